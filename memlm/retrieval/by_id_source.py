"""The C source of memlm.retrieval.by_id_kernels' library, its first part: half-to-float conversion, squared L2 over
float16 and float32 keys read by id (`l2_by_id_f16`, `l2_by_id_f32`), Hoare's selection and the radix sort
(memlm.compiled.RADIX_SORT_C) of int64 keys, each row's lowest keys (`lowest_keys_into`) and the sort keys of a
score and a place (`placed_key`, `placed_keys_into`). memlm.retrieval.walk_step_source's part uses these."""

BY_ID_C = r"""
#include <float.h>
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

/* buf[0 .. c) = the keys of row[0 .. h) (unique) at or under a bound that holds at least the t (<= h) lowest, in
   row order; returns c: a strided sample's order statistic bounds the row (c about 1.25 t; every key when the
   sample is too short or its bound leaves fewer than t). buf holds h. */
static int64_t under_sampled_bound(const int64_t *row, int64_t h, int64_t t, int64_t *buf) {
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
    return c;
}

/* buf[0 .. t) = the t (1 <= t <= h) lowest of row[0 .. h) (unique keys), lowest first. buf and tmp hold h. */
static void lowest_sorted(const int64_t *row, int64_t h, int64_t t, int64_t *buf, int64_t *tmp) {
    int64_t c = under_sampled_bound(row, h, t, buf);
    radix_sort_u64((uint64_t *)buf, (uint64_t *)tmp, c, 0, (uint64_t)1 << 63);  /* signed order */
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

"""
