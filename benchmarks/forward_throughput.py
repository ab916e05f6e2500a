"""Forward throughput: our Decoder vs transformers' LlamaForCausalLM on the same weights, batch and dtype.

Both models are timed alternately in one run (the machines are shared and noisy) and the ratio of
tokens/s is printed (goal: ours >= 1.0x). SmolLM2 by default; the random 'small' preset (same shapes
family, SmolLM2's tokenizer) only with --synthetic, and the output then says so.

    python benchmarks/forward_throughput.py [--model smollm2-135m] [--batch 4] [--seq 256] [--dtype float32]
        [--synthetic] [--results DIR]

Writes docs/results/data/forward_throughput.json (benchmarks/harness.py): the medians, the spread of the runs and
the largest logit difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
import harness
import torch


def hf_twin(model):
    """A transformers LlamaForCausalLM with our model's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head,
        rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta, max_position_embeddings=c.max_seq_len,
        tie_word_embeddings=c.tie_embeddings, attn_implementation="sdpa",
    )
    hf = LlamaForCausalLM(hf_config)
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in m or m == "lm_head.weight" for m in missing), missing
    return hf.to(device=model.device, dtype=model.dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="preset or path (default smollm2-135m; 'small' with --synthetic "
                        "when it is not fetched)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    _common.add_synthetic_flag(parser)
    harness.add_options(parser, "forward_throughput")
    args = parser.parse_args()
    result = harness.Result.from_args(args)

    dtype = getattr(torch, args.dtype)
    bench = _common.load_model(args.model, args.synthetic, synthetic_model="small", device=args.device, dtype=dtype)
    model, name = bench.pre.model, bench.name
    hf = hf_twin(model)
    idx = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=args.device)

    def run_ours():
        return model(idx).logits

    def run_hf():
        return hf(idx).logits

    with torch.inference_mode():
        diff = (run_ours().float() - run_hf().float()).abs().max().item()
        times = {"memlm": [], "transformers": []}
        for _ in range(args.repeats):
            for label, fn in (("memlm", run_ours), ("transformers", run_hf)):
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[label].append(time.perf_counter() - t0)
    tokens = args.batch * args.seq
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    result.set_synthetic(bench.synthetic)
    print(f"model {name}, device {args.device}, dtype {args.dtype}, batch {args.batch} x {args.seq} tokens, "
          f"median of {args.repeats} alternating runs (first warm-up pass not counted)")
    print(f"max |logit diff| = {diff:.2e}")
    for k, v in tps.items():
        print(f"{k:>14}: {v:10.1f} tokens/s")
    ratio = tps["memlm"] / tps["transformers"]
    print(f"{'ratio':>14}: {ratio:.3f}x  (memlm / transformers; goal >= 1.0)")
    result.settings = {"model": name, "device": args.device, "dtype": args.dtype, "batch": args.batch,
                       "seq": args.seq, "repeats": args.repeats, "threads": torch.get_num_threads(),
                       "statistic": "median of alternating runs"}
    result.figures = {"memlm_tokens_per_s": tps["memlm"], "transformers_tokens_per_s": tps["transformers"],
                      "memlm_over_transformers": ratio, "max_logit_diff": diff,
                      **{f"{k}_runs_s": harness.stats(v) for k, v in times.items()}}
    result.headline("vs_transformers", f"{ratio:.2f}x")
    result.write()


if __name__ == "__main__":
    main()
