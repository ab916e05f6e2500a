"""The Compressive Transformer's attention-reconstruction loss (Rae et al. 2019, Algorithm 2).

Shape legend: B batch rows, T segment tokens, E evicted states, nh query heads, nkv key/value heads, hs head size.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from memlm.memory.compressive import CompressiveMemory
from memlm.model.decoder import (
    Decoder,
    LayerMemory,
    apply_rotary,
    rotary_cos_sin,
    sdpa_scale,
)

# ----------------------------------------------------------------------------------------------
# Attention-reconstruction loss (Rae et al. 2019, Algorithm 2)


@contextlib.contextmanager
def capture_queries(model: Decoder) -> Iterator[list[torch.Tensor]]:
    """Collect each layer's un-rotated queries (B, T, nh*hs) during a forward pass, in layer order.

    Forward hooks on q_proj, removed on exit, so the model keeps no state between calls.
    """
    captured: list[torch.Tensor] = []
    handles = [
        block.self_attn.q_proj.register_forward_hook(lambda _m, _inp, out: captured.append(out))
        for block in model.layers
    ]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def _project(m: LayerMemory, block: nn.Module) -> LayerMemory:
    """Keys and values of a memory that carries layer inputs, from `block`'s current projections.

    The weights are detached: the reconstruction loss must not train the model (Rae et al. 2019)."""
    if m.x is None:
        return m
    attn = block.self_attn
    B, S, _ = m.x.shape
    k = F.linear(m.x, attn.k_proj.weight.detach()).view(B, S, *m.k.shape[2:])  # (B, S, nkv, hs)
    v = F.linear(m.x, attn.v_proj.weight.detach()).view(B, S, *m.v.shape[2:])  # (B, S, nkv, hs)
    return m._replace(k=k, v=v)


def _attend(q: torch.Tensor, q_pos: torch.Tensor, m: LayerMemory, theta: float) -> torch.Tensor:
    """Queries q (B, nh, T, hs) at q_pos (B, T) attend over memory m only -> (B, nh, T, hs), float32."""
    B, nh, T, hs = q.shape
    nkv = m.k.shape[2]
    origin = q_pos[:, :1]  # (B, 1) same reference point as the decoder: only distances matter
    cos_q, sin_q = rotary_cos_sin(q_pos - origin, hs, theta)  # (B, 1, T, hs)
    cos_k, sin_k = rotary_cos_sin(m.pos - origin, hs, theta)  # (B, 1, S, hs)
    qr = apply_rotary(q.float(), cos_q, sin_q)  # (B, nh, T, hs)
    kr = apply_rotary(m.k.float().transpose(1, 2), cos_k, sin_k)  # (B, nkv, S, hs)
    vr = m.v.float().transpose(1, 2)  # (B, nkv, S, hs)
    kr = kr.repeat_interleave(nh // nkv, dim=1)  # (B, nh, S, hs) grouped-query attention
    vr = vr.repeat_interleave(nh // nkv, dim=1)  # (B, nh, S, hs)
    scores = qr @ kr.transpose(-1, -2) * sdpa_scale(hs)  # (B, nh, T, S)
    scores = scores.masked_fill(~m.valid[:, None, None, :], float("-inf"))
    return scores.softmax(dim=-1) @ vr  # (B, nh, T, hs)


def attention_reconstruction_loss(
    state: CompressiveMemory, queries: Sequence[torch.Tensor], model: Decoder
) -> torch.Tensor:
    """Mean squared difference between attention over the evicted memories and over their compression.

    state: the memory returned by the forward pass whose queries were captured (its last_compression).
    queries: per layer (B, T, nh*hs), from `capture_queries`.
    model: the decoder that ran; a re-projecting memory's keys and values come from its projections.
    Everything but the compression is detached (the paper's stop-gradients), so this loss trains only
    the compressor. Returns a scalar float32 (0 when nothing was compressed).
    """
    config = model.config
    terms = []
    for i, rec in enumerate(state.last_compression or ()):
        if rec is None:
            continue
        rows = rec.old.valid.any(dim=1)  # (B,) rows that evicted something
        if not bool(rows.any()):
            continue
        q = queries[i].detach()[rows]  # (B', T, nh*hs)
        Bq, T, _ = q.shape
        q = q.view(Bq, T, config.n_head, config.head_dim).transpose(1, 2)  # (B', nh, T, hs)
        q_pos = rec.query_pos[rows]  # (B', T)
        old = _project(LayerMemory(*(None if t is None else t[rows] for t in rec.old)), model.layers[i])
        comp = _project(LayerMemory(*(None if t is None else t[rows] for t in rec.compressed)), model.layers[i])
        target = _attend(q, q_pos, old, config.rope_theta)  # (B', nh, T, hs) no graph
        approx = _attend(q, q_pos, comp, config.rope_theta)  # (B', nh, T, hs) graph into the compressor
        terms.append(F.mse_loss(approx, target))
    if not terms:
        device = queries[0].device if queries else torch.device("cpu")
        return torch.zeros((), device=device)
    return torch.stack(terms).mean()
