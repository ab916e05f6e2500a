"""Weight-only int8 and int4 linear layers over torch's own quantised-weight kernels, as gpt-fast uses them.

int8: one symmetric scale per output row, y = (x @ q.T) * s (aten._weight_int8pack_mm, CPU and CUDA).
int4: asymmetric groups of GROUP_SIZE input columns, w = (q - 8) * scale + zero with q in [0, 15]
(aten._weight_int4pack_mm_for_cpu on the CPU, aten._weight_int4pack_mm, tinygemm, on CUDA). A group of 32
matches GGUF's Q4_1 blocks, so a Q4_1 weight dequantised on load is quantised back to nearly its own values.

Activations come in the layer's compute dtype (its scales' dtype): bfloat16 is where these kernels are fast
(the CPU kernels also take float32, through a slow reference path; CUDA's int4 takes bfloat16 only). The
layers hold buffers, not parameters: they serve inference, never training.

Shape legend: M rows (batch x tokens), K input width, N output width, G groups of GROUP_SIZE columns.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32
"""Input columns per int4 group (GGUF's Q4_1 block)."""
INT4_CENTRE = 8
"""The int4 kernels' zero point: q - 8 spans [-8, 7]."""


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> (M, K) contiguous."""
    return x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)


class Int8Linear(nn.Module):
    """x @ W.T with W stored as int8 (N, K) and one scale per output row (N,)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scales", scales)  # (N,) the compute dtype
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int8Linear:
        """Quantise a float weight (N, K): scale = max |w| of its row / 127, q = round(w / scale)."""
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # (N,)
        q = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)  # (N, K)
        return cls(q, scales.to(dtype))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (N, K) in the compute dtype, for code that reads the matrix itself (SPALM's
        head reads the output embedding); made afresh on every read."""
        return (self.qweight.to(self.scales.dtype) * self.scales[:, None])  # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(_rows(x), self.qweight, scales)  # (M, N)
        return y.reshape(*x.shape[:-1], self.out_features)  # (..., N)


def _inner_k_tiles(k: int) -> int:
    """The largest tile count (8, 4 or 2) the int4 packing accepts for K input columns (K % (16 * tiles) == 0)."""
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"int4 weights need an input width divisible by 32, got {k}")


class Int4Linear(nn.Module):
    """x @ W.T with W stored as packed int4 in groups of GROUP_SIZE input columns, a scale and zero per group."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int, out_features: int,
                 levels: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("packed", packed)  # the kernel's own layout of (N, K) int4
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # (G, N, 2) the compute dtype
        self.register_buffer("levels", levels, persistent=False)  # (N, K/2) uint8, two q a byte: `weight`, moves
        self.in_features, self.out_features = in_features, out_features

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int4Linear:
        """Quantise a float weight (N, K) per group of GROUP_SIZE columns between its min and max (15 steps)."""
        w = weight.detach().float()
        n, k = w.shape
        if k % GROUP_SIZE:
            raise ValueError(f"int4 weights need an input width divisible by {GROUP_SIZE}, got {k}")
        groups = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)  # (N, G, GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (N, G)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)  # (N, G)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)  # (N, G, GROUP_SIZE)
        q = q.to(torch.int32).reshape(n, k)  # (N, K)
        zero = low + scale * INT4_CENTRE  # (N, G): w = (q - 8) * scale + zero
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # (G, N, 2)
        return cls(pack_int4(q), scales_and_zeros, k, n, _two_per_byte(q))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (N, K) in the compute dtype (see Int8Linear.weight)."""
        n, k = self.out_features, self.in_features
        scale, zero = self.scales_and_zeros[..., 0].T, self.scales_and_zeros[..., 1].T  # (N, G) each
        q = _unpack(self.levels).to(scale.dtype).reshape(n, k // GROUP_SIZE, GROUP_SIZE)  # (N, G, GROUP_SIZE)
        return ((q - INT4_CENTRE) * scale[..., None] + zero[..., None]).reshape(n, k)  # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sz = self.scales_and_zeros if self.scales_and_zeros.dtype == x.dtype else self.scales_and_zeros.to(x.dtype)
        rows = _rows(x)  # (M, K)
        if rows.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, sz)  # (M, N)
        else:
            y = torch.ops.aten._weight_int4pack_mm(rows, self.packed, GROUP_SIZE, sz)  # (M, N)
        return y.reshape(*x.shape[:-1], self.out_features)  # (..., N)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module's signature
        # The packed layout differs between the CPU and CUDA kernels: pack again for the device moved to.
        before = self.packed.device
        super()._apply(fn, recurse)
        if self.packed.device != before:
            self.packed = pack_int4(_unpack(self.levels))
        return self


def _two_per_byte(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) in [0, 15] -> (N, K/2) uint8, the even column in the high nibble."""
    return (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # (N, K/2)


def _unpack(levels: torch.Tensor) -> torch.Tensor:
    """_two_per_byte's inverse: (N, K/2) uint8 -> (N, K) int32."""
    wide = levels.to(torch.int32)  # (N, K/2)
    return torch.stack([wide >> 4, wide & 15], dim=-1).reshape(levels.shape[0], -1)  # (N, K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) int32 in [0, 15] -> the int4 kernel's packed weight on q's device (CPU: its own layout from
    int32; CUDA: tinygemm's tiles from two levels a byte, high nibble first)."""
    tiles = _inner_k_tiles(q.shape[1])
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), tiles)
    return torch.ops.aten._convert_weight_to_int4pack(_two_per_byte(q).contiguous(), tiles)
