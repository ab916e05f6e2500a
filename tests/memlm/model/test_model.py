"""The Decoder against transformers' LlamaForCausalLM (the oracle), and its own invariants.

Tiny random configs with grouped-query attention; weights are drawn larger than the training init
(std 0.2, norms around 1) so that logits spread over several units (std about 1.4, max about 5) and
layout mistakes (rotary halves vs pairs, GQA head grouping, norm placement) show up as errors of
order 1, far above the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from memlm.model.config import ModelConfig
from memlm.model.cpu_gemm import float32_gemm_on_mkl
from memlm.model.decoder import Decoder, KVCache

TOL = 2e-5
"""Max abs logit difference allowed against transformers (float32, CPU). Measured on these configs:
3.4e-6 to 6.7e-6 (tied and untied; 1, 2 and 6 key/value heads); float32 summation order differs."""


def make_config(tie: bool, **overrides) -> ModelConfig:
    base = dict(name="custom", vocab_size=97, n_layer=3, n_embd=48, n_head=6, n_kv_head=2,
                intermediate_size=80, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=tie, max_seq_len=64)
    return ModelConfig(**(base | overrides))


def make_model(config: ModelConfig, seed: int = 0) -> Decoder:
    gen = torch.Generator().manual_seed(seed)
    model = Decoder(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model


def tokens(config: ModelConfig, B: int = 2, T: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers(tie: bool, hf_llama) -> None:
    config = make_config(tie)
    model = make_model(config)
    ref = hf_llama(config, model.state_dict())
    idx = tokens(config)
    with torch.no_grad():
        ours = model(idx).logits  # (B, T, V)
        theirs = ref(idx).logits  # (B, T, V)
    assert ours.shape == theirs.shape == (2, 20, config.vocab_size)
    assert theirs.std() > 0.5, "logits too flat for the comparison to mean anything"
    torch.testing.assert_close(ours, theirs, atol=TOL, rtol=0)
    if tie:
        assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("n_kv_head", [6, 2, 1])
def test_logits_equal_transformers_sdpa_bit_for_bit(tie: bool, n_kv_head: int, hf_llama) -> None:
    # The README's "logits bit-identical" (benchmarks/forward_throughput.py): with the same attention
    # kernel (torch SDPA) every float matches; against eager attention only TOL holds.
    config = make_config(tie, n_kv_head=n_kv_head)
    model = make_model(config)
    idx = tokens(config)
    # ... and the same GEMM: oneDNN off (memlm.model.cpu_gemm.cpu_float32_gemm), so both sides run MKL's.
    with torch.no_grad(), float32_gemm_on_mkl():
        ours = model(idx).logits  # (B, T, V)
        theirs = hf_llama(config, model.state_dict(), "sdpa")(idx).logits  # (B, T, V)
    assert torch.equal(ours, theirs)


def test_no_gqa_and_multi_query_match_transformers(hf_llama) -> None:
    for n_kv_head in (6, 1):  # plain multi-head attention, and one shared key/value head
        config = make_config(False, n_kv_head=n_kv_head)
        model = make_model(config)
        idx = tokens(config, B=1, T=12)
        with torch.no_grad():
            torch.testing.assert_close(model(idx).logits, hf_llama(config, model.state_dict())(idx).logits,
                                       atol=TOL, rtol=0)


def test_kv_cache_token_by_token_equals_full_pass() -> None:
    config = make_config(True)
    model = make_model(config)
    idx = tokens(config, T=16)
    with torch.no_grad():
        full = model(idx)
        state = KVCache.empty(config)
        steps, keys = [], []
        for t in range(idx.shape[1]):
            out = model(idx[:, t : t + 1], state)
            state = out.state
            steps.append(out.logits)  # (B, 1, V)
            keys.append(out.knn_key)  # (B, 1, C)
        # Prefill of a chunk, then single tokens: the mixed path a generator takes.
        pre = model(idx[:, :9], KVCache.empty(config))
        rest = model(idx[:, 9:], pre.state)
    torch.testing.assert_close(torch.cat(steps, dim=1), full.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(keys, dim=1), full.knn_key, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat([pre.logits, rest.logits], dim=1), full.logits, atol=1e-4, rtol=0)
    assert state.length == 16


def test_kv_cache_refuses_to_overflow() -> None:
    config = make_config(True)
    model = make_model(config)
    state = model(tokens(config, T=6), KVCache.empty(config, max_len=8)).state
    with pytest.raises(ValueError, match="KV cache full"):
        model(tokens(config, T=3), state)


@pytest.mark.parametrize("layer", [-1, 0])
def test_ffn_input_key_is_the_mlp_input_in_transformers(layer: int, hf_llama) -> None:
    config = make_config(False, knn_key_layer=layer)
    model = make_model(config)
    ref = hf_llama(config, model.state_dict())
    captured = []
    hook = ref.model.layers[layer].mlp.register_forward_hook(lambda mod, args, out: captured.append(args[0]))
    idx = tokens(config)
    with torch.no_grad():
        ours = model(idx).knn_key  # (B, T, C)
        ref(idx)
    hook.remove()
    assert len(captured) == 1
    torch.testing.assert_close(ours, captured[0], atol=TOL, rtol=0)
    assert config.key_description == f"ffn_input.{layer % config.n_layer}"


def test_final_hidden_key_is_the_final_norm_output_in_transformers(hf_llama) -> None:
    config = make_config(True, knn_key="final_hidden")
    model = make_model(config)
    ref = hf_llama(config, model.state_dict())
    captured = []
    hook = ref.model.norm.register_forward_hook(lambda mod, args, out: captured.append(out))
    idx = tokens(config)
    with torch.no_grad():
        ours = model(idx).knn_key
        ref(idx)
    hook.remove()
    torch.testing.assert_close(ours, captured[0], atol=TOL, rtol=0)


def test_logits_from_returns_the_tail_of_the_full_logits() -> None:
    config = make_config(True)
    model = make_model(config)
    idx = tokens(config, T=20)
    with torch.no_grad():
        full = model(idx)
        tail = model(idx, logits_from=13)
    assert tail.logits.shape == (2, 7, config.vocab_size)
    torch.testing.assert_close(tail.logits, full.logits[:, 13:], atol=1e-5, rtol=0)
    torch.testing.assert_close(tail.knn_key, full.knn_key, atol=0, rtol=0)  # keys stay for every position


def test_bfloat16_forward_is_close_to_float32() -> None:
    config = make_config(True)
    model = make_model(config)
    idx = tokens(config)
    with torch.no_grad():
        ref = model(idx).logits  # (B, T, V) float32
        out = model.to(torch.bfloat16)(idx)
    assert out.logits.dtype == torch.bfloat16 and out.knn_key.dtype == torch.bfloat16
    assert torch.isfinite(out.logits).all()
    # bf16 keeps 8 mantissa bits: relative error ~0.4% per op; a few percent of the logit scale after
    # 3 layers. A wrong cast (e.g. rotary in bf16 at large angles) shows up as tens of percent.
    err = (out.logits.float() - ref).abs().max() / ref.abs().max()
    assert err < 0.05, f"bf16 logits differ from fp32 by {err:.3f} of the logit scale"
    assert (out.logits.float().argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
