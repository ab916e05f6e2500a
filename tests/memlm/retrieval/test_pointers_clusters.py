"""RetoMaton over clustered states (memlm.retrieval.pointers.extend_by_clusters, Alon et al. 2022 section 3.2):
the extension against a brute-force oracle (every member of the pointers' clusters, each once, at its exact
distance, the nearest `width`), with and without the members' KeySketch (exact where the sketch's ranking
cannot matter or cannot err; otherwise exact distances, the row's own candidates kept), singleton clusters
walk exactly as pointers alone, a minimum above k is plain kNN-LM with clusters too, and clusters let more
pointers survive on repeated text."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import RowWiseSearcher, repeated_phrase_documents

from memlm.jobs.pointer_walk import walk
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.clustered_states import cluster_states, clusters_of
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.pointers import PointerConfig, PointerSource, extend_by_clusters, successors
from memlm.retrieval.searcher import Neighbors, Provenance, SearchOptions

V, BOS = 40, 1
WINDOW = WindowConfig(context=32, stride=16, batch_size=4)


ROWS = np.array([0, 2, 3])
"""The rows extended in the oracle tests (row 1 has no candidates and is not asked for)."""


def oracle_case(keys: np.ndarray, sketch_dims: int, exact_members: int = 4, seed: int = 0):
    """A 60-entry store in 7 random clusters, four rows of candidates and their queries."""
    rng = np.random.default_rng(seed)
    n, d = keys.shape
    values = rng.integers(0, 9, size=n).astype(np.int32)
    assign = rng.integers(0, 7, size=n)
    clusters = clusters_of(assign, keys, 7, seed=0, sketch_dims=sketch_dims, exact_members=exact_members)
    source = PointerSource.local(np.full(n, -1), values, keys, clusters)
    ids = np.array([[3, 10, -1], [-1, -1, -1], [5, 6, 7], [11, -1, -1]])
    xq = (keys[rng.integers(0, n, size=4)].astype(np.float32) + rng.normal(size=(4, d)).astype(np.float32))
    return source, candidates(ids, xq, keys, values), xq, assign, values


def candidates(ids: np.ndarray, xq: np.ndarray, keys: np.ndarray, values: np.ndarray) -> Neighbors:
    """Rows of candidates at their exact distances to the rows' queries, as `follow` gives them."""
    dist = ((keys[np.maximum(ids, 0)].astype(np.float32) - xq[:, None, :]) ** 2).sum(-1)  # (r, w)
    return Neighbors(np.where(ids >= 0, dist, np.inf).astype(np.float32), ids, np.where(ids >= 0, values[ids], -1))


def check_against_oracle(got, source, cands, xq, assign, values, width, keys, own_first=False):
    """Every member of the row's clusters once, at its exact distance, the nearest `width`, nearest first;
    own_first: the row's own candidates kept whatever their distance, the nearest others beside them."""
    np.testing.assert_array_equal(got.ids[1], -1)  # a row not asked for is as it was
    for r in ROWS:
        ids = cands.ids[r][cands.ids[r] >= 0]
        members = np.flatnonzero(np.isin(assign, assign[ids]))  # each once
        others = np.setdiff1d(members, ids) if own_first else members
        dist = ((keys[others].astype(np.float32) - xq[r]) ** 2).sum(1)
        want = others[np.argsort(dist, kind="stable")[: width - (ids.size if own_first else 0)]]
        if own_first:
            want = np.concatenate([ids, want])
        live = got.ids[r] >= 0
        assert live.sum() == len(want) and set(got.ids[r][live]) == set(want)
        exact = ((keys[got.ids[r][live]].astype(np.float32) - xq[r]) ** 2).sum(1)
        np.testing.assert_allclose(got.distances[r][live], exact, rtol=1e-4, atol=1e-3)
        assert (np.diff(got.distances[r][live]) >= 0).all()
        np.testing.assert_array_equal(got.values[r][live], values[got.ids[r][live]])


def test_extension_matches_a_brute_force_oracle():
    keys = np.random.default_rng(1).normal(size=(60, 5)).astype(np.float16)
    source, cands, xq, assign, values = oracle_case(keys, sketch_dims=0)
    assert source.clusters.sketch is None
    for width in (4, 100):
        got = extend_by_clusters(cands, ROWS, xq, source, width)
        check_against_oracle(got, source, cands, xq, assign, values, width, keys)
    n = keys.shape[0]
    assert extend_by_clusters(cands, ROWS, xq, PointerSource.local(np.full(n, -1), values, keys), 4) is cands


def test_a_sketch_is_exact_where_its_ranking_cannot_matter_or_cannot_err():
    """Room for every member (exact_members and width 100): all are scored exactly. Keys in a 2-dimensional
    subspace (plus float16 rounding) and a 2-component sketch scoring 4 exactly: its ranking is the exact
    one, so beside the row's own candidates (kept first, as retomaton.py keeps its pointers before the
    clusters' members) the nearest others are found."""
    rng = np.random.default_rng(2)
    full = rng.normal(size=(60, 8)).astype(np.float16)
    source, cands, xq, assign, values = oracle_case(full, sketch_dims=2, exact_members=100)
    assert source.clusters.sketch is not None and source.clusters.sketch.codes.shape == (60, 2)
    check_against_oracle(extend_by_clusters(cands, ROWS, xq, source, 100), source, cands, xq, assign, values, 100, full)
    flat = (rng.normal(size=(60, 2)) @ rng.normal(size=(2, 8)) * 4.0 + 8.0).astype(np.float16)  # rank 2, off centre
    source, cands, xq, assign, values = oracle_case(flat, sketch_dims=2)
    xq = flat[[0, 0, 20, 40]].astype(np.float32) + 0.1  # near the subspace: the dropped part is the same for all
    cands = candidates(cands.ids, xq, flat, values)
    check_against_oracle(extend_by_clusters(cands, ROWS, xq, source, 4), source, cands, xq, assign, values, 4, flat,
                         own_first=True)


def test_a_poor_sketch_still_gives_exact_distances_and_keeps_the_rows_own_candidates():
    """A 1-component sketch of full-rank keys ranks badly, and scores 2 exactly: a row keeps `width` members
    of its clusters, each once: its own candidates (never dropped for the sketch's error) and the best by
    the sketch; its own and the best others up to 2 in all at their exact distances, nearest first, then
    the others at inf (followed at the next step, no weight in p_kNN)."""
    keys = np.random.default_rng(3).normal(size=(60, 8)).astype(np.float16)
    source, cands, xq, assign, values = oracle_case(keys, sketch_dims=1, exact_members=2)
    width = 6
    got = extend_by_clusters(cands, ROWS, xq, source, width)
    for r in ROWS:
        own = cands.ids[r][cands.ids[r] >= 0]
        members = np.flatnonzero(np.isin(assign, assign[own]))
        live = got.ids[r] >= 0
        ids, dist = got.ids[r][live], got.distances[r][live]
        assert live.sum() == min(width, members.size) and len(set(ids)) == live.sum() and set(ids) <= set(members)
        scored = np.isfinite(dist)
        assert scored.sum() == max(2, own.size) and set(own) <= set(ids[scored])
        assert not scored[scored.sum():].any()  # the scored first, then the followed-only
        exact = ((keys[ids[scored]].astype(np.float32) - xq[r]) ** 2).sum(1)
        np.testing.assert_allclose(dist[scored], exact, rtol=1e-4, atol=1e-3)
        assert (np.diff(dist[scored]) >= 0).all()
        np.testing.assert_array_equal(got.values[r][live], values[ids])
    at = np.array([10, -1, 7, 11])  # each row's query on one of its own candidates, room for 1: that one is kept
    xq = keys[np.maximum(at, 0)].astype(np.float32)
    got = extend_by_clusters(candidates(cands.ids, xq, keys, values), ROWS, xq, source, 1)
    np.testing.assert_array_equal(got.ids[ROWS, 0], at[ROWS])
    np.testing.assert_allclose(got.distances[ROWS, 0], 0.0, atol=1e-5)


def walk_data():
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("tiny", vocab_size=V)).eval()
    keys, values, dd, pp = [], [], [], []
    for s in score_documents(model, repeated_phrase_documents(V), WINDOW, BOS, with_logprobs=False):
        keys.append(s.keys.to(torch.float16))
        values.append(s.targets)
        dd.append(np.full(s.targets.shape[0], s.doc))
        pp.append(s.positions.numpy() + 1)
    keys, values = torch.cat(keys), torch.cat(values).numpy().astype(np.int32)
    d, p = np.concatenate(dd), np.concatenate(pp)
    nxt = successors(lambda ids: Provenance(d[ids], p[ids]), len(values)).next_ids
    return keys, values, d, nxt


def run(keys, values, d, source, min_pointers, k=6):
    xq, targets = keys.float().numpy(), values.astype(np.int64)  # the datastore's own text: pointers survive
    config = PointerConfig(min_pointers=min_pointers, stream_tokens=20, streams=3)
    return walk(xq, targets, d, RowWiseSearcher(TorchExactSearcher(keys, values)), k, SearchOptions(), 2.0, config,
                source, None, torch.no_grad())


def test_singleton_clusters_walk_as_pointers_alone_and_a_minimum_above_k_is_plain():
    keys, values, d, nxt = walk_data()
    n = len(values)
    plain_source = PointerSource.local(nxt, values, keys.numpy())
    singletons = PointerSource.local(nxt, values, keys.numpy(), clusters_of(np.arange(n), keys.numpy(), n, seed=0))
    for m in (1, 3):
        alone, single = run(keys, values, d, plain_source, m), run(keys, values, d, singletons, m)
        np.testing.assert_array_equal(single.searched, alone.searched)
        np.testing.assert_allclose(single.knn_logprob.numpy(), alone.knn_logprob.numpy(), rtol=1e-5, atol=1e-5)
    clustered = PointerSource.local(nxt, values, keys.numpy(), cluster_states(keys.numpy(), 8))
    every = run(keys, values, d, clustered, 7)  # a minimum above k (6): every token searched
    want = RowWiseSearcher(TorchExactSearcher(keys, values)).search(keys.float().numpy(), 6)
    from memlm.retrieval.knnlm import knn_target_logprob

    assert every.searched.all()
    torch.testing.assert_close(every.knn_logprob, knn_target_logprob(want, values.astype(np.int64), 2.0))


def test_clusters_let_more_pointers_survive():
    """With room for the members (k 64 of 216 entries; retomaton.py caps them at max_knns the same way)."""
    keys, values, d, nxt = walk_data()
    alone = run(keys, values, d, PointerSource.local(nxt, values, keys.numpy()), 8, k=64)
    clustered = run(keys, values, d, PointerSource.local(nxt, values, keys.numpy(), cluster_states(keys.numpy(), 16)),
                    8, k=64)
    assert clustered.searched.sum() < alone.searched.sum()


def test_tied_members_at_the_width_cut_are_kept_the_same_alone_and_beside_other_rows():
    # Duplicate keys tie (every document's first key, repeated texts): which of them a row keeps, and in what
    # order, must not depend on the other rows of the call (torch.topk's tie order depends on the matrix width).
    rng = np.random.default_rng(0)
    d = 8
    base = rng.normal(size=(1, d)).astype(np.float16)
    keys = np.concatenate([np.repeat(base, 40, 0), rng.normal(size=(200, d)).astype(np.float16)])  # 40 identical
    n = keys.shape[0]
    values = np.arange(n, dtype=np.int32) % 30
    assign = np.concatenate([np.zeros(40, int), 1 + np.arange(200) % 2])  # cluster 0: the duplicates
    source = PointerSource.local(np.full(n, -1), values, keys, clusters_of(assign, keys, 3, seed=0))
    xq = np.repeat(base.astype(np.float32) + 0.01, 2, 0)

    def cands(ids):
        ids = np.array(ids)
        return Neighbors(np.zeros(ids.shape, np.float32), ids, np.where(ids >= 0, values[np.maximum(ids, 0)], -1))

    alone = extend_by_clusters(cands([[0, -1, -1]]), np.array([0]), xq[:1], source, 8)
    beside = extend_by_clusters(cands([[0, -1, -1], [40, 41, 42]]), np.array([0, 1]), xq, source, 8)
    assert alone.ids[0].tolist() == beside.ids[0].tolist() == list(range(8))  # ties by member order
    np.testing.assert_array_equal(alone.distances[0], beside.distances[0])


def test_search_rows_batches_the_searches_differently_and_walks_the_same():
    """PointerConfig.search_rows: the streams waiting for a search are searched once that many wait (or as many
    as still move) instead of once all of them wait: more, smaller search calls and the same walk, token for
    token (which tokens are searched, every log p_kNN), with clustered states ranked by a sketch and without."""
    keys, values, d, nxt = walk_data()
    xq, targets = keys.float().numpy(), values.astype(np.int64)
    sketched = cluster_states(keys.numpy(), 8, sketch_dims=2, exact_members=3)
    for source in (PointerSource.local(nxt, values, keys.numpy()), PointerSource.local(nxt, values, keys.numpy(),
                                                                                         sketched)):
        runs = {}
        for rows in (None, 1, 3):
            searcher = RowWiseSearcher(TorchExactSearcher(keys, values))
            config = PointerConfig(min_pointers=2, stream_tokens=20, streams=8, search_rows=rows)
            runs[rows] = walk(xq, targets, d, searcher, 6, SearchOptions(), 2.0, config, source, None,
                              torch.no_grad()), searcher.sizes
        base, base_sizes = runs[None]
        assert 0 < base.searched.sum() < len(xq)
        for rows in (1, 3):
            got, sizes = runs[rows]
            np.testing.assert_array_equal(got.searched, base.searched)
            torch.testing.assert_close(got.knn_logprob, base.knn_logprob, rtol=0, atol=0)
            assert sum(sizes) == sum(base_sizes) and len(sizes) > len(base_sizes)  # the same rows, more calls
        assert len(runs[1][1]) > len(runs[3][1])


@pytest.mark.parametrize("exact_members, max_clusters, width", [(3, None, None), (2, 2, 9), (40, 1, 4)])
def test_a_sketched_walk_is_the_same_collecting_its_candidates_or_not(exact_members, max_clusters, width):
    """memlm.jobs.pointer_walk with clustered states ranked by a sketch, on the datastore's own text (pointers
    survive) and with a random gate: the same walk whether or not it collects each token's candidates (which
    tokens are searched or skipped, log p_kNN); searched, skipped and walked tokens all occur, members are kept
    but not scored exactly where the sketch scores fewer than the width, and a row is cut to the width."""
    keys, values, d, nxt = walk_data()
    xq, targets = keys.float().numpy(), values.astype(np.int64)
    sketched = cluster_states(keys.numpy(), 8, sketch_dims=2, exact_members=exact_members, max_clusters=max_clusters)
    source = PointerSource.local(nxt, values, keys.numpy(), sketched)
    allowed = np.random.default_rng(0).random(len(xq)) < 0.7
    config = PointerConfig(min_pointers=2, stream_tokens=20, streams=5, search_rows=2, cluster_width=width)
    runs = {collect: walk(xq, targets, d, RowWiseSearcher(TorchExactSearcher(keys, values)), 6, SearchOptions(), 2.0,
                          config, source, allowed, torch.no_grad(), collect=collect) for collect in (True, False)}
    got, bare = runs[True], runs[False]
    np.testing.assert_array_equal(got.searched, bare.searched)
    np.testing.assert_array_equal(got.skipped, bare.skipped)
    torch.testing.assert_close(got.knn_logprob, bare.knn_logprob, rtol=0, atol=0)
    assert 0 < got.searched.sum() < len(xq) and got.skipped.any() and (~got.searched & ~got.skipped).any()
    pointed = ~got.searched & ~got.skipped & (got.neighbors.ids >= 0).any(axis=1)  # (Q,) walked tokens
    live = got.neighbors.ids[pointed] >= 0
    followed = (live & np.isinf(got.neighbors.distances[pointed])).any()  # members kept but not scored
    assert followed == (exact_members < config.extended_width(6))
    assert (live.sum(axis=1) == config.extended_width(6)).any()  # a row cut to the width
