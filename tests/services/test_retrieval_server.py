"""RetrievalService with real servers on port 0: the remote Searcher equals the local one.

Shape legend: N datastore entries, d key dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import os
import queue
import signal
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
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlm.retrieval.searcher import SearchOptions
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc, tensor_pb2
from services.retrieval.client import RetrievalClient
from services.retrieval.server import (
    BatchingOptions,
    SearchLimits,
    create_retrieval_server,
    info_from_proto,
    start_retrieval_server,
)
from services.common.server import ServerOptions, ServiceError

REPO = Path(__file__).resolve().parents[2]


def assert_same(a, b):
    for name, x, y in zip(("distances", "ids", "values"), a, b):
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def queries(q: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((q, d)).astype(np.float32)  # (Q, d)


def wait_until(predicate, timeout: float = 10.0) -> None:
    """Bounded poll for server-side state the client cannot observe directly."""
    until = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > until:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


@pytest.mark.parametrize("q, k", [(1, 1), (7, 10), (100, 64), (5, 3500)])  # k=3500 > N: padded
def test_remote_search_equals_local(loop_thread, searcher, q, k):
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher)
    xq = queries(q, searcher.dim, seed=q)
    with RetrievalClient(f"127.0.0.1:{port}") as client:
        assert client.dim == searcher.dim
        remote = client.search(xq, k)
        assert_same(remote, searcher.search(xq, k))
        # float16 queries travel as float16 and are widened exactly on the server.
        assert_same(client.search(xq.astype(np.float16), k), searcher.search(xq.astype(np.float16).astype(np.float32), k))
    if k > searcher.index.ntotal:
        assert (remote.ids[:, -1] == -1).all() and np.isinf(remote.distances[:, -1]).all()


def test_search_options_reach_the_searcher_as_sent(loop_thread, make_searcher):
    s = make_searcher(200, 8, seed=1)
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", s)
    sent = [None, SearchOptions(nprobe=7), SearchOptions(exact_rerank=True), SearchOptions(nprobe=2, exact_rerank=True)]
    with RetrievalClient(f"127.0.0.1:{port}") as client:
        for options in sent:
            client.search(queries(2, 8, 0), 3, options)
    # None travels as the defaults: every searcher call gets a typed SearchOptions, never kwargs.
    assert [options for _, _, options in s.calls] == [SearchOptions(), *sent[1:]]


def test_client_splits_batches_over_the_message_limit(loop_thread, searcher):
    limit = 256 * 1024
    port = loop_thread.start(
        create_retrieval_server, "127.0.0.1:0", searcher, options=ServerOptions(max_message_bytes=limit),
        batching=BatchingOptions(micro_batching=False),
    )
    searcher.calls.clear()
    xq = queries(500, searcher.dim, seed=3)  # response 500 * 100 * 16 B = 800 kB > 256 kB
    with RetrievalClient(f"127.0.0.1:{port}") as client:
        assert_same(client.search(xq, 100), searcher.search(xq, 100))
    remote_calls = searcher.calls[:-1]  # the last one is our local oracle call
    assert len(remote_calls) >= 4 and sum(q for q, _, _ in remote_calls) == 500
    assert all(q * 100 * 16 < limit for q, _, _ in remote_calls)


def test_health_reflection_and_info(loop_thread, searcher):
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "memlm.v1.RetrievalService"):
            assert check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"memlm.v1.RetrievalService", "grpc.health.v1.Health"} <= names
        info = retrieval_pb2_grpc.RetrievalServiceStub(channel).GetInfo(retrieval_pb2.RetrievalServiceGetInfoRequest(), timeout=10)
    # Every SearcherInfo field survives the wire (the fixture's values differ from proto defaults).
    assert info_from_proto(info.datastore) == searcher.info()
    assert info.datastore.n == 3000 and info.datastore.dim == 32 and info.datastore.boundary_token == 0


# ---------------------------------------------------------------------------------------------
# Malformed requests: each generated request is wrong in exactly one way, so the expected status
# and the field its message must name are known.

D, MAX_K, MAX_Q = 8, 50, 64
F32, F16 = tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_FLOAT16
INVALID, RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE


def _tensor(a: np.ndarray, dtype=F32, shape=None) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=dtype, shape=a.shape if shape is None else shape, data=a.tobytes())


@st.composite
def malformed(draw):
    q = draw(st.integers(1, 5))
    xq = np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal((q, D)).astype(np.float32)  # (Q, D)
    good = dict(queries=_tensor(xq), k=draw(st.integers(1, MAX_K)))
    kind = draw(
        st.sampled_from(["dtype", "ndim", "dim", "bytes", "nonfinite", "k_low", "k_high", "empty", "too_many", "missing", "nprobe", "negative_shape"])
    )
    if kind == "dtype":
        dtype = draw(st.sampled_from([d for d in tensor_pb2.DType.values() if d not in (F32, F16)] + [42, -3]))
        return dict(good, queries=_tensor(xq, dtype=dtype)), INVALID, "queries.dtype"
    if kind == "ndim":
        shape = draw(st.sampled_from([[q * D], [q, D, 1], [], [1, q, D]]))
        return dict(good, queries=_tensor(xq, shape=shape)), INVALID, "queries.shape"
    if kind == "dim":
        d = draw(st.integers(1, 20).filter(lambda d: d != D))
        return dict(good, queries=_tensor(np.zeros((q, d), np.float32))), INVALID, "queries.shape[1]"
    if kind == "bytes":
        cut = draw(st.integers(1, xq.nbytes))
        t = _tensor(xq)
        t.data = t.data[:-cut] if draw(st.booleans()) else t.data + b"\0" * cut
        return dict(good, queries=t), INVALID, "queries.data"
    if kind == "nonfinite":
        bad = xq.copy()
        bad[draw(st.integers(0, q - 1)), draw(st.integers(0, D - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        return dict(good, queries=_tensor(bad)), INVALID, "queries.data"
    if kind == "k_low":
        return dict(good, k=draw(st.integers(-(2**31), 0))), INVALID, "k"
    if kind == "k_high":
        return dict(good, k=draw(st.integers(MAX_K + 1, 2**31 - 1))), RANGE, "k"
    if kind == "empty":
        return dict(good, queries=_tensor(np.zeros((0, D), np.float32))), INVALID, "queries.shape[0]"
    if kind == "too_many":
        return dict(good, queries=_tensor(np.zeros((draw(st.integers(MAX_Q + 1, 200)), D), np.float32))), RANGE, "queries.shape[0]"
    if kind == "missing":
        return dict(k=good["k"]), INVALID, "queries"
    if kind == "nprobe":
        return dict(good, nprobe=draw(st.integers(-(2**31), 0))), INVALID, "nprobe"
    shape = [-q, -D] if draw(st.booleans()) else [q, -D]
    return dict(good, queries=_tensor(xq, shape=shape)), INVALID, "queries.shape"


def test_malformed_requests_get_field_naming_errors_and_server_keeps_serving(loop_thread, make_searcher):
    s = make_searcher(100, D, seed=2)
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", s,
                             limits=SearchLimits(max_k=MAX_K, max_queries=MAX_Q))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
    raw = channel.unary_unary("/memlm.v1.RetrievalService/Search")  # bytes in, bytes out

    @settings(max_examples=150, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
    @given(malformed())
    def check(case):
        fields, code, field = case
        with pytest.raises(grpc.RpcError) as info:
            stub.Search(retrieval_pb2.SearchRequest(**fields), timeout=10)
        assert info.value.code() == code, info.value.details()
        assert info.value.details().startswith(field + ":"), info.value.details()

    @settings(max_examples=100, deadline=5000)
    @given(st.binary(max_size=200))
    def check_bytes(data):
        try:
            raw(data, timeout=10)  # a few byte strings are valid requests; fine if so
        except grpc.RpcError as e:
            assert e.code() in (INVALID, RANGE), (e.code(), e.details())

    check()
    check_bytes()
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with RetrievalClient(f"127.0.0.1:{port}") as client:
        xq = queries(3, D, seed=9)
        assert_same(client.search(xq, 5), s.search(xq, 5))
    channel.close()


# ---------------------------------------------------------------------------------------------
# Concurrency, micro-batching, limits, deadlines


def test_concurrent_clients_get_the_sequential_answers(loop_thread, searcher):
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher)
    rng = np.random.default_rng(5)
    jobs = [(queries(int(rng.integers(1, 40)), searcher.dim, seed=i), int(rng.choice([4, 16]))) for i in range(48)]
    with RetrievalClient(f"127.0.0.1:{port}") as client:
        sequential = [client.search(xq, k) for xq, k in jobs]
        results: dict[int, object] = {}

        def worker(w: int):
            with RetrievalClient(f"127.0.0.1:{port}") as own:  # half share a channel, half have their own
                c = own if w % 2 else client
                for i in range(w, len(jobs), 8):
                    results[i] = c.search(*jobs[i])

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(results) == list(range(len(jobs)))
    for i, expected in enumerate(sequential):
        assert_same(results[i], expected)


def test_queued_requests_are_merged_into_one_search_per_k(loop_thread, searcher, gated_searcher):
    gated = gated_searcher
    started = loop_thread.run(start_retrieval_server("127.0.0.1:0", gated))
    loop_thread.servers.append(started.running.server)
    address = f"127.0.0.1:{started.running.port}"
    client = RetrievalClient(address)
    client.info()  # fetch GetInfo before the gate closes the searcher
    jobs = [(queries(3, 32, seed=100), 5)] + [(queries(q, 32, seed=q), k) for q, k in [(2, 5), (4, 7), (6, 5), (1, 7)]]
    out: dict[int, object] = {}
    first = threading.Thread(target=lambda: out.__setitem__(0, client.search(*jobs[0])))
    first.start()
    assert gated.entered.wait(10)
    rest = [threading.Thread(target=lambda i=i: out.__setitem__(i, client.search(*jobs[i]))) for i in range(1, 5)]
    for t in rest:
        t.start()
    wait_until(lambda: started.batcher.pending_queries == 13)
    gated.release.set()
    for t in [first, *rest]:
        t.join(30)
    # First the lone request, then the 4 queued ones as one search per k: (2+6) for k=5, (4+1) for k=7.
    # (Groups run in the order their first request arrived, which the threads do not fix.)
    calls = [(q, k) for q, k, _ in gated.calls]
    assert calls[0] == (3, 5) and sorted(calls[1:]) == [(5, 7), (8, 5)]
    for i, (xq, k) in enumerate(jobs):
        assert_same(out[i], searcher.search(xq, k))
    client.close()


def test_past_max_concurrent_rpcs_is_resource_exhausted(loop_thread, searcher, gated_searcher):
    gated = gated_searcher
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", gated,
                             options=ServerOptions(max_concurrent_rpcs=1))
    client = RetrievalClient(f"127.0.0.1:{port}")
    client.info()  # connect before the gate closes
    xq = queries(2, 32, seed=1)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", client.search(xq, 4)))
    t.start()
    assert gated.entered.wait(10)
    with pytest.raises(ServiceError) as info:
        client.search(xq, 4)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    gated.release.set()
    t.join(30)
    assert_same(out["r"], searcher.search(xq, 4))
    assert_same(client.search(xq, 4), searcher.search(xq, 4))  # still serving
    client.close()


def test_expired_call_is_dropped_before_it_is_searched(loop_thread, searcher, gated_searcher):
    gated = gated_searcher
    started = loop_thread.run(start_retrieval_server("127.0.0.1:0", gated))
    loop_thread.servers.append(started.running.server)
    address = f"127.0.0.1:{started.running.port}"
    slow, hurried = RetrievalClient(address), RetrievalClient(address)
    slow.info(), hurried.info()  # connect before the short deadline applies
    hurried.timeout = 0.3
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", slow.search(queries(3, 32, 0), 4)))
    t.start()
    assert gated.entered.wait(10)
    with pytest.raises(ServiceError) as info:
        hurried.search(queries(9, 32, 1), 4)  # queued behind the gated search, expires there
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    gated.release.set()
    t.join(30)
    assert out["r"].ids.shape == (3, 4)
    loop_thread.run(_wait_idle(started.batcher))
    assert [q for q, _, _ in gated.calls] == [3]  # the 9 expired queries never reached the searcher
    slow.close()
    hurried.close()


async def _wait_idle(batcher, timeout: float = 10.0):
    import asyncio

    async def idle():
        while not batcher.idle:
            await asyncio.sleep(0.005)

    await asyncio.wait_for(idle(), timeout)


# ---------------------------------------------------------------------------------------------
# SIGTERM drains in-flight calls (a real server process)

SLOW_SERVER = textwrap.dedent(
    """
    import asyncio, sys, time
    import numpy as np
    from memlm.retrieval.searcher import Neighbors, SearcherInfo
    from services.retrieval.server import serve_retrieval
    from services.common.server import ServerOptions

    class SlowSearcher:
        dim = 4
        def info(self):
            return SearcherInfo(n=100, dim=4, index="Flat", metric="l2", nprobe=1, key_layer="k", model_name="m",
                                model_fingerprint="m", tokenizer_fingerprint="t", corpus="c", corpus_fingerprint="c",
                                context=8, stride=4, boundary_token=0, sink_tokens=0)
        def search(self, xq, k, options=None):
            print("searching", flush=True)
            time.sleep(1.0)  # long enough for the test to send SIGTERM mid-search
            ids = np.tile(np.arange(k, dtype=np.int64), (len(xq), 1))  # (Q, k)
            return Neighbors(ids.astype(np.float32) + xq[:, :1], ids, (ids * 2).astype(np.int32))

    asyncio.run(serve_retrieval(SlowSearcher(), "127.0.0.1", 0, options=ServerOptions(grace_s=20)))
    """
)


def test_sigterm_drains_the_in_flight_call_then_exits_zero():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_SERVER], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in proc.stdout], daemon=True).start()
    try:
        first = lines.get(timeout=60)
        assert first.startswith("listening on 127.0.0.1:"), first
        port = int(first.rsplit(":", 1)[1])
        client = RetrievalClient(f"127.0.0.1:{port}", timeout=30)
        xq = np.arange(8, dtype=np.float32).reshape(2, 4)  # (Q, d)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", client.search(xq, 3)))
        t.start()
        assert lines.get(timeout=30) == "searching"
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        np.testing.assert_array_equal(out["r"].ids, [[0, 1, 2], [0, 1, 2]])
        np.testing.assert_array_equal(out["r"].distances, [[0, 1, 2], [4, 5, 6]])
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
