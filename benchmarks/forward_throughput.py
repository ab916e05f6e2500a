"""Forward throughput: our Decoder vs transformers' LlamaForCausalLM on the same weights, batch and dtype.

Both models are timed alternately in one run (the machines are shared and noisy) and the ratio of
tokens/s is printed (goal: ours >= 1.0x).

    python benchmarks/forward_throughput.py [--model smollm2-135m] [--batch 4] [--seq 256] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

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
    parser.add_argument("--model", default="smollm2-135m", help="preset or path (falls back to 'small' if not fetched)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from memlm.errors import MemlmError
    from memlm.model.weights import load_pretrained

    dtype = getattr(torch, args.dtype)
    try:
        model = load_pretrained(args.model, device=args.device, dtype=dtype).model
        name = args.model
    except MemlmError as e:
        print(f"({e}; using the random 'small' preset instead)")
        model = load_pretrained("small", device=args.device, dtype=dtype).model
        name = "small"
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
    print(f"model {name}, device {args.device}, dtype {args.dtype}, batch {args.batch} x {args.seq} tokens, "
          f"median of {args.repeats} alternating runs (first warm-up pass not counted)")
    print(f"max |logit diff| = {diff:.2e}")
    for k, v in tps.items():
        print(f"{k:>14}: {v:10.1f} tokens/s")
    print(f"{'ratio':>14}: {tps['memlm'] / tps['transformers']:.3f}x  (memlm / transformers; goal >= 1.0)")


if __name__ == "__main__":
    main()
