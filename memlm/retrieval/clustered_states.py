"""Clustered states for RetoMaton's walk (Alon et al. 2022, section 3.2; retomaton.py
`extend_pointers_using_clusters`): the datastore's keys clustered by k-means
(`cluster_states`), held in cluster order (`StateClusters`), optionally with a `KeySketch` of their top
principal components, and the scoring pieces memlm.retrieval.pointers.extend_by_clusters builds a row's
extension from: every member of a row's clusters given a unique int64 key, its ranking score's order bits
above its place in cluster order (`rank_keys`, one matmul per cluster against every row asking for it, the
rows' members one after another in one flat array), each row's best by an in-place partition and a sort of
those keys (`lowest_keys`: ties by place, whatever else is in the call, with no padded matrix and no tie
repair), and exact float32 distances for those the sketch path scores (`exact_member_distances`, one faiss
call), the same members in the same order as the padded float matrix and torch.topk they replaced
(tests/memlm/retrieval/test_clustered_order.py: a row-by-row oracle, element for element).

Shape legend: N datastore entries, d key dimension, C clusters, r rows extended, p sketch components,
T the members of all rows of a call, t members a row keeps at most, e scored members of a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from memlm.errors import MemlmError


class KeySketch(NamedTuple):
    """A cheap stand-in for the stored keys that ranks cluster members before their exact distances are
    computed (extend_by_clusters): the keys' top p principal directions. For a query q and a key x,
    ||q - x||^2 = ||x - mean||^2 - 2 (x - mean).(q - mean) + ||q - mean||^2 exactly; the sketch keeps the
    first term exactly (centred_norms), the second only on the basis (its part outside the p directions is
    dropped: the approximation), and the third is the same for all of a query's members, so it is left out."""

    mean: torch.Tensor  # (d,) float32 mean key
    basis: torch.Tensor  # (d, p) float32 orthonormal: the covariance's top p eigenvectors
    codes: torch.Tensor  # (N, p) float32 (x - mean) @ basis rounded to float16 values, in StateClusters.members order
    centred_norms: torch.Tensor  # (N,) float32 ||x - mean||^2, in members order
    exact_members: int  # the best members by the ranking that get exact distances (the others: followed only)
    max_clusters: int | None = None
    """Clusters a row ranks the members of at most: the nearest to its query by centroid (StateClusters.
    centroids; ties by cluster), its own candidates in the others still kept (ranked first as ever); None:
    all of its own candidates' clusters. Fewer members ranked, and the nearest members mostly lie in the
    nearest clusters (208K SOTU, 50 clusters: the 3 nearest of a pointed row's ~6.7 hold 46% of its members
    and 92% of those it keeps)."""

    def project(self, q: torch.Tensor) -> torch.Tensor:
        """(r, p) float32 (q - mean) @ basis of queries q (r, d): what a row's sketch scores are formed from."""
        return (q - self.mean) @ self.basis


EXACT_MEMBERS = 1024
"""Members of a row scored exactly by default, the best by a KeySketch's ranking (extend_by_clusters): with
fewer the kNN distribution loses weight that counts (over 600 of the SOTU demo's searches, the 1024 nearest
beyond the 256th hold 17.5% of p_kNN's mass on average at T 2.18; with 50 clusters keeping 4,096, 256 scored
exactly gave +0.85% perplexity against +0.51% with 1,024)."""


def key_sketch(keys: torch.Tensor, dims: int, exact_members: int = EXACT_MEMBERS,
               max_clusters: int | None = None) -> KeySketch:
    """The KeySketch of (N, d) float32 keys with the top `dims` (< d) principal directions."""
    if exact_members < 1:
        raise MemlmError(f"exact_members must be at least 1, got {exact_members}")
    if max_clusters is not None and max_clusters < 1:
        raise MemlmError(f"max_clusters must be at least 1, got {max_clusters}")
    mean = keys.mean(dim=0)  # (d,)
    centred = keys - mean  # (N, d)
    cov = (centred.T @ centred).double()  # (d, d)
    basis = torch.linalg.eigh(cov).eigenvectors[:, -dims:].flip(1).float().contiguous()  # (d, p) largest first
    # (N, p) values rounded to float16 (clipped to its finite range): the sketch is an approximation, and its
    # ranking stays that of a float16 copy, should the codes be stored at half the bytes
    f16 = torch.finfo(torch.float16).max
    codes = (centred @ basis).clamp(-f16, f16).half().float().contiguous()
    return KeySketch(mean, basis, codes, centred.pow(2).sum(dim=1), exact_members, max_clusters)


@dataclass(frozen=True)
class StateClusters:
    """A k-means clustering of the datastore's keys (`cluster_states`): entries of one cluster share
    pointers (RetoMaton's clustered states)."""

    assign: np.ndarray
    """(N,) int64 cluster of each entry."""
    members: np.ndarray
    """(N,) int64 entry ids ordered by cluster: cluster c's members are members[offsets[c]:offsets[c + 1]]."""
    offsets: np.ndarray
    """(C + 1,) int64 start of each cluster in `members`."""
    stored_keys: np.ndarray
    """(N, d) the keys in `members` order as stored, C-contiguous (float16 from a datastore): a cluster's keys are
    one contiguous block."""
    centroids: torch.Tensor
    """(C, d) float32 mean key of each cluster (zeros for an empty one, which no row asks for)."""
    seed: int
    """k-means seed, for the record."""
    sketch: KeySketch | None = None
    """Ranks the members before their exact distances (extend_by_clusters); None: every member of a row's
    clusters is scored exactly (a walk then reads every such member's d floats: slow with few, large clusters)."""

    @property
    def n_clusters(self) -> int:
        return self.offsets.shape[0] - 1

    @cached_property
    def places(self) -> np.ndarray:
        """(N,) int64 0..N-1: the members' places in `members` (the low bits of rank_keys' keys)."""
        return np.arange(self.members.shape[0], dtype=np.int64)

    @cached_property
    def member_keys(self) -> torch.Tensor:
        """(N, d) float32 stored_keys, made on first use: float32 stored keys shared, float16 ones converted once
        (N * d * 4 bytes more: 480 MB on the 208K SOTU datastore), read by rank_keys' exact scores (no sketch) and
        exact_member_distances' faiss call."""
        return torch.from_numpy(self.stored_keys.astype(np.float32, copy=False))

    @cached_property
    def member_norms(self) -> torch.Tensor:
        """(N,) float32 squared norms of member_keys."""
        return self.member_keys.pow(2).sum(dim=1)

    @cached_property
    def position(self) -> np.ndarray:
        """(N,) int64 each entry's place in `members` (members[position[i]] == i)."""
        out = np.empty_like(self.members)  # (N,)
        out[self.members] = np.arange(self.members.shape[0])
        return out


CLUSTER_ITERATIONS = 10
"""k-means iterations of cluster_states (faiss.Kmeans' default 25 moves the SOTU clusters little after 10)."""
CLUSTER_SAMPLE = 64
"""Training points per centroid k-means reads at most (faiss' max_points_per_centroid)."""


def cluster_states(keys: np.ndarray, n_clusters: int, seed: int = 0, sketch_dims: int = 0,
                   exact_members: int = EXACT_MEMBERS, max_clusters: int | None = None) -> StateClusters:
    """k-means (faiss, squared L2) of the (N, d) stored keys into n_clusters (at most N) clusters, with a
    KeySketch of sketch_dims principal components keeping exact_members a row and ranking the members of at
    most max_clusters of a row's clusters (KeySketch.max_clusters; sketch_dims 0, or at least d: none, every
    member scored exactly)."""
    import faiss

    n = keys.shape[0]
    if not 1 <= n_clusters <= n:
        raise MemlmError(f"--pointer-clusters must be in [1, {n}] (the datastore's entries), got {n_clusters}")
    x = np.ascontiguousarray(keys, dtype=np.float32)  # (N, d)
    km = faiss.Kmeans(x.shape[1], n_clusters, niter=CLUSTER_ITERATIONS, seed=seed,
                      max_points_per_centroid=CLUSTER_SAMPLE, verbose=False)
    km.train(x)
    assign = km.index.search(x, 1)[1][:, 0]  # (N,)
    del x, km  # k-means' float32 copy; the clusters keep the keys as stored (float16 from a datastore: half the bytes)
    return clusters_of(assign, keys, n_clusters, seed, sketch_dims, exact_members, max_clusters)


def clusters_of(assign: np.ndarray, keys: np.ndarray, n_clusters: int, seed: int, sketch_dims: int = 0,
                exact_members: int = EXACT_MEMBERS, max_clusters: int | None = None) -> StateClusters:
    """StateClusters of a given assignment (N,) in [0, n_clusters) of the (N, d) keys, with a KeySketch of
    sketch_dims components keeping exact_members a row over at most max_clusters of its clusters (sketch_dims
    0, or at least d: none)."""
    assign = np.asarray(assign, dtype=np.int64)
    members = np.argsort(assign, kind="stable")  # (N,)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(assign, minlength=n_clusters))]).astype(np.int64)
    gathered = np.ascontiguousarray(keys[members])  # (N, d) as stored
    float_keys = torch.from_numpy(gathered.astype(np.float32, copy=False))  # (N, d) a temporary for float16 keys
    sketch = (key_sketch(float_keys, sketch_dims, exact_members, max_clusters)
              if 0 < sketch_dims < float_keys.shape[1] else None)
    return StateClusters(assign, members, offsets, gathered, cluster_means(float_keys, offsets), seed, sketch)


def cluster_means(keys: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    """(C, d) float32 mean of each cluster's keys (keys (N, d) in cluster order, cluster c's at offsets[c]:
    offsets[c + 1]); zeros for an empty cluster."""
    counts = np.diff(offsets)  # (C,)
    of = torch.from_numpy(np.repeat(np.arange(counts.shape[0]), counts))  # (N,) each member's cluster
    sums = torch.zeros(counts.shape[0], keys.shape[1]).index_add_(0, of, keys.float())  # (C, d)
    return sums / torch.from_numpy(counts).clamp(min=1).float()[:, None]


PAD_KEY = np.iinfo(np.int64).max
"""rank_keys' key past a row's members: above every member's (a float32 score's order bits are < 2^31 - 1)."""


def order_bits(score: np.ndarray, in_place: bool = False) -> np.ndarray:
    """int32 of the same shape whose signed order is float32 `score`'s (no nan): -0.0 and 0.0 both 0, as they
    compare equal (so that they tie, and the tie goes by member place). in_place: reuse score's memory."""
    b = np.add(score, np.float32(0.0), out=score if in_place else None).view(np.int32)  # -0.0 + 0.0 == +0.0
    flip = b >> 31  # (..) -1 where negative
    flip &= np.int32(0x7FFFFFFF)
    b ^= flip  # negatives: magnitude bits flipped, so more negative is lower
    return b


def placed_keys(score: np.ndarray, places: np.ndarray, in_place: bool = False) -> np.ndarray:
    """int64 keys order_bits(score) << 32 | places (broadcast against score): unique per place, so sorting or
    partitioning them orders by (score, place), ties by place. in_place: order_bits may reuse score's memory."""
    key = order_bits(score, in_place).astype(np.int64)
    key <<= 32
    key |= places
    return key


PLACE_MASK = (1 << 32) - 1
"""The low 32 bits of a rank_keys key: the member's place in StateClusters.members (N < 2^32)."""
OWN_KEY = np.int64(order_bits(np.array([-np.inf], np.float32))[0]) << 32
"""A rank_keys key's high part for a score of -inf: OWN_KEY | place ranks a member before every scored one."""


def score_of(key: np.ndarray) -> np.ndarray:
    """The float32 score of rank_keys' int64 keys (order_bits inverted; PAD_KEY gives nan)."""
    t = (key >> 32).astype(np.int32)
    return (t ^ ((t >> 31) & np.int32(0x7FFFFFFF))).view(np.float32)


def nearest_pairs(q: torch.Tensor, p_row: np.ndarray, p_cl: np.ndarray, cl: StateClusters, most: int) -> np.ndarray:
    """(p,) bool: the (row, cluster) pairs (p_row, p_cl) (p,) kept when each row keeps its `most` clusters
    nearest to its query q (r, d) by squared L2 to StateClusters.centroids, ties by cluster."""
    c = cl.centroids[torch.from_numpy(p_cl)]  # (p, d)
    dist = (q[torch.from_numpy(p_row)] - c).pow(2).sum(dim=1).numpy()  # (p,)
    order = np.lexsort((p_cl, dist, p_row))  # (p,) by row, then distance, then cluster
    counts = np.bincount(p_row, minlength=q.shape[0])  # (r,)
    rank = np.empty(p_row.shape[0], dtype=np.int64)
    rank[order] = np.arange(order.shape[0]) - np.repeat(np.cumsum(counts) - counts, counts)
    return rank < most


def rank_keys(q: torch.Tensor, p_row: np.ndarray, p_cl: np.ndarray, cl: StateClusters,
              starts: np.ndarray | None = None, length: int | None = None) -> np.ndarray:
    """(T,) int64 sort keys of every member of the (row, cluster) pairs (p_row, p_cl) (p,) for the rows'
    queries q (r, d), the pairs' members one after another in pair order (T: their clusters' sizes summed;
    or each pair's from starts (p,) in an array of `length`, the caller filling the rest):
    order_bits(score) << 32 | the member's place in cl.members. The score is the exact squared L2 without a
    sketch, the sketch's estimate (minus the row's constant) with one. Sorting keys orders members by
    (score, place), and keys are unique, so any selection of the lowest (a partition) is the stable one,
    whatever else is in the call. One matmul per cluster in the call: the members of cluster c (contiguous in
    cl.members) against every row that asked for c."""
    sk = cl.sketch
    if sk is None:
        block, norms, qq, qn = cl.member_keys, cl.member_norms, q, q.pow(2).sum(dim=1)  # (N, d), (N,), (r, d), (r,)
    else:  # (x - mean) . (q - mean) ~ its part on the basis; ||q - mean||^2 is the row's constant, left out
        block, norms = sk.codes, sk.centred_norms  # (N, p), (N,)
        qq, qn = sk.project(q), None  # (r, p)
    sizes = cl.offsets[p_cl + 1] - cl.offsets[p_cl]  # (p,)
    starts = np.asarray(np.cumsum(sizes) - sizes if starts is None else starts, dtype=np.int64)  # (p,) first keys
    out = np.empty(int(sizes.sum()) if length is None else length, dtype=np.int64)  # (T,)
    by_cluster = np.argsort(p_cl, kind="stable")  # (p,)
    cuts = np.flatnonzero(np.diff(p_cl[by_cluster])) + 1
    for group in np.split(by_cluster, cuts):  # the pairs of one cluster
        c = int(p_cl[group[0]])
        lo, hi = int(cl.offsets[c]), int(cl.offsets[c + 1])
        g_rows = torch.from_numpy(p_row[group])  # (g,)
        d = torch.addmm(norms[None, lo:hi], qq[g_rows], block[lo:hi].T, alpha=-2.0)  # (g, s)
        if qn is not None:
            d += qn[g_rows][:, None]
        bits = order_bits(d.numpy(), in_place=True)  # (g, s) int32
        places = cl.places[lo:hi]  # (s,)
        for j, pair in enumerate(group.tolist()):  # placed_keys written where the pair's keys go: no (g, s) copy
            key = out[int(starts[pair]) : int(starts[pair]) + hi - lo]  # (s,) a view
            np.left_shift(bits[j], 32, out=key, dtype=np.int64)
            key |= places
    return out


def stable_argsort(values: np.ndarray) -> np.ndarray:
    """(r, e) int64 np.argsort(values, axis=1, kind="stable") of float32 values (r, e) without nan, by one
    sort of unique int64 (order_bits, column) keys (numpy's stable float sort is a merge sort, several times
    slower than its int64 sort)."""
    keys = placed_keys(values, np.arange(values.shape[1], dtype=np.int64))  # (r, e)
    keys.sort(axis=1)
    return keys & PLACE_MASK


def lowest_keys(keys: np.ndarray, bounds: np.ndarray, takes: np.ndarray) -> np.ndarray:
    """(r, t) int64 the takes[i] (takes (r,), t their most) lowest of row i's rank_keys keys, keys[bounds[i]:
    bounds[i + 1]] (keys (T,), bounds (r + 1,)), lowest first: its members by (score, place), PAD_KEY after
    them (all of a row's keys if fewer). The keys are unique, so a partition picks what a stable sort would.
    May reorder `keys` in place."""
    out = np.full((takes.shape[0], int(takes.max(initial=0))), PAD_KEY, dtype=np.int64)  # (r, t)
    for i, (lo, hi, take) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist(), takes.tolist())):
        row = keys[lo:hi]  # (h,) a view: partitioned and sorted in place
        t = min(take, hi - lo)
        if t < hi - lo:
            row.partition(t - 1)
        head = row[:t]
        head.sort()
        out[i, :t] = head
    return out


def exact_member_distances(q: torch.Tensor, pos: np.ndarray, counts: np.ndarray, cl: StateClusters) -> np.ndarray:
    """(r, e) float32 squared L2 ||q - x||^2 of the first counts[i] (counts (r,)) members at places pos (r, e)
    of cl.members in each row i, to the rows' queries q (r, d), inf after them: by faiss' fvec_L2sqr_by_idx over
    the float32 member_keys, each key read once where it lies (a gather of the keys and a matrix-vector product per
    row, numpy's fastest, read them twice: 1.7x slower on the 81K SOTU datastore)."""
    import faiss

    at = np.where(np.arange(pos.shape[1])[None, :] < counts[:, None], pos, -1).astype(np.int64)  # (r, e) -1: none
    qs = np.ascontiguousarray(q.numpy(), dtype=np.float32)  # (r, d)
    keys = cl.member_keys.numpy()  # (N, d) C-contiguous float32
    out = np.empty(at.shape, dtype=np.float32)  # (r, e)
    faiss.fvec_L2sqr_by_idx(faiss.swig_ptr(out), faiss.swig_ptr(qs), faiss.swig_ptr(keys), faiss.swig_ptr(at),
                            keys.shape[1], at.shape[0], at.shape[1])  # inf where at is -1
    return out
