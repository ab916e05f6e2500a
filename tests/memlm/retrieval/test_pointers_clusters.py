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
def test_the_compiled_step_walks_as_the_numpy_one(exact_members, max_clusters, width, monkeypatch):
    """memlm.jobs.pointer_walk with clustered states ranked by a sketch takes walk_step.walk_step (follow, the
    extension and the store in one compiled call) where the kernels are available: the same walk as numpy's
    follow + extend_by_clusters, token for token (which tokens are searched or skipped by a gate, each token's
    candidates in order, log p_kNN), on the datastore's own text (pointers survive) and with a random gate."""
    from memlm.retrieval import by_id_kernels
    from memlm.jobs.pointer_walk import compiled_step

    if not by_id_kernels.available():
        pytest.skip("no C compiler: the kernels cannot be built")
    keys, values, d, nxt = walk_data()
    xq, targets = keys.float().numpy(), values.astype(np.int64)
    sketched = cluster_states(keys.numpy(), 8, sketch_dims=2, exact_members=exact_members, max_clusters=max_clusters)
    source = PointerSource.local(nxt, values, keys.numpy(), sketched)
    allowed = np.random.default_rng(0).random(len(xq)) < 0.7
    config = PointerConfig(min_pointers=2, stream_tokens=20, streams=5, search_rows=2, cluster_width=width)
    runs = {}
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(by_id_kernels, "available", lambda: False)
        assert compiled_step(source, config) == compiled
        for collect in (True, False):  # not collecting, the compiled walk reads only the weighted columns
            runs[compiled, collect] = walk(xq, targets, d, RowWiseSearcher(TorchExactSearcher(keys, values)), 6,
                                           SearchOptions(), 2.0, config, source, allowed, torch.no_grad(), collect=collect)
    for collect in (True, False):
        fast, slow = runs[True, collect], runs[False, collect]
        np.testing.assert_array_equal(fast.searched, slow.searched)
        np.testing.assert_array_equal(fast.skipped, slow.skipped)
        torch.testing.assert_close(fast.knn_logprob, slow.knn_logprob, rtol=1e-5, atol=1e-5)
    fast, slow = runs[True, True], runs[False, True]
    assert 0 < fast.searched.sum() < len(xq) and fast.skipped.any() and (~fast.searched & ~fast.skipped).any()
    pointed = ~fast.searched & ~fast.skipped & (fast.neighbors.ids >= 0).any(axis=1)  # (Q,) walked tokens
    live = fast.neighbors.ids[pointed] >= 0
    followed = (live & np.isinf(fast.neighbors.distances[pointed])).any()  # members kept but not scored
    assert followed == (exact_members < config.extended_width(6))
    assert (live.sum(axis=1) == config.extended_width(6)).any()  # a row cut to the width
    np.testing.assert_array_equal(fast.searched, slow.searched)
    np.testing.assert_array_equal(fast.skipped, slow.skipped)
    np.testing.assert_array_equal(fast.neighbors.ids, slow.neighbors.ids)
    np.testing.assert_array_equal(fast.neighbors.values, slow.neighbors.values)
    np.testing.assert_allclose(fast.neighbors.distances, slow.neighbors.distances, rtol=1e-5)
    torch.testing.assert_close(fast.knn_logprob, slow.knn_logprob, rtol=1e-5, atol=1e-5)


def test_walk_step_on_a_block_equals_follow_and_extend_and_leaves_only_pads_past_each_count(monkeypatch):
    """walk_step.walk_step on a block whose rows hold more candidates than they will keep (the columns past a
    row's new count must be reset: the walk reads a block's rows as wide as its fullest), against numpy's follow,
    needs_search and extend_by_clusters on the same rows; rows needing a search are left as they were."""
    from memlm.retrieval import by_id_kernels, walk_step
    from memlm.retrieval.pointers import follow, needs_search

    if not by_id_kernels.available():
        pytest.skip("no C compiler: the kernels cannot be built")
    keys, values, d, nxt = walk_data()
    n = len(values)
    cl = cluster_states(keys.numpy(), 8, sketch_dims=2, exact_members=3, max_clusters=2)
    source = PointerSource.local(nxt, values, keys.numpy(), cl)
    rng = np.random.default_rng(1)
    s, w, width = 6, 12, 5
    block = walk_step.CandidateBlock(np.full((s, w), -1, np.int64), np.full((s, w), np.inf, np.float32),
                                         np.full((s, w), -1, np.int32), np.zeros(s, np.int64))
    for r, c in enumerate([12, 0, 7, 12, 3, 9]):
        block.ids[r, :c] = rng.choice(n, size=c, replace=False)
        block.vals[r, :c] = values[block.ids[r, :c]]
        block.dist[r, :c] = np.sort(rng.random(c)).astype(np.float32)
        block.count[r] = c
    rows = np.array([5, 0, 2, 3, 1])  # row 4 does not move
    prev_targets = np.array([block.vals[r, 0] if block.count[r] else 0 for r in rows], np.int32)  # survivors
    fresh = np.array([False, False, False, True, False])
    xq = keys[rng.integers(0, n, size=rows.size)].float().numpy()
    before = tuple(a.copy() for a in block)
    prev = Neighbors(before[1][rows], before[0][rows], before[2][rows])
    cands = follow(prev, prev_targets, xq, source, distances=False)
    want_need = needs_search(cands, 2) | fresh
    with monkeypatch.context() as numpy_only:  # the reference: numpy's extension, not the same C
        numpy_only.setattr(by_id_kernels, "available", lambda: False)
        want = extend_by_clusters(cands, np.flatnonzero(~want_need), xq, source, width)
    sk = cl.sketch
    q = torch.from_numpy(xq)
    need, scored = walk_step.walk_step(block, rows, prev_targets, fresh, 2, nxt, xq, sk.project(q).numpy(),
                                           source.cluster_arrays, sk.exact_members, sk.max_clusters, width)
    np.testing.assert_array_equal(need, want_need)
    assert need.any() and (~need).any()
    for i, r in enumerate(rows):
        if need[i]:  # as it was
            for a, b in zip(block, before):
                np.testing.assert_array_equal(a[r], b[r])
            assert scored[i] == 0
            continue
        c = int(block.count[r])
        np.testing.assert_array_equal(block.ids[r, :c], want.ids[i][want.ids[i] >= 0])
        np.testing.assert_allclose(block.dist[r, :c], want.distances[i, :c], rtol=1e-5)
        np.testing.assert_array_equal(block.vals[r, :c], want.values[i, :c])
        assert scored[i] == np.isfinite(block.dist[r, :c]).sum() and np.isfinite(block.dist[r, : scored[i]]).all()
        assert (block.ids[r, c:] == -1).all() and (block.vals[r, c:] == -1).all() and np.isinf(block.dist[r, c:]).all()
    np.testing.assert_array_equal(block.ids[4], before[0][4])


def test_walk_step_refuses_ids_outside_the_datastore_and_survives_non_finite_sketch_scores():
    """The C reads any address it is given: a block row holding an id past the datastore is refused (nothing
    written). A sketch code past float16's range (clipped by key_sketch, but given here as it is) gives scores of
    -inf or nan, which must not pass for a row's own candidates: every kept member is still distinct."""
    from memlm.retrieval import by_id_kernels, walk_step
    from memlm.retrieval.clustered_states import KeySketch

    if not by_id_kernels.available():
        pytest.skip("no C compiler: the kernels cannot be built")
    keys, values, d, nxt = walk_data()
    n = len(values)
    cl = cluster_states(keys.numpy(), 4, sketch_dims=2, exact_members=3)
    source = PointerSource.local(nxt, values, keys.numpy(), cl)
    block = walk_step.CandidateBlock(np.full((1, 8), -1, np.int64), np.full((1, 8), np.inf, np.float32),
                                     np.full((1, 8), -1, np.int32), np.ones(1, np.int64))
    block.ids[0, 0], block.vals[0, 0] = n, 0
    xq = keys[:1].float().numpy()
    sk = cl.sketch
    qq = sk.project(torch.from_numpy(xq)).numpy()
    with pytest.raises(ValueError, match="outside"):
        walk_step.walk_step(block, np.array([0]), np.array([0]), np.array([False]), 1, nxt, xq, qq,
                            source.cluster_arrays, 3, None, 6)
    assert block.ids[0, 0] == n and block.count[0] == 1  # untouched
    codes = sk.codes.clone()
    codes[: n // 2, 0] = 1e6  # float16: inf; with q's sign, scores of -inf (or nan)
    wild = dataclasses.replace(cl, sketch=KeySketch(sk.mean, sk.basis, codes, sk.centred_norms, 3))
    wild_source = PointerSource.local(nxt, values, keys.numpy(), wild)
    own = np.array([[cl.members[0], cl.members[-1], -1]])
    with np.errstate(over="ignore"):  # the codes' float16 cast overflows: what is tested
        arrays = wild_source.cluster_arrays
    for sign in (1.0, -1.0):
        dist, ids, _, count = walk_step.extend_sketched(own, xq, sign * np.abs(qq) + sign, arrays, 3, None, 20)
        kept = ids[0, : count[0]]
        assert count[0] == 20 and len(set(kept.tolist())) == 20 and set(own[0, :2]) <= set(kept.tolist())
        assert np.isfinite(dist[0, :3]).all() and np.isinf(dist[0, 3:]).all()
