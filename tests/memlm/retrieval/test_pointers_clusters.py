"""RetoMaton over clustered states (memlm.retrieval.pointers.extend_by_clusters, Alon et al. 2022 section 3.2):
the extension against a brute-force oracle (every member of the pointers' clusters, each once, at its exact
distance, the nearest `width`), singleton clusters walk exactly as pointers alone, a minimum above k is
plain kNN-LM with clusters too, and clusters let more pointers survive on repeated text."""

from __future__ import annotations

import numpy as np
import torch
from tiny_models import RowWiseSearcher, repeated_phrase_documents

from memlm.jobs.pointer_walk import walk
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.pointers import (
    PointerConfig,
    PointerSource,
    cluster_states,
    clusters_of,
    extend_by_clusters,
    successors,
)
from memlm.retrieval.searcher import Neighbors, Provenance, SearchOptions

V, BOS = 40, 1
WINDOW = WindowConfig(context=32, stride=16, batch_size=4)


def test_extension_matches_a_brute_force_oracle():
    rng = np.random.default_rng(0)
    n, d = 60, 5
    keys = rng.normal(size=(n, d)).astype(np.float16)
    values = rng.integers(0, 9, size=n).astype(np.int32)
    assign = rng.integers(0, 7, size=n)
    source = PointerSource.local(np.full(n, -1), values, keys, clusters_of(assign, keys, 7, seed=0))
    ids = np.array([[3, 10, -1], [-1, -1, -1], [5, 6, 7], [11, -1, -1]])
    cands = Neighbors(np.where(ids >= 0, 1.0, np.inf).astype(np.float32), ids, np.where(ids >= 0, values[ids], -1))
    xq = rng.normal(size=(4, d)).astype(np.float32)
    rows = np.array([0, 2, 3])
    for width in (4, 100):
        got = extend_by_clusters(cands, rows, xq, source, width)
        np.testing.assert_array_equal(got.ids[1], -1)  # a row not asked for is as it was
        for r in rows:
            members = np.flatnonzero(np.isin(assign, assign[ids[r][ids[r] >= 0]]))  # each once
            dist = ((keys[members].astype(np.float32) - xq[r]) ** 2).sum(1)
            order = np.argsort(dist, kind="stable")[:width]
            live = got.ids[r] >= 0
            assert live.sum() == len(order) and set(got.ids[r][live]) == set(members[order])
            np.testing.assert_allclose(got.distances[r][live], dist[order], rtol=1e-4, atol=1e-4)
            assert (np.diff(got.distances[r][live]) >= 0).all()
            np.testing.assert_array_equal(got.values[r][live], values[got.ids[r][live]])
    assert extend_by_clusters(cands, rows, xq, PointerSource.local(np.full(n, -1), values, keys), 4) is cands


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
