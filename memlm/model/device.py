"""Where the model runs and in which float type: the one resolution of `--device` and `--dtype`.

Every command (eval, train, datastore build, serve) and the datastore's exact search resolve their
device and dtype here, so "auto" means the same everywhere: cuda when a GPU is visible, else cpu;
bfloat16 on a GPU, float32 on the CPU (CPU half-precision matmuls are slow).
"""

from __future__ import annotations

import torch

from memlm.errors import MemlmError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The float types a model may run in, by the name `--dtype` takes."""


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda when available, else cpu; "cpu" and "cuda[:N]" as given.

    Asking for cuda without a visible GPU, or for any other device, is an error (MemlmError).
    """
    if isinstance(device, torch.device):
        device = str(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise MemlmError(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise MemlmError(f"--device {device} was asked for but no CUDA GPU is visible; use --device cpu or auto")
    try:
        return torch.device(device)
    except RuntimeError as e:  # "cuda:x"
        raise MemlmError(f"--device must be auto, cpu or cuda[:N], got {device!r}") from e


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on a GPU, float32 on the CPU; otherwise one of DTYPES by name (or a torch dtype)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise MemlmError(f"--dtype must be auto, {', '.join(DTYPES)}; got {dtype}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise MemlmError(f"--dtype must be auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (for wall-clock timings); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
