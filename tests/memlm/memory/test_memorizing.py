"""The Memorizing Transformer layer and memory state, tiny random models, against oracles.

Oracles: the XL model (an empty kNN memory or a gate at 0 must give it exactly), the model with the
layer's output projection zeroed (a gate at 1 over a memory branch that returns zeros), a brute-force
softmax over the top-k cosine neighbours of each head's own stream, per-row runs (rows are independent
documents), the exact backend for FAISS, and the layer's own keys (from a KV cache) for the FIFO.
"""

from __future__ import annotations

import faiss
import pytest
import torch
from tiny_models import sharp_tiny_model as tiny_model
import torch.nn.functional as F

from memlm.model.memory_config import MemoryConfig
from memlm.memory.memorizing import (
    KnnAttention,
    KnnRetrieval,
    MemorizingMemory,
    load_knn_attention,
    mean_gate,
    new_knn_attention,
    save_knn_attention,
)
from memlm.memory.state import memory_from_state_dict, new_memory
from memlm.memory.xl import XLMemory
from memlm.model.config import ModelConfig
from memlm.model.decoder import Decoder, KVCache, LayerMemory
from memlm.memory import knn_store as memory_store
from memlm.memory.knn_store_faiss import IVF_NPROBE, FaissMemory
from memlm.memory.knn_store import ExactMemory

ZERO_GATE, ONE_GATE = -1e4, 1e4  # sigmoid gives exactly 0.0 and 1.0 in float32


def knn_module(model: Decoder, gate_logit: float = 0.0) -> KnnAttention:
    module = new_knn_attention(model.config)
    with torch.no_grad():
        module.gate_logit.fill_(gate_logit)
    return module


def memorizing(model: Decoder, B: int, module: KnnAttention, *, capacity: int = 256, top_k: int = 4,
               layer: int | None = None, backend: str = "exact", mem_len: int = 16, sinks: int = 2,
               factory: str | None = None, nprobe: int = IVF_NPROBE) -> MemorizingMemory:
    """factory, nprobe: a FAISS backend's index (FaissMemory's; default: its default_factory)."""
    cfg = model.config
    mcfg = MemoryConfig(kind="memorizing", mem_len=mem_len, sink_tokens=sinks, knn_layer=layer, knn_mem_size=capacity,
                        knn_top_k=top_k, knn_backend=backend)
    S, hs = B * cfg.n_kv_head, cfg.head_dim
    # float32 storage: exact comparisons (the CPU default, bfloat16, ranks to about 0.004).
    store = (ExactMemory(S, hs, hs, capacity, dtype=torch.float32) if backend == "exact"
             else FaissMemory(S, hs, hs, capacity, factory=factory, nprobe=nprobe))
    return new_memory(mcfg, B, knn_attention=module, knn_store=store, n_layer=cfg.n_layer)


def xl(B: int, mem_len: int = 16, sinks: int = 2) -> XLMemory:
    return XLMemory.empty(B, mem_len, sink_tokens=sinks)


def run(model: Decoder, x: torch.Tensor, seg: int, state, resets: dict[int, torch.Tensor] | None = None):
    outs = []
    for i, s in enumerate(range(0, x.shape[1], seg)):
        if resets and i in resets:
            state = state.reset_rows(resets[i])
        out = model(x[:, s : s + seg], state)
        outs.append(out.logits)
        state = out.state
    return torch.cat(outs, dim=1), state  # (B, n, V)


# ---------------------------------------------------------------- equalities with the XL model


def test_empty_memory_gives_exactly_the_local_attention():
    model = tiny_model()
    x = torch.randint(0, 512, (2, 16))
    state = memorizing(model, 2, knn_module(model, gate_logit=2.0))  # a large gate: emptiness alone must do it
    got = model(x, state).logits
    assert torch.equal(got, model(x, xl(2)).logits)


@pytest.mark.parametrize("layer", [0, 1])
def test_gate_at_zero_gives_exactly_the_model_without_the_layer(layer):
    model = tiny_model()
    x = torch.randint(0, 512, (2, 96))
    state = memorizing(model, 2, knn_module(model, ZERO_GATE), capacity=40, layer=layer)
    got, state = run(model, x, 16, state)
    assert state.knn_sizes().tolist() == [[40, 40], [40, 40]]  # full, and has evicted
    want, _ = run(model, x, 16, xl(2))
    assert torch.equal(got, want)
    # And the layer does something once the gate opens (this test could fail).
    opened, _ = run(model, x, 16, memorizing(model, 2, knn_module(model, 0.0), capacity=40, layer=layer))
    assert not torch.allclose(opened[:, 16:], want[:, 16:], atol=1e-3)
    torch.testing.assert_close(opened[:, :16], want[:, :16], atol=0, rtol=0)  # first segment: memory empty


class StubRetrieval:
    """A memory branch returning zeros with the gate at 1; records the queries it was given."""

    def __init__(self) -> None:
        self.q = None

    def attend(self, q):
        self.q = q
        B, nh, T, _ = q.shape
        return torch.zeros_like(q), torch.ones(B, nh, T)


class StubState:
    def __init__(self, retrieval, layer: int) -> None:
        self.retrieval, self.layer = retrieval, layer

    def positions(self, batch_size, seq_len, device):
        return (100 + torch.arange(seq_len, dtype=torch.float32)).expand(batch_size, seq_len)

    def layer_memory(self, layer):
        if layer != self.layer:
            return None
        z = torch.zeros(2, 0, 2, 16)
        return LayerMemory(z, z, torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool), knn=self.retrieval)

    def update(self, new_kv):
        return self


def test_the_gate_mixes_into_the_layer_output_with_unrotated_queries():
    # Gate 1 over a zero memory branch zeroes the layer's attention: the model with o_proj zeroed there.
    model = tiny_model(n_layer=1)
    x = torch.randint(0, 512, (2, 12))
    stub = StubRetrieval()
    got = model(x, StubState(stub, 0)).logits
    zeroed = tiny_model(n_layer=1)
    with torch.no_grad():
        zeroed.layers[0].self_attn.o_proj.weight.zero_()
    torch.testing.assert_close(got, zeroed(x).logits, atol=1e-5, rtol=0)
    # The memory branch got the queries before rotary (positions start at 100 here, so rotary would show).
    attn = model.layers[0].self_attn
    q = attn.q_proj(model.layers[0].input_layernorm(model.embed_tokens(x))).view(2, 12, 4, 16).transpose(1, 2)
    torch.testing.assert_close(stub.q, q)


def test_memory_attention_equals_brute_force_over_each_heads_stream():
    torch.manual_seed(5)
    B, nh, nkv, hs, T, k, n = 2, 4, 2, 8, 3, 5, 30
    module = KnnAttention(nh, nkv, hs)
    with torch.no_grad():
        module.log_scale.copy_(torch.tensor([0.5, 1.0, 2.0, 3.0]))
        module.gate_logit.copy_(torch.tensor([-1.0, 0.0, 1.0, 2.0]))
    store = ExactMemory(B * nkv, hs, hs, 64, dtype=torch.float32)
    keys, values = F.normalize(torch.randn(B * nkv, n, hs), dim=-1), torch.randn(B * nkv, n, hs)
    valid = torch.ones(B * nkv, n, dtype=torch.bool)
    valid[3] = False  # row 1, kv head 1: an empty stream
    store.append(keys, values, valid)
    q = torch.randn(B, nh, T, hs)
    out, gate = KnnRetrieval(store, module, k).attend(q)
    for b in range(B):
        for h in range(nh):
            s = b * nkv + h // (nh // nkv)  # GQA: query head h reads kv head h // G of its own row
            if s == 3:
                assert bool((gate[b, h] == 0).all()) and bool((out[b, h] == 0).all())
                continue
            qn = F.normalize(q[b, h], dim=-1)  # (T, hs)
            sims = qn @ keys[s].T  # (T, n)
            top = sims.topk(k, dim=-1)
            w = torch.softmax(top.values * module.log_scale[h].exp(), dim=-1)  # (T, k)
            want = (w[..., None] * values[s][top.indices]).sum(1)  # (T, hs)
            torch.testing.assert_close(out[b, h], want.detach(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(gate[b, h], module.gate()[h].expand(T).detach())


# ---------------------------------------------------------------- rows, backends, FIFO, gradients


def test_a_boundary_in_one_row_clears_only_that_row_and_batched_equals_alone():
    model = tiny_model()
    x = torch.randint(0, 512, (2, 80))
    module = knn_module(model, 0.0)
    reset = {3: torch.tensor([True, False])}  # a new document starts in row 0 at segment 3
    both, state = run(model, x, 16, memorizing(model, 2, module, capacity=40), reset)
    sizes = state.knn_sizes()
    assert sizes[0].tolist() == [32, 32] and sizes[1].tolist() == [40, 40]
    row1, _ = run(model, x[1:], 16, memorizing(model, 1, module, capacity=40))
    torch.testing.assert_close(both[1:], row1, atol=1e-5, rtol=0)
    # Row 0: its first document alone, then its second document from an empty memory.
    first, _ = run(model, x[:1, :48], 16, memorizing(model, 1, module, capacity=40))
    second, _ = run(model, x[:1, 48:], 16, memorizing(model, 1, module, capacity=40))
    torch.testing.assert_close(both[:1], torch.cat([first, second], dim=1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan", ["faiss", "torch"])  # the exact backend's CPU and GPU scans
def test_exact_and_faiss_backends_give_the_same_layer_output(scan, monkeypatch):
    monkeypatch.setattr(memory_store, "uses_faiss_scan", lambda buffer: scan == "faiss")
    model = tiny_model()
    x = torch.randint(0, 512, (2, 64))
    module = knn_module(model, 0.0)
    a, _ = run(model, x, 16, memorizing(model, 2, module, capacity=24, backend="exact"))
    b, _ = run(model, x, 16, memorizing(model, 2, module, capacity=24, backend="faiss"))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_memory_over_capacity_holds_the_most_recent_keys():
    # One layer: its keys depend on the token only, so a KV cache gives every key the memory can hold.
    model = tiny_model(n_layer=1)
    x = torch.randint(0, 512, (1, 72))
    cap = 20
    _, state = run(model, x, 8, memorizing(model, 1, knn_module(model), capacity=cap, layer=0))
    kv = model(x, KVCache.empty(model.config)).state.layers[0]  # (1, 72, nkv, hs) un-rotated
    want = F.normalize(kv.k[0], dim=-1).transpose(0, 1)  # (nkv, 72, hs)
    buf = state.store.buffer
    for j in range(72 - cap, 72):  # entry j lives in slot j % cap; older ones were overwritten in order
        torch.testing.assert_close(buf.keys[:, j % cap], want[:, j], atol=1e-6, rtol=0)
        torch.testing.assert_close(buf.values[:, j % cap], kv.v[0, j], atol=1e-6, rtol=0)
    assert state.knn_sizes().tolist() == [[cap, cap]]


def test_gradients_reach_the_knn_parameters_and_nothing_in_the_store():
    model = tiny_model().train()
    module = knn_module(model, 0.0)
    x = torch.randint(0, 512, (2, 32))
    state = memorizing(model, 2, module)
    state = model(x[:, :16], state).state
    out = model(x[:, 16:], state)
    F.cross_entropy(out.logits.flatten(0, 1), x[:, 16:].flatten()).backward()
    assert float(module.gate_logit.grad.abs().min()) > 0 and float(module.log_scale.grad.abs().min()) > 0
    buf = out.state.store.buffer
    assert not buf.keys.requires_grad and not buf.values.requires_grad and buf.keys.grad_fn is None


def test_a_consumed_state_refuses_reuse():
    model = tiny_model()
    state = memorizing(model, 1, knn_module(model))
    new = model(torch.randint(0, 512, (1, 8)), state).state
    with pytest.raises(ValueError, match="consumed"):
        model(torch.randint(0, 512, (1, 8)), state)
    new.reset_rows(torch.tensor([True]))
    with pytest.raises(ValueError, match="consumed"):
        new.layer_memory(1)


def test_state_dict_resume_equals_an_uninterrupted_run():
    model = tiny_model()
    module = knn_module(model, 0.0)
    x = torch.randint(0, 512, (2, 64))
    want, _ = run(model, x, 16, memorizing(model, 2, module, capacity=24))
    head, state = run(model, x[:, :32], 16, memorizing(model, 2, module, capacity=24))
    saved = state.state_dict()
    store = ExactMemory(4, 16, 16, 24, dtype=torch.float32)
    back = memory_from_state_dict(saved, knn_attention=module, knn_store=store)
    tail, _ = run(model, x[:, 32:], 16, back)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), want, atol=0, rtol=0)


def test_knn_attention_saves_and_loads(tmp_path):
    model = tiny_model()
    module = knn_module(model, 0.3)
    assert load_knn_attention(tmp_path) is None
    save_knn_attention(module, tmp_path)
    back = load_knn_attention(tmp_path)
    assert mean_gate(back) == pytest.approx(mean_gate(module)) and len(mean_gate(back)) == model.config.n_head
    torch.testing.assert_close(back.log_scale, module.log_scale)
    back.check_model(model.config)
    with pytest.raises(ValueError, match="heads"):
        back.check_model(ModelConfig.from_name("small"))


def test_new_memory_refuses_what_does_not_fit():
    model = tiny_model()
    module = knn_module(model)
    mcfg = MemoryConfig(kind="memorizing", knn_mem_size=8)
    with pytest.raises(ValueError, match="needs knn_attention"):
        new_memory(mcfg, 1, knn_attention=module)
    with pytest.raises(ValueError, match="streams"):
        new_memory(mcfg, 2, knn_attention=module, knn_store=ExactMemory(2, 16, 16, 8), n_layer=2)
    with pytest.raises(ValueError, match="memorizing memory only"):
        new_memory(MemoryConfig(kind="xl"), 1, knn_attention=module)


def test_an_ivf_memory_is_saved_with_the_state_and_resumes():
    # "ivf" is a local backend: its contents travel in the state (a resumed training run keeps its memory).
    # A real inverted file, trained before the save (IVF4: 156 entries, of a capacity of 256; the tail
    # evicts) and probing 1 of its 4 lists, so that which lists a query reads depends on the quantizer:
    # the resumed memory must read the one trained then, as the uninterrupted one does.
    model = tiny_model()
    module = knn_module(model, 0.0)
    x = torch.randint(0, 512, (2, 320))
    ivf = {"capacity": 256, "backend": "ivf", "factory": "IVF4,Flat", "nprobe": 1}
    want, _ = run(model, x, 16, memorizing(model, 2, module, **ivf))
    head, state = run(model, x[:, :192], 16, memorizing(model, 2, module, **ivf))
    saved = state.state_dict()
    assert saved["backend"] == "ivf" and saved["store"] is not None
    trained = [faiss.deserialize_index(i.numpy()) for i in saved["store"]["indexes"]]
    assert all(i.is_trained and i.ntotal == 0 for i in trained)  # the quantizer, without the entries
    back = memory_from_state_dict(saved, knn_attention=module,
                                  knn_store=FaissMemory(4, 16, 16, 256, factory="IVF4,Flat", nprobe=1))
    tail, _ = run(model, x[:, 192:], 16, back)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), want, atol=0, rtol=0)
