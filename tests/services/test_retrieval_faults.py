"""A dead or hung retrieval service fails kNN calls fast and delays nothing else.

A real retrieval server runs as a child process (over the tiny model's keys) that the tests kill, stop
(SIGSTOP, a hung service) and restart on the same port; the LM server runs in-process on port 0 and
reaches it through a link with wait_for_ready on, the setting with which a kNN Score after the kill
would wait out its deadline and hold the model thread meanwhile.
The shard router gets the same treatment over that process as its one shard (a hung shard, a caller
without a deadline). Every wait is bounded; timings are asserted with wide margins against a 60 s wait.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memlm.retrieval.knnlm import KNNLMConfig
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_pb2_grpc
from services.common.circuit import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker
from services.lm.client import KnnRequest, LanguageModelClient
from services.lm.server import start_lm_server
from services.retrieval.client import (
    KNN_HEALTH_NAME,
    RetrievalClient,
    connect_retrieval,
)
from services.router.server import ShardLinks, create_router_server
from services.common.server import ServiceError

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
TEXT = "the quick brown fox jumps over the lazy dog"

RETRIEVAL_SERVER = textwrap.dedent(
    """
    import asyncio, sys
    from memlm.jobs.windows import WindowConfig
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained
    from memlm.jobs.windows import exact_searcher_over_documents
    from services.retrieval.server import serve_retrieval

    tiny = load_pretrained("tiny")
    tok = tiny.tokenizer
    docs = [tok.encode("the lazy dog and the quick fox " * 3)]
    index = exact_searcher_over_documents(tiny.model, docs, WindowConfig(48, 24, 4), document_boundary(tok),
                                          model_fingerprint=tiny.fingerprint, tokenizer_fingerprint=tok.fingerprint)
    asyncio.run(serve_retrieval(index, "127.0.0.1", int(sys.argv[1])))
    """
)


class RetrievalProcess:
    """`serve_retrieval` in a child process; start() waits (bounded) for its `listening on` line."""

    def __init__(self) -> None:
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RETRIEVAL_SERVER, str(self.port)], cwd=REPO, env=ENV,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line.strip()) for line in self.proc.stdout], daemon=True).start()
        first = lines.get(timeout=60)
        assert first.startswith("listening on 127.0.0.1:"), first
        self.port = int(first.rsplit(":", 1)[1])  # the same port again on a restart

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped one cannot die otherwise
            self.kill()


@pytest.fixture(scope="module")
def retrieval():
    process = RetrievalProcess()
    process.start()
    yield process
    process.close()


@pytest.fixture(scope="module")
def lm(tiny, retrieval, module_loop):
    """The address of an LM server over the child retrieval server."""
    link = RetrievalClient(retrieval.address, wait_for_ready=True, timeout=60)  # what serve lm built before
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, link, model_name="tiny", knn_defaults=KNN))
    module_loop.servers.append(started.running.server)
    yield f"127.0.0.1:{started.running.port}"
    link.close()


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def wait_for_health(address: str, service: str, status: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while health(address, service) != status:
        assert time.monotonic() < deadline, f"{service!r} never became {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
        time.sleep(0.1)


def timed(fn):
    """(fn(), seconds it took)."""
    start = time.monotonic()
    out = fn()
    return out, time.monotonic() - start


def test_killed_retrieval_fails_knn_fast_delays_no_plain_score_and_health_follows(lm, retrieval):
    address = lm
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with LanguageModelClient(address, timeout=30) as c:
        before = c.score([TEXT], knn=KnnRequest())  # the link works
        assert health(address, KNN_HEALTH_NAME) == serving
        retrieval.kill()
        # Noticed without any kNN call (the link watcher asks the idle channel to reconnect).
        wait_for_health(address, KNN_HEALTH_NAME, not_serving, within_s=15)
        assert health(address, "memlm.v1.LanguageModelService") == serving  # the base LM still serves
        assert health(address, "") == serving

        # A kNN Score and a plain one sent right behind it: both answer quickly (old: 60 s, and the plain one
        # queued behind the kNN one on the model thread).
        plain_out = {}
        plain_call = threading.Thread(target=lambda: plain_out.setdefault("r", timed(lambda: c.score([TEXT]))))
        start = time.monotonic()
        with pytest.raises(ServiceError) as e:
            plain_call.start()
            c.score([TEXT], knn=KnnRequest())
        knn_s = time.monotonic() - start
        plain_call.join(30)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert f"retrieval service {retrieval.address}" in e.value.details and "link down" in e.value.details
        assert knn_s < 10, knn_s  # not the 60 s of a wait for ready (the client's deadline here: 30 s)
        plain, plain_s = plain_out["r"]
        assert plain_s < 10, plain_s
        assert plain[0].total_logprob == pytest.approx(before[0].base_total_logprob, abs=1e-4)

        retrieval.start()  # the same port
        wait_for_health(address, KNN_HEALTH_NAME, serving, within_s=20)
        after = c.score([TEXT], knn=KnnRequest())
        assert after[0].total_logprob == pytest.approx(before[0].total_logprob, abs=1e-4)


def test_hung_retrieval_holds_nothing_past_the_callers_deadline(lm, retrieval):
    address = lm
    with LanguageModelClient(address, timeout=30) as c:
        c.score([TEXT], knn=KnnRequest())  # connected
        retrieval.proc.send_signal(signal.SIGSTOP)  # the connection stays up; searches hang
        try:
            hung = LanguageModelClient(address, timeout=2)
            with pytest.raises(ServiceError) as e:
                hung.score([TEXT], knn=KnnRequest())
            hung.close()
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            # The model thread was free by the kNN caller's deadline: a plain Score right after is quick
            # (old: the search waited out the link's own 60 s deadline, holding the model thread).
            _, plain_s = timed(lambda: c.score([TEXT]))
            assert plain_s < 5, plain_s
        finally:
            retrieval.proc.send_signal(signal.SIGCONT)
        c.score([TEXT], knn=KnnRequest())  # and kNN works again


def test_a_cancelled_knn_score_frees_the_model_thread_while_its_search_hangs(lm, retrieval):
    address = lm
    with LanguageModelClient(address, timeout=30) as c, grpc.insecure_channel(address) as channel:
        c.score([TEXT], knn=KnnRequest())  # connected
        retrieval.proc.send_signal(signal.SIGSTOP)
        try:
            request = lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(text=TEXT)], knn=KnnRequest().to_proto())
            call = lm_pb2_grpc.LanguageModelServiceStub(channel).Score.future(request, timeout=30)
            time.sleep(1.0)  # the tiny model's forward takes milliseconds: the search is waiting by now
            call.cancel()
            # Old: the search waited out the caller's 30 s deadline on the model thread.
            _, plain_s = timed(lambda: c.score([TEXT]))
            assert plain_s < 5, plain_s
        finally:
            retrieval.proc.send_signal(signal.SIGCONT)
        c.score([TEXT], knn=KnnRequest())


def test_serve_lm_link_fails_knn_fast_right_after_the_kill(tiny, retrieval, loop_thread):
    """The link `memlm serve lm --retrieval` opens (connect_retrieval): no wait for the watcher to notice."""
    link = connect_retrieval(retrieval.address, tls=None, token=None)
    try:
        started = loop_thread.run(start_lm_server("127.0.0.1:0", tiny, link, model_name="tiny", knn_defaults=KNN))
        loop_thread.servers.append(started.running.server)
        address = f"127.0.0.1:{started.running.port}"
        with LanguageModelClient(address, timeout=30) as c:
            c.score([TEXT], knn=KnnRequest())
            retrieval.kill()
            start = time.monotonic()
            with pytest.raises(ServiceError) as e:
                c.score([TEXT], knn=KnnRequest())
            knn_s = time.monotonic() - start
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and retrieval.address in e.value.details
            assert knn_s < 10, knn_s  # not the caller's whole deadline (30 s here)
            _, plain_s = timed(lambda: c.score([TEXT]))
            assert plain_s < 10, plain_s
            retrieval.start()
            wait_for_health(address, KNN_HEALTH_NAME, health_pb2.HealthCheckResponse.SERVING, within_s=20)
            c.score([TEXT], knn=KnnRequest())
    finally:
        link.close()


def test_router_bounds_a_hung_shard_without_a_caller_deadline_then_fails_fast_and_recovers(retrieval, loop_thread):
    links = ShardLinks(call_timeout_s=2.0, breaker=BreakerConfig(failure_threshold=1, backoff_s=3.0))
    port = loop_thread.start(create_router_server, "127.0.0.1:0", [retrieval.address], shards=links)
    with RetrievalClient(f"127.0.0.1:{port}", timeout=None) as client:  # no deadline of its own
        xq = np.random.default_rng(0).standard_normal((2, client.dim)).astype(np.float32)  # (Q, d)
        expected = client.search(xq, 4)
        retrieval.proc.send_signal(signal.SIGSTOP)
        try:
            out = {}

            def search() -> None:
                try:
                    client.search(xq, 4)
                except ServiceError as e:
                    out["error"] = e

            hung = threading.Thread(target=search, daemon=True)
            hung.start()
            hung.join(20)  # old: no deadline anywhere, so it waited for the shard forever
            assert not hung.is_alive(), "the router waited on a hung shard without a deadline"
            assert out["error"].code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert f"shard {retrieval.address}" in out["error"].details
            start = time.monotonic()
            with pytest.raises(ServiceError) as e:  # the breaker is open: refused without waiting
                client.search(xq, 4)
            assert time.monotonic() - start < 1.5
            assert e.value.code == grpc.StatusCode.UNAVAILABLE and "circuit open" in e.value.details
        finally:
            retrieval.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 15
        while True:  # the trial after the back-off goes through
            try:
                got = client.search(xq, 4)
                break
            except ServiceError:
                assert time.monotonic() < deadline, "the router never recovered"
                time.sleep(0.2)
        np.testing.assert_array_equal(got.ids, expected.ids)


def test_start_up_against_a_closed_port_fails_fast_in_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    command = [sys.executable, "-m", "memlm", "serve", "lm", "--model", "tiny", "--port", "0",
               "--retrieval", f"127.0.0.1:{port}"]
    done = subprocess.run(command, check=False, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=40)
    took = time.monotonic() - start
    assert done.returncode == 1, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "not reachable within" in lines[0], done.stderr
    assert took < 25, took  # old: 62 s of silence, then "Deadline Exceeded"


def test_breaker_opens_after_repeated_failures_backs_off_and_closes_on_success():
    now = [0.0]
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=2, backoff_s=1.0, max_backoff_s=3.0), clock=lambda: now[0])
    assert breaker.allow() and breaker.state == CLOSED
    breaker.record_failure()
    assert breaker.state == CLOSED  # one failure is not enough
    breaker.record_failure()
    assert breaker.state == OPEN and not breaker.allow() and breaker.retry_in() == pytest.approx(1.0)
    now[0] = 1.0
    assert breaker.state == HALF_OPEN and breaker.allow()  # the one trial
    assert not breaker.allow()  # a second caller waits for the trial's outcome
    breaker.record_failure()  # the trial failed: twice the back-off
    assert breaker.retry_in() == pytest.approx(2.0)
    now[0] = 3.0
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.retry_in() == pytest.approx(3.0)  # capped at max_backoff_s
    now[0] = 6.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.allow()
    breaker.record_failure()
    assert breaker.state == CLOSED  # the count started again
