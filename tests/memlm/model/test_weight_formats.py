"""Weight formats against float oracles: the int8 / int4 layers equal dequantise-then-F.linear, int4 keeps a
Q4_1 weight's own values, the decoder's logits in each format stay close to float32's, and --weights with
--dtype resolve by one rule.

Shape legend: M rows, K input width, N output width, B batch, T tokens, V vocab.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.model.int_linear import GROUP_SIZE, Int4Linear, Int8Linear
from memlm.model.weight_formats import DEFAULT_WEIGHTS, ModelFormat, convert, format_of, resolve_format
from memlm.model.weights import load_pretrained

CPU = torch.device("cpu")


def q4_1_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight (N, K) made of GGUF Q4_1 blocks: per 32 columns d * q + m, q in [0, 15] spanning both ends."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP_SIZE, GROUP_SIZE), generator=g).float()  # (N, G, 32)
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 picks d and m from the block's min and max
    d = torch.rand(n, k // GROUP_SIZE, 1, generator=g) * 0.01 + 1e-3  # (N, G, 1)
    m = -torch.rand(n, k // GROUP_SIZE, 1, generator=g) * 0.05  # (N, G, 1)
    return (d * q + m).reshape(n, k)  # (N, K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("layer", [Int8Linear, Int4Linear], ids=["int8", "int4"])
def test_quantised_linear_equals_dequantise_then_linear(layer, dtype) -> None:
    """The kernel computes x @ W.T for its own dequantised W: float32 to a few ulps of the sum, bfloat16 to its
    rounding of the output (eps 2^-8 of the largest output, with margin)."""
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05  # (N, K)
    x = torch.randn(5, 3, 128).to(dtype)  # (B, T, K)
    q = layer.from_float(w, dtype)
    with torch.inference_mode():
        got = q(x)  # (B, T, N)
        want = F.linear(x.float(), q.weight.float())  # (B, T, N)
    assert got.shape == (5, 3, 96) and got.dtype == dtype
    scale = want.abs().max().item()
    tol = 1e-5 * scale if dtype == torch.float32 else 2 ** -7 * scale
    torch.testing.assert_close(got.float(), want, rtol=0, atol=tol)


def test_int8_and_int4_round_a_weight_within_half_a_step() -> None:
    """Quantisation error: int8 at most half a row's step (max |w| / 127), int4 at most half a group's."""
    w = torch.randn(64, 96)
    int8 = Int8Linear.from_float(w, torch.float32)
    assert ((int8.weight - w).abs() <= w.abs().amax(1, keepdim=True) / 254 * 1.001).all()
    int4 = Int4Linear.from_float(w, torch.float32)
    groups = w.reshape(64, -1, GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # (N, G)
    err = (int4.weight - w).abs().reshape(64, -1, GROUP_SIZE)
    assert (err <= step[..., None] / 2 * 1.001 + 1e-7).all()


def test_int4_keeps_a_q4_1_weight() -> None:
    """A weight dequantised from Q4_1 blocks comes back from int4 as itself (float32 scales: to float rounding)."""
    w = q4_1_weight(64, 128)
    torch.testing.assert_close(Int4Linear.from_float(w, torch.float32).weight, w, rtol=0, atol=1e-6)


LOGITS_RTOL = 1e-2
"""Largest logit difference from float32, as a fraction of the largest logit: bfloat16 keeps 8 bits of mantissa
(2^-8, 0.4%), rounded again at every layer of the tiny preset; measured 0.4-0.6% for the three formats."""
KEYS_RTOL = 2.5e-2
"""The same for the kNN keys (the last layer's feed-forward input, a norm's bfloat16 output): measured 1.2%."""


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4"])
def test_decoder_logits_in_each_format_are_close_to_float32(weights) -> None:
    """The tiny preset (its linear weights made Q4_1 blocks, as the real model's are) in each format: logits and
    kNN keys within LOGITS_RTOL and KEYS_RTOL of float32's largest, same shapes."""
    reference = load_pretrained("tiny").model
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("proj.weight") or name == "lm_head.weight":
                p.copy_(q4_1_weight(*p.shape))
    quantised = load_pretrained("tiny").model
    quantised.load_state_dict(reference.state_dict())
    model = convert(quantised, resolve_format(weights, None, CPU))
    assert format_of(model) == weights and model.dtype == torch.bfloat16
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))  # (B, T)
    with torch.inference_mode():
        want = reference(idx)
        got = model(idx)
    assert got.logits.shape == want.logits.shape == (2, 24, 512)
    for g, w, rtol in ((got.logits, want.logits, LOGITS_RTOL), (got.knn_key, want.knn_key, KEYS_RTOL)):
        torch.testing.assert_close(g.float(), w, rtol=0, atol=rtol * w.abs().max().item())


def test_resolve_format_one_rule_for_weights_and_dtype() -> None:
    assert resolve_format(None, None, CPU) == ModelFormat(DEFAULT_WEIGHTS["cpu"], getattr(torch, DEFAULT_WEIGHTS["cpu"]))
    assert resolve_format(None, "auto", CPU).weights == DEFAULT_WEIGHTS["cpu"]
    assert resolve_format(None, "float16", CPU) == ModelFormat("float16", torch.float16)  # --dtype alone, as before
    assert resolve_format("bfloat16", "auto", CPU) == ModelFormat("bfloat16", torch.bfloat16)
    assert resolve_format("int8", None, CPU) == ModelFormat("int8", torch.bfloat16)
    assert resolve_format("int4", "float32", CPU) == ModelFormat("int4", torch.float32)
    with pytest.raises(MemlmError, match="--weights bfloat16 computes in bfloat16"):
        resolve_format("bfloat16", "float32", CPU)
    with pytest.raises(MemlmError, match="--weights must be one of"):
        resolve_format("int2", None, CPU)


def test_load_pretrained_in_an_int_format_and_format_of() -> None:
    pre = load_pretrained("tiny", dtype=torch.bfloat16, weights="int8")
    assert format_of(pre.model) == "int8" and pre.fingerprint == load_pretrained("tiny").fingerprint
    assert isinstance(pre.model.lm_head, Int8Linear) and pre.model.embed_tokens.weight.dtype == torch.bfloat16
    assert format_of(load_pretrained("tiny", dtype=torch.bfloat16).model) == "bfloat16"
    with pytest.raises(MemlmError, match="computes in bfloat16"):
        load_pretrained("tiny", dtype=torch.float32, weights="bfloat16")


def test_a_tied_output_head_stays_the_embedding() -> None:
    """An int format quantises the blocks' linear layers; a head tied to the embedding stays that one matrix."""
    from memlm.model.config import ModelConfig
    from memlm.model.decoder import build_model

    model = convert(build_model(ModelConfig.from_name("tiny", tie_embeddings=True)), ModelFormat("int4", torch.bfloat16))
    assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.dtype == torch.bfloat16
    assert isinstance(model.layers[0].mlp.up_proj, Int4Linear) and format_of(model) == "int4"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the int8 / int4 CUDA kernels)")
@pytest.mark.parametrize("layer", [Int8Linear, Int4Linear], ids=["int8", "int4"])
def test_quantised_linear_on_cuda_equals_dequantise_then_linear(layer) -> None:
    """Made on the CPU and moved (int4 packs again for tinygemm's layout), or made on the GPU: the same product."""
    torch.manual_seed(0)
    w = torch.randn(256, 512) * 0.05  # (N, K)
    x = torch.randn(7, 512, dtype=torch.bfloat16, device="cuda")  # (M, K)
    for q in (layer.from_float(w, torch.bfloat16).to("cuda"), layer.from_float(w.cuda(), torch.bfloat16)):
        with torch.inference_mode():
            got = q(x)  # (M, N)
            want = F.linear(x.float(), q.weight.float())  # (M, N)
        torch.testing.assert_close(got.float(), want, rtol=0, atol=2 ** -7 * want.abs().max().item())
