"""kNN-LM evaluation with a chosen interpolation (memlm.jobs.interpolation_eval) on the tiny preset: constant
lambda is evaluate_knnlm bit for bit, a learned model of constant output too, kNN-LM + cache is the by-hand
mixture of three distributions over brute-force neighbours (the cache reset where a document starts), the
held-apart tail is cut by document, and the auto choice is the candidate of lowest held-apart NLL."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from memlm.jobs.interpolation_eval import (
    METHODS,
    CacheConfig,
    DocumentCache,
    choose_method,
    collect_interpolation_data,
    evaluate_auto,
    evaluate_interpolation,
    fit_method,
    held_apart_split,
    method_nll,
)
from memlm.jobs.knnlm_eval import evaluate_knnlm
from memlm.jobs.windows import WindowConfig, exact_searcher_over_documents, score_documents
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.interpolation import ConstantInterpolation, FitConfig, LearnedInterpolation, n_features
from memlm.retrieval.knnlm import KNNLMConfig

V = 50
WINDOW = WindowConfig(context=48, stride=24, batch_size=4)
BOS = 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("tiny", vocab_size=V)).eval()


@pytest.fixture(scope="module")
def docs():
    rng = np.random.default_rng(3)
    return [rng.integers(2, V, size=n).tolist() for n in (130, 60, 95, 110, 70)]


@pytest.fixture(scope="module")
def searcher(model, docs):
    return exact_searcher_over_documents(model, docs[:2], WINDOW, BOS)


KNN = KNNLMConfig(k=16, lmbda=0.3, temperature=2.0)


def test_constant_lambda_equals_evaluate_knnlm_bit_for_bit(model, docs, searcher):
    want = evaluate_knnlm(model, docs[2:4], searcher, WINDOW, KNN, BOS, progress=False)
    got = evaluate_interpolation(model, docs[2:4], searcher, WINDOW, KNN, BOS,
                                 ConstantInterpolation(("knn",), (0.7, 0.3), (2.0,)), progress=False)
    assert got["knnlm_nll"] == want["knnlm_nll"] and got["base_nll"] == want["base_nll"]
    assert got["tokens"] == want["tokens"] and got["knn_hit_rate"] == want["knn_hit_rate"]


def test_a_learned_model_of_constant_output_equals_constant_lambda(model, docs, searcher):
    learned = LearnedInterpolation(("knn",), (2.0,), hidden=4, learn_temperature=False)
    with torch.no_grad():
        learned.net[-1].weight.zero_()
        learned.net[-1].bias.copy_(torch.tensor([0.4, -0.9]))
    learned.eval()
    lam = float(learned.plan(torch.zeros(1, n_features(1))).weights[0, 1])
    want = evaluate_knnlm(model, docs[2:4], searcher, WINDOW, KNNLMConfig(k=16, lmbda=lam, temperature=2.0), BOS,
                          progress=False)
    got = evaluate_interpolation(model, docs[2:4], searcher, WINDOW, KNN, BOS, learned, progress=False)
    assert got["knnlm_nll"] == want["knnlm_nll"]


def test_knnlm_with_cache_is_the_by_hand_three_way_mixture(model, docs, searcher):
    """Every token's p_cache from all earlier positions of its own document (the last `size`), p_kNN from the
    exact neighbours, mixed in float64 probability space."""
    cache = CacheConfig(size=40, k=40 + WINDOW.context)  # k covers every candidate: the whole cache is read
    method = ConstantInterpolation(("knn", "cache"), (0.6, 0.25, 0.15), (2.0, 3.0))
    eval_docs = docs[2:5]
    got = evaluate_interpolation(model, eval_docs, searcher, WINDOW, KNN, BOS, method, cache=cache, progress=False)
    nll = 0.0
    for doc in eval_docs:
        scored = list(score_documents(model, [doc], WINDOW, BOS))
        keys = torch.cat([s.keys for s in scored]).double()  # (n, d) in document order
        targets = torch.cat([s.targets for s in scored])  # (n,)
        lm = torch.cat([s.lm_logprob for s in scored]).double()  # (n,)
        nb = searcher.search(keys.float().numpy(), KNN.k)
        for t in range(keys.shape[0]):
            w = np.exp(-nb.distances[t].astype(np.float64) / 2.0)
            p_knn = w[nb.values[t] == int(targets[t])].sum() / w.sum()
            earlier = range(max(0, t - 40), t)  # the cache: the document's last 40 positions before t
            if len(earlier):
                dist = ((keys[list(earlier)] - keys[t]) ** 2).sum(dim=1).numpy()  # (m,)
                wc = np.exp(-dist / 3.0)
                p_cache = wc[(targets[list(earlier)] == targets[t]).numpy()].sum() / wc.sum()
            else:
                p_cache = 0.0
            nll -= math.log(0.6 * math.exp(float(lm[t])) + 0.25 * p_knn + 0.15 * p_cache)
    assert got["knnlm_nll"] == pytest.approx(nll, rel=1e-5)


def test_the_cache_is_empty_where_a_document_starts(model, docs):
    scored = list(score_documents(model, docs[:2], WINDOW, BOS))
    cache = DocumentCache(CacheConfig(size=1000, k=8))
    firsts = []
    for s in scored:
        d, v = cache.step(s)
        if int(s.positions[0]) == 0:
            firsts.append((d[0], v[0]))
    assert len(firsts) == 2
    for d, v in firsts:  # the first token of each document reads nothing, not the last document's tail
        assert torch.isinf(d).all() and (v == -1).all()


def test_held_apart_tail_is_cut_by_document_or_at_the_tail_of_one():
    docs = torch.tensor([0] * 50 + [1] * 30 + [2] * 20)
    fit, held = held_apart_split(docs)
    assert fit.tolist() == list(range(80)) and held.tolist() == list(range(80, 100))
    fit, held = held_apart_split(torch.zeros(100, dtype=torch.long))
    assert fit.tolist() == list(range(75)) and held.tolist() == list(range(75, 100))


def test_auto_chooses_the_lowest_held_apart_nll_and_fits_it_on_all_tuning_tokens(model, docs, searcher):
    cache, fit = CacheConfig(size=64, k=32), FitConfig(steps=20)
    data = collect_interpolation_data(model, docs[3:5], searcher, WINDOW, KNN, cache, BOS, progress=False)
    choice = choose_method(data, fit)
    assert set(choice.held_apart) == set(METHODS) and choice.fit_tokens + choice.held_tokens == data.lm.shape[0]
    fit_rows, held_rows = held_apart_split(data.docs)
    scores = {m: method_nll(fit_method(m, data.rows(fit_rows), fit), data.rows(held_rows)) for m in METHODS}
    best = min(METHODS, key=scores.get)
    assert choice.method.method == best
    assert method_nll(choice.method, data) == method_nll(fit_method(best, data, fit), data)
    result, method = evaluate_auto(model, docs[2:3], searcher, WINDOW, KNN, BOS, docs[3:5], cache=cache, fit=fit,
                                   progress=False)
    assert result["interpolation"]["method"] == method.method == best
    assert result["tuned"] and 0 <= result["lambda"] <= 1 and result["tokens"] == len(docs[2])
