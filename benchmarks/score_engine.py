"""Score on the decoding engine vs the library's score_tokens, side by side in one run.

The same inputs scored in the server's sliding windows both ways: the library runs `batch_size` windows a
forward pass (services.lm.requests.LMLimits.step_rows: as many windows as --step-tokens hold, what the Score
rpc's library path ran); the engine reads each input's windows in score rows, an input split over
max_batch / inputs rows (memlm.engine.score_rows.split), every row in the same steps. Both score every token
exactly once with the same windows; the script prints tokens/s of each, their ratio (best of --repeats,
interleaved), the largest base log-prob difference and whether the greedy flags agree: they must, in every
repeat (the command exits 1 otherwise).

    python benchmarks/score_engine.py [--inputs 4 --tokens 512 --window 256 --stride 128 --repeats 2] [--results DIR]

Writes docs/results/data/score_engine.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import time

import _common
import harness
import numpy as np
import torch

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, ScoreRequest
from memlm.engine.score_rows import join_scores, split
from memlm.jobs.scoring import score_tokens
from services.lm.requests import LMLimits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--inputs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512, help="tokens per input (from 2003+ SOTU speeches)")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--stride", type=int, default=128)
    p.add_argument("--step-tokens", type=int, default=1024, help="tokens a forward pass (LMLimits.max_step_tokens)")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    _common.add_synthetic_flag(p)
    harness.add_options(p, "score_engine")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    bench = _common.load_model(args.model, args.synthetic)
    model, tokenizer, boundary = bench.pre.model, bench.pre.tokenizer, bench.boundary
    docs, random_tokens = _common.load_tokens(bench, "sotu", "year>=2003", args.inputs * args.tokens, args.synthetic)
    result.set_synthetic(bench.synthetic or random_tokens)
    text = [t for d in docs for t in d]
    seqs = [text[i * args.tokens : (i + 1) * args.tokens] for i in range(args.inputs)]
    rows = LMLimits(max_step_tokens=args.step_tokens).step_rows(args.window)  # windows a library pass
    parts = min(rows, max(1, args.max_batch // args.inputs))

    def library():
        return score_tokens(model, seqs, context=args.window, stride=args.stride, boundary_token=boundary,
                            batch_size=rows), None

    def engine():
        e = Engine(model, tokenizer, EngineConfig(max_batch=args.max_batch, prefill_chunk=args.step_tokens))
        requests = [split(ScoreRequest(tuple(s), boundary, window=(args.window, args.stride)), parts) for s in seqs]
        events = iter([ev for (ev,) in run_all(e, [r for rs in requests for r in rs])])
        return [join_scores([next(events) for _ in rs]) for rs in requests], e.steps

    times: dict[str, list[float]] = {"library": [], "engine": []}
    results = {}
    diffs = []
    for r in range(args.repeats):
        for name, run in (("library", library), ("engine", engine)):
            t0 = time.perf_counter()
            results[name] = run()
            times[name].append(time.perf_counter() - t0)
        (lib, _), (eng, steps) = results["library"], results["engine"]
        diffs.append(max(float(np.abs(x.base_logprob - y.base_logprob).max()) for x, y in zip(eng, lib)))
        result.check(f"greedy flags of the engine equal the library's, repeat {r + 1}",
                     all(bool((x.greedy == y.greedy).all()) for x, y in zip(eng, lib)))
    diff, same = max(diffs), all(c["ok"] for c in result.checks)
    n = sum(len(s) for s in seqs)
    tl, te = min(times["library"]), min(times["engine"])
    print(f"{bench.name}: {args.inputs} inputs x {args.tokens} tokens, window {args.window} stride {args.stride}, "
          f"{rows} windows a library pass, {parts} engine rows an input; torch threads {torch.get_num_threads()}")
    print(f"library {n / tl:.0f} tokens/s ({tl:.2f} s), engine {n / te:.0f} tokens/s ({te:.2f} s, {steps} steps): "
          f"engine / library {tl / te:.2f}x; max |base log-prob diff| {diff:.2e}; greedy flags equal: {same}")
    result.settings = {"model": bench.name, "dtype": "float32", "inputs": args.inputs, "tokens": args.tokens,
                       "window": args.window, "stride": args.stride, "step_tokens": args.step_tokens,
                       "max_batch": args.max_batch, "library_windows_a_pass": rows, "engine_rows_an_input": parts,
                       "repeats": args.repeats, "threads": torch.get_num_threads(),
                       "statistic": "best of the interleaved repeats"}
    result.figures = {"library_tokens_per_s": n / tl, "engine_tokens_per_s": n / te, "engine_over_library": tl / te,
                      "engine_steps": steps, "max_base_logprob_diff": diff, "greedy_flags_equal": same,
                      "library_runs_s": harness.stats(times["library"]), "engine_runs_s": harness.stats(times["engine"])}
    result.write()


if __name__ == "__main__":
    main()
