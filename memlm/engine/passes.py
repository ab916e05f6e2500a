"""The engine's forward passes: the step's token ids and cache view built on the host, then one pass.

`run` feeds a plan of rows (sorted by slot, tokens each), left-padded to the longest; `run_packed` feeds the
step's prompt chunks and decode rows in ONE pass (kv_cache.PackedStep: the weights are read once per step,
decode rows are not padded to the chunk). Both go through memlm.engine.spalm_rows.forward, which gives the
decoder's logits or, for SPALM rows, keeps what the head needs; a memorizing engine's passes attend to each
row's kNN memory at its layer (memlm.engine.memorizing_rows.attach).

Shape legend: B rows in a forward pass, T tokens per row, V vocab, C key width, N packed tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from memlm.engine import memorizing_rows, spalm_rows
from memlm.engine.compression import compress_due
from memlm.engine.kv_cache import PackedGroup, PackedStep, RowCache, StepView
from memlm.engine.requests import EngineConfig
from memlm.engine.rows import Row, window_starts
from memlm.model.decoder import Decoder

if TYPE_CHECKING:  # score_rows runs its passes here
    from memlm.engine.score_rows import ScoreRow


class Engine(Protocol):
    """What a pass uses of memlm.engine.engine.Engine (a protocol: that module imports this one)."""

    model: Decoder
    config: EngineConfig
    cache: RowCache


class TreeShape(NamedTuple):
    """How a row's fed tokens lie when they are a draft tree (memlm.engine.draft_trees): x_t, then the nodes."""

    depths: list[int]
    """(n,) each token's position past the first's (a chain: 0 .. n - 1); its slot is still first + index."""
    sees: np.ndarray
    """(n, n) bool: which of the row's fed tokens each attends to (a chain: the causal mask)."""


def inputs(engine: Engine, plan: Sequence[tuple[Row | ScoreRow, int]], verify: bool = False,
           trees: Sequence[TreeShape] | None = None) -> tuple[torch.Tensor, StepView]:
    """The left-padded token ids (B, T) of a pass feeding `plan` (rows sorted by slot, tokens each) and its
    cache view. Built on the host with whole-array operations (no per-row tensor ops: at 32 rows those
    cost more than the step's attention). trees: per plan row its tokens' TreeShape (a verifying pass of
    draft trees)."""
    ns = np.array([n for _, n in plan])  # (B,)
    T = int(ns.max())
    first = np.array([row.fed - row.base for row, _ in plan])  # (B,) position of each row's first fed token
    offset = np.arange(T)[None, :] - (T - ns)[:, None]  # (B, T) index in the row's chunk; < 0: padding
    real = offset >= 0  # (B, T)
    index = np.where(real, offset, ns[:, None] - 1)  # (B, T) padding: the last real token's
    pos = first[:, None] + index  # (B, T)
    idx = np.zeros(real.shape, dtype=np.int64)  # (B, T)
    idx[real] = np.concatenate([row.tokens[row.fed : row.fed + n] for row, n in plan])
    slots, sees = None, None
    if trees is not None:  # a node's position is its depth past x_t's, its slot its index past x_t's
        slots = engine.cache.slot_of(torch.from_numpy(pos))  # (B, T)
        depth = np.zeros(real.shape, dtype=np.int64)  # (B, T)
        depth[real] = np.concatenate([tree.depths for tree in trees])
        pos = first[:, None] + np.where(real, depth, depth[:, -1:])  # (B, T) padding: the last token's (left pad)
        sees = torch.zeros(real.shape[0], T, T, dtype=torch.bool)  # (B, T, T)
        for b, ((_, n), tree) in enumerate(zip(plan, trees)):
            sees[b, T - n :, T - n :] = torch.from_numpy(tree.sees)
    pos_t = torch.from_numpy(pos)  # (B, T)
    generated_from = torch.tensor([[row.first_generated_pos] for row, _ in plan])  # (B, 1)
    window = window_starts(pos_t, generated_from, engine.cache.layout.segment)  # (B, T)
    if engine.cache.layout.cmem:
        compress_due(engine.cache, [row for row, _ in plan], window[:, -1].tolist(), engine.config.xl.compress_fn)
    view = engine.cache.view([row.slot for row, _ in plan], pos_t, torch.from_numpy(real), window, verify, slots,
                             sees)
    return torch.from_numpy(idx), view


def run(engine: Engine, plan: Sequence[tuple[Row | ScoreRow, int]], every_position: bool = False,
        verify: bool = False, trees: Sequence[TreeShape] | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """One forward pass feeding `plan` (rows sorted by slot, tokens each), left-padded to the longest.
    Returns the last position's logits (B, V) and kNN keys (B, C) (every_position: all, (B, T, V) and (B, T, C))
    and, per row, whether it has fed everything it had (its logits are the next token's). verify: RowCache.view;
    trees: `inputs`."""
    idx, view = inputs(engine, plan, verify, trees)
    T = idx.shape[1]
    state = memorizing_rows.attach(engine, [[row for row, _ in plan]], view)  # memorizing: kNN attention
    out = spalm_rows.forward(engine, idx.to(engine.model.device), state, 0 if every_position else T - 1)
    for row, n in plan:
        row.fed += n
    logits = out.logits if every_position else out.logits[:, -1]  # (B, T, V) or (B, V)
    keys = out.knn_key if every_position else out.knn_key[:, -1]  # (B, T, C) or (B, C)
    return logits, keys, [row.to_feed == 0 for row, _ in plan]


def run_packed(engine: Engine, prefilling: list[tuple[Row, int]], decoding: list[tuple[Row, int]],
               ) -> tuple[torch.Tensor, torch.Tensor, list[Row]]:
    """Prefill chunks and decode rows in ONE forward pass (kv_cache.PackedStep: the weights are read once
    per step). The packed sequence puts the tokens whose logits are read last (the last token of each
    prompt that completes now, then every decode row's), so the head runs on those only. Returns their
    logits (b, V), kNN keys (b, C) and rows, prompts completed first, then the decode rows."""
    p_idx, p_view = inputs(engine, prefilling)
    d_idx, d_view = inputs(engine, decoding)
    Tp = p_idx.shape[1]
    real = p_view.real_cpu.reshape(-1).clone()  # (Bp*Tp,)
    done = [row.to_feed == n for row, n in prefilling]
    last = torch.tensor([i * Tp + Tp - 1 for i, d in enumerate(done) if d], dtype=torch.long)  # (b_p,)
    real[last] = False
    order = torch.cat([real.nonzero()[:, 0], last])  # (n_p,) flat indices, the read ones last
    n_p, n_d = len(order), len(decoding)
    device = engine.model.device
    groups = [PackedGroup(p_view, torch.arange(n_p, device=device), order.to(device)),
              PackedGroup(d_view, torch.arange(n_p, n_p + n_d, device=device), None)]
    idx = torch.cat([p_idx.reshape(-1)[order], d_idx.reshape(-1)])[None]  # (1, N)
    read = len(last) + n_d
    state = memorizing_rows.attach(engine, [[r for r, _ in prefilling], [r for r, _ in decoding]], PackedStep(groups))
    out = spalm_rows.forward(engine, idx.to(device), state, idx.shape[1] - read)
    for row, n in (*prefilling, *decoding):
        row.fed += n
    ready = [row for (row, _), d in zip(prefilling, done) if d] + [row for row, _ in decoding]
    return out.logits[0], out.knn_key[0, -read:], ready  # (b, V), (b, C)
