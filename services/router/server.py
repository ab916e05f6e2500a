"""Shard router: one RetrievalService in front of N retrieval servers holding shards of one corpus.

A Search is validated, sent to every shard concurrently with the caller's remaining deadline, and
the per-shard top-k lists are merged into a global top-k by distance (smaller is nearer). Because each shard returns its own
exact top-k, the merged list equals the top-k over the union for exact (Flat) shards.

Global ids: shard s's local id i becomes offset_s + i, where offset_s is the sum of N (from
GetInfo) of the shards listed BEFORE it. So the --shard order must be the order in which the
datastore builder wrote the shards; then a global id is the row number in the concatenated corpus.
Missing neighbours (id -1) stay -1.

Generations: a shard's N changes when `memlm datastore add` or `compact` commits a generation
it then serves. Every shard SearchResponse carries the generation that answered; when one differs from
the generation the router's offsets were computed from, the router asks all shards for GetInfo again,
recomputes the offsets, and uses the answers if their generations match the new layout (else it searches
once more). So merged ids are always rows of the concatenation of the generations that answered.

Faults: a shard call never outlives the caller's deadline nor ShardLinks.call_timeout_s
(a caller without a deadline must not wait forever on a hung shard), and each replica has a circuit breaker
(services/common/circuit.py): after repeated failures the router skips it at once, until a trial call after the
back-off succeeds.

Replicas: a shard may be served by several replicas (`--shard A,B`), chosen by health
and failed over or hedged within the caller's deadline (services/router/replicas.py). When every replica of a
shard is gone the call fails with that replica's code (UNAVAILABLE for a dead one) naming the shard, or,
when the request sets allow_partial, is answered from the other shards with partial set and the missing
shards named (their rows keep their offsets: ids stay those of the whole union).

Shape legend: Q queries, k neighbours, S shards.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import numpy as np

from memlm.errors import MemlmError
from memlm.retrieval.searcher import Neighbors
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc, tensor_pb2
from services.common.circuit import BreakerConfig, CircuitBreaker
from services.common.metrics import AsyncClientCalls, LinkMetrics
from services.router.replicas import (
    RETRIED_CODES,
    Replica,
    ReplicaSet,
    ShardFailed,
    replicas_of,
)
from services.retrieval.documents import decode_sourced, merge_sourced
from services.retrieval.server import (
    MESSAGE_CLASSES,
    SERVICE,
    neighbors_to_response,
    parse_search_request,
)
from services.common.security import ClientTls, auth_metadata
from services.common.server import (
    DEFAULT_HOST,
    RunningServer,
    ServerOptions,
    close_when_stopped,
    join_host_port,
    open_channel,
    run_until_signal,
    start_server,
)
from services.common.tensors import TensorError, from_tensor

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
    infos: list[retrieval_pb2.RetrievalServiceGetInfoResponse]
    """Each shard's own GetInfo answer (kept for a shard that is down when the layout is renewed)."""


def layout_of(addresses: Sequence[str], infos: Sequence[retrieval_pb2.RetrievalServiceGetInfoResponse],
              max_message_bytes: int) -> Layout:
    info, offsets = merge_shard_infos(addresses, infos, max_message_bytes)
    return Layout(info, offsets, [i.generation for i in infos], list(infos))


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
    return merge_top_k_order(results, offsets, k)[0]


def merge_top_k_order(results: Sequence[Neighbors], offsets: Sequence[int], k: int) -> tuple[Neighbors, np.ndarray]:
    """merge_top_k, and the (Q, k) columns it picked from the results side by side (S * k columns, shard
    order), with which the neighbours' documents are merged (services.retrieval.documents.merge_sourced)."""
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
    ), order


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
    """RetrievalService that fans out to one replica of every shard and merges."""

    def __init__(self, shards: Sequence[ReplicaSet], layout: Layout, links: ShardLinks):
        self._shards = list(shards)
        self._layout = layout  # the union of the shards, the tightest of their limits, the id offsets
        self._call_timeout_s = links.call_timeout_s

    async def Search(self, request: retrieval_pb2.SearchRequest, context: grpc.aio.ServicerContext):
        # Validate here too: bad input is refused once, not S times, and the message names the field.
        parsed = parse_search_request(request, self._layout.info)
        deadline_s = self._deadline(context)
        for _ in range(2):  # a second time only when a shard changed generation during the first
            responses = await self._fan_out(request, deadline_s, context)  # None: a shard that is gone
            layout = self._layout
            if not _answered_from(layout, responses):
                layout = await self._relayout(deadline_s, context)
            if _answered_from(layout, responses):
                break
        else:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shards changed generation during the call; retry")
        q = len(parsed.xq)
        answered = [i for i, r in enumerate(responses) if r is not None]
        try:
            results = [_decode(responses[i], q, parsed.k) for i in answered]
            # With documents (attribution): each shard's, from the generation its neighbours came from.
            sourced = [decode_sourced(responses[i], r, 0) for i, r in zip(answered, results)] \
                if parsed.with_documents else None
        except TensorError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"bad shard response: {e}")
        merged, order = merge_top_k_order(results, [layout.offsets[i] for i in answered], parsed.k)
        response = neighbors_to_response(merged if sourced is None else merge_sourced(sourced, order, merged))
        if sourced is not None and response.ByteSize() > self._layout.info.max_message_bytes:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"with_documents: the merged response ({response.ByteSize()} "
                                "bytes with its sources) does not fit one message; split the batch")
        missing = [shard.name for shard, r in zip(self._shards, responses) if r is None]
        if missing:  # only when the caller allowed it (_fan_out)
            response.partial = True
            response.missing_shards.extend(missing)
        return response

    def _deadline(self, context: grpc.aio.ServicerContext) -> Callable[[], float]:
        """Seconds the next shard call may take: the caller's remaining deadline, at most call_timeout_s (a
        caller without a deadline must not wait forever on a hung shard)."""
        def seconds() -> float:
            remaining = context.time_remaining()
            return self._call_timeout_s if remaining is None else min(remaining, self._call_timeout_s)
        return seconds

    async def _relayout(self, deadline_s: Callable[[], float], context: grpc.aio.ServicerContext) -> Layout:
        """Ask every shard for GetInfo and replace the layout (a shard now serves another generation); a shard
        that does not answer keeps its last info (a partial answer leaves it out anyway)."""
        old = self._layout
        answers = await asyncio.gather(*(
            shard.call(_get_info, retrieval_pb2.RetrievalServiceGetInfoRequest(), deadline_s)
            for shard in self._shards), return_exceptions=True)
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, ShardFailed):
                raise a
        infos = [old.infos[i] if isinstance(a, ShardFailed) else a for i, a in enumerate(answers)]
        try:
            self._layout = layout_of([s.name for s in self._shards], infos, old.info.max_message_bytes)
        except MemlmError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"shards no longer agree: {e}")
        return self._layout

    async def _fan_out(self, request, deadline_s: Callable[[], float], context) -> list:
        """Every shard's SearchResponse (None for a shard whose replicas are all down, when the request allows
        a partial answer), or an abort naming the shard that failed."""
        calls = [asyncio.ensure_future(shard.call(_search, request, deadline_s)) for shard in self._shards]
        try:
            if not request.allow_partial:  # the first failure decides: stop waiting for the others
                return await asyncio.gather(*calls)
            answers = await asyncio.gather(*calls, return_exceptions=True)
        except ShardFailed as f:
            # Pass the shard's code on (DEADLINE_EXCEEDED stays that), naming the shard.
            await context.abort(f.code, f"shard {f.shard}: {f.details}")
        finally:
            for c in calls:  # one shard failed (or our caller went away): stop waiting for the others
                c.cancel()
        failed = [a for a in answers if isinstance(a, BaseException)]
        for f in failed:
            if not isinstance(f, ShardFailed):
                raise f
        refused = [f for f in failed if f.code not in RETRIED_CODES]  # a bad request is no missing shard
        if refused or len(failed) == len(answers):
            f = (refused or failed)[0]
            await context.abort(f.code, f"shard {f.shard}: {f.details}")
        return [None if isinstance(a, ShardFailed) else a for a in answers]

    async def GetInfo(self, request, context: grpc.aio.ServicerContext):
        return self._layout.info


def _search(stub):
    return stub.Search


def _get_info(stub):
    return stub.GetInfo


def _answered_from(layout: Layout, responses) -> bool:
    """True when every shard that answered answered from the generation `layout`'s offsets assume."""
    return all(r is None or r.generation == g for r, g in zip(responses, layout.generations))


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
    """When repeated failures of one replica make the router skip it at once (UNAVAILABLE naming the shard
    when it was the last)."""
    hedge_after_s: float | None = 1.0
    """Seconds a shard call may go unanswered before the shard's next replica is sent the same request (the
    first answer wins); None = another replica only on failure. Above a healthy replica's search time, so
    hedges stay rare: each is a second search."""

    def __post_init__(self) -> None:
        if self.hedge_after_s is not None and self.hedge_after_s <= 0:
            raise ValueError(f"hedge_after_s must be > 0 or None, got {self.hedge_after_s}")


async def start_router_server(
    address: str,
    shard_addresses: Sequence[str],
    *,
    shards: ShardLinks = ShardLinks(),
    options: ServerOptions = ServerOptions(),
) -> RunningServer:
    """Start a router on `address` over `shard_addresses` (in the builder's shard order), each one shard's
    replicas: HOST:PORT[,HOST:PORT...] (services/router/replicas.py).

    shards: how the router reaches the shards; options: what the router's own callers get and must use
    (TLS, token, message size, concurrent calls, grace period). The server starts NOT_SERVING, asks every
    shard for GetInfo (the first replica to answer, waiting up to shards.connect_timeout_s), checks they
    agree, starts watching every replica's health, then reports SERVING. Raises MemlmError (after stopping)
    when a shard is unreachable or the shards disagree.
    """
    if not shard_addresses:
        raise MemlmError("the router needs at least one --shard HOST:PORT[,HOST:PORT...]")
    try:
        groups = [replicas_of(a) for a in shard_addresses]
    except ValueError as e:
        raise MemlmError(str(e)) from None
    metadata = auth_metadata(shards.token)
    sets, calls = [], []
    for group in groups:
        replicas = []
        for a in group:
            calls.append(AsyncClientCalls())
            channel = open_channel(a, shards.tls, options.max_message_bytes, asynchronous=True,
                                   interceptors=[calls[-1]])
            replicas.append(Replica(a, channel, retrieval_pb2_grpc.RetrievalServiceStub(channel),
                                    CircuitBreaker(shards.breaker)))
        sets.append(ReplicaSet(",".join(group), replicas, shards.hedge_after_s, metadata))
    channels = [r.channel for s in sets for r in s.replicas]
    names = [s.name for s in sets]

    servicer = _LateServicer()
    running = await start_server(address, [(SERVICE, servicer)], MESSAGE_CLASSES, options)
    links = LinkMetrics(running.metrics)  # each replica's calls and breaker, by its address
    for replica, replica_calls in zip((r for s in sets for r in s.replicas), calls):
        links.watch(replica.address, replica_calls, lambda breaker=replica.breaker: breaker.state)
    try:
        loop = asyncio.get_running_loop()
        connect_by = loop.time() + shards.connect_timeout_s
        infos = await asyncio.gather(*(
            s.call(_get_info_when_ready, retrieval_pb2.RetrievalServiceGetInfoRequest(),
                   lambda: connect_by - loop.time())
            for s in sets
        ))
        layout = layout_of(names, infos, options.max_message_bytes)
    except ShardFailed as e:
        await _stop(running, channels)
        raise MemlmError(f"router: shard {e.shard} did not answer GetInfo: {e.code.name}: {e.details}") from None
    except MemlmError:
        await _stop(running, channels)
        raise
    watchers = [asyncio.ensure_future(r.watch_health()) for s in sets for r in s.replicas]
    servicer.target = RouterServicer(sets, layout, shards)

    async def close() -> None:
        for w in watchers:
            w.cancel()
        await _close_all(channels)

    close_when_stopped(running.server, close)
    await running.mark_serving()
    return running


def _get_info_when_ready(stub):
    """GetInfo that waits for a replica still starting (start-up only; a live call fails over instead)."""
    return functools.partial(stub.GetInfo, wait_for_ready=True)


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

    async def Successors(self, request, context):
        # Ids are the shards' rows behind the router's offsets, so Successors is not routed, as the proto says.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "a shard router does not answer Successors; ask a "
                            "retrieval server (memlm serve retrieval) of one datastore")


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
