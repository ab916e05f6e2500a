"""A compiled kernel that turns one chunk of an exact search's products into the k nearest keys so far, for the
torch exact search on the CPU (memlm.retrieval.exact.TorchExactSearcher; issue 15).

torch.topk(k=1024) over a row of 65,536 distances costs about 0.65 ms on one core, more than the row's share of
the product that made it (the panel GEMM reads the keys once for all rows): a verifying pass of speculative
decoding searches several queries at once, and each extra query paid mostly for its top-k. This kernel does, per
row, in one pass over the products:

1. the squared distances |x|^2 - 2 x.k + |k|^2 in float32 in the same order of operations as the torch path
   (((x.k * -2) + |x|^2) + |k|^2, clamped at 0), so the same values bit for bit;
2. a bound: the k-th best distance of the earlier chunks, or, for a row with fewer than k so far, the r-th
   smallest of a strided sample of the chunk (every 16th key, r ~ 1.25 k / 16), which leaves ~1.25 k candidates;
3. the candidates at or under the bound (AVX-512 compress-stores where the CPU has it), with the earlier best; if
   fewer than k are at or under it (a sample can miss), every key is a candidate: the result is exact either way;
4. the candidates sorted by (distance, id) (a stable radix sort on the distance's bits: they are collected in id
   order), the first k written back as the new best.

Ties are broken by the smaller id (torch.topk's order among equal distances is unspecified). The C source is
compiled at first use (memlm.compiled: cached by source and flags), AVX-512 where /proc/cpuinfo shows avx512f,
portable -O3 otherwise; without a compiler, `available()` is False (logged once) and the searcher keeps torch.topk.

Shape legend: Q queries (rows), n keys of a chunk, k neighbours.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import numpy as np

from memlm.compiled import RADIX_SORT_C, compile_library, cpu_flags, load_or_warn

log = logging.getLogger(__name__)

SAMPLE_STRIDE = 16
"""Every SAMPLE_STRIDE-th key of a chunk estimates the bound of a row with fewer than k neighbours so far."""

MAX_IDS = 1 << 32
"""Ids are packed into 32 bits beside the distance's 32 (a sort on one 64-bit integer): N must stay under this."""
MAX_CHUNK = 1 << 31
"""A chunk's positions are int32 in the kernel: fewer keys than this a call."""


def fits(n_keys: int, chunk_size: int) -> bool:
    """Whether a search over n_keys keys in chunks of chunk_size can take this kernel (ids and positions fit)."""
    return n_keys < MAX_IDS and chunk_size < MAX_CHUNK

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#define VECTOR 1
#endif

#define SAMPLE_STRIDE %(stride)d

/* (distance, id) as one integer: a non-negative float's bits order as its value (-0.0 as 0.0), the id (< 2^32)
   in the low bits. */
static uint64_t pack(float d, int64_t id) {
    uint32_t bits;
    memcpy(&bits, &d, sizeof bits);
    if (bits == 0x80000000u) bits = 0;
    return ((uint64_t)bits << 32) | (uint32_t)id;
}

static float unpack_distance(uint64_t key) {
    uint32_t bits = (uint32_t)(key >> 32);
    float d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* RADIX_SORT_C */

static void swapf(float *a, float *b) { float t = *a; *a = *b; *b = t; }

/* The r-th smallest (1-based) of a[0 .. n) (no nan), a reordered. */
static float nth_float(float *a, int64_t n, int64_t r) {
    int64_t lo = 0, hi = n - 1, want = r - 1;
    while (lo < hi) {
        float pivot = a[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) { swapf(&a[i], &a[j]); i++; j--; }
        }
        if (want <= j) hi = j; else if (want >= i) lo = i; else return a[want];
    }
    return a[want];
}

static float distance(float product, float x_norm, float key_norm) {
    float d = product * -2.0f;
    d = d + x_norm;
    d = d + key_norm;
    return d < 0.0f ? 0.0f : d;
}

/* Candidates of one row at or under bound: their distances and chunk positions into dist/pos, their count. */
static int64_t collect(const float *p, const float *key_norms, int64_t n, float x_norm, float bound, float *dist,
                       int32_t *pos) {
    int64_t c = 0, j = 0;
    const int every = isinf(bound) && bound > 0;
#ifdef VECTOR
    const __m512 minus2 = _mm512_set1_ps(-2.0f), xn = _mm512_set1_ps(x_norm), zero = _mm512_setzero_ps(),
                 limit = _mm512_set1_ps(bound);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sixteen = _mm512_set1_epi32(16);
    for (; j + 16 <= n; j += 16) {
        __m512 d = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(p + j), minus2), xn),
                                 _mm512_loadu_ps(key_norms + j));
        d = _mm512_max_ps(zero, d);  /* d < 0 -> 0; nan stays nan (max_ps returns its second operand) */
        /* under an infinite bound every key, nan included (it sorts last, as torch.topk puts it) */
        __mmask16 under = every ? (__mmask16)0xffff : _mm512_cmp_ps_mask(d, limit, _CMP_LE_OQ);
        if (under) {
            _mm512_mask_compressstoreu_ps(dist + c, under, d);
            _mm512_mask_compressstoreu_epi32(pos + c, under, at);
            c += __builtin_popcount((unsigned)under);
        }
        at = _mm512_add_epi32(at, sixteen);
    }
#endif
    for (; j < n; j++) {
        float d = distance(p[j], x_norm, key_norms[j]);
        if (every || d <= bound) { dist[c] = d; pos[c] = (int32_t)j; c++; }
    }
    return c;
}

/* best_d/best_i (rows, k), sorted, inf/-1 where empty, become the k nearest of themselves and this chunk:
   products (rows, n) = x . keys of the chunk, keys id_offset + 0 .. n - 1. Returns 0, or -1 if out of memory. */
int nearest_into(const float *products, int64_t rows, int64_t n, const float *x_norms, const float *key_norms,
                 int64_t id_offset, int64_t k, float *best_d, int64_t *best_i) {
    float *dist = malloc((size_t)(n + 1) * sizeof(float));
    int32_t *pos = malloc((size_t)(n + 1) * sizeof(int32_t));
    uint64_t *keys = malloc((size_t)(n + k + 1) * sizeof(uint64_t));
    uint64_t *tmp = malloc((size_t)(n + k + 1) * sizeof(uint64_t));
    float *sample = malloc((size_t)(n / SAMPLE_STRIDE + 1) * sizeof(float));
    if (!dist || !pos || !keys || !tmp || !sample) {
        free(dist); free(pos); free(keys); free(tmp); free(sample);
        return -1;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *p = products + r * n;
        float *bd = best_d + r * k;
        int64_t *bi = best_i + r * k;
        float x_norm = x_norms[r];
        float bound = bi[k - 1] >= 0 ? bd[k - 1] : INFINITY;
        int64_t samples = n / SAMPLE_STRIDE, rank = (k * 5 / 4) / SAMPLE_STRIDE + 8;
        if (bound == INFINITY && samples >= 4 * rank) {
            for (int64_t s = 0; s < samples; s++) {
                float d = distance(p[s * SAMPLE_STRIDE], x_norm, key_norms[s * SAMPLE_STRIDE]);
                sample[s] = isnan(d) ? INFINITY : d;
            }
            bound = nth_float(sample, samples, rank);
        }
        int64_t c;
        for (;;) {
            c = 0;
            for (int64_t t = 0; t < k && bi[t] >= 0; t++)
                if (bd[t] <= bound) keys[c++] = pack(bd[t], bi[t]);
            int64_t found = collect(p, key_norms, n, x_norm, bound, dist, pos);
            for (int64_t t = 0; t < found; t++) keys[c++] = pack(dist[t], id_offset + pos[t]);
            if (c >= k || bound == INFINITY) break;
            bound = INFINITY;  /* the sample's bound left fewer than k: take every key */
        }
        int64_t m = c < k ? c : k;  /* short of k only where the row has fewer keys */
        /* stable by distance alone (the high 32 bits): candidates are collected in id order among equal distances
           (the earlier best, sorted by (distance, id) and of smaller ids, then the chunk in order) */
        radix_sort_u64(keys, tmp, c, 32, 0);
        for (int64_t t = 0; t < m; t++) {
            bd[t] = unpack_distance(keys[t]);
            bi[t] = (int64_t)(uint32_t)keys[t];
        }
        for (int64_t t = m; t < k; t++) { bd[t] = INFINITY; bi[t] = -1; }
    }
    free(dist); free(pos); free(keys); free(tmp); free(sample);
    return 0;
}
""".replace("%(stride)d", str(SAMPLE_STRIDE)).replace("/* RADIX_SORT_C */", RADIX_SORT_C)

VECTOR_FLAGS = ("-O3", "-mavx512f")
PORTABLE_FLAGS = ("-O3",)


def build_flags() -> tuple[str, ...]:
    """VECTOR_FLAGS where the CPU has avx512f, else PORTABLE_FLAGS."""
    return VECTOR_FLAGS if "avx512f" in cpu_flags() else PORTABLE_FLAGS


def compile_kernel(flags: tuple[str, ...], folder: Path | None = None) -> Path:
    """SOURCE's shared library built with `flags` (memlm.compiled.compile_library: cached by source and flags)."""
    return compile_library(SOURCE, "nearest", flags, folder)


def load_kernel(path: Path) -> ctypes.CDLL:
    """The library at `path` with its function's argument types declared."""
    lib = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.nearest_into.argtypes = [pointer, size, size, pointer, pointer, size, size, pointer, pointer]
    lib.nearest_into.restype = ctypes.c_int
    return lib


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """This process' kernel, built for this CPU; None (logged once) where it cannot be built or loaded."""
    return load_or_warn(lambda: load_kernel(compile_kernel(build_flags())), log, "nearest-k kernel")


def available() -> bool:
    """Whether `nearest_into` can run in this process (else the caller keeps torch.topk)."""
    return kernel() is not None


def empty_best(rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, k) float32 inf distances and (rows, k) int64 -1 ids: no neighbour yet."""
    return np.full((rows, k), np.inf, dtype=np.float32), np.full((rows, k), -1, dtype=np.int64)


def nearest_into(products: np.ndarray, x_norms: np.ndarray, key_norms: np.ndarray, id_offset: int,
                 best_d: np.ndarray, best_i: np.ndarray, lib: ctypes.CDLL | None = None) -> None:
    """best_d (Q, k) float32 / best_i (Q, k) int64 (sorted by distance then id; inf / -1 where empty; from
    empty_best or an earlier call) become the k nearest of themselves and one chunk's keys, ids id_offset ..
    id_offset + n - 1: products (Q, n) float32 = the queries . the chunk's keys, x_norms (Q,) the queries' squared
    norms, key_norms (n,) the keys'. Distances as the torch path computes them, clamped at 0, bit for bit. Chunks go
    in ascending id order (as the searcher passes them): ties are then broken by the smaller id.
    lib: a library of load_kernel (default this process' `kernel()`, which must be available)."""
    lib = lib or kernel()
    if lib is None:
        raise RuntimeError("the nearest-k kernel is not available (nearest_kernel.available() is False)")
    p = np.ascontiguousarray(products, dtype=np.float32)  # (Q, n)
    xn = np.ascontiguousarray(x_norms, dtype=np.float32)  # (Q,)
    kn = np.ascontiguousarray(key_norms, dtype=np.float32)  # (n,)
    Q, n = p.shape
    k = best_d.shape[1] if best_d.ndim == 2 else 0
    if xn.shape != (Q,) or kn.shape != (n,) or best_d.shape != (Q, k) or best_i.shape != (Q, k) or k < 1:
        raise ValueError(f"products (Q, n), x_norms (Q,), key_norms (n,) and best (Q, k >= 1) expected, got "
                         f"{p.shape}, {xn.shape}, {kn.shape}, {best_d.shape}, {best_i.shape}")
    for name, a, dtype in (("best_d", best_d, np.float32), ("best_i", best_i, np.int64)):
        if a.dtype != dtype or not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError(f"{name} must be a writeable C-contiguous {np.dtype(dtype)} array, got {a.dtype}")
    if not 0 <= id_offset or not fits(id_offset + n, n):
        raise ValueError(f"ids {id_offset} .. {id_offset + n - 1} must lie in [0, 2^32), a chunk under 2^31 keys")
    if Q and n:
        if lib.nearest_into(p.ctypes.data, Q, n, xn.ctypes.data, kn.ctypes.data, id_offset, k,
                            best_d.ctypes.data, best_i.ctypes.data) != 0:
            raise MemoryError(f"the nearest-k kernel could not allocate its buffers for {n} keys")
