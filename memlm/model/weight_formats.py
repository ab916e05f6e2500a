"""The weight format a model runs in (`--weights`): float32, bfloat16, int8 or int4, and its compute dtype.

float32 and bfloat16: every weight, the activations and the KV cache in that float type (torch's float32 GEMM,
oneDNN's bfloat16 one on the CPU). int8 and int4: weight-only quantised linear layers (memlm.model.int_linear),
with the embedding, norms, activations and KV cache in the compute dtype, bfloat16 unless `--dtype` names
another: the CPU's int8 and int4 kernels are fast with bfloat16 activations only. An output head tied to the
embedding stays the embedding's: quantising it would keep a second copy, and per-row scales lose more of it
(GGUF stores SmolLM2's as Q8_0, a scale per 32) than the rest of the model loses together.

The default of each device is the fastest format whose perplexity stays within 0.5% of float32 on a tuning
text; the measurement is docs/decisions/weight-formats.md, from benchmarks/weight_formats.py.
None of the formats is batch-invariant in general (a kernel may pick its blocking by the number of rows); the
identity tests of batched and speculative decoding say which formats they hold for.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from memlm.errors import MemlmError
from memlm.model import decoder
from memlm.model.device import DTYPES, resolve_dtype
from memlm.model.int_linear import Int4Linear, Int8Linear

FLOAT_FORMATS = ("float32", "bfloat16")
"""Formats that store every weight in a float type and compute in it."""
INT_FORMATS = ("int8", "int4")
"""Weight-only quantised formats."""
WEIGHT_FORMATS = FLOAT_FORMATS + INT_FORMATS
"""What `--weights` takes."""
DEFAULT_WEIGHTS = {"cpu": "float32", "cuda": "bfloat16"}
"""The format of each device type when neither --weights nor --dtype is given (docs/decisions/weight-formats.md)."""
INT_COMPUTE_DTYPE = torch.bfloat16
"""The activations' dtype of the int formats unless --dtype names another."""


class ModelFormat(NamedTuple):
    """How a model's weights are stored and what its activations and KV cache compute in."""

    weights: str
    """One of WEIGHT_FORMATS; for the float formats also the compute dtype's name. float16 models (--dtype
    float16) carry "float16"."""
    dtype: torch.dtype
    """The activations', norms', embedding's and KV cache's dtype."""


def resolve_format(weights: str | None, dtype: str | torch.dtype | None, device: torch.device) -> ModelFormat:
    """The one resolution of --weights with --dtype on `device`: unset --weights takes the float type --dtype
    names, else DEFAULT_WEIGHTS; a float format computes in itself (another --dtype is refused in one line); an
    int format computes in --dtype, bfloat16 when unset or auto."""
    dtype = None if dtype == "auto" else dtype
    if weights is None or weights == "auto":
        if dtype is not None:
            resolved = resolve_dtype(dtype, device)
            return ModelFormat(dtype_name(resolved), resolved)
        weights = DEFAULT_WEIGHTS.get(device.type, "float32")
    if weights not in WEIGHT_FORMATS and weights not in DTYPES:
        raise MemlmError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if weights in DTYPES:  # FLOAT_FORMATS, and float16 as --dtype float16 (or a datastore built so) names it
        own = DTYPES[weights]
        if dtype is not None and resolve_dtype(dtype, device) != own:
            raise MemlmError(f"--weights {weights} computes in {weights}; leave --dtype unset or give --dtype {weights}")
        return ModelFormat(weights, own)
    return ModelFormat(weights, INT_COMPUTE_DTYPE if dtype is None else resolve_dtype(dtype, device))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def convert(model: decoder.Decoder, fmt: ModelFormat) -> decoder.Decoder:
    """`model` (float, any dtype) in the format `fmt`, in place: an int format replaces the linear layers of
    memlm's decoder (the output head unless it is tied to the embedding) with their quantised layers, quantised
    from the float weights as they are; then the rest is cast to fmt.dtype."""
    if fmt.weights in INT_FORMATS:
        layer = Int8Linear if fmt.weights == "int8" else Int4Linear
        tied = model.lm_head if model.config.tie_embeddings else None
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, decoder.Linear) and child is not tied:
                    if child.bias is not None:
                        raise MemlmError(f"--weights {fmt.weights} quantises linear layers without a bias")
                    setattr(parent, name, layer.from_float(child.weight, fmt.dtype))
    return model.to(fmt.dtype)


def format_of(model: nn.Module) -> str:
    """The weight format a loaded model runs in: int8/int4 where its linear layers are quantised, else the
    name of its dtype (what datastore manifests and GetInfo record)."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            return "int8"
        if isinstance(module, Int4Linear):
            return "int4"
    return dtype_name(model.dtype)
