"""What one forward pass costs by the positions it feeds after a cache (a plain decode step feeds 1, a speculative
verifying pass 1 + its draft tree's nodes): the whole pass, its Linear products (memlm.model.decoder.Linear, on the GEMM
memlm.model.cpu_gemm picks), and the rest (attention, norms, rotary, the Python of every layer); then
the torch exact search of a datastore's keys by the number of queries (a verifying pass searches several at once).

Positions are timed round-robin (each round feeds every count once) after --cache tokens, so a drift of the machine
touches all counts alike; medians over the rounds after the first two. Random token ids and random queries: what a
pass and an exact search cost does not depend on the values.

    OMP_NUM_THREADS=1 python benchmarks/pass_cost.py [--positions 1,2,4,8,9,16,17] [--rounds 12] [--cache 128]
        [--datastore DS] [--queries 1,2,3,4,8] [--synthetic] [--results DIR]

Writes docs/results/data/pass_cost.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path

import _common
import harness
import numpy as np
import torch

from memlm.model.decoder import KVCache, Linear

DEFAULT_DATASTORE = str(Path.home() / ".cache/memlm/demo/ds-sotu-1990-2000")


class ProductClock:
    """Wall seconds spent inside the model's Linear layers, summed (forward pre- and post-hooks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds = 0.0
        self._started = 0.0
        for module in model.modules():
            if isinstance(module, Linear):
                module.register_forward_pre_hook(self._start)
                module.register_forward_hook(self._stop)

    def _start(self, *_: object) -> None:
        self._started = time.perf_counter()

    def _stop(self, *_: object) -> None:
        self.seconds += time.perf_counter() - self._started


def median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values[2:] if len(values) > 4 else values)


def forward_times(model, positions: list[int], rounds: int, cache_tokens: int, count_products: bool = True
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """Median ms of a forward pass feeding n positions after a cache of cache_tokens, and of its Linear products
    (count_products: hooks on every Linear, left on the model, which they slow; else none and {}), for each n of
    `positions` (round-robin, random token ids)."""
    clock = ProductClock(model) if count_products else None
    vocab = model.config.vocab_size
    whole: dict[int, list[float]] = defaultdict(list)
    products: dict[int, list[float]] = defaultdict(list)
    with torch.no_grad():
        prompt = torch.randint(0, vocab, (1, cache_tokens))  # (1, cache)
        cache = model(prompt, KVCache.empty(model.config, cache_tokens + max(positions) + 1)).state
        for _ in range(rounds):
            for n in positions:
                ids = torch.randint(0, vocab, (1, n))  # (1, n), fed after the cache, which is not extended
                if clock is not None:
                    clock.seconds = 0.0
                start = time.perf_counter()
                model(ids, cache)
                whole[n].append(time.perf_counter() - start)
                if clock is not None:
                    products[n].append(clock.seconds)
    return {n: median_ms(whole[n]) for n in positions}, {n: median_ms(v) for n, v in products.items()}


def pass_costs(model, positions: list[int], rounds: int, cache_tokens: int, result: harness.Result | None = None
               ) -> None:
    whole, products = forward_times(model, positions, rounds, cache_tokens)
    print(f"# forward pass after a {cache_tokens}-token cache, ms (median of {rounds} rounds, round-robin)")
    for n in positions:
        w, p = whole[n], products[n]
        print(f"positions {n:3d}: pass {w:6.1f}, Linear products {p:6.1f}, the rest {w - p:5.1f}; "
              f"{w / whole[positions[0]]:.2f}x {positions[0]} position(s)", flush=True)
        if result is not None:
            result.rows.append({"positions": n, "pass_ms": w, "linear_ms": p, "rest_ms": w - p,
                                f"over_{positions[0]}_positions": w / whole[positions[0]]})


def search_times(store, queries: list[int], rounds: int, k: int = 1024) -> dict[int, float]:
    """Median ms of one search of q random queries, k neighbours, for each q of `queries` (round-robin)."""
    rng = np.random.default_rng(0)
    times: dict[int, list[float]] = defaultdict(list)
    xq = rng.standard_normal((max(queries), store.info().dim)).astype(np.float32)  # (Q, d)
    store.search(xq[:1], k)  # the first search makes the CPU copy of the keys
    for _ in range(rounds):
        for q in queries:
            start = time.perf_counter()
            store.search(xq[:q], k)
            times[q].append(time.perf_counter() - start)
    return {q: median_ms(times[q]) for q in queries}


def search_costs(datastore: str, queries: list[int], rounds: int, device: str,
                 result: harness.Result | None = None) -> None:
    from datastore import Datastore

    store = Datastore.open(datastore, backend="torch", device=device)
    times = search_times(store, queries, rounds)
    print(f"# torch exact search of {datastore} ({store.info().n} keys), k 1024, ms (median of {rounds} rounds)")
    for q in queries:
        print(f"queries {q:3d}: {times[q]:6.2f}", flush=True)
        if result is not None:
            result.rows.append({"queries": q, "search_ms": times[q], "datastore_entries": store.info().n})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", default="1,2,4,8,9,16,17")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--cache", type=int, default=128, help="tokens in the cache before each timed pass")
    p.add_argument("--datastore", default=DEFAULT_DATASTORE, help="a datastore built by scripts/demo.sh; '' skips")
    p.add_argument("--queries", default="1,2,3,4,8")
    _common.add_synthetic_flag(p)
    harness.add_options(p, "pass_cost")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    bench = _common.load_model(None, args.synthetic)
    model = bench.pre.model
    result.set_synthetic(bench.synthetic)
    weights = " (SYNTHETIC: random weights, speed only)" if bench.synthetic else " (SmolLM2-135M-Instruct Q4_1, in float32)"
    print(f"# {bench.name}{weights} | torch threads {torch.get_num_threads()}")
    pass_costs(model, [int(n) for n in args.positions.split(",")], args.rounds, args.cache, result)
    searched = bool(args.datastore and not args.synthetic)
    if searched:
        if not Path(args.datastore).is_dir():
            raise SystemExit(f"no datastore at {args.datastore}: run `make demo` or pass --datastore ''")
        search_costs(args.datastore, [int(q) for q in args.queries.split(",")], args.rounds, str(model.device),
                     result)
    result.settings = {"model": bench.name, "dtype": "float32", "threads": torch.get_num_threads(),
                       "cache_tokens": args.cache, "rounds": args.rounds, "positions": args.positions,
                       "datastore": args.datastore if searched else None, "queries": args.queries if searched else None,
                       "statistic": "median over the rounds after the first two, round-robin"}
    result.write()


if __name__ == "__main__":
    main()
