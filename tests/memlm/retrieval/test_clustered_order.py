"""The clustered walk's extension (memlm.retrieval.pointers.extend_by_clusters over
memlm.retrieval.clustered_states' rank_keys / lowest_keys / exact_member_distances) against a row-by-row oracle
written from its docstring, compared element for element: the same members, in the same order, at the same
distances. Integer keys and an axis-aligned KeySketch make every score exact in float32 and tie often, so
a selection that breaks ties other than by member place, drops a row's own candidate, scores the wrong
prefix exactly or orders the followed-only members differently fails here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from memlm.retrieval.clustered_states import KeySketch, StateClusters, clusters_of
from memlm.retrieval.pointers import PointerSource, extend_by_clusters
from memlm.retrieval.searcher import Neighbors

N, D, C, P = 400, 6, 9, 2


def integer_store(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N, D) float16 keys of small integers (many duplicates), (N,) values, (N,) uneven cluster assignment."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(-2, 3, size=(N, D)).astype(np.float16)
    values = rng.integers(0, 11, size=N).astype(np.int32)
    assign = np.minimum(rng.geometric(0.3, size=N) - 1, C - 1)  # cluster 0 large, the last ones small
    return keys, values, assign


def axis_sketch(cl: StateClusters, exact_members: int) -> KeySketch:
    """A KeySketch on the first P axes, centred at 0: its scores ||x||^2 - 2 x[:P].q[:P] are integers."""
    keys = cl.member_keys  # (N, D) in members order
    basis = torch.eye(D)[:, :P].contiguous()  # (D, P)
    return KeySketch(torch.zeros(D), basis, (keys @ basis).contiguous(), keys.pow(2).sum(dim=1), exact_members)


def oracle_row(own: np.ndarray, q: np.ndarray, cl: StateClusters, keys: np.ndarray, width: int) -> list[tuple]:
    """(id, distance) of the members one row keeps, in order, from the extension's docstring: every member of
    the own candidates' clusters, ranked by (score, place in cl.members), the own first with a sketch; the best
    max(width, own) (all of them if fewer); with a sketch the first max(exact_members, own) of the ranking
    get exact distances and come first, nearest first (ties: ranking order), the others after them at inf,
    in place order; then cut to `width`."""
    clusters = np.unique(cl.assign[own])
    sk = cl.sketch
    if sk is not None and sk.max_clusters is not None:  # the nearest by centroid (mean key), ties by cluster
        dist = [((keys[cl.assign == c].astype(np.float64).mean(axis=0) - q) ** 2).sum() for c in clusters]
        clusters = clusters[np.lexsort((clusters, dist))[: sk.max_clusters]]
    members = np.concatenate([cl.members[cl.offsets[c] : cl.offsets[c + 1]] for c in clusters])
    members = np.union1d(members, own)  # the own candidates in the other clusters too (by id: order is by place)
    place = cl.position[members]
    x = keys[members].astype(np.float64)
    exact = ((x - q) ** 2).sum(axis=1)
    if sk is None:
        score = exact
        take = min(len(members), width)
    else:
        score = (x**2).sum(axis=1) - 2.0 * x[:, :P] @ q[:P]
        score[np.isin(members, own)] = -np.inf
        take = min(len(members), max(width, len(own)))
    rank = np.lexsort((place, score))[:take]  # by score, ties by place
    if sk is None:
        kept = [(members[i], exact[i]) for i in rank]
    else:
        n_scored = min(take, max(sk.exact_members, len(own)))
        scored = sorted(range(n_scored), key=lambda j: (exact[rank[j]], j))
        kept = [(members[rank[j]], exact[rank[j]]) for j in scored]
        kept += [(members[i], np.inf) for i in sorted(rank[n_scored:], key=lambda i: place[i])]
    return kept[:width]


def candidate_rows(rng: np.random.Generator, cl: StateClusters) -> np.ndarray:
    """(7, 60) ids -1 padded: rows of 1 to 60 distinct candidates, row 3 none (not extended); row 5 one
    whole small cluster and a few others (more own candidates than a narrow width)."""
    out = np.full((7, 60), -1, dtype=np.int64)
    for i, n in enumerate([1, 5, 60, 0, 12, 0, 30]):
        out[i, :n] = rng.choice(N, size=n, replace=False)
    last = cl.members[cl.offsets[C - 2] : cl.offsets[C]][:50]  # the two smallest clusters' members
    out[5, : last.size] = last
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sketch_exact", [None, 1, 7, 40, 10_000])
@pytest.mark.parametrize("width", [1, 6, 45, 10_000])
def test_extension_equals_a_row_by_row_oracle(seed, sketch_exact, width):
    keys, values, assign = integer_store(seed)
    cl = clusters_of(assign, keys, C, seed=0)
    if sketch_exact is not None:
        cl = dataclasses.replace(cl, sketch=axis_sketch(cl, sketch_exact))
    source = PointerSource.local(np.full(N, -1), values, keys, cl)
    rng = np.random.default_rng(100 + seed)
    ids = candidate_rows(rng, cl)
    cands = Neighbors(np.where(ids >= 0, 0.0, np.inf).astype(np.float32), ids,
                      np.where(ids >= 0, values[np.maximum(ids, 0)], -1).astype(np.int32))
    xq = rng.integers(-2, 3, size=(7, D)).astype(np.float32)
    rows = np.flatnonzero((ids >= 0).any(axis=1))
    got = extend_by_clusters(cands, rows, xq, source, width)
    for i in range(7):
        live = got.ids[i] >= 0
        assert not live[live.sum():].any()  # the kept first, then missing entries
        if i not in rows:  # as it was
            np.testing.assert_array_equal(got.ids[i][: ids.shape[1]], ids[i])
            continue
        want = oracle_row(ids[i][ids[i] >= 0], xq[i].astype(np.float64), cl, keys, width)
        assert got.ids[i][live].tolist() == [m for m, _ in want]
        np.testing.assert_array_equal(got.distances[i][live], np.array([d for _, d in want], np.float32))
        np.testing.assert_array_equal(got.values[i][live], values[got.ids[i][live]])
        assert np.isinf(got.distances[i][~live]).all() and (got.values[i][~live] == -1).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("max_clusters", [1, 2, C])
@pytest.mark.parametrize("sketch_exact", [1, 40, 10_000])
@pytest.mark.parametrize("width", [6, 45, 10_000])
def test_extension_over_the_nearest_clusters_equals_the_oracle(seed, max_clusters, sketch_exact, width):
    """KeySketch.max_clusters: a row ranks the members of its nearest clusters only, its own candidates in
    the others kept first all the same (rows 2 and 6 hold candidates of many clusters)."""
    keys, values, assign = integer_store(seed)
    cl = clusters_of(assign, keys, C, seed=0)
    cl = dataclasses.replace(cl, sketch=axis_sketch(cl, sketch_exact)._replace(max_clusters=max_clusters))
    source = PointerSource.local(np.full(N, -1), values, keys, cl)
    rng = np.random.default_rng(200 + seed)
    ids = candidate_rows(rng, cl)
    cands = Neighbors(np.zeros(ids.shape, np.float32), ids, np.where(ids >= 0, values[np.maximum(ids, 0)], -1))
    xq = rng.normal(0.0, 1.5, size=(7, D)).astype(np.float32)  # real-valued: no ties between cluster distances
    rows = np.flatnonzero((ids >= 0).any(axis=1))
    got = extend_by_clusters(cands, rows, xq, source, width)
    for i in rows:
        live = got.ids[i] >= 0
        want = oracle_row(ids[i][ids[i] >= 0], xq[i].astype(np.float64), cl, keys, width)
        assert got.ids[i][live].tolist() == [m for m, _ in want]
        np.testing.assert_allclose(got.distances[i][live], np.array([d for _, d in want], np.float32), rtol=1e-6)
        assert set(ids[i][ids[i] >= 0]) <= set(got.ids[i][live]) or width < (ids[i] >= 0).sum()


def test_a_rows_extension_is_the_same_alone_and_beside_any_rows():
    """Each row's members and order depend on its own candidates and query only (the call's other rows, and
    so how wide the call is, never change them): extended one by one = extended together. With more exact
    members than kept (25, 20) and a row with more own candidates (60) than kept: the walk before this test
    scored every row as deep as the call's widest row (its own 60), and kept the nearest of those."""
    keys, values, assign = integer_store(3)
    cl = clusters_of(assign, keys, C, seed=0)
    cl = dataclasses.replace(cl, sketch=axis_sketch(cl, 25))
    source = PointerSource.local(np.full(N, -1), values, keys, cl)
    rng = np.random.default_rng(7)
    ids = candidate_rows(rng, cl)
    cands = Neighbors(np.zeros(ids.shape, np.float32), ids, np.where(ids >= 0, values[np.maximum(ids, 0)], -1))
    xq = rng.integers(-2, 3, size=(7, D)).astype(np.float32)
    rows = np.flatnonzero((ids >= 0).any(axis=1))
    together = extend_by_clusters(cands, rows, xq, source, 20)
    for i in rows:
        alone = extend_by_clusters(cands, np.array([i]), xq, source, 20)
        n = int((alone.ids[i] >= 0).sum())
        assert n == int((together.ids[i] >= 0).sum())
        np.testing.assert_array_equal(alone.ids[i][:n], together.ids[i][:n])
        np.testing.assert_array_equal(alone.distances[i][:n], together.distances[i][:n])


def test_a_sketched_walk_over_float16_keys_reads_their_float32_copy_and_the_clusters_means():
    """A sketched walk over float16 keys extends its rows from StateClusters.member_keys, the stored keys as
    float32 (made on first use), and the centroids the nearest-cluster ranking uses are the clusters' means (a
    float64 oracle)."""
    keys, values, assign = integer_store(4)
    cl = clusters_of(assign, keys, C, seed=0, sketch_dims=P, exact_members=7, max_clusters=2)
    means = np.stack([keys[assign == c].astype(np.float64).mean(axis=0) if (assign == c).any() else np.zeros(D)
                      for c in range(C)])
    np.testing.assert_allclose(cl.centroids.numpy(), means, rtol=1e-6, atol=1e-6)
    source = PointerSource.local(np.full(N, -1), values, keys, cl)
    rng = np.random.default_rng(9)
    ids = candidate_rows(rng, cl)
    cands = Neighbors(np.zeros(ids.shape, np.float32), ids, np.where(ids >= 0, values[np.maximum(ids, 0)], -1))
    xq = rng.normal(0.0, 1.5, size=(7, D)).astype(np.float32)
    rows = np.flatnonzero((ids >= 0).any(axis=1))
    got = extend_by_clusters(cands, rows, xq, source, 20)
    assert (got.ids[rows] >= 0).any()
    assert cl.stored_keys.dtype == np.float16
    np.testing.assert_array_equal(cl.member_keys.numpy(), cl.stored_keys.astype(np.float32))  # made on demand


def test_cluster_states_keeps_float16_keys_as_stored():
    """k-means runs on a float32 copy, but the clusters keep the keys as the datastore stores them (float16: half
    the bytes), in cluster order, the same values."""
    from memlm.retrieval.clustered_states import cluster_states

    keys, _, _ = integer_store(5)
    cl = cluster_states(keys, C, sketch_dims=P, exact_members=7)
    assert cl.stored_keys.dtype == np.float16
    np.testing.assert_array_equal(cl.stored_keys, keys[cl.members])
    np.testing.assert_array_equal(np.sort(cl.members), np.arange(N))
