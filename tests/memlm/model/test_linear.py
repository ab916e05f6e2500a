"""memlm.model.decoder.Linear: CPU float32 inference on oneDNN's GEMM through torch.utils.mkldnn
(memlm.model.cpu_gemm.cpu_float32_gemm; these tests under cpu_gemm_as("onednn")) against F.linear, else F.linear
itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memlm.model.cpu_gemm import cpu_float32_gemm, cpu_gemm_as, float32_gemm_on_mkl
from memlm.model.decoder import Linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch built with oneDNN")


@pytest.fixture(autouse=True)
def on_onednn():
    """oneDNN's GEMM (the default is F.linear's)."""
    with cpu_gemm_as("onednn"):
        yield


def make_linear(n_in: int, n_out: int, bias: bool) -> Linear:
    layer = Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(0)))
        if bias:
            layer.bias.copy_(torch.randn(n_out, generator=torch.Generator().manual_seed(1)))
    return layer


@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (3, 64), (2, 5, 64), (1, 0, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_path_equals_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    layer = make_linear(64, 96, bias)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert cpu_float32_gemm(x, layer.weight)
        ours = layer(x)
        ref = F.linear(x, layer.weight, layer.bias)
    assert ours.shape == ref.shape == (*shape[:-1], 96)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)  # float32 sums in another order


def test_strided_input_is_read_as_laid_out() -> None:
    layer = make_linear(64, 32, False)
    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(3)).transpose(0, 1)  # (2, 5, 64), strided
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_grad_bfloat16_and_switched_off_take_f_linear() -> None:
    layer = make_linear(16, 8, True)
    x = torch.randn(4, 16, requires_grad=True)
    assert not cpu_float32_gemm(x, layer.weight)  # grad enabled: autograd's F.linear
    layer(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.detach().sum(0).expand(8, 16))  # d(sum W x)/dW = sum x
    with torch.no_grad():
        assert not cpu_float32_gemm(x.bfloat16(), layer.weight.bfloat16())
        with float32_gemm_on_mkl():
            assert not cpu_float32_gemm(x, layer.weight)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_packed_copy_follows_the_weight() -> None:
    """The packed copy is remade when the weight is written in place or replaced: never a stale product."""
    layer = make_linear(64, 96, True)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        layer(x)
        first = layer._packed[1]
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert layer._packed[1] is first  # the same weight: packed once
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place: a new version
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(96, 64))  # another tensor
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_packed_layer_copies_and_pickles() -> None:
    import copy
    import pickle

    layer = make_linear(64, 32, False)
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = layer(x)  # made the packed copy, which neither copy nor pickle can carry
        for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert torch.equal(other.weight, layer.weight)
            torch.testing.assert_close(other(x), expected, atol=0, rtol=0)


def test_weight_made_in_inference_mode_is_used_unpacked() -> None:
    """An inference-mode weight has no version counter (an in-place write could not be told): no oneDNN copy,
    F.linear itself."""
    with torch.inference_mode():
        layer = make_linear(64, 32, True)
        x = torch.randn(3, 64)
        assert not cpu_float32_gemm(x, layer.weight)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(3.0)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer._packed is None


def test_the_onednn_copy_is_no_parameter_or_state() -> None:
    """The oneDNN copy is not a submodule: the state dict and the parameters stay nn.Linear's."""
    layer = make_linear(64, 32, True)
    with torch.inference_mode():
        layer(torch.randn(2, 64))
    assert layer._packed is not None
    assert list(layer.state_dict()) == ["weight", "bias"] and len(list(layer.modules())) == 1
