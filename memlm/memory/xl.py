"""Transformer-XL memory (Dai et al. 2019) with attention sinks: a per-layer FIFO of detached states.

Shape legend: B batch rows, T segment tokens, S memory slots, E evicted states, nkv key/value heads,
hs head size.
"""

from __future__ import annotations

import torch

from memlm.model.decoder import LayerMemory

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
# Memories


def detached(m: LayerMemory, valid: torch.Tensor) -> LayerMemory:
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
    at chance, tests/memlm/jobs/test_train.py), and the cached keys are one optimizer step stale. For fixed
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
        cls, batch_size: int, mem_len: int, *, sink_tokens: int, device: torch.device | str = "cpu",
        reproject: bool = False,
    ) -> "XLMemory":
        """An empty memory for batch_size rows. sink_tokens has no default here: its one default is
        MemoryConfig.sink_tokens (memlm.memory.state.new_memory builds memories from a MemoryConfig)."""
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

    def _sink_part(self, layer: int) -> LayerMemory | None:
        if self.sink is not None and self.sink[layer].k.shape[1] > 0 and bool(self.sink[layer].valid.any()):
            return self.sink[layer]
        return None

    def _parts(self, layer: int) -> list[LayerMemory]:
        """The slots after the sinks, oldest first (XL: the memory; compressive adds its cmem before it)."""
        if self.mem is not None and self.mem[layer].k.shape[1] > 0:
            return [self.mem[layer]]
        return []

    def layer_memory(self, layer: int) -> LayerMemory | None:
        sink, parts = self._sink_part(layer), self._parts(layer)
        if sink is None and not parts:
            return None  # lets attention take the plain causal fast path
        out = parts[0] if parts else None
        for p in parts[1:]:
            out = _concat(out, p)  # (B, S, ...) in the order [cmem; mem]
        if sink is None:
            return out
        sink = sink._replace(pos=self._sink_positions(sink, out))
        return sink if out is None else _concat(sink, out)  # (B, N + S, ...) in the order [sink; cmem; mem]

    def _sink_positions(self, sink: LayerMemory, rest: LayerMemory | None) -> torch.Tensor:
        """(B, N) positions the sinks take in attention: right before the oldest slot that follows them.

        StreamingLLM (Xiao et al. 2023, section 3.2) gives the sinks positions within the cache, not in the
        text: a sink kept at its true position 0 is, deep into a document, further from the query than any
        distance the model was trained on, and SmolLM2's loss climbs from 3.4 to 7 nats past ~13K tokens
        (segment 512, memory 512). Re-based, the sinks sit just before the memory, so every
        distance stays within sinks + memory + segment. While the memory has not slid past them
        (max with the true position) they keep their true positions, so short documents are unchanged."""
        N = sink.pos.shape[1]
        if rest is None or rest.pos.shape[1] == 0:
            first = self.next_pos.to(sink.pos.device)  # (B,) the segment follows the sinks directly
        else:
            big = torch.finfo(torch.float32).max
            oldest = torch.where(rest.valid, rest.pos.float(), torch.full_like(rest.pos.float(), big)).amin(dim=1)  # (B,)
            first = torch.where(rest.valid.any(dim=1), oldest, self.next_pos.to(oldest.device))  # (B,)
        slot = torch.arange(N, device=sink.pos.device, dtype=torch.float32)  # (N,)
        return torch.maximum(sink.pos.float(), first[:, None] - N + slot[None, :])  # (B, N)

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
            fifo_in.append(detached(new, new.valid & ~to_sink))
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
def empty_like(m: LayerMemory) -> LayerMemory:
    return LayerMemory(m.k[:, :0], m.v[:, :0], m.pos[:, :0], m.valid[:, :0], None if m.x is None else m.x[:, :0])
