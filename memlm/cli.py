"""The memlm command line: one table from subcommand to a typed function.

The library modules never import `datastore` or `services`; this file wires them together.
User errors (MemlmError) print one line and exit 1, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError

# ---------------------------------------------------------------------------------------------------
# fetch


def cmd_fetch(name: str) -> None:
    """Fetch a model or corpus into the cache and print the local path."""
    from memlm.data.corpora import fetch_corpus
    from memlm.model.weights import fetch_model

    if name in MODEL_NAMES:
        path = fetch_model(name)
    elif name in CORPUS_NAMES:
        path = fetch_corpus(name)
    else:
        raise MemlmError(f"unknown name {name!r}; fetchable: {', '.join(MODEL_NAMES + CORPUS_NAMES)}")
    print(path)


MODEL_NAMES = ["smollm2-135m"]
CORPUS_NAMES = ["sotu", "wiki-summaries"]  # memlm.data.corpora.CORPORA

# ---------------------------------------------------------------------------------------------------
# eval


def load_eval_tokens(tokenizer: Any, data: str, split: str | None, max_tokens: int | None) -> list[list[int]]:
    from memlm.data.documents import load_documents, tokenize_documents

    docs = load_documents(data, split)
    token_docs = [t for t in tokenize_documents(docs, tokenizer, max_tokens) if t]
    if not token_docs:
        raise MemlmError(f"corpus {data} (split {split or 'all'}) has no tokens to evaluate")
    return token_docs


def cmd_eval(args: argparse.Namespace) -> None:
    from memlm.jobs.evaluate import evaluate_perplexity, write_json
    from memlm.model.device import resolve_device, resolve_dtype
    from memlm.jobs.windows import WindowConfig
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    pretrained = load_pretrained(args.model, device=device, dtype=dtype)
    model, tokenizer = pretrained.model, pretrained.tokenizer
    context = args.context or min(1024, model.config.max_seq_len)
    stride = args.stride or max(1, context // 2)
    window = WindowConfig(context=context, stride=stride, batch_size=args.batch_size)
    if context > model.config.max_seq_len:
        raise MemlmError(
            f"--context {context} is longer than {args.model} supports ({model.config.max_seq_len}); "
            f"pass --context {model.config.max_seq_len} or less"
        )
    token_docs = load_eval_tokens(tokenizer, args.data, args.split, args.max_tokens)
    bos = document_boundary(tokenizer)
    header = {
        "model": args.model,
        "model_fingerprint": pretrained.fingerprint,
        "data": args.data,
        "split": args.split,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
    }

    if args.memory != "none" and args.datastore:
        raise MemlmError("--memory and --datastore cannot be combined in memlm eval; the LM service's Score "
                         "combines XL memory with kNN-LM (memlm client score --memory xl --knn)")
    if args.memory != "none":
        from memlm.jobs.segment_eval import evaluate_segments
        from memlm.jobs.train import load_compressor
        from memlm.memory.config import MemoryConfig

        try:
            MemoryConfig(args.memory, args.mem_len, args.cmem_len, args.compress_rate, args.compress_fn,
                         args.sink_tokens)
        except ValueError as e:
            raise MemlmError(str(e)) from None

        compressor = None
        if args.memory == "compressive" and args.compress_fn == "conv":
            compressor = load_compressor(args.model, device) if Path(args.model).is_dir() else None
            if compressor is None:
                raise MemlmError("--compress-fn conv needs a checkpoint trained with it (memlm train --memory "
                                 "compressive --compress-fn conv); use mean or max pooling with other models")
            if compressor.rate != args.compress_rate:
                raise MemlmError(f"the checkpoint's compressor has rate {compressor.rate}; pass --compress-rate "
                                 f"{compressor.rate}")
        result = evaluate_segments(
            model, token_docs, segment=args.segment, memory=args.memory, mem_len=args.mem_len,
            cmem_len=args.cmem_len, compress_rate=args.compress_rate, compress_fn=args.compress_fn,
            sink_tokens=args.sink_tokens, batch_size=args.batch_size, compressor=compressor,
            boundary_token=bos,
        )
    elif args.datastore:
        result = run_knnlm_eval(args, pretrained, token_docs, window, bos)
    else:
        result = evaluate_perplexity(model, token_docs, window, bos, progress=not args.quiet)
    result = {**header, **result}
    print_result(result)
    if args.json:
        write_json(result, args.json)


def run_knnlm_eval(args: argparse.Namespace, pretrained: Any, token_docs: list[list[int]], window: Any, bos: int) -> dict:
    from datastore import Datastore
    from memlm.jobs.knnlm_eval import evaluate_knnlm
    from memlm.retrieval.knnlm import KNNLMConfig

    store = Datastore.open(
        Path(args.datastore),
        expect_model_fingerprint=pretrained.fingerprint,
        expect_tokenizer_fingerprint=pretrained.tokenizer.fingerprint,
        backend=args.search_backend,
        device=str(pretrained.model.device),
    )
    tune_docs = None
    if args.tune_data:
        tune_docs = load_eval_tokens(pretrained.tokenizer, args.tune_data, args.tune_split, args.tune_max_tokens)
    elif args.lmbda == "auto" or args.temperature == "auto":
        raise MemlmError("--lambda auto / --temperature auto need --tune-data (never tuned on the evaluation split)")
    knn = KNNLMConfig(
        k=args.k,
        lmbda=None if args.lmbda == "auto" else float(args.lmbda),
        temperature=None if args.temperature == "auto" else float(args.temperature),
        exact_rerank=args.exact_rerank,
        nprobe=args.nprobe,
    )
    return evaluate_knnlm(
        pretrained.model, token_docs, store, window, knn, bos, tune_docs=tune_docs, progress=not args.quiet
    )


def print_result(result: dict[str, Any]) -> None:
    """A short human summary on stdout; the JSON file has everything."""
    for key in ("perplexity", "base_perplexity", "knnlm_perplexity", "relative_change", "lambda", "temperature",
                "k", "index", "datastore_size", "tokens", "tokens_per_s", "base_tokens_per_s", "knnlm_tokens_per_s",
                "knnlm_speed_ratio", "recall_at_k", "recall_at_10",
                "attention_span", "seconds"):
        if key in result:
            value = result[key]
            text = f"{value:.4f}" if isinstance(value, float) else str(value)
            print(f"{key:>20}: {text}")


# ---------------------------------------------------------------------------------------------------
# datastore


def cmd_datastore_build(args: argparse.Namespace) -> None:
    from datastore import build_datastore

    out = build_datastore(
        model=args.model, data=args.data, out=Path(args.out), split=args.split, max_tokens=args.max_tokens,
        index=args.index, context=args.context, stride=args.stride, batch_size=args.batch_size,
        device=args.device, dtype=args.dtype, overwrite=args.overwrite, nprobe=args.nprobe,
        progress=not args.quiet, num_shards=args.shards,
    )
    print(out)


def cmd_datastore_info(directory: str) -> None:
    from datastore import datastore_info

    print(datastore_info(Path(directory)))


# ---------------------------------------------------------------------------------------------------
# serve and client


def token_from(args: argparse.Namespace) -> str | None:
    """--token, else $MEMLM_TOKEN (an environment variable keeps the secret out of `ps`)."""
    return args.token or os.environ.get("MEMLM_TOKEN") or None


def server_tls(args: argparse.Namespace) -> Any:
    from services.security import ServerTls

    if bool(args.tls_cert) != bool(args.tls_key):
        raise MemlmError("--tls-cert and --tls-key go together")
    if not args.tls_cert:
        if args.tls_client_ca:
            raise MemlmError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    return ServerTls.from_files(args.tls_cert, args.tls_key, args.tls_client_ca)


def client_tls(ca: str | None) -> Any:
    from services.security import ClientTls

    return ClientTls.from_files(root_ca=ca) if ca else None


def cmd_serve_retrieval(args: argparse.Namespace) -> None:
    from datastore import Datastore
    from services.retrieval_server import serve_retrieval

    store = Datastore.open(Path(args.datastore), mmap=args.mmap, backend=args.search_backend,
                           device=None if args.device == "auto" else args.device)
    asyncio.run(serve_retrieval(
        store, store.info(), args.host, args.port, tls=server_tls(args), token=token_from(args),
        micro_batching=not args.no_micro_batching, max_concurrent_rpcs=args.max_concurrent_rpcs,
    ))


def cmd_serve_router(args: argparse.Namespace) -> None:
    from services.router import serve_router

    asyncio.run(serve_router(
        args.shard, args.host, args.port, shard_tls=client_tls(args.shard_ca),
        shard_token=args.shard_token or os.environ.get("MEMLM_SHARD_TOKEN") or None,
        tls=server_tls(args), token=token_from(args), max_concurrent_rpcs=args.max_concurrent_rpcs,
    ))


def cmd_serve_lm(args: argparse.Namespace) -> None:
    from memlm.model.device import resolve_device, resolve_dtype
    from memlm.retrieval.knnlm import KNNLMConfig
    from services.lm_server import LMLimits, serve_lm
    from services.server_common import ServerOptions

    if args.datastore and args.retrieval:
        raise MemlmError("give --datastore DIR or --retrieval HOST:PORT, not both")
    device = resolve_device(args.device)
    knn = KNNLMConfig(k=args.k, lmbda=args.lmbda, temperature=args.knn_temperature,
                      exact_rerank=args.exact_rerank, nprobe=args.nprobe)
    asyncio.run(serve_lm(
        args.model, datastore=args.datastore, retrieval=args.retrieval, host=args.host, port=args.port,
        device=device, dtype=resolve_dtype(args.dtype, device), knn_defaults=knn,
        options=ServerOptions(tls=server_tls(args), token=token_from(args),
                              max_concurrent_rpcs=args.max_concurrent_rpcs),
        limits=LMLimits(max_new_tokens=args.max_new_tokens, max_score_tokens=args.max_score_tokens,
                        segment_tokens=args.segment, memory_tokens=args.mem_len, sink_tokens=args.sink_tokens),
        retrieval_tls=client_tls(args.retrieval_ca),
        retrieval_token=args.retrieval_token or os.environ.get("MEMLM_RETRIEVAL_TOKEN") or None,
    ))


def knn_request(args: argparse.Namespace) -> Any:
    from services.lm_client import KnnRequest

    if not args.knn:
        return None
    return KnnRequest(lmbda=args.lmbda, temperature=args.knn_temperature, k=args.k)


def memory_request(args: argparse.Namespace) -> dict[str, Any]:
    """memory_mode= and memory= keyword arguments of the client calls (server defaults when unset)."""
    from services.lm_client import MemoryRequest

    if args.memory == "none":
        return {}
    return {"memory_mode": args.memory, "memory": MemoryRequest(args.segment, args.mem_len, args.sink_tokens)}


def cmd_client_score(args: argparse.Namespace) -> None:
    from services.lm_client import main_score

    main_score(
        args.address, args.text, contexts=args.context or None, knn=knn_request(args), top_n=args.top_n,
        window_tokens=args.window, stride_tokens=args.stride, per_token=args.per_token,
        tls=client_tls(args.tls_ca), token=token_from(args), timeout=args.timeout, **memory_request(args),
    )


def cmd_client_generate(args: argparse.Namespace) -> None:
    from services.lm_client import main_generate

    main_generate(
        args.address, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop or (), knn=knn_request(args),
        tls=client_tls(args.tls_ca), token=token_from(args), timeout=args.timeout, **memory_request(args),
    )


# ---------------------------------------------------------------------------------------------------
# train


def cmd_train(args: argparse.Namespace) -> None:
    from memlm.jobs.train import TrainConfig, train
    from memlm.memory.config import MemoryConfig

    try:
        memory = MemoryConfig(args.memory, args.mem_len, args.cmem_len, args.compress_rate, args.compress_fn,
                              args.sink_tokens)
    except ValueError as e:
        raise MemlmError(str(e)) from None
    config = TrainConfig(
        model=args.model, init=args.init, memory=memory, segment=args.segment, batch_size=args.batch_size,
        steps=args.steps, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, compressor_only=args.compressor_only,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, out_dir=args.out,
        log_every=args.log_every, seed=args.seed, device=args.device, data=args.data,
        train_split=args.split, eval_split=args.eval_split, max_train_tokens=args.max_train_tokens,
        max_eval_tokens=args.max_eval_tokens,
    )
    result = train(config, resume_from=args.resume)
    summary = {
        "step": result.step,
        "tokens": result.tokens,
        "final_loss": result.losses[-1] if result.losses else None,
        "evals": result.evals,
        "checkpoint": result.checkpoint,
    }
    print(json.dumps(summary, indent=2, default=str))


# ---------------------------------------------------------------------------------------------------
# argument parsing


def add_eval_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="perplexity of a model (optionally with kNN-LM or a memory) on a corpus split")
    p.add_argument("--model", required=True, help="preset (smollm2-135m, tiny, small), .gguf file, HF or memlm checkpoint dir")
    p.add_argument("--data", required=True, help="fetched corpus name (sotu, wiki-summaries) or a .txt/.jsonl/.json/.parquet file")
    p.add_argument("--split", default=None, help='documents to use, e.g. "year>=2001", "[0:10]", "year<2001[-5:]"')
    p.add_argument("--context", type=int, default=None, help="window length in tokens (default min(1024, model max))")
    p.add_argument("--stride", type=int, default=None, help="tokens between window starts (default context/2)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on tokens evaluated")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--json", default=None, help="write the result as JSON to this path")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    knn = p.add_argument_group("kNN-LM")
    knn.add_argument("--datastore", default=None, help="datastore directory: report base and kNN-LM perplexity")
    knn.add_argument("--k", type=int, default=1024, help="neighbours per token")
    knn.add_argument("--lambda", dest="lmbda", default="0.25", help="interpolation weight, or auto (tuned on --tune-data)")
    knn.add_argument("--temperature", default="1.0", help="softmax temperature over -distance, or auto")
    knn.add_argument("--exact-rerank", action="store_true", help="recompute exact distances from the stored keys")
    knn.add_argument("--nprobe", type=int, default=None, help="IVF lists probed (default: the datastore's)")
    knn.add_argument("--search-backend", default="faiss", choices=["faiss", "torch"],
                     help="faiss index (GPU clone when faiss-gpu sees CUDA), or exact torch search on the model's device")
    knn.add_argument("--tune-data", default=None, help="corpus for --lambda/--temperature auto (never the eval split)")
    knn.add_argument("--tune-split", default=None, help="split of --tune-data")
    knn.add_argument("--tune-max-tokens", type=int, default=None, help="cap on tuning tokens")
    mem = p.add_argument_group("memory")
    mem.add_argument("--memory", default="none", choices=["none", "xl", "compressive"], help="segment-recurrent memory")
    mem.add_argument("--segment", type=int, default=128, help="segment length in tokens")
    mem.add_argument("--mem-len", type=int, default=1024, help="Transformer-XL memory slots per layer")
    mem.add_argument("--cmem-len", type=int, default=0, help="compressed memory slots per layer")
    mem.add_argument("--compress-rate", type=int, default=4, help="memories per compressed slot")
    mem.add_argument("--compress-fn", default="mean", choices=["mean", "max", "conv"], help="compression function")
    mem.add_argument("--sink-tokens", type=int, default=4, help="first tokens of each document kept in memory")
    p.set_defaults(func=lambda a: cmd_eval(a))



def add_datastore_parser(sub: Any) -> None:
    p = sub.add_parser("datastore", help="build and inspect kNN-LM datastores")
    dsub = p.add_subparsers(dest="datastore_command", required=True, metavar="ACTION")
    b = dsub.add_parser("build", help="corpus -> (key, next token) pairs -> FAISS index; resumable (run it again)")
    b.add_argument("--model", required=True, help="preset, .gguf file, HF or memlm checkpoint dir")
    b.add_argument("--data", required=True, help="fetched corpus name or a .txt/.jsonl/.json/.parquet file")
    b.add_argument("--out", required=True, help="datastore directory to write")
    b.add_argument("--split", default=None, help="documents to use (see memlm eval --help)")
    b.add_argument("--max-tokens", type=int, default=None, help="cap on tokens stored")
    b.add_argument("--index", default=None, help='FAISS factory string, e.g. "IVF4096,PQ64" (default: chosen from N and d)')
    b.add_argument("--nprobe", type=int, default=None, help="default IVF lists probed at search time")
    b.add_argument("--context", type=int, default=None, help="window length (default min(1024, model max))")
    b.add_argument("--stride", type=int, default=None, help="tokens between window starts (default context/2)")
    b.add_argument("--batch-size", type=int, default=4, help="windows per forward pass")
    b.add_argument("--device", default="auto", help="auto, cpu or cuda")
    b.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    b.add_argument("--overwrite", action="store_true", help="replace a finished datastore in --out")
    b.add_argument("--shards", type=int, default=1,
                   help="write N datastores over contiguous document runs (for memlm serve router)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_datastore_build)
    i = dsub.add_parser("info", help="print a datastore's manifest")
    i.add_argument("directory")
    i.set_defaults(func=lambda a: cmd_datastore_info(a.directory))


def add_server_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=0, help="port (0: any free port; the chosen one is printed)")
    p.add_argument("--tls-cert", default=None, help="server certificate chain (PEM) to serve TLS")
    p.add_argument("--tls-key", default=None, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", default=None, help="CA (PEM) that client certificates must chain to (mTLS)")
    p.add_argument("--token", default=None, help="bearer token callers must send (default $MEMLM_TOKEN)")
    p.add_argument("--max-concurrent-rpcs", type=int, default=64, help="RESOURCE_EXHAUSTED past this many calls")


def add_knn_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    p.add_argument("--k", type=int, default=1024 if defaults else None, help="neighbours per token")
    p.add_argument("--lambda", dest="lmbda", type=float, default=0.25 if defaults else None, help="kNN-LM weight")
    p.add_argument("--knn-temperature", type=float, default=1.0 if defaults else None, help="temperature over -distance")


def add_memory_options(p: argparse.ArgumentParser, defaults: bool) -> None:
    p.add_argument("--segment", type=int, default=128 if defaults else None, help="XL segment length, tokens")
    p.add_argument("--mem-len", type=int, default=1024 if defaults else None, help="XL memory per layer, tokens")
    p.add_argument("--sink-tokens", type=int, default=4 if defaults else None, help="first tokens kept in memory")


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run a gRPC server (prints the address it listens on)")
    ssub = p.add_subparsers(dest="serve_command", required=True, metavar="SERVER")
    r = ssub.add_parser("retrieval", help="RetrievalService over a datastore")
    r.add_argument("--datastore", required=True, help="datastore directory")
    r.add_argument("--mmap", action="store_true", help="memory-map the index instead of loading it")
    r.add_argument("--no-micro-batching", action="store_true", help="one FAISS search per call")
    r.add_argument("--search-backend", default="faiss", choices=["faiss", "torch"],
                   help="faiss index, or exact torch search over the keys on --device")
    r.add_argument("--device", default="auto", help="auto, cpu or cuda: where the search runs")
    add_server_security(r)
    r.set_defaults(func=cmd_serve_retrieval)
    ro = ssub.add_parser("router", help="RetrievalService that fans out to shards and merges the top-k")
    ro.add_argument("--shard", action="append", required=True, help="HOST:PORT of a shard, in build order (repeat)")
    ro.add_argument("--shard-ca", default=None, help="CA (PEM) to reach TLS shards")
    ro.add_argument("--shard-token", default=None, help="token for the shards (default $MEMLM_SHARD_TOKEN)")
    add_server_security(ro)
    ro.set_defaults(func=cmd_serve_router)
    lm = ssub.add_parser("lm", help="LanguageModelService: Score, Generate, Tokenize")
    lm.add_argument("--model", required=True, help="preset, .gguf file, HF or memlm checkpoint dir")
    lm.add_argument("--datastore", default=None, help="local datastore for kNN-LM")
    lm.add_argument("--retrieval", default=None, help="HOST:PORT of a retrieval service or router for kNN-LM")
    lm.add_argument("--retrieval-ca", default=None, help="CA (PEM) to reach a TLS retrieval service")
    lm.add_argument("--retrieval-token", default=None, help="token for the retrieval service (default $MEMLM_RETRIEVAL_TOKEN)")
    lm.add_argument("--device", default="auto", help="auto, cpu or cuda")
    lm.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    add_knn_options(lm, defaults=True)
    lm.add_argument("--nprobe", type=int, default=None, help="IVF lists probed (default: the datastore's)")
    lm.add_argument("--exact-rerank", action="store_true", help="re-rank neighbours with exact distances")
    lm.add_argument("--max-new-tokens", type=int, default=4096, help="largest Generate request")
    lm.add_argument("--max-score-tokens", type=int, default=65536, help="largest Score request, in tokens")
    add_memory_options(lm, defaults=True)
    add_server_security(lm)
    lm.set_defaults(func=cmd_serve_lm)


def add_client_parser(sub: Any) -> None:
    p = sub.add_parser("client", help="call a running LanguageModelService")
    csub = p.add_subparsers(dest="client_command", required=True, metavar="CALL")
    for name in ("score", "generate"):
        c = csub.add_parser(name, help=f"{name} text")
        c.add_argument("--address", required=True, help="HOST:PORT of `memlm serve lm`")
        c.add_argument("--tls-ca", default=None, help="CA (PEM) of a TLS server")
        c.add_argument("--token", default=None, help="bearer token (default $MEMLM_TOKEN)")
        c.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
        c.add_argument("--knn", action="store_true", help="use kNN-LM (the server needs a datastore)")
        add_knn_options(c, defaults=False)
        c.add_argument("--memory", default="none", choices=["none", "xl"], help="Transformer-XL memory mode")
        add_memory_options(c, defaults=False)
        if name == "score":
            c.add_argument("text", nargs="+", help="texts to score")
            c.add_argument("--context", action="append", help="context for each text (loglikelihood of text given it)")
            c.add_argument("--top-n", type=int, default=0, help="alternatives per token")
            c.add_argument("--window", type=int, default=None, help="window length in tokens")
            c.add_argument("--stride", type=int, default=None, help="window stride in tokens")
            c.add_argument("--per-token", action="store_true", help="print every token's log-probability")
            c.set_defaults(func=cmd_client_score)
        else:
            c.add_argument("prompt", help="prompt text")
            c.add_argument("--max-new-tokens", type=int, default=64)
            c.add_argument("--temperature", type=float, default=None, help="0 = greedy")
            c.add_argument("--top-k", type=int, default=None)
            c.add_argument("--top-p", type=float, default=None)
            c.add_argument("--seed", type=int, default=None)
            c.add_argument("--stop", action="append", help="stop sequence (repeat)")
            c.set_defaults(func=cmd_client_generate)


def add_train_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a model (from scratch or SmolLM2) with XL / compressive memory")
    p.add_argument("--model", default="tiny", help="preset (scratch) or anything `eval --model` takes (pretrained)")
    p.add_argument("--init", default="scratch", choices=["scratch", "pretrained"])
    p.add_argument("--data", required=True, help="corpus (long documents are read in order)")
    p.add_argument("--split", default=None, help="training documents")
    p.add_argument("--eval-split", default=None, help="evaluation documents (periodic evaluation)")
    p.add_argument("--max-train-tokens", type=int, default=None)
    p.add_argument("--max-eval-tokens", type=int, default=None)
    p.add_argument("--out", default=None, help="checkpoint directory (config, weights, tokenizer, optimizer)")
    p.add_argument("--resume", default=None, help="checkpoint directory to continue from")
    p.add_argument("--memory", default="xl", choices=["none", "xl", "compressive"])
    p.add_argument("--segment", type=int, default=64, help="tokens per segment (truncated BPTT unit)")
    p.add_argument("--mem-len", type=int, default=128)
    p.add_argument("--cmem-len", type=int, default=0)
    p.add_argument("--compress-rate", type=int, default=4)
    p.add_argument("--compress-fn", default="mean", choices=["mean", "max", "conv"])
    p.add_argument("--sink-tokens", type=int, default=0)
    p.add_argument("--compressor-only", action="store_true", help="freeze the model, train the conv compressor")
    p.add_argument("--batch-size", type=int, default=4, help="independent document streams")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("fetch", help="fetch a model or corpus into the cache ($MEMLM_CACHE or ~/.cache/memlm)")
    p.add_argument("name", help=f"one of: {', '.join(MODEL_NAMES + CORPUS_NAMES)}")
    p.set_defaults(func=lambda a: cmd_fetch(a.name))

    add_eval_parser(sub)
    add_datastore_parser(sub)
    add_serve_parser(sub)
    add_client_parser(sub)
    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except MemlmError as e:
        print(f"memlm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("memlm: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
