"""Issue 9, findings 3 and 4: callers without the token cannot lock token holders out, readiness answers
under full load, and authentication cannot be switched off by accident (empty tokens, tokens in `ps`,
exposed plaintext binds, mTLS on every client).

Real servers on port 0; `memlm serve lm` runs as a real process where its argv or its stderr is checked.
Every wait is bounded by a deadline.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.retrieval_client import RetrievalClient
from services.retrieval_server import create_retrieval_server
from services.server_common import ServerOptions, ServiceError

SERVING = health_pb2.HealthCheckResponse.SERVING
ROOT = Path(__file__).resolve().parents[2]


def health_check(address: str, timeout: float = 10) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


# ---------------------------------------------------------------------------------------------
# Finding 3: separate budgets


def test_64_unauthenticated_watch_streams_do_not_lock_out_a_token_holder(loop_thread, searcher):
    options = ServerOptions(token="s3cret")  # max_concurrent_rpcs 64, max_open_rpcs 16: the defaults
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher, options=options)
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address)
    watches = [health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
               for _ in range(64)]
    try:
        admitted, refused = 0, 0
        for watch in watches:  # each stream's first answer: it is open on the server, or it was refused
            try:
                assert next(watch).status == SERVING
                admitted += 1
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                refused += 1
        # The streams cost the token holder nothing: GetInfo and Search succeed, readiness answers.
        xq = np.random.default_rng(1).standard_normal((3, searcher.dim)).astype(np.float32)  # (Q, d)
        with RetrievalClient(address, token="s3cret", timeout=10) as client:
            assert client.info().n == len(searcher.keys)
            np.testing.assert_array_equal(client.search(xq, 4).ids, searcher.search(xq, 4).ids)
        assert health_check(address) == SERVING
        # The open budget bounds the streams: 16 held, the rest refused.
        assert (admitted, refused) == (options.max_open_rpcs, 64 - options.max_open_rpcs)
        # A caller without the token is refused inside the open budget (full now), never in a token slot.
        with RetrievalClient(address, timeout=10) as stranger, pytest.raises(ServiceError) as e:
            stranger.info()
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for watch in watches:
            watch.cancel()
        channel.close()


def get_info_status(channel: grpc.Channel, token: str) -> grpc.StatusCode:
    """The status of one raw GetInfo call (the client caches GetInfo, so it is called by hand here)."""
    call = channel.unary_unary("/memlm.v1.RetrievalService/GetInfo")
    try:
        call(b"", timeout=10, metadata=(("authorization", f"Bearer {token}"),))
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def test_health_check_answers_while_every_authenticated_slot_is_busy(loop_thread, searcher, gated_searcher):
    gated = gated_searcher
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", gated,
                             options=ServerOptions(max_concurrent_rpcs=2, token="t0ken"))
    address = f"127.0.0.1:{port}"
    xq = np.random.default_rng(0).standard_normal((2, searcher.dim)).astype(np.float32)  # (Q, d)
    clients = [RetrievalClient(address, token="t0ken", timeout=30) for _ in range(2)]
    for c in clients:
        c.info()  # connected (and max_queries known) before the gate closes
    out: list = []
    threads = [threading.Thread(target=lambda c=c: out.append(c.search(xq, 4))) for c in clients]
    channel = grpc.insecure_channel(address)
    try:
        for t in threads:
            t.start()
        assert gated.entered.wait(10)
        # Both searches hold a slot once a third call is refused; the second may still be on its way.
        deadline = time.monotonic() + 10
        while get_info_status(channel, "t0ken") == grpc.StatusCode.OK and time.monotonic() < deadline:
            time.sleep(0.01)
        assert get_info_status(channel, "t0ken") == grpc.StatusCode.RESOURCE_EXHAUSTED  # every slot is busy
        assert health_check(address) == SERVING  # and readiness still answers
    finally:
        gated.release.set()
        for t in threads:
            t.join(30)
        for c in clients:
            c.close()
        channel.close()
    assert len(out) == 2  # the busy calls finished normally
    np.testing.assert_array_equal(out[0].ids, searcher.search(xq, 4).ids)
