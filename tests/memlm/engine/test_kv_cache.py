"""memlm.engine.kv_cache: cached decoding against full recomputation, exact rotary far past the context,
padding never written, rows independent.

Shape legend: B rows, T tokens, V vocab.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import sharp_tiny_model

from memlm.engine.kv_cache import CacheLayout, RowCache, kv_bytes_per_token, rotary_at
from memlm.model.config import ModelConfig
from memlm.model.decoder import rotary_inv_freq


def plain_cache(model, rows: int = 3, ring: int = 64) -> RowCache:
    return RowCache(model.config, CacheLayout(rows, 0, ring, None, None), model.device, model.dtype)


def feed(model, cache: RowCache, rows: list[int], chunks: list[list[int]], starts: list[int]) -> torch.Tensor:
    """One left-padded forward of `chunks` into `rows` at positions from `starts`: last logits (B, V)."""
    T = max(len(c) for c in chunks)
    idx = torch.zeros(len(rows), T, dtype=torch.long)  # (B, T)
    pos = torch.zeros(len(rows), T, dtype=torch.long)  # (B, T)
    real = torch.zeros(len(rows), T, dtype=torch.bool)  # (B, T)
    for i, (c, s) in enumerate(zip(chunks, starts)):
        idx[i, T - len(c):] = torch.tensor(c)
        pos[i, :] = s + len(c) - 1
        pos[i, T - len(c):] = torch.arange(s, s + len(c))
        real[i, T - len(c):] = True
    view = cache.view(rows, pos, real, torch.zeros_like(pos))
    return model(idx, state=view, logits_from=T - 1).logits[:, -1]  # (B, V)


def greedy_both_ways(model, prompt: list[int], n: int, row: int = 1) -> tuple[list[int], list[int], float]:
    """Greedy tokens through the cache and by full recomputation, and the largest logit difference relative
    to the largest |logit| (float32 rounding of different but equivalent sums: rotary at absolute positions,
    one attention over the cache instead of SDPA over the whole sequence)."""
    cache = plain_cache(model, ring=len(prompt) + n)
    seq, cached, full, diff, scale = list(prompt), [], [], 0.0, 0.0
    with torch.inference_mode():
        logits = feed(model, cache, [row], [prompt], [0])[0]  # (V,)
        for _ in range(n):
            ref = model(torch.tensor([seq])).logits[0, -1]  # (V,) full recomputation
            diff = max(diff, float((ref.float() - logits.float()).abs().max()))
            scale = max(scale, float(ref.float().abs().max()))
            cached.append(int(logits.argmax()))
            full.append(int(ref.argmax()))
            seq.append(full[-1])
            logits = feed(model, cache, [row], [[full[-1]]], [len(seq) - 1])[0]
    return cached, full, diff / scale


def test_cached_greedy_equals_full_recomputation_tiny() -> None:
    model = sharp_tiny_model()
    cached, full, diff = greedy_both_ways(model, [3, 17, 250, 9, 81, 44, 7], 16)
    assert cached == full
    assert diff < 1e-5  # measured 2e-6 (1.1e-5 absolute on logits up to 5.7)


def test_cached_greedy_equals_full_recomputation_smollm2(smollm2_model) -> None:
    pretrained = smollm2_model  # the GGUF on the CPU in float32, loaded once (tests/conftest.py)
    prompt = pretrained.tokenizer.encode("The history of the United States began with")
    cached, full, diff = greedy_both_ways(pretrained.model, [0, *prompt], 16)
    assert cached == full
    assert diff < 1e-5  # measured 1.4e-6 (4.3e-5 absolute on logits up to 31, through 30 layers)


def test_rows_of_different_lengths_padding_unwritten() -> None:
    """Two prompts of different lengths prefilled together (left padding) give each one's logits alone,
    and the padding slots stay empty."""
    model = sharp_tiny_model()
    a, b = [5, 6, 7, 8, 9, 10, 11], [40, 41]
    with torch.inference_mode():
        together = feed(model, plain_cache(model), [0, 2], [a, b], [0, 0])  # (2, V)
        cache = plain_cache(model)
        alone_a = feed(model, cache, [0], [a], [0])[0]
        alone_b = feed(model, plain_cache(model), [2], [b], [0])[0]
        torch.testing.assert_close(together[0], alone_a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(together[1], alone_b, atol=1e-5, rtol=1e-5)
        both = plain_cache(model)
        feed(model, both, [0, 2], [a, b], [0, 0])
    assert both.slot_pos[2].tolist()[:3] == [0, 1, -1] and (both.slot_pos[1] == -1).all()
    assert both.slot_pos[0].tolist()[:8] == [0, 1, 2, 3, 4, 5, 6, -1]


def test_rotary_angles_stay_exact_far_past_the_context() -> None:
    """At position 10^9 + t the float64-reduced angle is within 1e-6 rad of the exact one (mpmath-free
    oracle: the product in exact integer arithmetic via Python floats of the float32 frequencies); a
    float32 product is off by whole radians there."""
    inv = rotary_inv_freq(64, 10000.0, "cpu")  # (32,)
    pos = torch.tensor([[10**9, 10**9 + 1, 12345678901]], dtype=torch.long)  # (1, 3)
    cos, sin = rotary_at(pos, inv)  # (1, 1, 3, 64)
    for j, p in enumerate(pos[0].tolist()):
        for i, f in enumerate(inv.tolist()):
            # f is a float32 value; p * f in Python's float64 is exact to 2^-52 relative, reduced mod 2 pi.
            exact = math.fmod(p * f, 2 * math.pi)
            assert abs(float(cos[0, 0, j, i]) - math.cos(exact)) < 2e-6
            assert abs(float(sin[0, 0, j, i]) - math.sin(exact)) < 2e-6
    p, f = 10**9 + 1, float(inv[1])  # p is not a float32 value; f = 10000^(-2/64)
    naive = float(torch.tensor(p, dtype=torch.float32) * torch.tensor(f, dtype=torch.float32))
    off = abs(math.remainder(naive - p * f, 2 * math.pi))  # angular distance of the float32 product
    assert off > 1e-2


def test_layout_refuses_a_ring_smaller_than_memory_plus_segment() -> None:
    with pytest.raises(ValueError, match="mem_len \\+ rate - 1 \\+ segment = 12"):
        CacheLayout(2, 4, 10, 8, 4)
    with pytest.raises(ValueError, match="= 14 slots"):  # compressive: c - 1 states wait for their group
        CacheLayout(2, 4, 13, 8, 4, 3, 3)
    with pytest.raises(ValueError, match="needs the XL memory"):
        CacheLayout(2, 0, 10, None, None, 3, 3)
    with pytest.raises(ValueError, match="go together"):
        CacheLayout(2, 0, 10, 8, None)


def test_rows_grow_past_the_first_allocation() -> None:
    """A prompt past INITIAL_SLOTS grows the cache's slots (doubling twice) and still decodes like recomputation."""
    from memlm.engine.kv_cache import INITIAL_SLOTS

    model = sharp_tiny_model()
    prompt = [(7 * i) % 500 for i in range(3 * INITIAL_SLOTS + 44)]
    cached, full, diff = greedy_both_ways(model, prompt, 4)
    assert cached == full and diff < 1e-5


def test_rotate_is_apply_rotary_bit_for_bit() -> None:
    """kv_cache.rotate (roll and a signed sine, fewer ops) gives apply_rotary's values exactly."""
    from memlm.engine.kv_cache import _signed, rotate
    from memlm.model.decoder import apply_rotary

    pos = torch.tensor([[0, 5, 63, 10**7]])  # (B, T)
    cos, sin = rotary_at(pos, rotary_inv_freq(16, 10000.0, "cpu"))  # (B, 1, T, hs)
    x = torch.randn(1, 3, 4, 16, generator=torch.Generator().manual_seed(0))  # (B, h, T, hs)
    assert torch.equal(rotate(x, cos, _signed(sin)), apply_rotary(x, cos, sin))
    xb = x.bfloat16()
    assert torch.equal(rotate(xb, cos, _signed(sin)), apply_rotary(xb, cos, sin))


def test_packed_step_whose_decode_group_grows_the_cache() -> None:
    """One packed pass: a new prompt's group (its view made first), then a decode row at position INITIAL_SLOTS,
    whose view grows the cache; both write where the grown cache's flat views say (StepView.write_flat)."""
    from memlm.engine.kv_cache import INITIAL_SLOTS, PackedGroup, PackedStep

    def view(cache: RowCache, row: int, start: int, n: int):
        pos = torch.arange(start, start + n)[None]  # (1, n)
        return cache.view([row], pos, torch.ones_like(pos, dtype=torch.bool), torch.zeros_like(pos))

    model = sharp_tiny_model()
    cache = plain_cache(model, rows=2, ring=4 * INITIAL_SLOTS)
    a = [(5 * i + 3) % 500 for i in range(INITIAL_SLOTS)]  # row 0 fills the first allocation
    b = [3, 17, 250, 9]  # row 1's prompt
    with torch.inference_mode():
        nxt = int(feed(model, cache, [0], [a], [0])[0].argmax())
        assert cache.allocated == INITIAL_SLOTS
        prompt = view(cache, 1, 0, len(b))
        decode = view(cache, 0, INITIAL_SLOTS, 1)
        assert cache.allocated > INITIAL_SLOTS  # grown after the prompt's view was made
        step = PackedStep([PackedGroup(prompt, torch.arange(len(b)), None),
                           PackedGroup(decode, torch.tensor([len(b)]), None)])
        packed = model(torch.tensor([[*b, nxt]]), state=step).logits[0]  # (len(b) + 1, V)
        ref_b = model(torch.tensor([b])).logits[0, -1]  # (V,)
        ref_a = model(torch.tensor([[*a, nxt]])).logits[0, -1]  # (V,)
        again = feed(model, cache, [0, 1], [[7], [7]], [INITIAL_SLOTS + 1, len(b)])  # (2, V): reads what was written
        ref_again = [model(torch.tensor([s])).logits[0, -1] for s in ([*a, nxt, 7], [*b, 7])]
    for got, ref in [(packed[len(b) - 1], ref_b), (packed[len(b)], ref_a), (again[0], ref_again[0]),
                     (again[1], ref_again[1])]:
        assert float((got - ref).abs().max()) < 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_per_token_is_what_a_full_row_cache_holds_per_slot(dtype) -> None:
    """The byte budget's conversion against the cache itself: its key and value tensors, fully grown, over
    their rows x slots."""
    config = ModelConfig.from_name("tiny", n_layer=3)
    cache = RowCache(config, CacheLayout(2, 0, 40, None, None), torch.device("cpu"), dtype)
    cache.reserve(40)
    held = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
    assert kv_bytes_per_token(config, dtype) == held // (2 * 40)
