"""What does gRPC cost on top of an in-process search? (goal: remote <= 1.15x local time)

One Flat index of random vectors (default 50k x 576, k = 1024) is searched in-process and through a
retrieval server running in a child process (the same index, rebuilt from the same seed), at 256
and 1024 queries per call, alternating local and remote calls so that both see the same machine
load. Prints the median times and their ratio; both must give identical neighbours in every repeat (the
command exits 1 otherwise). Random keys by design: the figure measures the wire, not a model.

    python benchmarks/grpc_overhead.py [--n 50000] [--d 576] [--k 1024] [--repeats 3] [--results DIR]

Writes docs/results/data/grpc_overhead.json (benchmarks/harness.py).

Shape legend: N datastore entries, d key dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import harness  # noqa: E402  (puts the repository on sys.path)

REPO = harness.ROOT

from memlm.retrieval.searcher import Neighbors, SearcherInfo, SearchOptions


class FlatSearcher:
    """faiss.IndexFlatL2 over random keys with random next-token values."""

    def __init__(self, n: int, d: int, seed: int = 0) -> None:
        import faiss

        rng = np.random.default_rng(seed)
        keys = rng.standard_normal((n, d), dtype=np.float32)  # (N, d)
        self.values = rng.integers(0, 49152, size=n).astype(np.int32)  # (N,)
        self.index = faiss.IndexFlatL2(d)
        self.index.add(keys)
        self.dim = d

    def info(self) -> SearcherInfo:
        return SearcherInfo(n=self.index.ntotal, dim=self.dim, index="Flat", metric="l2", nprobe=1, key_layer="random",
                            model_name="bench", model_fingerprint="bench", tokenizer_fingerprint="bench",
                            corpus="random keys", corpus_fingerprint="bench", context=0, stride=0, boundary_token=-1,
                            sink_tokens=0)

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        distances, ids = self.index.search(xq, k)  # (Q, k) each
        return Neighbors(distances, ids, self.values[ids])


def serve(args) -> None:
    from services.retrieval.server import BatchingOptions, serve_retrieval

    searcher = FlatSearcher(args.n, args.d)
    batching = BatchingOptions(micro_batching=not args.no_micro_batching, search_threads=args.search_threads)
    asyncio.run(serve_retrieval(searcher, "127.0.0.1", 0, batching=batching))


def start_server(args, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, __file__, "--serve", "--n", str(args.n), "--d", str(args.d), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()  # the server prints one line once it is healthy
    if not line.startswith("listening on "):
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.removeprefix("listening on ")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--d", type=int, default=576)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--batches", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-micro-batching", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--search-threads", type=int, default=1, help=argparse.SUPPRESS)
    harness.add_options(p, "grpc_overhead")
    args = p.parse_args()
    if args.serve:
        return serve(args)
    result = harness.Result.from_args(args)
    result.children = True  # the retrieval server

    from services.retrieval.client import RetrievalClient

    local = FlatSearcher(args.n, args.d)
    proc, address = start_server(args)
    try:
        client = RetrievalClient(address, timeout=600)
        rng = np.random.default_rng(1)
        print(f"synthetic keys (random vectors, no model: this measures the wire); Flat index N={args.n} d={args.d}, k={args.k}, median of {args.repeats}; server in a child process at {address}")
        print(f"{'Q':>6} {'local s':>9} {'remote s':>9} {'ratio':>7}  identical")
        for q in args.batches:
            xq = rng.standard_normal((q, args.d), dtype=np.float32)  # (Q, d)
            client.search(xq[:8], args.k)  # warm up the channel
            t_local, t_remote, same_rounds = [], [], []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                a = local.search(xq, args.k)
                t_local.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                b = client.search(xq, args.k)
                t_remote.append(time.perf_counter() - t0)
                same_rounds.append(all(np.array_equal(x, y) for x, y in zip(a, b)))
                result.check(f"remote neighbours identical to local, Q {q}, repeat {r + 1}", same_rounds[-1])
            same = all(same_rounds)
            lm, rm = statistics.median(t_local), statistics.median(t_remote)
            print(f"{q:>6} {lm:>9.3f} {rm:>9.3f} {rm / lm:>6.3f}x  {same}", flush=True)
            result.rows.append({"queries": q, "local_s": harness.stats(t_local), "remote_s": harness.stats(t_remote),
                                "remote_over_local": rm / lm, "identical": same})
        client.close()
        result.settings = {"keys": "random vectors (no model: the wire's cost)", "index": "Flat", "n": args.n,
                           "d": args.d, "k": args.k, "repeats": args.repeats, "statistic": "median, alternating"}
    finally:
        proc.terminate()
        proc.wait(60)
    result.write()  # after the server's exit: its peak memory is the children's


if __name__ == "__main__":
    main()
