"""A compiled float32 GEMM over weights laid out in panels, built for the few rows a decode step feeds and batch-
invariant: y (M, N) = x (M, K) @ w (N, K).T (memlm.model.decoder.Linear's CPU float32 product), its panels split
across torch's threads where it is built with OpenMP.

Why our own kernel: a decode step of SmolLM2-135M reads its 538 MB of float32 weights for one row (plain decoding)
or a few (a speculative verifying pass, memlm.engine.speculative; a handful of batched rows), so it is bound by
memory bandwidth, and a good kernel for 1 row should cost about what one for 8 does. Neither library's does on
this project's CPU (Intel Xeon, AVX-512). This kernel reads the weight laid out in panels of 16 outputs (`panels`:
each panel (K, 16) contiguous) and keeps every row's 16-wide sums in registers, broadcasting one input at a time, so
it has no horizontal sums; more than 8 rows go in groups of 8 over each group of panels, which then come from cache.
Three panels are streamed at once at every row count (the C source's STREAMED), with 8 KB prefetched ahead of the
read, shared among them. Why three: on 4 Dec's Intel Xeon one panel at a time for up to 7 rows beat the table before
it (8 panels at once for 1 row, 6 for 2-4, 4 for 5-6, 3 for 7-8, 2 KB ahead of each: 22.1 / 22.9 / 29.4 ms at 1 / 4 /
8 rows instead of 29.5 / 31.4 / 30.2); on 6 Dec's Intel Xeon with AMX (2 cores, the fourth session's), two threads,
three at once beat one at every row count from 1 to 8 (`OMP_NUM_THREADS=2 python benchmarks/panel_gemm.py --rows
1,2,3,4,5,6,7,8 --repeats 9 --streamed 1,4`: the builds alternating in one run, ms a round, best of 9; the same
outputs bit for bit, tested):

    rows                  1      2      3      4      5      6      7      8
    one panel          18.7   20.3   23.4   22.1   23.1   24.2   24.8   25.8
    three (STREAMED)   18.3   18.3   18.8   19.1   19.4   19.7   19.9   20.4
    four               18.0   18.3   18.5   19.3   19.5   19.7   19.9   20.4

(the table before this one streamed one panel up to 7 rows, three at 8: 20.6 / 25.2 ms at 1 / 6 rows against 18.6 /
20.1 for three, in another run; on the AMD EPYC (Zen 4) of that day's third session, idle, 2-4 panels at 5-7 rows
made no difference that held from one minute to the next, and 1-4 rows were not tried there.) So a 6-position
verifying pass's products cost 1.08x a plain step's instead of 1.22x (README, issue 15). Four panels are no better,
and 8 rows x 4 panels would need more accumulators than the 32 AVX-512 registers. SmolLM2's 211 weights once each,
one thread, 4 Dec (one panel at a time then)
(`OMP_NUM_THREADS=1 python benchmarks/panel_gemm.py --rows ...`, ms a round, best of 5):

    rows           1      2      4      8     17     32     48     65    128    256    512
    ours        22.9   22.6   23.0   28.8   54.6   92.5  126.6  175.8  333.8  682.1   1343
    oneDNN      41.5   46.9   33.3   43.0   61.2  100.3  134.2  179.3  335.5  681.4   1327  (packed for 4 rows)
    MKL         51.6   80.2   63.2   76.5  106.3  145.0  189.7  245.2  419.2  801.8   1567

(23 GB/s at 1 to 4 rows, this core's bandwidth; from about 64 rows all three are bound by arithmetic alike.) So
Linear gives it every product, prefill chunks too, and keeps no oneDNN copy.

Batch-invariant: every output y[m, n] is one fused multiply-add chain over k in order whatever the other rows are,
so a row's logits in a verifying pass are bit for bit those of a plain one-row step, a batched row's those of the
row alone, and a prefill's those of decoding the same tokens one by one (the linear layers; attention is not
this kernel's). Equal to a float64 oracle up to float32 rounding (a chain of K roundings: about 3e-6 relative at
K = 1536, where oneDNN's blocked sums give 2-4e-6).

Memory: the panels are a copy of the weight (N * K * 4 bytes), made on the first call and kept (Linear), as oneDNN's
packed copy was.

Built (memlm.compiled) only where /proc/cpuinfo shows avx512f and fma; elsewhere, or without a C compiler,
`available()` is False (logged once) and Linear keeps oneDNN's GEMM.

Threads (6 Dec): built with -fopenmp where the compiler has it (the runtime is libgomp, which torch has loaded, so
the same thread pool), each of torch's threads streams its own contiguous run of panels; every output is still one
chain over k, so the result is the one-thread result bit for bit. Without OpenMP the kernel runs on one torch thread
only and oneDNN's GEMM takes more. On the AMD EPYC (Zen 4) of 6 Dec, SmolLM2's 211 weights (`OMP_NUM_THREADS=N
python benchmarks/panel_gemm.py --rows 1,4,8,17`, ms a round, best of 5):

    rows                 1      4      8     17     32     64    512
    ours, 1 thread    21.3   22.4   31.2   55.1
    ours, 2 threads   17.5   17.2   20.0   30.4   46.9   84.8  657.8
    oneDNN, 2 threads 25.0   21.4   25.7   34.3   52.4   92.3  648.0

Two threads read more of the memory bandwidth at 1-4 rows and halve the arithmetic from 8 rows on, where one core's
FMAs bound the kernel: a speculative verifying pass's extra positions get cheap again (17 rows 1.7x one row's time,
against 2.6x on one thread). Like oneDNN's parallel GEMMs, it waits at its end for every thread: on cores other
processes hold, run one thread or `--cpu-gemm mkl` (memlm.model.decoder.cpu_float32_gemm).

Shape legend: M rows, K inputs, N outputs, P panels.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from memlm.compiled import compile_library, cpu_flags, load_or_warn

log = logging.getLogger(__name__)

PANEL = 16
"""Outputs a panel holds: one AVX-512 vector of float32 (the C source's __m512 and its 16 lanes)."""
PANEL_DTYPES = (torch.float32, torch.float16)
"""What panels may hold: float32 (`kernel`) or float16 (`half_kernel`, widened to float32 as loaded)."""

SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#define INLINE static inline __attribute__((always_inline))
#ifdef WEIGHT_F16 /* the float16 build (half_kernel): weights widened to float32 as loaded, exactly */
typedef uint16_t weight_t;
#define LOAD_W(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#else
typedef float weight_t;
#define LOAD_W(p) _mm512_loadu_ps(p)
#endif
#define AHEAD (8192 / (int64_t)sizeof(weight_t)) /* weights prefetched ahead of the ones read (8 KB), shared among
                                                    the NB panels streamed */

/* y[m, 16 (p + b) ...] for m < M <= 8, b < NB: M rows against NB panels, k by k: each output one fused
   multiply-add chain over k in order. M and NB are constants after inlining, so the M * NB accumulators (16
   outputs each) stay in registers. */
INLINE void group(const float *x, const weight_t *panels, float *y, int64_t M, int64_t NB, int64_t N, int64_t K,
                  int64_t p) {
    __m512 acc[8][8];
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    const weight_t *w = panels + p * K * 16;
    for (int64_t k = 0; k < K; k++) {
        __m512 wv[8];
        for (int64_t b = 0; b < NB; b++) {
            _mm_prefetch((const char *)(w + b * K * 16 + k * 16 + AHEAD / NB), _MM_HINT_T0); /* never faults */
            wv[b] = LOAD_W(w + b * K * 16 + k * 16);
        }
        for (int64_t m = 0; m < M; m++) {
            __m512 xm = _mm512_set1_ps(x[m * K + k]);
            for (int64_t b = 0; b < NB; b++) acc[m][b] = _mm512_fmadd_ps(xm, wv[b], acc[m][b]);
        }
    }
    for (int64_t b = 0; b < NB; b++) {
        int64_t n = (p + b) * 16, left = N - n;
        __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int64_t m = 0; m < M; m++) _mm512_mask_storeu_ps(y + m * N + n, mask, acc[m][b]);
    }
}

/* Rows m0 .. m0 + min(8, rest) - 1 against NB panels from p. */
#define GROUP(mm, nb) group(x + m0 * K, panels, y + m0 * N, mm, nb, N, K, p)
#define EIGHT_ROWS(NAME, NB)                                                                                   \
    static void NAME(const float *x, const weight_t *panels, float *y, int64_t rest, int64_t N, int64_t K,     \
                     int64_t p, int64_t m0) {                                                                  \
        switch (rest) {                                                                                        \
        case 1: GROUP(1, NB); break; case 2: GROUP(2, NB); break; case 3: GROUP(3, NB); break;               \
        case 4: GROUP(4, NB); break; case 5: GROUP(5, NB); break; case 6: GROUP(6, NB); break;               \
        case 7: GROUP(7, NB); break; default: GROUP(8, NB); break;                                           \
        }                                                                                                      \
    }
#ifndef STREAMED /* a benchmark builds other values (build's `streamed`): the same outputs bit for bit */
#define STREAMED 3 /* panels streamed at once, whatever the rows (docstring) */
#endif
EIGHT_ROWS(rows_streamed, STREAMED)
EIGHT_ROWS(rows_1, 1)

/* The outputs of panels first .. last - 1 of y (M, N) = x (M, K) @ w (N, K).T with w as panels (P, K, 16):
   panels[p, k, j] = w[16 p + j, k], zero rows past N. The rows go in groups of 8 over each group of STREAMED panels:
   the panels come from memory for the first group of rows and from cache for the others. */
static void panel_range(const float *x, const weight_t *panels, float *y, int64_t M, int64_t N, int64_t K,
                        int64_t first, int64_t last) {
    for (int64_t p = first; p < last; p += STREAMED) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            if (last - p < STREAMED) { /* the last, short group: a panel at a time */
                for (int64_t q = p; q < last; q++) rows_1(x, panels, y, M - m0, N, K, q, m0);
                continue;
            }
            rows_streamed(x, panels, y, M - m0, N, K, p, m0);
        }
    }
}

/* y (M, N) = x (M, K) @ w (N, K).T on `threads` threads (the OpenMP build; 1 otherwise), each streaming its own
   contiguous run of panels: every output is the same chain over k whatever the split, so the result is the
   one-thread result bit for bit. */
void panel_gemm(const float *x, const weight_t *panels, float *y, int64_t M, int64_t N, int64_t K, int64_t threads) {
    int64_t P = (N + 15) / 16;
#ifdef _OPENMP
    if (threads > P) threads = P;
    if (threads > 1) {
#pragma omp parallel num_threads((int)threads)
        {
            int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
            panel_range(x, panels, y, M, N, K, P * t / T, P * (t + 1) / T);
        }
        return;
    }
#endif
    panel_range(x, panels, y, M, N, K, 0, P);
}
"""

CPU_NEEDS = ("avx512f", "fma")
"""What the build needs of the CPU (its -m flags below); without them no build (oneDNN's GEMM instead)."""
FLAGS = ("-O3", "-mavx512f", "-mfma")
OPENMP_FLAGS = ("-fopenmp",)
"""Added where the compiler has OpenMP (the panels split across torch's threads; the OpenMP runtime is the one
torch has loaded, libgomp); else a one-thread build."""


def load_kernel(path: Path) -> ctypes.CDLL:
    """The library at `path` with panel_gemm's argument types declared."""
    lib = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.panel_gemm.argtypes = [pointer, pointer, pointer, size, size, size, size]
    lib.panel_gemm.restype = None
    return lib


def build(half: bool = False, threaded: bool = True, streamed: int | None = None) -> ctypes.CDLL:
    """This CPU's build of SOURCE (half: its float16-weight build, WEIGHT_F16; threaded: with OPENMP_FLAGS, and
    without them where that build fails; streamed: panels streamed at once other than the source's STREAMED, for
    benchmarks/panel_gemm.py --streamed, 1 to 8), loaded; OSError where the CPU lacks CPU_NEEDS."""
    missing = set(CPU_NEEDS) - cpu_flags()
    if missing:
        raise OSError(f"the CPU lacks {', '.join(sorted(missing))}")
    stem, flags = ("panel_gemm_f16", (*FLAGS, "-DWEIGHT_F16")) if half else ("panel_gemm", FLAGS)
    if streamed is not None:
        if not 1 <= streamed <= 8:
            raise ValueError(f"streamed panels must be 1 to 8, got {streamed}")
        stem, flags = f"{stem}_streamed{streamed}", (*flags, f"-DSTREAMED={streamed}")
    if threaded:
        try:
            lib = load_kernel(compile_library(SOURCE, stem, (*flags, *OPENMP_FLAGS)))
            lib.threaded = True
            return lib
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("memlm: panel GEMM without OpenMP (%s): it runs on one torch thread only", e)
    lib = load_kernel(compile_library(SOURCE, stem, flags))
    lib.threaded = False
    return lib


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """This process' kernel; None where the CPU lacks CPU_NEEDS (the library path is then the one path, no
    warning), or (logged once) where it cannot be built or loaded."""
    if set(CPU_NEEDS) - cpu_flags():
        return None
    return load_or_warn(build, log, "panel GEMM (Linear keeps oneDNN's)")


@functools.cache
def half_kernel() -> ctypes.CDLL | None:
    """This process' float16-weight kernel (float16 panels, float32 rows and outputs); None (logged once) where it
    cannot be built or loaded."""
    if set(CPU_NEEDS) - cpu_flags():
        return None
    return load_or_warn(functools.partial(build, half=True), log, "float16 panel GEMM (float32 panels instead)")


def available() -> bool:
    """Whether `linear` can run in this process."""
    return kernel() is not None


def threaded() -> bool:
    """Whether this process' kernel splits its panels across torch's threads (the OpenMP build)."""
    lib = kernel()
    return lib is not None and lib.threaded


def fits(x: torch.Tensor) -> bool:
    """Whether Linear takes this kernel for x (..., K): built here, at least one row, and torch running one thread
    or the kernel the OpenMP build (else oneDNN's GEMM splits the weight across the threads). The caller has
    checked float32 CPU inference (decoder.cpu_float32_gemm)."""
    return x.numel() > 0 and available() and (torch.get_num_threads() == 1 or threaded())


def panels(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight (N, K) -> its panels (P, K, 16) of `dtype`, P = ceil(N / 16): panels[p, k, j] = weight[16 p + j, k],
    zero past N; the layout the kernel streams (a copy: N * K * 4 bytes more, 2 for float16 panels: half_kernel's,
    for weights that are float16 already, whose products then equal those of their float32 panels bit for bit)."""
    if dtype not in PANEL_DTYPES:
        raise ValueError(f"panels are float32 or float16, got {dtype}")
    n, k = weight.shape
    padded = F.pad(weight.detach().to(dtype), (0, 0, 0, -n % PANEL))  # (16 P, K)
    return padded.reshape(-1, PANEL, k).transpose(1, 2).contiguous()  # (P, K, 16)


def linear(x: torch.Tensor, weight_panels: torch.Tensor, n_out: int, bias: torch.Tensor | None = None,
           lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x (..., K) @ weight.T (+ bias) -> (..., n_out) float32 on the CPU, with weight_panels = panels(weight) of a
    weight (n_out, K), float32 or float16, any number of rows. lib: a library of load_kernel for the panels' dtype
    (default this process' `kernel()` for float32 panels, `half_kernel()` for float16 ones, which must be
    available)."""
    half = weight_panels.dtype == torch.float16
    lib = lib or (half_kernel() if half else kernel())
    if lib is None:
        raise RuntimeError(f"the {'float16 ' if half else ''}panel GEMM is not available here")
    p, k, width = weight_panels.shape if weight_panels.dim() == 3 else (0, 0, 0)
    if width != PANEL or not weight_panels.is_contiguous() or weight_panels.dtype not in PANEL_DTYPES \
            or not (p - 1) * PANEL < n_out <= p * PANEL:
        raise ValueError(f"weight_panels must be panels() of a ({n_out}, K) weight, got {tuple(weight_panels.shape)}")
    if x.shape[-1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"float32 CPU x (..., {k}) expected, got {x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, k).contiguous()  # (M, K)
    out = torch.empty(rows.shape[0], n_out, dtype=torch.float32)  # (M, N)
    if rows.shape[0]:
        lib.panel_gemm(rows.data_ptr(), weight_panels.data_ptr(), out.data_ptr(), rows.shape[0], n_out, k,
                       torch.get_num_threads())
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n_out)
