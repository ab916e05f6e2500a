"""Shard router: one RetrievalService in front of N retrieval servers holding shards of one corpus.

A Search is validated, sent to every shard concurrently with the caller's remaining deadline, and
the per-shard top-k lists are merged into a global top-k by distance (smaller is nearer). Because each shard returns its own
exact top-k, the merged list equals the top-k over the union for exact (Flat) shards.

Global ids: shard s's local id i becomes offset_s + i, where offset_s is the sum of N (from
GetInfo) of the shards listed BEFORE it. So the --shard order must be the order in which the
datastore builder wrote the shards; then a global id is the row number in the concatenated corpus.
Missing neighbours (id -1) stay -1.

Generations (issue 14): a shard's N changes when `memlm datastore add` or `compact` commits a generation
it then serves. Every shard SearchResponse carries the generation that answered; when one differs from
the generation the router's offsets were computed from, the router asks all shards for GetInfo again,
recomputes the offsets, and uses the answers if their generations match the new layout (else it searches
once more). So merged ids are always rows of the concatenation of the generations that answered.

Faults (issue 9, finding 2): a shard call never outlives the caller's deadline nor ShardLinks.call_timeout_s
(a caller without a deadline must not wait forever on a hung shard), and each shard has a circuit breaker
(services/circuit.py): after repeated failures the router answers UNAVAILABLE naming the shard at once,
until a trial call after the back-off succeeds.

Shape legend: Q queries, k neighbours, S shards.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import numpy as np

from memlm.errors import MemlmError
from memlm.retrieval.searcher import Neighbors
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc, tensor_pb2
from services.circuit import BreakerConfig, CircuitBreaker
from services.retrieval_server import (
    MESSAGE_CLASSES,
    SERVICE,
    neighbors_to_response,
    parse_search_request,
)
from services.security import ClientTls, auth_metadata
from services.server_common import (
    DEFAULT_HOST,
    RunningServer,
    ServerOptions,
    close_when_stopped,
    join_host_port,
    open_channel,
    run_until_signal,
    start_server,
)
from services.tensors import TensorError, from_tensor

# Fields every shard must agree on: a query vector (made by one model, key layer and text layout)
# means the same thing on all of them, and their values are the same tokenizer's ids.
AGREEING_FIELDS = (
    "dim", "metric", "model_fingerprint", "tokenizer_fingerprint", "key_layer", "context", "stride",
    "boundary_token", "sink_tokens",
)


class Layout(NamedTuple):
    """What the router knows of its shards at one moment (replaced whole, never edited)."""

    info: retrieval_pb2.RetrievalServiceGetInfoResponse
    """The union's GetInfo answer."""
    offsets: list[int]
    """Global id offset of each shard."""
    generations: list[int]
    """Each shard's generation the offsets were computed from."""


def layout_of(addresses: Sequence[str], infos: Sequence[retrieval_pb2.RetrievalServiceGetInfoResponse],
              max_message_bytes: int) -> Layout:
    info, offsets = merge_shard_infos(addresses, infos, max_message_bytes)
    return Layout(info, offsets, [i.generation for i in infos])


def merge_shard_infos(
    addresses: Sequence[str], infos: Sequence[retrieval_pb2.RetrievalServiceGetInfoResponse], max_message_bytes: int
) -> tuple[retrieval_pb2.RetrievalServiceGetInfoResponse, list[int]]:
    """Check the shards agree and describe their union; returns (info, id offset of each shard)."""
    first = infos[0].datastore
    for address, info in zip(addresses[1:], infos[1:]):
        for field in AGREEING_FIELDS:
            if getattr(info.datastore, field) != getattr(first, field):
                raise MemlmError(
                    f"shard {address} has {field}={getattr(info.datastore, field)!r} but shard {addresses[0]} has "
                    f"{getattr(first, field)!r}; all shards must come from one model, tokenizer, key layer and "
                    "window layout"
                )
    offsets = np.cumsum([0] + [info.datastore.n for info in infos[:-1]]).tolist()  # offset_s = sum of earlier N
    union = retrieval_pb2.DatastoreInfo()
    union.CopyFrom(first)  # the agreeing fields, and model_name
    union.n = sum(info.datastore.n for info in infos)
    union.index = _joined(info.datastore.index for info in infos)
    union.corpus = _joined(info.datastore.corpus for info in infos)
    if len(infos) > 1:  # the union's content, in shard order (the order that defines the global ids)
        union.corpus_fingerprint = hashlib.sha256(
            "\n".join(info.datastore.corpus_fingerprint for info in infos).encode()
        ).hexdigest()
    nprobes = {info.datastore.nprobe for info in infos}
    union.nprobe = nprobes.pop() if len(nprobes) == 1 else 0  # 0: each shard uses its own default
    merged = retrieval_pb2.RetrievalServiceGetInfoResponse(
        datastore=union,
        max_k=min(info.max_k for info in infos),
        max_queries=min(info.max_queries for info in infos),
        max_message_bytes=min([max_message_bytes] + [info.max_message_bytes for info in infos]),
    )
    return merged, offsets


def _joined(values) -> str:
    """Distinct values in first-seen order, joined by " | " (one value stays as it is)."""
    return " | ".join(dict.fromkeys(values))


def merge_top_k(results: Sequence[Neighbors], offsets: Sequence[int], k: int) -> Neighbors:
    """Merge per-shard (Q, k) results into the global (Q, k) top-k, ids made global by offsets."""
    distances = np.concatenate([r.distances for r in results], axis=1)  # (Q, S*k)
    ids = np.concatenate(
        [np.where(r.ids >= 0, r.ids + offset, -1) for r, offset in zip(results, offsets)], axis=1
    )  # (Q, S*k)
    values = np.concatenate([r.values for r in results], axis=1)  # (Q, S*k)
    # Stable sort: equal distances keep shard order, then each shard's own order -- deterministic.
    order = np.argsort(distances, axis=1, kind="stable")[:, :k]  # (Q, k)
    return Neighbors(
        np.take_along_axis(distances, order, axis=1),  # (Q, k)
        np.take_along_axis(ids, order, axis=1),  # (Q, k)
        np.take_along_axis(values, order, axis=1),  # (Q, k)
    )


def _decode(response: retrieval_pb2.SearchResponse, q: int, k: int) -> Neighbors:
    out = Neighbors(
        from_tensor(response.distances, "distances", dtypes=(tensor_pb2.DTYPE_FLOAT32,), ndim=2),
        from_tensor(response.ids, "ids", dtypes=(tensor_pb2.DTYPE_INT64,), ndim=2),
        from_tensor(response.values, "values", dtypes=(tensor_pb2.DTYPE_INT32,), ndim=2),
    )
    for name, a in zip(Neighbors._fields, out):
        if a.shape != (q, k):
            raise TensorError(name, f"shape {a.shape}, expected {(q, k)}")
    return out


class RouterServicer:
    """RetrievalService that fans out to shard stubs and merges."""

    def __init__(self, addresses, stubs, metadata, layout: Layout, links: ShardLinks):
        self._addresses = addresses
        self._stubs = stubs
        self._metadata = metadata
        self._layout = layout  # the union of the shards, the tightest of their limits, the id offsets
        self._call_timeout_s = links.call_timeout_s
        self._breakers = [CircuitBreaker(links.breaker) for _ in stubs]

    async def Search(self, request: retrieval_pb2.SearchRequest, context: grpc.aio.ServicerContext):
        # Validate here too: bad input is refused once, not S times, and the message names the field.
        parsed = parse_search_request(request, self._layout.info)
        remaining = context.time_remaining()  # the caller's deadline bounds every shard call
        timeout = self._call_timeout_s if remaining is None else min(remaining, self._call_timeout_s)
        for _ in range(2):  # a second time only when a shard changed generation during the first
            responses = await self._fan_out(request, timeout, context)
            answered = [r.generation for r in responses]
            layout = self._layout
            if answered != layout.generations:
                layout = await self._relayout(timeout, context)
            if answered == layout.generations:
                break
        else:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shards changed generation during the call; retry")
        q = len(parsed.xq)
        try:
            results = [_decode(r, q, parsed.k) for r in responses]
        except TensorError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"bad shard response: {e}")
        return neighbors_to_response(merge_top_k(results, layout.offsets, parsed.k))

    async def _relayout(self, timeout: float, context: grpc.aio.ServicerContext) -> Layout:
        """Ask every shard for GetInfo and replace the layout (a shard now serves another generation)."""
        try:
            infos = await asyncio.gather(*(
                stub.GetInfo(retrieval_pb2.RetrievalServiceGetInfoRequest(), timeout=timeout, metadata=self._metadata)
                for stub in self._stubs))
            self._layout = layout_of(self._addresses, infos, self._layout.info.max_message_bytes)
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"a shard did not answer GetInfo: {e.code().name}")
        except MemlmError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"shards no longer agree: {e}")
        return self._layout

    async def _fan_out(self, request, timeout: float, context) -> list[retrieval_pb2.SearchResponse]:
        """Every shard's SearchResponse, or an abort naming the first shard that failed."""
        calls = [asyncio.ensure_future(self._shard_search(i, request, timeout)) for i in range(len(self._stubs))]
        try:
            responses = await asyncio.gather(*calls)
        except _ShardFailed as f:
            # Pass the shard's code on (DEADLINE_EXCEEDED stays that), naming the shard.
            await context.abort(f.code, f"shard {f.address}: {f.details}")
        finally:
            for c in calls:  # one shard failed (or our caller went away): stop waiting for the others
                c.cancel()
        return responses

    async def GetInfo(self, request, context: grpc.aio.ServicerContext):
        return self._layout.info

    async def _shard_search(self, i: int, request, timeout: float) -> retrieval_pb2.SearchResponse:
        breaker = self._breakers[i]
        if not breaker.allow():
            raise _ShardFailed(self._addresses[i], grpc.StatusCode.UNAVAILABLE,
                               f"circuit open after repeated failures; next try in {breaker.retry_in():.1f} s")
        try:
            response = await self._stubs[i].Search(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() in SHARD_DOWN_CODES:
                breaker.record_failure()
            else:  # the shard answered: it is alive
                breaker.record_success()
            raise _ShardFailed(self._addresses[i], e.code(), e.details() or "") from None
        except asyncio.CancelledError:  # another shard failed or our caller left: no verdict on this one
            breaker.record_abandoned()
            raise
        breaker.record_success()
        return response


SHARD_DOWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Shard failures that count towards its breaker: the shard is down or hung (not a bad request)."""


class _ShardFailed(Exception):
    def __init__(self, address: str, code: grpc.StatusCode, details: str):
        super().__init__(address)
        self.address = address
        self.code = code
        self.details = details


@dataclass(frozen=True)
class ShardLinks:
    """How the router reaches its shards."""

    tls: ClientTls | None = None
    """TLS towards the shards; None = plaintext."""
    token: str | None = None
    """Bearer token the shards want, if any."""
    connect_timeout_s: float = 30.0
    """Seconds to wait at start-up for every shard's GetInfo (shards may still be starting)."""
    call_timeout_s: float = 60.0
    """Longest a shard Search may take, in seconds, when the caller's deadline is later or unset."""
    breaker: BreakerConfig = BreakerConfig()
    """When repeated failures of one shard make the router refuse at once (UNAVAILABLE naming it)."""


async def start_router_server(
    address: str,
    shard_addresses: Sequence[str],
    *,
    shards: ShardLinks = ShardLinks(),
    options: ServerOptions = ServerOptions(),
) -> RunningServer:
    """Start a router on `address` over `shard_addresses` (in the builder's shard order).

    shards: how the router reaches the shards; options: what the router's own callers get and must use
    (TLS, token, message size, concurrent calls, grace period). The server starts NOT_SERVING, asks every
    shard for GetInfo (waiting up to shards.connect_timeout_s), checks they agree, then reports SERVING.
    Raises MemlmError (after stopping) when a shard is unreachable or the shards disagree.
    """
    if not shard_addresses:
        raise MemlmError("the router needs at least one --shard HOST:PORT")
    channels = [open_channel(a, shards.tls, options.max_message_bytes, asynchronous=True) for a in shard_addresses]
    stubs = [retrieval_pb2_grpc.RetrievalServiceStub(c) for c in channels]
    metadata = auth_metadata(shards.token)

    servicer = _LateServicer()
    running = await start_server(address, [(SERVICE, servicer)], MESSAGE_CLASSES, options)
    try:
        infos = await asyncio.gather(*(
            stub.GetInfo(retrieval_pb2.RetrievalServiceGetInfoRequest(), timeout=shards.connect_timeout_s,
                         metadata=metadata, wait_for_ready=True)
            for stub in stubs
        ))
        layout = layout_of(shard_addresses, infos, options.max_message_bytes)
    except grpc.aio.AioRpcError as e:
        await _stop(running, channels)
        raise MemlmError(f"router: a shard did not answer GetInfo: {e.code().name}: {e.details()}") from None
    except MemlmError:
        await _stop(running, channels)
        raise
    servicer.target = RouterServicer(list(shard_addresses), stubs, metadata, layout, shards)
    close_when_stopped(running.server, lambda: _close_all(channels))
    await running.mark_serving()
    return running


class _LateServicer:
    """Answers UNAVAILABLE until the shards are known, then delegates (health says NOT_SERVING meanwhile)."""

    target: RouterServicer | None = None

    async def Search(self, request, context):
        if self.target is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router is still contacting its shards")
        return await self.target.Search(request, context)

    async def GetInfo(self, request, context):
        if self.target is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router is still contacting its shards")
        return await self.target.GetInfo(request, context)


async def _stop(running: RunningServer, channels) -> None:
    await running.server.stop(None)
    await _close_all(channels)


async def _close_all(channels) -> None:
    for c in channels:
        await c.close()


async def create_router_server(
    address: str, shard_addresses: Sequence[str], *, shards: ShardLinks = ShardLinks(),
    options: ServerOptions = ServerOptions(),
) -> tuple[grpc.aio.Server, int]:
    """start_router_server, returning (server, bound port)."""
    running = await start_router_server(address, shard_addresses, shards=shards, options=options)
    return running.server, running.port


async def serve_router(
    shard_addresses: Sequence[str], host: str = DEFAULT_HOST, port: int = 0, *, shards: ShardLinks = ShardLinks(),
    options: ServerOptions = ServerOptions(),
) -> None:
    """Run a router until SIGTERM/SIGINT; prints `listening on HOST:PORT` once it is SERVING. Arguments as
    for start_router_server."""
    running = await start_router_server(join_host_port(host, port), shard_addresses, shards=shards, options=options)
    await run_until_signal(running, host, grace_s=options.grace_s)
