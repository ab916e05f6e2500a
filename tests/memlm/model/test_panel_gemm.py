"""memlm.model.panel_gemm: the compiled panel GEMM against a float64 oracle (row counts in and past its groups
of 8, output sizes that are no multiple of its 16-wide panels or of its groups of panels), bit for bit batch-
invariant (a row's output is the same alone, with other rows, and inside a (B, S, K) input) and the same on any
number of threads (the OpenMP build) and of panels streamed at once; Linear takes it on one torch thread, and on
more where it is that build, with panels that follow the weight, and without a compiler it is unavailable (logged
once) and Linear keeps oneDNN's GEMM with the same products up to float32 rounding."""

from __future__ import annotations

import logging
import subprocess

import pytest
import torch
import torch.nn.functional as F

from memlm import compiled
from memlm.model import panel_gemm
from memlm.model.decoder import Linear, cpu_gemm_as
from memlm.model.panel_gemm import linear, panels

ROWS = 32
"""Rows the invariance test takes (a 16-token draft's verifying pass feeds 17)."""

needs_kernel = pytest.mark.skipif(not panel_gemm.available(),
                                  reason="no AVX-512 CPU or no C compiler: the panel GEMM cannot be built")


def random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def one_thread():
    """torch on one thread for the test (the kernel's condition), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("k", [1, 17, 576])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 16 * 8 + 16 * 6 + 5])
def test_row_counts_equal_a_float64_oracle(k, n):
    w = random(n, k, seed=k * 100 + n) / k ** 0.5
    p = panels(w)
    for m in [*range(1, 10), 16, 17, 40, 65]:
        x = random(m, k, seed=m)
        got = linear(x, p, n)
        want = x.double() @ w.double().T  # (m, n)
        bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)  # a float32 dot product's error bound
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert ((got.double() - want).abs() <= bound).all(), (m, float((got.double() - want).abs().max()))


@needs_kernel
@pytest.mark.parametrize("k, n", [(576, 192), (1536, 576), (64, 1001)])
def test_a_rows_output_is_the_same_alone_and_beside_any_other_rows(k, n):
    p = panels(random(n, k, seed=7))
    x = random(ROWS, k, seed=8)
    alone = [linear(x[i : i + 1], p, n) for i in range(ROWS)]
    for m in range(2, ROWS + 1):
        together = linear(x[:m], p, n)
        for i in range(m):
            assert torch.equal(together[i : i + 1], alone[i]), (m, i)
    batched = linear(x[:6].reshape(2, 3, k), p, n)  # (B, S, K) as a verifying pass of 2 rows feeds it
    assert batched.shape == (2, 3, n) and torch.equal(batched.reshape(6, n), torch.cat(alone[:6]))


@needs_kernel
@pytest.mark.parametrize("k, n", [(576, 192), (17, 100), (1536, 16 * 8 + 5)])
def test_float16_panels_give_the_float32_panels_products_bit_for_bit(k, n):
    w = (random(n, k, seed=9) / k ** 0.5).half()  # (n, k) float16 weights: exact in float32 too
    p16, p32 = panels(w, torch.float16), panels(w)
    assert p16.dtype == torch.float16 and p32.dtype == torch.float32 and p16.shape == p32.shape
    for m in [*range(1, 10), 16, 17]:
        x = random(m, k, seed=m)
        assert torch.equal(linear(x, p16, n), linear(x, p32, n)), m
    with pytest.raises(ValueError, match="float32 or float16"):
        panels(w, torch.bfloat16)


@needs_kernel
def test_bias_strided_input_and_bad_calls():
    w, b = random(40, 32, seed=1), random(40, seed=2)
    x = random(3, 2, 32, seed=3).transpose(0, 1)  # (2, 3, 32), strided
    torch.testing.assert_close(linear(x, panels(w), 40, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert linear(random(0, 32, seed=4), panels(w), 40).shape == (0, 40)
    with pytest.raises(ValueError, match="float32 CPU x"):
        linear(random(2, 31, seed=5), panels(w), 40)
    with pytest.raises(ValueError, match="must be panels"):
        linear(random(2, 32, seed=6), w, 40)  # the weight itself, not its panels
    with pytest.raises(ValueError, match="must be panels"):
        linear(random(2, 32, seed=6), panels(w), 60)  # panels of another output size


@needs_kernel
@pytest.mark.parametrize("streamed", [1, 2, 4])
def test_the_panels_streamed_at_once_change_no_output_bit(streamed):
    """A build streaming another number of panels at once (benchmarks/panel_gemm.py --streamed) gives the default
    build's outputs bit for bit: each output is the same chain over k. Output sizes leave a short last group."""
    other = panel_gemm.build(streamed=streamed)
    for k, n in [(576, 192), (64, 16 * 7 + 3), (1536, 16 * 5)]:
        p = panels(random(n, k, seed=31))
        for m in [*range(1, 10), 17]:
            x = random(m, k, seed=32 + m)
            assert torch.equal(linear(x, p, n, lib=other), linear(x, p, n)), (streamed, k, n, m)
    with pytest.raises(ValueError, match="1 to 8"):
        panel_gemm.build(streamed=9)


@needs_kernel
@pytest.mark.parametrize("k, n", [(576, 192), (64, 1001), (32, 40)])
def test_any_number_of_threads_gives_the_one_thread_result_bit_for_bit(k, n, one_thread):
    """Each thread streams its own run of panels (more threads than panels too: 40 outputs are 3 panels)."""
    p = panels(random(n, k, seed=21))
    x = random(17, k, seed=22)
    alone = linear(x, p, n)
    for threads in (2, 3, 5):
        torch.set_num_threads(threads)
        for m in (1, 4, 17):
            assert torch.equal(linear(x[:m], p, n), alone[:m]), (threads, m)


@needs_kernel
def test_the_kernel_is_threaded_where_the_compiler_has_openmp(tmp_path):
    """The threaded build is the one loaded wherever the C compiler builds OpenMP code (else the one-thread tests
    above would pass on a build that never splits)."""
    try:
        compiled.compile_library("#include <omp.h>\nint threads(void) { return omp_get_max_threads(); }\n",
                                 "openmp_probe", panel_gemm.OPENMP_FLAGS, tmp_path)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("this C compiler builds no OpenMP code: the kernel runs on one thread")
    assert panel_gemm.threaded()


@needs_kernel
def test_linear_takes_the_kernel_on_one_thread_and_on_more_where_it_is_threaded(one_thread, monkeypatch):
    layer = Linear(64, 96, bias=True)
    calls = []
    real = panel_gemm.linear
    monkeypatch.setattr(panel_gemm, "linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    with torch.no_grad():
        for shape in [(1, 64), (2, 4, 64), (300, 64), (0, 64)]:
            x = random(*shape, seed=len(shape))
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert calls == [(1, 64), (2, 4, 64), (300, 64)]  # a prefill chunk's rows too; no rows: oneDNN's GEMM
        layer.weight.mul_(-2.0)  # written in place: the panels are made again
        x = random(3, 64, seed=8)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert len(calls) == 4
        with cpu_gemm_as("onednn"):
            layer(random(1, 64, seed=9))
        torch.set_num_threads(2)
        layer(random(1, 64, seed=10))  # two threads: the kernel where it is the OpenMP build, else oneDNN's
        made = 5 if panel_gemm.threaded() else 4
        assert len(calls) == made
        monkeypatch.setattr(panel_gemm, "threaded", lambda: False)  # a build without OpenMP
        layer(random(1, 64, seed=10))
        assert len(calls) == made
    layer(random(1, 64, seed=11))  # grad enabled: F.linear
    assert len(calls) == made


def test_without_a_compiler_the_kernel_is_unavailable_logged_once_and_linear_keeps_onednn(monkeypatch, caplog,
                                                                                         one_thread):
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    monkeypatch.setattr(panel_gemm, "FLAGS", ("-O3", "-DNOT_CACHED"))  # another build name: not on disk
    panel_gemm.kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=panel_gemm.__name__):
            assert not panel_gemm.available() and not panel_gemm.available()
        assert sum("no compiled panel GEMM" in r.getMessage() for r in caplog.records) == 1
        layer = Linear(32, 8)
        x = random(2, 32, seed=12)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        with pytest.raises(RuntimeError, match="not available"):
            linear(x, panels(layer.weight), 8)
    finally:
        panel_gemm.kernel.cache_clear()


def test_cpu_gemm_names_are_checked():
    with pytest.raises(ValueError, match="must be one of panels, onednn, mkl"):
        with cpu_gemm_as("blas"):
            pass
