"""The continuous cache (Grave et al. 2017) against a brute-force oracle, and lambda 0 against the base."""

from __future__ import annotations

import math

import pytest
import torch

from memlm.jobs.continuous_cache import evaluate_continuous_cache
from memlm.jobs.segment_eval import evaluate_memory
from memlm.model.memory_config import MemoryConfig
from memlm.model.weights import load_pretrained, random_model
from memlm.retrieval.knnlm import KNNLMConfig

BOUNDARY = 0


@pytest.fixture(scope="module")
def model():
    return random_model(load_pretrained("tiny").model.config, 0, "cpu", torch.float32).eval()


def _docs(lengths, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["none", "xl"])
def test_lambda_zero_is_the_base_exactly(model, kind) -> None:
    docs = _docs((150, 90, 200))
    memory = MemoryConfig(kind=kind, segment=32, mem_len=32)
    base = evaluate_memory(model, docs, memory, boundary_token=BOUNDARY, batch_size=2)
    cached = evaluate_continuous_cache(model, docs, memory, 64, KNNLMConfig(k=16, lmbda=0.0),
                                       boundary_token=BOUNDARY, batch_size=2)
    assert cached["nll"] == cached["base_nll"] == base["nll"]
    assert cached["tokens"] == base["tokens"] == sum(len(d) for d in docs)


def _oracle_nll(model, doc, segment, size, lmbda, temperature) -> float:
    """Brute force: every earlier position of the document within reach of the cache (the last `size`
    positions before the segment, plus the segment's earlier ones), no top-k."""
    seq = [BOUNDARY, *doc]
    inputs, targets = seq[:-1], seq[1:]
    keys, logps = [], []
    with torch.no_grad():
        for lo in range(0, len(inputs), segment):  # memory "none": each segment alone
            out = model(torch.tensor([inputs[lo : lo + segment]]))
            keys.append(out.knn_key[0].double())
            logps.append(torch.log_softmax(out.logits[0].double(), -1))
    keys, logps = torch.cat(keys), torch.cat(logps)
    total = 0.0
    for t, target in enumerate(targets):
        start = (t // segment) * segment
        reach = range(max(0, start - size), t)
        lm = math.exp(float(logps[t, target]))
        if reach:
            w = torch.tensor([math.exp(-float((keys[t] - keys[i]).pow(2).sum()) / temperature) for i in reach],
                             dtype=torch.float64)
            hit = torch.tensor([targets[i] == target for i in reach])
            p_cache = float(w[hit].sum() / w.sum())
        else:
            p_cache = 0.0
        total -= math.log(lmbda * p_cache + (1 - lmbda) * lm)
    return total / len(targets)


def test_equals_a_brute_force_cache_when_k_covers_it(model) -> None:
    doc = _docs((70,), vocab=8, seed=1)[0]  # few distinct tokens: the cache often predicts the target
    segment, size = 16, 20
    memory = MemoryConfig(kind="none", segment=segment)
    keys_scale = evaluate_continuous_cache(model, [doc], memory, size, KNNLMConfig(k=64, lmbda=0.0),
                                           boundary_token=BOUNDARY)
    assert keys_scale["nll"] == keys_scale["base_nll"]
    temperature = 50.0
    got = evaluate_continuous_cache(model, [doc], memory, size, KNNLMConfig(k=64, lmbda=0.3, temperature=temperature),
                                    boundary_token=BOUNDARY)
    want = _oracle_nll(model, doc, segment, size, 0.3, temperature)
    assert got["nll"] == pytest.approx(want, rel=1e-5)
    assert got["nll"] != got["base_nll"]


def test_tunes_lambda_and_temperature_on_the_tuning_documents(model) -> None:
    docs = _docs((120, 80), vocab=8, seed=2)
    tune_docs = _docs((120, 100), vocab=8, seed=3)
    memory = MemoryConfig(kind="xl", segment=32, mem_len=32)
    r = evaluate_continuous_cache(model, docs, memory, 64, KNNLMConfig(k=32, lmbda=None, temperature=None),
                                  boundary_token=BOUNDARY, tune_docs=tune_docs)
    assert r["tuned"] and 0.0 <= r["lambda"] <= 1.0 and r["temperature"] > 0
    # Repetitive text (8 distinct tokens): a cache tuned on other such documents helps on these.
    assert r["perplexity"] < r["base_perplexity"]
