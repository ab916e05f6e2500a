"""Transformer-XL / compressive memories and segment-recurrent evaluation, against oracles.

Oracles: one full-context pass (nothing evicted), the model run on each segment alone (no memory),
hand-built attention memories for a one-layer model (whose keys do not depend on earlier attention),
XL memory of the same size (compression at rate 1 is the identity), and per-row runs (batch rows are
independent).
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import sharp_tiny_model as tiny_model

from memlm.jobs.segment_eval import SegmentStream, evaluate_segments
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.memory.compressive import CompressiveMemory, Compressor
from memlm.model.memory_config import MemoryConfig
from memlm.memory.reconstruction import attention_reconstruction_loss, capture_queries
from memlm.memory.state import memory_from_state_dict, new_memory
from memlm.memory.xl import XLMemory, push_fifo
from memlm.model.config import ModelConfig
from memlm.model.decoder import Decoder, KVCache, LayerMemory


ATOL = 1e-4  # logits are O(10) with the 0.2 init; float32 rounding differs by summation order


def run_segments(model: Decoder, x: torch.Tensor, seg: int, state) -> tuple[torch.Tensor, object]:
    outs = []
    for s in range(0, x.shape[1], seg):
        out = model(x[:, s : s + seg], state)
        outs.append(out.logits)
        state = out.state
    return torch.cat(outs, dim=1), state  # (B, n, V)


# ---------------------------------------------------------------- equalities with simpler models


def test_xl_mem_len_zero_equals_no_memory():
    model = tiny_model(2)
    x = torch.randint(0, 512, (2, 48))
    got, _ = run_segments(model, x, 16, XLMemory.empty(2, mem_len=0, sink_tokens=0))
    want = torch.cat([model(x[:, s : s + 16]).logits for s in range(0, 48, 16)], dim=1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    # And through segment evaluation: "xl" with no slots is "none".
    docs = [torch.randint(1, 512, (n,)).tolist() for n in (50, 17)]
    a = evaluate_segments(model, docs, 16, "xl", boundary_token=0, mem_len=0, sink_tokens=0)
    b = evaluate_segments(model, docs, 16, "none", boundary_token=0)
    assert a["tokens"] == b["tokens"] == 67
    assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-6)


@pytest.mark.parametrize("n_layer", [1, 3])
@pytest.mark.parametrize("sinks", [0, 4])
@pytest.mark.parametrize("kind", ["xl", "compressive"])
def test_segments_with_whole_document_span_equal_full_pass(n_layer, sinks, kind):
    # With a span covering the whole document nothing is evicted, so every token attends to exactly
    # what a full causal pass gives it (multi-layer too: before any eviction memories hold the same states).
    model = tiny_model(n_layer)
    x = torch.randint(0, 512, (2, 70))
    full = model(x).logits  # (B, 70, V)
    if kind == "xl":
        state = XLMemory.empty(2, mem_len=70, sink_tokens=sinks)
    else:
        state = CompressiveMemory.empty(2, mem_len=70, cmem_len=8, rate=4, compress_fn="mean", sink_tokens=sinks)
    got, _ = run_segments(model, x, 16, state)
    torch.testing.assert_close(got, full, atol=ATOL, rtol=0)


def test_segment_eval_equals_full_context_windows():
    # Oracle from another module: memlm.jobs.windows with one window per document.
    model = tiny_model(2)
    docs = [torch.randint(1, 512, (n,)).tolist() for n in (100, 37, 130, 5, 64)]
    ref = list(score_documents(model, docs, WindowConfig(context=256, stride=256, batch_size=2), boundary_token=0))
    n = sum(len(s.targets) for s in ref)
    ppl = math.exp(-float(torch.cat([s.lm_logprob for s in ref]).double().sum()) / n)
    for kind in ("xl", "compressive"):
        for batch_size in (1, 3):  # rows switch documents at different steps: resets must be per row
            r = evaluate_segments(model, docs, 16, kind, boundary_token=0, mem_len=256, cmem_len=16,
                                  batch_size=batch_size)
            assert r["tokens"] == n == sum(map(len, docs))  # every token scored exactly once
            assert r["perplexity"] == pytest.approx(ppl, rel=1e-5)


def test_compressive_at_rate_one_equals_xl_of_the_same_size():
    # Mean-pooling groups of one state is the identity, so the compressed FIFO just extends the memory:
    # this checks eviction into the second FIFO, its order, its positions and its eviction.
    model = tiny_model(2)
    x = torch.randint(0, 512, (2, 96))
    xl, _ = run_segments(model, x, 16, XLMemory.empty(2, mem_len=40, sink_tokens=4))
    comp, st = run_segments(model, x, 16, CompressiveMemory.empty(2, 24, 16, rate=1, compress_fn="mean", sink_tokens=4))
    assert st.cmem[0].k.shape[1] == 16  # the compressed FIFO was filled and has evicted
    torch.testing.assert_close(comp, xl, atol=ATOL, rtol=0)


class FixedMemory:
    """A DecoderState that attends to a given LayerMemory (one-layer oracle)."""

    def __init__(self, memory: LayerMemory | None, start: int) -> None:
        self.memory, self.start = memory, start

    def positions(self, batch_size, seq_len, device):
        return (self.start + torch.arange(seq_len, dtype=torch.float32, device=device)).expand(batch_size, seq_len)

    def layer_memory(self, layer):
        return self.memory

    def update(self, new_kv):
        return self


@pytest.mark.parametrize("sinks", [0, 3])
def test_eviction_matches_hand_built_memory(sinks):
    # In a one-layer model a token's key and value depend only on the token, so the oracle memory for
    # segment [s, s+T) is: the sink tokens [0, N) plus the last mem_len tokens before s (not in the sinks),
    # the sinks at StreamingLLM's positions within the cache: right before the oldest memory slot.
    model = tiny_model(1)
    seg, mem_len, n = 8, 12, 56
    x = torch.randint(0, 512, (1, n))
    kv = model(x, KVCache.empty(model.config)).state.layers[0]  # all keys, un-rotated, positions 0..n-1
    got, _ = run_segments(model, x, seg, XLMemory.empty(1, mem_len=mem_len, sink_tokens=sinks))
    for s in range(0, n, seg):
        slots = sorted(set(range(min(sinks, s))) | set(range(max(sinks, s - mem_len), s)))
        idx = torch.tensor(slots, dtype=torch.long)
        first = max(sinks, s - mem_len) if s > sinks else s  # oldest memory slot (or the segment)
        pos = torch.tensor([[float(max(i, first - min(sinks, s) + i)) if i < min(sinks, s) else float(i)
                             for i in slots]])  # (1, S)
        mem = LayerMemory(kv.k[:, idx], kv.v[:, idx], pos, torch.ones(1, len(slots), dtype=torch.bool))
        want = model(x[:, s : s + seg], FixedMemory(mem if slots else None, s)).logits
        torch.testing.assert_close(got[:, s : s + seg], want, atol=ATOL, rtol=0)


def test_compressed_slots_match_hand_built_memory():
    # One layer, mean compression at rate 2: oracle cmem slot = mean of two consecutive states at their
    # mean position, the memory = the most recent states; the order [cmem; mem] is irrelevant to attention.
    model = tiny_model(1)
    seg, mem_len, cmem_len, c, n = 8, 8, 6, 2, 48
    x = torch.randint(0, 512, (1, n))
    kv = model(x, KVCache.empty(model.config)).state.layers[0]
    got, _ = run_segments(model, x, seg, CompressiveMemory.empty(1, mem_len, cmem_len, c, "mean", sink_tokens=0))
    for s in range(seg, n, seg):
        mem_idx = torch.arange(max(0, s - mem_len), s)
        compressed_until = max(0, s - mem_len)  # states before this were compressed, pairwise
        groups = torch.arange(0, compressed_until, c).view(-1, 1) + torch.arange(c)  # (G, c)
        groups = groups[-cmem_len:]
        ck = kv.k[0, groups].mean(1)[None]  # (1, G, nkv, hs)
        cv = kv.v[0, groups].mean(1)[None]
        cpos = kv.pos[0, groups].mean(1)[None]
        mem = LayerMemory(
            torch.cat([ck, kv.k[:, mem_idx]], 1), torch.cat([cv, kv.v[:, mem_idx]], 1),
            torch.cat([cpos, kv.pos[:, mem_idx]], 1), torch.ones(1, len(groups) + len(mem_idx), dtype=torch.bool),
        )
        want = model(x[:, s : s + seg], FixedMemory(mem, s)).logits
        torch.testing.assert_close(got[:, s : s + seg], want, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- FIFO order and bookkeeping


def fake_kv(start: int, T: int, B: int = 2, n_layer: int = 1) -> list[LayerMemory]:
    """Keys/values whose entries equal their position: contents identify the token."""
    pos = (start + torch.arange(T, dtype=torch.float32)).expand(B, T)  # (B, T)
    k = pos[:, :, None, None].expand(B, T, 1, 2).clone()  # (B, T, 1, 2)
    return [LayerMemory(k, -k, pos, torch.ones(B, T, dtype=torch.bool)) for _ in range(n_layer)]


def test_xl_fifo_keeps_the_most_recent_states_in_order_and_never_resets():
    mem = XLMemory.empty(2, mem_len=10, sink_tokens=2)
    for step in range(7):  # 42 tokens through a 10-slot memory
        mem = mem.update(fake_kv(6 * step, 6))
        n_seen = 6 * (step + 1)
        expected = list(range(max(2, n_seen - 10), n_seen))
        m = mem.mem[0]
        assert m.pos[0, m.valid[0]].tolist() == m.pos[1, m.valid[1]].tolist() == expected
        assert m.k[0, m.valid[0], 0, 0].tolist() == expected  # contents travel with positions
        assert mem.sink[0].pos[0].tolist() == [0, 1] and bool(mem.sink[0].valid.all())
        lm = mem.layer_memory(0)
        # [sink; mem], the sinks right before the oldest memory slot (StreamingLLM's cache positions)
        assert lm.pos[0, lm.valid[0]].tolist() == [expected[0] - 2, expected[0] - 1, *expected]
        assert lm.k[0, lm.valid[0], 0, 0].tolist()[:2] == [0, 1]  # the sinks' contents are the first tokens
    assert mem.positions(2, 3, torch.device("cpu"))[0].tolist() == [42, 43, 44]


def test_compressive_fifo_order_mean_and_max():
    for fn, pool in (("mean", lambda g: sum(g) / len(g)), ("max", max)):
        mem = CompressiveMemory.empty(2, mem_len=8, cmem_len=3, rate=2, compress_fn=fn, sink_tokens=0)
        for step in range(6):  # 36 tokens: 8 in memory, 28 evicted -> 14 compressed, last 3 kept
            mem = mem.update(fake_kv(6 * step, 6))
        assert mem.mem[0].pos[0].tolist() == list(range(28, 36))
        c = mem.cmem[0]
        groups = [[22, 23], [24, 25], [26, 27]]
        assert c.pos[0].tolist() == [sum(g) / 2 for g in groups]  # mean positions, oldest first
        assert c.k[0, :, 0, 0].tolist() == [pool(g) for g in groups]
        lm = mem.layer_memory(0)
        assert lm.pos[0].tolist() == [22.5, 24.5, 26.5, *range(28, 36)]  # [cmem; mem]


def test_push_fifo_evicts_whole_groups_per_row():
    # Row 1 holds fewer valid states (as after a reset): rows evict independently, in groups of 4.
    old = fake_kv(0, 6)[0]
    old = LayerMemory(old.k, old.v, old.pos, torch.tensor([[True] * 6, [False] * 3 + [True] * 3]))
    kept, evicted = push_fifo(old, fake_kv(6, 4)[0], capacity=5, group=4, want_evicted=True)
    # Row 0: 10 states, 5 over capacity -> evict 4 (0..3), keep 6 (4..9). Row 1: 7 states -> evict 0.
    assert kept.pos[0, kept.valid[0]].tolist() == list(range(4, 10))
    assert kept.pos[1, kept.valid[1]].tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert evicted.pos[0, evicted.valid[0]].tolist() == [0, 1, 2, 3]
    assert not bool(evicted.valid[1].any())


def test_new_memory_takes_every_size_from_the_config():
    # MemoryConfig is the one home of the defaults: new_memory passes each field on, none is re-defaulted.
    xl = new_memory(MemoryConfig("xl", mem_len=7, sink_tokens=3), batch_size=2)
    assert (type(xl), xl.mem_len, xl.sink_tokens, tuple(xl.next_pos.shape)) == (XLMemory, 7, 3, (2,))
    assert new_memory(MemoryConfig(), 1).sink_tokens == MemoryConfig.sink_tokens == 4
    comp = new_memory(MemoryConfig("compressive", mem_len=6, cmem_len=5, compress_rate=3, compress_fn="max",
                                   sink_tokens=1), batch_size=1)
    assert (type(comp), comp.mem_len, comp.cmem_len, comp.rate, comp.compress_fn, comp.sink_tokens) == (
        CompressiveMemory, 6, 5, 3, "max", 1)
    assert new_memory(MemoryConfig("none"), 1) is None


def test_state_dict_round_trip():
    mem = CompressiveMemory.empty(2, 4, 4, 2, "mean", sink_tokens=1)
    for step in range(3):
        mem = mem.update(fake_kv(5 * step, 5, n_layer=2))
    back = memory_from_state_dict(mem.state_dict())
    for i in range(2):
        for a, b in zip(mem.layer_memory(i), back.layer_memory(i)):
            assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(mem.next_pos, back.next_pos)


# ---------------------------------------------------------------- batch rows and document boundaries


@pytest.mark.parametrize("kind", ["xl", "compressive"])
def test_document_boundary_resets_only_that_row(kind):
    model = tiny_model(2)
    seg = 8
    a = torch.randint(0, 512, (1, 48))
    b1 = torch.randint(0, 512, (1, 24))
    b2 = torch.randint(0, 512, (1, 24))

    def empty(B):
        if kind == "xl":
            return XLMemory.empty(B, mem_len=12, sink_tokens=2)
        return CompressiveMemory.empty(B, 8, 4, 2, "mean", sink_tokens=2)

    # Oracles: each document alone in a fresh memory.
    want_a, _ = run_segments(model, a, seg, empty(1))
    want_b2, _ = run_segments(model, b2, seg, empty(1))
    # Row 0 reads a; row 1 reads b1, then a boundary in row 1 only, then b2.
    state = empty(2)
    got = []
    for i, s in enumerate(range(0, 48, seg)):
        if s == 24:
            state = state.reset_rows(torch.tensor([False, True]))
        row1 = b1[:, s : s + seg] if s < 24 else b2[:, s - 24 : s - 24 + seg]
        out = model(torch.cat([a[:, s : s + seg], row1]), state)
        got.append(out.logits)
        state = out.state
    got = torch.cat(got, dim=1)
    torch.testing.assert_close(got[0:1], want_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1:2, 24:], want_b2, atol=ATOL, rtol=0)
    assert not torch.allclose(got[1:2, 24:], run_segments(model, torch.cat([b1, b2], 1), seg, empty(1))[0][:, 24:])


def test_segment_stream_scores_every_token_once():
    docs = [list(range(1, 1 + n)) for n in (5, 0, 17, 9)]
    stream = SegmentStream(docs, batch_size=2, segment=4, boundary_token=0)
    seen = []
    while (batch := stream.next_batch()) is not None:
        seen += batch.targets[batch.mask].tolist()
    assert sorted(seen) == sorted(t for d in docs for t in d)


# ---------------------------------------------------------------- the reconstruction loss


def test_reconstruction_loss_trains_only_the_compressor():
    model = tiny_model(2).train()
    compressor = Compressor(model.config, rate=2)
    before = [p.detach().clone() for p in compressor.parameters()]
    opt = torch.optim.SGD(compressor.parameters(), lr=0.5)
    state = CompressiveMemory.empty(2, 8, 8, 2, "conv", sink_tokens=0, compressor=compressor)
    x = torch.randint(0, 512, (2, 64))
    losses = []
    for s in range(0, 64, 8):
        with capture_queries(model) as queries:
            out = model(x[:, s : s + 8], state)
        state = out.state
        loss = attention_reconstruction_loss(state, queries, model)
        if s == 0:  # memory not full yet: nothing compressed
            assert loss.item() == 0.0
            continue
        losses.append(loss.item())
        lm_loss = out.logits.float().logsumexp(-1).mean()
        (loss + 0 * lm_loss).backward()
        assert all(p.grad is None or not p.grad.any() for p in model.parameters()), "gradient leaked into the model"
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in compressor.parameters())
        opt.step()
        opt.zero_grad()
    assert losses[0] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, compressor.parameters()))


def test_reconstruction_loss_is_zero_exactly_when_compression_is_lossless():
    """Rate 1 pooling keeps every evicted state as it is, so attention over the compression equals
    attention over the evicted states: the loss is 0.0; rate 2 mean pooling loses information."""
    model = tiny_model(2)
    x = torch.randint(0, 512, (2, 48))
    for rate, fn in ((1, "mean"), (1, "max"), (2, "mean")):
        state = CompressiveMemory.empty(2, 8, 8, rate, fn, sink_tokens=0)
        losses, evicted = [], 0
        for s in range(0, 48, 8):
            with torch.no_grad(), capture_queries(model) as queries:
                out = model(x[:, s : s + 8], state)
            state = out.state
            evicted += sum(int(rec.old.valid.sum()) for rec in state.last_compression or () if rec is not None)
            losses.append(attention_reconstruction_loss(state, queries, model).item())
        assert evicted == 2 * 2 * (48 - 8)  # layers x rows x tokens pushed past the 8 memory slots
        if rate == 1:
            assert losses == [0.0] * 6, (fn, losses)
        else:
            assert losses[0] == 0.0 and min(losses[1:]) > 1e-4, losses  # the first segment evicts nothing


def test_conv_compressor_starts_as_mean_pooling():
    cfg = ModelConfig.from_name("tiny")
    comp = Compressor(cfg, rate=4)
    k = torch.randn(2, 8, cfg.n_kv_head, cfg.head_dim)
    ck, cv = comp(1, k, -k)
    torch.testing.assert_close(ck, k.view(2, 2, 4, cfg.n_kv_head, cfg.head_dim).mean(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(cv, -ck, atol=1e-6, rtol=0)


def test_memory_config_costs():
    cfg = MemoryConfig("compressive", mem_len=512, cmem_len=512, compress_rate=4, sink_tokens=4)
    assert cfg.memory_slots == 1028 and cfg.history_tokens == 4 + 512 + 2048
    r = evaluate_segments(tiny_model(2), [list(range(1, 40))], 16, "xl", boundary_token=0, mem_len=32,
                          sink_tokens=4)
    assert r["memory_slots"] == 36 and r["attention_span"] == 52 and r["effective_reach"] == 32 * 2 + 16


# ---------------------------------------------------------------- re-projected memory (training)


@pytest.mark.parametrize("kind", ["xl", "compressive-mean"])
def test_reprojected_memory_scores_like_cached_keys(kind):
    # For fixed weights, keys projected from the stored layer inputs equal the cached keys (mean pooling
    # commutes with the linear projection), so both memories give the same logits.
    model = tiny_model(2)
    x = torch.randint(0, 512, (2, 48))

    def memory(reproject: bool):
        if kind == "xl":
            return XLMemory.empty(2, 12, sink_tokens=2, reproject=reproject)
        return CompressiveMemory.empty(2, 8, 4, 2, "mean", sink_tokens=2, reproject=reproject)

    with torch.no_grad():
        cached, _ = run_segments(model, x, 8, memory(False))
        reprojected, state = run_segments(model, x, 8, memory(True))
    assert state.layer_memory(0).x is not None and state.layer_memory(0).x.shape[-1] == model.config.n_embd
    torch.testing.assert_close(reprojected, cached, atol=ATOL, rtol=0)


def test_reprojected_memory_trains_key_and_value_projections_like_a_full_pass():
    # Transformer-XL: k = SG(h) W_k. In a one-layer model h is the (normalised) embedding, so the gradient
    # of segment 2's loss into W_q, W_k, W_v, W_o equals that of one full pass over both segments scored
    # on segment 2 only. Cached keys give W_k and W_v no gradient from the memory: it must differ.
    model = tiny_model(1).train()
    x = torch.randint(0, 512, (2, 24))
    y = torch.randint(0, 512, (2, 12))
    names = ["q_proj", "k_proj", "v_proj", "o_proj"]

    def grads(logits):
        model.zero_grad()
        torch.nn.functional.cross_entropy(logits.reshape(-1, 512), y.reshape(-1)).backward()
        return [getattr(model.layers[0].self_attn, n).weight.grad.clone() for n in names]

    full = grads(model(x).logits[:, 12:])
    for reproject in (True, False):
        state = model(x[:, :12], XLMemory.empty(2, 12, sink_tokens=0, reproject=reproject)).state
        got = grads(model(x[:, 12:], state).logits)
        for name, a, b in zip(names, got, full):
            if reproject or name in ("q_proj", "o_proj"):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
            else:
                assert not torch.allclose(a, b, atol=1e-5, rtol=1e-4), f"{name}: cached keys should lose gradient"


@pytest.mark.parametrize("space", ["kv", "x"])
def test_reconstruction_loss_trains_only_the_compressor_in_both_spaces(space):
    model = tiny_model(2).train()
    compressor = Compressor(model.config, rate=2, space=space)
    state = CompressiveMemory.empty(2, 8, 8, 2, "conv", sink_tokens=0, compressor=compressor, reproject=space == "x")
    x = torch.randint(0, 512, (2, 32))
    for s in range(0, 32, 8):
        with capture_queries(model) as queries:
            out = model(x[:, s : s + 8], state)
        state = out.state
        loss = attention_reconstruction_loss(state, queries, model)
        if s < 16:
            continue
        assert loss.item() > 0
        model.zero_grad()
        compressor.zero_grad()
        (loss + 0 * out.logits.sum()).backward()
        assert all(p.grad is None or not p.grad.any() for p in model.parameters()), "gradient leaked into the model"
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in compressor.parameters())


def test_compressor_space_must_match_the_memory():
    cfg = ModelConfig.from_name("tiny")
    with pytest.raises(ValueError, match="^a re-projecting memory needs a compressor of space x, got 'kv'$"):
        CompressiveMemory.empty(1, 4, 4, 2, "conv", sink_tokens=0, compressor=Compressor(cfg, 2, space="kv"),
                                reproject=True)
    with pytest.raises(ValueError, match="^a key/value memory needs a compressor of space kv, got 'x'$"):
        CompressiveMemory.empty(1, 4, 4, 2, "conv", sink_tokens=0, compressor=Compressor(cfg, 2, space="x"),
                                reproject=False)
    comp = Compressor(cfg, rate=4, space="x")
    h = torch.randn(2, 8, cfg.n_embd)
    torch.testing.assert_close(comp.compress_x(0, h), h.view(2, 2, 4, cfg.n_embd).mean(2), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["xl", "compressive"])
def test_sink_distance_stays_within_the_cache_deep_into_a_document(kind):
    # Sinks kept at their true positions would sit ~13K tokens from the query deep into a SOTU
    # president's speeches, beyond anything SmolLM2 was trained on (loss 3.4 -> 7 nats). Every slot the
    # segment attends to must lie within sinks + memory (+ compressed span) of the segment start.
    if kind == "xl":
        mem = XLMemory.empty(2, mem_len=10, sink_tokens=2)
        span = 2 + 10
    else:
        mem = CompressiveMemory.empty(2, 6, 4, rate=2, compress_fn="mean", sink_tokens=2)
        span = 2 + 6 + 4 * 2
    for step in range(50):  # 300 tokens, far past the memory
        mem = mem.update(fake_kv(6 * step, 6))
        lm = mem.layer_memory(0)
        start = mem.positions(2, 1, torch.device("cpu"))[:, 0]  # (B,)
        distance = start[:, None] - lm.pos  # (B, S)
        assert float(distance[lm.valid].max()) <= span
        assert float(distance[lm.valid].min()) >= 1
