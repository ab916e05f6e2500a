"""`memlm generate`: continue one or more prompts through the decoding engine (memlm.engine).

    memlm generate --model M [--datastore DIR | --retrieval ADDR] [--lambda L --knn-temperature T --k K]
        [--memory none|xl|compressive|memorizing --segment S --mem-len M --sink-tokens N --cmem-len C --compress-rate R
         --knn-layer L --knn-mem-size M --knn-top-k K --knn-backend B --knn-service HOST:PORT] [--max-new-tokens N]
        [--sampling-temperature X --top-k K --top-p P --seed S] [--stop TEXT] [--json OUT]
        [--speculative [--draft-tokens N] [--draft-from datastore|history|both]] [--pointers [--min-pointers N] [--pointer-clusters C]]
        [--adaptive-gate DIR (--adaptive-threshold X | --adaptive-fraction F)] PROMPT...

All prompts run as one continuous batch (each its own request: its own sampler, seeded by --seed, so a
prompt yields the same tokens alone or among others). Prints each continuation and the tokens/s; --json
writes every token with its log-probabilities (final and base LM). kNN-LM needs a datastore (local,
searched in process) or a retrieval service; both are checked against the model (fingerprints, key
layer, boundary token) before generating. The option groups are memlm.cli.options' (kNN, memory); the
sampling group is defined here once. --speculative (memlm.engine.speculative) drafts
continuations from the --datastore's successors and verifies them in one forward pass: the same greedy
tokens, the same sampled distribution; with --lambda 0 the target is the base LM and the datastore only
drafts. Each result carries `searches` (kNN queries), `verify_steps`, `verified_tokens` (exact counts,
GenerationEnd's) and `mean_accepted_tokens`. --memory memorizing (Wu et al. 2022) takes a `memlm train
--memory memorizing` checkpoint's kNN attention (any other model: a fresh, untrained gate, said on stderr and
recorded) and keeps every prompt's kNN memory in process or, with --knn-backend service, in the memory
sessions of --knn-service (memlm.engine.memorizing_rows); --json records the layer, sizes, backend and gates.
Fewer searches (memlm eval's flags, memlm.cli.options.FEWER_SEARCHES_OPTIONS; memlm.engine.fewer_rows):
--pointers follows RetoMaton pointers along the generated tokens and searches only when fewer than
--min-pointers survive (through --retrieval, by the service's Successors rpc); --adaptive-gate skips the
search where the gate says retrieval will not help, the token then comes from the base LM. Each result
carries `searches` and `searches_saved`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError
from memlm.cli.eval import (
    add_knn_service_options,
    knn_attention_for,
    memory_service,
)
from memlm.files import check_writable_file
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.cli.link_options import add_link_security, link_tls, secret
from memlm.model.memory_config import MemoryConfig
from memlm.cli.options import (
    ACCEPT_WEIGHTS_OPTIONS,
    FEWER_SEARCHES_OPTIONS,
    KNN_OPTIONS,
    MEMORIZING_ONLY,
    MEMORY_OPTIONS,
    SEARCH_BACKEND_OPTIONS,
    WEIGHTS_OPTIONS,
    Option,
    add_options,
    given,
    knn_config,
    memory_config,
    model_format,
    positive_int,
    refuse_given,
)
from memlm.retrieval.searcher import DEFAULT_SEARCH_BACKEND

GENERATE_MEMORY = ("kind", "segment", "mem_len", "sink_tokens", "cmem_len", "compress_rate", "compress_fn",
                   *MEMORIZING_ONLY)
"""The memory options the engine serves (--memory none, xl, compressive (pooled) or memorizing, and their sizes)."""
GENERATE_KINDS = ("none", "xl", "compressive", "memorizing")
COMPRESSIVE_ONLY = ("cmem_len", "compress_rate", "compress_fn")
DEFAULT_MAX_NEW_TOKENS = 64
"""Tokens generated per prompt when --max-new-tokens is not given."""


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


_S = SamplingConfig()
SAMPLING_OPTIONS = {o.dest: o for o in (
    Option("--sampling-temperature", "sampling_temperature", non_negative_float, "sampling temperature; 0 = greedy",
           _S.temperature),
    Option("--top-k", "top_k", positive_int, "sample among the k most likely tokens only", "no limit"),
    Option("--top-p", "top_p", float, "nucleus sampling: the smallest set of tokens of total probability >= p",
           "1"),
    Option("--seed", "seed", int, "seed of every prompt's sampler (reproducible whatever the batch)", "random"),
)}


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    """SamplingConfig from the sampling options given (the rest: its defaults). --sampling-temperature's
    dest is prefixed: --knn-temperature's dest is "temperature"."""
    return SamplingConfig(**{dest.removeprefix("sampling_"): v for dest, v in given(args, SAMPLING_OPTIONS).items()})


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    """--speculative [--draft-tokens N] [--draft-from SOURCE] (the names the LM client shares; defaults:
    SpeculativeConfig's)."""
    from memlm.engine.drafts import DRAFT_FROM, SpeculativeConfig

    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", action="store_true",
                   help="draft continuations from the datastore (REST) and verify each in one forward pass: the "
                        "same greedy tokens, the same sampled distribution (needs --datastore), where the weight "
                        "format's kernels are batch-invariant; bfloat16's on the CPU are not for SmolLM2, whose "
                        "verified tokens may then part from plain decoding's (docs/decisions/weight-formats.md)")
    g.add_argument("--draft-tokens", type=positive_int, default=None,
                   help=f"most draft tokens verified per step (default {SpeculativeConfig.draft_tokens})")
    g.add_argument("--draft-from", choices=DRAFT_FROM, default=None,
                   help="where drafts come from: the datastore's successors, the text's own past (prompt lookup), "
                        f"or both (default {SpeculativeConfig.draft_from})")


def speculative_config(args: argparse.Namespace) -> Any:
    """SpeculativeConfig of --speculative (None without); refused in one line where it cannot run."""
    from memlm.engine.drafts import SpeculativeConfig

    if not args.speculative:
        for flag, value in (("--draft-tokens", args.draft_tokens), ("--draft-from", args.draft_from)):
            if value is not None:
                raise MemlmError(f"{flag} needs --speculative")
        return None
    if not args.datastore and args.draft_from != "history":
        raise MemlmError("--speculative drafts from a local --datastore (the retrieval service has no "
                         "successors lookup), or from the row's own text with --draft-from history")
    config = SpeculativeConfig()
    config = config if args.draft_tokens is None else dataclasses.replace(config, draft_tokens=args.draft_tokens)
    return config if args.draft_from is None else dataclasses.replace(config, draft_from=args.draft_from)


def add_generate_parser(sub: Any) -> None:
    from memlm.engine.decode_graphs import CUDA_GRAPHS_HELP
    from memlm.engine.requests import EngineConfig

    p = sub.add_parser("generate", help="continue prompts through the decoding engine (one continuous batch)")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt texts (one request each)")
    p.add_argument("--model", required=True, help="preset, .gguf file, HF or memlm checkpoint dir")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--max-new-tokens", type=positive_int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens generated per prompt (default {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--stop", action="append", default=None, help="stop sequence (repeat for several)")
    p.add_argument("--json", default=None, help="write tokens and log-probabilities as JSON to this path")
    add_options(p, "model", WEIGHTS_OPTIONS)
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-batch", type=positive_int, default=None,
                        help="rows decoded together (default: one per prompt)")
    engine.add_argument("--prefill-chunk", type=positive_int, default=None,
                        help=f"prompt tokens prefilled per step (default {EngineConfig.prefill_chunk})")
    engine.add_argument("--cuda-graphs", action="store_true", help=CUDA_GRAPHS_HELP)
    add_options(p, "sampling", SAMPLING_OPTIONS)
    add_options(p, "kNN-LM", KNN_OPTIONS)
    knn = p.add_argument_group("kNN-LM datastore")
    knn.add_argument("--datastore", default=None, help="datastore directory (searched in this process)")
    knn.add_argument("--retrieval", default=None, help="HOST:PORT of a retrieval service or router")
    knn.add_argument("--interpolation", default=None, metavar="PATH",
                     help="mix as this file of `memlm eval --lambda auto --save-interpolation` says (its k and "
                          "learned weights; not a +cache method); refused when fitted with another model or datastore")
    SEARCH_BACKEND_OPTIONS["search_backend"].add_to(knn, None)
    ACCEPT_WEIGHTS_OPTIONS["accept_weights_mismatch"].add_to(knn, None)
    add_link_security(p, "retrieval-", "retrieval service", "MEMLM_RETRIEVAL_TOKEN")
    add_options(p, "memory", MEMORY_OPTIONS, GENERATE_MEMORY, choices={"kind": GENERATE_KINDS})
    add_knn_service_options(p)
    add_speculative_options(p)
    add_options(p, "fewer kNN-LM searches", FEWER_SEARCHES_OPTIONS)
    p.set_defaults(func=cmd_generate)


def memory_from(args: argparse.Namespace) -> MemoryConfig | None:
    """--memory xl, compressive or memorizing and its sizes (MemoryConfig's defaults for the rest); None: the plain KV
    cache."""
    if args.kind in (None, "none"):
        refuse_given(args, GENERATE_MEMORY[1:], "needs --memory xl, compressive or memorizing")
        return None
    if args.kind in ("xl", "memorizing"):
        refuse_given(args, COMPRESSIVE_ONLY, "needs --memory compressive")
    return memory_config(args, MemoryConfig())


def checkpoint_memorizing(args: argparse.Namespace, memory: MemoryConfig, boundary: int) -> MemoryConfig:
    """--memory memorizing over a `memlm train --memory memorizing` checkpoint: the memory its settings.json
    records (its layer above all), as memlm eval takes it (eval_command.checkpoint_memory: an unset flag takes the
    checkpoint's, a different one is refused; the kNN sizes and backend are free). Other models: `memory`."""
    from memlm.cli.eval import checkpoint_memory, checkpoint_settings

    if memory.kind != "memorizing" or not Path(args.model).is_dir():
        return memory
    settings = checkpoint_settings(args.model, boundary)
    if settings is None or settings.memory.kind != "memorizing":
        return memory
    return MemoryConfig(**checkpoint_memory(args, given(args, MEMORY_OPTIONS), settings.memory))


def open_searcher(args: argparse.Namespace, pretrained: Any) -> Any:
    """The datastore or retrieval link of --datastore / --retrieval, checked against the model; None without."""
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weight_formats import format_of
    from memlm.retrieval.compat import check_searcher

    if args.datastore and args.retrieval:
        raise MemlmError("give --datastore DIR or --retrieval HOST:PORT, not both")
    if not args.datastore:
        refuse_given(args, SEARCH_BACKEND_OPTIONS, "needs --datastore (a retrieval service searches its own way)")
    if args.datastore:
        from datastore import Datastore

        searcher = Datastore.open(Path(args.datastore), backend=args.search_backend or DEFAULT_SEARCH_BACKEND,
                                  device=str(pretrained.model.device))
    elif args.retrieval:
        from services.retrieval.client import RetrievalClient

        searcher = RetrievalClient(args.retrieval, tls=link_tls(args, "retrieval-"),
                                   token=secret(args, "retrieval-", "MEMLM_RETRIEVAL_TOKEN"))
    else:
        refuse_given(args, KNN_OPTIONS, "needs --datastore or --retrieval")
        return None
    model, tokenizer = pretrained.model, pretrained.tokenizer
    check_searcher(searcher.info(), model_fingerprint=pretrained.fingerprint,
                   tokenizer_fingerprint=tokenizer.fingerprint, dim=model.config.n_embd,
                   key_layer=model.config.key_description, boundary_token=document_boundary(tokenizer),
                   weights=format_of(model), accept_weights_mismatch=bool(args.accept_weights_mismatch))
    return searcher


def fewer_for(args: argparse.Namespace, searcher: Any, pretrained: Any) -> tuple[Any, dict[str, Any], Any]:
    """The Retrieval of the fewer-searches flags over `searcher` (None without kNN-LM), its record
    (memlm.cli.fewer_searches.generation_fewer) and the engine's searcher: through --retrieval with
    --pointers, one services.retrieval.walk.OneGeneration answers the searches and the Successors lookups,
    all held to one datastore generation (a change mid-run is refused); else `searcher`."""
    from memlm.cli.fewer_searches import generation_fewer
    from memlm.retrieval.pointers import PointerSource

    remote = None
    if args.retrieval and args.pointers:
        from services.retrieval.walk import OneGeneration

        remote = PointerSource(OneGeneration(searcher, searcher), None)
    retrieval, record = generation_fewer(args, searcher, pretrained.fingerprint, pretrained.model.config.key_description,
                                         remote)
    return retrieval, record, searcher if remote is None else remote.successors


def interpolation_knn(args: argparse.Namespace, knn: Any, pretrained: Any, searcher: Any) -> Any:
    """knn with --interpolation's saved method in force (memlm.retrieval.interpolation.served_knn, checked against
    the model and the datastore); a method that mixes the document cache is refused (Score keeps it, not generation)."""
    from memlm.retrieval.interpolation import served_knn

    knn = served_knn(knn, Path(args.interpolation), model_fingerprint=pretrained.fingerprint,
                     key_layer=pretrained.model.config.key_description,
                     corpus_fingerprint=searcher.info().corpus_fingerprint)
    if knn.interpolation is not None and knn.interpolation.has_cache:
        raise MemlmError(f"--interpolation {args.interpolation}: the {knn.interpolation.method.method} method mixes a "
                         "document cache, which generation does not keep; serve it for Score (`memlm serve lm`)")
    return knn


def cmd_generate(args: argparse.Namespace) -> None:
    from memlm.engine.drafts import draft_source
    from memlm.engine.engine import Engine, run_all
    from memlm.engine.requests import EngineConfig, GenerationRequest
    from memlm.jobs.evaluate import write_json
    from memlm.jobs.memorizing import memorizing_record
    from memlm.model.device import resolve_device
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained

    if args.json:
        check_writable_file(args.json, "--json")
    memory = memory_from(args)
    sampling = sampling_config(args)
    knn = knn_config(args) if (args.datastore or args.retrieval) else None
    if args.interpolation is not None:
        if knn is None:
            raise MemlmError("--interpolation needs --datastore or --retrieval: it mixes the datastore's neighbours")
        refuse_given(args, ("k", "lmbda", "temperature"), "is the --interpolation file's")
    speculative = speculative_config(args)
    if speculative is not None and knn is not None and knn.lmbda == 0:
        knn = None  # lambda 0 is the base LM exactly (memlm.retrieval.knnlm.interpolate): the datastore only drafts
    service = memory_service(args, memory or MemoryConfig("none"))  # --knn-backend service: its memory sessions
    device = resolve_device(args.device)
    fmt = model_format(args, device, None if args.retrieval else args.datastore)  # both: refused by open_searcher
    pretrained = load_pretrained(args.model, device=device, dtype=fmt.dtype, weights=fmt.weights,
                                 allow_pickle=bool(args.allow_pickle_weights))
    searcher = open_searcher(args, pretrained)
    if args.interpolation is not None:
        knn = interpolation_knn(args, knn, pretrained, searcher)
    tokenizer = pretrained.tokenizer
    boundary = document_boundary(tokenizer)
    fewer, fewer_record, engine_searcher = fewer_for(args, searcher if knn is not None else None, pretrained)
    memory = checkpoint_memorizing(args, memory, boundary) if memory is not None else None
    knn_attention, trained = knn_attention_for(args.model, pretrained.model, memory or MemoryConfig("none"))
    config = EngineConfig(max_batch=args.max_batch or len(args.prompts), memory=memory, cuda_graphs=args.cuda_graphs)
    if args.prefill_chunk is not None:
        config = dataclasses.replace(config, prefill_chunk=args.prefill_chunk)
    requests = [GenerationRequest(tuple(tokenizer.encode(p)), args.max_new_tokens, sampling, tuple(args.stop or ()),
                                  boundary, tokenizer.eos_id, knn=knn, speculative=speculative, fewer=fewer)
                for p in args.prompts]
    start = time.perf_counter()
    try:
        # A transformers model has no row cache: the engine runs each of its rows with the row's own forward.
        uses_datastore = speculative is not None and speculative.uses_datastore  # history drafts read none
        drafts = draft_source(searcher.provenance, searcher.values) if uses_datastore else None
        engine = Engine(pretrained.model, tokenizer, config, engine_searcher or searcher, drafts,
                        knn_attention=knn_attention, knn_service=service)
        results = run_all(engine, requests)
    finally:
        if args.retrieval:
            searcher.close()  # the RetrievalClient's channel
        if service is not None:
            service.close()  # the memory service's channel (every row dropped its session when it ended)
    seconds = time.perf_counter() - start
    report = generation_report(args, results, seconds, speculative)
    report["settings"]["fewer_searches"] = fewer_record
    if memory is not None and memory.kind == "memorizing":
        report["settings"]["memorizing"] = memorizing_record(memory, pretrained.model.config.n_layer, knn_attention,
                                                             trained)
    for i, r in enumerate(report["results"]):
        print(f"--- [{i}] {r['finish_reason']}, {r['completion_tokens']} tokens")
        print(r["prompt"] + r["text"])
    print(f"{report['completion_tokens']} tokens in {seconds:.2f} s: {report['tokens_per_s']:.1f} tokens/s "
          f"({len(requests)} prompts, batch {config.max_batch})")
    if args.json:
        write_json(report, args.json)


def generation_report(args: argparse.Namespace, results: list[list[Any]], seconds: float,
                      speculative: Any) -> dict[str, Any]:
    """What --json writes: every prompt's tokens, texts and log-probs (nats), and the run's settings;
    speculative: the SpeculativeConfig that ran (None without --speculative), recorded field by field."""
    out = []
    for prompt, events in zip(args.prompts, results):
        toks = [e for e in events if isinstance(e, TokenEvent)]
        end = events[-1]
        out.append({
            "prompt": prompt, "text": "".join(e.text_delta for e in events),
            "tokens": [e.token_id for e in toks], "token_texts": [e.text for e in toks],
            "logprobs": [e.logprob for e in toks], "base_logprobs": [e.base_logprob for e in toks],
            "finish_reason": end.reason, "stop_sequence": end.stop_sequence,
            "prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "searches": end.searches, "searches_saved": end.searches_saved, "mean_accepted_tokens": end.mean_accepted_tokens,
            "verify_steps": end.verify_steps, "verified_tokens": end.verified_tokens,
        })
    total = sum(r["completion_tokens"] for r in out)
    return {
        "model": args.model, "results": out, "completion_tokens": total, "seconds": seconds,
        "tokens_per_s": total / seconds if seconds > 0 else 0.0,
        "searches": sum(r["searches"] for r in out),
        "searches_saved": sum(r["searches_saved"] for r in out),
        "mean_accepted_tokens": mean_accepted(out),
        "settings": {"max_new_tokens": args.max_new_tokens, "stop": args.stop or [],
                     **{k: getattr(args, k) for k in (*SAMPLING_OPTIONS, *KNN_OPTIONS, *GENERATE_MEMORY)},
                     "datastore": args.datastore, "retrieval": args.retrieval, "interpolation": args.interpolation,
                     "speculative": dataclasses.asdict(speculative) if speculative is not None else None},
    }


def mean_accepted(results: list[dict[str, Any]]) -> float | None:
    """Completion tokens per verifying forward pass over all prompts, from their exact counts
    (GenerationEnd.verify_steps, verified_tokens); None without a verifying pass (without --speculative)."""
    passes = sum(r["verify_steps"] for r in results)
    return sum(r["verified_tokens"] for r in results) / passes if passes else None
