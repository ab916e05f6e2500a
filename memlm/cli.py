"""The memlm command line: one table from subcommand to a typed function.

The library modules never import `datastore` or `services`; this file wires them together.
User errors (MemlmError) print one line and exit 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from memlm.errors import MemlmError

# ---------------------------------------------------------------------------------------------------
# fetch


def cmd_fetch(name: str) -> None:
    """Fetch a model or corpus into the cache and print the local path."""
    from memlm import corpus, weights

    if name in MODEL_NAMES:
        path = weights.fetch_model(name)
    elif name in CORPUS_NAMES:
        path = corpus.fetch_corpus(name)
    else:
        raise MemlmError(f"unknown name {name!r}; fetchable: {', '.join(MODEL_NAMES + CORPUS_NAMES)}")
    print(path)


MODEL_NAMES = ["smollm2-135m"]
CORPUS_NAMES = ["sotu", "wiki-summaries"]

# ---------------------------------------------------------------------------------------------------
# eval


def load_eval_tokens(tokenizer: Any, data: str, split: str | None, max_tokens: int | None) -> list[list[int]]:
    from memlm.corpus import load_documents, tokenize_documents

    docs = load_documents(data, split)
    token_docs = [t for t in tokenize_documents(docs, tokenizer, max_tokens) if t]
    if not token_docs:
        raise MemlmError(f"corpus {data} (split {split or 'all'}) has no tokens to evaluate")
    return token_docs


def boundary_token(tokenizer: Any) -> int:
    """The token that precedes every document (BOS, else EOS)."""
    token = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if token is None:
        raise MemlmError("the tokenizer has neither a BOS nor an EOS token to mark document starts")
    return token


def cmd_eval(args: argparse.Namespace) -> None:
    from memlm.evaluate import evaluate_perplexity, resolve_device, resolve_dtype, write_json
    from memlm.weights import load_pretrained
    from memlm.windows import WindowConfig

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
    bos = boundary_token(tokenizer)
    header = {
        "model": args.model,
        "model_fingerprint": pretrained.fingerprint,
        "data": args.data,
        "split": args.split,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
    }

    if args.memory != "none":
        from memlm.segment_eval import evaluate_segments

        result = evaluate_segments(
            model, token_docs, segment=args.segment, memory=args.memory, mem_len=args.mem_len,
            cmem_len=args.cmem_len, compress_rate=args.compress_rate, compress_fn=args.compress_fn,
            sink_tokens=args.sink_tokens, batch_size=args.batch_size,
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
    from memlm.knnlm import KNNLMConfig, evaluate_knnlm

    store = Datastore.open(
        Path(args.datastore),
        expect_model_fingerprint=pretrained.fingerprint,
        expect_tokenizer_fingerprint=pretrained.tokenizer.fingerprint,
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
                "k", "tokens", "tokens_per_s", "base_tokens_per_s", "knnlm_tokens_per_s", "recall_at_k",
                "attention_span", "seconds"):
        if key in result:
            value = result[key]
            text = f"{value:.4f}" if isinstance(value, float) else str(value)
            print(f"{key:>20}: {text}")


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("fetch", help="fetch a model or corpus into the cache ($MEMLM_CACHE or ~/.cache/memlm)")
    p.add_argument("name", help=f"one of: {', '.join(MODEL_NAMES + CORPUS_NAMES)}")
    p.set_defaults(func=lambda a: cmd_fetch(a.name))

    add_eval_parser(sub)
    for add in EXTRA_PARSERS:
        add(sub)
    return parser


# Later subsystems (datastore, serve, client, train) register their parsers here.
EXTRA_PARSERS: list[Callable[[Any], None]] = []


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
