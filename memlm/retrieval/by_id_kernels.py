"""Compiled kernels over keys read by id, for RetoMaton's walk (memlm.retrieval.pointers; issue 15): squared L2
between each row's query and the keys of its ids, reading each key once where it lies, float16 keys converted in
registers (F16C), float32 arithmetic with fused multiply-adds, and the key two ids ahead prefetched so that the
walk's scattered reads overlap the arithmetic. On the 208K-key SOTU datastore one walk's exact distances took
0.55 s in faiss' fvec_L2sqr_by_idx over float32 keys and 0.34 s here over float16 keys (the same values: the
stored keys are float16), equal up to float32 rounding (2.4e-7 relative).

The C source below is compiled at first use (memlm.compiled: cached by source and flags, safe for concurrent
processes), with AVX-512 where /proc/cpuinfo shows avx512f, f16c and fma, and a portable -O3 build otherwise.
Beside them, the walk's selection (`lowest_keys_into`: each row's lowest rank keys, sorted; clustered_states.
lowest_keys' rule, 88 -> 38 us a row of 6,000 keys taking 2,048 against numpy's partition and sort, 6 Dec).
Without a compiler, or when the build or the load fails, `available()` is False (logged once) and callers keep
their faiss path.

Shape legend: r rows, e ids a row, d key dimension, N keys.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np

from memlm.compiled import RADIX_SORT_C, compile_library, cpu_flags, load_or_warn

log = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#endif

/* IEEE half to float, subnormals, infinities and nan included (the portable build's conversion). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) {
        exponent = 113;
        while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float l2_f16(const float *q, const uint16_t *x, int64_t d) {
    int64_t j = 0;
    float sum = 0.0f;
#ifdef VECTOR
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; j + 32 <= d; j += 32) {
        __m512 x0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + j)));
        __m512 x1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + j + 16)));
        __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(q + j), x0), d1 = _mm512_sub_ps(_mm512_loadu_ps(q + j + 16), x1);
        a0 = _mm512_fmadd_ps(d0, d0, a0);
        a1 = _mm512_fmadd_ps(d1, d1, a1);
    }
    for (; j + 16 <= d; j += 16) {
        __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(q + j), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + j))));
        a0 = _mm512_fmadd_ps(d0, d0, a0);
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
    for (; j < d; j++) {
        float t = q[j] - half_to_float(x[j]);
        sum += t * t;
    }
    return sum;
}

static float l2_f32(const float *q, const float *x, int64_t d) {
    int64_t j = 0;
    float sum = 0.0f;
#ifdef VECTOR
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; j + 32 <= d; j += 32) {
        __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(q + j), _mm512_loadu_ps(x + j));
        __m512 d1 = _mm512_sub_ps(_mm512_loadu_ps(q + j + 16), _mm512_loadu_ps(x + j + 16));
        a0 = _mm512_fmadd_ps(d0, d0, a0);
        a1 = _mm512_fmadd_ps(d1, d1, a1);
    }
    for (; j + 16 <= d; j += 16) {
        __m512 d0 = _mm512_sub_ps(_mm512_loadu_ps(q + j), _mm512_loadu_ps(x + j));
        a0 = _mm512_fmadd_ps(d0, d0, a0);
    }
    sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
    for (; j < d; j++) {
        float t = q[j] - x[j];
        sum += t * t;
    }
    return sum;
}

#define AHEAD 2 /* ids prefetched ahead of the one scored */

static void prefetch_row(const char *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 3);
}

/* out[i, j] = ||q[i] - keys[ids[i, j]]||^2, inf where ids[i, j] < 0: q (rows, d), ids and out (rows, cols). */
#define L2_BY_ID(NAME, KEY, DIST)                                                                          \
    void NAME(const float *q, const KEY *keys, const int64_t *ids, int64_t rows, int64_t cols, int64_t d,  \
              float *out) {                                                                                \
        const int64_t n = rows * cols, bytes = d * (int64_t)sizeof(KEY);                                   \
        for (int64_t a = 0; a < AHEAD && a < n; a++)                                                       \
            if (ids[a] >= 0) prefetch_row((const char *)(keys + ids[a] * d), bytes);                       \
        for (int64_t i = 0; i < n; i++) {                                                                  \
            if (i + AHEAD < n && ids[i + AHEAD] >= 0)                                                      \
                prefetch_row((const char *)(keys + ids[i + AHEAD] * d), bytes);                            \
            out[i] = ids[i] < 0 ? INFINITY : DIST(q + (i / cols) * d, keys + ids[i] * d, d);               \
        }                                                                                                  \
    }

L2_BY_ID(l2_by_id_f16, uint16_t, l2_f16)
L2_BY_ID(l2_by_id_f32, float, l2_f32)

/* RADIX_SORT_C */

/* The r-th smallest (1-based) of a[0 .. n), a reordered (Hoare's selection). */
static int64_t nth_key(int64_t *a, int64_t n, int64_t r) {
    int64_t lo = 0, hi = n - 1, want = r - 1;
    while (lo < hi) {
        int64_t pivot = a[lo + (hi - lo) / 2], i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) { int64_t t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (want <= j) hi = j; else if (want >= i) lo = i; else return a[want];
    }
    return a[want];
}

#define KEY_SAMPLE 8 /* every 8th key of a row bounds its takes[i] lowest */

/* out[i, :t_i] = the t_i = min(takes[i], row length) lowest of row i's keys keys[bounds[i] .. bounds[i + 1]),
   lowest first (keys unique; out (rows, width) already filled with the pad past them). A strided sample's
   order statistic bounds the row, the keys at or under it are sorted (all of them when fewer than t_i are);
   returns 0, or -1 if out of memory. */
int lowest_keys_into(const int64_t *keys, const int64_t *bounds, const int64_t *takes, int64_t rows, int64_t width,
                     int64_t *out) {
    int64_t longest = 0;
    for (int64_t i = 0; i < rows; i++)
        if (bounds[i + 1] - bounds[i] > longest) longest = bounds[i + 1] - bounds[i];
    int64_t *buf = malloc((size_t)(longest + 1) * sizeof(int64_t));
    int64_t *tmp = malloc((size_t)(longest + 1) * sizeof(int64_t));
    if (!buf || !tmp) { free(buf); free(tmp); return -1; }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t *row = keys + bounds[i];
        int64_t h = bounds[i + 1] - bounds[i], t = takes[i] < h ? takes[i] : h, c = 0;
        if (t <= 0) continue;
        int64_t bound = INT64_MAX, samples = h / KEY_SAMPLE, rank = (t * 5 / 4) / KEY_SAMPLE + 4;
        if (t < h && samples >= 2 * rank) {
            for (int64_t s = 0; s < samples; s++) buf[s] = row[s * KEY_SAMPLE];
            bound = nth_key(buf, samples, rank);
        }
        for (int64_t j = 0; j < h; j++) {  /* branch-free: the count moves only for a key at or under the bound */
            buf[c] = row[j];
            c += row[j] <= bound;
        }
        if (c < t) {  /* the sample's bound left fewer than t: every key */
            memcpy(buf, row, (size_t)h * sizeof(int64_t));
            c = h;
        }
        radix_sort_u64((uint64_t *)buf, (uint64_t *)tmp, c, 0, (uint64_t)1 << 63);  /* signed order */
        memcpy(out + i * width, buf, (size_t)t * sizeof(int64_t));
    }
    free(buf); free(tmp);
    return 0;
}

/* out[starts[i] + j] = order_bits(scores[i, j]) << 32 | (first_place + j): scores (rows, cols), no nan;
   order_bits as memlm.retrieval.clustered_states.order_bits (-0.0 as 0.0, negatives' magnitude bits flipped). */
void placed_keys_into(const float *scores, int64_t rows, int64_t cols, int64_t first_place, const int64_t *starts,
                      int64_t *out) {
    for (int64_t i = 0; i < rows; i++) {
        const float *row = scores + i * cols;
        int64_t *key = out + starts[i];
        for (int64_t j = 0; j < cols; j++) {
            int32_t b;
            memcpy(&b, row + j, sizeof b);
            if (b == INT32_MIN) b = 0; /* -0.0 */
            b ^= (b >> 31) & 0x7fffffff;
            key[j] = (int64_t)((uint64_t)(int64_t)b << 32) | (first_place + j);
        }
    }
}
""".replace("/* RADIX_SORT_C */", RADIX_SORT_C)

VECTOR_CPU_FLAGS = ("avx512f", "f16c", "fma")
"""What the vector build needs of the CPU (its -m flags below)."""
VECTOR_FLAGS = ("-O3", "-mavx512f", "-mf16c", "-mfma")
PORTABLE_FLAGS = ("-O3",)


def build_flags() -> tuple[str, ...]:
    """VECTOR_FLAGS where the CPU has VECTOR_CPU_FLAGS, else PORTABLE_FLAGS."""
    return VECTOR_FLAGS if set(VECTOR_CPU_FLAGS) <= cpu_flags() else PORTABLE_FLAGS


def compile_kernels(flags: tuple[str, ...], folder: Path | None = None) -> Path:
    """SOURCE's shared library built with `flags` (memlm.compiled.compile_library: cached by source and flags)."""
    return compile_library(SOURCE, "by_id", flags, folder)


def load_kernels(path: Path) -> ctypes.CDLL:
    """The library at `path` with its functions' argument types declared."""
    lib = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in ("l2_by_id_f16", "l2_by_id_f32"):
        fn = getattr(lib, name)
        fn.argtypes = [pointer, pointer, pointer, size, size, size, pointer]
        fn.restype = None
    lib.placed_keys_into.argtypes = [pointer, size, size, size, pointer, pointer]
    lib.placed_keys_into.restype = None
    lib.lowest_keys_into.argtypes = [pointer, pointer, pointer, size, size, pointer]
    lib.lowest_keys_into.restype = ctypes.c_int
    return lib


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """This process' kernels, built for this CPU; None (logged once) where they cannot be built or loaded: exact
    distances then use faiss."""
    return load_or_warn(lambda: load_kernels(compile_kernels(build_flags())), log, "by-id kernels")


def available() -> bool:
    """Whether `l2_by_id` can run in this process (else the caller takes its faiss path)."""
    return kernels() is not None


def l2_by_id(queries: np.ndarray, keys: np.ndarray, ids: np.ndarray, lib: ctypes.CDLL | None = None) -> np.ndarray:
    """(r, e) float32 squared L2 between queries (r, d) float32 and keys[ids] (ids (r, e) int64, each in [0, N)
    or -1), inf where the id is -1; keys (N, d) float16 or float32, C-contiguous (a memmap will do). float32
    arithmetic in any summation order: equal to a float64 oracle up to float32 rounding. lib: a library of
    load_kernels (default this process' `kernels()`, which must be available)."""
    lib = lib or kernels()
    if lib is None:
        raise RuntimeError("the by-id kernels are not available (by_id_kernels.available() is False)")
    if keys.dtype not in (np.float16, np.float32) or not keys.flags.c_contiguous or keys.ndim != 2:
        raise ValueError(f"keys must be C-contiguous (N, d) float16 or float32, got {keys.dtype} {keys.shape}")
    d = keys.shape[1]
    q = np.ascontiguousarray(queries, dtype=np.float32)  # (r, d)
    at = np.ascontiguousarray(ids, dtype=np.int64)  # (r, e)
    if q.ndim != 2 or q.shape[1] != d or at.ndim != 2 or at.shape[0] != q.shape[0]:
        raise ValueError(f"queries (r, {d}) and ids (r, e) expected, got {q.shape} and {at.shape}")
    if at.size and (int(at.max()) >= keys.shape[0] or int(at.min()) < -1):  # C reads any address it is given
        raise ValueError(f"ids must be in [0, {keys.shape[0]}) or -1, got [{int(at.min())}, {int(at.max())}]")
    out = np.empty(at.shape, dtype=np.float32)  # (r, e)
    if out.size:
        fn = lib.l2_by_id_f16 if keys.dtype == np.float16 else lib.l2_by_id_f32
        fn(q.ctypes.data, keys.ctypes.data, at.ctypes.data, at.shape[0], at.shape[1], d, out.ctypes.data)
    return out


def placed_keys_into(scores: np.ndarray, first_place: int, starts: np.ndarray, out: np.ndarray,
                     lib: ctypes.CDLL | None = None) -> None:
    """out[starts[i] : starts[i] + s] = clustered_states.placed_keys(scores[i], first_place + arange(s)) for each
    row i of scores (g, s) float32 C-contiguous without nan (starts (g,) int64, out (T,) int64 C-contiguous): the
    rows' sort keys written where they go, in one pass (rank_keys). lib: as l2_by_id's."""
    lib = lib or kernels()
    if lib is None:
        raise RuntimeError("the by-id kernels are not available (by_id_kernels.available() is False)")
    at = np.ascontiguousarray(starts, dtype=np.int64)  # (g,)
    g, s = scores.shape
    if scores.dtype != np.float32 or not scores.flags.c_contiguous or at.shape != (g,):
        raise ValueError(f"scores (g, s) C-contiguous float32 and starts (g,) expected, got {scores.dtype} "
                         f"{scores.shape} and {at.shape}")
    if out.dtype != np.int64 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous (T,) int64 array, got {out.dtype} {out.shape}")
    if g and (int(at.min()) < 0 or int(at.max()) + s > out.shape[0] or not 0 <= first_place <= (1 << 32) - s):
        raise ValueError(f"rows of {s} keys from starts in [{int(at.min())}, {int(at.max())}] do not fit out "
                         f"({out.shape[0]}), or places from {first_place} pass 2^32")
    if g and s:
        lib.placed_keys_into(scores.ctypes.data, g, s, first_place, at.ctypes.data, out.ctypes.data)


def lowest_keys_into(keys: np.ndarray, bounds: np.ndarray, takes: np.ndarray, out: np.ndarray,
                     lib: ctypes.CDLL | None = None) -> None:
    """out[i, :t] = the t = min(takes[i], its length) lowest of row i's keys, keys[bounds[i] : bounds[i + 1]],
    lowest first (clustered_states.lowest_keys' rule: keys (T,) int64 unique within a row, bounds (r + 1,), takes
    (r,); out (r, w) int64 C-contiguous, w >= max(takes), already filled with the pad past each row's t). keys
    is only read. lib: as l2_by_id's."""
    lib = lib or kernels()
    if lib is None:
        raise RuntimeError("the by-id kernels are not available (by_id_kernels.available() is False)")
    k = np.ascontiguousarray(keys, dtype=np.int64)  # (T,)
    b = np.ascontiguousarray(bounds, dtype=np.int64)  # (r + 1,)
    t = np.ascontiguousarray(takes, dtype=np.int64)  # (r,)
    r = t.shape[0]
    if b.shape != (r + 1,) or (r and (int(b[0]) < 0 or int(b[-1]) > k.shape[0] or bool((np.diff(b) < 0).any()))):
        raise ValueError(f"bounds (r + 1,) rising within keys ({k.shape[0]}) expected, got {b.shape}")
    if out.dtype != np.int64 or out.ndim != 2 or out.shape[0] != r or not out.flags.c_contiguous \
            or not out.flags.writeable or (r and out.shape[1] < int(t.max())):
        raise ValueError(f"out must be a writeable C-contiguous ({r}, >= max(takes)) int64 array, got {out.dtype} "
                         f"{out.shape}")
    if r and lib.lowest_keys_into(k.ctypes.data, b.ctypes.data, t.ctypes.data, r, out.shape[1], out.ctypes.data):
        raise MemoryError("lowest_keys_into could not allocate its row buffers")
