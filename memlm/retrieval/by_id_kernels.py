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
from typing import NamedTuple

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

#define KEY_SAMPLE 8 /* every 8th key of a row bounds its t lowest */

/* buf[0 .. t) = the t (1 <= t <= h) lowest of row[0 .. h) (unique keys), lowest first: a strided sample's order
   statistic bounds the row, the keys at or under it are sorted (all of them when fewer than t are). buf and tmp
   hold h. */
static void lowest_sorted(const int64_t *row, int64_t h, int64_t t, int64_t *buf, int64_t *tmp) {
    int64_t bound = INT64_MAX, samples = h / KEY_SAMPLE, rank = (t * 5 / 4) / KEY_SAMPLE + 4, c = 0;
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
}

#define SELECT_BUCKETS 1024

/* The r-th lowest (1 <= r <= n) of the unique keys a[0 .. n), a and spare (n) reordered: the keys are counted into
   1,024 buckets of equal width between their least and greatest, and only the bucket holding the r-th is kept,
   until few remain (branch-free passes; a Hoare selection over random keys mispredicts half its branches). */
static int64_t select_key(int64_t *a, int64_t n, int64_t r, int64_t *spare) {
    while (n > 64) {
        int64_t lo = a[0], hi = a[0];
        for (int64_t i = 1; i < n; i++) { lo = a[i] < lo ? a[i] : lo; hi = a[i] > hi ? a[i] : hi; }
        uint64_t span = (uint64_t)hi - (uint64_t)lo;  /* exact: hi >= lo */
        int shift = 0;
        while ((span >> shift) >= SELECT_BUCKETS) shift++;
        int64_t count[SELECT_BUCKETS] = {0};
        for (int64_t i = 0; i < n; i++) count[((uint64_t)a[i] - (uint64_t)lo) >> shift]++;
        uint64_t b = 0;
        while (r > count[b]) r -= count[b++];
        int64_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            spare[m] = a[i];
            m += (((uint64_t)a[i] - (uint64_t)lo) >> shift) == b;
        }
        int64_t *t = a; a = spare; spare = t;
        n = m;
    }
    return nth_key(a, n, r);
}

/* out[i, :t_i] = the t_i = min(takes[i], row length) lowest of row i's keys keys[bounds[i] .. bounds[i + 1]),
   lowest first (keys unique; out (rows, width) already filled with the pad past them); returns 0, or -1 if out of
   memory. */
int lowest_keys_into(const int64_t *keys, const int64_t *bounds, const int64_t *takes, int64_t rows, int64_t width,
                     int64_t *out) {
    int64_t longest = 0;
    for (int64_t i = 0; i < rows; i++)
        if (bounds[i + 1] - bounds[i] > longest) longest = bounds[i + 1] - bounds[i];
    int64_t *buf = malloc((size_t)(longest + 1) * sizeof(int64_t));
    int64_t *tmp = malloc((size_t)(longest + 1) * sizeof(int64_t));
    if (!buf || !tmp) { free(buf); free(tmp); return -1; }
    for (int64_t i = 0; i < rows; i++) {
        int64_t h = bounds[i + 1] - bounds[i], t = takes[i] < h ? takes[i] : h;
        if (t <= 0) continue;
        lowest_sorted(keys + bounds[i], h, t, buf, tmp);
        memcpy(out + i * width, buf, (size_t)t * sizeof(int64_t));
    }
    free(buf); free(tmp);
    return 0;
}

/* order_bits(score) << 32 | place: order_bits as memlm.retrieval.clustered_states.order_bits (-0.0 as 0.0,
   negatives' magnitude bits flipped), so that the keys' signed order is (score, place); score not nan. */
static int64_t placed_key(float score, int64_t place) {
    int32_t b;
    memcpy(&b, &score, sizeof b);
    if (b == INT32_MIN) b = 0; /* -0.0 */
    b ^= (b >> 31) & 0x7fffffff;
    return (int64_t)((uint64_t)(int64_t)b << 32) | place;
}

/* out[starts[i] + j] = placed_key(scores[i, j], first_place + j): scores (rows, cols), no nan. */
void placed_keys_into(const float *scores, int64_t rows, int64_t cols, int64_t first_place, const int64_t *starts,
                      int64_t *out) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) out[starts[i] + j] = placed_key(scores[i * cols + j], first_place + j);
}

#define PLACE_BITS 0xffffffffLL
#define BLOCK 16 /* members a sketch block holds: blocks (ceil(N / 16), p, 16) float16, member m at [m / 16][:][m % 16] */

/* One row's (row, cluster) pair: its keys for the cluster's members start at keys[start]. */
typedef struct { int64_t row, cluster, start; } Pair;

/* The clustered states and their KeySketch as the extension reads them (by_id_kernels.ClusterArrays). */
typedef struct {
    const int64_t *assign, *position, *offsets, *members;
    const int32_t *values;
    const float *centroids;
    const uint16_t *blocks;
    const float *norms;
    const void *keys;
    int64_t n_clusters, d, p, half, exact, max_clusters, width;
} Clusters;

/* Where the extension writes its row i: row out.row[i] (i where out.row is NULL) of (., out.width) arrays dist, ids,
   vals; count[that row] = kept, the entries past kept up to its old count reset to inf / -1 / -1 (the walk's block
   rows hold their candidates first); scored[i] = how many of the kept have a distance (NULL: not asked). */
typedef struct {
    const int64_t *row;
    int64_t width;
    float *dist;
    int64_t *ids;
    int32_t *vals;
    int64_t *count, *scored;
} Out;

/* The clustered extension of memlm.retrieval.pointers.extend_by_clusters with a KeySketch, all rows in one call
   (the same rule; the Python docstring has it): for row i, its own candidates own[sel[i], :] (ids >= 0, distinct,
   -1 padded; a row with none is skipped; sel NULL: i), the clusters holding them, the max_clusters nearest of
   those by squared L2 from q[sel[i]] to the centroid (ties by cluster; max_clusters <= 0: all), every member of
   those clusters ranked by the sketch score norms[m] - 2 qq[sel[i]] . code[m] (place m in cluster order), the own
   candidates first (placed_key(-inf, m)); the t = min(held, max(width, own)) best by (score, place), the first
   e = min(max(exact, own), t) of them scored exactly (squared L2 to keys[m], float16 or float32 by `half`) and
   ordered nearest first (ties in ranking order), the others after them at inf in place order; cut to width;
   written as `out` says. Each cluster's members are scored for every row asking for it in turn, so that its
   sketch blocks are read from memory once a call. Returns 0, or -1 if out of memory. */
static int extend_rows(int64_t rows, const int64_t *sel, const int64_t *own, int64_t own_width, const float *q,
                       const float *qq, Clusters k, Out out) {
    const int64_t *assign = k.assign, *position = k.position, *offsets = k.offsets, *members = k.members;
    const int32_t *values = k.values;
    const float *centroids = k.centroids, *norms = k.norms;
    const uint16_t *blocks = k.blocks;
    const void *keys = k.keys;
    int64_t n_clusters = k.n_clusters, d = k.d, p = k.p, half = k.half, exact = k.exact, width = k.width;
    int64_t max_clusters = k.max_clusters;
    int64_t *stamp = malloc((size_t)n_clusters * sizeof(int64_t)), *start_of = malloc((size_t)n_clusters * sizeof(int64_t));
    int64_t *row_start = malloc((size_t)(rows + 1) * sizeof(int64_t)), *row_pairs = malloc((size_t)(rows + 1) * sizeof(int64_t));
    int64_t *row_own = malloc((size_t)(rows + 1) * sizeof(int64_t));
    int64_t *found = malloc((size_t)(n_clusters + 1) * sizeof(int64_t));
    float *cdist = malloc((size_t)(n_clusters + 1) * sizeof(float));
    Pair *pairs = malloc((size_t)(rows * (n_clusters < own_width ? n_clusters : own_width) + 1) * sizeof(Pair));
    int64_t *keybuf = NULL, *buf = NULL, *tmp = NULL, *by_cluster = NULL, *cluster_first = NULL;
    float *scored = NULL;
    int status = -1;
    if (!stamp || !start_of || !row_start || !row_pairs || !row_own || !found || !cdist || !pairs) goto done;
    for (int64_t c = 0; c < n_clusters; c++) stamp[c] = -1;

    /* 1. each row's clusters, the nearest kept, and where its keys go */
    int64_t n_pairs = 0, total = 0, longest = 0;
    for (int64_t i = 0; i < rows; i++) {
        int64_t in = sel ? sel[i] : i;
        const int64_t *mine = own + in * own_width;
        int64_t n_found = 0, n_own = 0;
        row_pairs[i] = n_pairs;
        row_start[i] = total;
        for (int64_t j = 0; j < own_width; j++) {
            if (mine[j] < 0) continue;
            n_own++;
            int64_t c = assign[mine[j]];
            if (stamp[c] != i) { stamp[c] = i; found[n_found++] = c; }
        }
        row_own[i] = n_own;
        if (max_clusters > 0 && n_found > max_clusters) {  /* the nearest by centroid, ties by cluster */
            for (int64_t a = 0; a < n_found; a++) cdist[a] = l2_f32(q + in * d, centroids + found[a] * d, d);
            for (int64_t a = 1; a < n_found; a++) {  /* insertion sort by (distance, cluster): a row has few */
                int64_t c = found[a], b = a - 1;
                float x = cdist[a];
                while (b >= 0 && (cdist[b] > x || (cdist[b] == x && found[b] > c))) {
                    found[b + 1] = found[b]; cdist[b + 1] = cdist[b]; b--;
                }
                found[b + 1] = c; cdist[b + 1] = x;
            }
            n_found = max_clusters;
        }
        for (int64_t a = 1; a < n_found; a++) {  /* by cluster: the row's keys then lie in place order */
            int64_t c = found[a], b = a - 1;
            while (b >= 0 && found[b] > c) { found[b + 1] = found[b]; b--; }
            found[b + 1] = c;
        }
        int64_t held = 0;
        for (int64_t a = 0; a < n_found; a++) {
            int64_t c = found[a];
            pairs[n_pairs++] = (Pair){i, c, held};
            held += offsets[c + 1] - offsets[c];
        }
        for (int64_t a = 0; a < n_found; a++) stamp[found[a]] = rows + i;  /* ranked for row i */
        for (int64_t j = 0; j < own_width; j++)  /* strays: own candidates outside the ranked clusters */
            if (mine[j] >= 0 && stamp[assign[mine[j]]] != rows + i) held++;
        total += held;
        if (held > longest) longest = held;
    }
    row_start[rows] = total;
    row_pairs[rows] = n_pairs;

    keybuf = malloc((size_t)(total + 1) * sizeof(int64_t));
    buf = malloc((size_t)(longest + 1) * sizeof(int64_t));
    tmp = malloc((size_t)(2 * longest + 2) * sizeof(int64_t));  /* two halves: the exact distances' sorts */
    scored = malloc((size_t)(longest + 1) * sizeof(float));
    by_cluster = malloc((size_t)(n_pairs + 1) * sizeof(int64_t));
    cluster_first = malloc((size_t)(n_clusters + 1) * sizeof(int64_t));
    if (!keybuf || !buf || !tmp || !scored || !by_cluster || !cluster_first) goto done;

    /* 2. the sketch scores, cluster by cluster (pairs counted into cluster order) */
    memset(cluster_first, 0, (size_t)(n_clusters + 1) * sizeof(int64_t));
    for (int64_t a = 0; a < n_pairs; a++) cluster_first[pairs[a].cluster + 1]++;
    for (int64_t c = 0; c < n_clusters; c++) cluster_first[c + 1] += cluster_first[c];
    for (int64_t a = 0; a < n_pairs; a++) by_cluster[cluster_first[pairs[a].cluster]++] = a;
    for (int64_t a = 0; a < n_pairs; a++) {
        const Pair *pr = pairs + by_cluster[a];
        const float *w = qq + (sel ? sel[pr->row] : pr->row) * p;
        int64_t lo = offsets[pr->cluster], hi = offsets[pr->cluster + 1];
        int64_t base = row_start[pr->row] + pr->start - lo;  /* keybuf[base + m]: member place m's key */
        for (int64_t b = lo / BLOCK; b * BLOCK < hi; b++) {
            const uint16_t *blk = blocks + b * p * BLOCK;
            float acc[BLOCK] = {0};
#ifdef VECTOR
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < p; j++)
                sum = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + j * BLOCK))), sum);
            _mm512_storeu_ps(acc, sum);
#else
            for (int64_t j = 0; j < p; j++)
                for (int l = 0; l < BLOCK; l++) acc[l] += w[j] * half_to_float(blk[j * BLOCK + l]);
#endif
            int64_t m0 = b * BLOCK < lo ? lo : b * BLOCK, m1 = (b + 1) * BLOCK > hi ? hi : (b + 1) * BLOCK;
            for (int64_t m = m0; m < m1; m++) keybuf[base + m] = placed_key(norms[m] + -2.0f * acc[m - b * BLOCK], m);
        }
    }

    /* 3. per row: its own candidates first, the best kept, the first scored exactly */
    for (int64_t i = 0; i < rows; i++) {
        int64_t in = sel ? sel[i] : i;
        const int64_t *mine = own + in * own_width;
        int64_t *row = keybuf + row_start[i], h = row_start[i + 1] - row_start[i], n_own = row_own[i];
        if (n_own == 0) continue;
        for (int64_t a = row_pairs[i]; a < row_pairs[i + 1]; a++) {
            stamp[pairs[a].cluster] = 2 * rows + i;
            start_of[pairs[a].cluster] = pairs[a].start - offsets[pairs[a].cluster];
        }
        int64_t stray = h;
        for (int64_t j = own_width - 1; j >= 0; j--) {  /* strays fill the row's end, in candidate order */
            if (mine[j] < 0) continue;
            int64_t m = position[mine[j]], c = assign[mine[j]];
            if (stamp[c] == 2 * rows + i) row[start_of[c] + m] = placed_key(-INFINITY, m);
            else row[--stray] = placed_key(-INFINITY, m);
        }
        int64_t t = width > n_own ? width : n_own;
        t = t < h ? t : h;
        int64_t e = exact > n_own ? exact : n_own;
        e = e < t ? e : t;
        /* the kept: the own candidates (the lowest keys) and the t - own lowest others, in row order (place order);
           the scored: the own and the e - own lowest others, sorted */
        int64_t own_high = placed_key(-INFINITY, 0) >> 32, own_top = (int64_t)((uint64_t)own_high << 32) | PLACE_BITS;
        int64_t others = 0, kth = own_top, eth = own_top;
        for (int64_t j = 0; j < h; j++) {
            buf[others] = row[j];
            others += row[j] > own_top;
        }
        if (t > n_own) kth = select_key(buf, others, t - n_own, tmp);
        int64_t n = 0;
        for (int64_t j = 0; j < h; j++) {
            buf[n] = row[j];
            n += row[j] <= kth;
        }
        if (e > n_own) {
            for (int64_t j = 0, c = 0; j < t; j++) {
                tmp[c] = buf[j];
                c += buf[j] > own_top;
            }
            eth = select_key(tmp, t - n_own, e - n_own, tmp + t);
        }
        int64_t first = 0, later = e;
        for (int64_t j = 0; j < t; j++) {  /* buf: the scored first, the followed-only after them in place order */
            if (buf[j] <= eth) tmp[first++] = buf[j];
            else tmp[later++] = buf[j];
        }
        memcpy(buf, tmp, (size_t)t * sizeof(int64_t));
        radix_sort_u64((uint64_t *)buf, (uint64_t *)tmp, e, 0, (uint64_t)1 << 63);  /* the scored in ranking order */
        for (int64_t j = 0; j < e; j++) {  /* exact distances, read in place order (the keys' order in memory) */
            tmp[j] = ((buf[j] & PLACE_BITS) << 32) | j;
        }
        radix_sort_u64((uint64_t *)tmp, (uint64_t *)(tmp + e), e, 0, 0);
        for (int64_t j = 0; j < e; j++) {
            int64_t ahead = j + AHEAD < e ? (tmp[j + AHEAD] >> 32) : -1, m = tmp[j] >> 32;
            const float *qi = q + in * d;
            if (half) {
                if (ahead >= 0) prefetch_row((const char *)((const uint16_t *)keys + ahead * d), d * 2);
                scored[tmp[j] & PLACE_BITS] = l2_f16(qi, (const uint16_t *)keys + m * d, d);
            } else {
                if (ahead >= 0) prefetch_row((const char *)((const float *)keys + ahead * d), d * 4);
                scored[tmp[j] & PLACE_BITS] = l2_f32(qi, (const float *)keys + m * d, d);
            }
        }
        for (int64_t j = 0; j < e; j++) tmp[j] = placed_key(scored[j], j);  /* nearest first, ties by rank */
        radix_sort_u64((uint64_t *)tmp, (uint64_t *)(tmp + e), e, 0, (uint64_t)1 << 63);
        int64_t kept = t < width ? t : width, o = out.row ? out.row[i] : i, old = out.count[o];
        float *o_dist = out.dist + o * out.width;
        int64_t *o_ids = out.ids + o * out.width;
        int32_t *o_vals = out.vals + o * out.width;
        for (int64_t j = 0; j < kept; j++) {
            int64_t at = j < e ? (tmp[j] & PLACE_BITS) : j, m = buf[at] & PLACE_BITS;
            o_dist[j] = j < e ? scored[at] : INFINITY;
            o_ids[j] = members[m];
            o_vals[j] = values[m];
        }
        for (int64_t j = kept; j < old; j++) { o_dist[j] = INFINITY; o_ids[j] = -1; o_vals[j] = -1; }
        out.count[o] = kept;
        if (out.scored) out.scored[i] = e < kept ? e : kept;
    }
    status = 0;
done:
    free(stamp); free(start_of); free(row_start); free(row_pairs); free(row_own); free(found); free(cdist);
    free(pairs); free(keybuf); free(buf); free(tmp); free(scored); free(by_cluster); free(cluster_first);
    return status;
}

/* extend_rows over the rows of own (rows, own_width), q and qq, written to dist, ids, vals (rows, width), already
   filled with inf / -1 / -1, and count (rows,) zeros. */
int extend_sketched(int64_t rows, const int64_t *own, int64_t own_width, const float *q, const float *qq,
                    const int64_t *assign, const int64_t *position, const int64_t *offsets, int64_t n_clusters,
                    const int64_t *members, const int32_t *values, const float *centroids, int64_t d,
                    const uint16_t *blocks, const float *norms, int64_t p, const void *keys, int half,
                    int64_t exact, int64_t max_clusters, int64_t width,
                    float *dist, int64_t *ids, int32_t *vals, int64_t *count) {
    Clusters k = {assign, position, offsets, members, values, centroids, blocks, norms, keys,
                  n_clusters, d, p, half, exact, max_clusters, width};
    Out out = {NULL, width, dist, ids, vals, count, NULL};
    return extend_rows(rows, NULL, own, own_width, q, qq, k, out);
}

/* One step of RetoMaton's walk for the moving streams, on the walk's candidate block in place (memlm.jobs.
   pointer_walk: ids, dist, vals (S, block_width), count (S,), each row's candidates first): mover i (block row
   rows[i]) follows its candidates whose value is prev_targets[i] to their successors (next_ids; -1: none), its own
   candidates (memlm.retrieval.pointers.follow's rule). need[i] = 1 where it is fresh[i] (a stream's first token)
   or fewer than min_pointers survive: its block row is left as it is (the caller searches it, or empties it).
   The others are extended (extend_rows, their queries q[i] and qq[i]) into their block rows, scored[i] = how many
   of the kept have a distance (0 where need[i]). Returns 0, or -1 if out of memory. */
int walk_step(int64_t movers, const int64_t *rows, const int32_t *prev_targets, const uint8_t *fresh,
              int64_t min_pointers, const int64_t *next_ids, int64_t *block_ids, float *block_dist,
              int32_t *block_vals, int64_t *block_count, int64_t block_width, const float *q, const float *qq,
              const int64_t *assign, const int64_t *position, const int64_t *offsets, int64_t n_clusters,
              const int64_t *members, const int32_t *values, const float *centroids, int64_t d,
              const uint16_t *blocks, const float *norms, int64_t p, const void *keys, int half,
              int64_t exact, int64_t max_clusters, int64_t width, uint8_t *need, int64_t *scored) {
    int64_t own_width = 1;
    for (int64_t i = 0; i < movers; i++)
        if (block_count[rows[i]] > own_width) own_width = block_count[rows[i]];
    int64_t *own = malloc((size_t)(movers * own_width) * sizeof(int64_t));
    int64_t *sel = malloc((size_t)(movers + 1) * sizeof(int64_t)), *out_rows = malloc((size_t)(movers + 1) * sizeof(int64_t));
    int64_t *ext_scored = malloc((size_t)(movers + 1) * sizeof(int64_t));
    int status = -1;
    if (!own || !sel || !out_rows || !ext_scored) goto done;
    int64_t extended = 0;
    for (int64_t i = 0; i < movers; i++) {
        const int64_t *ids = block_ids + rows[i] * block_width;
        const int32_t *vals = block_vals + rows[i] * block_width;
        int64_t *mine = own + i * own_width, n = 0;
        if (!fresh[i])
            for (int64_t j = 0; j < block_count[rows[i]]; j++) {
                int64_t next = ids[j] >= 0 && vals[j] == prev_targets[i] ? next_ids[ids[j]] : -1;
                mine[n] = next;
                n += next >= 0;
            }
        for (int64_t j = n; j < own_width; j++) mine[j] = -1;
        need[i] = fresh[i] || n < min_pointers;
        scored[i] = 0;
        if (!need[i]) { sel[extended] = i; out_rows[extended++] = rows[i]; }
    }
    Clusters k = {assign, position, offsets, members, values, centroids, blocks, norms, keys,
                  n_clusters, d, p, half, exact, max_clusters, width};
    Out out = {out_rows, block_width, block_dist, block_ids, block_vals, block_count, ext_scored};
    status = extend_rows(extended, sel, own, own_width, q, qq, k, out);
    for (int64_t a = 0; a < extended; a++) scored[sel[a]] = ext_scored[a];
done:
    free(own); free(sel); free(out_rows); free(ext_scored);
    return status;
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
    lib.extend_sketched.argtypes = [size, pointer, size, pointer, pointer, pointer, pointer, pointer, size, pointer,
                                    pointer, pointer, size, pointer, pointer, size, pointer, ctypes.c_int, size, size,
                                    size, pointer, pointer, pointer, pointer]
    lib.extend_sketched.restype = ctypes.c_int
    lib.walk_step.argtypes = [size, pointer, pointer, pointer, size, pointer, pointer, pointer, pointer, pointer,
                              size, pointer, pointer, *lib.extend_sketched.argtypes[5:21], pointer, pointer]
    lib.walk_step.restype = ctypes.c_int
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


SKETCH_BLOCK = 16
"""Members a sketch block holds (the C source's BLOCK): `sketch_blocks` lays a KeySketch's codes out so that 16
members' scores are formed side by side, one code component at a time."""


def sketch_blocks(codes: np.ndarray) -> np.ndarray:
    """(ceil(N / 16), p, 16) float16: codes (N, p) with member m's at [m // 16, :, m % 16], zeros past N (a
    KeySketch's codes are float16 values: key_sketch rounds them)."""
    n, p = codes.shape
    padded = np.zeros((-(-n // SKETCH_BLOCK) * SKETCH_BLOCK, p), dtype=np.float16)  # (N', p)
    padded[:n] = codes
    return np.ascontiguousarray(padded.reshape(-1, SKETCH_BLOCK, p).transpose(0, 2, 1))


class ClusterArrays(NamedTuple):
    """What extend_sketched reads of the clustered states (memlm.retrieval.clustered_states.StateClusters and its
    KeySketch, as C-contiguous arrays; N entries, C clusters, d key dimension, p sketch components)."""

    assign: np.ndarray  # (N,) int64 cluster of each entry
    position: np.ndarray  # (N,) int64 each entry's place in cluster order
    offsets: np.ndarray  # (C + 1,) int64 each cluster's first place
    members: np.ndarray  # (N,) int64 the entry at each place
    values: np.ndarray  # (N,) int32 the stored next token at each place
    centroids: np.ndarray  # (C, d) float32
    blocks: np.ndarray  # (ceil(N / 16), p, 16) float16 the sketch codes by place (sketch_blocks)
    norms: np.ndarray  # (N,) float32 the sketch's centred norms by place
    keys: np.ndarray  # (N, d) float16 or float32 the stored keys by place


def _cluster_args(cl: ClusterArrays, q: np.ndarray, qq: np.ndarray, exact: int, max_clusters: int | None,
                  width: int) -> list:
    """The C arguments from `assign` to `width` of extend_sketched and walk_step, the arrays checked (C reads any
    address it is given): q (r, d) and qq (r, p) float32 C-contiguous."""
    n, (c, d), p = cl.assign.shape[0], cl.centroids.shape, cl.blocks.shape[1]
    if q.shape != (q.shape[0], d) or qq.shape != (q.shape[0], p) or cl.keys.shape != (n, d):
        raise ValueError(f"q (r, {d}) and qq (r, {p}) expected, got {q.shape} and {qq.shape}")
    if cl.offsets.shape != (c + 1,) or cl.blocks.shape != (-(-n // SKETCH_BLOCK), p, SKETCH_BLOCK) \
            or any(a.shape != (n,) for a in (cl.position, cl.members, cl.values, cl.norms)):
        raise ValueError("the cluster arrays disagree in shape (ClusterArrays)")
    for a, dtype in zip(cl, (np.int64, np.int64, np.int64, np.int64, np.int32, np.float32, np.float16, np.float32,
                             cl.keys.dtype)):
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"cluster arrays must be C-contiguous {dtype}, got {a.dtype}")
    if cl.keys.dtype not in (np.float16, np.float32):
        raise ValueError(f"keys must be float16 or float32, got {cl.keys.dtype}")
    if width < 1 or exact < 1:
        raise ValueError(f"width and exact must be at least 1, got {width} and {exact}")
    return [cl.assign.ctypes.data, cl.position.ctypes.data, cl.offsets.ctypes.data, c, cl.members.ctypes.data,
            cl.values.ctypes.data, cl.centroids.ctypes.data, d, cl.blocks.ctypes.data, cl.norms.ctypes.data, p,
            cl.keys.ctypes.data, int(cl.keys.dtype == np.float16), exact, max_clusters or 0, width]


def _library(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or kernels()
    if lib is None:
        raise RuntimeError("the by-id kernels are not available (by_id_kernels.available() is False)")
    return lib


def extend_sketched(own: np.ndarray, q: np.ndarray, qq: np.ndarray, cl: ClusterArrays, exact: int,
                    max_clusters: int | None, width: int, lib: ctypes.CDLL | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """memlm.retrieval.pointers.extend_by_clusters' rule with a KeySketch, for every row at once in compiled code:
    own (r, w) int64 each row's own candidates (distinct ids, -1 padded), q (r, d) float32 its query, qq (r, p)
    float32 (q - mean) @ basis; exact = KeySketch.exact_members, max_clusters = KeySketch.max_clusters.
    Returns (dist, ids, vals, count): (r, width) float32 / int64 / int32, each row's kept members first (inf / -1 /
    -1 after them), and (r,) int64 how many each row keeps (0 for a row without own candidates). lib: as
    l2_by_id's."""
    lib = _library(lib)
    own = np.ascontiguousarray(own, dtype=np.int64)  # (r, w)
    q = np.ascontiguousarray(q, dtype=np.float32)  # (r, d)
    qq = np.ascontiguousarray(qq, dtype=np.float32)  # (r, p)
    r, n = own.shape[0], cl.assign.shape[0]
    args = _cluster_args(cl, q, qq, exact, max_clusters, width)
    if own.ndim != 2 or q.shape[0] != r:
        raise ValueError(f"own (r, w) and q (r, d) expected, got {own.shape} and {q.shape}")
    if own.size and (int(own.max()) >= n or int(own.min()) < -1):
        raise ValueError(f"ids must be in [0, {n}) or -1, got [{int(own.min())}, {int(own.max())}]")
    dist = np.full((r, width), np.inf, dtype=np.float32)  # (r, width)
    ids = np.full((r, width), -1, dtype=np.int64)
    vals = np.full((r, width), -1, dtype=np.int32)
    count = np.zeros(r, dtype=np.int64)  # (r,)
    if r and own.shape[1] and lib.extend_sketched(r, own.ctypes.data, own.shape[1], q.ctypes.data, qq.ctypes.data,
                                                  *args, dist.ctypes.data, ids.ctypes.data, vals.ctypes.data,
                                                  count.ctypes.data):
        raise MemoryError("extend_sketched could not allocate its buffers")
    return dist, ids, vals, count


class CandidateBlock(NamedTuple):
    """The walk's candidates of S streams in place (memlm.jobs.pointer_walk), each row's candidates first and
    inf / -1 / -1 after them: what walk_step reads and writes."""

    ids: np.ndarray  # (S, W) int64
    dist: np.ndarray  # (S, W) float32
    vals: np.ndarray  # (S, W) int32
    count: np.ndarray  # (S,) int64 candidates each row holds


def walk_step(block: CandidateBlock, rows: np.ndarray, prev_targets: np.ndarray, fresh: np.ndarray,
              min_pointers: int, next_ids: np.ndarray, q: np.ndarray, qq: np.ndarray, cl: ClusterArrays, exact: int,
              max_clusters: int | None, width: int, lib: ctypes.CDLL | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One step of RetoMaton's walk over clustered states with a KeySketch in compiled code, in place on `block`:
    the streams in block rows `rows` (m,) follow their candidates whose value is prev_targets (m,) (the token that
    came next) to their successors next_ids (N,) int64 (memlm.retrieval.pointers.follow's rule); those with fewer
    than min_pointers, or fresh (m,) bool (a stream's first token), need a search and are left as they are; the
    others are extended by extend_by_clusters' rule (q (m, d), qq (m, p) as extend_sketched's) into their rows
    (at most `width` <= W). Returns need (m,) bool and scored (m,) int64: how many of a row's kept candidates
    have a distance (they come first; 0 where it needs a search). The block's ids must be datastore rows."""
    lib = _library(lib)
    q = np.ascontiguousarray(q, dtype=np.float32)  # (m, d)
    qq = np.ascontiguousarray(qq, dtype=np.float32)  # (m, p)
    rows = np.ascontiguousarray(rows, dtype=np.int64)  # (m,)
    targets = np.ascontiguousarray(prev_targets, dtype=np.int32)  # (m,)
    first = np.ascontiguousarray(fresh, dtype=np.uint8)  # (m,)
    args = _cluster_args(cl, q, qq, exact, max_clusters, width)
    s, w = block.ids.shape
    m = rows.shape[0]
    if q.shape[0] != m or targets.shape != (m,) or first.shape != (m,) or width > w:
        raise ValueError(f"rows, prev_targets, fresh and q must have {m} rows, and width <= {w}")
    if next_ids.shape != cl.assign.shape or next_ids.dtype != np.int64 or not next_ids.flags.c_contiguous:
        raise ValueError(f"next_ids must be C-contiguous ({cl.assign.shape[0]},) int64")
    for a, dtype in zip(block, (np.int64, np.float32, np.int32, np.int64)):
        if a.dtype != dtype or not a.flags.c_contiguous or not a.flags.writeable or a.shape[0] != s:
            raise ValueError(f"the block must be writeable C-contiguous arrays of {s} rows ({dtype})")
    if m and (int(rows.min()) < 0 or int(rows.max()) >= s):
        raise ValueError(f"rows must be in [0, {s})")
    need = np.zeros(m, dtype=np.uint8)  # (m,)
    scored = np.zeros(m, dtype=np.int64)
    if m and lib.walk_step(m, rows.ctypes.data, targets.ctypes.data, first.ctypes.data, min_pointers,
                           next_ids.ctypes.data, block.ids.ctypes.data, block.dist.ctypes.data,
                           block.vals.ctypes.data, block.count.ctypes.data, w, q.ctypes.data, qq.ctypes.data, *args,
                           need.ctypes.data, scored.ctypes.data):
        raise MemoryError("walk_step could not allocate its buffers")
    return need.astype(bool), scored
