"""The decoder's greedy decode speed on each CPU float32 GEMM it can run (memlm.model.cpu_gemm.CPU_GEMM_NAMES:
F.linear's and oneDNN's through torch.utils.mkldnn), at batch 1 and batch 8, side by side in one run: the engine
(memlm.engine) decodes --new-tokens greedy tokens for each of `batch` prompts of 2003+ SOTU text, the GEMMs
alternating over --repeats rounds after a warm-up, the best round of each kept (the spread of the rounds is in
the JSON); the tokens of each GEMM must equal the default's in every round (the command exits 1 otherwise).

    python benchmarks/decoder_gemm.py [--new-tokens 24] [--prompt-tokens 32] [--repeats 2] [--results DIR]

Writes docs/results/data/decoder_gemm.json (benchmarks/harness.py).
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
from memlm.model.cpu_gemm import CPU_GEMM_NAMES, DEFAULT_CPU_GEMM, cpu_gemm_as

BATCHES = (1, 8)
WEIGHTS = {"smollm2-135m": "SmolLM2-135M-Instruct, Q4_1 GGUF weights dequantised to float32"}
"""What the real model is, for the output (memlm.model.weights' preset)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    harness.add_options(p, "decoder_gemm")
    _common.add_synthetic_flag(p)
    args = p.parse_args()
    result = harness.Result.from_args(args)
    bench = _common.load_model(None, args.synthetic)
    model, tokenizer = bench.pre.model, bench.pre.tokenizer
    docs, random_tokens = _common.load_tokens(bench, "sotu", "year>=2003", 8 * max(BATCHES) * args.prompt_tokens,
                                              args.synthetic)
    result.set_synthetic(bench.synthetic or random_tokens)
    weights = WEIGHTS.get(bench.name, f"{bench.name} (random weights)")
    text = [t for d in docs for t in d]  # the split's tokens, one after another
    stride = len(text) // max(BATCHES)
    prompts = [text[i * stride : i * stride + args.prompt_tokens] for i in range(max(BATCHES))]  # spread over it
    if stride < args.prompt_tokens:
        raise SystemExit(f"needs {max(BATCHES) * args.prompt_tokens} tokens of text, got {len(text)}")

    def decode(gemm: str, batch: int) -> tuple[list[list[int]], float]:
        """(each prompt's greedy tokens, seconds) for `batch` prompts decoded together on `gemm`."""
        requests = [GenerationRequest(tuple(prompt), args.new_tokens, sampling=SamplingConfig(temperature=0.0),
                                      boundary_token=bench.boundary) for prompt in prompts[:batch]]
        with cpu_gemm_as(gemm):
            engine = Engine(model, tokenizer, EngineConfig(max_batch=batch))
            t0 = time.perf_counter()
            streams = run_all(engine, requests)
            seconds = time.perf_counter() - t0
        return [[e.token_id for e in events if isinstance(e, TokenEvent)] for events in streams], seconds

    seconds: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for gemm in CPU_GEMM_NAMES:  # warm-up: oneDNN's weight copies, the allocator
        decode(gemm, 1)
    for r in range(args.repeats):
        for batch in BATCHES:
            for gemm in CPU_GEMM_NAMES:
                out, s = decode(gemm, batch)
                tokens[gemm, batch] = out
                seconds.setdefault((gemm, batch), []).append(s)
                if gemm != DEFAULT_CPU_GEMM:
                    base = tokens[DEFAULT_CPU_GEMM, batch]
                    parted = [i for i, (a, b) in enumerate(zip(out, base)) if a != b]
                    result.check(f"{gemm} tokens equal {DEFAULT_CPU_GEMM}'s, batch {batch}, round {r + 1}", not parted,
                                 f"prompts {parted} part" if parted else "")
    best = {key: min(v) for key, v in seconds.items()}

    print(f"command: {harness.command()}")
    print(f"weights: {weights}; float32, CPU, torch threads {torch.get_num_threads()}; {args.new_tokens} greedy "
          f"tokens a prompt after {args.prompt_tokens} prompt tokens; best of {args.repeats} rounds")
    print(f"{'GEMM':<8} {'batch':>5} {'tokens/s':>9} {'vs ' + DEFAULT_CPU_GEMM:>8}  tokens as {DEFAULT_CPU_GEMM}'s")
    for batch in BATCHES:
        base = best[DEFAULT_CPU_GEMM, batch]
        for gemm in CPU_GEMM_NAMES:
            rate = batch * args.new_tokens / best[gemm, batch]
            same = tokens[gemm, batch] == tokens[DEFAULT_CPU_GEMM, batch]
            print(f"{gemm:<8} {batch:>5} {rate:>9.1f} {base / best[gemm, batch]:>7.2f}x  {same}")
            spread = harness.stats(seconds[gemm, batch])["spread"]
            result.rows.append({"gemm": gemm, "batch": batch, "tokens_per_s": round(rate, 2),
                                "speedup_vs_default": round(base / best[gemm, batch], 3),
                                "tokens_equal_default": same, "rounds_spread": round(spread, 3)})
            result.figures[f"{gemm}_batch{batch}_tokens_per_s"] = round(rate, 2)
    rates = {g: 8 * args.new_tokens / best[g, 8] for g in CPU_GEMM_NAMES}
    result.headline("batch8", f"{rates['mkl']:.1f} vs {rates['onednn']:.1f} tokens/s")
    result.settings = {"weights": weights, "model": bench.name, "dtype": "float32", "device": "cpu",
                       "threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
                       "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "default_gemm": DEFAULT_CPU_GEMM,
                       "synthetic": bench.synthetic or random_tokens}
    result.write()


if __name__ == "__main__":
    main()
