"""RetoMaton pointers (memlm.retrieval.pointers, memlm.jobs.pointer_walk): successors from a
built datastore's provenance (contiguous per document, checked, with a correct fallback for any row
order), never across a document boundary; the walk against a per-token oracle written from the rule
(searches counted right, the same p_kNN for every token); a minimum above k is plain kNN-LM exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import RowWiseSearcher, repeated_phrase_documents

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from memlm.jobs.knnlm_eval import Retrieval, evaluate_knnlm
from memlm.jobs.pointer_walk import streams_of, walk
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import KNNLMConfig, knn_target_logprob
from memlm.retrieval.pointers import PointerConfig, PointerSource, follow, successors, weighed_groups
from memlm.retrieval.searcher import Neighbors, Provenance, SearchOptions

V, BOS = 40, 1
WINDOW = WindowConfig(context=32, stride=16, batch_size=4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("tiny", vocab_size=V)).eval()


@pytest.fixture(scope="module")
def docs():
    """Documents with repeated phrases, so that pointers survive for several steps."""
    return repeated_phrase_documents(V)


def entries(model, docs):
    """Keys (N, d) float16, values (N,) and provenance (docs, positions) of a datastore of `docs`."""
    keys, values, dd, pp = [], [], [], []
    for s in score_documents(model, docs, WINDOW, BOS, with_logprobs=False):
        keys.append(s.keys.to(torch.float16))
        values.append(s.targets)
        dd.append(np.full(s.targets.shape[0], s.doc))
        pp.append(s.positions.numpy() + 1)  # Provenance: the boundary is position 0
    return (torch.cat(keys), torch.cat(values).numpy().astype(np.int32), np.concatenate(dd).astype(np.int32),
            np.concatenate(pp).astype(np.int32))


def lookup_of(docs: np.ndarray, positions: np.ndarray):
    return lambda ids: Provenance(docs[ids], positions[ids])


def brute_successors(docs: np.ndarray, positions: np.ndarray) -> np.ndarray:
    where = {(int(d), int(p)): i for i, (d, p) in enumerate(zip(docs, positions))}
    return np.array([where.get((int(d), int(p) + 1), -1) for d, p in zip(docs, positions)])


def test_successors_of_a_built_datastore_are_contiguous_per_document_and_stop_at_its_end(tmp_path, model, docs):
    source = BuildSource(model_name="tiny-test", model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64,
                         corpus="phrases", corpus_fingerprint="c" * 64, boundary_token=BOS)
    with_empty = [docs[0], [], docs[1], docs[2][:5]]  # an empty document and a 5-token one
    out = build_from_tokens(model, with_empty, tmp_path / "ds", source, BuildSettings(window=WINDOW, index_factory="Flat"),
                            progress=False, log=lambda m: None)
    store = Datastore.open(out)
    n = len(store)
    nxt, contiguous = successors(store.provenance, n)
    prov = store.provenance(np.arange(n)[None, :])
    d, p = prov.docs[0], prov.positions[0]
    assert contiguous  # the builder writes each document's entries in order: checked here, not assumed
    assert np.array_equal(nxt, brute_successors(d, p))
    ends = np.flatnonzero(nxt < 0)
    assert len(ends) == 3 and ends[-1] == n - 1  # one end per non-empty document
    assert (d[nxt[nxt >= 0]] == d[nxt >= 0]).all()  # never across a document boundary
    assert np.array_equal(nxt[nxt >= 0], np.flatnonzero(nxt >= 0) + 1)


def test_successors_fallback_for_rows_in_any_order():
    rng = np.random.default_rng(0)
    docs = np.repeat([0, 1, 2], [5, 1, 4]).astype(np.int32)
    positions = np.concatenate([np.arange(1, 6), [1], [1, 2, 4, 5]]).astype(np.int32)  # doc 2 has a gap
    perm = rng.permutation(docs.size)
    nxt, contiguous = successors(lookup_of(docs[perm], positions[perm]), docs.size)
    assert not contiguous
    assert np.array_equal(nxt, brute_successors(docs[perm], positions[perm]))
    assert (nxt >= 0).sum() == 4 + 0 + 2


def test_follow_keeps_the_successors_of_neighbours_that_predicted_the_next_token():
    keys = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float16)
    source = PointerSource.local(np.array([1, 2, -1, 4, 5, -1]), np.array([7, 8, 9, 7, 3, 3], np.int32), keys)
    prev = Neighbors(np.array([[0.5, 1.0, 2.0, np.inf]], np.float32), np.array([[0, 2, 3, -1]]),
                     np.array([[7, 9, 7, -1]], np.int32))
    xq = np.random.default_rng(1).normal(size=(1, 4)).astype(np.float32)
    table = source.successors
    got = follow(prev, np.array([7]), xq, source)  # entry 2 predicted 9, not 7
    assert sorted(got.ids[0].tolist()) == [1, 4]
    exact = ((keys[got.ids[0]].astype(np.float32) - xq) ** 2).sum(1)
    np.testing.assert_allclose(got.distances[0], exact, rtol=1e-6)
    assert (np.diff(got.distances[0]) >= 0).all() and list(got.values[0]) == list(table.values[got.ids[0]])
    carried = follow(prev, np.array([7]), xq, PointerSource.local(table.next_ids, table.values, None))
    assert dict(zip(carried.ids[0], carried.distances[0])) == {1: 0.5, 4: 2.0}
    # a neighbour at its document's end (entry 2) has no successor even when it predicted the token
    assert (follow(prev, np.array([9]), xq, source).ids == -1).all()


def oracle_walk(xq, targets, doc_of, searcher, k, temperature, min_pointers, stream_tokens, source):
    """The rule token by token with Python sets: (log p_kNN per token, number of searches)."""
    table = source.successors
    out, searches, cands, prev_t, run_start = [], 0, [], None, 0
    for i in range(xq.shape[0]):
        start = i == 0 or doc_of[i] != doc_of[i - 1]
        run_start = i if start else run_start
        if start or (i - run_start) % stream_tokens == 0:
            cands = []
        else:
            cands = [int(table.next_ids[j]) for j in cands
                     if table.values[j] == prev_t and table.next_ids[j] >= 0]
        if len(cands) < min_pointers:
            nb = searcher.search(xq[i : i + 1], k)
            searches += 1
            cands = [int(j) for j in nb.ids[0] if j >= 0]
            dist = nb.distances[0][: len(cands)]
        else:
            dist = ((source.keys[cands].astype(np.float32) - xq[i]) ** 2).sum(1)
        nb = Neighbors(np.array([dist], np.float32), np.array([cands]), table.values[np.array([cands])])
        out.append(float(knn_target_logprob(nb, np.array([targets[i]]), temperature)[0]))
        prev_t = targets[i]
    return np.array(out), searches


@pytest.mark.parametrize("min_pointers", [1, 3])
def test_walk_matches_a_per_token_oracle_of_the_rule(model, docs, min_pointers):
    keys, values, d, p = entries(model, docs)
    exact = TorchExactSearcher(keys, values)
    source = PointerSource.local(successors(lookup_of(d, p), len(values)).next_ids, values, keys.numpy())
    xq, targets = keys.float().numpy(), values.astype(np.int64)  # the datastore's own text: pointers survive
    config = PointerConfig(min_pointers=min_pointers, stream_tokens=20, streams=3)
    assert config.stream_length(len(xq)) == 20
    searcher = RowWiseSearcher(exact)
    got = walk(xq, targets, d, searcher, 6, SearchOptions(), 2.0, config, source, None, torch.no_grad())
    want, searches = oracle_walk(xq, targets, d, RowWiseSearcher(exact), 6, 2.0, min_pointers, 20, source)
    assert int(got.searched.sum()) == searches == searcher.rows
    assert searches < len(xq) // 2  # most tokens follow pointers on repeated text
    assert got.stream_searches == streams_of(d, 20).shape[0]
    # a call holds `streams` queries (3) while streams remain to start: only the last calls are smaller
    first_short = next(i for i, n in enumerate(searcher.sizes + [0]) if n < 3)
    assert first_short > len(searcher.sizes) // 2 and min(searcher.sizes[:first_short]) == 3
    np.testing.assert_allclose(got.knn_logprob.numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_minimum_above_k_is_plain_knnlm_exactly(model, docs):
    keys, values, d, p = entries(model, docs[:3])
    source = PointerSource.local(successors(lookup_of(d, p), len(values)).next_ids, values, keys.numpy())
    searcher = RowWiseSearcher(TorchExactSearcher(keys, values))
    knn = KNNLMConfig(k=8, lmbda=0.4, temperature=3.0)
    evaluated = docs[1:]
    plain = evaluate_knnlm(model, evaluated, searcher, WINDOW, knn, BOS, progress=False)
    walked = evaluate_knnlm(model, evaluated, searcher, WINDOW, knn, BOS, progress=False,
                            retrieval=Retrieval(PointerConfig(min_pointers=9, stream_tokens=16), source))
    assert walked["knnlm_nll"] == plain["knnlm_nll"] and walked["knnlm_perplexity"] == plain["knnlm_perplexity"]
    assert walked["searches"] == plain["searches"] == plain["tokens"] and walked["searches_saved"] == 0
    saving = evaluate_knnlm(model, evaluated, searcher, WINDOW, knn, BOS, progress=False,
                            retrieval=Retrieval(PointerConfig(min_pointers=1), source))
    assert saving["searches"] + saving["searches_saved"] == saving["tokens"] and saving["searches_saved"] > 0
    assert saving["pointer_tokens"] == saving["searches_saved"] and saving["base_perplexity"] == plain["base_perplexity"]


def test_kept_pointers_join_the_fresh_search_once_each():
    from memlm.retrieval.pointers import union_candidates

    searched = Neighbors(np.array([[1.0, 2.0, 3.0]], np.float32), np.array([[5, 7, 9]]), np.array([[1, 2, 3]], np.int32))
    pointed = Neighbors(np.array([[0.5, 2.5, np.inf]], np.float32), np.array([[7, 4, -1]]), np.array([[2, 8, -1]], np.int32))
    got = union_candidates(searched, pointed)
    assert got.ids[0].tolist() == [5, 7, 4, 9, -1, -1]  # 7 once (its searched distance 2.0), nearest first
    assert got.distances[0][:4].tolist() == [1.0, 2.0, 2.5, 3.0] and got.values[0][:4].tolist() == [1, 2, 8, 3]


def test_keep_pointers_adds_candidates_to_searched_tokens(model, docs):
    keys, values, d, p = entries(model, docs)
    source = PointerSource.local(successors(lookup_of(d, p), len(values)).next_ids, values, keys.numpy())
    xq, targets = keys.float().numpy(), values.astype(np.int64)
    exact = TorchExactSearcher(keys, values)
    runs = {}
    for keep in (False, True):
        config = PointerConfig(min_pointers=4, stream_tokens=20, streams=3, keep_pointers=keep)
        runs[keep] = walk(xq, targets, d, RowWiseSearcher(exact), 6, SearchOptions(), 2.0, config, source, None,
                          torch.no_grad(), collect=True)
    plain, kept = runs[False], runs[True]
    rows = np.flatnonzero(kept.searched & plain.searched)  # (kept pointers can make later searches fewer)
    more = (kept.neighbors.ids[rows] >= 0).sum(1) - (plain.neighbors.ids[rows] >= 0).sum(1)
    assert (more >= 0).all() and more.sum() > 0
    for r in rows:  # the k nearest are all still there
        assert set(plain.neighbors.ids[r][plain.neighbors.ids[r] >= 0]) <= set(kept.neighbors.ids[r].tolist())


def test_weighed_groups_score_each_row_as_its_whole_candidates():
    """pointers.weighed_groups: every row once, in one of two groups each cut after its own last finite distance;
    log p_kNN of each group's rows = that of the uncut rows (the columns cut weigh nothing), and the narrow group
    is cut narrower than the widest row."""
    rng = np.random.default_rng(0)
    s, w = 9, 40
    finite = rng.integers(0, w + 1, size=s)  # (S,) each row's weighted prefix, one row none, one all
    finite[0], finite[1] = 0, w
    dist = np.where(np.arange(w)[None, :] < finite[:, None], rng.uniform(0, 5, (s, w)), np.inf).astype(np.float32)
    ids = np.where(np.arange(w)[None, :] < finite[:, None] + 3, rng.integers(0, 100, (s, w)), -1)  # followed after
    vals = np.where(ids >= 0, rng.integers(0, 4, (s, w)), -1).astype(np.int32)
    cands = Neighbors(dist, ids, vals)
    targets = rng.integers(0, 4, size=s)
    want = knn_target_logprob(cands, targets, 2.0)
    groups = weighed_groups(cands)
    seen = np.concatenate([g for g, _ in groups])
    assert sorted(seen.tolist()) == list(range(s))
    assert min(nb.ids.shape[1] for _, nb in groups) < w
    for g, nb in groups:
        torch.testing.assert_close(knn_target_logprob(nb, targets[g], 2.0), want[torch.from_numpy(g)])
