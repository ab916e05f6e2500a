"""Score on the decoding engine (services.lm.score_engine): calls from different clients, and Generate
rows, share engine steps; each Score equals itself alone.

Real servers on port 0 over the tiny model. Oracle: each call alone on the same server (and the library, in
tests/memlm/engine/test_engine_score.py and tests/services/test_lm_server.py). A call in a shared batch has the
same tokens, greedy flags and alternatives as alone, its log-probs within float32 rounding (tiny_models.logprobs_close).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest
from tiny_models import logprobs_close

from memlm.jobs.scoring import plan_scored_windows, score_tokens
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import document_boundary
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm.args import ScoreArgs
from services.lm.engine import RETRY_AFTER_KEY, LaneKey
from services.lm.requests import LMLimits
from services.lm.score_engine import ALONE, BATCHED, ENGINE, score_path
from services.lm.server import start_lm_server

WAIT_S = 30.0
"""How long a poll for a state waits (not a latency bound: the assert after the poll decides)."""
KNN = lm_pb2.KnnOptions(enabled=True, k=8, lambda_weight=0.5, temperature=5.0)


def ids(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 250 + 1 for i in range(n)]  # ids the tiny tokenizer knows


def start(module_loop, tiny, searcher=None, **limits):
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, searcher, limits=dataclasses.replace(
        LMLimits(max_score_tokens=4001, max_forward_tokens=1 << 22, max_new_tokens=100_000), **limits)))
    module_loop.servers.append(started.running.server)
    return f"127.0.0.1:{started.running.port}", started.servicer


def score(n: int, **kw) -> lm_pb2.ScoreRequest:
    return lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids(n, salt=n)))], **kw)


def concurrently(stub, requests) -> list[lm_pb2.ScoreResponse]:
    out = [None] * len(requests)
    go = threading.Barrier(len(requests))

    def one(i):
        go.wait(10)
        out[i] = stub.Score(requests[i], timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def same(got: lm_pb2.ScoreResponse, want: lm_pb2.ScoreResponse) -> None:
    def exact(r):
        return [[(t.token_id, t.is_greedy, [a.token_id for a in t.alternatives]) for t in x.tokens] for x in r.results]

    assert exact(got) == exact(want)
    for field in ("logprob", "base_logprob"):
        g, w = ([getattr(t, field) for x in r.results for t in x.tokens] for r in (got, want))
        assert logprobs_close(g, w), (field, g, w)


def steps(servicer) -> int:
    return sum(lane.engine.steps for lane in servicer.engines.lanes())


def test_concurrent_scores_share_engine_steps_and_equal_each_alone(tiny, module_loop):
    address, servicer = start(module_loop, tiny, max_step_tokens=256)
    windows = [score(n, window_tokens=64, stride_tokens=16, top_n=2) for n in (300, 500, 77, 410, 120, 90)]
    xl = [score(n, memory_mode=lm_pb2.MEMORY_MODE_XL, top_n=1,
                memory=lm_pb2.MemoryOptions(segment_tokens=32, memory_tokens=64, sink_tokens=4))
          for n in (300, 123, 77, 410, 5, 260)]
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        for group in (windows, xl):
            alone, alone_steps = [], 0
            for r in group:
                before = steps(servicer)
                alone.append(stub.Score(r, timeout=60))
                alone_steps += steps(servicer) - before
            before = steps(servicer)
            together = concurrently(stub, group)
            assert steps(servicer) - before < alone_steps  # rows of several calls ran in the same steps
            for t, a in zip(together, alone):
                same(t, a)
    assert servicer.score_batches.batches == 0  # none took the library's batcher


def test_a_long_text_is_read_by_several_rows_side_by_side(tiny, module_loop):
    # max_step_tokens 256 at window 64: the library ran 4 windows a pass; the engine splits the text over 4 rows.
    address, servicer = start(module_loop, tiny, max_step_tokens=256)
    n, (window, stride) = 500, (64, 16)
    windows = len(plan_scored_windows(n, 0, window, stride))
    with grpc.insecure_channel(address) as channel:
        got = lm_grpc.LanguageModelServiceStub(channel).Score(score(n, window_tokens=window, stride_tokens=stride),
                                                              timeout=60)
    assert len(got.results[0].tokens) == n
    # 4 windows a step at best (one row each); the rows are admitted one after another, so the first steps may
    # start before the last row is in. Side by side means far fewer steps than one window a step (29).
    assert -(-windows // 4) <= steps(servicer) < windows / 2


def test_a_score_beside_running_generations_equals_score_alone(tiny, index, module_loop):
    address, servicer = start(module_loop, tiny, index, max_step_tokens=128)
    quick = tiny.tokenizer.encode("The quick")  # no end-of-text for thousands of greedy tokens
    generate = [lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=quick), max_new_tokens=100_000,
                                       sampling=lm_pb2.SamplingOptions(temperature=0.0), knn=knn)
                for knn in (KNN, lm_pb2.KnnOptions())]
    calls = [score(n, top_n=2, knn=knn) for n in (200, 60) for knn in (KNN, lm_pb2.KnnOptions())]
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        alone = [stub.Score(r, timeout=60) for r in calls]
        running = [stub.Generate(r, timeout=120) for r in generate]
        for stream in running:
            assert next(stream).HasField("delta")
        lanes = {lane.key for lane in servicer.engines.lanes()}
        beside = concurrently(stub, calls)
        assert {lane.key for lane in servicer.engines.lanes()} == lanes  # in the Generate calls' batches
        assert lanes == {LaneKey(None, True), LaneKey(None, False)}
        for b, a in zip(beside, alone):
            same(b, a)
        assert [list(r.datastore_generations) for r in beside] == [[0], [], [0], []]  # searched (exact: 0)
        for stream in running:
            stream.cancel()


def test_a_full_server_refuses_a_score_with_a_retry_hint_and_a_cancelled_call_frees_its_rows(tiny, module_loop):
    address, servicer = start(module_loop, tiny, max_batch=1, max_queue=0)
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        want = stub.Score(score(100, window_tokens=32, stride_tokens=16), timeout=60)
        running = stub.Generate(lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=ids(5)),
                                                       max_new_tokens=100_000), timeout=120)
        assert next(running).HasField("delta")
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(score(100, window_tokens=32, stride_tokens=16), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in e.value.details()
        assert int(dict(e.value.trailing_metadata())[RETRY_AFTER_KEY]) >= 1
        running.cancel()
        deadline = time.monotonic() + WAIT_S
        while not all(lane.idle for lane in servicer.engines.lanes()) and time.monotonic() < deadline:
            time.sleep(0.01)
        same(stub.Score(score(100, window_tokens=32, stride_tokens=16), timeout=30), want)


def test_a_call_with_more_inputs_than_the_queue_holds_waits_for_its_own_rows(tiny, module_loop):
    address, _ = start(module_loop, tiny, max_batch=2, max_queue=1)
    seqs = [ids(n, salt=n) for n in (90, 40, 130, 7, 60, 75, 20, 100)]
    request = lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=s)) for s in seqs],
                                  window_tokens=32, stride_tokens=16)
    with grpc.insecure_channel(address) as channel:
        got = lm_grpc.LanguageModelServiceStub(channel).Score(request, timeout=60)
    want = score_tokens(tiny.model, seqs, context=32, stride=16, boundary_token=document_boundary(tiny.tokenizer))
    for r, w in zip(got.results, want):
        assert [t.token_id for t in r.tokens] == w.tokens.tolist()
        assert logprobs_close([t.logprob for t in r.tokens], w.logprob)


def test_a_call_that_gives_up_leaves_the_batch_and_the_others_are_served(tiny, module_loop):
    address, servicer = start(module_loop, tiny, max_step_tokens=256)
    requests = [score(n, window_tokens=64, stride_tokens=16) for n in (200, 300, 250)]
    blocker = score(4000, window_tokens=256, stride_tokens=8)
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        alone = [stub.Score(r, timeout=60) for r in requests]
        busy = stub.Score.future(blocker, timeout=120)
        futures = [stub.Score.future(r, timeout=60) for r in requests]
        futures[1].cancel()
        busy.cancel()
        for i in (0, 2):
            same(futures[i].result(timeout=60), alone[i])
        assert futures[1].cancelled() and busy.cancelled()
        deadline = time.monotonic() + WAIT_S
        while not all(lane.idle for lane in servicer.engines.lanes()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(lane.idle for lane in servicer.engines.lanes())  # the cancelled calls' rows are free
        assert servicer.scheduler.turns.waiting() == 0


def test_score_path_says_where_each_score_runs():
    base = ScoreArgs(token_seqs=[[1]], contexts=[[]], context=8, stride=4, knn=None, top_n=0, memory=None,
                     spalm=None, batch_size=1)
    knn = KNNLMConfig(k=4, lmbda=0.5, temperature=1.0)

    def with_(**kw) -> ScoreArgs:
        return dataclasses.replace(base, **kw)

    class NotOurDecoder:
        pass

    from memlm.model.weights import load_pretrained

    model = load_pretrained("tiny").model
    assert score_path(base, model) == ENGINE
    assert score_path(with_(knn=knn, top_n=3), model) == ENGINE
    for kind in ("xl", "compressive"):
        assert score_path(with_(memory=MemoryConfig(kind), knn=knn), model) == ENGINE
    assert score_path(with_(knn=knn, attribution=2), model) == BATCHED
    assert score_path(base, NotOurDecoder()) == BATCHED
    assert score_path(with_(memory=MemoryConfig("memorizing")), model) == ALONE
    assert score_path(with_(spalm=object()), model) == ALONE
    assert score_path(with_(knn=knn, retrieval=object()), model) == ALONE


def test_a_call_cancelled_while_its_inputs_are_submitted_cancels_every_stream_it_submitted(tiny, module_loop,
                                                                                          monkeypatch):
    from services.lm import score_engine as lm_score_engine

    real, submitted, release = lm_score_engine._submit_some, [], threading.Event()

    def held(*args):  # submits, then holds the worker thread until the client has cancelled
        out = real(*args)
        submitted.extend(stream for _, stream in out[0])
        release.wait(WAIT_S)
        return out

    monkeypatch.setattr(lm_score_engine, "_submit_some", held)
    address, servicer = start(module_loop, tiny, max_step_tokens=256)
    with grpc.insecure_channel(address) as channel:
        call = lm_grpc.LanguageModelServiceStub(channel).Score.future(score(4000, window_tokens=256, stride_tokens=8),
                                                                      timeout=120)
        deadline = time.monotonic() + WAIT_S
        while not submitted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert submitted
        call.cancel()
        time.sleep(0.5)  # the server sees the cancel while the worker thread still holds the submitted streams
        release.set()
        deadline = time.monotonic() + WAIT_S
        while not all(lane.idle for lane in servicer.engines.lanes()) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert call.cancelled()
    assert all(s.handle.cancelled for s in submitted)  # cancelled, not left to read all their windows
    assert all(lane.idle for lane in servicer.engines.lanes())
