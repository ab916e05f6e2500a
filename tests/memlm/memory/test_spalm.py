"""SPALM head (memlm.memory.spalm): gate 1 is the XL model exactly, rows without neighbours are the
base model, the head matches a per-position oracle, and gradients reach w_g, b and W but not the keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import phrase_documents, sharp_tiny_model

from memlm.jobs.windows import WindowConfig
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SpalmHead, spalm_forward
from memlm.memory.state import new_memory
from memlm.memory.xl import XLMemory
from memlm.jobs.windows import exact_searcher_over_documents
from memlm.retrieval.searcher import Neighbors

BOUNDARY = 1
K = 4


@pytest.fixture(scope="module")
def setup():
    model = sharp_tiny_model()
    store_docs = phrase_documents(4, 96, seed=1)
    searcher = exact_searcher_over_documents(model, store_docs, WindowConfig(context=32, stride=16), BOUNDARY)
    docs = torch.tensor(phrase_documents(2, 48, seed=1))[:, :48]  # (B, 48): the stored phrases, so neighbours match
    return model, searcher, docs


def segments(docs: torch.Tensor, T: int = 16):
    for lo in range(0, docs.shape[1], T):
        yield docs[:, lo : lo + T]  # (B, T)


def test_memory_kind_spalm_is_the_xl_memory():
    state = new_memory(MemoryConfig(kind="spalm", mem_len=8, sink_tokens=2), 2)
    assert isinstance(state, XLMemory) and state.mem_len == 8 and state.sink_tokens == 2


def test_gate_forced_to_one_equals_the_xl_model_exactly(setup):
    model, searcher, docs = setup
    head = SpalmHead(model.config.n_embd)
    with torch.no_grad():
        head.bias.fill_(float("inf"))  # g = sigmoid(inf) = 1 exactly
    mcfg = MemoryConfig(kind="spalm", mem_len=16, sink_tokens=2)
    base_state, spalm_state = new_memory(mcfg, 2), new_memory(mcfg, 2)
    mixed = SpalmHead(model.config.n_embd)  # the default gate: must differ, or the test could not fail
    mixed_state = new_memory(mcfg, 2)
    with torch.no_grad():
        for idx in segments(docs):
            base = model(idx, base_state)
            mask = torch.ones_like(idx, dtype=torch.bool)
            out = spalm_forward(model, head, idx, spalm_state, searcher, K, mask)
            other = spalm_forward(model, mixed, idx, mixed_state, searcher, K, mask)
            assert bool(out.has_neighbours.all())
            assert torch.equal(out.logits, base.logits)
            assert torch.equal(out.gate, torch.ones_like(out.gate))
            assert not torch.allclose(other.logits, base.logits)
            base_state, spalm_state, mixed_state = base.state, out.state, other.state


def test_rows_without_neighbours_give_the_base_output(setup):
    model, searcher, docs = setup
    head = SpalmHead(model.config.n_embd)
    with torch.no_grad():
        head.w_g.normal_(0, 0.5)
        head.bias.fill_(-1.0)  # g ~ 0.27: valid rows lean on the memory
    idx = docs[:, :16]
    mask = torch.ones_like(idx, dtype=torch.bool)
    mask[1, 8:] = False  # positions not searched have no neighbours either

    def drop_even_rows(nb: Neighbors) -> Neighbors:
        ids, values, dist = nb.ids.copy(), nb.values.copy(), nb.distances.copy()
        ids[::2], values[::2], dist[::2] = -1, -1, np.inf
        return Neighbors(dist, ids, values)

    with torch.no_grad():
        base = model(idx, None).logits  # (B, T, V)
        out = spalm_forward(model, head, idx, None, searcher, K, mask, neighbors_filter=drop_even_rows)
    searched = mask.reshape(-1).nonzero()[:, 0]  # searched positions, row-major (the filter's row order)
    empty = torch.zeros(idx.numel(), dtype=torch.bool)
    empty[searched[::2]] = True
    empty[~mask.reshape(-1)] = True
    empty = empty.reshape(idx.shape)  # (B, T)
    assert torch.equal(~out.has_neighbours, empty)
    assert torch.equal(out.logits[empty], base[empty])
    assert torch.equal(out.gate[empty], torch.ones(int(empty.sum())))
    assert not torch.allclose(out.logits[~empty], base[~empty])


def test_head_matches_a_per_position_oracle():
    torch.manual_seed(0)
    B, T, k, C, V = 2, 3, 4, 8, 11
    head = SpalmHead(C)
    with torch.no_grad():
        head.w_g.normal_()
        head.bias.fill_(0.3)
    h, W = torch.randn(B, T, C), torch.randn(V, C)
    tokens = torch.randint(0, V, (B, T, k))
    valid = torch.rand(B, T, k) > 0.3
    valid[0, 0] = False
    z, g = head(h, tokens, valid, W)
    for b in range(B):
        for t in range(T):
            ys = [W[tokens[b, t, j]] for j in range(k) if valid[b, t, j]]
            if not ys:
                assert g[b, t] == 1 and torch.equal(z[b, t], h[b, t])
                continue
            y = torch.stack(ys)  # (k', C)
            m = (torch.softmax(y @ h[b, t], dim=0)[:, None] * y).sum(0)  # (C,)
            gt = torch.sigmoid(head.w_g @ h[b, t] + head.bias)
            torch.testing.assert_close(g[b, t], gt)
            torch.testing.assert_close(z[b, t], (1 - gt) * m + gt * h[b, t])


def test_gradients_reach_w_g_b_and_W_but_not_the_keys(setup):
    model, searcher, docs = setup
    model.zero_grad(set_to_none=True)
    head = SpalmHead(model.config.n_embd)
    with torch.no_grad():
        head.w_g.normal_(0, 0.1)
    idx = docs[:, :16]
    mask = torch.ones_like(idx, dtype=torch.bool)
    out = spalm_forward(model, head, idx, None, searcher, K, mask)
    out.logits.logsumexp(-1).sum().backward()
    assert head.w_g.grad is not None and bool(head.w_g.grad.abs().sum() > 0)
    assert head.bias.grad is not None and float(head.bias.grad.abs()) > 0
    W = model.lm_head.weight
    assert W.grad is not None and bool(W.grad.abs().sum() > 0)
    assert not searcher.keys.requires_grad and searcher.keys.grad is None  # the datastore's keys are fixed
    model.zero_grad(set_to_none=True)

    # Through the head alone, W gets gradient exactly at the rows of the retrieved (valid) tokens.
    h = torch.randn(2, 3, model.config.n_embd)
    tokens = torch.tensor([[[5, 7], [9, 9], [3, 4]], [[11, 12], [13, 14], [15, 16]]])  # (B, T, k)
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[1, 2] = False  # tokens 15 and 16 are not valid: no gradient there
    W = torch.randn(model.config.vocab_size, model.config.n_embd, requires_grad=True)
    z, _ = head(h, tokens, valid, W)
    z.sum().backward()
    rows = set(W.grad.abs().sum(-1).nonzero()[:, 0].tolist())
    assert rows == {5, 7, 9, 3, 4, 11, 12, 13, 14}


def keyed_model(knn_key_layer: int, knn_key: str = "ffn_input"):
    """A 4-layer sharp tiny model whose kNN key is the feed-forward input of `knn_key_layer` (or final_hidden)."""
    from memlm.model.config import ModelConfig
    from memlm.model.decoder import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("tiny", n_layer=4, knn_key_layer=knn_key_layer, knn_key=knn_key))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    return model


@pytest.mark.parametrize(("key_layer", "top", "blocks"), [
    (-1, 1, {"layers.3.mlp."}),  # the default key (the last block's feed-forward input): its MLP only
    (1, 2, {"layers.2.", "layers.3."}),
    (1, 3, {"layers.1.mlp.", "layers.2.", "layers.3."}),
])
def test_gradients_reach_w_g_b_W_and_the_top_blocks_after_the_key_and_nothing_else(key_layer, top, blocks):
    from memlm.jobs.spalm import select_spalm_trainable

    model = keyed_model(key_layer)
    store_docs = phrase_documents(4, 96, seed=1)
    searcher = exact_searcher_over_documents(model, store_docs, WindowConfig(context=32, stride=16), BOUNDARY)
    trained = select_spalm_trainable(model, top, freeze_embeddings=False)
    assert set(trained) == {"norm.", *blocks}
    head = SpalmHead(model.config.n_embd)
    with torch.no_grad():
        head.w_g.normal_(0, 0.1)
    idx = torch.tensor(phrase_documents(2, 16, seed=1))  # (B, 16)
    state = new_memory(MemoryConfig(kind="spalm", mem_len=16, sink_tokens=0), 2)
    for seg in (idx, idx):  # the second segment attends to the first's memory: the trained blocks' k/v too
        out = spalm_forward(model, head, seg, state, searcher, K, torch.ones_like(seg, dtype=torch.bool))
        state = out.state
    out.logits.logsumexp(-1).sum().backward()
    reached = {n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert reached == {n for n, _ in model.named_parameters() if n.startswith(trained)} | {"lm_head.weight"}
    assert bool(head.w_g.grad.abs().sum() > 0) and float(head.bias.grad.abs()) > 0


@pytest.mark.parametrize("key_layer", [-1, 1])
def test_what_trains_never_makes_the_key_and_one_more_block_would(key_layer):
    from memlm.errors import MemlmError
    from memlm.jobs.spalm import select_spalm_trainable, spalm_trainable

    model = keyed_model(key_layer)
    idx = torch.tensor(phrase_documents(2, 16, seed=1))  # (B, 16)
    most = model.config.n_layer - model.config.key_layer_index
    select_spalm_trainable(model, most, freeze_embeddings=True)
    assert not model(idx, None).knn_key.requires_grad  # the key is a function of frozen weights only
    key = model.config.key_layer_index
    model.layers[key].post_attention_layernorm.requires_grad_(True)  # the rest of the key layer's block...
    assert model(idx, None).knn_key.requires_grad  # ...makes the key: the rule is tight
    with pytest.raises(MemlmError, match=f"--spalm-train-top {most + 1} would change the datastore's keys"):
        spalm_trainable(model.config, most + 1)
    with pytest.raises(MemlmError, match="at most 0"):  # final_hidden keys: nothing after them but W
        spalm_trainable(keyed_model(-1, "final_hidden").config, 1)
