"""SPALM evaluation speed over base + XL evaluation speed, measured side by side in one run.

Both sides are the library's evaluations of `memlm eval` on the same tokens with the same segments, XL
memory and sinks: base + XL is memlm.jobs.segment_eval.evaluate_memory (--memory xl), SPALM is
memlm.jobs.spalm.evaluate_spalm (--memory spalm: the same decoder pass, one batched search of the
datastore per segment, the head). They run interleaved, XL then SPALM, --repeats times (same machine
load for both), and the ratio is of the medians. The datastore's search time inside SPALM is timed too
(a wrapper around its search), so the overhead splits into search and head. The head is fresh (its
values do not change the work); the datastore is SmolLM2's own (the keys' model is checked, as memlm eval
does).

    python benchmarks/spalm_speed.py [--datastore /tmp/demo_v3/ds-sotu-1990-2000] [--split "year>=2003"]
        [--tokens 1024] [--repeats 3] [--k 8] [--segment S] [--mem-len M] [--threads N] [--synthetic]

--synthetic without SmolLM2 or the datastore: the random tiny model over an in-memory exact datastore of
random tokens (prints SYNTHETIC; speed only). Shape legend: Q searched positions, d key width, k neighbours.
Writes docs/results/data/spalm_speed.json (benchmarks/harness.py; --results DIR moves it); the datastore's token
counts (what the head reads) are built before the timings, their seconds beside them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import _common
import harness
import numpy as np
import torch

from memlm.jobs.segment_eval import evaluate_memory
from memlm.jobs.spalm import datastore_token_counts, evaluate_spalm
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SPALM_DEFAULT_K, SpalmHead
from memlm.retrieval.searcher import Neighbors, SearcherInfo, SearchOptions

DEFAULT_DATASTORE = "/tmp/demo_v3/ds-sotu-1990-2000"
"""81,169 SmolLM2 keys of the SOTU speeches 1990-2000 (Flat index), built by `memlm datastore build`."""


class TimedSearcher:
    """A Searcher that adds the wall time of each search to `seconds` (the rest is delegated)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds, self.values = inner, 0.0, inner.values

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        t0 = time.perf_counter()
        try:
            return self.inner.search(xq, k, options)  # (Q, k) arrays
        finally:
            self.seconds += time.perf_counter() - t0

    def info(self) -> SearcherInfo:
        return self.inner.info()


def open_store(args: argparse.Namespace, bench: _common.BenchModel) -> tuple[Any, str, bool]:
    """(searcher, its description, synthetic): the datastore, checked against the model as memlm eval
    checks it; with --synthetic and no datastore (or a random model), an exact one over random tokens."""
    if Path(args.datastore).is_dir() and not bench.synthetic:
        from memlm.cli.spalm import open_spalm_datastore

        store = open_spalm_datastore(args.datastore, bench.pre, bench.pre.fingerprint, bench.boundary, "faiss")
        info = store.info()
        return store, f"{args.datastore} ({info.n:,} keys, {info.index})", False
    if not args.synthetic:
        raise SystemExit(f"datastore {args.datastore} not found: build it with `memlm datastore build --model "
                         "smollm2-135m --data sotu --split '1990<=year<=2000' --out DIR` (or pass --synthetic)")
    from memlm.jobs.windows import WindowConfig
    from memlm.jobs.windows import exact_searcher_over_documents

    rng = np.random.default_rng(1)
    docs = [rng.integers(3, bench.pre.model.config.vocab_size, size=2000).tolist() for _ in range(4)]
    store = exact_searcher_over_documents(bench.pre.model, docs, WindowConfig(context=256, stride=128), bench.boundary)
    return store, "in-memory exact datastore of 8,000 random tokens", True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: smollm2-135m (random 'tiny' only with --synthetic)")
    p.add_argument("--datastore", default=DEFAULT_DATASTORE, help="SmolLM2 datastore directory")
    p.add_argument("--split", default="year>=2003", help="the SOTU speeches evaluated (their first --tokens)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens evaluated by both sides per repeat")
    p.add_argument("--repeats", type=int, default=3, help="interleaved (XL, SPALM) repeats")
    p.add_argument("--k", type=int, default=SPALM_DEFAULT_K, help="SPALM neighbours per token")
    p.add_argument("--segment", type=int, default=None, help=f"default {MemoryConfig().segment}")
    p.add_argument("--mem-len", type=int, default=None, help=f"default {MemoryConfig().mem_len}")
    p.add_argument("--threads", type=int, default=0, help="torch and FAISS threads (0: their defaults)")
    _common.add_synthetic_flag(p)
    harness.add_options(p, "spalm_speed")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    if args.threads:
        import faiss

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)

    bench = _common.load_model(args.model, args.synthetic)
    model = bench.pre.model.eval()
    docs, random_tokens = _common.load_tokens(bench, "sotu", args.split, args.tokens, args.synthetic)
    store, described, synthetic_store = open_store(args, bench)
    synthetic = bench.synthetic or random_tokens or synthetic_store
    base = MemoryConfig()
    segment, mem_len = args.segment or base.segment, args.mem_len or base.mem_len
    xl = MemoryConfig("xl", segment=segment, mem_len=mem_len, sink_tokens=base.sink_tokens)
    spalm = MemoryConfig("spalm", segment=segment, mem_len=mem_len, sink_tokens=base.sink_tokens)
    head = SpalmHead(model.config.n_embd).to(model.device)
    with result.build("the datastore's token counts"):
        counts = datastore_token_counts(store, model.config.vocab_size)
    timed = TimedSearcher(store)
    result.set_synthetic(synthetic)
    print(f"# model {bench.name}; {'random tokens' if random_tokens else 'sotu ' + repr(args.split)}, "
          f"{sum(map(len, docs))} tokens; datastore {described}; segment {segment}, mem_len {mem_len}, "
          f"{base.sink_tokens} sinks, k {args.k}; torch threads {torch.get_num_threads()}")
    evaluate_memory(model, [docs[0][:segment]], xl, boundary_token=bench.boundary)  # warm-up
    print("repeat | XL tok/s | SPALM tok/s | ratio | SPALM search s | XL ppl | SPALM ppl (fresh head)")
    print("-------|----------|-------------|-------|----------------|--------|-----------------------")
    xl_rates, spalm_rates, search_s = [], [], []
    for r in range(args.repeats):
        a = evaluate_memory(model, docs, xl, boundary_token=bench.boundary)
        timed.seconds = 0.0
        b = evaluate_spalm(model, head, docs, spalm, timed, args.k, boundary_token=bench.boundary, token_counts=counts)
        assert a["tokens"] == b["tokens"]  # the same scored tokens on both sides
        xl_rates.append(a["tokens_per_s"])
        spalm_rates.append(b["tokens_per_s"])
        search_s.append(timed.seconds)
        result.rows.append({"repeat": r + 1, "xl_tokens_per_s": a["tokens_per_s"], "spalm_tokens_per_s":
                            b["tokens_per_s"], "ratio": b["tokens_per_s"] / a["tokens_per_s"],
                            "spalm_search_s": timed.seconds, "xl_perplexity": a["perplexity"],
                            "spalm_perplexity_fresh_head": b["perplexity"]})
        print(f"{r + 1:6d} | {a['tokens_per_s']:8.1f} | {b['tokens_per_s']:11.1f} | "
              f"{b['tokens_per_s'] / a['tokens_per_s']:5.3f} | {timed.seconds:14.2f} | {a['perplexity']:6.2f} | "
              f"{b['perplexity']:6.2f}", flush=True)
    ratio = statistics.median(spalm_rates) / statistics.median(xl_rates)
    print(f"# SPALM / base+XL evaluation tokens/s = {ratio:.3f} (medians of {args.repeats} interleaved repeats: "
          f"{statistics.median(spalm_rates):.1f} vs {statistics.median(xl_rates):.1f} tok/s)")
    _common.synthetic_banner(synthetic)
    result.settings = {"model": bench.name, "dtype": "float32", "datastore": described,
                       "split": "random tokens" if random_tokens else f"sotu {args.split}",
                       "tokens": sum(map(len, docs)), "segment": segment, "mem_len": mem_len,
                       "sink_tokens": base.sink_tokens, "k": args.k, "repeats": args.repeats,
                       "threads": torch.get_num_threads(), "statistic": "ratio of the medians, interleaved repeats"}
    result.figures = {"spalm_over_xl": ratio, "xl_tokens_per_s": harness.stats(xl_rates),
                      "spalm_tokens_per_s": harness.stats(spalm_rates), "spalm_search_s": harness.stats(search_s)}
    result.write()


if __name__ == "__main__":
    main()
