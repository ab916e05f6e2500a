"""A preallocated KV cache with per-row lengths, for the decoding engine.

Every row of the running batch owns one row of the cache: per layer, keys and values (R, nkv, L, hs)
(allocated for all rows at once and grown by doubling up to L as rows get longer, never per token), and
`slot_pos` (R, L) int64, the position each slot holds (-1: empty). A forward pass
gets a `StepView` (a DecoderState): its `CachedAttention` per layer rotates the new queries and keys,
writes the keys *already rotated* with the values into their slots, and attends over the row's slots
with a mask built once per step from `slot_pos`. Rotary is applied once per key, when it is written,
never again to every cached key at every step (what memlm.model.decoder.KVCache does).

Slots: positions below `sink` (the attention sinks of an XL memory, Xiao et al. 2023) keep slots
[0, sink); every later position p lives in the ring slot sink + (p - sink) % ring. Without a memory
sink = 0 and ring = the row's capacity, so slots never wrap. With the XL memory (Dai et al. 2019) the
ring holds mem_len + segment positions: a query at p in a segment starting at s attends to the sinks,
to positions [s - mem_len, s) and causally within its segment (memlm.memory.xl's semantics, with the
memory as a window over the ring, never copied); for a generated token s = p. The sinks take positions
right before the oldest memory slot (XLMemory._sink_positions, StreamingLLM section 3.2): their keys are
written rotated at their true positions, and the shift is applied to the query instead, q R(-delta),
since R(a)q . R(b)k depends on b - a only.

Exact positions far past the context: positions are int64 (exact), and the rotary angle
p * inv_freq is formed in float64 and reduced modulo 2 pi before rounding to float32 (`rotary_at`), from
the integer position of every token at every step, never accumulated. The product's float64 error is
p * f * 2^-53, so the reduced angle is within 2e-6 rad of the exact one up to position ~10^10
(tests/memlm/engine/test_kv_cache.py checks 1.2e10), where a float32 product is off by up to 0.03 rad at
position 10^6 already and the scores drift.

Shape legend: R cache rows, L slots per row, B rows in a step, T tokens per row in the step,
nh query heads, nkv key/value heads, g = nh / nkv, hs head size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memlm.model.config import ModelConfig
from memlm.model.decoder import (
    CachedAttention,
    LayerMemory,
    apply_rotary,
    rotary_inv_freq,
)

TWO_PI = 2.0 * math.pi
INITIAL_SLOTS = 64
"""Slots per row allocated at first (RowCache.reserve grows them)."""


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in the cache (config: a ModelConfig, or a transformers model's
    HFModelConfig): 2 x n_layer x nkv x hs elements of `dtype`
    (SmolLM2-135M in float32: 46,080 bytes, so 2^20 tokens are 45 GiB)."""
    return 2 * config.n_layer * config.n_kv_head * config.head_dim * dtype.itemsize


def rotary_at(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pos: (B, T) int64 positions -> cos, sin (B, 1, T, hs) float32, the angles reduced exactly.

    The product is taken in float64 and reduced mod 2 pi before the float32 rounding (module docstring)."""
    angles = torch.remainder(pos.double()[..., None] * inv_freq.double(), TWO_PI).float()  # (B, T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, T, hs), the "rotate_half" layout of the decoder
    return angles.cos()[:, None], angles.sin()[:, None]  # (B, 1, T, hs) each


@dataclass(frozen=True)
class CacheLayout:
    """How many rows the cache has and how a row's slots are laid out."""

    rows: int
    """R: rows (requests decoded at once)."""
    sink: int
    """Slots [0, sink) hold the first `sink` positions for good (XL sinks); 0 without a memory."""
    ring: int
    """Ring slots after the sinks; without a memory, the most positions a row holds (no wrap)."""
    mem_len: int | None
    """XL memory: a query sees positions [s - mem_len, s) of earlier segments; None: every cached one."""
    segment: int | None
    """XL memory: prompt tokens attend in segments of this many tokens (the memory's segment); None."""
    cmem: int = 0
    """Compressive memory (Rae et al. 2019): slots [sink, sink + cmem) hold the last `cmem` compressed
    groups (memlm.engine.compression), group j in slot sink + j % cmem; 0: none."""
    rate: int = 1
    """Compressive memory: states per compressed group, c. The memory evicts in whole groups, so up to
    c - 1 states over mem_len stay visible (memlm.memory.xl.push_fifo); 1: the XL memory."""

    def __post_init__(self) -> None:
        if self.rows < 1 or self.ring < 1 or self.sink < 0 or self.cmem < 0 or self.rate < 1:
            raise ValueError(f"a cache needs rows >= 1, ring >= 1, sink >= 0, cmem >= 0 and rate >= 1, got {self}")
        if (self.mem_len is None) != (self.segment is None):
            raise ValueError("mem_len and segment go together (the XL memory) or are both None")
        if self.mem_len is None and (self.cmem or self.rate != 1):
            raise ValueError("a compressed memory needs the XL memory's mem_len and segment")
        if self.mem_len is not None and self.ring < self.mem_len + self.rate - 1 + self.segment:
            raise ValueError(f"an XL ring needs mem_len + rate - 1 + segment = "
                             f"{self.mem_len + self.rate - 1 + self.segment} slots, got {self.ring}")

    @property
    def slots(self) -> int:
        """L: slots per row."""
        return self.sink + self.cmem + self.ring

    @property
    def wraps(self) -> bool:
        """True when positions reuse ring slots (the XL memory); False: a row is full at `ring` tokens."""
        return self.mem_len is not None

    def memory_start(self, window: torch.Tensor) -> torch.Tensor:
        """(B, T) int64: the oldest position a query of segment start `window` sees besides the sinks. The
        memory holds the last mem_len states plus those over it short of a whole group: with E = s - sink -
        mem_len states over capacity, E mod c of them (memlm.memory.xl.push_fifo's eviction by groups)."""
        over = window - self.sink - self.mem_len  # (B, T)
        waiting = torch.where(over > 0, torch.remainder(over, self.rate), torch.zeros_like(over))  # (B, T)
        return window - self.mem_len - waiting  # (B, T)

    def groups_before(self, window: int) -> int:
        """Groups compressed (evicted from the memory) before a segment that starts at `window`."""
        return max(0, window - self.sink - self.mem_len) // self.rate

    def group_position(self, group: torch.Tensor) -> torch.Tensor:
        """Float64 position of compressed group(s) `group` (int64, any shape): the mean of its c positions,
        (c - 1) / 2 past its first (memlm.memory.compressive.compress: fractional, exactly centred)."""
        return (self.sink + group * self.rate).double() + (self.rate - 1) / 2


class RowCache:
    """The cache tensors. Rows are cleared when a request takes them (`clear_row`); views write into them."""

    def __init__(self, config: ModelConfig, layout: CacheLayout, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.layout = layout
        self.k: list[torch.Tensor] = []  # per layer (R, nkv, allocated, hs)
        self.v: list[torch.Tensor] = []
        self.slot_pos = torch.full((layout.rows, layout.slots), -1, dtype=torch.long, device=device)  # (R, L)
        self.inv_freq = rotary_inv_freq(config.head_dim, config.rope_theta, device)  # (hs/2,)
        self.allocated = 0
        """Slots allocated per row so far: grown by doubling up to layout.slots as rows get longer, never per
        token, so a 32-row cache of an 8192-token model does not zero 12 GB up front."""
        self._dtype = dtype
        self.reserve(min(layout.slots, INITIAL_SLOTS))

    def reserve(self, slots: int) -> None:
        """Make at least `slots` slots per row exist (doubling; zeros, so unwritten slots hold finite values)."""
        if slots <= self.allocated:
            return
        new = min(self.layout.slots, max(slots, 2 * self.allocated))
        R, nkv, hs = self.layout.rows, self.config.n_kv_head, self.config.head_dim

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            t = torch.zeros(R, nkv, new, hs, device=self.device, dtype=self._dtype)  # (R, nkv, new, hs)
            if old is not None:
                t[:, :, : old.shape[2]] = old
            return t

        layers = range(self.config.n_layer)
        self.k = [grown(self.k[i] if self.k else None) for i in layers]
        self.v = [grown(self.v[i] if self.v else None) for i in layers]
        self.allocated = new

    @property
    def device(self) -> torch.device:
        return self.slot_pos.device

    def clear_row(self, row: int) -> None:
        """Forget everything row `row` holds (a new request, or a sliding window re-encoded)."""
        self.slot_pos[row] = -1

    def move_row(self, src: int, dst: int) -> None:
        """Row `src`'s keys, values and positions become row `dst`'s (src is left empty): the engine keeps
        its rows packed at the front, so a decode step reads a view of the cache instead of a gathered copy."""
        for t in (*self.k, *self.v):
            t[dst].copy_(t[src])
        self.slot_pos[dst] = self.slot_pos[src]
        self.clear_row(src)

    def slot_of(self, pos: torch.Tensor) -> torch.Tensor:
        """Slots (same shape) of int64 positions `pos` (module docstring)."""
        sink, ring = self.layout.sink, self.layout.ring
        return torch.where(pos < sink, pos, sink + self.layout.cmem + torch.remainder(pos - sink, ring))

    def move_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Slots `src` of row `row` (keys, values, positions) copied to slots `dst` (a speculative pass's accepted
        tree path into the slots after x_t: memlm.engine.draft_trees)."""
        for t in (*self.k, *self.v):
            t[row, :, dst] = t[row, :, src]
        self.slot_pos[row, dst] = self.slot_pos[row, src]

    def view(self, rows: list[int], pos: torch.Tensor, real: torch.Tensor, window: torch.Tensor,
             verify: bool = False, slots: torch.Tensor | None = None, sees: torch.Tensor | None = None) -> StepView:
        """The DecoderState of one forward pass over cache rows `rows` (B,), sorted.

        pos: (B, T) int64 on the host, the position of every token; real: (B, T) bool, False for padding (not written,
        output ignored); window: (B, T) int64, the start s of each token's attention segment (XL memory;
        ignored without one). Writes slot_pos for the real tokens now: the step's keys are visible to
        the masks of every layer. verify: a speculative verification pass (memlm.engine.speculative), whose
        attention is computed as a decode step's (float32 in bf16/fp16: _scores), so that its tokens are the
        ones plain decoding would choose. A draft tree's pass (memlm.engine.draft_trees) gives slots (B, T) int64, the
        slot of every token (None: the slot of its position), and sees (B, T, T) bool, which of the pass's own tokens
        each attends to (None: those at or before its position)."""
        return StepView(self, rows, pos, real, window, verify, slots, sees)


def _sink_shift(layout: CacheLayout, window: torch.Tensor) -> torch.Tensor:
    """(B, T) float64: how far past their true positions the sinks sit for queries with segment start `window`.

    memlm.memory.xl.XLMemory._sink_positions: the sinks sit right before the oldest slot after them (the
    oldest compressed group, at its mean position, else the oldest memory slot), or right before the
    segment when both are empty, never before their true positions. The memory holds the non-sink
    positions [max(sink, memory_start(s)), s): empty when s <= sink or it holds nothing (mem_len 0)."""
    s, N = window, layout.sink
    lo = layout.memory_start(s)  # (B, T)
    first = torch.where((s > N) & (lo < s), torch.clamp(lo, min=N), s).double()  # (B, T)
    if layout.cmem > 0:
        c = layout.rate
        groups = torch.div(torch.clamp(s - N - layout.mem_len, min=0), c, rounding_mode="floor")  # (B, T)
        oldest = torch.clamp(groups - layout.cmem, min=0)  # (B, T) the oldest group kept
        first = torch.where(groups > 0, layout.group_position(oldest), first)  # (B, T)
    return torch.clamp(first - N, min=0)


class StepView:
    """One forward pass over some cache rows: a DecoderState whose layers are CachedAttention views."""

    def __init__(self, cache: RowCache, rows: list[int], pos: torch.Tensor, real: torch.Tensor,
                 window: torch.Tensor, verify: bool = False, slots: torch.Tensor | None = None,
                 sees: torch.Tensor | None = None) -> None:
        layout, device = cache.layout, cache.device
        B, T = pos.shape
        # Decode steps attend in float32 (faster in bf16 here: _scores); a verification pass must do the same
        # products as the decode steps it stands for, or greedy tokens part ways in bf16.
        self.float32_attention = T == 1 or verify
        # Slots in use: a position p never sits beyond slot p + cmem, so no row of this step uses more than this
        # (read from the host's positions: no device synchronisation).
        pos_cpu, real_cpu = pos.cpu(), real.cpu()
        slot_cpu = cache.slot_of(pos_cpu) if slots is None else slots  # (B, T)
        self.width = min(layout.slots, int(pos.max() if slots is None else slots.max()) + 1 + layout.cmem)
        cache.reserve(self.width)
        self.cache = cache
        self.pos = pos.to(device)  # (B, T) int64
        lo, hi = rows[0], rows[-1] + 1
        # Rows next to each other are a view of the cache (no copy); others are gathered once per layer.
        # (A slice only for rows that ARE lo..hi - 1 in order: [0, 3, 2] has three rows in three slots too.)
        self.rows = slice(lo, hi) if rows == list(range(lo, hi)) else torch.tensor(rows, device=device)
        # Which (row, slot) each real token goes to, picked on the host (a boolean index on the device
        # would wait for it): (n,) each, and the tokens' flat indices into (B * T).
        self.real_cpu = real_cpu  # (B, T) bool on the host (the engine packs passes by it)
        row_index = torch.tensor(rows)[:, None].expand(B, T)  # (B, T)
        self.write_rows = row_index[real_cpu].to(device)  # (n,)
        self.write_slots = slot_cpu[real_cpu].to(device)  # (n,)
        # (n,) into B * T; None when every token is real (a decode step): the tokens are all of them, in order.
        self.write_tokens = None if bool(real_cpu.all()) else real_cpu.reshape(-1).nonzero()[:, 0].to(device)
        cache.slot_pos[self.write_rows, self.write_slots] = pos_cpu[real_cpu].to(device)
        nkv = cache.config.n_kv_head
        self._flat: tuple[int, torch.Tensor] | None = None  # write_flat's (allocated, rows)
        self.cos, self.sin_signed = rotation_at(self.pos, cache.inv_freq)  # (B, 1, T, hs): rotate() in 4 ops
        # The mask once per step for every layer, laid out as the grouped queries (B, 1, g*T, width).
        g = cache.config.n_head // nkv
        seen = self._mask(window.to(device))  # (B, 1, T, width)
        if sees is not None:  # a draft tree: among the pass's own slots, each token sees its ancestors only
            b, u = real_cpu.nonzero(as_tuple=True)  # (n,) the real tokens
            seen[b.to(device), 0, :, slot_cpu[b, u].to(device)] = sees[b, :, u].to(device)  # (n, T)
        self.hidden = ~seen[:, :, None].expand(B, 1, g, T, self.width).reshape(B, 1, g * T, self.width)
        self.shift = None
        if layout.sink > 0 and self.width > 0:
            shift = _sink_shift(layout, window.to(device))  # (B, T)
            self.shift = rotary_at(-shift, cache.inv_freq)  # rotates the queries back by the shift
        # A decode step or a verifying pass without sinks attends in float32 through baddbmm: the scale and the mask
        # (0 or -inf, built here once for all layers) in the product's one call, laid out (B * nkv, g * T, width).
        # A verifying pass thus does a decode step's products (the same call), and pays no mask per layer.
        self.bias = None
        if self.float32_attention and self.shift is None:
            hidden = self.hidden[:, :, None].expand(B, 1, nkv, g * T, self.width).reshape(B, nkv, g * T, self.width)
            bias = torch.zeros(B, nkv, g * T, self.width, device=device).masked_fill_(hidden, float("-inf"))
            self.bias = bias.reshape(B * nkv, g * T, self.width)  # (B*nkv, g*T, width)

    def write_flat(self) -> torch.Tensor:
        """(n * nkv,) the rows of the real tokens' keys in a layer's (R * nkv * allocated, hs) view: every layer's
        cache is (R, nkv, allocated, hs), contiguous, so the writes are one index_copy_ per tensor (an index_put_
        over (row, :, slot) cost 3x as much per layer at a decode step). Recomputed if the cache grew since (the
        other group of a PackedStep reserved more slots)."""
        allocated = self.cache.allocated
        if self._flat is None or self._flat[0] != allocated:
            nkv = self.cache.config.n_kv_head
            heads = torch.arange(nkv, device=self.cache.device)[None, :]  # (1, nkv)
            flat = ((self.write_rows[:, None] * nkv + heads) * allocated + self.write_slots[:, None])  # (n, nkv)
            self._flat = (allocated, flat.reshape(-1))
        return self._flat[1]

    def _mask(self, window: torch.Tensor) -> torch.Tensor:
        """(B, 1, T, width) bool: the slots each query attends to."""
        layout = self.cache.layout
        sp = self._rows_of(self.cache.slot_pos)[:, : self.width]  # (B, width)
        seen = (sp[:, None, :] >= 0) & (sp[:, None, :] <= self.pos[..., None])  # (B, T, width)
        if layout.mem_len is not None:
            lo = layout.memory_start(window)[..., None]  # (B, T, 1)
            seen &= (sp[:, None, :] < layout.sink) | (sp[:, None, :] >= lo)
            a, b = layout.sink, min(layout.sink + layout.cmem, self.width)
            if b > a:  # a compressed slot is seen once written: it holds one of the last cmem groups
                seen[..., a:b] = (sp[:, None, a:b] >= 0).expand(-1, seen.shape[1], -1)  # (B, T, b - a)
        return seen[:, None]  # (B, 1, T, width)

    def _rows_of(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.rows] if isinstance(self.rows, slice) else t.index_select(0, self.rows)

    # -- DecoderState --
    def positions(self, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
        return self.pos.float()  # (B, T): only the segment's LayerMemory records them; attention uses int64

    def layer_memory(self, layer: int) -> CachedAttention:
        return _LayerView(self, layer)

    def update(self, new_kv: list[LayerMemory]) -> StepView:
        return self  # the cache was written in place by the layers' views


def _tokens(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """x: (B, nkv, T, hs) -> the tokens `index` of the flattened (B * T), (n, nkv, hs); None: all of them."""
    B, nkv, T, hs = x.shape
    flat = x.transpose(1, 2).reshape(B * T, nkv, hs)  # (B*T, nkv, hs)
    return flat if index is None else flat.index_select(0, index)  # (n, nkv, hs)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """sin (..., hs) -> its first half negated: rotate(x) = x cos + roll(x, hs/2) sin_signed is apply_rotary's
    x cos + cat(-x2, x1) sin, bit for bit ((-a) b = a (-b) in IEEE arithmetic)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotation_at(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pos: (B, T) int64 -> cos, sin_signed (B, 1, T, hs): what `rotate` takes (rotary_at's angles)."""
    cos, sin = rotary_at(pos, inv_freq)
    return cos, _signed(sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: (B, h, T, hs) -> rotated, as memlm.model.decoder.apply_rotary (same values, fewer ops: a decode
    step calls it twice per layer)."""
    x32 = x.float()
    return (x32 * cos + x32.roll(x.shape[-1] // 2, dims=-1) * sin_signed).to(x.dtype)


def write_kv(kc: torch.Tensor, vc: torch.Tensor, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write rows k, v (n * nkv, hs) into a layer's cache kc, vc (R, nkv, allocated, hs) at the rows `flat`
    (n * nkv,) of its (R * nkv * allocated, hs) view: one index_copy_ per tensor (StepView.write_flat)."""
    hs = kc.shape[-1]
    kc.view(-1, hs).index_copy_(0, flat, k.to(kc.dtype))
    vc.view(-1, hs).index_copy_(0, flat, v.to(vc.dtype))


def decode_attention(bias: torch.Tensor, qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """A decode step's attention (one query position, or a verifying pass's T) in 4 calls: bias (B*nkv, g*T, W), 0 or
    -inf (the mask and the scale in the product's one call); qg (B*nkv, g*T, hs), the grouped queries; keys and values
    (B, nkv, W, hs), views of the cache (B and nkv merge without a copy: B's stride is nkv times nkv's) -> (B*nkv,
    g*T, hs). The engine's ordinary step and verifying pass (StepView.bias) and the fixed-shape step
    (memlm.engine.decode_graphs)."""
    Bn, W, hs = bias.shape[0], keys.shape[2], keys.shape[3]
    scores = torch.baddbmm(bias, qg, keys.reshape(Bn, W, hs).transpose(1, 2), alpha=scale)  # (B*nkv, g, W)
    return torch.bmm(scores.softmax(dim=-1), values.reshape(Bn, W, hs))  # (B*nkv, g, hs)


def _scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q: (B, nkv, g*T, hs), keys: (B, nkv, width, hs), a strided view of the cache -> q . k, (B, nkv, g*T, width)
    float32. The same products either way; measured on a CPU with avx512_bf16 at 32 rows: CPU bf16
    bmm copies the transposed key view to a contiguous one (2.5x slower than keys @ q^T), float32 does not.
    A decode step (T = 1) in bf16 casts to float32 first: per layer 29 us vs 55 us at 1 row, 80 vs 89 at 8,
    257 vs 200 at 32 (CPU time, one thread, q k^T + softmax + weights v), where the bf16 kernels' set-up
    dominates; prefill chunks (T up to 256) keep the bf16 products; speculative verification passes cast to
    float32 as decode steps do (StepView.float32_attention)."""
    if keys.dtype == torch.float32:
        return q @ keys.transpose(-1, -2)  # (B, nkv, g*T, width)
    return (keys @ q.transpose(-1, -2)).transpose(-1, -2).float()  # (B, nkv, g*T, width)


class _LayerView(CachedAttention):
    def __init__(self, step: StepView, layer: int) -> None:
        self.step = step
        self.layer = layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step, cache = self.step, self.step.cache
        B, nh, T, hs = q.shape
        nkv = k.shape[1]
        q = rotate(q, step.cos, step.sin_signed)  # (B, nh, T, hs)
        k = rotate(k, step.cos, step.sin_signed)  # (B, nkv, T, hs)
        kc, vc = cache.k[self.layer], cache.v[self.layer]
        # Only the real tokens are written: (n, nkv, hs) rows picked from (B, T, nkv, hs), into the flat view.
        write_kv(kc, vc, step.write_flat(), _tokens(k, step.write_tokens).reshape(-1, hs),
                 _tokens(v, step.write_tokens).reshape(-1, hs))
        keys = step._rows_of(kc)[:, :, : step.width]  # (B, nkv, width, hs)
        values = step._rows_of(vc)[:, :, : step.width]  # (B, nkv, width, hs)

        # Grouped-query attention without repeating keys: query head h reads kv head h // g (HF layout).
        g = nh // nkv
        qg = q.reshape(B, nkv, g * T, hs)  # (B, nkv, g*T, hs)
        if step.float32_attention and keys.dtype != torch.float32:  # decode / verify in bf16/fp16 (_scores)
            qg, keys, values = qg.float(), keys.float(), values.float()
        scale = 1.0 / math.sqrt(hs)
        if step.bias is not None:  # a decode step or a verifying pass without sinks: 4 calls (StepView.bias)
            y = decode_attention(step.bias, qg.reshape(B * nkv, g * T, hs), keys, values, scale)  # (B*nkv, g*T, hs)
            return y.to(q.dtype).reshape(B, nh, T, hs)  # (B, nh, T, hs)
        scores = _scores(qg, keys) * scale  # (B, nkv, g*T, width)
        N = min(cache.layout.sink, step.width)
        if step.shift is not None and N > 0:
            qs = apply_rotary(q, *step.shift).reshape(B, nkv, g * T, hs)  # (B, nkv, g*T, hs)
            sink_scores = (qs.to(keys.dtype) @ keys[:, :, :N].transpose(-1, -2)).float() * scale  # (B, nkv, g*T, N)
            scores = torch.cat([sink_scores, scores[..., N:]], dim=-1)  # (B, nkv, g*T, width)
        scores = scores.masked_fill(step.hidden, float("-inf"))  # (B, nkv, g*T, width)
        weights = scores.softmax(dim=-1).to(values.dtype)  # (B, nkv, g*T, width)
        y = (weights @ values).to(q.dtype)  # (B, nkv, g*T, hs)
        return y.reshape(B, nh, T, hs)  # (B, nh, T, hs)


@dataclass(frozen=True)
class PackedGroup:
    """One StepView's tokens inside a packed forward pass (PackedStep)."""

    view: StepView
    """The group's rows, positions and masks, laid out (B, T) as StepView takes them."""
    packed: torch.Tensor
    """(n,) int64: where the group's real tokens sit in the packed sequence (N,)."""
    padded: torch.Tensor | None
    """(n,) int64: the same tokens' flat indices into the group's (B * T); None when every token is real
    and in order (a decode group, T = 1: packing is a reshape)."""

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """x: (1, h, N, hs) packed -> (B, h, T, hs), zeros at the padding (never written, output ignored)."""
        B, T = self.view.pos.shape
        h, hs = x.shape[1], x.shape[3]
        part = x[0].index_select(1, self.packed)  # (h, n, hs)
        if self.padded is not None:
            part = part.new_zeros(h, B * T, hs).index_copy_(1, self.padded, part)  # (h, B*T, hs)
        return part.view(h, B, T, hs).transpose(0, 1)  # (B, h, T, hs)

    def pack(self, y: torch.Tensor) -> torch.Tensor:
        """y: (B, h, T, hs) -> the real tokens (h, n, hs), in the packed order."""
        B, h, T, hs = y.shape
        flat = y.transpose(0, 1).reshape(h, B * T, hs)  # (h, B*T, hs)
        return flat if self.padded is None else flat.index_select(1, self.padded)  # (h, n, hs)


class PackedStep:
    """A DecoderState for ONE forward pass over the tokens of several StepViews packed into one sequence
    (1, N): the projections and feed-forward blocks read the weights once for all of them, and each group
    attends on its own (B, T) layout. The engine packs a step's prefill chunks (T up to the chunk) with its
    decode rows (T = 1) so that a step reads the weights once, not once per kind of row (vLLM's chunked
    prefill mixes them the same way), without padding the decode rows to the chunk's length."""

    def __init__(self, groups: list[PackedGroup]) -> None:
        self.groups = groups

    def positions(self, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, device=device)  # (1, N): attention uses the groups' int64 positions

    def layer_memory(self, layer: int) -> CachedAttention:
        return _PackedLayer(self, layer)

    def update(self, new_kv: list[LayerMemory]) -> PackedStep:
        return self  # written in place by the groups' views


class _PackedLayer(CachedAttention):
    def __init__(self, step: PackedStep, layer: int) -> None:
        self.step = step
        self.layer = layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(q.shape)  # (1, nh, N, hs)
        for group in self.step.groups:
            y = _LayerView(group.view, self.layer).attend(group.unpack(q), group.unpack(k), group.unpack(v))
            out[0].index_copy_(1, group.packed, group.pack(y))  # (nh, n, hs) into (nh, N, hs)
        return out
