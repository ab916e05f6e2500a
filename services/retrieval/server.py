"""RetrievalService over gRPC: a Searcher (e.g. the on-disk Datastore) behind grpc.aio; beside it, or
alone, MemoryService: session memories for the Memorizing layer (services/retrieval/memory_sessions.py).

Concurrent Search calls are micro-batched (services.retrieval.batching): the requests that arrive while the index is busy (or
within `max_wait_s` of each other) are concatenated into ONE `searcher.search` call on ONE worker
thread per index, because FAISS answers a batch of queries much faster than the same queries one by
one, and GPU indexes are not thread-safe. Requests are grouped by (k, SearchOptions) since
those are per-call arguments of the searcher; results are split back by row. With with_documents a
batch's neighbours and documents come from one generation (services.retrieval.documents, attribution).

Shape legend: Q queries in one request, B queries in one batch (sum of Q), d key dimension, k
neighbours.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from memlm.errors import MemlmError
from memlm.retrieval.attribution import (
    SourcedNeighbors,
)
from memlm.retrieval.searcher import (
    MAX_K,
    MAX_QUERY_ABS,
    Neighbors,
    Searcher,
    SearcherInfo,
    SearchOptions,
    first_unsearchable_query,
)
from memlm.v1 import retrieval_pb2, tensor_pb2
from services.retrieval.memory_sessions import (
    MEMORY_SERVICE,
    MemoryOptions,
    MemoryServicer,
    MemorySessions,
)
from services.retrieval.batching import (
    DEFAULT_BATCHING,
    BatchingOptions,
    DeadlineExceeded,
    ParsedSearch,
    SearchBatcher,
)
from services.retrieval.documents import DOCUMENT_BYTES_PER_NEIGHBOUR, set_documents
from services.retrieval.generations import GenerationWatch, follow_generations
from services.retrieval.successors import SuccessorsNow
from services.retrieval.successors import answer as answer_successors
from services.common.server import (
    DEFAULT_HOST,
    InvalidRequest,
    RunningServer,
    ServerOptions,
    close_when_stopped,
    join_host_port,
    message_classes_of,
    run_until_signal,
    start_server,
)
from services.common.tensors import from_tensor, to_tensor

SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"]
MESSAGE_CLASSES = message_classes_of(retrieval_pb2, tensor_pb2)
QUERY_DTYPES = (tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_FLOAT16)
MAX_NPROBE = 1 << 16
"""Largest nprobe a search may ask for: as many lists as the largest IVF index in common use (IVF65536); more
probes than lists search nothing more, and FAISS sizes (Q, nprobe) arrays by it before searching."""
# Bytes per (query, neighbour) in a SearchResponse: float32 distance + int64 id + int32 value.
RESPONSE_BYTES_PER_NEIGHBOUR = 4 + 8 + 4


@dataclass(frozen=True)
class SearchLimits:
    """What one Search request may ask for (GetInfo reports them, with ServerOptions.max_message_bytes,
    which the response (Q * k * 16 bytes) must fit: OUT_OF_RANGE when it would not)."""

    max_k: int = MAX_K
    """Largest k accepted (OUT_OF_RANGE above); at most memlm.retrieval.searcher.MAX_K, which searchers refuse beyond."""
    max_queries: int = 65536
    """Largest Q in one request (OUT_OF_RANGE above); the client splits bigger batches."""


def parse_search_request(
    request: retrieval_pb2.SearchRequest, info: retrieval_pb2.RetrievalServiceGetInfoResponse
) -> ParsedSearch:
    """Validate a SearchRequest against what GetInfo reports (the datastore's dim, max_k, max_queries,
    max_message_bytes); raise InvalidRequest (or TensorError) naming the bad field. Shared by the retrieval
    server and the router."""
    dim, max_k, max_queries, max_bytes = info.datastore.dim, info.max_k, info.max_queries, info.max_message_bytes
    if not request.HasField("queries"):
        raise InvalidRequest("queries", "missing; send a (Q, d) float32 or float16 tensor")
    xq = from_tensor(request.queries, "queries", dtypes=QUERY_DTYPES, ndim=2)  # (Q, d)
    q, d = xq.shape
    if q == 0:
        raise InvalidRequest("queries.shape[0]", "empty batch: send at least one query")
    if q > max_queries:
        raise InvalidRequest("queries.shape[0]", f"{q} queries, at most {max_queries} per call", grpc.StatusCode.OUT_OF_RANGE)
    if d != dim:
        raise InvalidRequest("queries.shape[1]", f"dimension {d}, the datastore's keys have dimension {dim}")
    if request.k < 1:
        raise InvalidRequest("k", f"{request.k}, must be >= 1")
    if request.k > max_k:
        raise InvalidRequest("k", f"{request.k}, at most {max_k}", grpc.StatusCode.OUT_OF_RANGE)
    if response_bytes(q, request.k, request.with_documents) > max_bytes:
        raise InvalidRequest(
            "queries.shape[0]",
            f"{q} queries x k={request.k} do not fit one {max_bytes}-byte response; split the batch",
            grpc.StatusCode.OUT_OF_RANGE,
        )
    nprobe = request.nprobe if request.HasField("nprobe") else None
    if nprobe is not None and nprobe < 1:
        raise InvalidRequest("nprobe", f"{nprobe}, must be >= 1")
    if nprobe is not None and nprobe > MAX_NPROBE:
        raise InvalidRequest("nprobe", f"{nprobe}, at most {MAX_NPROBE}", grpc.StatusCode.OUT_OF_RANGE)
    exact_rerank = request.exact_rerank if request.HasField("exact_rerank") else False
    bad = first_unsearchable_query(xq)
    if bad is not None:
        raise InvalidRequest("queries.data", f"query {bad} contains NaN, infinity or a coordinate beyond "
                             f"{MAX_QUERY_ABS:g} (the keys' float16 range), where float32 distances cannot order neighbours")
    # float16 -> float32 is exact; one dtype lets requests of both kinds share a batch.
    options = SearchOptions(nprobe=nprobe, exact_rerank=exact_rerank)
    return ParsedSearch(xq.astype(np.float32, copy=False), int(request.k), options, request.with_documents)


def response_bytes(q: int, k: int, with_documents: bool = False) -> int:
    """Upper bound on the serialized size of a SearchResponse for Q queries and k neighbours (with
    documents: without their sources, whose size the server checks on the built response)."""
    per = RESPONSE_BYTES_PER_NEIGHBOUR + (DOCUMENT_BYTES_PER_NEIGHBOUR if with_documents else 0)
    return q * k * per + 1024  # + tensor headers (dtype, shape, tags)


def neighbors_to_response(nb: Neighbors | SourcedNeighbors) -> retrieval_pb2.SearchResponse:
    """The response for neighbours (Q, k), with their documents and sources when `nb` is sourced."""
    found = nb if isinstance(nb, SourcedNeighbors) else None
    nb = found.neighbors if found is not None else nb
    response = retrieval_pb2.SearchResponse(
        distances=to_tensor(np.asarray(nb.distances, dtype=np.float32)),
        ids=to_tensor(np.asarray(nb.ids, dtype=np.int64)),
        values=to_tensor(np.asarray(nb.values, dtype=np.int32)),
    )
    if found is not None:
        set_documents(response, found)
    return response


def info_to_proto(info: SearcherInfo) -> retrieval_pb2.DatastoreInfo:
    """SearcherInfo -> the wire's DatastoreInfo (the one conversion; info_from_proto is its inverse)."""
    return retrieval_pb2.DatastoreInfo(**dataclasses.asdict(info))


def info_from_proto(message: retrieval_pb2.DatastoreInfo) -> SearcherInfo:
    """The wire's DatastoreInfo -> SearcherInfo, every field (weights: float32 from a server that sends none)."""
    info = SearcherInfo(**{f.name: getattr(message, f.name) for f in dataclasses.fields(SearcherInfo)})
    return info if info.weights else dataclasses.replace(info, weights="float32")


# ---------------------------------------------------------------------------------------------
# Servicer and server


class RetrievalServicer:
    """Thin servicer: validate, hand to the batcher, encode."""

    def __init__(self, batcher: SearchBatcher, info: Callable[[], retrieval_pb2.RetrievalServiceGetInfoResponse],
                 successors: SuccessorsNow | None = None):
        self._batcher = batcher
        self._info = info  # the datastore now and the limits every request is checked against
        self._successors = successors  # the Successors rpc's table (None: UNIMPLEMENTED)

    async def Search(self, request: retrieval_pb2.SearchRequest, context: grpc.aio.ServicerContext):
        self._batcher.arriving += 1
        try:
            parsed = parse_search_request(request, self._info())
        finally:
            self._batcher.arriving -= 1
        try:
            nb, generation = await self._batcher.search_served(parsed, context.time_remaining())
        except DeadlineExceeded:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the search started")
        except MemlmError as e:  # with_documents from a datastore without a documents table
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"with_documents: {e}")
        response = neighbors_to_response(nb)
        response.generation = generation
        if parsed.with_documents and response.ByteSize() > self._info().max_message_bytes:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"with_documents: the response ({response.ByteSize()} "
                                "bytes with its sources) does not fit one message; split the batch")
        return response

    async def GetInfo(self, request, context: grpc.aio.ServicerContext):
        return self._info()

    async def Successors(self, request: retrieval_pb2.SuccessorsRequest, context: grpc.aio.ServicerContext):
        return await answer_successors(request, self._successors, self._info().max_message_bytes, context)


def server_info(searcher: Searcher, limits: SearchLimits, max_message_bytes: int,
                watch: GenerationWatch | None) -> Callable[[], retrieval_pb2.RetrievalServiceGetInfoResponse]:
    """GetInfo's answer for the generation served now, built again only when the generation changes."""
    built: list[retrieval_pb2.RetrievalServiceGetInfoResponse] = []

    def info() -> retrieval_pb2.RetrievalServiceGetInfoResponse:
        now, generation = watch.served() if watch is not None else (searcher, 0)
        if not built or built[0].generation != generation:
            datastore = info_to_proto(now.info())
            if now.dim != datastore.dim or (built and datastore.dim != built[0].datastore.dim):
                raise ValueError(f"searcher.dim {now.dim} != searcher.info().dim {datastore.dim} (or it changed)")
            built[:] = [retrieval_pb2.RetrievalServiceGetInfoResponse(
                datastore=datastore, max_k=limits.max_k, max_queries=limits.max_queries,
                max_message_bytes=max_message_bytes, generation=generation)]
        return built[0]

    return info


@dataclass(frozen=True)
class RetrievalServer:
    """A started retrieval server, its batcher and its session memories (tests and benchmarks look at them)."""

    running: RunningServer
    """Server, bound port and health."""
    batcher: SearchBatcher | None
    """The micro-batcher in front of the searcher; None on a server without a datastore."""
    memories: MemorySessions | None = None
    """The session memories (MemoryService); None when the server hosts none."""


async def start_retrieval_server(
    address: str,
    searcher: Searcher | None,
    *,
    options: ServerOptions = ServerOptions(),
    limits: SearchLimits = SearchLimits(),
    batching: BatchingOptions = DEFAULT_BATCHING,
    memories: MemoryOptions | None = None,
    watch: GenerationWatch | None = None,
    successors: SuccessorsNow | None = None,
) -> RetrievalServer:
    """Start a RetrievalService for `searcher` on `address` ("HOST:PORT", port 0 = any free port), and a
    MemoryService beside it when `memories` is given.

    searcher: the Searcher served (e.g. a Datastore): `search(xq (B, d) float32, k, SearchOptions)`, and
        `info()`, which GetInfo sends on (read here, and again when the watched generation changes); None = no datastore (then `memories` is needed,
        and RetrievalService calls are UNIMPLEMENTED).
    options: message size, concurrent calls, grace period, TLS, token (memory calls are authenticated and
        budgeted like Search). limits: largest k and Q per request. batching: micro-batching (see SearchBatcher).
    memories: session limits (services/retrieval/memory_sessions.py); None = no MemoryService.
    watch: follow the datastore's generations (GenerationWatch; GetInfo reports the one served); None: the
        searcher never changes (GetInfo reports generation 0).
    successors: the Successors rpc's table for the generation served now
        (services.retrieval.successors.successors_by_generation); None: that rpc is UNIMPLEMENTED.
    Health reports SERVING once this returns (the searcher is already loaded). The batcher's worker thread
    and the sessions are released when the server stops (`server.stop` / SIGTERM).
    """
    if searcher is None and memories is None:
        raise ValueError("a retrieval server needs a searcher (a datastore), session memories, or both")
    if watch is not None and searcher is None:
        raise ValueError("a generation watch needs the searcher it refreshes")
    services, batcher, sessions = [], None, None
    if searcher is not None:
        info = server_info(searcher, limits, options.max_message_bytes, watch)
        info()  # checks the searcher now, before the server starts
        batcher = SearchBatcher(searcher, batching, None if watch is None else watch.served)
        services.append((SERVICE, RetrievalServicer(batcher, info, successors)))
    if memories is not None:
        sessions = MemorySessions(memories)
        services.append((MEMORY_SERVICE, MemoryServicer(sessions, options.max_message_bytes)))
    running = await start_server(address, services, MESSAGE_CLASSES, options)

    follower = None
    if watch is not None:
        follower = asyncio.get_running_loop().create_task(
            follow_generations(watch, lambda m: print(m, file=sys.stderr, flush=True)))

    async def release() -> None:
        # Once the server has stopped, however it was stopped: join the worker threads, free the sessions.
        if follower is not None:
            follower.cancel()
        if batcher is not None:
            batcher.close()
        if sessions is not None:
            await sessions.close()

    if sessions is not None:
        sessions.start()
        running.metrics.gauge("memlm_memory_sessions", "Memory sessions open", lambda: len(sessions))
        running.metrics.gauge("memlm_memory_bytes", "Bytes the open memory sessions reserve (keys and values)",
                              lambda: sessions.reserved_bytes)
    close_when_stopped(running.server, release)
    await running.mark_serving()
    return RetrievalServer(running, batcher, sessions)


async def create_retrieval_server(
    address: str,
    searcher: Searcher | None,
    *,
    options: ServerOptions = ServerOptions(),
    limits: SearchLimits = SearchLimits(),
    batching: BatchingOptions = DEFAULT_BATCHING,
    memories: MemoryOptions | None = None,
    watch: GenerationWatch | None = None,
    successors: SuccessorsNow | None = None,
) -> tuple[grpc.aio.Server, int]:
    """start_retrieval_server, returning (server, bound port)."""
    started = await start_retrieval_server(address, searcher, options=options, limits=limits, batching=batching,
                                           memories=memories, watch=watch, successors=successors)
    return started.running.server, started.running.port


async def serve_retrieval(
    searcher: Searcher | None,
    host: str = DEFAULT_HOST,
    port: int = 0,
    *,
    options: ServerOptions = ServerOptions(),
    limits: SearchLimits = SearchLimits(),
    batching: BatchingOptions = DEFAULT_BATCHING,
    memories: MemoryOptions | None = None,
    watch: GenerationWatch | None = None,
    successors: SuccessorsNow | None = None,
) -> None:
    """Serve `searcher` (and/or session memories) until SIGTERM/SIGINT: prints `listening on HOST:PORT`
    once healthy, then drains in-flight calls on the signal (for up to options.grace_s) and returns.
    Arguments as for start_retrieval_server."""
    started = await start_retrieval_server(
        join_host_port(host, port), searcher, options=options, limits=limits, batching=batching, memories=memories,
        watch=watch, successors=successors,
    )
    await run_until_signal(started.running, host, grace_s=options.grace_s)
