"""kNN-LM evaluation end to end through a Datastore (the in-process Searcher)."""

from __future__ import annotations

from store_helpers import PROVENANCE, WINDOW

from datastore import Datastore
from memlm.jobs.evaluate import evaluate_perplexity
from memlm.jobs.knnlm_eval import evaluate_knnlm
from memlm.retrieval.knnlm import KNNLMConfig

BOS = PROVENANCE.boundary_token


def test_memorisation_oracle_through_the_ivf_datastore(built, tiny_model, docs):
    ds = Datastore.open(built, mmap=True)
    config = KNNLMConfig(k=16, lmbda=0.999, temperature=1e-3, exact_rerank=True, nprobe=16)
    result = evaluate_knnlm(tiny_model, docs, ds, WINDOW, config, BOS, exact_searcher=ds.exact_searcher("cpu"),
                            progress=False)
    assert result["base_perplexity"] > 30
    assert result["knnlm_perplexity"] < 1.05
    assert result["recall_at_k"] == 1.0 and result["recall_queries"] == 256  # all lists probed
    assert result["index"] == "IVF16,Flat" and result["datastore_size"] == 1483


def test_lambda_zero_through_the_datastore_is_the_base_perplexity(built, tiny_model, docs):
    ds = Datastore.open(built)
    result = evaluate_knnlm(tiny_model, docs[:2], ds, WINDOW, KNNLMConfig(k=32, lmbda=0.0), BOS, progress=False)
    assert result["knnlm_perplexity"] == evaluate_perplexity(tiny_model, docs[:2], WINDOW, BOS, False)["perplexity"]
    assert "recall_at_k" not in result  # no exact searcher given: no recall
