"""Datastore build tokens/s over pure forward tokens/s on the same text (goal >= 0.9).

Pure forward = the same windows through `score_documents(with_logprobs=False)` with the keys dropped;
the build adds float16 conversion, shard files (fsynced), the merge, index training/adding and checksums.
Prints the ratio; no assertions. Uses SmolLM2 + SOTU (`memlm fetch smollm2-135m`, `memlm fetch sotu`);
a random model or random tokens only with --synthetic (said in the output).

    python benchmarks/build_throughput.py [--model M] [--max-tokens 4000] [--index Flat] [--synthetic]
        [--results DIR]

Writes docs/results/data/build_throughput.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _common
import harness
import torch

from datastore import BuildSettings, BuildSource, build_from_tokens
from memlm.jobs.windows import WindowConfig, score_documents


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: smollm2-135m when fetched, else tiny")
    p.add_argument("--data", default="sotu")
    p.add_argument("--split", default="1990<=year<=2000")
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--index", default=None, help="FAISS factory (default: chosen from N and d)")
    harness.add_options(p, "build_throughput")
    _common.add_synthetic_flag(p)
    args = p.parse_args()
    result = harness.Result.from_args(args)

    bench = _common.load_model(args.model, args.synthetic)
    pre, name, bos = bench.pre, bench.name, bench.boundary
    model = pre.model
    docs, random_tokens = _common.load_tokens(bench, args.data, args.split, args.max_tokens, args.synthetic)
    synthetic = bench.synthetic or random_tokens
    n = sum(map(len, docs))
    window = WindowConfig(args.context, args.stride, args.batch_size)
    list(score_documents(model, [docs[0][:64]], window, bos, with_logprobs=False))  # warm-up

    t0 = time.perf_counter()
    for scored in score_documents(model, docs, window, bos, with_logprobs=False):
        pass
    forward_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        prov = BuildSource(name, pre.fingerprint, pre.tokenizer.fingerprint, f"{args.data} [{args.split}]", "bench", bos)
        t0 = time.perf_counter()
        build_from_tokens(model, docs, Path(tmp) / "ds", prov,
                          BuildSettings(window=window, index_factory=args.index), progress=False)
        build_s = time.perf_counter() - t0

    result.set_synthetic(synthetic)
    print(f"model {name}, {n} tokens, context {args.context}, stride {args.stride}, batch {args.batch_size}, "
          f"threads {torch.get_num_threads()}")
    print(f"pure forward : {n / forward_s:8.1f} tokens/s ({forward_s:.1f} s)")
    print(f"build        : {n / build_s:8.1f} tokens/s ({build_s:.1f} s, all stages)")
    print(f"ratio build/forward = {forward_s / build_s:.3f}   (goal >= 0.9)")
    result.settings = {"model": name, "data": f"{args.data} [{args.split}]", "tokens": n, "context": args.context,
                       "stride": args.stride, "batch_size": args.batch_size, "index": args.index or "default",
                       "dtype": "float32", "threads": torch.get_num_threads()}
    result.figures = {"forward_tokens_per_s": n / forward_s, "build_tokens_per_s": n / build_s,
                      "forward_s": forward_s, "build_s": build_s, "build_over_forward": forward_s / build_s}
    result.write()


if __name__ == "__main__":
    main()
