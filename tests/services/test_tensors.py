"""services/common/tensors.py: numpy <-> Tensor round trips and field-naming validation."""

from __future__ import annotations

import numpy as np
import pytest

from memlm.v1 import tensor_pb2
from services.common.tensors import TensorError, from_tensor, to_tensor


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f2", "<f8", "i1", "u1", "<i4", ">i8", "?"])
def test_round_trip_preserves_values_and_shape(dtype):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((3, 5)) * 100).astype(dtype)
    back = from_tensor(tensor_pb2.Tensor.FromString(to_tensor(a).SerializeToString()), "x")
    assert back.shape == (3, 5)
    np.testing.assert_array_equal(back, a)


def test_wire_bytes_are_little_endian_row_major():
    a = np.array([[1, 2], [3, 256]], dtype=">i4")[:, ::-1]  # big-endian and non-contiguous
    t = to_tensor(a)
    assert t.dtype == tensor_pb2.DTYPE_INT32 and list(t.shape) == [2, 2]
    assert t.data == np.array([2, 1, 256, 3], dtype="<i4").tobytes()


def test_bfloat16_is_widened_exactly():
    # bf16 bit patterns: 1.0 = 0x3F80, -2.0 = 0xC000, 0.5 = 0x3F00
    t = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_BFLOAT16, shape=[3], data=np.array([0x3F80, 0xC000, 0x3F00], "<u2").tobytes())
    np.testing.assert_array_equal(from_tensor(t, "x"), np.array([1.0, -2.0, 0.5], np.float32))


@pytest.mark.parametrize(
    "tensor, kwargs, field",
    [
        (tensor_pb2.Tensor(dtype=99, shape=[1], data=b"\0" * 4), {}, "q.dtype"),
        (tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4), {}, "q.dtype"),
        (tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT32, shape=[1], data=b"\0" * 4), {"dtypes": (tensor_pb2.DTYPE_FLOAT32,)}, "q.dtype"),
        (tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4], data=b"\0" * 16), {"ndim": 2}, "q.shape"),
        (tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[-1, -4], data=b"\0" * 16), {}, "q.shape"),
        (tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2, 2], data=b"\0" * 15), {}, "q.data"),
        # A product that overflows int64 must not wrap around to the byte length sent.
        (tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2**62, 2**62], data=b"\0" * 16), {}, "q.data"),
    ],
)
def test_malformed_tensors_name_the_field(tensor, kwargs, field):
    with pytest.raises(TensorError) as info:
        from_tensor(tensor, "q", **kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")
