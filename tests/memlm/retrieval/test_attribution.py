"""Attribution (issue 14, part 5): per scored token, the documents its p_kNN mass came from.

Oracles: the interpolation identity (p = lambda p_kNN + (1 - lambda) p_LM, so p_kNN follows from the
scores' final and base log-probabilities) for "shares sum to the kNN mass"; a document scored as it was
stored for "the top document is that document"; the in-process datastore for the retrieval service."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from memlm.errors import MemlmError
from memlm.jobs.scoring import score_tokens
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import KNNLMConfig

VOCAB, BOS, CONTEXT, STRIDE = 64, 1, 48, 24
SOURCE = BuildSource(model_name="tiny-test", model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64,
                     corpus="random tokens", corpus_fingerprint="c" * 64, boundary_token=BOS)
SETTINGS = BuildSettings(window=WindowConfig(context=CONTEXT, stride=STRIDE, batch_size=1), index_factory="Flat")
KNN = KNNLMConfig(k=16, lmbda=0.5, temperature=1.0)


def tiny_model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("tiny", vocab_size=VOCAB)).eval()


def documents() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(2, VOCAB, size=n).tolist() for n in (200, 90, 150, 120)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = build_from_tokens(tiny_model(), documents(), tmp_path_factory.mktemp("attr") / "store", SOURCE, SETTINGS,
                            progress=False, log=lambda m: None)
    return Datastore.open(out)


def score(model, store, seqs, attribution, knn=KNN):
    return score_tokens(model, seqs, context=CONTEXT, stride=STRIDE, boundary_token=BOS, searcher=store, knn=knn,
                        attribution=attribution)


def test_shares_sum_to_the_knn_mass(store):
    model = tiny_model()
    rng = np.random.default_rng(9)
    seqs = [documents()[1][:40] + rng.integers(2, VOCAB, size=60).tolist()]  # half known, half new text
    (s,) = score(model, store, seqs, attribution=len(store.documents()))  # every document with mass is listed
    assert len(s.attribution) == len(s.tokens)
    lam = KNN.lmbda
    p_knn = (np.exp(s.logprob.astype(np.float64)) - (1 - lam) * np.exp(s.base_logprob.astype(np.float64))) / lam
    for a, want, final in zip(s.attribution, p_knn, s.logprob):
        masses = [d.knn_mass for d in a.documents]
        assert abs(sum(masses) - want) <= 1e-6 and abs(a.knn_prob - want) <= 1e-6
        assert masses == sorted(masses, reverse=True) and all(m > 0 for m in masses)
        assert abs(sum(d.final_share for d in a.documents) - lam * a.knn_prob / np.exp(float(final))) <= 1e-6
        assert a.generation == 0
    assert any(a.documents for a in s.attribution) and any(not a.documents for a in s.attribution)


def test_the_top_document_of_a_stored_document_is_that_document(store):
    model = tiny_model()
    records = store.documents()
    docs = documents()
    results = score(model, store, docs, attribution=2)
    for record, s in zip(records, results):
        tops = [a.documents[0].source.doc_id for a in s.attribution]
        assert tops == [record.doc_id] * len(s.tokens)
        assert all(a.documents[0].source.meta == record.meta for a in s.attribution)
    # Scores do not change with attribution.
    plain = score(model, store, docs, attribution=0)
    for a, b in zip(results, plain):
        np.testing.assert_array_equal(a.logprob, b.logprob)
        assert b.attribution == ()


def test_attribution_needs_a_searcher_with_documents(store):
    model = tiny_model()
    bare = TorchExactSearcher(torch.from_numpy(np.array(store.keys)), np.asarray(store.values), info=store.info())
    with pytest.raises(MemlmError, match="documents table"):
        score(model, bare, [[5, 6, 7]], attribution=1)
    with pytest.raises(MemlmError, match="needs kNN-LM"):
        score_tokens(model, [[5, 6, 7]], context=CONTEXT, stride=STRIDE, boundary_token=BOS, attribution=1)
