"""torch.compile of the decoder's forward vs eager, for the engine's batch-1 greedy decode (issue 12, part 4:
"torch.compile for the decode step where it helps, as measured"). The same engine, prompt (--prompt-tokens of
2003+ SOTU text) and --new-tokens greedy tokens on both sides, best of two runs each after a warm-up (the
compiled side's first run, compilation included, is printed apart); tokens compared.

    python benchmarks/compile_decode.py [--new-tokens 64] [--prompt-tokens 32]
"""

from __future__ import annotations

import argparse
import time

import _common
import torch

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.generate import SamplingConfig, TokenEvent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    _common.add_synthetic_flag(p)
    args = p.parse_args()
    bench = _common.load_model(None, args.synthetic)
    model, tokenizer = bench.pre.model, bench.pre.tokenizer
    docs, random_tokens = _common.load_tokens(bench, "sotu", "year>=2003", 4 * args.prompt_tokens, args.synthetic)
    _common.synthetic_banner(bench.synthetic or random_tokens)
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
    _, first_s = run()
    compiled_tokens, compiled_s = min(run(), run(), key=lambda r: r[1])
    model.forward = eager_forward
    eager_s = min(eager_s, run()[1])
    n = args.new_tokens
    print(f"{bench.name}, batch 1, {n} greedy tokens, torch threads {torch.get_num_threads()}: compiled first run "
          f"(compilation included) {first_s:.1f} s; eager {n / eager_s:.1f} tokens/s, compiled {n / compiled_s:.1f} "
          f"tokens/s: compiled / eager {eager_s / compiled_s:.2f}x; tokens identical {compiled_tokens == eager_tokens}")


if __name__ == "__main__":
    main()
