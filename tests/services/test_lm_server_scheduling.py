"""The LM server's model turns (services.lm.scheduler): fair steps, bounded steps, remote
searches without the model, and results that do not depend on how steps interleave.

Real servers on port 0 over the tiny model. The long Score below is 1,200 tokens at window 256, stride 2:
about 470 one-window steps, some seconds of forward work on one CPU thread (measured: 5.4 s in the server,
over 5x FAST_S), while a small Score is one step of a few milliseconds (measured: 10-30 ms); before the
turns, the small Score waited for all of the long one.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest

from memlm.jobs.scoring import score_tokens, score_tokens_segments
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import document_boundary
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm.requests import LMLimits
from services.lm.scheduler import POLL_S, ModelTurns, StepGate
from services.lm.server import start_lm_server
from services.retrieval.client import RetrievalClient, connect_retrieval
from services.retrieval.server import create_retrieval_server

LONG, WINDOW, STRIDE = 1200, 256, 2
LIMITS = LMLimits(max_score_tokens=LONG + 1, max_forward_tokens=1 << 22, max_step_tokens=WINDOW)
"""One window per step for the long Score (about 120K forward tokens)."""
FAST_S = 1.0
"""What "at once" means here: far under the long Score's seconds, far over one step's milliseconds."""


def ids(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 250 + 1 for i in range(n)]  # ids the tiny tokenizer knows


def score_request(seqs: list[list[int]], window: int, stride: int, **kwargs) -> lm_pb2.ScoreRequest:
    return lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=s)) for s in seqs],
                               window_tokens=window, stride_tokens=stride, **kwargs)


def base_logprobs(response: lm_pb2.ScoreResponse) -> list[np.ndarray]:
    return [np.array([t.base_logprob for t in r.tokens], dtype=np.float32) for r in response.results]


def start(module_loop, tiny, searcher=None, **limits) -> tuple[str, object]:
    """(address, servicer) of an LM server with LIMITS changed by `limits`."""
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, searcher, limits=dataclasses.replace(LIMITS, **limits)))
    module_loop.servers.append(started.running.server)
    return f"127.0.0.1:{started.running.port}", started.servicer


@pytest.fixture(scope="module")
def lm(tiny, module_loop):
    address, servicer = start(module_loop, tiny)
    with grpc.insecure_channel(address) as channel:
        yield lm_grpc.LanguageModelServiceStub(channel), servicer


def test_turns_rotate_among_equals_and_a_stopped_waiter_leaves():
    turns = ModelTurns(clock=lambda: 0.0)  # no time passes: every client is charged equally (0)
    never = lambda: False
    a, b, c = (StepGate(turns, never, turns.tenant(name)) for name in "abc")
    ran: list[str] = []
    assert a.enter()

    def one_step(gate: StepGate, name: str) -> None:
        assert gate.enter()
        ran.append(name)
        gate.leave()

    threads = []
    for gate, name in ((b, "b"), (c, "c")):
        threads.append(threading.Thread(target=one_step, args=(gate, name)))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while turns.waiting() < len(threads) and time.monotonic() < deadline:  # b queued before c
            time.sleep(0.001)
    assert a() is False  # a step boundary: the turn goes to b, then c; a queues behind them
    ran.append("a")
    for t in threads:
        t.join(5)
    assert ran == ["b", "c", "a"] and a.holding and a.steps == 1
    assert a() is False and a.holding  # nobody waits: a keeps the turn

    stopped = threading.Event()
    d = StepGate(turns, stopped.is_set, turns.tenant("d"))
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(d.enter()))
    waiter.start()
    time.sleep(5 * POLL_S)
    stopped.set()
    waiter.join(5)
    assert result == [False] and turns.waiting() == 0 and not d.holding
    a.leave()


def test_each_client_gets_equal_model_time_whatever_its_step_size():
    # Client "big" takes 4 s a step, "small" 1 s (a fake clock): small runs 4 steps per big one, so each
    # holds the model as long; round-robin by steps would have given big 4x the time.
    now = [0.0]
    turns = ModelTurns(clock=lambda: now[0])
    ran: list[str] = []

    go = threading.Event()

    def client(name: str, cost: float, steps: int, started: threading.Event) -> None:
        gate = StepGate(turns, lambda: False, turns.tenant(name))
        started.set()
        assert gate.enter()
        go.wait(5)
        for _ in range(steps):
            ran.append(name)
            now[0] += cost  # the step runs with the turn held
            gate()  # its boundary
        gate.leave()

    big_in, small_in = threading.Event(), threading.Event()
    big = threading.Thread(target=client, args=("big", 4.0, 3, big_in))
    big.start()
    assert big_in.wait(5)
    deadline = time.monotonic() + 5
    while turns.entries < 1 and time.monotonic() < deadline:  # big holds the turn
        time.sleep(0.001)
    small = threading.Thread(target=client, args=("small", 1.0, 12, small_in))
    small.start()
    while turns.waiting() < 1 and time.monotonic() < deadline:  # small queued behind it
        time.sleep(0.001)
    go.set()
    for t in (big, small):
        t.join(10)
    # big's first step began before small came; then 4 small steps per big step.
    assert "".join(n[0] for n in ran) == "b" + "ssssb" * 2 + "ssss", ran


def test_a_small_score_does_not_wait_for_a_long_one(tiny, lm):
    # With one model thread running the long Score to its end, the small one would wait all of it.
    stub, _ = lm
    small = score_request([ids(40)], WINDOW, WINDOW // 2)
    stub.Score(small, timeout=30)  # warm
    long_request = score_request([ids(LONG)], WINDOW, STRIDE)
    future = stub.Score.future(long_request, timeout=120)
    time.sleep(0.3)  # the long Score is under way
    latencies = []
    for _ in range(5):
        t0 = time.monotonic()
        stub.Score(small, timeout=30)
        latencies.append(time.monotonic() - t0)
    assert not future.done(), "the long Score ended before the small ones: make it longer"
    assert max(latencies) < FAST_S, latencies
    # The long Score went on meanwhile and its floats are the library's (one window per step), up to the float32
    # rounding of the engine's cache layout (services.lm.score_engine; measured: 2^-20 at most).
    (got,) = base_logprobs(future.result(timeout=120))
    (alone,) = score_tokens(tiny.model, [ids(LONG)], context=WINDOW, stride=STRIDE,
                            boundary_token=document_boundary(tiny.tokenizer), batch_size=1)
    np.testing.assert_allclose(got, alone.base_logprob, rtol=0, atol=2e-6)


def test_interleaved_scores_equal_each_alone(lm):
    stub, _ = lm
    requests = [score_request([ids(n, salt=n)], 64, 16, top_n=2) for n in (300, 500, 77, 410)]
    alone = [stub.Score(r, timeout=60) for r in requests]
    futures = [stub.Score.future(r, timeout=60) for r in requests]  # now their steps interleave or are shared
    for f, a in zip(futures, alone):
        # Calls of one key may share forward passes (engine score rows, services.lm.score_engine): every token, flag and
        # alternative as alone, log-probs within float32 rounding (tests/services/test_lm_engine_score.py).
        got = f.result(timeout=60)
        assert [[(t.token_id, t.is_greedy, [x.token_id for x in t.alternatives]) for t in r.tokens] for r in got.results] == [
            [(t.token_id, t.is_greedy, [x.token_id for x in t.alternatives]) for t in r.tokens] for r in a.results]
        np.testing.assert_allclose([t.logprob for r in got.results for t in r.tokens],
                                   [t.logprob for r in a.results for t in r.tokens], rtol=0, atol=1e-6)


@pytest.mark.parametrize("memory", [None, MemoryConfig("xl", mem_len=64, sink_tokens=4, segment=32)])
def test_the_step_budget_sets_windows_per_step_and_the_scores_stay_the_library_s(tiny, module_loop, memory):
    # 1 window (segment row) per step at max_step_tokens = its length, 4 at 4x: each server equals the library at
    # that batch size bit for bit; across batch sizes, sliding windows differ only in float32 rounding
    # (other padding and matrix shapes), segments not at all.
    seqs = [ids(n, salt=n) for n in (300, 123, 77, 410, 5)]
    boundary = document_boundary(tiny.tokenizer)
    got = {}
    step = 64 if memory is None else memory.segment
    for budget, rows in ((step, 1), (4 * step, 4)):
        address, _ = start(module_loop, tiny, max_step_tokens=budget)
        with grpc.insecure_channel(address) as channel:
            stub = lm_grpc.LanguageModelServiceStub(channel)
            if memory is None:
                response = stub.Score(score_request(seqs, 64, 16), timeout=60)
                library = score_tokens(tiny.model, seqs, context=64, stride=16, boundary_token=boundary,
                                       batch_size=rows)
            else:
                response = stub.Score(lm_pb2.ScoreRequest(
                    inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=s)) for s in seqs],
                    memory_mode=lm_pb2.MEMORY_MODE_XL,
                    memory=lm_pb2.MemoryOptions(segment_tokens=32, memory_tokens=64, sink_tokens=4)), timeout=60)
                library = score_tokens_segments(tiny.model, seqs, memory=memory, boundary_token=boundary,
                                                batch_size=rows)
        got[rows] = base_logprobs(response)
        for g, s in zip(got[rows], library):  # Score runs on the engine: float32 rounding of its cache layout
            np.testing.assert_allclose(g, s.base_logprob, rtol=0, atol=2e-6)
    for one, four in zip(got[1], got[4]):
        np.testing.assert_allclose(one, four, rtol=0, atol=2e-6)


def test_steps_over_the_budget_are_refused_and_get_info_reports_the_limits(tiny, module_loop):
    address, _ = start(module_loop, tiny, max_step_tokens=64)
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        info = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
        assert (info.max_step_tokens, info.max_forward_tokens, info.max_score_entries, info.max_text_chars) == (
            64, LIMITS.max_forward_tokens, LIMITS.max_score_entries, LIMITS.max_text_chars)
        refused = [
            (stub.Score, score_request([ids(100)], 128, 64), "window_tokens"),
            (stub.Score, lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids(100)))],
                                             memory_mode=lm_pb2.MEMORY_MODE_XL,
                                             memory=lm_pb2.MemoryOptions(segment_tokens=128)), "memory.segment_tokens"),
        ]
        for call, request, field in refused:
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=10)
            assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert e.value.details().startswith(f"{field}:") and "max_step_tokens 64" in e.value.details()
        # Within the budget: a window of 64; a 50-token input at window 128 (its one window is 50 long);
        # an XL prompt of 100 tokens in segments of 32.
        stub.Score(score_request([ids(100)], 64, 32), timeout=10)
        stub.Score(score_request([ids(50)], 128, 64), timeout=10)
        # A 100-token prompt without a memory: the engine prefills it in chunks of 64 (it was refused when
        # the one-sequence path encoded a prompt in one forward pass).
        # Greedy: sampled (the default), a draw of eos ended the call with no tokens now and then.
        greedy = lm_pb2.SamplingOptions(temperature=0.0)
        plain = lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=ids(100)), max_new_tokens=2, sampling=greedy)
        assert list(stub.Generate(plain, timeout=10))[-1].finish.completion_tokens == 2
        xl = lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=ids(100)), max_new_tokens=2, sampling=greedy,
                                    memory_mode=lm_pb2.MEMORY_MODE_XL, memory=lm_pb2.MemoryOptions(segment_tokens=32))
        assert list(stub.Generate(xl, timeout=10))[-1].HasField("finish")


class GatedIndex:
    """The test index behind a gate: a search blocks until `release` is set (a hung retrieval service)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    @property
    def dim(self) -> int:
        return self._inner.dim

    def info(self):
        return self._inner.info()

    def search(self, xq, k, options=None):
        self.entered.set()
        assert self.release.wait(30), "test never released the searcher"
        return self._inner.search(xq, k, options)


def test_a_remote_search_does_not_hold_the_model(tiny, index, module_loop, servers):
    # A remote search must not wait on the model thread, or every other call would wait behind it.
    gated = GatedIndex(index)
    retrieval = f"127.0.0.1:{module_loop.start(create_retrieval_server, '127.0.0.1:0', gated)}"
    link = RetrievalClient(retrieval)
    try:
        address, servicer = start(module_loop, tiny, link, max_step_tokens=1024)
        knn = score_request([ids(60)], 48, 24, knn=lm_pb2.KnnOptions(enabled=True, k=8, lambda_weight=0.5,
                                                                     temperature=5.0))
        with grpc.insecure_channel(address) as channel, grpc.insecure_channel(servers["local"]) as local:
            stub = lm_grpc.LanguageModelServiceStub(channel)
            gated.release.set()
            stub.Score(knn, timeout=30)  # warm
            gated.release.clear()
            gated.entered.clear()
            future = stub.Score.future(knn, timeout=60)
            assert gated.entered.wait(10)  # the kNN Score waits on the retrieval service now
            t0 = time.monotonic()
            stub.Score(score_request([ids(40)], 48, 24), timeout=30)
            assert time.monotonic() - t0 < FAST_S
            assert not future.done()
            # Its deadline bounds the search too: no longer than the caller's.
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(knn, timeout=0.5)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 0.5 + FAST_S
            gated.release.set()
            expected = lm_grpc.LanguageModelServiceStub(local).Score(knn, timeout=30)  # the index in process
            assert future.result(timeout=30) == expected
        assert servicer.scheduler.turns.waiting() == 0
    finally:
        gated.release.set()
        link.close()


def test_knn_calls_fail_at_once_while_the_retrieval_link_is_down(tiny, index, module_loop, lm):
    # A kNN Score must not queue for the model and run its first forward step before its search fails.
    server, port = module_loop.run(create_retrieval_server("127.0.0.1:0", index))
    link = connect_retrieval(f"127.0.0.1:{port}", tls=None, token=None)  # watched, as serve lm's link
    try:
        address, servicer = start(module_loop, tiny, link, max_step_tokens=1024)
        knn = score_request([ids(60)], 48, 24, knn=lm_pb2.KnnOptions(enabled=True, k=8, lambda_weight=0.5,
                                                                     temperature=5.0))
        turns = servicer.scheduler.turns
        with grpc.insecure_channel(address) as channel:
            stub = lm_grpc.LanguageModelServiceStub(channel)
            stub.Score(knn, timeout=30)
            module_loop.run(server.stop(None))
            deadline = time.monotonic() + 10
            while link.link_up is not False and time.monotonic() < deadline:
                time.sleep(0.05)
            assert link.link_up is False
            busy = stub.Score.future(score_request([ids(LONG)], WINDOW, STRIDE), timeout=120)  # the model is busy
            deadline = time.monotonic() + 10  # its engine batch (services.lm.score_engine) is made and stepping
            while not any(lane.engine.steps for lane in servicer.engines.lanes() if not lane.key.searches) \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)
            entries = turns.entries
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(knn, timeout=30)
            assert time.monotonic() - t0 < 0.5
            assert turns.entries == entries  # refused before it asked for the model
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "link down" in e.value.details()
            assert not busy.done()
            busy.cancel()
    finally:
        link.close()
