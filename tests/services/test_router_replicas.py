"""Router over replicated shards: failover, hedging, a whole shard gone, partial answers.

Every test runs real retrieval servers and a real router on port 0; a replica is killed by stopping its
server (no grace) and restarted on the same port. The oracle is one Flat index over the union.

Shape legend: N datastore entries, d key dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc
from services.common.circuit import OPEN, BreakerConfig, CircuitBreaker
from services.router.replicas import SERVING, ReplicaSet
from services.router.replicas import Replica as ReplicaLink
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server
from services.router.server import ShardLinks, create_router_server
from services.common.server import ServiceError
from services.common.tensors import from_tensor, to_tensor

HALF = 1500  # the 3000-row searcher split into two shards of 1500 rows


class Replica:
    """A retrieval server over its own searcher (same rows as its twin) that a test can kill and restart."""

    def __init__(self, loop_thread, searcher):
        self.loop_thread, self.searcher = loop_thread, searcher
        self.server, self.port = loop_thread.run(create_retrieval_server("127.0.0.1:0", searcher))
        self.address = f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        self.loop_thread.run(self.server.stop(None))

    def restart(self) -> None:
        self.server, _ = self.loop_thread.run(create_retrieval_server(self.address, self.searcher))

    def close(self) -> None:
        self.kill()


@pytest.fixture
def replicas(loop_thread, searcher):
    """Two shards (rows [0, 1500) and [1500, 3000)) with two replicas each: [[0a, 0b], [1a, 1b]]."""
    flat = type(searcher)
    made = [[Replica(loop_thread, flat(searcher.keys[s : s + HALF], searcher.values[s : s + HALF])) for _ in range(2)]
            for s in (0, HALF)]
    yield made
    for shard in made:
        for r in shard:
            r.close()


def shard_spec(shard) -> str:
    return ",".join(r.address for r in shard)


def start_router(loop_thread, replicas, links: ShardLinks | None = None) -> str:
    port = loop_thread.start(create_router_server, "127.0.0.1:0", [shard_spec(s) for s in replicas],
                             shards=links or ShardLinks())
    return f"127.0.0.1:{port}"


def queries(d: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((8, d)).astype(np.float32)  # (Q, d)


def assert_same(got, expected) -> None:
    for name, a, b in zip(("distances", "ids", "values"), got, expected):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_a_replica_killed_and_restarted_mid_loop_costs_no_call(loop_thread, searcher, replicas):
    router = start_router(loop_thread, replicas)
    xq = queries(searcher.dim)
    expected = searcher.search(xq, 10)  # (Q, k) each: one index over the same data
    a, b = replicas[0]
    done, answered, errors = threading.Event(), [0], []

    def chaos() -> None:
        try:
            time.sleep(0.3)
            a.kill()  # calls in flight on it fail over to b
            time.sleep(0.5)
            a.restart()
            calls = len(a.searcher.calls)
            deadline = time.monotonic() + 15
            while len(a.searcher.calls) == calls:  # back in the rotation once the router sees it SERVING
                assert time.monotonic() < deadline, "the router never routed to the restarted replica again"
                time.sleep(0.05)
            b.kill()  # now a alone answers for shard 0
            time.sleep(0.5)
        finally:
            done.set()

    worker = threading.Thread(target=chaos, daemon=True)
    worker.start()
    with RetrievalClient(router, timeout=5) as client:
        while not done.is_set():
            try:
                assert_same(client.search(xq, 10), expected)
                answered[0] += 1
            except ServiceError as e:  # counted, not raised: the test says how many failed
                errors.append(f"{e.code.name}: {e.details}")
    worker.join(1)
    assert errors == [] and answered[0] > 20, (answered, errors[:3])
    assert a.searcher.calls and b.searcher.calls  # both replicas served


def test_a_whole_shard_gone_is_unavailable_naming_it_or_partial_when_allowed(loop_thread, searcher, replicas):
    router = start_router(loop_thread, replicas)
    xq = queries(searcher.dim, seed=1)
    for r in replicas[0]:
        r.kill()
    with RetrievalClient(router, timeout=5) as client, pytest.raises(ServiceError) as info:
        client.search(xq, 10)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"shard {shard_spec(replicas[0])}:" in info.value.details

    with grpc.insecure_channel(router) as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        response = stub.Search(retrieval_pb2.SearchRequest(queries=to_tensor(xq), k=10, allow_partial=True), timeout=5)
    assert response.partial and list(response.missing_shards) == [shard_spec(replicas[0])]
    survivor = type(searcher)(searcher.keys[HALF:], searcher.values[HALF:]).search(xq, 10)  # (Q, k) each
    ids = from_tensor(response.ids, "ids")  # (Q, k)
    np.testing.assert_array_equal(ids, survivor.ids + HALF)  # shard 1's rows keep their global ids
    np.testing.assert_array_equal(from_tensor(response.distances, "distances"), survivor.distances)
    np.testing.assert_array_equal(from_tensor(response.values, "values"), survivor.values)


def test_a_complete_answer_is_not_marked_partial(loop_thread, searcher, replicas):
    router = start_router(loop_thread, replicas)
    xq = queries(searcher.dim, seed=2)
    with grpc.insecure_channel(router) as channel:
        response = retrieval_pb2_grpc.RetrievalServiceStub(channel).Search(
            retrieval_pb2.SearchRequest(queries=to_tensor(xq), k=5, allow_partial=True), timeout=5)
    assert not response.partial and not response.missing_shards
    np.testing.assert_array_equal(from_tensor(response.ids, "ids"), searcher.search(xq, 5).ids)


def test_a_slow_replica_is_hedged_within_the_deadline(loop_thread, searcher, gated_searcher):
    flat = type(searcher)
    fast = Replica(loop_thread, flat(searcher.keys, searcher.values))
    slow = Replica(loop_thread, gated_searcher)  # same rows; never answers until released
    try:
        links = ShardLinks(hedge_after_s=0.1, call_timeout_s=10.0)
        router = start_router(loop_thread, [[slow, fast]], links)
        xq = queries(searcher.dim, seed=3)
        with RetrievalClient(router, timeout=3) as client:
            for _ in range(4):  # the rotation makes the slow replica the first choice of every other call
                start = time.monotonic()
                assert_same(client.search(xq, 4), searcher.search(xq, 4))
                assert time.monotonic() - start < 1.5  # no hedge: the caller's 3 s deadline would pass
        assert gated_searcher.entered.is_set()  # the slow replica was asked (and hedged around)
    finally:
        gated_searcher.release.set()
        fast.close()
        slow.close()


def test_without_hedging_a_hung_replica_waits_out_the_deadline(loop_thread, searcher, gated_searcher):
    """The control for the hedging test: the same replicas without hedging fail the first call."""
    fast = Replica(loop_thread, type(searcher)(searcher.keys, searcher.values))
    slow = Replica(loop_thread, gated_searcher)
    try:
        router = start_router(loop_thread, [[slow, fast]], ShardLinks(hedge_after_s=None))
        codes = []
        with RetrievalClient(router, timeout=0.5) as client:
            for _ in range(2):  # the rotation makes the slow replica the first choice of one of them
                try:
                    client.search(queries(searcher.dim), 4)
                    codes.append(grpc.StatusCode.OK)
                except ServiceError as e:
                    codes.append(e.code)
        assert grpc.StatusCode.DEADLINE_EXCEEDED in codes, codes
    finally:
        gated_searcher.release.set()
        fast.close()
        slow.close()


def test_a_bad_shard_spec_is_one_line(loop_thread):
    with pytest.raises(MemlmError, match="expected HOST:PORT"):
        loop_thread.run(create_router_server("127.0.0.1:0", ["127.0.0.1:1,"]))


def test_a_call_to_a_dead_replica_fails_over_before_health_notices(loop_thread, searcher):
    """Failover itself, without health routing's help: both replicas look SERVING, the first is a closed
    port; the call answers from the second, and the first's breaker counts the failure."""
    live = Replica(loop_thread, type(searcher)(searcher.keys, searcher.values))
    dead = Replica(loop_thread, type(searcher)(searcher.keys, searcher.values))
    dead.kill()
    try:
        async def call():
            replicas = []
            for r in (dead, live):
                channel = grpc.aio.insecure_channel(r.address)
                replicas.append(ReplicaLink(r.address, channel, retrieval_pb2_grpc.RetrievalServiceStub(channel),
                                            CircuitBreaker(BreakerConfig(failure_threshold=1))))
                replicas[-1].status = SERVING  # as if health had not noticed yet
            shard = ReplicaSet("dead,live", replicas, hedge_after_s=None, metadata=())
            request = retrieval_pb2.SearchRequest(queries=to_tensor(queries(searcher.dim)), k=3)
            try:
                response = await shard.call(lambda stub: stub.Search, request, lambda: 5.0)
            finally:
                for r in replicas:
                    await r.channel.close()
            return response, replicas[0].breaker.state

        response, dead_breaker = loop_thread.run(call())
        np.testing.assert_array_equal(from_tensor(response.ids, "ids"), searcher.search(queries(searcher.dim), 3).ids)
        assert dead_breaker == OPEN
    finally:
        live.close()
