"""One call's failing row ends that call only, with its own status; the calls beside it in the same engine
steps answer exactly what they answer alone. A sampling temperature far below float32's range is served
(it draws the greedy tokens) instead of failing the step.

Real LM server on port 0 over the tiny model, with its datastore in process behind a searcher that fails the
queries asking nprobe FAULTY (the failing call's own settings).
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm.requests import LMLimits
from services.lm.server import start_lm_server

FAULTY = 13
"""The nprobe whose searches fail."""


class FaultySearcher:
    """The datastore; a search with nprobe FAULTY raises (a fault of those queries alone)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    @property
    def dim(self) -> int:
        return self.inner.dim

    def info(self):
        return self.inner.info()

    def search(self, xq, k, options=None):
        if options is not None and options.nprobe == FAULTY:
            raise RuntimeError("the shard for these queries failed")
        return self.inner.search(xq, k, options)


def ids(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 250 + 1 for i in range(n)]  # ids the tiny tokenizer knows


def request(prompt: list[int], n: int, temperature: float = 0.0, **kw) -> lm_pb2.GenerateRequest:
    return lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=prompt), max_new_tokens=n,
                                  sampling=lm_pb2.SamplingOptions(temperature=temperature, seed=7), **kw)


def tokens(responses) -> list[int]:
    return [t.token_id for r in responses if r.HasField("delta") for t in r.delta.tokens]


def answer(stub, request):
    """A Generate's responses (a list) or a Score's response."""
    if isinstance(request, lm_pb2.ScoreRequest):
        return stub.Score(request, timeout=120)
    return list(stub.Generate(request, timeout=120))


def outcomes(stub, requests) -> list:
    """Each call's answer, or its grpc.RpcError, with all calls in flight at once."""
    out: list = [None] * len(requests)
    go = threading.Barrier(len(requests))

    def one(i: int) -> None:
        go.wait(10)
        try:
            out[i] = answer(stub, requests[i])
        except grpc.RpcError as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.fixture(scope="module")
def stub(tiny, index, module_loop):
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, FaultySearcher(index),
                                              limits=LMLimits(max_new_tokens=1000)))
    module_loop.servers.append(started.running.server)
    with grpc.insecure_channel(f"127.0.0.1:{started.running.port}") as channel:
        yield lm_grpc.LanguageModelServiceStub(channel)


def test_a_call_whose_search_fails_ends_alone_with_its_status(stub):
    knn = lm_pb2.KnnOptions(enabled=True, k=8, lambda_weight=0.5, temperature=5.0)
    faulty = lm_pb2.KnnOptions(enabled=True, k=8, lambda_weight=0.5, temperature=5.0, nprobe=FAULTY)
    calls = [request(ids(6), 30), request(ids(9, 1), 30, knn=knn), request(ids(7, 2), 30, knn=faulty),
             request(ids(5, 3), 30, temperature=0.8, knn=knn), request(ids(8, 4), 30, knn=knn)]
    got = outcomes(stub, calls)
    failed = got[2]
    assert isinstance(failed, grpc.RpcError) and failed.code() == grpc.StatusCode.INTERNAL
    assert "shard for these queries failed" in failed.details()
    for call, answer in zip(calls, got):
        if call is not calls[2]:
            assert tokens(answer) == tokens(stub.Generate(call, timeout=60)) and len(tokens(answer)) == 30


def test_a_temperature_below_float32_range_is_served_beside_greedy_calls(stub):
    greedy = [request(ids(6 + i, i), 24) for i in range(3)]
    cold = request(ids(6), 24, temperature=1e-38)
    got = outcomes(stub, [*greedy, cold])
    assert all(not isinstance(g, grpc.RpcError) for g in got)
    assert tokens(got[3]) == tokens(got[0])  # the most likely token each time: the greedy call's tokens
    for call, answer in zip(greedy, got):
        assert tokens(answer) == tokens(stub.Generate(call, timeout=60))


def assert_same_scores(a, b) -> None:
    """Token ids equal, log-probs within float32 rounding (the rows shared other batch shapes)."""
    assert [t.token_id for r in a.results for t in r.tokens] == [t.token_id for r in b.results for t in r.tokens]
    np.testing.assert_allclose([t.logprob for r in a.results for t in r.tokens],
                               [t.logprob for r in b.results for t in r.tokens], rtol=1e-5, atol=1e-5)


def test_a_score_whose_search_fails_ends_alone_with_its_status(stub):
    knn = lm_pb2.KnnOptions(enabled=True, k=8, lambda_weight=0.5, temperature=5.0)
    faulty = lm_pb2.KnnOptions(enabled=True, k=8, lambda_weight=0.5, temperature=5.0, nprobe=FAULTY)

    def score(salt: int, options=None) -> lm_pb2.ScoreRequest:
        return lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids(60, salt)))],
                                   knn=options)

    calls = [score(0, knn), score(1, faulty), score(2), score(3, knn), request(ids(6, 4), 20, knn=knn)]
    got = outcomes(stub, calls)
    failed = got[1]
    assert isinstance(failed, grpc.RpcError) and failed.code() == grpc.StatusCode.INTERNAL
    assert "shard for these queries failed" in failed.details()
    for call, answered in zip(calls, got):
        if call is calls[1]:
            continue
        alone = answer(stub, call)
        if isinstance(call, lm_pb2.ScoreRequest):
            assert_same_scores(answered, alone)
            assert len(answered.results[0].tokens) == 60
        else:
            assert tokens(answered) == tokens(alone) and len(tokens(answered)) == 20
