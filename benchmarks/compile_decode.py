"""torch.compile of the decoder's forward vs eager, for the engine's batch-1 greedy decode: is
torch.compile worth using for the decode step? The same engine, prompt (--prompt-tokens of
2003+ SOTU text) and --new-tokens greedy tokens on both sides, best of two runs each after a warm-up (the
compiled side's first run, compilation included, is printed apart and recorded as its build time); every
compiled run's tokens must equal eager's (the command exits 1 otherwise).

    python benchmarks/compile_decode.py [--new-tokens 64] [--prompt-tokens 32] [--results DIR]

Writes docs/results/data/compile_decode.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import time

import _common
import harness
import torch

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    harness.add_options(p, "compile_decode")
    _common.add_synthetic_flag(p)
    args = p.parse_args()
    result = harness.Result.from_args(args)
    bench = _common.load_model(None, args.synthetic)
    model, tokenizer = bench.pre.model, bench.pre.tokenizer
    docs, random_tokens = _common.load_tokens(bench, "sotu", "year>=2003", 4 * args.prompt_tokens, args.synthetic)
    result.set_synthetic(bench.synthetic or random_tokens)
    request = GenerationRequest(tuple(docs[0][: args.prompt_tokens]), args.new_tokens,
                                sampling=SamplingConfig(temperature=0.0), boundary_token=bench.boundary)

    def run() -> tuple[list[int], float]:
        engine = Engine(model, tokenizer, EngineConfig(max_batch=1))
        t0 = time.perf_counter()
        (events,) = run_all(engine, [request])
        return [e.token_id for e in events if isinstance(e, TokenEvent)], time.perf_counter() - t0

    run()  # warm-up
    eager_tokens, eager_s = run()
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, dynamic=True)
    with result.build("torch.compile, first run (compilation included)"):
        first_tokens, first_s = run()
    compiled = [run(), run()]
    for i, (tokens, _) in enumerate([(first_tokens, first_s), *compiled]):
        result.check(f"compiled tokens equal eager's, run {i + 1}", tokens == eager_tokens)
    compiled_s = [s for _, s in compiled]
    model.forward = eager_forward
    eager_runs = [eager_s, run()[1]]
    eager_s, best_compiled = min(eager_runs), min(compiled_s)
    n = args.new_tokens
    same = all(c["ok"] for c in result.checks)
    print(f"{bench.name}, batch 1, {n} greedy tokens, torch threads {torch.get_num_threads()}: compiled first run "
          f"(compilation included) {first_s:.1f} s; eager {n / eager_s:.1f} tokens/s, compiled {n / best_compiled:.1f} "
          f"tokens/s: compiled / eager {eager_s / best_compiled:.2f}x; tokens identical {same}")
    result.settings = {"model": bench.name, "dtype": "float32", "device": str(model.device), "batch": 1,
                       "new_tokens": n, "prompt_tokens": args.prompt_tokens, "threads": torch.get_num_threads(),
                       "statistic": "best of 2 runs a side after a warm-up"}
    result.figures = {"eager_tokens_per_s": n / eager_s, "compiled_tokens_per_s": n / best_compiled,
                      "compiled_over_eager": eager_s / best_compiled, "compiled_first_run_s": first_s,
                      "eager_runs_s": harness.stats(eager_runs), "compiled_runs_s": harness.stats(compiled_s),
                      "tokens_identical": same}
    result.write()


if __name__ == "__main__":
    main()
