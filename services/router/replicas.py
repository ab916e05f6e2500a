"""The replicas of one router shard: health-watched, each behind a circuit breaker, called with failover.

A shard is served by one or more replica retrieval servers holding the same rows
(`--shard A,B`). The router keeps a `grpc.health.v1` Watch stream open to each replica (the servers serve
health; services/common/server.py) and routes to the replicas that report SERVING, rotating the first
choice so replicas share the load. A call that fails because its replica is down or hung (UNAVAILABLE,
DEADLINE_EXCEEDED, CANCELLED by a stopping server) goes to the next replica while the caller's deadline
lasts; a call still unanswered after `hedge_after_s` is hedged: the next replica gets the same request and
the first answer wins (Dean & Barroso, "The Tail at Scale", CACM 2013). A bad request (INVALID_ARGUMENT and
the like) is the request's fault, not the replica's: it is passed on at once, never retried.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.circuit import CircuitBreaker

SHARD_DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Replica failures that count towards its breaker: the replica is down or hung (not a bad request)."""
RETRIED_CODES = SHARD_DOWN_CODES | {grpc.StatusCode.CANCELLED}
"""Replica failures another replica may answer instead (CANCELLED: the replica's server stopped mid-call)."""
SERVING = health_pb2.HealthCheckResponse.SERVING
HEALTH_RETRY_S = 0.5
"""Pause before a replica's health Watch stream is opened again after it broke (bounds the retry rate)."""


def replicas_of(shard: str) -> list[str]:
    """The replica addresses of one `--shard` value: HOST:PORT[,HOST:PORT...]."""
    replicas = [a.strip() for a in shard.split(",")]
    if not all(replicas):
        raise ValueError(f"--shard {shard!r}: expected HOST:PORT[,HOST:PORT...]")
    return replicas


class ShardFailed(Exception):
    """Every replica of a shard failed (or one refused the request); code is the last replica's."""

    def __init__(self, shard: str, code: grpc.StatusCode, details: str):
        super().__init__(shard)
        self.shard = shard
        self.code = code
        self.details = details


class Replica:
    """One replica: its stub, its breaker and the health status its server last reported."""

    def __init__(self, address: str, channel: grpc.aio.Channel, stub, breaker: CircuitBreaker):
        self.address = address
        self.channel = channel
        self.stub = stub
        self.breaker = breaker
        self.status: int | None = None  # None: not heard yet (tried after the SERVING ones)

    async def watch_health(self) -> None:
        """Follow the server's overall health ("") until cancelled; a broken stream marks it down."""
        health = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                # wait_for_ready: a stream to a dead server waits for it to come back instead of failing at once.
                async for reply in health.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True):
                    if reply.status == SERVING and self.status != SERVING:
                        self.breaker.reset()  # it is back: let calls through before the back-off ends
                    self.status = reply.status
            except grpc.aio.AioRpcError:
                pass
            self.status = health_pb2.HealthCheckResponse.NOT_SERVING
            await asyncio.sleep(HEALTH_RETRY_S)


class ReplicaSet:
    """A shard's replicas, called with health routing, failover and hedging (module docstring)."""

    def __init__(self, name: str, replicas: Sequence[Replica], hedge_after_s: float | None, metadata):
        self.name = name
        """The shard as the router names it in errors: its replica addresses, comma-joined."""
        self.replicas = list(replicas)
        self._hedge_after_s = hedge_after_s  # ShardLinks.hedge_after_s
        self._metadata = metadata
        self._turn = itertools.count()

    def candidates(self) -> list[Replica]:
        """Replicas in the order to try: SERVING ones first (rotated per call), then the unheard, then the
        rest (a stale NOT_SERVING view must not leave a shard unanswered when its server is back)."""
        start = next(self._turn) % len(self.replicas)
        rotated = self.replicas[start:] + self.replicas[:start]
        rank = {SERVING: 0, None: 1}
        return sorted(rotated, key=lambda r: rank.get(r.status, 2))  # stable: the rotation within a rank

    async def call(self, rpc: Callable, request, deadline_s: Callable[[], float]):
        """rpc(stub)(request) on the first replica that answers; raises ShardFailed naming this shard.

        deadline_s(): seconds the next replica call may take now (the caller's remaining deadline, capped)."""
        order = iter(self.candidates())
        failures: list[str] = []
        last_code = grpc.StatusCode.UNAVAILABLE
        pending: dict[asyncio.Task, Replica] = {}
        try:
            while True:
                if (not pending or self._hedge_after_s is not None) and deadline_s() > 0:
                    for replica in order:  # the next replica its breaker lets through
                        if replica.breaker.allow():
                            call = rpc(replica.stub)(request, timeout=deadline_s(), metadata=self._metadata)
                            pending[asyncio.ensure_future(call)] = replica
                            break
                        failures.append(f"{replica.address}: circuit open after repeated failures; next try in "
                                        f"{replica.breaker.retry_in():.1f} s")
                if not pending:
                    code = last_code if deadline_s() > 0 else grpc.StatusCode.DEADLINE_EXCEEDED
                    raise ShardFailed(self.name, code, "; ".join(failures) or "no time left in the caller's deadline")
                done, _ = await asyncio.wait(pending, timeout=self._hedge_after_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    replica = pending.pop(task)
                    try:
                        response = task.result()
                    except grpc.aio.AioRpcError as e:
                        if e.code() not in RETRIED_CODES:
                            replica.breaker.record_success()  # it answered: alive; the request is at fault
                            raise ShardFailed(self.name, e.code(), e.details() or "") from None
                        if e.code() in SHARD_DOWN_CODES:
                            replica.breaker.record_failure()
                        last_code = e.code()
                        failures.append(f"{replica.address}: {e.code().name}: {e.details() or ''}")
                        continue
                    replica.breaker.record_success()
                    return response
        finally:
            for task, replica in pending.items():  # answered elsewhere, or our caller left: no verdict
                task.cancel()
                replica.breaker.record_abandoned()
