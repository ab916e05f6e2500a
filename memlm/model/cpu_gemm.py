"""Which library GEMM the decoder's linear layers run for float32 inference on the CPU (`memlm --cpu-gemm NAME`).

"mkl": F.linear, the BLAS that PyTorch's CPU wheel links for float32 (MKL), as transformers' nn.Linear: the one to
compare with transformers bit for bit, and the one that keeps its speed when other processes hold the cores of a
multi-threaded run (oneDNN's parallel GEMMs wait at their barriers there). "onednn": oneDNN's GEMM through
torch.utils.mkldnn.MkldnnLinear over a oneDNN copy of the weight, made on first use. bfloat16 and float16 CPU
matmuls run on oneDNN inside torch either way; autograd always takes F.linear. The speeds of both at batch 1 and 8
on the real model: benchmarks/decoder_gemm.py.

Neither is batch-invariant: a row's output may differ in its last bits with the rows beside it (a BLAS picks its
kernel by the number of rows), so a speculative verifying pass over several positions may round otherwise than
single-token decoding. Callers that compare bit for bit pin the rows they feed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.mkldnn import MkldnnLinear

CPU_GEMM_NAMES = ("mkl", "onednn")
"""The CPU float32 GEMMs a Linear can run (cpu_gemm_as)."""
DEFAULT_CPU_GEMM = "mkl"
"""The GEMM in force unless a command or benchmark picks another: the plain library path (F.linear)."""
_cpu_gemm = DEFAULT_CPU_GEMM
"""The GEMM in force (cpu_gemm_as): process-wide, one choice for every thread of a server, as torch.backends'
own flags."""


@contextlib.contextmanager
def cpu_gemm_as(name: str) -> Iterator[None]:
    """A context in which Linear's CPU float32 inference runs the GEMM `name` (CPU_GEMM_NAMES)."""
    global _cpu_gemm
    if name not in CPU_GEMM_NAMES:
        raise ValueError(f"the CPU GEMM must be one of {', '.join(CPU_GEMM_NAMES)}, got {name!r}")
    before, _cpu_gemm = _cpu_gemm, name
    try:
        yield
    finally:
        _cpu_gemm = before


def float32_gemm_on_mkl() -> contextlib.AbstractContextManager[None]:
    """cpu_gemm_as("mkl"): F.linear's GEMM, as transformers' nn.Linear (comparisons bit for bit with transformers)."""
    return cpu_gemm_as("mkl")


def cpu_float32_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the product x @ weight.T runs oneDNN's GEMM rather than F.linear's: the GEMM in force is "onednn",
    both are float32 on the CPU, grad is disabled, oneDNN is built in and on, the weight is no inference-mode
    tensor (its copy could not tell an in-place write), and no torch.compile graph is being traced (Inductor
    picks its own GEMM for F.linear)."""
    return (_cpu_gemm == "onednn" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled() and not weight.is_inference()
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and not torch.compiler.is_compiling())


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) (x (..., K) -> (..., N)) on the GEMM cpu_float32_gemm picks; oneDNN's copy of the weight is kept
    on the layer (`_packed`: its key, the copy) and made again whenever the weight changed (another tensor, or
    written in place: its version)."""
    w = layer.weight
    if not cpu_float32_gemm(x, w):
        return F.linear(x, w, layer.bias)
    key = (id(w), w.data_ptr(), w._version, None if layer.bias is None else layer.bias._version)
    kept = getattr(layer, "_packed", None)
    if kept is None or kept[0] != key:
        kept = (key, MkldnnLinear(layer, torch.float32))  # a tuple: not registered as a submodule
        layer._packed = kept
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    if rows.shape[0] == 0:
        return F.linear(x, w, layer.bias)
    return kept[1](rows.contiguous()).reshape(*x.shape[:-1], w.shape[0])  # (..., N)
