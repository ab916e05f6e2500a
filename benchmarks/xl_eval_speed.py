"""Segment-recurrent (Transformer-XL) evaluation vs a stride-1 sliding window of the same span, both timed
on the same scored tokens (Dai et al. 2019 section 4.4, "up to 1,800x faster").

A vanilla model that gives every token L tokens of context re-encodes an L-token window per scored token
(stride 1); a segment-recurrent model with memory L runs each token once and attends to cached states.
Per span L in --spans, on one SOTU speech preceded by the document boundary token
(memlm.model.tokenizer.document_boundary):
- the first L inputs are the prefix: XL runs them (untimed) to fill its memory (L slots + the sink
  tokens), the stride-1 side takes its windows from them;
- the next --tokens targets are scored by both sides and timed in full: XL runs their segments of
  --segment tokens with mem_len L; the stride-1 side runs one L-token window per target, --window-batch
  windows per forward, output head on the last position only. Nothing is sampled or extrapolated.
Both sides run in this process one after the other per span (same machine load). Each side's
perplexity on those targets is printed as a check that both scored the same tokens.

    python benchmarks/xl_eval_speed.py [--tokens 128] [--spans 256 512 1024] [--segment 128]
        [--window-batch 4] [--threads N] [--synthetic] [--results DIR]

Writes docs/results/data/xl_eval_speed.json (benchmarks/harness.py).

Shape legend: B windows per forward, L span, T segment tokens, V vocab.
"""

from __future__ import annotations

import argparse
import math
import time

import _common
import harness
import torch
import torch.nn.functional as F

from memlm.model.memory_config import MemoryConfig
from memlm.memory.state import new_memory


@torch.inference_mode()
def time_xl(model, seq: torch.Tensor, prefix: int, tokens: int, segment: int, memory: MemoryConfig) -> tuple[float, float]:
    """(seconds, nll sum) of XL scoring targets seq[prefix+1 : prefix+tokens+1] after an untimed prefix."""
    device = model.device
    state = new_memory(memory, 1, device, None, False)
    for lo in range(0, prefix, segment):  # fill the memory
        state = model(seq[None, lo : min(lo + segment, prefix)].to(device), state).state
    nll = 0.0
    t0 = time.perf_counter()
    for lo in range(prefix, prefix + tokens, segment):
        hi = min(lo + segment, prefix + tokens)
        out = model(seq[None, lo:hi].to(device), state)  # logits (1, T, V)
        state = out.state
        logp = F.log_softmax(out.logits[0].float(), dim=-1)  # (T, V)
        nll -= float(logp.gather(-1, seq[lo + 1 : hi + 1, None].to(device)).sum())
    return time.perf_counter() - t0, nll


@torch.inference_mode()
def time_stride1(model, seq: torch.Tensor, span: int, prefix: int, tokens: int, batch: int) -> tuple[float, float]:
    """(seconds, nll sum) of one span-token window per target seq[j], j in [prefix+1, prefix+tokens]."""
    device = model.device
    targets = list(range(prefix + 1, prefix + tokens + 1))
    nll = 0.0
    t0 = time.perf_counter()
    for i in range(0, len(targets), batch):
        js = targets[i : i + batch]
        windows = torch.stack([seq[j - span : j] for j in js]).to(device)  # (B, L)
        logits = model(windows, logits_from=span - 1).logits[:, -1].float()  # (B, V)
        logp = F.log_softmax(logits, dim=-1)  # (B, V)
        nll -= float(logp.gather(-1, seq[js, None].to(device)).sum())
    return time.perf_counter() - t0, nll


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: smollm2-135m (random 'tiny' only with --synthetic)")
    p.add_argument("--split", default="year==2010", help="the SOTU speech (its first tokens)")
    p.add_argument("--tokens", type=int, default=128, help="targets scored and timed by both sides")
    p.add_argument("--spans", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--segment", type=int, default=128)
    p.add_argument("--window-batch", type=int, default=4, help="stride-1 windows per forward")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    _common.add_synthetic_flag(p)
    harness.add_options(p, "xl_eval_speed")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)

    bench = _common.load_model(args.model, args.synthetic)
    model = bench.pre.model.eval()
    need = max(args.spans) + args.tokens + 1
    docs, random_tokens = _common.load_tokens(bench, "sotu", args.split, need, args.synthetic)
    ids = [t for d in docs for t in d]
    if len(ids) < need:
        raise SystemExit(f"{args.split} has {len(ids)} tokens; {need} are needed (max span + --tokens + 1)")
    seq = torch.tensor([bench.boundary, *ids[: need - 1]], dtype=torch.long)  # inputs and targets
    sinks = MemoryConfig().sink_tokens
    result.set_synthetic(bench.synthetic or random_tokens)
    print(f"# model {bench.name}, {'random tokens' if random_tokens else 'sotu ' + args.split}; {args.tokens} "
          f"targets timed on both sides per span, after a prefix of `span` tokens; segment {args.segment}, "
          f"{sinks} sink tokens, stride-1 batch {args.window_batch}, torch threads {torch.get_num_threads()}")
    print("span  | XL tok/s | stride-1 tok/s | ratio  | XL ppl | stride-1 ppl")
    print("------|----------|----------------|--------|--------|-------------")
    model(seq[None, : args.segment].to(model.device))  # warm-up
    for span in args.spans:
        memory = MemoryConfig("xl", mem_len=span, sink_tokens=sinks)
        xl_s, xl_nll = time_xl(model, seq, span, args.tokens, args.segment, memory)
        w_s, w_nll = time_stride1(model, seq, span, span, args.tokens, args.window_batch)
        print(f"{span:5d} | {args.tokens / xl_s:8.1f} | {args.tokens / w_s:14.2f} | {w_s / xl_s:5.0f}x | "
              f"{math.exp(xl_nll / args.tokens):6.2f} | {math.exp(w_nll / args.tokens):6.2f}", flush=True)
        result.rows.append({"span": span, "xl_tokens_per_s": args.tokens / xl_s, "stride1_tokens_per_s":
                            args.tokens / w_s, "ratio": w_s / xl_s, "xl_perplexity": math.exp(xl_nll / args.tokens),
                            "stride1_perplexity": math.exp(w_nll / args.tokens)})
        if span == 1024:
            result.headline("span_1024", f"{w_s / xl_s:.0f}x")
    print(f"# ratio = stride-1 seconds / XL seconds for the same {args.tokens} targets (both measured in full)")
    _common.synthetic_banner(bench.synthetic or random_tokens)
    result.settings = {"model": bench.name, "dtype": "float32", "split": "random tokens" if random_tokens else
                       f"sotu {args.split}", "tokens": args.tokens, "segment": args.segment, "sink_tokens": sinks,
                       "window_batch": args.window_batch, "threads": torch.get_num_threads(), "runs": 1}
    result.write()


if __name__ == "__main__":
    main()
