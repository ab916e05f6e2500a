"""Segment memories for the decoder: Transformer-XL (Dai et al. 2019) and Compressive (Rae et al. 2019).

Both are `DecoderState`s (memlm.model): immutable values that the caller passes into
`Decoder.forward(idx, state)` and gets back, updated, in `LMOutput.state`. Nothing is kept in modules.

Per layer, the decoder attends to [sink tokens; compressed memory; memory; segment]:
- sink tokens: the first `sink_tokens` states of each document stay for the whole document. Pretrained
  models park much of their attention on the first tokens ("attention sinks", Xiao et al. 2023,
  StreamingLLM); once a sliding memory drops them perplexity collapses (issue 5: 56.2 without sinks
  vs 35.9 with 4 sinks on SmolLM2, segment 128, memory 1024). They keep their true positions.
- memory: a FIFO of the last `mem_len` states of earlier segments (stop-gradient: stored detached,
  so training is truncated backpropagation through time).
- compressed memory (CompressiveMemory only): states pushed out of the memory are compressed at rate c
  (max-pool, mean-pool or a learned Conv1d) into a second FIFO of `cmem_len` slots instead of dropped.

Keys are stored un-rotated with absolute positions (LayerMemory); the decoder applies rotary at
attention time relative to the segment start, so positions that continue across segments only ever
enter through relative distances.

Batch rows are independent streams: each row has its own positions and its own valid slots, and
`reset_rows(mask)` starts a new document in some rows only (their slots are invalidated, their
positions restart at 0). Full buffers evict their oldest states (FIFO); nothing ever resets by itself.

Shape legend:
    B batch rows, T segment tokens, S memory slots, E evicted states, nkv key/value heads,
    nh query heads, hs head size, D = nkv * hs, c compression rate, L layers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Literal, NamedTuple, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from memlm.config import ModelConfig
from memlm.model import Decoder, LayerMemory, apply_rotary, rotary_cos_sin, sdpa_scale

MemoryKind = Literal["none", "xl", "compressive"]
CompressFn = Literal["max", "mean", "conv"]
MEMORY_KINDS: tuple[str, ...] = ("none", "xl", "compressive")
COMPRESS_FNS: tuple[str, ...] = ("max", "mean", "conv")


@dataclass(frozen=True)
class MemoryConfig:
    """Which memory a segment-recurrent run carries, and its sizes (all counts are per layer)."""

    kind: str = "xl"
    """"none" (each segment alone), "xl" (Transformer-XL) or "compressive" (Compressive Transformer)."""
    mem_len: int = 1024
    """Memory slots: the last mem_len states of earlier segments."""
    cmem_len: int = 0
    """Compressed-memory slots (compressive only)."""
    compress_rate: int = 4
    """c: states per compressed slot (compressive only)."""
    compress_fn: str = "mean"
    """"max", "mean" (parameter-free pooling over time) or "conv" (learned Conv1d, see Compressor)."""
    sink_tokens: int = 4
    """The first sink_tokens states of each document stay in memory for the whole document."""

    def __post_init__(self) -> None:
        if self.kind not in MEMORY_KINDS:
            raise ValueError(f"memory must be one of {MEMORY_KINDS}, got {self.kind!r}")
        if self.compress_fn not in COMPRESS_FNS:
            raise ValueError(f"compress_fn must be one of {COMPRESS_FNS}, got {self.compress_fn!r}")
        if self.mem_len < 0 or self.cmem_len < 0 or self.sink_tokens < 0:
            raise ValueError("mem_len, cmem_len and sink_tokens must be >= 0")
        if self.compress_rate < 1:
            raise ValueError(f"compress_rate must be >= 1, got {self.compress_rate}")

    @property
    def memory_slots(self) -> int:
        """Slots each query attends to besides its own segment (the attention cost of the memory)."""
        if self.kind == "none":
            return 0
        return self.sink_tokens + self.mem_len + (self.cmem_len if self.kind == "compressive" else 0)

    @property
    def history_tokens(self) -> int:
        """Earlier tokens one layer's memory summarises (compressed slots cover c tokens each)."""
        if self.kind == "none":
            return 0
        compressed = self.cmem_len * self.compress_rate if self.kind == "compressive" else 0
        return self.sink_tokens + self.mem_len + compressed


# ----------------------------------------------------------------------------------------------
# FIFO primitive


def _gather_slots(m: LayerMemory, index: torch.Tensor, valid: torch.Tensor) -> LayerMemory:
    """Pick slots `index` (B, S') of every row of m; `valid` (B, S') is the new validity."""
    nkv, hs = m.k.shape[2], m.k.shape[3]
    idx4 = index[:, :, None, None].expand(-1, -1, nkv, hs)  # (B, S', nkv, hs)
    x = None if m.x is None else m.x.gather(1, index[:, :, None].expand(-1, -1, m.x.shape[2]))  # (B, S', C)
    return LayerMemory(m.k.gather(1, idx4), m.v.gather(1, idx4), m.pos.gather(1, index), valid, x)


def _concat(a: LayerMemory | None, b: LayerMemory) -> LayerMemory:
    if a is None or a.k.shape[1] == 0:
        return b
    return LayerMemory(
        torch.cat([a.k, b.k.to(a.k.dtype)], dim=1),  # (B, S+T, nkv, hs)
        torch.cat([a.v, b.v.to(a.v.dtype)], dim=1),  # (B, S+T, nkv, hs)
        torch.cat([a.pos, b.pos], dim=1),  # (B, S+T)
        torch.cat([a.valid, b.valid], dim=1),  # (B, S+T)
        None if a.x is None or b.x is None else torch.cat([a.x, b.x.to(a.x.dtype)], dim=1),  # (B, S+T, C)
    )


def push_fifo(
    fifo: LayerMemory | None, new: LayerMemory, capacity: int, group: int = 1, want_evicted: bool = False
) -> tuple[LayerMemory, LayerMemory | None]:
    """Append `new` (only its valid slots) to a per-row FIFO holding at most `capacity` valid states.

    Rows are independent: each keeps its own most recent valid slots, right-aligned (oldest first),
    with invalid padding on the left where a row holds fewer than the others.
    Eviction happens in whole groups of `group` states (the compression rate), oldest first, so each
    compressed slot summarises exactly `group` consecutive states; up to group - 1 states over capacity
    wait in the FIFO for their group to fill (they stay visible to attention, so nothing is lost).
    Returns (kept, evicted): evicted (B, E, ...) right-aligned with E a multiple of `group`, or None
    when nothing was evicted from any row or want_evicted is False.
    """
    both = _concat(fifo, new)  # (B, L, ...)
    B, L = both.valid.shape
    device = both.valid.device
    # A stable sort on validity moves invalid slots to the front and keeps valid ones in time order.
    order = torch.sort(both.valid.to(torch.int8), dim=1, stable=True).indices  # (B, L)
    n = both.valid.sum(dim=1)  # (B,) valid states per row
    excess = (n - capacity).clamp(min=0)  # (B,)
    evict = torch.div(excess, group, rounding_mode="floor") * group  # (B,)
    keep = n - evict  # (B,)

    s_keep = int(keep.max().item()) if B > 0 else 0
    cols = torch.arange(s_keep, device=device)  # (S',)
    kept_index = order[:, L - s_keep :]  # (B, S')
    kept_valid = cols[None, :] >= (s_keep - keep)[:, None]  # (B, S')
    kept = _gather_slots(both, kept_index, kept_valid)

    evicted = None
    e_max = int(evict.max().item()) if (want_evicted and B > 0) else 0
    if e_max > 0:
        j = torch.arange(e_max, device=device)  # (E,)
        # Row b's evicted states are sorted columns [L - n_b, L - n_b + e_b); right-align them in E.
        src = (L - n + evict - e_max)[:, None] + j[None, :]  # (B, E)
        ev_valid = j[None, :] >= (e_max - evict)[:, None]  # (B, E)
        ev_index = order.gather(1, src.clamp(min=0, max=L - 1))  # (B, E)
        evicted = _gather_slots(both, ev_index, ev_valid)
    return kept, evicted


# ----------------------------------------------------------------------------------------------
# Compression


class Compressor(nn.Module):
    """Learned compression (Rae et al. 2019): per layer, a Conv1d over time with kernel = stride = c.

    space "kv": one conv for keys and one for values, over the D = nkv * hs channels of the un-rotated
    states (memories that cache keys and values: evaluation of a frozen model).
    space "x": one conv over the C channels of the layer's normalised input, which the memory stores when
    it re-projects keys and values with the current weights (training; the paper compresses the
    memory's activations the same way).
    Initialised to mean pooling (weight = identity / c), so an untrained compressor equals the
    parameter-free "mean" compression and training can only start from that baseline.
    """

    def __init__(self, config: ModelConfig, rate: int, space: str = "kv") -> None:
        super().__init__()
        if space not in ("kv", "x"):
            raise ValueError(f"compressor space must be 'kv' or 'x', got {space!r}")
        self.rate = rate
        self.space = space
        d = config.n_kv_head * config.head_dim if space == "kv" else config.n_embd
        n = config.n_layer
        if space == "kv":
            self.k_convs = nn.ModuleList(nn.Conv1d(d, d, kernel_size=rate, stride=rate) for _ in range(n))
            self.v_convs = nn.ModuleList(nn.Conv1d(d, d, kernel_size=rate, stride=rate) for _ in range(n))
            convs = [*self.k_convs, *self.v_convs]
        else:
            self.x_convs = nn.ModuleList(nn.Conv1d(d, d, kernel_size=rate, stride=rate) for _ in range(n))
            convs = list(self.x_convs)
        with torch.no_grad():
            eye = torch.eye(d)[:, :, None].expand(d, d, rate) / rate  # (D, D, c)
            for conv in convs:
                conv.weight.copy_(eye)
                conv.bias.zero_()

    def forward(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """space "kv": k, v: (B, E, nkv, hs) with E a multiple of c -> (B, E/c, nkv, hs) each, in their dtype."""
        if self.space != "kv":
            raise ValueError("this compressor compresses layer inputs (space 'x'); call compress_x")
        return self._conv_time(self.k_convs[layer], k), self._conv_time(self.v_convs[layer], v)

    def compress_x(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """space "x": x: (B, E, C) with E a multiple of c -> (B, E/c, C), in its dtype."""
        if self.space != "x":
            raise ValueError("this compressor compresses keys and values (space 'kv'); call it directly")
        return self._conv_time(self.x_convs[layer], x[:, :, None, :])[:, :, 0, :]

    @staticmethod
    def _conv_time(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
        B, E = x.shape[0], x.shape[1]
        w = conv.weight
        y = conv(x.reshape(B, E, -1).transpose(1, 2).to(w.dtype))  # (B, D, E/c)
        return y.transpose(1, 2).reshape(B, -1, *x.shape[2:]).to(x.dtype)  # (B, E/c, ...)


def compress(
    old: LayerMemory, rate: int, fn: str, compressor: Compressor | None = None, layer: int = 0
) -> LayerMemory:
    """Compress right-aligned evicted states (B, E, ...) with E a multiple of `rate` into (B, E/c, ...).

    Positions: each compressed slot sits at the mean position of the c states it summarises. Rotary
    scores depend only on the distance between query and key position; a query at distance d from the
    slot is at distance d + delta (|delta| <= (c-1)/2) from each summarised state, so the slot keeps
    the average distance of its states, compressed slots stay in time order behind the memory, and the
    distances stay in the range the model saw in training. Pooling un-rotated keys and then rotating the
    pooled key at the mean position equals pooling the rotated keys up to an error of at most
    (c-1)/2 * theta_i per rotary frequency theta_i: negligible for the low frequencies that carry long-range
    attention, while high frequencies are blurred by any pooling anyway. (Positions are not averaged
    as integers: the fractional mean keeps the slot exactly centred.)
    """
    B, E, nkv, hs = old.k.shape
    if E % rate != 0:
        raise ValueError(f"{E} states cannot be compressed in groups of {rate}")
    groups = E // rate
    if fn not in COMPRESS_FNS:
        raise ValueError(f"unknown compress_fn {fn!r}")
    if fn == "conv" and compressor is None:
        raise ValueError("compress_fn 'conv' needs a Compressor")
    x = None
    if old.x is not None:
        # The memory re-projects keys and values from layer inputs: compress the inputs (Rae et al.
        # compress the memory's activations); k and v are left as cheap placeholders (mean pooling),
        # attention recomputes them from x.
        if fn == "conv":
            x = compressor.compress_x(layer, old.x)  # (B, E/c, C)
        else:
            xg = old.x.reshape(B, groups, rate, -1)  # (B, E/c, c, C)
            x = xg.amax(dim=2) if fn == "max" else xg.mean(dim=2)  # (B, E/c, C)
        fn = "mean"
    if fn == "conv":
        k, v = compressor(layer, old.k, old.v)  # (B, E/c, nkv, hs) each
    else:
        kg = old.k.reshape(B, groups, rate, nkv, hs)  # (B, E/c, c, nkv, hs)
        vg = old.v.reshape(B, groups, rate, nkv, hs)
        if fn == "max":
            k, v = kg.amax(dim=2), vg.amax(dim=2)  # (B, E/c, nkv, hs)
        else:
            k, v = kg.mean(dim=2), vg.mean(dim=2)  # (B, E/c, nkv, hs)
    pos = old.pos.reshape(B, groups, rate).float().mean(dim=2)  # (B, E/c) fractional
    # push_fifo evicts whole groups, so a group is entirely valid or entirely padding.
    valid = old.valid.reshape(B, groups, rate).all(dim=2)  # (B, E/c)
    return LayerMemory(k, v, pos, valid, x)


class Compression(NamedTuple):
    """What one layer's update pushed out of the memory and what it became (for the reconstruction loss)."""

    old: LayerMemory  # (B, E, nkv, hs) the evicted states, detached
    compressed: LayerMemory  # (B, E/c, nkv, hs) their compression; carries the compressor's graph
    query_pos: torch.Tensor  # (B, T) positions of the segment whose states evicted them


# ----------------------------------------------------------------------------------------------
# Memories


def _detached(m: LayerMemory, valid: torch.Tensor) -> LayerMemory:
    # Stop-gradient into memory (Transformer-XL's SG(h_{tau-1})): later segments never backpropagate
    # into the segment that wrote the memory.
    x = None if m.x is None else m.x.detach()
    return LayerMemory(m.k.detach(), m.v.detach(), m.pos.detach().float(), valid, x)


class XLMemory:
    """Transformer-XL memory with attention sinks. Immutable: `update` and `reset_rows` return new values.

    mem_len 0 and sink_tokens 0 is exactly "no memory" (every segment attends to itself only).

    reproject: keep each slot's layer input x (LayerMemory.x) so that attention projects the memory's
    keys and values with the *current* weights, as Transformer-XL does (k = SG(h) W_k). Training needs
    it: with cached keys (reproject False) W_k and W_v get no gradient from attention to the memory, so
    a model cannot learn to look further back than its segment (a copy task at distance > segment stays
    at chance, tests/memlm/test_train.py), and the cached keys are one optimizer step stale. For fixed
    weights both give the same scores; cached keys are cheaper (evaluation).
    """

    def __init__(
        self,
        mem_len: int,
        sink_tokens: int,
        next_pos: torch.Tensor,
        seen: torch.Tensor,
        sink: tuple[LayerMemory, ...] | None = None,
        mem: tuple[LayerMemory, ...] | None = None,
        reproject: bool = False,
    ) -> None:
        self.mem_len = mem_len
        self.sink_tokens = sink_tokens
        self.reproject = reproject
        self.next_pos = next_pos  # (B,) float32: position of each row's next token
        self.seen = seen  # (B,) int64: tokens of the current document seen so far (for sink slots)
        self.sink = sink  # per layer (B, N, nkv, hs), or None before the first segment
        self.mem = mem  # per layer (B, S, nkv, hs), or None before the first segment

    @classmethod
    def empty(
        cls, batch_size: int, mem_len: int, sink_tokens: int = 4, device: torch.device | str = "cpu",
        reproject: bool = False,
    ) -> "XLMemory":
        return cls(
            mem_len,
            sink_tokens,
            torch.zeros(batch_size, dtype=torch.float32, device=device),
            torch.zeros(batch_size, dtype=torch.long, device=device),
            reproject=reproject,
        )

    # -- DecoderState protocol --
    def positions(self, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
        if batch_size != self.next_pos.shape[0]:
            raise ValueError(f"memory has {self.next_pos.shape[0]} rows, segment has {batch_size}")
        steps = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
        return self.next_pos.to(device)[:, None] + steps[None, :]  # (B, T)

    def _parts(self, layer: int) -> list[LayerMemory]:
        parts = []
        if self.sink is not None and self.sink[layer].k.shape[1] > 0 and bool(self.sink[layer].valid.any()):
            parts.append(self.sink[layer])
        if self.mem is not None and self.mem[layer].k.shape[1] > 0:
            parts.append(self.mem[layer])
        return parts

    def layer_memory(self, layer: int) -> LayerMemory | None:
        parts = self._parts(layer)
        if not parts:
            return None  # lets attention take the plain causal fast path
        out = parts[0]
        for p in parts[1:]:
            out = _concat(out, p)  # (B, S, ...) in the order [sink; cmem; mem]
        return out

    def update(self, new_kv: list[LayerMemory]) -> "XLMemory":
        sink, fifo_new, T = self._split_segment(new_kv)
        mem = []
        for i, new in enumerate(fifo_new):
            kept, _ = push_fifo(self.mem[i] if self.mem is not None else None, new, self.mem_len)
            mem.append(kept)
        return XLMemory(self.mem_len, self.sink_tokens, self.next_pos + T, self.seen + T, sink, tuple(mem), self.reproject)

    # -- shared by both memories --
    def _split_segment(self, new_kv: list[LayerMemory]) -> tuple[tuple[LayerMemory, ...], list[LayerMemory], int]:
        """Route the segment's states: the document's first sink_tokens go to the sink slots, the rest
        (detached) to the FIFO. Returns (new sink per layer, FIFO input per layer, T)."""
        B, T = new_kv[0].pos.shape
        device = new_kv[0].k.device
        N = self.sink_tokens
        offset = self.seen.to(device)[:, None] + torch.arange(T, device=device)[None, :]  # (B, T) doc offsets
        to_sink = offset < N  # (B, T)
        sinks, fifo_in = [], []
        for i, new in enumerate(new_kv):
            if not self.reproject or new.x is None:
                new = new._replace(x=None)
            if self.reproject and new.x is None:
                raise ValueError("a reprojecting memory needs the layer inputs (LayerMemory.x) from the decoder")
            nkv, hs = new.k.shape[2], new.k.shape[3]
            if self.sink is not None:
                old = self.sink[i]
            else:
                old = LayerMemory(
                    new.k.new_zeros(B, N, nkv, hs).detach(),
                    new.v.new_zeros(B, N, nkv, hs).detach(),
                    torch.zeros(B, N, dtype=torch.float32, device=device),
                    torch.zeros(B, N, dtype=torch.bool, device=device),
                    None if new.x is None else new.x.new_zeros(B, N, new.x.shape[2]).detach(),
                )
            k, v, pos, valid = old.k.clone(), old.v.clone(), old.pos.clone(), old.valid.clone()
            x = None if old.x is None else old.x.clone()
            # Only the first N tokens of a segment can be sink tokens; write token t to slot offset t.
            for t in range(min(T, N)):
                rows = to_sink[:, t]  # (B,)
                if not bool(rows.any()):
                    continue
                slot = offset[:, t].clamp(max=N - 1)  # (B,)
                r = rows.nonzero()[:, 0]
                k[r, slot[r]] = new.k[r, t].detach().to(k.dtype)
                v[r, slot[r]] = new.v[r, t].detach().to(v.dtype)
                pos[r, slot[r]] = new.pos[r, t].float()
                valid[r, slot[r]] = True
                if x is not None:
                    x[r, slot[r]] = new.x[r, t].detach().to(x.dtype)
            sinks.append(LayerMemory(k, v, pos, valid, x))
            fifo_in.append(_detached(new, new.valid & ~to_sink))
        return tuple(sinks), fifo_in, T

    def reset_rows(self, mask: torch.Tensor) -> "XLMemory":
        """A new document starts in rows where mask (B,) is True: clear only those rows, positions restart at 0."""
        next_pos, seen, sink, mem, _ = self._reset_common(mask)
        return XLMemory(self.mem_len, self.sink_tokens, next_pos, seen, sink, mem, self.reproject)

    def _reset_common(self, mask: torch.Tensor):
        mask = mask.to(self.next_pos.device).bool()  # (B,)
        keep = ~mask[:, None]  # (B, 1)

        def clear(layers: tuple[LayerMemory, ...] | None) -> tuple[LayerMemory, ...] | None:
            if layers is None:
                return None
            return tuple(m._replace(valid=m.valid & keep) for m in layers)

        next_pos = torch.where(mask, torch.zeros_like(self.next_pos), self.next_pos)
        seen = torch.where(mask, torch.zeros_like(self.seen), self.seen)
        return next_pos, seen, clear(self.sink), clear(self.mem), clear

    def state_dict(self) -> dict:
        """Tensors and sizes, for checkpoints (resume continues with the same memory)."""
        return {
            "kind": "xl", "mem_len": self.mem_len, "sink_tokens": self.sink_tokens, "reproject": self.reproject,
            "next_pos": self.next_pos, "seen": self.seen,
            "sink": None if self.sink is None else [tuple(m) for m in self.sink],
            "mem": None if self.mem is None else [tuple(m) for m in self.mem],
        }


class CompressiveMemory(XLMemory):
    """Compressive Transformer memory: [sink; compressed memory (cmem_len); memory (mem_len)].

    States pushed out of the memory are compressed in groups of `rate` with `compress_fn` into the
    compressed FIFO, whose oldest slots are dropped when it is full. `last_compression` holds what the
    latest update compressed, for `attention_reconstruction_loss`.
    """

    def __init__(
        self,
        mem_len: int,
        cmem_len: int,
        rate: int,
        compress_fn: str,
        sink_tokens: int,
        next_pos: torch.Tensor,
        seen: torch.Tensor,
        sink: tuple[LayerMemory, ...] | None = None,
        mem: tuple[LayerMemory, ...] | None = None,
        cmem: tuple[LayerMemory, ...] | None = None,
        compressor: Compressor | None = None,
        last_compression: tuple[Compression | None, ...] | None = None,
        reproject: bool = False,
    ) -> None:
        super().__init__(mem_len, sink_tokens, next_pos, seen, sink, mem, reproject)
        if compress_fn == "conv" and compressor is None:
            raise ValueError("compress_fn 'conv' needs a Compressor")
        if compressor is not None and compressor.rate != rate:
            raise ValueError(f"compressor rate {compressor.rate} != compress_rate {rate}")
        if compress_fn == "conv" and compressor.space != ("x" if reproject else "kv"):
            raise ValueError(f"a {'re-projecting' if reproject else 'key/value'} memory needs a compressor of "
                             f"space {'x' if reproject else 'kv'}, got {compressor.space!r}")
        self.cmem_len = cmem_len
        self.rate = rate
        self.compress_fn = compress_fn
        self.cmem = cmem  # per layer (B, S_c, nkv, hs), or None
        self.compressor = compressor  # parameters only; the memory's contents live in this value
        self.last_compression = last_compression

    @classmethod
    def empty(  # type: ignore[override]
        cls,
        batch_size: int,
        mem_len: int,
        cmem_len: int,
        rate: int = 4,
        compress_fn: str = "mean",
        sink_tokens: int = 4,
        device: torch.device | str = "cpu",
        compressor: Compressor | None = None,
        reproject: bool = False,
    ) -> "CompressiveMemory":
        return cls(
            mem_len, cmem_len, rate, compress_fn, sink_tokens,
            torch.zeros(batch_size, dtype=torch.float32, device=device),
            torch.zeros(batch_size, dtype=torch.long, device=device),
            compressor=compressor, reproject=reproject,
        )

    def _parts(self, layer: int) -> list[LayerMemory]:
        parts = super()._parts(layer)
        if self.cmem is not None and self.cmem[layer].k.shape[1] > 0:
            # [sink; cmem; mem]: insert the compressed memory before the memory.
            has_mem = self.mem is not None and self.mem[layer].k.shape[1] > 0
            parts.insert(len(parts) - 1 if has_mem else len(parts), self.cmem[layer])
        return parts

    def update(self, new_kv: list[LayerMemory]) -> "CompressiveMemory":
        sink, fifo_new, T = self._split_segment(new_kv)
        mem, cmem, record = [], [], []
        for i, new in enumerate(fifo_new):
            kept, evicted = push_fifo(
                self.mem[i] if self.mem is not None else None, new, self.mem_len, self.rate,
                want_evicted=self.cmem_len > 0,
            )
            mem.append(kept)
            old_c = self.cmem[i] if self.cmem is not None else None
            if evicted is None:
                record.append(None)
                cmem.append(old_c if old_c is not None else _empty_like(kept))
                continue
            compressed = compress(evicted, self.rate, self.compress_fn, self.compressor, i)  # (B, E/c, ...)
            record.append(Compression(evicted, compressed, new_kv[i].pos.detach().float()))
            # The stored compressed memory is detached: the LM loss never trains the compressor
            # (Rae et al. 2019 train it with the local reconstruction loss only).
            c_kept, _ = push_fifo(old_c, _detached(compressed, compressed.valid), self.cmem_len)
            cmem.append(c_kept)
        return CompressiveMemory(
            self.mem_len, self.cmem_len, self.rate, self.compress_fn, self.sink_tokens,
            self.next_pos + T, self.seen + T, sink, tuple(mem), tuple(cmem), self.compressor, tuple(record),
            self.reproject,
        )

    def reset_rows(self, mask: torch.Tensor) -> "CompressiveMemory":
        next_pos, seen, sink, mem, clear = self._reset_common(mask)
        return CompressiveMemory(
            self.mem_len, self.cmem_len, self.rate, self.compress_fn, self.sink_tokens,
            next_pos, seen, sink, mem, clear(self.cmem), self.compressor, None, self.reproject,
        )

    def state_dict(self) -> dict:
        d = super().state_dict()
        d.update(kind="compressive", cmem_len=self.cmem_len, rate=self.rate, compress_fn=self.compress_fn,
                 cmem=None if self.cmem is None else [tuple(m) for m in self.cmem])
        return d


def _empty_like(m: LayerMemory) -> LayerMemory:
    return LayerMemory(m.k[:, :0], m.v[:, :0], m.pos[:, :0], m.valid[:, :0], None if m.x is None else m.x[:, :0])


def new_memory(
    config: MemoryConfig, batch_size: int, device: torch.device | str = "cpu", compressor: Compressor | None = None,
    reproject: bool = False,
) -> XLMemory | None:
    """An empty memory for `config` (None for kind "none"); reproject: see XLMemory (True for training).

    A conv compressor of space "x" (trained by memlm train) compresses layer inputs, so its memory
    re-projects whatever `reproject` says."""
    if config.kind == "none":
        return None
    if config.kind == "compressive" and config.compress_fn == "conv" and compressor is not None:
        reproject = reproject or compressor.space == "x"
    if config.kind == "xl":
        return XLMemory.empty(batch_size, config.mem_len, config.sink_tokens, device, reproject)
    return CompressiveMemory.empty(
        batch_size, config.mem_len, config.cmem_len, config.compress_rate, config.compress_fn,
        config.sink_tokens, device, compressor, reproject,
    )


def memory_from_state_dict(d: dict, device: torch.device | str = "cpu", compressor: Compressor | None = None) -> XLMemory:
    """Inverse of `state_dict` (the compressor, a module, is passed in separately)."""

    def layers(x):
        if x is None:
            return None
        return tuple(LayerMemory(*(None if t is None else t.to(device) for t in m)) for m in x)

    next_pos, seen = d["next_pos"].to(device), d["seen"].to(device)
    reproject = bool(d.get("reproject", False))
    if d["kind"] == "xl":
        return XLMemory(d["mem_len"], d["sink_tokens"], next_pos, seen, layers(d["sink"]), layers(d["mem"]), reproject)
    return CompressiveMemory(
        d["mem_len"], d["cmem_len"], d["rate"], d["compress_fn"], d["sink_tokens"], next_pos, seen,
        layers(d["sink"]), layers(d["mem"]), layers(d["cmem"]), compressor, reproject=reproject,
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
