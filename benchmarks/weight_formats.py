"""Each weight format (memlm.model.weight_formats: float32, bfloat16, int8, int4) side by side in one run: the
perplexity of each on a tuning text (SOTU 2001-2002, the first --max-tokens tokens, `memlm eval`'s windows) against
float32's, and the engine's greedy decode tokens/s at batch 1 and batch 8 (--new-tokens tokens for each prompt of
2003+ SOTU text, the formats alternating over --repeats rounds after a warm-up, the best round kept). Beside them:
whether each format's batch-8 tokens equal the same prompts decoded alone (batch invariance on the real model), and
the default rule's choice, the fastest format at batch 1 whose perplexity is within 0.5% of float32's.

    python benchmarks/weight_formats.py [--device cpu] [--max-tokens 4000] [--new-tokens 32] [--repeats 2]
        [--results DIR]

Writes docs/results/data/weight_formats.json (benchmarks/harness.py); docs/decisions/weight-formats.md reads it.
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
from memlm.jobs.evaluate import evaluate_perplexity
from memlm.jobs.windows import WindowConfig
from memlm.model.device import resolve_device, synchronize
from memlm.model.weight_formats import DEFAULT_WEIGHTS, WEIGHT_FORMATS, resolve_format
from memlm.model.weights import load_pretrained

BATCHES = (1, 8)
TUNING = ("sotu", "2001<=year<=2002")
"""The tuning text the default is chosen on."""
PROMPTS = ("sotu", "year>=2003")
"""Where the decode prompts come from (apart from the tuning text)."""
PERPLEXITY_BUDGET = 0.005
"""The default is the fastest format whose perplexity is at most this much above float32's (relative)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=4000)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    harness.add_options(p, "weight_formats")
    _common.add_synthetic_flag(p)
    args = p.parse_args()
    result = harness.Result.from_args(args)
    device = resolve_device(args.device)
    bench = _common.load_model(None, args.synthetic, device=str(device))
    name = bench.name
    models = {}
    for weights in WEIGHT_FORMATS:
        fmt = resolve_format(weights, None, device)
        with result.build(f"load {weights}"):
            models[weights] = load_pretrained(name, device=device, dtype=fmt.dtype, weights=fmt.weights).model
    tokenizer = bench.pre.tokenizer
    tuning, random_tuning = _common.load_tokens(bench, *TUNING, args.max_tokens, args.synthetic)
    docs, random_prompts = _common.load_tokens(bench, *PROMPTS, 8 * max(BATCHES) * args.prompt_tokens, args.synthetic)
    result.set_synthetic(bench.synthetic or random_tuning or random_prompts)
    text = [t for d in docs for t in d]
    stride = len(text) // max(BATCHES)
    if stride < args.prompt_tokens:
        raise SystemExit(f"needs {max(BATCHES) * args.prompt_tokens} tokens of prompt text, got {len(text)}")
    prompts = [text[i * stride : i * stride + args.prompt_tokens] for i in range(max(BATCHES))]

    def decode(weights: str, rows: list[list[int]]) -> tuple[list[list[int]], float]:
        """(each prompt's greedy tokens, seconds) for `rows` decoded together in `weights`."""
        requests = [GenerationRequest(tuple(r), args.new_tokens, sampling=SamplingConfig(temperature=0.0),
                                      boundary_token=bench.boundary) for r in rows]
        engine = Engine(models[weights], tokenizer, EngineConfig(max_batch=len(rows)))
        synchronize(device)
        t0 = time.perf_counter()
        streams = run_all(engine, requests)
        synchronize(device)
        seconds = time.perf_counter() - t0
        return [[e.token_id for e in events if isinstance(e, TokenEvent)] for events in streams], seconds

    window = WindowConfig.for_model(bench.pre.model.config.max_seq_len)
    perplexity = {}
    for weights in WEIGHT_FORMATS:
        perplexity[weights] = evaluate_perplexity(models[weights], tuning, window, bench.boundary,
                                                  progress=False)["perplexity"]
    seconds: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for weights in WEIGHT_FORMATS:  # warm-up
        decode(weights, prompts[:1])
    for _ in range(args.repeats):
        for batch in BATCHES:
            for weights in WEIGHT_FORMATS:
                out, s = decode(weights, prompts[:batch])
                tokens[weights, batch] = out
                seconds.setdefault((weights, batch), []).append(s)
    alone = {w: [decode(w, [prompt])[0][0] for prompt in prompts] for w in WEIGHT_FORMATS}
    best = {key: min(v) for key, v in seconds.items()}
    rate = {key: key[1] * args.new_tokens / s for key, s in best.items()}

    base = perplexity["float32"]
    within = [w for w in WEIGHT_FORMATS if perplexity[w] <= base * (1 + PERPLEXITY_BUDGET)]
    chosen = max(within, key=lambda w: rate[w, 1])
    print(f"command: {harness.command()}")
    print(f"model: {name}; {device.type}, torch threads {torch.get_num_threads()}; perplexity on {TUNING[0]} "
          f"[{TUNING[1]}] ({sum(map(len, tuning))} tokens); {args.new_tokens} greedy tokens a prompt after "
          f"{args.prompt_tokens} prompt tokens; best of {args.repeats} rounds")
    print(f"{'weights':<9} {'dtype':<9} {'perplexity':>10} {'vs f32':>7} {'b1 tok/s':>9} {'b8 tok/s':>9}  "
          "batch 8 = alone")
    for weights in WEIGHT_FORMATS:
        fmt = resolve_format(weights, None, device)
        same = tokens[weights, 8] == alone[weights]
        parted = [i for i, (a, b) in enumerate(zip(tokens[weights, 8], alone[weights])) if a != b]
        rel = perplexity[weights] / base - 1
        print(f"{weights:<9} {str(fmt.dtype).removeprefix('torch.'):<9} {perplexity[weights]:>10.4f} {rel:>+7.2%} "
              f"{rate[weights, 1]:>9.1f} {rate[weights, 8]:>9.1f}  {same}")
        result.rows.append({"weights": weights, "dtype": str(fmt.dtype).removeprefix("torch."),
                            "perplexity": round(perplexity[weights], 4), "perplexity_vs_float32": round(rel, 5),
                            "batch1_tokens_per_s": round(rate[weights, 1], 2),
                            "batch8_tokens_per_s": round(rate[weights, 8], 2),
                            "batch8_tokens_equal_alone": same, "batch8_prompts_parting": parted,
                            "rounds_spread_batch1": round(harness.stats(seconds[weights, 1])["spread"], 3)})
        result.figures[f"{weights}_perplexity"] = round(perplexity[weights], 4)
        result.figures[f"{weights}_batch1_tokens_per_s"] = round(rate[weights, 1], 2)
        result.figures[f"{weights}_batch8_tokens_per_s"] = round(rate[weights, 8], 2)
    print(f"the default rule's choice on {device.type}: {chosen} (fastest at batch 1 within "
          f"{PERPLEXITY_BUDGET:.1%} of float32's perplexity); DEFAULT_WEIGHTS says {DEFAULT_WEIGHTS.get(device.type)}")
    result.figures[f"chosen_default_{device.type}"] = chosen
    result.headline("weight_formats", f"{chosen}: {rate[chosen, 1]:.1f} vs {rate['float32', 1]:.1f} tokens/s at "
                                      "batch 1")
    result.settings = {"model": name, "device": device.type, "threads": torch.get_num_threads(),
                       "tuning": f"{TUNING[0]} [{TUNING[1]}]", "max_tokens": args.max_tokens,
                       "context": window.context, "stride": window.stride, "prompts": f"{PROMPTS[0]} [{PROMPTS[1]}]",
                       "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
                       "perplexity_budget": PERPLEXITY_BUDGET, "default_weights": DEFAULT_WEIGHTS.get(device.type),
                       "synthetic": result.synthetic}
    result.write()


if __name__ == "__main__":
    main()
