"""The memlm command line: one table from subcommand to a typed function.

Option groups (kNN-LM, memory, windows) are defined once in memlm.cli.options; `memlm eval` lives in
memlm.cli.eval. The library modules never import `datastore` or `services`; this file wires them together.
User errors (MemlmError) print one line and exit 1, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from memlm.cli.datastore import add_datastore_parser
from memlm.cli.threads import add_threads_option, apply_threads
from memlm.errors import MemlmError
from memlm.cli.link_options import add_link_security, add_token_options, link_tls, secret
from memlm.cli.eval import add_eval_parser
from memlm.cli.gate import add_train_gate_parser
from memlm.cli.generate import add_generate_parser, add_speculative_options
from memlm.model.memory_config import MemoryConfig
from memlm.model.cpu_gemm import CPU_GEMM_NAMES, DEFAULT_CPU_GEMM, cpu_gemm_as
from memlm.cli.options import (
    ACCEPT_WEIGHTS_OPTIONS,
    FEWER_SEARCHES_OPTIONS,
    KNN_OPTIONS,
    MEMORY_OPTIONS,
    SEARCH_BACKEND_OPTIONS,
    WEIGHTS_OPTIONS,
    WINDOW_OPTIONS,
    add_options,
    flag,
    given,
    knn_config,
    memory_config,
    model_format,
    port_number,
    positive_int,
    refuse_given,
)
from memlm.cli.metrics_options import add_metrics_options, metrics_options
from memlm.cli.plan import add_plan_parser
from memlm.cli.serve_openai import add_openai_parser
from memlm.retrieval.searcher import DEFAULT_SEARCH_BACKEND, SEARCH_BACKENDS
from memlm.cli.train import add_train_parser

SERVE_MEMORY = ("segment", "mem_len", "sink_tokens")
"""The memory options a LanguageModelService request carries (MemoryOptions), for `serve lm` and `client`."""
CLIENT_KNN_MEMORY = ("knn_mem_size", "knn_top_k")
"""The memorizing options a request carries (MemoryOptions; the layer is the server's checkpoint's)."""
CLIENT_KNN = ("k", "lmbda", "temperature", "nprobe")
"""The kNN options a request carries (KnnRequest; exact re-rank is the server's setting)."""
CLIENT_FEWER = ("pointers", "min_pointers", "adaptive_threshold", "adaptive_fraction")
"""The fewer-searches options a Score request carries (the gate is the server's --adaptive-gate)."""

# ---------------------------------------------------------------------------------------------------
# fetch


def cmd_fetch(name: str) -> None:
    """Fetch a model or corpus into the cache and print the local path."""
    from memlm.data.corpora import fetch_corpus
    from memlm.model.weights import fetch_model, fetch_name

    if name in MODEL_NAMES:
        path = fetch_model(fetch_name(name))
    elif name in CORPUS_NAMES:
        path = fetch_corpus(name)
    else:
        raise MemlmError(f"unknown name {name!r}; fetchable: {', '.join(MODEL_NAMES + CORPUS_NAMES)}")
    print(path)


MODEL_NAMES = ["smollm2-135m-instruct-q4_1", "smollm2-135m"]  # memlm.model.config: the preset and its alias
CORPUS_NAMES = ["sotu", "wiki-summaries", "shakespeare"]  # memlm.data.corpora.CORPORA (tests/memlm/data/test_long_documents.py checks)

# ---------------------------------------------------------------------------------------------------
# serve and client


def token_from(args: argparse.Namespace) -> str | None:
    """The token this server wants or this client sends: --token, --token-file, else $MEMLM_TOKEN."""
    return secret(args, "", "MEMLM_TOKEN")


def auth_file_from(args: argparse.Namespace) -> Path | None:
    """--auth-file, read once here so that a bad file stops the command before anything loads; None without it."""
    from services.common.tenants import AuthFileError, TenantTable

    if args.auth_file is None:
        return None
    if args.token is not None or args.token_file is not None:
        raise MemlmError("give --auth-file or --token/--token-file, not both")
    try:
        TenantTable.read(args.auth_file)
    except AuthFileError as e:
        raise MemlmError(str(e)) from None
    return Path(args.auth_file)


def server_tls(args: argparse.Namespace) -> Any:
    from services.common.security import ServerTls

    if bool(args.tls_cert) != bool(args.tls_key):
        raise MemlmError("--tls-cert and --tls-key go together")
    if not args.tls_cert:
        if args.tls_client_ca:
            raise MemlmError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    return ServerTls.from_files(args.tls_cert, args.tls_key, args.tls_client_ca)


def server_options(args: argparse.Namespace) -> Any:
    """ServerOptions of every `memlm serve` command: TLS, token, the two call budgets, metrics and call log."""
    from services.common.server import ServerOptions

    tls, auth_file = server_tls(args), auth_file_from(args)
    token = token_from(args) if auth_file is None else None  # $MEMLM_TOKEN gives way to an auth file
    metrics = metrics_options(args)
    try:
        return ServerOptions(tls=tls, token=token, auth_file=auth_file, max_concurrent_rpcs=args.max_concurrent_rpcs,
                             max_open_rpcs=args.max_open_rpcs, grace_s=args.grace, metrics=metrics)
    except ValueError as e:  # a budget below 1
        raise MemlmError(f"--{str(e).replace('_', '-')}") from None


def cmd_serve_retrieval(args: argparse.Namespace) -> None:
    from services.retrieval.memory_sessions import memory_options_from_args
    from services.retrieval.server import BatchingOptions, GenerationWatch, serve_retrieval

    try:
        memories = memory_options_from_args(args)
    except ValueError as e:
        raise MemlmError(f"serve retrieval: {e}") from None
    if args.datastore is None and memories is None:
        raise MemlmError("serve retrieval needs --datastore DIR, --memories (session memories), or both")
    store = watch = successors = None
    if args.datastore is not None:  # served generation by generation (add/remove/compact while serving)
        from datastore.live import LiveDatastore, OpenOptions
        from services.retrieval.successors import successors_by_generation

        store = LiveDatastore(Path(args.datastore), OpenOptions(mmap=args.mmap, backend=args.search_backend,
                                                                device=None if args.device == "auto" else args.device))
        watch = GenerationWatch(store.refresh, store.served)
        successors = successors_by_generation(store.served)  # the Successors rpc (remote pointers)
    asyncio.run(serve_retrieval(
        store, args.host, args.port,
        options=server_options(args),
        batching=BatchingOptions(micro_batching=not args.no_micro_batching),
        memories=memories, watch=watch, successors=successors,
    ))


def cmd_serve_router(args: argparse.Namespace) -> None:
    from services.router.server import ShardLinks, serve_router

    shards = ShardLinks(tls=link_tls(args, "shard-"), token=secret(args, "shard-", "MEMLM_SHARD_TOKEN"))
    if args.hedge_after is not None:  # unset: ShardLinks' default; 0: fail over only on failure
        shards = dataclasses.replace(shards, hedge_after_s=args.hedge_after or None)
    asyncio.run(serve_router(
        args.shard, args.host, args.port, shards=shards,
        options=server_options(args),
    ))


def serve_memory_defaults(args: argparse.Namespace) -> MemoryConfig:
    """Segment, memory length and sink tokens of requests that leave them unset: the flags, else a `memlm
    train` checkpoint's settings (one line says so), else MemoryConfig's defaults."""
    from memlm.cli.eval import checkpoint_settings
    from memlm.model.tokenizer import Tokenizer, document_boundary
    from memlm.retrieval.compat import adopt, say_taken

    settings = None
    if Path(args.model).is_dir() and (Path(args.model) / "tokenizer.json").is_file():
        settings = checkpoint_settings(args.model, document_boundary(Tokenizer.from_dir(Path(args.model))))
    if settings is None:
        return memory_config(args, MemoryConfig())
    taken: list[str] = []
    values = {d: adopt(flag(d), getattr(args, d), getattr(settings.memory, d), f"checkpoint {args.model}", taken)
              for d in SERVE_MEMORY}
    say_taken(taken, f"checkpoint {args.model}")
    if settings.memory.kind == "memorizing" and args.knn_backend is not None:  # free, as in eval (EVAL_TIME_KNN)
        values["knn_backend"] = args.knn_backend
    return dataclasses.replace(settings.memory, **values)


def serve_knn_service(args: argparse.Namespace, memory: MemoryConfig) -> Any:
    """The memory sessions (services.retrieval.memory_client.MemoryClient) that hold MEMORIZING memories when the
    kNN backend (--knn-backend, else the checkpoint's settings) is "service": --knn-service and its TLS and
    token flags, as `memlm eval` takes them (eval_command.memory_service); None for in-process memories."""
    from memlm.cli.eval import KNN_SERVICE_FLAGS, memory_service
    from memlm.model.memory_config import resolve_knn_backend

    if memory.kind != "memorizing" or resolve_knn_backend(memory) != "service":
        refuse_given(args, KNN_SERVICE_FLAGS, "needs a memorizing checkpoint served with --knn-backend service")
        return None
    return memory_service(args, memory)


def cmd_serve_lm(args: argparse.Namespace) -> None:
    from memlm.model.device import resolve_device
    from services.lm.server import LMLimits, serve_lm

    if args.datastore and args.retrieval:
        raise MemlmError("give --datastore DIR or --retrieval HOST:PORT, not both")
    if not (args.datastore or args.retrieval):
        refuse_given(args, KNN_OPTIONS, "needs --datastore or --retrieval (the server has no kNN-LM without one)")
    if not args.datastore:
        refuse_given(args, SEARCH_BACKEND_OPTIONS, "needs --datastore (a retrieval service searches its own way)")
    if args.interpolation is not None:
        refuse_given(args, ("k", "lmbda", "temperature"), "is the --interpolation file's (what it was fitted with)")
    device = resolve_device(args.device)
    fmt = model_format(args, device)
    memory = serve_memory_defaults(args)
    knn_service = serve_knn_service(args, memory)
    asyncio.run(serve_lm(
        args.model, datastore=args.datastore, retrieval=args.retrieval, host=args.host, port=args.port,
        device=device, dtype=fmt.dtype, weights=fmt.weights, knn_defaults=knn_config(args),
        options=server_options(args),
        limits=LMLimits(max_new_tokens=args.max_new_tokens, max_score_tokens=args.max_score_tokens,
                        segment_tokens=memory.segment, memory_tokens=memory.mem_len, sink_tokens=memory.sink_tokens,
                        max_forward_tokens=args.max_forward_tokens, max_score_entries=args.max_score_entries,
                        max_text_chars=args.max_text_chars, max_step_tokens=args.max_step_tokens,
                        knn_layer=memory.knn_layer, knn_mem_size=memory.knn_mem_size, knn_top_k=memory.knn_top_k,
                        knn_backend=memory.knn_backend, max_batch=args.max_batch, max_queue=args.max_queue,
                        max_kv_bytes=args.max_kv_bytes, cuda_graphs=args.cuda_graphs),
        retrieval_tls=link_tls(args, "retrieval-"),
        retrieval_token=secret(args, "retrieval-", "MEMLM_RETRIEVAL_TOKEN"), key_module=args.key_module,
        knn_service=knn_service, adaptive_gate=args.adaptive_gate,
        search_backend=args.search_backend or DEFAULT_SEARCH_BACKEND,
        accept_weights_mismatch=bool(args.accept_weights_mismatch),
        allow_pickle_weights=bool(args.allow_pickle_weights),
        interpolation=Path(args.interpolation) if args.interpolation is not None else None,
    ))


def knn_request(args: argparse.Namespace) -> Any:
    """The request's kNN-LM options (None fields: the server's defaults); kNN flags without --knn are refused."""
    from services.lm.client import KnnRequest

    if args.kind == "spalm":  # --k and --nprobe set SPALM's own search (memory_request)
        if args.knn:
            raise MemlmError("--knn does not combine with --memory spalm (it mixes by its learned gate)")
        refuse_given(args, ("lmbda", "temperature"), "is kNN-LM's interpolation; --memory spalm mixes by its gate")
        refuse_given(args, ("attribution",), "is kNN-LM's (its neighbours' documents); --memory spalm mixes by its gate")
        return None
    if not args.knn:
        refuse_given(args, (*CLIENT_KNN, "attribution"), "needs --knn")
        return None
    values = given(args, KNN_OPTIONS)
    if "auto" in (values.get("lmbda"), values.get("temperature")):
        raise MemlmError("auto is tuned by `memlm eval --tune-data` only; give a number")
    return KnnRequest(**values, attribution_top_n=args.attribution or 0)


def memory_request(args: argparse.Namespace) -> dict[str, Any]:
    """memory_mode= and memory= keyword arguments of the client calls (server defaults when unset)."""
    from services.lm.client import MemoryRequest, SpalmRequest

    if args.kind in (None, "none"):
        refuse_given(args, SERVE_MEMORY + CLIENT_KNN_MEMORY, "needs --memory xl, memorizing or spalm")
        return {}
    if args.kind != "memorizing":
        refuse_given(args, CLIENT_KNN_MEMORY, "needs --memory memorizing")
    spalm = {"spalm": SpalmRequest(k=args.k, nprobe=args.nprobe)} if args.kind == "spalm" else {}
    return {"memory_mode": args.kind, **spalm,
            "memory": MemoryRequest(segment_tokens=args.segment, memory_tokens=args.mem_len, sink_tokens=args.sink_tokens,
                                    knn_mem_size=args.knn_mem_size, knn_top_k=args.knn_top_k)}


def knn_with_fewer(args: argparse.Namespace):
    """The call's KnnRequest with the fewer-searches flags it was given (Score and Generate alike)."""
    import dataclasses

    knn, fewer = knn_request(args), given(args, {n: FEWER_SEARCHES_OPTIONS[n] for n in CLIENT_FEWER})
    if knn is None and fewer:
        raise MemlmError("--pointers, --min-pointers and --adaptive-* need --knn")
    return knn and dataclasses.replace(knn, **fewer)


def cmd_client_score(args: argparse.Namespace) -> None:
    from services.lm.client import main_score

    main_score(
        args.address, args.text, contexts=args.prefix or None, knn=knn_with_fewer(args), top_n=args.top_n,
        window_tokens=args.context, stride_tokens=args.stride, per_token=args.per_token,
        tls=link_tls(args, ""), token=token_from(args), timeout=args.timeout, **memory_request(args),
    )


def cmd_client_generate(args: argparse.Namespace) -> None:
    from services.lm.client import main_generate

    main_generate(
        args.address, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.sampling_temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or (), knn=knn_with_fewer(args),
        speculative=args.speculative, draft_tokens=args.draft_tokens, draft_from=args.draft_from,
        tls=link_tls(args, ""), token=token_from(args), timeout=args.timeout, **memory_request(args),
    )


# ---------------------------------------------------------------------------------------------------
# argument parsing


def add_server_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=port_number, default=0, help="port (0: any free port; the chosen one is printed)")
    p.add_argument("--tls-cert", default=None, help="server certificate chain (PEM) to serve TLS")
    p.add_argument("--tls-key", default=None, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", default=None, help="CA (PEM) that client certificates must chain to (mTLS)")
    add_token_options(p, "", "callers must send", "MEMLM_TOKEN")
    p.add_argument("--auth-file", default=None, metavar="PATH",
                   help="TOML file of [[tenant]] tables (name, token_sha256, rpcs, quotas) instead of one token; "
                        "re-read on SIGHUP")
    from services.common.server import ServerOptions  # the one home of the budgets' defaults

    p.add_argument("--max-concurrent-rpcs", type=int, default=ServerOptions.max_concurrent_rpcs,
                   help="token holders' calls at once; RESOURCE_EXHAUSTED past it (health checks and callers "
                   "without the token never take these slots)")
    p.add_argument("--max-open-rpcs", type=int, default=ServerOptions.max_open_rpcs,
                   help="health Watch streams at once, and apart from them health Checks and refused calls at once")
    p.add_argument("--grace", type=grace_seconds, default=ServerOptions.grace_s, metavar="SECONDS",
                   help="on SIGTERM/SIGINT: refuse new calls, let in-flight ones finish for this long, then cancel them")
    add_metrics_options(p)


def grace_seconds(text: str) -> float:
    """--grace: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run a gRPC server (prints the address it listens on)")
    ssub = p.add_subparsers(dest="serve_command", required=True, metavar="SERVER")
    r = ssub.add_parser("retrieval", help="RetrievalService over a datastore, and/or session memories (--memories)")
    r.add_argument("--datastore", default=None, help="datastore directory (may be left out with --memories)")
    r.add_argument("--mmap", action="store_true", help="memory-map the index instead of loading it")
    r.add_argument("--no-micro-batching", action="store_true", help="one FAISS search per call")
    r.add_argument("--search-backend", default=DEFAULT_SEARCH_BACKEND, choices=SEARCH_BACKENDS,
                   help="faiss index, or exact torch search over the keys on --device")
    r.add_argument("--device", default="auto", help="auto, cpu or cuda: where the search runs")
    # services.retrieval.memory_sessions is the one home of the session limits' defaults.
    from services.retrieval.memory_sessions import add_memory_options

    add_memory_options(r)
    add_server_security(r)
    r.set_defaults(func=cmd_serve_retrieval)
    ro = ssub.add_parser("router", help="RetrievalService that fans out to shards and merges the top-k")
    ro.add_argument("--shard", action="append", required=True,
                    help="HOST:PORT[,HOST:PORT...]: a shard's replicas, in build order (repeat per shard)")
    ro.add_argument("--hedge-after", type=float, default=None, metavar="SECONDS",
                    help="send a shard call unanswered this long to another replica too (0: only on failure; "
                         "default services.router.server.ShardLinks.hedge_after_s, 1 s)")
    add_link_security(ro, "shard-", "shard", "MEMLM_SHARD_TOKEN")
    add_server_security(ro)
    ro.set_defaults(func=cmd_serve_router)
    lm = ssub.add_parser("lm", help="LanguageModelService: Score, Generate, Tokenize")
    lm.add_argument("--model", required=True, help="preset, .gguf file, HF or memlm checkpoint dir")
    from memlm.engine.decode_graphs import CUDA_GRAPHS_HELP
    from memlm.model.hf_model import KEY_MODULE_HELP

    lm.add_argument("--key-module", default=None, metavar="PATH", help=KEY_MODULE_HELP)
    lm.add_argument("--datastore", default=None, help="local datastore for kNN-LM")
    lm.add_argument("--retrieval", default=None, help="HOST:PORT of a retrieval service or router for kNN-LM")
    add_link_security(lm, "retrieval-", "retrieval service", "MEMLM_RETRIEVAL_TOKEN")
    lm.add_argument("--device", default="auto", help="auto, cpu or cuda")
    lm.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    add_options(lm, "model", WEIGHTS_OPTIONS)
    add_options(lm, "kNN-LM defaults of requests", KNN_OPTIONS)
    lm.add_argument("--interpolation", default=None, metavar="PATH",
                    help="kNN-LM Score mixes as this file of `memlm eval --lambda auto --knn-temperature auto "
                         "--save-interpolation` says (its k, learned weights, document cache) where a request sets "
                         "no lambda or temperature; refused when fitted with another model or datastore")
    lm.add_argument("--max-new-tokens", type=int, default=4096, help="largest Generate request")
    lm.add_argument("--max-score-tokens", type=int, default=65536, help="largest Score request, in tokens")
    from services.lm.requests import LMLimits  # the one home of the limits' defaults

    for name, what in (("max_forward_tokens", "most forward work of one Score: the sum of its windows' lengths"),
                       ("max_score_entries", "most entries of one Score response: scored tokens x (1 + top_n)"),
                       ("max_text_chars", "most characters of text in one request"),
                       ("max_step_tokens", "most input tokens of one forward step (calls take turns step by step)"),
                       ("max_batch", "Generate calls decoded together in one engine step"),
                       ("max_queue", "Generate calls waiting for a row (more: RESOURCE_EXHAUSTED, retry-after-ms)")):
        lm.add_argument(flag(name), type=positive_int, default=getattr(LMLimits, name), help=what)
    from services.common.sizes import byte_size, format_bytes

    lm.add_argument("--max-kv-bytes", type=byte_size, default=LMLimits.max_kv_bytes, metavar="SIZE",
                    help="KV cache bytes of the tokens in flight (prompt + max_new_tokens over all Generate calls; "
                         "more: refused), converted with the model's layers, kv heads, head size and dtype (e.g. 512M, "
                         f"4G; default {format_bytes(LMLimits.max_kv_bytes)})")
    lm.add_argument("--cuda-graphs", action="store_true", help=CUDA_GRAPHS_HELP)
    add_options(lm, "kNN-LM datastore", {**SEARCH_BACKEND_OPTIONS, **ACCEPT_WEIGHTS_OPTIONS})
    add_options(lm, "memory defaults of requests", MEMORY_OPTIONS, SERVE_MEMORY)
    add_options(lm, "memorizing checkpoint (MEMORY_MODE_MEMORIZING): where its kNN memories live", MEMORY_OPTIONS,
                ("knn_backend",))
    from memlm.cli.eval import KNN_SERVICE, KNN_SERVICE_ENV

    lm.add_argument("--knn-service", default=None, metavar="HOST:PORT",
                    help="retrieval server with memory sessions (serve retrieval --memories) for --knn-backend service")
    add_link_security(lm, KNN_SERVICE, "memory service", KNN_SERVICE_ENV)
    add_options(lm, "adaptive retrieval of Score requests", FEWER_SEARCHES_OPTIONS, ("adaptive_gate",))
    add_server_security(lm)
    lm.set_defaults(func=cmd_serve_lm)
    for server in (r, ro, lm):
        add_threads_option(server)
    add_openai_parser(ssub)


def add_client_parser(sub: Any) -> None:
    p = sub.add_parser("client", help="call a running LanguageModelService")
    csub = p.add_subparsers(dest="client_command", required=True, metavar="CALL")
    for name in ("score", "generate"):
        c = csub.add_parser(name, help=f"{name} text")
        c.add_argument("--address", required=True, help="HOST:PORT of `memlm serve lm`")
        add_link_security(c, "", "server", "MEMLM_TOKEN")
        c.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
        c.add_argument("--knn", action="store_true", help="use kNN-LM (the server needs a datastore)")
        c.add_argument("--attribution", type=int, default=None, metavar="N",
                       help="print each token's top N datastore documents by kNN mass (needs --knn)")
        add_options(c, "kNN-LM (unset: the server's defaults)", KNN_OPTIONS, CLIENT_KNN)
        add_options(c, "memory (unset: the server's defaults)", MEMORY_OPTIONS, ("kind", *SERVE_MEMORY, *CLIENT_KNN_MEMORY),
                    choices={"kind": ("none", "xl", "memorizing", "spalm")})
        add_options(c, "fewer kNN-LM searches (the server's gate)", FEWER_SEARCHES_OPTIONS, CLIENT_FEWER)
        if name == "score":
            c.add_argument("text", nargs="+", help="texts to score")
            c.add_argument("--prefix", action="append", help="text each text continues (its loglikelihood given it)")
            c.add_argument("--top-n", type=int, default=0, help="alternatives per token")
            add_options(c, "sliding windows (unset: the server's)", WINDOW_OPTIONS)
            c.add_argument("--per-token", action="store_true", help="print every token's log-probability")
            c.set_defaults(func=cmd_client_score)
        else:
            c.add_argument("prompt", help="prompt text")
            c.add_argument("--max-new-tokens", type=int, default=64)
            c.add_argument("--temperature", dest="sampling_temperature", type=float, default=None,
                           help="sampling temperature, 0 = greedy")
            c.add_argument("--top-k", type=int, default=None)
            c.add_argument("--top-p", type=float, default=None)
            c.add_argument("--seed", type=int, default=None)
            c.add_argument("--stop", action="append", help="stop sequence (repeat)")
            add_speculative_options(c)  # memlm generate's names and help, defined in one place
            c.set_defaults(func=cmd_client_generate)


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose usage errors are one line, as MemlmError's: `memlm: error: --port: ...`
    (without argparse's usage block first); subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"memlm: error: {message.removeprefix('argument ')}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="memlm", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-gemm", default=DEFAULT_CPU_GEMM, choices=CPU_GEMM_NAMES,
                        help="the CPU float32 GEMM of the decoder's linear layers (memlm.model.cpu_gemm): mkl (default: "
                             "F.linear) or onednn (torch.utils.mkldnn); before the command: memlm --cpu-gemm onednn serve lm ...")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("fetch", help="fetch a model or corpus into the cache ($MEMLM_CACHE or ~/.cache/memlm)")
    p.add_argument("name", help=f"one of: {', '.join(MODEL_NAMES + CORPUS_NAMES)}")
    p.set_defaults(func=lambda a: cmd_fetch(a.name))

    add_eval_parser(sub)
    add_generate_parser(sub)
    add_datastore_parser(sub)
    add_plan_parser(sub)
    add_serve_parser(sub)
    add_client_parser(sub)
    add_train_parser(sub)
    add_train_gate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "threads"):
            apply_threads(args.threads)
        with cpu_gemm_as(args.cpu_gemm):
            args.func(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at interpreter exit
    except MemlmError as e:
        print(f"memlm: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `memlm ... | head -1`: the reader left; exit quietly, and point stdout at /dev/null so that
        # Python's own flush at exit does not fail again (the recipe of the signal module's docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        if e.filename is None:
            raise
        # A file named on the command line that cannot be read (a missing TLS certificate, ...): one line.
        print(f"memlm: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("memlm: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
