"""kNN-LM in the engine: one batched search per step over every row that needs a next token, and greedy
tokens identical to kNN-LM greedy by full recomputation (Khandelwal et al. 2020's mixture, exact search).

Shape legend: N datastore entries, C key width, V vocab, Q queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tiny_models import sharp_tiny_model

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.generate import SamplingConfig, TokenEvent
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


def knn_greedy_by_full_recomputation(model, searcher, prefix: list[int], n: int) -> list[int]:
    seq, out = list(prefix), []
    with torch.inference_mode():
        for _ in range(n):
            o = model(torch.tensor([seq]))
            lm = F.log_softmax(o.logits[0, -1:].float(), -1)  # (1, V)
            nb = search_keys(searcher, o.knn_key[0, -1:], KNN.k, KNN.search_options)  # (1, k)
            mixed = interpolate(lm, knn_log_distribution(nb, lm.shape[-1], KNN.temperature), KNN.lmbda)  # (1, V)
            out.append(int(mixed[0, : TOK.vocab_size].argmax()))
            seq.append(out[-1])
    return out


def test_knn_greedy_equals_full_recomputation_with_one_search_per_step() -> None:
    model = sharp_tiny_model()
    exact = datastore(model)
    searcher = CountingSearcher(exact)
    prompts = ["the cat", "on the", "a dog and the cat sat"]
    reqs = [GenerationRequest(tuple(TOK.encode(p)), 12 + 4 * i, GREEDY, boundary_token=BOUNDARY)
            for i, p in enumerate(prompts)]
    engine = Engine(model, TOK, EngineConfig(max_batch=3, prefill_chunk=8, knn=KNN), searcher=searcher)
    results = run_all(engine, reqs)
    base = run_all(Engine(model, TOK, EngineConfig(max_batch=3)), reqs)
    for req, events, plain in zip(reqs, results, base):
        got = [e.token_id for e in events if isinstance(e, TokenEvent)]
        assert got == knn_greedy_by_full_recomputation(model, exact, req.prefix, req.max_new_tokens)
        assert got != [e.token_id for e in plain if isinstance(e, TokenEvent)]  # the datastore matters
        assert all(e.logprob != e.base_logprob for e in events if isinstance(e, TokenEvent))
    # One search per step that chose tokens, all rows at once: as many searches as such steps, and
    # exactly one query per generated token.
    assert len(searcher.queries) == engine.steps
    assert sum(searcher.queries) == sum(r.max_new_tokens for r in reqs)
    assert max(searcher.queries) == 3
