"""The command-line side of SPALM: `memlm eval --memory spalm --datastore DIR` and the settings
`memlm train --memory spalm` takes.

Settings follow the one rule of memlm.retrieval.compat: a SPALM checkpoint's memory (segment, memory
size, sinks) is taken when left unset and refused when given differently; the datastore must fit the
model through `check_searcher`, with the fingerprint of the model whose keys the head was trained
against (training changes the decoder's own fingerprint, the datastore's keys stay fixed). Flags that
do not apply (windows, other memories' options) are refused in one line.

SPALM + kNN-LM (the issue's "SPALM and SPALM + kNN-LM interpolation, side by side"): --lambda,
--knn-temperature (numbers, or auto: tuned on --tune-data by kNN-LM's grid search, the overlap with the
evaluation documents refused as for kNN-LM) and --knn-k (kNN-LM's neighbours; --k stays SPALM's) turn on
p = (1 - lambda) p_SPALM + lambda p_kNN over the same search (memlm.jobs.spalm.evaluate_spalm).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SPALM_DEFAULT_K
from memlm.cli.options import (
    KNN_OPTIONS,
    MEMORIZING_ONLY,
    MEMORY_OPTIONS,
    WINDOW_OPTIONS,
    given,
    refuse_given,
)
from memlm.retrieval.searcher import DEFAULT_SEARCH_BACKEND

SPALM_MEMORY = ("kind", "segment", "mem_len", "sink_tokens")
"""The memory options of SPALM (its short-term memory is the XL memory)."""
SPALM_KNN = ("k", "nprobe", "exact_rerank", "lmbda", "temperature")
"""The kNN options SPALM takes: neighbours per token, how the datastore is searched, and kNN-LM's mixture."""
INTERPOLATION = ("lmbda", "temperature")
"""Either given: SPALM + kNN-LM (the other, and --knn-k, take KNNLMConfig's defaults)."""


def add_spalm_eval_options(parser: argparse.ArgumentParser) -> None:
    """`memlm eval`'s SPALM-only flag: kNN-LM's neighbours in SPALM + kNN-LM (--k is SPALM's there)."""
    from memlm.cli.options import neighbours
    from memlm.retrieval.knnlm import KNNLMConfig

    group = parser.add_argument_group("SPALM + kNN-LM (--memory spalm with --lambda / --knn-temperature)")
    group.add_argument("--knn-k", type=neighbours, default=None, metavar="K",
                       help=f"kNN-LM's neighbours, read from SPALM's one search of max(--k, K) (default {KNNLMConfig().k})")


def spalm_knn_config(args: argparse.Namespace) -> Any:
    """The KNNLMConfig of SPALM + kNN-LM (k: --knn-k), or None when none of INTERPOLATION is given."""
    from memlm.cli.options import knn_config
    from memlm.retrieval.knnlm import KNNLMConfig

    if all(getattr(args, d, None) is None for d in INTERPOLATION):
        return None
    knn = knn_config(args, allow_auto=True)  # its k is SPALM's --k: replaced by kNN-LM's own
    return dataclasses.replace(knn, k=args.knn_k if args.knn_k is not None else KNNLMConfig().k)


def wants_spalm(args: argparse.Namespace, settings: Any) -> bool:
    """--memory spalm, or a SPALM checkpoint (settings.json) evaluated with --memory unset."""
    if args.kind == "spalm":
        return True
    return args.kind is None and settings is not None and settings.memory.kind == "spalm"


def spalm_memory_config(args: argparse.Namespace, settings: Any) -> MemoryConfig:
    """The XL part of a SPALM run from the flags; a SPALM checkpoint's recorded values where unset."""
    from memlm.retrieval.compat import adopt, say_taken

    refuse_given(args, [d for d in MEMORY_OPTIONS if d not in SPALM_MEMORY], "applies to other memories, not --memory spalm")
    mem = given(args, MEMORY_OPTIONS)
    values: dict[str, Any] = {"kind": "spalm"}
    if settings is not None and settings.memory.kind == "spalm":
        taken: list[str] = []
        artifact = f"checkpoint {args.model}"
        for dest in SPALM_MEMORY[1:]:
            values[dest] = adopt(MEMORY_OPTIONS[dest].flag, mem.get(dest), getattr(settings.memory, dest), artifact, taken)
        say_taken(taken, artifact)
    else:
        values.update({d: mem[d] for d in SPALM_MEMORY[1:] if d in mem})
    try:
        return MemoryConfig(**values)
    except ValueError as e:
        raise MemlmError(str(e)) from None


def spalm_k(args: argparse.Namespace) -> int:
    """--k, or SPALM_DEFAULT_K."""
    return args.k if args.k is not None else SPALM_DEFAULT_K


def spalm_head_for(model_arg: str, model: Any, fingerprint: str) -> tuple[Any, str, bool]:
    """(head, fingerprint of the keys' model, trained): a `memlm train --memory spalm` checkpoint's
    spalm_head.pt, else a fresh head (gate near 1: the base model), said on stderr and recorded."""
    from memlm.memory.spalm import SpalmHead, load_spalm_head

    saved = load_spalm_head(model_arg, model.device) if Path(model_arg).is_dir() else None
    if saved is not None:
        head, keys_fingerprint = saved
        try:
            head.check_model(model.config.n_embd)
        except ValueError as e:
            raise MemlmError(f"{model_arg}: {e}") from None
        return head, keys_fingerprint, True
    print(f"{model_arg} has no trained SPALM head (memlm train --memory spalm): a fresh gate is used, untrained "
          "(recorded as head_trained false)", file=sys.stderr)
    return SpalmHead(model.config.n_embd).to(model.device), fingerprint, False


def open_spalm_datastore(directory: str, pretrained: Any, keys_fingerprint: str, boundary: int,
                         search_backend: str | None) -> Any:
    """The datastore, checked against the model (compat.check_searcher: the keys' model fingerprint, the
    tokenizer, the key layer and width, the boundary token; no windows: SPALM runs segment by segment)."""
    from datastore import Datastore
    from memlm.model.weight_formats import format_of
    from memlm.retrieval.compat import check_searcher

    model = pretrained.model
    store = Datastore.open(Path(directory), backend=search_backend or DEFAULT_SEARCH_BACKEND, device=str(model.device))
    check_searcher(store.info(), model_fingerprint=keys_fingerprint, tokenizer_fingerprint=pretrained.tokenizer.fingerprint,
                   dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=boundary,
                   weights=format_of(model))
    return store


def refuse_non_spalm_eval_flags(args: argparse.Namespace) -> None:
    """The eval flags that do not apply to SPALM, one line each; --datastore is required."""
    if args.datastore is None:
        raise MemlmError("--memory spalm needs --datastore DIR (its long-term memory)")
    refuse_given(args, WINDOW_OPTIONS, "does not apply with --memory spalm (it runs segment by segment: --segment)")
    refuse_given(args, [d for d in KNN_OPTIONS if d not in SPALM_KNN], "does not apply with --memory spalm")
    refuse_given(args, ("continuous_cache", *MEMORIZING_ONLY), "does not apply with --memory spalm")
    if spalm_knn_config(args) is None:
        refuse_given(args, ("knn_k",), "is kNN-LM's in SPALM + kNN-LM: give --lambda (and --knn-temperature)")
        refuse_given(args, ("tune_data",), "tunes SPALM + kNN-LM: give --lambda auto or --knn-temperature auto")


def run_spalm_eval(args: argparse.Namespace, pretrained: Any, evaluation: Any, boundary: int, settings: Any,
                   tuning_tokens: Callable[[argparse.Namespace, Any, Any], tuple[Any, dict]]) -> dict:
    """`memlm eval --memory spalm --datastore DIR [--k K]` (+ kNN-LM: [--lambda L] [--knn-temperature T]
    [--knn-k K'] [--tune-data ...]): memlm.jobs.spalm.evaluate_spalm with the XL memory of the flags (or the
    checkpoint's) and the checkpoint's head (or a fresh one). tuning_tokens: memlm.cli.eval's (the tuning
    documents, refused where they overlap the evaluation's), called once the flags are checked."""
    from memlm.jobs.spalm import (
        datastore_token_counts,
        evaluate_spalm,
        require_tuning_docs,
    )
    from memlm.cli.options import knn_config

    refuse_non_spalm_eval_flags(args)
    knn = spalm_knn_config(args)
    tune_docs, tune_record = tuning_tokens(args, pretrained.tokenizer, evaluation)
    require_tuning_docs(knn, tune_docs)
    memory = spalm_memory_config(args, settings)
    model = pretrained.model
    head, keys_fingerprint, trained = spalm_head_for(args.model, model, pretrained.fingerprint)
    store = open_spalm_datastore(args.datastore, pretrained, keys_fingerprint, boundary, args.search_backend)
    options = knn_config(args, allow_auto=True).search_options  # lambda and T are spalm_knn_config's
    result = evaluate_spalm(model, head, evaluation.token_docs, memory, store, spalm_k(args), boundary_token=boundary,
                            token_counts=datastore_token_counts(store, model.config.vocab_size),
                            batch_size=args.batch_size, options=options, head_trained=trained, knn=knn,
                            tune_docs=tune_docs)
    info = store.info()
    return {**result, **tune_record, "index": info.index, "datastore_size": info.n, "nprobe": options.nprobe,
            "exact_rerank": options.exact_rerank}
