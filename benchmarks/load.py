"""Load on one retrieval server: 16 concurrent clients, with and without micro-batching.

Goals: 0 errors, micro-batching >= 1.5x the throughput of the best server that searches every
call on its own (the best unbatched configuration, not one thread). The unbatched server is
tried with --search-threads worker threads each (BatchingOptions.search_threads: that many calls
searched at once; FAISS CPU search is thread-safe) and the best of them is the baseline. Each
configuration gets a fresh server in a child process (the same Flat index of random vectors, rebuilt
from one seed: synthetic keys by design, no model); 16 client threads, each with its own channel, make
a fixed number of Search calls. Prints throughput (queries/s and calls/s), p50/p99 call latency,
errors, and the server's resident memory (VmRSS) before and after the load, then the throughput
ratio against the best unbatched row. All rows come from one run. No assertions.

    python benchmarks/load.py [--clients 16] [--calls 20] [--queries 1] [--k 32] [--n 50000] [--d 576]
        [--search-threads 1 2 4] [--results DIR]

Writes docs/results/data/load.json (benchmarks/harness.py).

Shape legend: N datastore entries, d key dimension, Q queries per call, k neighbours.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402
from grpc_overhead import start_server  # noqa: E402  (same child-process server)


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_load(address: str, args) -> dict:
    from services.retrieval.client import RetrievalClient

    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(args.clients)

    def client_thread(c: int) -> None:
        rng = np.random.default_rng(100 + c)
        with RetrievalClient(address, timeout=120) as client:
            client.info()  # connect before the clock starts
            barrier.wait()
            for _ in range(args.calls):
                xq = rng.standard_normal((args.queries, args.d), dtype=np.float32)  # (Q, d)
                t0 = time.perf_counter()
                try:
                    client.search(xq, args.k)
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 -- counted and reported
                    with lock:
                        errors.append(repr(e))

    threads = [threading.Thread(target=client_thread, args=(c,)) for c in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = np.array(latencies) * 1000  # ms
    calls = args.clients * args.calls
    return dict(
        wall=wall,
        calls_s=len(latencies) / wall,
        queries_s=len(latencies) * args.queries / wall,
        p50=float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        p99=float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        errors=len(errors),
        calls=calls,
        first_error=errors[0] if errors else "",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--calls", type=int, default=20, help="Search calls per client")
    p.add_argument("--queries", type=int, default=1, help="queries per call (one token step of one sequence)")
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--d", type=int, default=576)
    p.add_argument("--search-threads", type=int, nargs="+", default=[1, 2, 4],
                   help="worker threads of the unbatched servers tried")
    harness.add_options(p, "load")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    result.children = True  # the servers

    print(
        f"{args.clients} clients x {args.calls} calls x {args.queries} queries, k={args.k}, "
        f"Flat N={args.n} d={args.d} of random vectors (synthetic keys, no model); server in a child process"
    )
    print(f"{'mode':<22} {'wall s':>7} {'calls/s':>8} {'queries/s':>9} {'p50 ms':>7} {'p99 ms':>8} {'errors':>6} {'RSS before':>10} {'RSS after':>9}")
    results = {}
    modes = [("micro-batching", [])] + [
        (f"unbatched, {t} thread{'s' if t > 1 else ''}", ["--no-micro-batching", "--search-threads", str(t)])
        for t in args.search_threads
    ]
    for mode, extra in modes:
        proc, address = start_server(args, extra)
        try:
            before = rss_mib(proc.pid)
            r = run_load(address, args)
            after = rss_mib(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
        results[mode] = r
        result.rows.append({"mode": mode, "wall_s": r["wall"], "calls_per_s": r["calls_s"],
                            "queries_per_s": r["queries_s"], "p50_ms": r["p50"], "p99_ms": r["p99"],
                            "errors": r["errors"], "calls": r["calls"], "server_rss_before_mib": before,
                            "server_rss_after_mib": after})
        print(
            f"{mode:<22} {r['wall']:>7.2f} {r['calls_s']:>8.1f} {r['queries_s']:>9.1f} {r['p50']:>7.1f} {r['p99']:>8.1f} "
            f"{r['errors']:>3}/{r['calls']:<3} {before:>7.0f} MiB {after:>6.0f} MiB",
            flush=True,
        )
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")
    unbatched = {mode: r for mode, r in results.items() if mode != "micro-batching" and r["errors"] == 0}
    if not unbatched:
        raise SystemExit("every unbatched configuration had errors; no baseline")
    best = max(unbatched, key=lambda mode: unbatched[mode]["calls_s"])
    ratio = results["micro-batching"]["calls_s"] / unbatched[best]["calls_s"]
    print(f"micro-batching throughput / best unbatched ({best}): {ratio:.2f}x")
    errors = results["micro-batching"]["errors"]
    result.settings = {"keys": "random vectors (no model: the server's batching)", "index": "Flat", "n": args.n,
                       "d": args.d, "k": args.k, "clients": args.clients, "calls_per_client": args.calls,
                       "queries_per_call": args.queries, "search_threads_tried": args.search_threads}
    result.figures = {"micro_batching_over_best_unbatched": ratio, "best_unbatched": best,
                      "micro_batching_errors": errors}
    result.headline("micro_batching", f"{ratio:.2f}x throughput, {errors} errors")
    result.write()


if __name__ == "__main__":
    main()
