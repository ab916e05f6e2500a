"""A synchronous RetrievalService client that answers the Searcher seam (memlm/retrieval/searcher.py).

Library code (kNN-LM scoring, evaluation) calls `search(xq, k, options)` and `info()` without knowing
whether the datastore is in-process, behind one retrieval server, or behind a shard router: one Searcher seam.
It uses a blocking grpc channel, so it works from plain synchronous code and from threads.

Faults: the client keeps a circuit breaker (services/common/circuit.py) and, for a long-lived
link (`watch_link`: the LM server's), follows its channel's connectivity (`link_up`), so a dead or hung
retrieval service fails searches at once with UNAVAILABLE instead of making every caller wait out a deadline;
`search_call` runs one caller's search within its `CallOptions` (deadline, cancel, the model's turn given away
while it waits; services.retrieval.call_searcher wraps it for a server call); `wait_until_ready` is the
start-up check that fails in one line instead of waiting silently.

Shape legend: Q queries, d key dimension, k neighbours.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import numpy as np
from grpc_health.v1 import health

from memlm.jobs.windows import ShouldStop, WorkStopped
from memlm.retrieval.attribution import SourcedNeighbors
from memlm.retrieval.searcher import Neighbors, Searcher, SearcherInfo, SearchOptions
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc, tensor_pb2
from services.common.circuit import BreakerConfig, CircuitBreaker
from services.retrieval.documents import decode_sourced
from services.retrieval.server import (
    info_from_proto,
    response_bytes,
)
from services.retrieval.successors import SUCCESSOR_BYTES
from services.common.security import ClientTls
from services.common.server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    NOT_SERVING,
    SERVING,
    ServiceClient,
    ServiceError,
)
from services.common.tensors import TensorError, from_tensor, to_tensor

CONNECT_TIMEOUT_S = 5.0
"""Seconds `memlm serve lm --retrieval` waits at start-up for its retrieval service, then fails in one line."""

STOP_POLL_S = 0.05
"""While a search waits, how often (seconds) it asks the caller's should_stop whether to give up."""

BREAKER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Failures that say the service is down or hung; any other answer shows it alive (a bad request is not its fault)."""


class Wants(enum.Enum):
    """What one search gives back besides its neighbours."""

    NEIGHBORS = "neighbors"
    """The neighbours only (Searcher.search)."""
    GENERATION = "generation"
    """And the datastore generation that answered (GenerationSearcher.search_generation)."""
    SOURCES = "sources"
    """And each neighbour's document, all from one generation (SourcedSearcher.search_sourced: attribution)."""


@dataclass(frozen=True)
class CallOptions:
    """How one caller's remote searches run: ended by its deadline, cancelled once it gives up, waiting without
    what it holds (the model's turn), and what each gives back."""

    deadline: float | None = None
    """time.monotonic() seconds by which every search call ends (DEADLINE_EXCEEDED); None = the client's timeout only."""
    should_stop: ShouldStop | None = None
    """Polled every STOP_POLL_S while a search waits: True cancels it (WorkStopped); None = never."""
    turn_away: Callable[[], contextlib.AbstractContextManager[None]] | None = None
    """Entered around the whole remote search (services.lm.scheduler.StepGate.outside: other calls' steps run
    while it waits); None = the search keeps what the caller holds."""
    wants: Wants = Wants.NEIGHBORS
    """What a search gives back (Found)."""


class Found(NamedTuple):
    """One search's answer (RetrievalClient.search_call, services.retrieval.call_searcher.CallSearcher)."""

    neighbors: Neighbors
    """(Q, k) distances, ids, values."""
    generation: int
    """The datastore generation that answered (of a batch split into calls answered by different generations, the
    newest); 0 from a searcher without generations, as SearchResponse.generation says."""
    sourced: SourcedNeighbors | None = None
    """Wants.SOURCES: the neighbours with their documents; None otherwise."""


class LinkWatcher:
    """Follows a blocking channel's connectivity: `up` is True after READY, False after TRANSIENT_FAILURE or
    SHUTDOWN, None before either (not known yet); CONNECTING keeps the last value.

    A channel whose server went away falls back to IDLE and would not try again until the next call, so on
    IDLE the watcher asks it to connect: a lost service is noticed, and a returning one too, without any
    search. Listeners get every change of `up`, on grpc's thread (keep them short).
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()
        self._up: bool | None = None
        # A connection has been asked for and not yet begun: grpc delivers the IDLE it starts from (again after
        # a resubscription), which must not ask again. Asking while the channel closes makes grpc's poller
        # raise on its thread.
        self._asked = True
        self._closed = False
        self._listeners: list[Callable[[bool], None]] = []
        channel.subscribe(self._on_state, try_to_connect=True)

    @property
    def up(self) -> bool | None:
        with self._lock:
            return self._up

    def add_listener(self, listener: Callable[[bool], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.IDLE:
            with self._lock:
                if self._asked or self._closed:
                    return
                self._asked = True
            # Subscribing again with try_to_connect is the public way to make grpc's poller connect.
            self._channel.unsubscribe(self._on_state)
            self._channel.subscribe(self._on_state, try_to_connect=True)
            return
        with self._lock:
            self._asked = False
            if state is grpc.ChannelConnectivity.READY:
                up = True
            elif state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                up = False
            else:  # CONNECTING
                return
            if up == self._up:
                return
            self._up = up
            listeners = list(self._listeners)
        for listener in listeners:
            listener(up)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._channel.unsubscribe(self._on_state)


class RetrievalClient(ServiceClient):
    """Searcher backed by a remote RetrievalService (a retrieval server or a shard router).

    Arguments as ServiceClient; the timeout is per call, and a search of many queries makes several calls.
    breaker: when repeated failures stop searches from going out (services/common/circuit.py).
    Errors are ServiceError (a MemlmError) carrying the gRPC status code. A search fails at once with
    UNAVAILABLE while the breaker is open or (watch_link) the channel cannot connect; wait_for_ready does
    not wait then.
    """

    def __init__(
        self,
        address: str,
        *,
        tls: ClientTls | None = None,
        token: str | None = None,
        timeout: float | None = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        wait_for_ready: bool = False,
        breaker: BreakerConfig = BreakerConfig(),
    ) -> None:
        super().__init__(address, tls, token, timeout, max_message_bytes, wait_for_ready)
        self._stub = retrieval_pb2_grpc.RetrievalServiceStub(self._channel)
        self._server_info: retrieval_pb2.RetrievalServiceGetInfoResponse | None = None
        self._breaker = CircuitBreaker(breaker)
        self._link: LinkWatcher | None = None  # watch_link() starts it

    def watch_link(self) -> None:
        """Follow the channel's connectivity from now on (on a thread of grpc's): while it cannot connect,
        searches fail fast and link_up is False. For long-lived links (the LM server's); idempotent."""
        if self._link is None:
            self._link = LinkWatcher(self._channel)
            self._link.add_listener(self._on_link_change)

    @property
    def link_up(self) -> bool | None:
        """True: connected; False: the channel cannot connect (searches fail fast); None: not known yet or
        not watched (watch_link)."""
        return None if self._link is None else self._link.up

    def add_link_listener(self, listener: Callable[[bool], None]) -> None:
        """Call listener(up) on every change of link_up, on grpc's thread (starts watch_link)."""
        self.watch_link()
        self._link.add_listener(listener)

    @property
    def breaker_state(self) -> str:
        """The circuit breaker's state now: services.common.circuit.CLOSED, HALF_OPEN or OPEN."""
        return self._breaker.state

    def _on_link_change(self, up: bool) -> None:
        if up:  # the service is back: no need to wait out the breaker's back-off
            self._breaker.reset()

    def wait_until_ready(self, timeout_s: float) -> None:
        """Block until the channel is connected; ServiceError UNAVAILABLE after timeout_s (a start-up check)."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ServiceError(self.address, grpc.StatusCode.UNAVAILABLE,
                               f"retrieval service not reachable within {timeout_s:g} s; is it running?") from None
        finally:
            ready.cancel()

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            # grpc's connectivity poller looks at the channel every 0.2 s until it sees nobody subscribed; a
            # channel closed under it makes it raise on its thread. Let it see that first (at most two rounds).
            time.sleep(0.5)
        super().close()

    def server_info(self) -> retrieval_pb2.RetrievalServiceGetInfoResponse:
        """The server's GetInfo answer, datastore and request limits (fetched once, then cached)."""
        if self._server_info is None:
            self._server_info = self._call(self._stub.GetInfo, retrieval_pb2.RetrievalServiceGetInfoRequest())
        return self._server_info

    def generation(self) -> int:
        """The generation the server answers from now (GetInfo, asked again: a live server switches when
        `memlm datastore add`, `remove` or `compact` commits), for results that record which
        generation served them. Refreshes what server_info() and info() return too."""
        self._server_info = self._call(self._stub.GetInfo, retrieval_pb2.RetrievalServiceGetInfoRequest())
        return int(self._server_info.generation)

    def info(self) -> SearcherInfo:
        """The remote datastore (for a router: the union of its shards), as the Searcher seam says."""
        return info_from_proto(self.server_info().datastore)

    @property
    def dim(self) -> int:
        """Key dimension d of the remote datastore."""
        return self.server_info().datastore.dim

    def rows_per_call(self, k: int, itemsize: int = 4, with_documents: bool = False) -> int:
        """Most queries one call may carry: within the server's max_queries, and so that both the
        request (Q * d * itemsize bytes) and the response (Q * k * 16 bytes, 20 with documents) fit one
        message on both ends."""
        info = self.server_info()
        limit = min(self._max_message_bytes, info.max_message_bytes or self._max_message_bytes)
        per_query = response_bytes(1, max(k, 1), with_documents) - response_bytes(0, k)  # k < 1: server says why
        by_response = (limit - response_bytes(0, k)) // per_query
        by_request = (limit - 4096) // (self.dim * itemsize)  # 4096: room for the message's headers
        return max(1, min(info.max_queries or by_request, by_request, by_response))

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        """Searcher.search: xq (Q, d) float32 or float16 queries -> Neighbors with (Q, k) arrays (search_call)."""
        return self.search_call(xq, k, options).neighbors

    def search_generation(self, xq: np.ndarray, k: int, options: SearchOptions | None = None
                          ) -> tuple[Neighbors, int]:
        """GenerationSearcher.search_generation: search, and the generation that answered (search_call)."""
        found = self.search_call(xq, k, options, CallOptions(wants=Wants.GENERATION))
        return found.neighbors, found.generation

    def search_sourced(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> SourcedNeighbors:
        """SourcedSearcher.search_sourced: search, plus each neighbour's document and the generation that
        answered (search_call with Wants.SOURCES)."""
        return self.search_call(xq, k, options, CallOptions(wants=Wants.SOURCES)).sourced

    def search_call(self, xq: np.ndarray, k: int, options: SearchOptions | None = None,
                    call: CallOptions = CallOptions()) -> Found:
        """xq: (Q, d) float32 or float16 queries -> Found with (Q, k) arrays, run as `call` says: every call ends by
        its deadline, is cancelled (WorkStopped) once its should_stop() (polled every STOP_POLL_S), and the whole
        search runs inside its turn_away.

        options: sent with every call (nprobe only when set: unset is the datastore's default). Batches bigger than
        one message are split into several calls, made one after another; with Wants.SOURCES, calls answered by
        different generations are refused (ServiceError ABORTED: retry), as one result's documents come from one
        documents table.
        """
        with call.turn_away() if call.turn_away is not None else contextlib.nullcontext():
            return self._search(xq, k, options, call)

    def successors_generation(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """The Successors rpc: ids (M,) int64 datastore rows -> (next_ids (M,) int64, -1 at a document's end;
        next_values (M,) int32; the generation that answered, SuccessorsResponse.generation), in calls that fit
        a message; calls answered by different generations: ServiceError ABORTED, as a split sourced search.
        Rows are a generation's (compaction renumbers them): a pointer walk compares the generation
        with its searches' (services.retrieval.walk.OneGeneration, the walk's SuccessorLookup)."""
        ids = np.asarray(ids, dtype=np.int64)  # (M,)
        if ids.shape[0] == 0:
            return np.empty(0, np.int64), np.empty(0, np.int32), self.generation()
        info = self.server_info()
        limit = min(self._max_message_bytes, info.max_message_bytes or self._max_message_bytes)
        step = max(1, (limit - 4096) // SUCCESSOR_BYTES)  # the response (12 B an id) is the bigger message
        nxt, values, generations = [], [], set()
        for start in range(0, ids.shape[0], step):
            response = self._call(self._stub.Successors, retrieval_pb2.SuccessorsRequest(ids=to_tensor(ids[start : start + step])))
            generations.add(int(response.generation))
            try:
                nxt.append(from_tensor(response.next_ids, "next_ids", dtypes=(tensor_pb2.DTYPE_INT64,), ndim=1))
                values.append(from_tensor(response.values, "values", dtypes=(tensor_pb2.DTYPE_INT32,), ndim=1))
            except TensorError as e:
                raise ServiceError(self.address, grpc.StatusCode.INTERNAL, f"bad response: {e}") from None
        if len(generations) > 1:
            raise ServiceError(self.address, grpc.StatusCode.ABORTED, "the datastore changed generation during a "
                               "successors lookup split into several calls; retry")
        return np.concatenate(nxt), np.concatenate(values), generations.pop()  # (M,), (M,)

    def _search(self, xq: np.ndarray, k: int, options: SearchOptions | None, call: CallOptions) -> Found:
        options = options or SearchOptions()
        with_documents = call.wants is Wants.SOURCES
        xq = np.asarray(xq)
        if xq.dtype != np.float16:
            xq = xq.astype(np.float32, copy=False)  # float16 travels as is: half the bytes
        if xq.ndim != 2:
            raise ValueError(f"xq must be (Q, d), got shape {xq.shape}")
        if len(xq) == 0:  # what a local FAISS index answers; the server refuses empty batches
            empty = Neighbors(np.empty((0, k), np.float32), np.empty((0, k), np.int64), np.empty((0, k), np.int32))
            return Found(empty, 0, SourcedNeighbors(empty, np.empty((0, k), np.int32), (), 0) if with_documents else None)
        step = self.rows_per_call(k, xq.dtype.itemsize, with_documents)
        parts, generations = [], set()
        for start in range(0, len(xq), step):
            chunk = xq[start : start + step]  # (q, d)
            request = retrieval_pb2.SearchRequest(
                queries=to_tensor(chunk), k=k, nprobe=options.nprobe, exact_rerank=options.exact_rerank,
                with_documents=with_documents,
            )
            response = self._guarded_search(request, call.deadline, call.should_stop)
            generations.add(int(response.generation))
            nb = self._decode(response, len(chunk), k)
            if with_documents:
                try:
                    nb = decode_sourced(response, nb, int(response.generation))
                except TensorError as e:
                    raise ServiceError(self.address, grpc.StatusCode.INTERNAL, f"bad response: {e}") from None
            parts.append(nb)
        if len(generations) > 1 and with_documents:  # one result's documents come from one documents table
            raise ServiceError(self.address, grpc.StatusCode.ABORTED, "the datastore changed generation during a "
                               "search with documents split into several calls; retry")
        generation = max(generations)
        if not with_documents:
            nb = parts[0] if len(parts) == 1 else Neighbors(*(np.concatenate(a) for a in zip(*parts)))  # (Q, k) each
            return Found(nb, generation)
        sourced = parts[0] if len(parts) == 1 else _join_sourced(parts)
        return Found(sourced.neighbors, generation, sourced)

    def _guarded_search(self, request: retrieval_pb2.SearchRequest, deadline: float | None,
                        should_stop: ShouldStop | None) -> retrieval_pb2.SearchResponse:
        """One Search call: refused at once while the link is down or the breaker open, within the caller's
        deadline and the client's timeout, cancelled when should_stop(), its outcome told to the breaker."""
        if self.link_up is False:
            raise self._down("the channel cannot connect")
        if not self._breaker.allow():
            raise self._down(f"circuit open after repeated failures; next try in {self._breaker.retry_in():.1f} s")
        timeout = self.timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceError(self.address, grpc.StatusCode.DEADLINE_EXCEEDED, "the caller's deadline passed")
            timeout = left if timeout is None else min(timeout, left)
        call = self._stub.Search.future(request, timeout=timeout, metadata=self._metadata,
                                        wait_for_ready=self._wait_for_ready)
        try:
            response = _wait(call, should_stop)
        except WorkStopped:
            call.cancel()
            self._breaker.record_abandoned()
            raise
        except grpc.RpcError as e:
            if e.code() in BREAKER_CODES:
                self._breaker.record_failure()
            else:
                self._breaker.record_success()
            raise ServiceError(self.address, e.code(), e.details() or "") from None
        self._breaker.record_success()
        return response

    def _down(self, why: str) -> ServiceError:
        return ServiceError(self.address, grpc.StatusCode.UNAVAILABLE, f"retrieval link down ({why}); failing fast")

    def _decode(self, response: retrieval_pb2.SearchResponse, q: int, k: int) -> Neighbors:
        try:
            out = Neighbors(
                from_tensor(response.distances, "distances", dtypes=(tensor_pb2.DTYPE_FLOAT32,), ndim=2),
                from_tensor(response.ids, "ids", dtypes=(tensor_pb2.DTYPE_INT64,), ndim=2),
                from_tensor(response.values, "values", dtypes=(tensor_pb2.DTYPE_INT32,), ndim=2),
            )
        except TensorError as e:
            raise ServiceError(self.address, grpc.StatusCode.INTERNAL, f"bad response: {e}") from None
        for name, a in zip(Neighbors._fields, out):
            if a.shape != (q, k):
                raise ServiceError(
                    self.address, grpc.StatusCode.INTERNAL, f"bad response: {name} shape {a.shape}, expected {(q, k)}"
                )
        # Copies: the decoded views of the message bytes are read-only, local FAISS results are not.
        return Neighbors(*(np.array(a) for a in out))


def _join_sourced(parts: list[SourcedNeighbors]) -> SourcedNeighbors:
    """The calls of one split batch (one generation) as one result (Q, k): sources concatenated, indices shifted."""
    documents, sources = [], []
    for p in parts:
        documents.append(np.where(p.documents >= 0, p.documents + len(sources), -1).astype(np.int32))  # (q, k)
        sources.extend(p.sources)
    neighbors = Neighbors(*(np.concatenate(arrays) for arrays in zip(*(p.neighbors for p in parts))))  # (Q, k)
    return SourcedNeighbors(neighbors, np.concatenate(documents), tuple(sources), parts[0].generation)


def _wait(call: grpc.Future, should_stop: ShouldStop | None):
    """call's result (its RpcError raised), or WorkStopped as soon as should_stop() says the caller gave up."""
    if should_stop is None:
        return call.result()
    while True:
        try:
            return call.result(timeout=STOP_POLL_S)
        except grpc.FutureTimeoutError:
            if should_stop():
                raise WorkStopped("stopped: the caller gave up during a retrieval search") from None


def connect_retrieval(address: str, *, tls: ClientTls | None, token: str | None,
                      connect_timeout_s: float = CONNECT_TIMEOUT_S) -> RetrievalClient:
    """The LM server's link to its retrieval service: searches fail fast while it is down (wait_for_ready
    off, the link watched), and start-up fails with one ServiceError line when it is not reachable within
    connect_timeout_s."""
    client = RetrievalClient(address, tls=tls, token=token, wait_for_ready=False)
    try:
        client.wait_until_ready(connect_timeout_s)
        client.watch_link()
    except BaseException:
        client.close()
        raise
    return client


KNN_HEALTH_NAME = "memlm.v1.LanguageModelService/knn"
"""The health service name of an LM server's kNN-LM: SERVING while its searcher answers, NOT_SERVING while
its retrieval link is down (the base LM, "memlm.v1.LanguageModelService", keeps serving)."""

_HEALTH_TASKS: set[asyncio.Task] = set()
"""health.set tasks started from grpc's thread, held until done so that they are not garbage-collected."""


async def report_knn_health(health_servicer: health.aio.HealthServicer, searcher: Searcher | None) -> None:
    """Report KNN_HEALTH_NAME on the server's health from now on: not at all without a searcher (the name is
    unknown: NOT_FOUND), SERVING for an in-process one, and for a RetrievalClient whatever its link says,
    following every change. Call on the server's event loop once the searcher is loaded."""
    if searcher is None:
        return
    if not isinstance(searcher, RetrievalClient):
        await health_servicer.set(KNN_HEALTH_NAME, SERVING)
        return
    loop = asyncio.get_running_loop()

    def set_status(up: bool) -> None:  # on the event loop
        task = loop.create_task(health_servicer.set(KNN_HEALTH_NAME, SERVING if up else NOT_SERVING))
        _HEALTH_TASKS.add(task)
        task.add_done_callback(_HEALTH_TASKS.discard)

    def changed(up: bool) -> None:  # on grpc's thread
        try:
            loop.call_soon_threadsafe(set_status, up)
        except RuntimeError:  # the server's loop is closed: nobody is asking any more
            pass

    searcher.add_link_listener(changed)
    await health_servicer.set(KNN_HEALTH_NAME, NOT_SERVING if searcher.link_up is False else SERVING)
