"""Fewer searches in per-token scoring (memlm.jobs.fewer_scoring through score_tokens, what the Score rpc
runs): a RetoMaton minimum above k and a gate threshold of 0 are plain kNN-LM scoring exactly; with
savings, a searched token scores as plain kNN-LM does, a token the gate skips scores as the base LM, and
searches + saved = tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import RowWiseSearcher, repeated_phrase_documents

from memlm.jobs.knnlm_eval import Retrieval
from memlm.jobs.scoring import score_tokens
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.adaptive import (
    AdaptiveConfig,
    GateConfig,
    GateSettings,
    RetrievalGate,
    distribution_features,
)
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.pointers import PointerConfig, PointerSource, successors
from memlm.retrieval.searcher import Provenance

V, BOS = 40, 1
WINDOW = WindowConfig(context=32, stride=16, batch_size=4)
KNN = KNNLMConfig(k=8, lmbda=0.4, temperature=3.0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("tiny", vocab_size=V)).eval()


@pytest.fixture(scope="module")
def docs():
    return repeated_phrase_documents(V)


@pytest.fixture(scope="module")
def store(model, docs):
    """(RowWiseSearcher, PointerSource) over a datastore of docs[:3]."""
    keys, values, dd, pp = [], [], [], []
    for s in score_documents(model, docs[:3], WINDOW, BOS, with_logprobs=False):
        keys.append(s.keys.to(torch.float16))
        values.append(s.targets)
        dd.append(np.full(s.targets.shape[0], s.doc))
        pp.append(s.positions.numpy() + 1)
    keys, values = torch.cat(keys), torch.cat(values).numpy().astype(np.int32)
    d, p = np.concatenate(dd).astype(np.int32), np.concatenate(pp).astype(np.int32)
    nxt = successors(lambda ids: Provenance(d[ids], p[ids]), len(values)).next_ids
    return RowWiseSearcher(TorchExactSearcher(keys, values)), PointerSource.local(nxt, values, keys.numpy())


def gate(threshold: float | None, model=None, docs=None) -> AdaptiveConfig:
    """A random gate standardised on the documents' features; threshold None: their median score."""
    settings = GateSettings("m", "k", "c", KNN.k, KNN.temperature, KNN.lmbda, GateConfig(hidden=8), 5, (), "t", 1, 0.5,
                            0.5, tuple(np.linspace(0, 1, 1001).tolist()))
    with torch.random.fork_rng(devices=[]):  # the global RNG stays as other tests expect it
        torch.manual_seed(3)
        net = RetrievalGate(5, 8)
    if threshold is None:
        x = torch.cat([s.features for s in score_documents(model, docs, WINDOW, BOS, lm_features=distribution_features)])
        net.mean.copy_(x.mean(dim=0))
        net.std.copy_(x.std(dim=0))
        threshold = float(net.scores(x).median())
    return AdaptiveConfig(net, settings, threshold)


def scores(model, seqs, searcher, retrieval=None):
    return score_tokens(model, seqs, context=WINDOW.context, stride=WINDOW.stride, boundary_token=BOS,
                        contexts=[[5, 6]] + [None] * (len(seqs) - 1), searcher=searcher, knn=KNN, top_n=3,
                        batch_size=WINDOW.batch_size, retrieval=retrieval)


def same(a, b):
    for x, y in zip(a, b):
        for f in ("logprob", "base_logprob", "greedy", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f), err_msg=f)


def test_a_minimum_above_k_and_threshold_zero_score_as_plain_knnlm(model, docs, store):
    searcher, source = store
    plain = scores(model, docs[1:], searcher)
    for how in (Retrieval(PointerConfig(min_pointers=KNN.k + 1, stream_tokens=16), source),
                Retrieval(adaptive=gate(0.0))):
        got = scores(model, docs[1:], searcher, how)
        same(got, plain)
        assert all(s.searched.all() and s.searches == len(s.tokens) for s in got)


def test_pointers_save_searches_and_searched_tokens_score_as_plain(model, docs, store):
    searcher, source = store
    plain = scores(model, docs[1:], searcher)
    got = scores(model, docs[1:], searcher, Retrieval(PointerConfig(min_pointers=1, stream_tokens=16), source))
    total = sum(len(s.tokens) for s in got)
    saved = sum(len(s.tokens) - s.searches for s in got)
    assert 0 < saved < total
    for g, p in zip(got, plain):
        np.testing.assert_array_equal(g.logprob[g.searched], p.logprob[g.searched])  # the same k nearest
        np.testing.assert_array_equal(g.base_logprob, p.base_logprob)
        assert g.searched[0]  # a stream's first token is searched


def test_a_gate_skips_to_the_base_distribution(model, docs, store):
    searcher, _ = store
    plain = scores(model, docs[1:], searcher)
    got = scores(model, docs[1:], searcher, Retrieval(adaptive=gate(None, model, docs[1:])))
    skipped = np.concatenate([~s.searched for s in got])
    assert 0 < skipped.sum() < skipped.size
    for g, p in zip(got, plain):
        np.testing.assert_array_equal(g.logprob[~g.searched], g.base_logprob[~g.searched])
        np.testing.assert_array_equal(g.logprob[g.searched], p.logprob[g.searched])
        np.testing.assert_array_equal(g.greedy[g.searched], p.greedy[g.searched])
