"""Compressed memory in the engine's cache rows (the Compressive Transformer, Rae et al. 2019).

A compressive row is an XL row (memlm.engine.kv_cache) whose memory evicts its oldest states in groups
of c (CacheLayout.rate) and keeps, instead of dropping them, their compression: one key and one value per
group, in the row's compressed slots (CacheLayout.cmem of them, group j in slot sink + j % cmem). The rules
are memlm.memory.compressive's: group j holds the non-sink positions [sink + j c, sink + (j + 1) c); it is
pooled ("mean" or "max", CompressiveMemory's parameter-free functions) over the UN-rotated keys and the
values, and sits at the mean of its positions (fractional: (c - 1) / 2 past its first).

The cache holds keys rotated at their positions (rotary once per key), so a group's keys are rotated back
by their own positions (kv_cache.rotary_at, exact), pooled, and the pooled key rotated at the group's mean
position. Compression is lazy: before a pass, each row's groups evicted by the start of the segment it
feeds are compressed from its ring, where they still are (the ring holds mem_len + c - 1 + segment
positions, so the states of a segment's evicted groups are overwritten by the following segment at the
earliest). Rows and groups of one pass are compressed together, one gather per layer.

Shape legend: Q (row, group) pairs, c states per group, nkv key/value heads, hs head size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from memlm.engine.kv_cache import RowCache, rotary_at
from memlm.memory.compressive import pool_states
from memlm.model.decoder import apply_rotary

POOLS = ("mean", "max")
"""The compress functions the engine applies (memlm.model.memory_config.COMPRESS_FNS without the learned "conv",
which the one-sequence path does not serve either)."""


class CompressedRow(Protocol):
    """What compress_due reads and advances of a running row (memlm.engine.rows.Row, ScoreRow)."""

    slot: int
    compressed: int
    """Groups compressed so far."""


def compress_due(cache: RowCache, rows: Sequence[CompressedRow], windows: Sequence[int], pool: str) -> None:
    """Before a pass: compress each row's groups evicted by the start of the segment it feeds (`windows`, one
    per row: a chunk stays in one segment); of those, only the last cmem are kept, so only they are made."""
    layout = cache.layout
    slots: list[int] = []
    groups: list[int] = []
    for row, window in zip(rows, windows):
        due = layout.groups_before(window)
        for j in range(max(row.compressed, due - layout.cmem), due):
            slots.append(row.slot)
            groups.append(j)
        row.compressed = max(row.compressed, due)
    if groups:
        compress_groups(cache, slots, groups, pool)


def compress_groups(cache: RowCache, rows: list[int], groups: list[int], pool: str) -> None:
    """Compress group `groups[i]` of cache row `rows[i]` (its c states in the row's ring) into its slot."""
    if pool not in POOLS:
        raise ValueError(f"the engine compresses by {POOLS}, not {pool!r}")
    layout, device = cache.layout, cache.device
    N, c = layout.sink, layout.rate
    j = torch.tensor(groups, dtype=torch.long)  # (Q,)
    first = N + j * c  # (Q,) the group's first position
    positions = first[:, None] + torch.arange(c)[None, :]  # (Q, c)
    r = torch.tensor(rows, dtype=torch.long, device=device)  # (Q,)
    src = cache.slot_of(positions).to(device)  # (Q, c)
    dst = (N + torch.remainder(j, layout.cmem)).to(device)  # (Q,)
    back = rotary_at(-positions.to(device), cache.inv_freq)  # (Q, 1, c, hs) each: undoes each key's rotation
    mean = layout.group_position(j)[:, None].to(device)  # (Q, 1) fractional
    forward = rotary_at(mean, cache.inv_freq)  # (Q, 1, 1, hs) each
    for kc, vc in zip(cache.k, cache.v):
        k = apply_rotary(kc[r[:, None], :, src].transpose(1, 2), *back)  # (Q, nkv, c, hs) un-rotated
        v = vc[r[:, None], :, src].transpose(1, 2)  # (Q, nkv, c, hs)
        k, v = pool_states(k, pool, dim=2), pool_states(v, pool, dim=2)  # (Q, nkv, hs) each
        kc[r, :, dst] = apply_rotary(k[:, :, None], *forward)[:, :, 0]  # (Q, nkv, hs)
        vc[r, :, dst] = v  # (Q, nkv, hs)
    cache.slot_pos[r, dst] = first.to(device)  # written: the masks show the slot (kv_cache.StepView._mask)
