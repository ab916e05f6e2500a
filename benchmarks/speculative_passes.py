"""Where greedy kNN-LM decoding's time goes, plain vs speculative: the engine's forward passes timed
by the positions they feed, with the GEMM's share (memlm.model.cpu_gemm.linear: the weights' products) and the rest
of the pass (attention, norms, the layers' small operations); the time a step spends outside its pass (search,
mixture, drafting, acceptance); and, for the speculative side, the tokens each pass yields by its positions.

The same setting, prompts and defaults as benchmarks/speculative_knnlm.py (its --datastore, --split, --prompts ...),
the sides alternating over --repeats rounds; each round prints its own table, so what a figure of that benchmark
was made of can be read next to it. Why: the ratio of the two sides is a x P1 / Pk, a the tokens a verifying pass
yields, P1 plain's step and Pk a verifying pass; this shows each term.

Instrumented by wrapping memlm.engine.passes.run, memlm.model.cpu_gemm.linear and (speculative side) the verifying
pass's hand-off (memlm.engine.speculative._emit) with perf_counter checkpoints; the wrappers cost a few microseconds a
call, on both sides alike.

    OMP_NUM_THREADS=2 python benchmarks/speculative_passes.py [--prompts 8] [--new-tokens 64] [--repeats 2]
        [--search-backend torch] [--results DIR]

Writes docs/results/data/speculative_passes.json (benchmarks/harness.py): a row per round, side and pass size.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict

import harness
import speculative_knnlm as bench_setting

from memlm.engine import passes, speculative
from memlm.engine.drafts import SpeculativeConfig, draft_source
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.model import cpu_gemm


class Recorder:
    """Per pass: its positions, seconds, GEMM seconds; per speculative pass the tokens it yielded; the steps'
    seconds in all."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float, float]] = []
        self.yielded: list[tuple[int, int]] = []  # (positions of the verifying pass, tokens it yielded)
        self.gemm = 0.0
        self.positions = 0

    def clear(self) -> None:
        self.passes.clear()
        self.yielded.clear()


def instrument(recorder: Recorder) -> None:
    """Wrap the engine's pass, the decoder's GEMM and the verifying pass's hand-off (module docstring)."""
    run, linear, emit = passes.run, cpu_gemm.linear, speculative._emit

    def timed_run(engine, plan, **kwargs):
        recorder.gemm, start = 0.0, time.perf_counter()
        out = run(engine, plan, **kwargs)
        recorder.positions = sum(n for _, n in plan)
        recorder.passes.append((recorder.positions, time.perf_counter() - start, recorder.gemm))
        return out

    def timed_linear(*args, **kwargs):
        start = time.perf_counter()
        out = linear(*args, **kwargs)
        recorder.gemm += time.perf_counter() - start
        return out

    def counted_emit(engine, row, start, tokens, *rest):
        recorder.yielded.append((recorder.positions, len(tokens)))
        return emit(engine, row, start, tokens, *rest)

    passes.run, cpu_gemm.linear, speculative._emit = timed_run, timed_linear, counted_emit


def report(side: str, recorder: Recorder, wall: float, steps: int, result: harness.Result, round_: int) -> None:
    """One side's round: a line per pass size, then the time outside the passes."""
    by_size: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for n, seconds, gemm in recorder.passes:
        by_size[n].append((seconds, gemm))
    tokens: dict[int, list[int]] = defaultdict(list)
    for n, count in recorder.yielded:
        tokens[n].append(count)
    for n in sorted(by_size):
        pass_ms = statistics.median(s for s, _ in by_size[n]) * 1e3
        gemm_ms = statistics.median(g for _, g in by_size[n]) * 1e3
        yielded = f", {statistics.mean(tokens[n]):.2f} tokens a pass" if tokens.get(n) else ""
        print(f"  {side} {n:3d} positions: {len(by_size[n]):4d} passes, median {pass_ms:5.1f} ms (GEMM {gemm_ms:5.1f}, "
              f"the rest {pass_ms - gemm_ms:5.1f}){yielded}")
        result.rows.append({"round": round_, "side": side, "positions": n, "passes": len(by_size[n]),
                            "pass_ms": pass_ms, "gemm_ms": gemm_ms, "rest_ms": pass_ms - gemm_ms,
                            **({"tokens_a_pass": statistics.mean(tokens[n])} if tokens.get(n) else {})})
    outside = wall - sum(s for _, s, _ in recorder.passes)
    result.rows.append({"round": round_, "side": side, "wall_s": wall, "passes": len(recorder.passes),
                        "outside_ms_a_step": outside / steps * 1e3, "steps": steps})
    print(f"  {side}: wall {wall:.2f} s, {len(recorder.passes)} passes, outside the passes {outside / steps * 1e3:.2f} "
          f"ms a step ({steps} steps)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_setting.add_setting_options(p)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds, each printed")
    harness.add_options(p, "speculative_passes")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    args.in_datastore = False  # held_apart_prompts reads it: the prompts are held apart
    bench, store = bench_setting.open_setting(args)
    knn = bench_setting.knn_settings(args)
    prompts = bench_setting.held_apart_prompts(bench, store, args)
    engine = Engine(bench.pre.model, bench.pre.tokenizer, EngineConfig(max_batch=1), store,
                    draft_source(store.provenance, store.values))
    plain = [GenerationRequest(q, args.new_tokens, bench_setting.GREEDY, boundary_token=bench.boundary, knn=knn)
             for q in prompts]
    sides: dict[str, list[GenerationRequest]] = {
        "plain": plain,
        "speculative": [dataclasses.replace(r, speculative=SpeculativeConfig()) for r in plain],
    }
    print(f"# {len(prompts)} prompts of {args.prompt_tokens} tokens from {args.split}, {args.new_tokens} new tokens "
          f"greedy kNN-LM (k {knn.k}, lambda {knn.lmbda}), speculative with SpeculativeConfig's defaults; "
          f"{args.repeats} rounds", flush=True)
    recorder = Recorder()
    instrument(recorder)
    steps = engine.step
    counted = [0]

    def counted_step(*a, **k):
        counted[0] += 1
        return steps(*a, **k)

    engine.step = counted_step  # type: ignore[method-assign]
    for reqs in sides.values():  # warm-up, untimed (as benchmarks/speculative_knnlm.py)
        _timed(engine, reqs[:1])
    for r in range(args.repeats):
        print(f"# round {r + 1}")
        for side, reqs in sides.items():
            recorder.clear()
            counted[0] = 0
            wall = _timed(engine, reqs)
            report(side, recorder, wall, counted[0], result, r + 1)
    info = store.info()
    result.settings = {"model": bench.name, "dtype": args.dtype, "datastore": args.datastore, "entries": info.n,
                       "index": info.index, "search_backend": args.search_backend, "k": knn.k, "lambda": knn.lmbda,
                       "split": args.split, "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens, "repeats": args.repeats,
                       "speculative": "SpeculativeConfig's defaults"}
    result.write()


def _timed(engine: Engine, requests: list[GenerationRequest]) -> float:
    start = time.perf_counter()
    run_all(engine, requests)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
