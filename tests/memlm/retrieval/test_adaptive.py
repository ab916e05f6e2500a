"""Adaptive retrieval (memlm.retrieval.adaptive, memlm.jobs.adaptive_train): the features
against a dense oracle; threshold 0 (always search) is plain kNN-LM exactly and a threshold above every
score is the base LM exactly; a target fraction of searches saved is met on held-out documents; a saved
gate reopens with the same scores; the searches it keeps are those that help."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlm.jobs.adaptive_train import collect_gate_data, train_gate
from memlm.jobs.knnlm_eval import Retrieval, evaluate_knnlm
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.adaptive import (
    AdaptiveConfig,
    GateConfig,
    distribution_features,
    load_gate,
    save_gate,
    threshold_for_fraction,
)
from memlm.jobs.windows import exact_searcher_over_documents
from memlm.retrieval.knnlm import KNNLMConfig, interpolate, knn_logprob_from_matches

V, BOS = 40, 1
WINDOW = WindowConfig(context=32, stride=16, batch_size=4)
KNN = KNNLMConfig(k=8, lmbda=0.3, temperature=5.0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("tiny", vocab_size=V)).eval()


def phrase_docs(seed: int, n: int, length: int = 120) -> list[list[int]]:
    """Documents that half repeat phrases of the datastore (retrieval helps there) and half are noise."""
    rng = np.random.default_rng(seed)
    phrases = [np.random.default_rng(100 + i).integers(2, V, size=10).tolist() for i in range(4)]
    docs = []
    for _ in range(n):
        doc: list[int] = []
        while len(doc) < length:
            doc += phrases[int(rng.integers(4))] if rng.random() < 0.5 else rng.integers(2, V, size=10).tolist()
        docs.append(doc[:length])
    return docs


@pytest.fixture(scope="module")
def searcher(model):
    return exact_searcher_over_documents(model, phrase_docs(0, 6), WINDOW, BOS)


@pytest.fixture(scope="module")
def fitted(model, searcher):
    tune = phrase_docs(1, 6)
    # With a random tiny model the LM's distribution says little; what retrieval helps with shows in the key.
    return train_gate(model, tune, [f"tune-{i}" for i in range(6)], searcher, WINDOW, KNN, BOS,
                      GateConfig(steps=150, use_key=True), model_fingerprint="m", tune_data="phrases", progress=False)


def test_distribution_features_match_a_dense_oracle():
    logprobs = torch.log_softmax(torch.randn(5, 30) * 3, dim=-1)
    logprobs[0, :10] = float("-inf")  # zero-probability tokens add nothing to the entropy
    f = distribution_features(logprobs)
    p = logprobs.exp().double()
    entropy = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    torch.testing.assert_close(f[:, 0].double(), entropy, rtol=1e-5, atol=1e-5)
    top = logprobs.sort(dim=-1, descending=True).values
    torch.testing.assert_close(f[:, 1:4], top[:, :3])
    torch.testing.assert_close(f[:, 4], top[:, 0] - top[:, 1])


def test_threshold_zero_is_plain_knnlm_and_above_every_score_is_the_base(model, searcher, fitted):
    gate, settings = fitted
    docs = phrase_docs(2, 3)
    plain = evaluate_knnlm(model, docs, searcher, WINDOW, KNN, BOS, progress=False)
    always = evaluate_knnlm(model, docs, searcher, WINDOW, KNN, BOS, progress=False,
                            retrieval=Retrieval(adaptive=AdaptiveConfig(gate, settings, 0.0)))
    assert always["knnlm_nll"] == plain["knnlm_nll"] and always["searches"] == plain["tokens"]
    assert always["searches_saved"] == 0 and plain["searches_saved"] == 0
    never = evaluate_knnlm(model, docs, searcher, WINDOW, KNN, BOS, progress=False,
                           retrieval=Retrieval(adaptive=AdaptiveConfig(gate, settings, 2.0)))
    assert never["knnlm_nll"] == never["base_nll"] == plain["base_nll"]
    assert never["searches"] == 0 and never["adaptive_skipped"] == never["tokens"]


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_a_target_fraction_saves_about_that_fraction(model, searcher, fitted, fraction):
    gate, settings = fitted
    threshold = threshold_for_fraction(settings, fraction)
    result = evaluate_knnlm(model, phrase_docs(3, 4), searcher, WINDOW, KNN, BOS, progress=False,
                            retrieval=Retrieval(adaptive=AdaptiveConfig(gate, settings, threshold)))
    assert result["searches"] + result["searches_saved"] == result["tokens"]
    assert result["searches_saved_fraction"] == pytest.approx(fraction, abs=0.12)


def test_the_gate_keeps_the_searches_that_help_on_held_out_documents(model, searcher, fitted):
    gate, settings = fitted
    assert 0.1 < settings.positive_rate < 0.9  # both classes present in this setting
    assert settings.fitted_documents == tuple(f"tune-{i}" for i in range(6))
    held = collect_gate_data(model, phrase_docs(4, 4), searcher, WINDOW, KNN, BOS, progress=False)
    lm = held.tuning.lm_logprob
    gain = interpolate(lm, knn_logprob_from_matches(held.tuning.distances, held.tuning.matches, KNN.temperature),
                       KNN.lmbda) - lm  # (n,) nats retrieval adds per token
    keep = gate.scores(gate.inputs(held.distribution, held.keys, True)) >= threshold_for_fraction(settings, 0.5)
    assert gain[keep].mean() > gain[~keep].mean() + 0.1  # the kept searches are the ones that help


def test_a_saved_gate_reopens_with_the_same_scores(tmp_path, fitted):
    gate, settings = fitted
    again, same = load_gate(save_gate(gate, settings, tmp_path / "gate"))
    assert same == settings
    x = torch.randn(7, settings.n_features)
    torch.testing.assert_close(again.scores(x), gate.scores(x), rtol=0, atol=0)


def test_a_gate_of_an_earlier_train_gate_is_refused_in_one_line(tmp_path, fitted):
    import json

    from memlm.errors import MemlmError

    gate, settings = fitted
    path = save_gate(gate, settings, tmp_path / "old")
    raw = json.loads((path / "settings.json").read_text())
    del raw["config"]["objective"], raw["config"]["key_components"], raw["key_dim"]  # as the first version wrote it
    (path / "settings.json").write_text(json.dumps(raw))
    with pytest.raises(MemlmError, match="another version of memlm train-gate; fit the gate again"):
        load_gate(path)
