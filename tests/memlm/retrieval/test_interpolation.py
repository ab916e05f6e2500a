"""Interpolation methods (memlm.retrieval.interpolation) against oracles: a learned model whose output is
constant is constant-lambda kNN-LM bit for bit, the three-way mixture is the float64 sum of probabilities,
the features are what a loop over the neighbours says, gradients reach the temperature, and a fit on a toy
case recovers the rule that made it."""

from __future__ import annotations

import math

import numpy as np
import torch

from memlm.retrieval.interpolation import (
    LM_FEATURES,
    LM_WEIGHT_FLOOR,
    ConstantInterpolation,
    FitConfig,
    LearnedInterpolation,
    final_logprob,
    fit_learned,
    load_method,
    mixture,
    n_features,
    save_method,
    source_features,
    token_features,
    trainable_logprob,
)
from memlm.retrieval.knnlm import interpolate, knn_logprob_from_matches


def neighbours(rng, n, k, vocab=6, missing=0):
    d = torch.from_numpy(np.sort(rng.uniform(0, 10, size=(n, k)), axis=1).astype(np.float32))  # (n, k)
    v = torch.from_numpy(rng.integers(0, vocab, size=(n, k)))  # (n, k)
    if missing:
        d[:, -missing:] = math.inf
        v[:, -missing:] = -1
    return d, v


def lm_cols(rng, n, vocab=6):
    x = torch.from_numpy(rng.normal(size=(n, LM_FEATURES)).astype(np.float32))  # (n, 6)
    x[:, -1] = torch.from_numpy(rng.integers(0, vocab, size=n).astype(np.float32))  # the LM's top token
    return x


def constant_model(sources, temperatures, bias, learn_temperature=False):
    model = LearnedInterpolation(sources, temperatures, hidden=4, learn_temperature=learn_temperature)
    with torch.no_grad():
        model.net[-1].weight.zero_()
        model.net[-1].bias.zero_()
        model.net[-1].bias[: len(bias)] = torch.tensor(bias)
    return model.eval()


def test_a_learned_model_with_constant_output_is_constant_lambda_knnlm_exactly():
    rng = np.random.default_rng(0)
    d, v = neighbours(rng, 200, 16, missing=2)
    targets = torch.from_numpy(rng.integers(0, 8, size=200))  # some never retrieved
    lm = torch.log_softmax(torch.randn(200, 8), dim=1)[torch.arange(200), targets]  # (n,)
    model = constant_model(("knn",), (1.7,), [0.3, -1.2])
    features = token_features(lm_cols(rng, 200), [(d, v)], (1.7,))  # varies per token; the output does not
    plan = model.plan(features)
    lam = float(plan.weights[0, 1])
    assert torch.equal(plan.weights[:, 1], torch.full((200,), lam, dtype=torch.float64))
    got = final_logprob(plan, lm, [(d, v == targets[:, None])])
    want = interpolate(lm, knn_logprob_from_matches(d, v == targets[:, None], 1.7), lam)
    assert torch.equal(got, want)
    # the same through ConstantInterpolation and the generic mixture
    const = ConstantInterpolation(("knn",), (1 - lam, lam), (1.7,))
    assert torch.equal(final_logprob(const.plan(None), lm, [(d, v == targets[:, None])]), want)


def test_three_way_mixture_is_the_float64_sum_of_probabilities():
    rng = np.random.default_rng(1)
    lm = torch.log(torch.from_numpy(rng.uniform(0.01, 1, 50)).float())
    knn = torch.log(torch.from_numpy(rng.uniform(0, 1, 50)).float())
    cache = torch.log(torch.from_numpy(rng.uniform(0, 1, 50)).float())
    knn[::4] = -math.inf  # no neighbour predicts the target
    cache[::3] = -math.inf
    w = torch.from_numpy(rng.dirichlet([1, 1, 1], size=50))  # (n, 3) float64
    got = mixture(lm, [knn, cache], w)
    p = (w[:, 0] * lm.double().exp() + w[:, 1] * knn.double().exp() + w[:, 2] * cache.double().exp())
    torch.testing.assert_close(got.double(), p.log(), rtol=1e-6, atol=1e-6)
    # a zero weight drops its source exactly; all-LM weights are the base bit for bit
    one = torch.zeros(50, 3, dtype=torch.float64)
    one[:, 0] = 1.0
    assert torch.equal(mixture(lm, [knn, cache], one), lm)
    assert torch.equal(mixture(lm, [knn, cache], (1.0, 0.0, 0.0)), lm)


def test_source_features_against_a_loop_over_the_neighbours():
    rng = np.random.default_rng(2)
    d, v = neighbours(rng, 30, 12, vocab=4, missing=3)
    d[0], v[0] = math.inf, -1  # a token without neighbours
    lm_top = torch.from_numpy(rng.integers(0, 4, size=30))
    t = 2.5
    got = source_features(d, v, lm_top, t, with_count=True)
    assert torch.isnan(got[0, :7]).all() and got[0, 7] == 0
    for i in range(1, 30):
        ok = [j for j in range(12) if math.isfinite(float(d[i, j]))]
        w = np.array([math.exp(-float(d[i, j]) / t) for j in ok])
        w /= w.sum()
        mass = {}
        for j, wj in zip(ok, w):
            mass[int(v[i, j])] = mass.get(int(v[i, j]), 0.0) + wj
        top = max(mass, key=mass.get)
        share = sum(int(v[i, j]) == top for j in ok) / len(ok)
        entropy = -sum(p * math.log(p) for p in mass.values())
        p_lm = mass.get(int(lm_top[i]), 0.0)
        want = [math.log1p(float(d[i, ok].min())), math.log1p(float(d[i, ok].mean())), share, mass[top], entropy,
                math.log(max(p_lm, 1e-6)), float(top == int(lm_top[i])), math.log1p(len(ok))]
        torch.testing.assert_close(got[i].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-4)


def test_gradients_reach_the_temperature_and_match_the_exact_logprob():
    rng = np.random.default_rng(3)
    d, v = neighbours(rng, 20, 8, missing=2)
    m = v == 2
    t = torch.full((20, 1), 1.5, dtype=torch.float64, requires_grad=True)
    got = trainable_logprob(d.double(), m, t)
    exact = knn_logprob_from_matches(d.double(), m, 1.5)
    has = m.any(dim=1)
    torch.testing.assert_close(got[has], exact[has].double(), rtol=1e-5, atol=1e-5)
    assert torch.autograd.gradcheck(lambda x: trainable_logprob(d.double(), m, x), (t,))


def test_fitting_a_toy_case_recovers_the_rule_that_made_it():
    """The neighbours are right (all store the target) exactly when they agree among themselves; the fit must
    trust them there (lambda near its ceiling) and nowhere else (lambda near 0)."""
    rng = np.random.default_rng(4)
    n, k, vocab = 2000, 8, 50
    targets = torch.from_numpy(rng.integers(0, vocab, size=n))
    good = torch.from_numpy(rng.uniform(size=n) < 0.5)  # (n,)
    scattered = torch.from_numpy(rng.integers(0, vocab, size=(n, k)))
    scattered = torch.where(scattered == targets[:, None], (scattered + 1) % vocab, scattered)  # never the target
    v = torch.where(good[:, None], targets[:, None].expand(n, k), scattered)  # (n, k)
    d = torch.from_numpy(rng.uniform(1, 2, size=(n, k)).astype(np.float32))
    lm = torch.full((n,), math.log(0.2))
    lm_feats = lm_cols(rng, n, vocab)
    const = ConstantInterpolation(("knn",), (0.5, 0.5), (1.0,))
    x = token_features(lm_feats, [(d, v)], const.temperatures)
    model = fit_learned(const, x, lm, [(d, v == targets[:, None])], FitConfig(steps=300, lr=0.05))
    lam = model.plan(x).weights[:, 1]
    assert float(lam[good].mean()) > 0.9 * (1 - LM_WEIGHT_FLOOR) and float(lam[~good].mean()) < 0.05


def test_saved_methods_load_to_the_same_plans(tmp_path):
    rng = np.random.default_rng(5)
    sources = [neighbours(rng, 40, 8), neighbours(rng, 40, 6, missing=2)]
    x = token_features(lm_cols(rng, 40), sources, (1.0, 2.0))
    assert x.shape == (40, n_features(2))
    torch.manual_seed(0)
    learned = LearnedInterpolation(("knn", "cache"), (1.0, 2.0), hidden=4, learn_temperature=True).eval()
    const = ConstantInterpolation(("knn", "cache"), (0.8, 0.15, 0.05), (1.0, 2.0))
    for method in (learned, const):
        path = save_method(method, tmp_path / f"{method.method}.json", {"k": 8})
        loaded, settings = load_method(path)
        assert settings == {"k": 8} and loaded.method == method.method
        a, b = method.plan(x), loaded.plan(x)
        assert torch.equal(torch.as_tensor(a.weights), torch.as_tensor(b.weights))
        for ta, tb in zip(a.temperatures, b.temperatures):
            assert torch.equal(torch.as_tensor(ta), torch.as_tensor(tb))
