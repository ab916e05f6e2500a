"""Per-shard figures for `memlm plan`, and the retrieval tier's ratios, on the machine it runs on.

Sections (all by default; --only picks some):
  scan     the cost model of one IVF-PQ shard search on ONE thread: a fixed cost per query, a cost per
           probed list (its look-up table), a cost per PQ code scanned (fitted over nprobe on two indexes of
           --n random vectors of --dim, IVF{--nlist},PQ{--pq} and IVF{--nlist-small},PQ{--pq}), and the coarse
           quantizer's cost per centroid (a Flat search over --coarse-lists centroids)
  ondisk   the same index with its lists on disk (OnDiskInvertedLists; page cache warm) vs in memory, at
           the same nprobe: time ratio, and that the neighbours are identical
  router   one retrieval server over a Flat index of --router-n vectors vs a router over 2 servers holding
           its halves (all real gRPC on the one machine): time ratio per call (goal <= 1.2x), same answers
  ray      (only when named) `memlm datastore build` of --ray-tokens of --ray-data with --ray-model, in one
           process vs --ray local --workers 2 on the same cores: time ratio (goal <= 1.25x), same files?

Writes the figures to --out (default memlm/cli/shard_capacity.json, which `memlm plan` reads) and prints
them, and writes the run's result through benchmarks/harness.py (docs/results/data/shard_capacity.json, or
--results DIR). Random vectors: the figures are speeds (they depend on N, d, nlist and the code size, not on the
data), and the search threads of a real shard multiply them. The on-disk index and the router must give the
same neighbours as the in-memory index and the one server (the command exits 1 otherwise, writing neither file).

    python benchmarks/shard_capacity.py [--n 200000] [--dim 576] [--nlist 1024] [--pq 64] [--only scan]
        [--results DIR]

Shape legend: N vectors, d dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402  (benchmarks/ is this script's folder)

DEFAULT_OUT = ROOT / "memlm" / "cli" / "shard_capacity.json"


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_ivfpq(n: int, d: int, nlist: int, m: int, seed: int = 0):
    import faiss

    from datastore.index import make_index

    rng = np.random.default_rng(seed)
    xb = rng.standard_normal((n, d), dtype=np.float32)  # (N, d)
    index = make_index(f"IVF{nlist},PQ{m}", d)
    index.train(xb[: min(n, max(40 * nlist, 256 * 40))])
    index.add(xb)
    return index, xb, faiss


def scan_figures(args) -> tuple[dict, object, np.ndarray]:
    """Fit seconds per query = fixed + per_list * nprobe + per_code * codes scanned, over two indexes of the
    same vectors whose lists hold few and many codes (a list costs its look-up table, a code its m look-ups)."""
    import faiss

    faiss.omp_set_num_threads(1)  # per-core figures: the plan multiplies them by the cores of a replica
    rng = np.random.default_rng(1)
    rows, kept = [], None
    for nlist in (args.nlist, args.nlist_small):
        index, xb, _ = build_ivfpq(args.n, args.dim, nlist, args.pq)
        xq = xb[rng.choice(args.n, args.queries, replace=False)] + 0.1 * rng.standard_normal(
            (args.queries, args.dim), dtype=np.float32)  # (Q, d)
        for nprobe in (4, 16, 64):
            if nprobe >= nlist:
                continue
            params = faiss.SearchParametersIVF(nprobe=nprobe)
            seconds = timed(lambda p=params, i=index, q=xq: i.search(q, args.k, params=p), args.repeats)
            rows.append((nlist, nprobe, nprobe * args.n / nlist, seconds / args.queries))
        kept = kept or (index, xq)  # the first (args.nlist) serves the on-disk comparison
    design = np.array([[1.0, r[1], r[2]] for r in rows])  # (points, 3): fixed, per list, per code
    fixed, per_list, per_code = np.linalg.lstsq(design, np.array([r[3] for r in rows]), rcond=None)[0]
    xq = kept[1]
    centroids = rng.standard_normal((args.coarse_lists, args.dim), dtype=np.float32)  # (L, d)
    coarse = faiss.IndexFlatL2(args.dim)
    coarse.add(centroids)
    coarse_s = timed(lambda: coarse.search(xq, 64), args.repeats) / args.queries
    figures = {
        "pq_m": args.pq, "dim": args.dim, "n": args.n, "nlist": args.nlist, "nlist_small": args.nlist_small,
        "threads": 1,
        "ns_per_code": max(per_code, 0.0) * 1e9,
        "us_per_list": max(per_list, 0.0) * 1e6,
        "us_per_query_fixed": max(fixed, 0.0) * 1e6,
        "ns_per_coarse_list": coarse_s / args.coarse_lists * 1e9,
        "fit": [{"nlist": nl, "nprobe": npb, "codes_scanned": int(c), "us_per_query": s * 1e6}
                for nl, npb, c, s in rows],
    }
    return figures, kept[0], xq


def ondisk_figures(args, index, xq) -> dict:
    import faiss

    from datastore import index as index_lib

    faiss.omp_set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work"
        (work / "blocks").mkdir(parents=True)
        trained = faiss.clone_index(index)
        trained.reset()
        index_lib.write_index(trained, work / index_lib.TRAINED_NAME)
        block = work / "blocks" / "block-00000.faiss"
        index_lib.write_index(index, block)  # one block: the whole in-memory index
        index_lib.merge_blocks_into(Path(tmp) / "index.faiss", work, [block])
        disk = index_lib.read_index(Path(tmp) / "index.faiss")
        params = faiss.SearchParametersIVF(nprobe=args.nprobe)
        memory_s = timed(lambda: index.search(xq, args.k, params=params), args.repeats)
        disk_s = timed(lambda: disk.search(xq, args.k, params=params), args.repeats)
        same = bool((index.search(xq, args.k, params=params)[1] == disk.search(xq, args.k, params=params)[1]).all())
        lists_mib = (Path(tmp) / index_lib.IVFDATA_NAME).stat().st_size / 2**20
    return {"nprobe": args.nprobe, "memory_ms_per_query": memory_s / len(xq) * 1e3,
            "disk_ms_per_query": disk_s / len(xq) * 1e3, "ratio": disk_s / memory_s, "same_neighbours": same,
            "lists_mib": lists_mib, "note": "page cache warm: a cold disk adds a read per probed list"}


def router_figures(args) -> dict:
    import faiss

    from memlm.retrieval.searcher import Neighbors, SearcherInfo
    from services.retrieval.client import RetrievalClient
    from services.retrieval.server import create_retrieval_server
    from services.router.server import create_router_server

    class Flat:
        def __init__(self, keys, values):
            self.index = faiss.IndexFlatL2(keys.shape[1])
            self.index.add(keys)
            self.values, self.n, self.dim = values, len(keys), keys.shape[1]

        def info(self):
            return SearcherInfo(n=self.n, dim=self.dim, index="Flat", metric="l2", nprobe=1, key_layer="bench",
                                model_name="bench", model_fingerprint="m", tokenizer_fingerprint="t", corpus="random",
                                corpus_fingerprint="c", context=1, stride=1, boundary_token=0, sink_tokens=0)

        def search(self, xq, k, options=None):
            d, i = self.index.search(np.ascontiguousarray(xq, dtype=np.float32), k)  # (Q, k) each
            return Neighbors(d, i, self.values[np.maximum(i, 0)].astype(np.int32))

    faiss.omp_set_num_threads(1)  # each server searches on one thread: the two shards run side by side
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((args.router_n, args.dim), dtype=np.float32)  # (N, d)
    values = rng.integers(0, 49152, args.router_n).astype(np.int32)  # (N,)
    half = args.router_n // 2
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    whole = run(create_retrieval_server("127.0.0.1:0", Flat(keys, values)))
    parts = [run(create_retrieval_server("127.0.0.1:0", Flat(keys[s : s + half], values[s : s + half])))
             for s in (0, half)]
    router = run(create_router_server("127.0.0.1:0", [f"127.0.0.1:{p}" for _, p in parts]))
    xq = rng.standard_normal((args.router_queries, args.dim), dtype=np.float32)  # (Q, d)
    with RetrievalClient(f"127.0.0.1:{whole[1]}") as one, RetrievalClient(f"127.0.0.1:{router[1]}") as two:
        same = bool((one.search(xq, args.k).ids == two.search(xq, args.k).ids).all())
        one_s, two_s = [], []
        for _ in range(args.repeats):  # alternate, so both see the same machine load
            one_s.append(timed(lambda: one.search(xq, args.k), 1))
            two_s.append(timed(lambda: two.search(xq, args.k), 1))
    for server, _ in (whole, *parts, router):
        run(server.stop(None))
    one_m, two_m = statistics.median(one_s), statistics.median(two_s)
    return {"n": args.router_n, "queries": args.router_queries, "k": args.k, "one_index_ms": one_m * 1e3,
            "router_2_shards_ms": two_m * 1e3, "ratio": two_m / one_m, "same_neighbours": same,
            "cpus": os.cpu_count()}


def ray_figures(args) -> dict:
    """The same build twice on the same cores: in one process, then on a local Ray of --workers 2."""
    import shutil

    from datastore import build_datastore
    from datastore.ray_build import RayOptions

    # shard_batches 1: 4 windows (of 1024 tokens, stride 512) a shard, so a few thousand tokens give both workers
    # shards.
    common = {"model": args.ray_model, "data": args.ray_data, "max_tokens": args.ray_tokens, "index": "Flat",
              "device": "cpu", "dtype": "float32", "progress": False, "overwrite": True, "shard_batches": 1}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        build_datastore(out=Path(tmp) / "local", **common)
        local_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        build_datastore(out=Path(tmp) / "ray", ray=RayOptions(address="local", workers=2), **common)
        ray_s = time.perf_counter() - t0  # includes starting Ray and loading the model in each actor
        same = all((Path(tmp) / "local" / f).read_bytes() == (Path(tmp) / "ray" / f).read_bytes()
                   for f in ("keys.f16", "values.i32", "index.faiss"))
        shutil.rmtree(tmp, ignore_errors=True)
    return {"model": args.ray_model, "data": args.ray_data, "tokens": args.ray_tokens, "workers": 2, "shard_batches": 1,
            "local_s": local_s, "ray_s": ray_s, "ratio": ray_s / local_s, "same_files": same,
            "note": "one process uses all cores' threads; each Ray actor one thread (its keys may differ in the "
                    "last bits: float sums in another order); Ray start-up and per-actor model loads included"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200_000, help="vectors of the scan index")
    p.add_argument("--dim", type=int, default=576, help="dimension d (SmolLM2's 576)")
    p.add_argument("--nlist", type=int, default=1024, help="lists of the scan index (few codes a list)")
    p.add_argument("--nlist-small", type=int, default=64, help="lists of the second scan index (many codes a list)")
    p.add_argument("--pq", type=int, default=64, help="PQ bytes per code")
    p.add_argument("--coarse-lists", type=int, default=65536, help="centroids of the coarse-cost measurement")
    p.add_argument("--nprobe", type=int, default=32, help="nprobe of the on-disk comparison")
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--router-n", type=int, default=100_000)
    p.add_argument("--router-queries", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ray-model", default="smollm2-135m", help="model of the ray section's builds")
    p.add_argument("--ray-data", default="sotu", help="corpus of the ray section's builds")
    p.add_argument("--ray-tokens", type=int, default=8000, help="tokens of the ray section's builds")
    p.add_argument("--only", nargs="+", choices=["scan", "ondisk", "router", "ray"],
                   default=["scan", "ondisk", "router"], help="sections to measure (ray: not by default, minutes)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    harness.add_options(p, "shard_capacity")
    args = p.parse_args()
    record = harness.Result.from_args(args)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), {platform.python_version()}",
              "measured_unix": int(time.time()), "command": " ".join(sys.argv)}
    if args.out.exists():
        result = {**json.loads(args.out.read_text()), **result}  # sections not rerun keep their figures
    if "scan" in args.only or "ondisk" in args.only:
        scan, index, xq = scan_figures(args)
        if "scan" in args.only:
            result["scan"] = scan
        if "ondisk" in args.only:
            result["ondisk"] = ondisk_figures(args, index, xq)
    if "router" in args.only:
        result["router"] = router_figures(args)
    if "ray" in args.only:
        result["ray"] = ray_figures(args)
    for section in ("ondisk", "router"):
        if section in args.only:
            record.check(f"{section}: the same neighbours", result[section]["same_neighbours"])
    record.settings = {"sections": " ".join(args.only), "vectors": "random (speeds do not depend on the data)",
                       "n": args.n, "dim": args.dim, "nlist": args.nlist, "nlist_small": args.nlist_small,
                       "pq": args.pq, "k": args.k, "queries": args.queries, "repeats": args.repeats,
                       "statistic": "median after one warm-up call", "plan_figures": str(args.out)}
    for section in args.only:
        for key, value in result[section].items():
            if isinstance(value, list):  # the scan's fit points
                record.rows += [{"section": section, **point} for point in value]
            else:
                record.figures[f"{section}_{key}"] = value
    record.write()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
