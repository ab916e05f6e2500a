"""numpy arrays <-> `memlm.v1.Tensor` (dtype + shape + raw row-major little-endian bytes).

Tensors travel as raw bytes, never pickles (unpickling runs the sender's code). Everything that enters from the wire is
checked here: a known dtype, one the caller allows, non-negative shape entries, the expected number
of dimensions, and a byte length equal to product(shape) * itemsize. Errors are `TensorError`s whose
message starts with the name of the offending field, so servers can turn them into INVALID_ARGUMENT
statuses that say what to fix.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection

import numpy as np

from memlm.v1 import tensor_pb2

Tensor = tensor_pb2.Tensor
DType = tensor_pb2.DType

# Wire dtype -> little-endian numpy dtype. BFLOAT16 has no numpy dtype; it is widened on decode.
_NUMPY_OF: dict[int, np.dtype] = {
    DType.DTYPE_FLOAT32: np.dtype("<f4"),
    DType.DTYPE_FLOAT16: np.dtype("<f2"),
    DType.DTYPE_FLOAT64: np.dtype("<f8"),
    DType.DTYPE_INT8: np.dtype("i1"),
    DType.DTYPE_UINT8: np.dtype("u1"),
    DType.DTYPE_INT32: np.dtype("<i4"),
    DType.DTYPE_INT64: np.dtype("<i8"),
    DType.DTYPE_BOOL: np.dtype("?"),
}
_ITEMSIZE: dict[int, int] = {**{k: v.itemsize for k, v in _NUMPY_OF.items()}, DType.DTYPE_BFLOAT16: 2}
# numpy kind+size -> wire dtype, for encoding (byte order does not matter here: we convert).
_WIRE_OF: dict[tuple[str, int], int] = {(v.kind, v.itemsize): k for k, v in _NUMPY_OF.items()}


class TensorError(ValueError):
    """A Tensor that does not decode; `field` names it (e.g. "queries.shape")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def dtype_name(dtype: int) -> str:
    """"DTYPE_FLOAT32" for a known enum value, else the number (a client may send any int)."""
    try:
        return DType.Name(dtype)
    except ValueError:
        return str(dtype)


def to_tensor(array: np.ndarray) -> Tensor:
    """Encode a numpy array (any byte order or strides) as a row-major little-endian Tensor."""
    array = np.asarray(array)
    wire = _WIRE_OF.get((array.dtype.kind, array.dtype.itemsize))
    if wire is None:
        raise TypeError(f"no wire dtype for numpy dtype {array.dtype}")
    # ascontiguousarray + astype to the little-endian dtype: a no-op copy-free pass on x86/ARM hosts.
    data = np.ascontiguousarray(array, dtype=_NUMPY_OF[wire]).tobytes()
    return Tensor(dtype=wire, shape=array.shape, data=data)


def from_tensor(
    tensor: Tensor,
    field: str,
    *,
    dtypes: Collection[int] | None = None,
    ndim: int | None = None,
) -> np.ndarray:
    """Decode and validate a Tensor; raise TensorError naming `field` when it is malformed.

    dtypes: the wire dtypes the caller accepts (None = any known one). ndim: required number of
    dimensions (None = any). BFLOAT16 is returned widened to float32 (exact). The result is a
    read-only view of the message's bytes in native byte order.
    """
    if tensor.dtype not in _ITEMSIZE:
        raise TensorError(f"{field}.dtype", f"unknown dtype {dtype_name(tensor.dtype)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = ", ".join(dtype_name(d) for d in sorted(dtypes))
        raise TensorError(f"{field}.dtype", f"got {dtype_name(tensor.dtype)}, expected one of {allowed}")
    shape = tuple(tensor.shape)
    if ndim is not None and len(shape) != ndim:
        raise TensorError(f"{field}.shape", f"got {len(shape)} dimensions {list(shape)}, expected {ndim}")
    if any(s < 0 for s in shape):
        raise TensorError(f"{field}.shape", f"negative size in {list(shape)}")
    # Python ints: a hostile shape like [2**62, 2**62] must not overflow into a small product.
    expected = math.prod(shape) * _ITEMSIZE[tensor.dtype]
    data = tensor.data
    if len(data) != expected:
        raise TensorError(
            f"{field}.data",
            f"{len(data)} bytes, expected {expected} for shape {list(shape)} of {dtype_name(tensor.dtype)}",
        )
    if tensor.dtype == DType.DTYPE_BFLOAT16:
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16  # bf16 = high half of f32
        return bits.view(np.float32).reshape(shape)
    array = np.frombuffer(data, dtype=_NUMPY_OF[tensor.dtype]).reshape(shape)
    if sys.byteorder == "big" and array.dtype.itemsize > 1:
        array = array.astype(array.dtype.newbyteorder("="))
    return array
