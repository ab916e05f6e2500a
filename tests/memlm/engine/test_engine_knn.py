"""kNN-LM in the engine: one batched search per step over every row that needs a next token, and greedy
tokens identical to kNN-LM greedy by full recomputation (Khandelwal et al. 2020's mixture, exact search).

Shape legend: N datastore entries, C key width, V vocab, Q queries.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from tiny_models import sharp_tiny_model

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.errors import MemlmError
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import KNNLMConfig, interpolate, knn_log_distribution
from memlm.retrieval.searcher import search_keys

TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
KNN = KNNLMConfig(k=8, lmbda=0.6, temperature=5.0)
GREEDY = SamplingConfig(temperature=0.0)


class CountingSearcher:
    """An exact searcher that records the number of queries of every search."""

    def __init__(self, inner: TorchExactSearcher) -> None:
        self.inner = inner
        self.queries: list[int] = []

    @property
    def dim(self) -> int:
        return self.inner.dim

    def info(self):
        return self.inner.info()

    def search(self, xq, k, options=None):
        self.queries.append(len(xq))
        return self.inner.search(xq, k, options)


def datastore(model) -> TorchExactSearcher:
    """(key, next token) pairs of one text under the model: keys (N, C), values (N,)."""
    ids = [BOUNDARY, *TOK.encode("the cat sat on the mat and the dog sat on the log; " * 3)]
    with torch.inference_mode():
        keys = model(torch.tensor([ids[:-1]])).knn_key[0]  # (N, C)
    return TorchExactSearcher(keys.float(), torch.tensor(ids[1:]).numpy())


def knn_greedy_by_full_recomputation(model, searcher, prefix: list[int], n: int, knn: KNNLMConfig = KNN) -> list[int]:
    seq, out = list(prefix), []
    with torch.inference_mode():
        for _ in range(n):
            o = model(torch.tensor([seq]))
            lm = F.log_softmax(o.logits[0, -1:].float(), -1)  # (1, V)
            nb = search_keys(searcher, o.knn_key[0, -1:], knn.k, knn.search_options)  # (1, k)
            mixed = interpolate(lm, knn_log_distribution(nb, lm.shape[-1], knn.temperature), knn.lmbda)  # (1, V)
            out.append(int(mixed[0, : TOK.vocab_size].argmax()))
            seq.append(out[-1])
    return out


def test_knn_greedy_equals_full_recomputation_with_one_search_per_step() -> None:
    """Rows with different k, lambda and temperature, and one without kNN-LM, share one search per step."""
    model = sharp_tiny_model()
    exact = datastore(model)
    searcher = CountingSearcher(exact)
    prompts = ["the cat", "on the", "a dog and the cat sat", "no knn"]
    settings = [KNN, KNNLMConfig(k=3, lmbda=0.3, temperature=2.0), KNNLMConfig(k=16, lmbda=0.9, temperature=9.0), None]
    reqs = [GenerationRequest(tuple(TOK.encode(p)), 12 + 4 * i, GREEDY, boundary_token=BOUNDARY, knn=c)
            for i, (p, c) in enumerate(zip(prompts, settings))]
    engine = Engine(model, TOK, EngineConfig(max_batch=4, prefill_chunk=8), searcher=searcher)
    handles = [engine.submit(r) for r in reqs]
    results: list[list] = [[] for _ in reqs]
    knn_rows_per_step = []
    while engine.busy:
        engine.step()
        made = [h.ready() for h in handles]
        for out, events in zip(results, made):
            out += events
        knn_rows_per_step.append(sum(any(isinstance(e, TokenEvent) for e in events)
                                     for events, r in zip(made, reqs) if r.knn is not None))
    base = run_all(Engine(model, TOK, EngineConfig(max_batch=4)), [dataclasses.replace(r, knn=None) for r in reqs])
    for req, events, plain in zip(reqs, results, base):
        got = [e.token_id for e in events if isinstance(e, TokenEvent)]
        if req.knn is None:
            assert got == [e.token_id for e in plain if isinstance(e, TokenEvent)]
            continue
        assert got == knn_greedy_by_full_recomputation(model, exact, req.prefix, req.max_new_tokens, req.knn)
        assert got != [e.token_id for e in plain if isinstance(e, TokenEvent)]  # the datastore matters
        assert all(e.logprob != e.base_logprob for e in events if isinstance(e, TokenEvent))
    # One search per step in which kNN rows chose tokens, with exactly those rows as its queries.
    assert searcher.queries == [n for n in knn_rows_per_step if n > 0]
    assert max(searcher.queries) == 3 and sum(searcher.queries) == sum(r.max_new_tokens for r in reqs if r.knn)


class FailingSearcher(CountingSearcher):
    """A retrieval outage: every search from the third on fails."""

    def search(self, xq, k, options=None):
        super().search(xq, k, options)
        if len(self.queries) >= 3:
            raise MemlmError("retrieval service unavailable")
        return self.inner.search(xq, k, options)


def test_a_failed_search_ends_only_the_rows_that_searched() -> None:
    model = sharp_tiny_model()
    searcher = FailingSearcher(datastore(model))
    engine = Engine(model, TOK, EngineConfig(max_batch=3), searcher=searcher)
    plain = GenerationRequest(tuple(TOK.encode("plain")), 10, GREEDY, boundary_token=BOUNDARY)
    with_knn = dataclasses.replace(plain, prompt_ids=tuple(TOK.encode("the cat")), knn=KNN)
    handles = [engine.submit(with_knn), engine.submit(plain), engine.submit(with_knn)]
    with pytest.raises(MemlmError, match="unavailable"):
        list(handles[0].events())
    with pytest.raises(MemlmError, match="unavailable"):
        list(handles[2].events())
    alone = run_all(Engine(model, TOK), [plain])[0]
    went_on = list(handles[1].events())  # the row without kNN-LM went on, unchanged
    assert [e.token_id for e in went_on[:-1]] == [e.token_id for e in alone[:-1]] and went_on[-1] == alone[-1]
    assert searcher.queries[2:] == [2, 1, 1]  # the kNN rows left at the failed search and their own retries
