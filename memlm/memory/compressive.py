"""Compressive Transformer memory (Rae et al. 2019): evicted states are compressed at rate c into a second FIFO.

Shape legend: B batch rows, T segment tokens, S memory slots, E evicted states, nkv key/value heads,
hs head size, c compression rate, C model width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from memlm.model.memory_config import COMPRESS_FNS
from memlm.memory.xl import XLMemory, detached, empty_like, push_fifo
from memlm.model.config import ModelConfig
from memlm.model.decoder import LayerMemory

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


def pool_states(x: torch.Tensor, fn: str, dim: int) -> torch.Tensor:
    """A group of states pooled by compress_fn "max" or "mean" over `dim` (removed): the one pooling rule
    of this module and of the decoding engine's compressive rows (memlm.engine.compression)."""
    return x.amax(dim=dim) if fn == "max" else x.mean(dim=dim)


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
            x = pool_states(old.x.reshape(B, groups, rate, -1), fn, dim=2)  # (B, E/c, C)
        fn = "mean"
    if fn == "conv":
        k, v = compressor(layer, old.k, old.v)  # (B, E/c, nkv, hs) each
    else:
        k = pool_states(old.k.reshape(B, groups, rate, nkv, hs), fn, dim=2)  # (B, E/c, nkv, hs)
        v = pool_states(old.v.reshape(B, groups, rate, nkv, hs), fn, dim=2)  # (B, E/c, nkv, hs)
    pos = old.pos.reshape(B, groups, rate).float().mean(dim=2)  # (B, E/c) fractional
    # push_fifo evicts whole groups, so a group is entirely valid or entirely padding.
    valid = old.valid.reshape(B, groups, rate).all(dim=2)  # (B, E/c)
    return LayerMemory(k, v, pos, valid, x)


class Compression(NamedTuple):
    """What one layer's update pushed out of the memory and what it became (for the reconstruction loss)."""

    old: LayerMemory  # (B, E, nkv, hs) the evicted states, detached
    compressed: LayerMemory  # (B, E/c, nkv, hs) their compression; carries the compressor's graph
    query_pos: torch.Tensor  # (B, T) positions of the segment whose states evicted them



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
        rate: int,
        compress_fn: str,
        *,
        sink_tokens: int,
        device: torch.device | str = "cpu",
        compressor: Compressor | None = None,
        reproject: bool = False,
    ) -> "CompressiveMemory":
        """An empty memory for batch_size rows; no size has a default here (their one home is
        MemoryConfig; memlm.memory.state.new_memory builds memories from one)."""
        return cls(
            mem_len, cmem_len, rate, compress_fn, sink_tokens,
            torch.zeros(batch_size, dtype=torch.float32, device=device),
            torch.zeros(batch_size, dtype=torch.long, device=device),
            compressor=compressor, reproject=reproject,
        )

    def _parts(self, layer: int) -> list[LayerMemory]:
        parts = super()._parts(layer)
        if self.cmem is not None and self.cmem[layer].k.shape[1] > 0:
            parts.insert(0, self.cmem[layer])  # [cmem; mem]: the compressed memory is the older part
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
                cmem.append(old_c if old_c is not None else empty_like(kept))
                continue
            compressed = compress(evicted, self.rate, self.compress_fn, self.compressor, i)  # (B, E/c, ...)
            record.append(Compression(evicted, compressed, new_kv[i].pos.detach().float()))
            # The stored compressed memory is detached: the LM loss never trains the compressor
            # (Rae et al. 2019 train it with the local reconstruction loss only).
            c_kept, _ = push_fifo(old_c, detached(compressed, compressed.valid), self.cmem_len)
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
