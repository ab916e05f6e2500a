"""The C source of memlm.retrieval.by_id_kernels' library, its second part: RetoMaton's clustered extension with a
KeySketch (`extend_rows`, exported as `extend_sketched`) and the walk's compiled step (`walk_step`: follow, the
minimum check, the extension, in place on the walk's block), over memlm.retrieval.by_id_source's helpers. Their
Python side is memlm.retrieval.walk_step."""

WALK_STEP_C = r"""
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

#define PLACE_BITS 0xffffffffLL
#define BLOCK 16 /* members a sketch block holds: blocks (ceil(N / 16), p, 16) float16, member m at [m / 16][:][m % 16] */

#define GROUP 8 /* rows scored together against each sketch block: its codes are converted once for all */

/* acc[r * BLOCK + l] = w[r] . code of the block's member l (blk: p x BLOCK float16), for R rows (R <= GROUP), the
   components summed in order: the same for a row whatever R is, so a row's scores do not depend on the call. */
static inline __attribute__((always_inline)) void score_block(const uint16_t *blk, int64_t p, const float *const *w,
                                                              int R, float *acc) {
#ifdef VECTOR
    __m512 sum[GROUP];
    for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < p; j++) {
        __m512 code = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + j * BLOCK)));
        for (int r = 0; r < R; r++) sum[r] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][j]), code, sum[r]);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * BLOCK, sum[r]);
#else
    for (int r = 0; r < R; r++)
        for (int l = 0; l < BLOCK; l++) acc[r * BLOCK + l] = 0.0f;
    for (int64_t j = 0; j < p; j++)
        for (int l = 0; l < BLOCK; l++) {
            float code = half_to_float(blk[j * BLOCK + l]);
            for (int r = 0; r < R; r++) acc[r * BLOCK + l] += w[r][j] * code;
        }
#endif
}

/* keybuf[base[r] + m - lo] = placed_key(norms[m] - 2 w[r] . code[m], m) for the members lo <= m < hi of one
   cluster and R rows; the score made finite, so that only the own keys sort at -inf. */
static inline __attribute__((always_inline)) void score_group(const uint16_t *blocks, int64_t p, int64_t lo,
                                                              int64_t hi, const float *norms, const float *const *w,
                                                              const int64_t *base, int R, int64_t *keybuf) {
    float acc[GROUP * BLOCK];
    for (int64_t b = lo / BLOCK; b * BLOCK < hi; b++) {
        score_block(blocks + b * p * BLOCK, p, w, R, acc);
        int64_t m0 = b * BLOCK < lo ? lo : b * BLOCK, m1 = (b + 1) * BLOCK > hi ? hi : (b + 1) * BLOCK;
        for (int r = 0; r < R; r++)
            for (int64_t m = m0; m < m1; m++) {
                float score = norms[m] + -2.0f * acc[r * BLOCK + m - b * BLOCK];
                score = score != score ? INFINITY : score < -FLT_MAX ? -FLT_MAX : score;
                keybuf[base[r] + m - lo] = placed_key(score, m);
            }
    }
}

/* score_group for g (<= GROUP) rows, in groups of 8, 4, 2 and 1 (each compiled for its R). */
static void score_rows(const uint16_t *blocks, int64_t p, int64_t lo, int64_t hi, const float *norms,
                       const float *const *w, const int64_t *base, int64_t g, int64_t *keybuf) {
    for (int R = GROUP; R >= 1; R /= 2)
        for (; g >= R; g -= R, w += R, base += R) {
            if (R == 8) score_group(blocks, p, lo, hi, norms, w, base, 8, keybuf);
            else if (R == 4) score_group(blocks, p, lo, hi, norms, w, base, 4, keybuf);
            else if (R == 2) score_group(blocks, p, lo, hi, norms, w, base, 2, keybuf);
            else score_group(blocks, p, lo, hi, norms, w, base, 1, keybuf);
        }
}

/* One row's (row, cluster) pair: its keys for the cluster's members start at keys[start]. */
typedef struct { int64_t row, cluster, start; } Pair;

/* The clustered states and their KeySketch as the extension reads them (walk_step.ClusterArrays). */
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
    for (int64_t a = 0; a < n_pairs;) {  /* the pairs of one cluster, GROUP rows at a time */
        int64_t c = pairs[by_cluster[a]].cluster, g = 0, base[GROUP];
        const float *w[GROUP];
        while (a < n_pairs && g < GROUP && pairs[by_cluster[a]].cluster == c) {
            const Pair *pr = pairs + by_cluster[a++];
            w[g] = qq + (sel ? sel[pr->row] : pr->row) * p;
            base[g++] = row_start[pr->row] + pr->start;
        }
        score_rows(blocks, p, offsets[c], offsets[c + 1], norms, w, base, g, keybuf);
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
           the scored: the own and the e - own lowest others, sorted. A strided sample's bound keeps about 1.25 t
           of the row's keys in one pass, in order, and the selections read only those */
        int64_t own_high = placed_key(-INFINITY, 0) >> 32, own_top = (int64_t)((uint64_t)own_high << 32) | PLACE_BITS;
        int64_t c = under_sampled_bound(row, h, t, buf), kth = own_top, eth = own_top;
        if (t > n_own) {
            int64_t others = 0;
            for (int64_t j = 0; j < c; j++) {
                tmp[others] = buf[j];
                others += buf[j] > own_top;
            }
            kth = select_key(tmp, others, t - n_own, tmp + c);
        }
        int64_t n = 0;
        for (int64_t j = 0; j < c; j++) {  /* in place: n <= j */
            buf[n] = buf[j];
            n += buf[j] <= kth;
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
            tmp[j] = (int64_t)(((uint64_t)buf[j] & PLACE_BITS) << 32 | (uint64_t)j);
        }
        radix_sort_u64((uint64_t *)tmp, (uint64_t *)(tmp + e), e, 0, 0);
        for (int64_t j = 0; j < e; j++) {
            int64_t ahead = j + AHEAD < e ? (int64_t)((uint64_t)tmp[j + AHEAD] >> 32) : -1;
            int64_t m = (int64_t)((uint64_t)tmp[j] >> 32);
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
   pointer_walk: ids, dist, vals (S, block_width), count (S,) the columns in use, -1 past them): mover i (block row
   rows[i]) follows its candidates whose value is prev_targets[i] to their successors (next_ids; -1: none), its own
   candidates (memlm.retrieval.pointers.follow's rule). need[i] = 1 where it is fresh[i] (a stream's first token)
   or fewer than min_pointers survive: its block row is left as it is (the caller searches it, or empties it).
   The others are extended (extend_rows, their queries q[i] and qq[i]) into their block rows, scored[i] = how many
   of the kept have a distance (0 where need[i]). Returns 0; -1 if out of memory; -2 if a block row, or the
   successor of one of its ids, holds an id outside [-1, entries) (nothing written). */
int walk_step(int64_t movers, const int64_t *rows, const int32_t *prev_targets, const uint8_t *fresh,
              int64_t min_pointers, const int64_t *next_ids, int64_t entries, int64_t *block_ids, float *block_dist,
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
    int64_t *ext_scored = calloc((size_t)(movers + 1), sizeof(int64_t));
    int status = -1;
    if (!own || !sel || !out_rows || !ext_scored) goto done;
    int64_t extended = 0;
    for (int64_t i = 0; i < movers; i++) {
        const int64_t *ids = block_ids + rows[i] * block_width;
        const int32_t *vals = block_vals + rows[i] * block_width;
        int64_t *mine = own + i * own_width, n = 0;
        if (!fresh[i])
            for (int64_t j = 0; j < block_count[rows[i]]; j++) {
                if (ids[j] < -1 || ids[j] >= entries) { status = -2; goto done; }
                int64_t next = ids[j] >= 0 && vals[j] == prev_targets[i] ? next_ids[ids[j]] : -1;
                if (next < -1 || next >= entries) { status = -2; goto done; }
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
"""
