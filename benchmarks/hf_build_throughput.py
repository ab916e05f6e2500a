"""Datastore build tokens/s with the transformers model vs memlm's decoder on the same weights, in one
run.

Both load SmolLM2-135M-Instruct Q4_1 from the same GGUF (memlm's loader; transformers' gguf_file=, which
dequantises it too), build a datastore of the same SOTU tokens with the same windows (build_from_tokens:
forward, float16 keys, shards, index), alternately, `--repeats` times each; the best time of each is
printed, with the keys' largest difference as a check that both built the same datastore. No assertions.

    python benchmarks/hf_build_throughput.py [--max-tokens 2000] [--context 512] [--repeats 2] [--threads 2]
        [--results DIR]

Writes docs/results/data/hf_build_throughput.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _common
import harness
import numpy as np
import torch

from datastore import BuildSettings, BuildSource, build_from_tokens
from memlm.jobs.windows import WindowConfig


def build_seconds(pre, docs, window, boundary, directory: Path, name: str) -> float:
    source = BuildSource(name, pre.fingerprint, pre.tokenizer.fingerprint, "sotu", "bench", boundary)
    t0 = time.perf_counter()
    build_from_tokens(pre.model, docs, directory, source, BuildSettings(window=window, index_factory="Flat"),
                      progress=False)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="sotu")
    p.add_argument("--split", default="1990<=year<=2000")
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    harness.add_options(p, "hf_build_throughput")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)

    ours = _common.load_model(_common.REAL_MODEL, synthetic=False)
    from memlm.model.weights import load_pretrained, model_path

    theirs = load_pretrained(f"hf:{model_path(_common.REAL_MODEL)}", dtype=torch.float32)
    docs, _ = _common.load_tokens(ours, args.data, args.split, args.max_tokens, synthetic=False)
    n = sum(map(len, docs))
    window = WindowConfig(args.context, args.stride, args.batch_size)
    runs: dict[str, list[float]] = {"memlm decoder": [], "transformers": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for label, pre in (("memlm decoder", ours.pre), ("transformers", theirs)):
                out = Path(tmp) / f"{label.split()[0]}-{r}"
                runs[label].append(build_seconds(pre, docs, window, ours.boundary, out, label))
        best = {label: min(v) for label, v in runs.items()}
        # keys.f16: the (N, d) float16 keys (datastore.shards); the same rows in both builds
        a, b = (np.fromfile(Path(tmp) / f"{x}-0" / "keys.f16", dtype=np.float16) for x in ("memlm", "transformers"))
    print(f"SmolLM2-135M-Instruct Q4_1 (dequantised, float32), {n} tokens of {args.data} [{args.split}], context "
          f"{args.context}, stride {args.stride}, batch {args.batch_size}, threads {torch.get_num_threads()}, "
          f"best of {args.repeats}")
    for label, seconds in best.items():
        print(f"{label:14s}: {n / seconds:8.1f} tokens/s ({seconds:.1f} s, all build stages)")
    print(f"ratio transformers/memlm = {best['memlm decoder'] / best['transformers']:.3f}")
    diff = float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max())
    print(f"keys' largest difference: {diff:.4f} "
          f"(of {a.size} values, largest |key| {float(np.abs(a.astype(np.float32)).max()):.1f})")
    result.settings = {"model": "SmolLM2-135M-Instruct Q4_1 (dequantised, float32)", "dtype": "float32",
                       "data": f"{args.data} [{args.split}]", "tokens": n, "context": args.context,
                       "stride": args.stride, "batch_size": args.batch_size, "repeats": args.repeats,
                       "threads": torch.get_num_threads(), "statistic": "best of the alternating builds"}
    result.figures = {**{f"{label.split()[0]}_tokens_per_s": n / s for label, s in best.items()},
                      "transformers_over_memlm": best["memlm decoder"] / best["transformers"],
                      **{f"{label.split()[0]}_builds_s": harness.stats(v) for label, v in runs.items()},
                      "keys_largest_difference": diff}
    result.write()


if __name__ == "__main__":
    main()
