"""The LM server's Generate and Score on the decoding engine: one running batch per setting.

Every Generate call with MEMORY_MODE_NONE, XL, COMPRESSIVE, MEMORIZING (with or without kNN-LM) or SPALM is a request
in a running `memlm.engine.Engine` batch: requests join between steps, leave when they end, are cancelled or pass
their deadline, and every step decodes all of them in one forward pass (with kNN-LM or SPALM: one batched
search for every ready row, each with its own settings, memlm.engine.sampling / spalm_rows; a transformers
model's rows run their own forwards in the step, memlm.engine.engine). The engine takes
one MemoryConfig for all its rows, so calls are grouped into `Lane`s by memory and by whether they search
(LaneKey); a Score of the engine's modes puts each input in the lane of its settings as score rows
(services.lm.score_engine), beside the Generate rows; at most MAX_LANES lanes live at once (an idle one is
closed to make room; none: RESOURCE_EXHAUSTED).

Model turns (services.lm.scheduler): each lane's thread takes the model's turn like any call, as a tenant of
its own ("engine:<lane>"), for one engine step at a time, passed on at every step boundary when Score calls
wait. A remote search gives the turn away while it waits and ends when every caller in the batch
gave up or the batch's latest deadline passed (the lane's services.retrieval.call_searcher.CallSearcher); a
failing search ends the rows whose own search failed with its status, never other rows nor other lanes' calls.

Admission is bounded (LMLimits.max_batch rows per batch, max_queue waiting per batch, max_tokens_in_flight
prompt + max_new_tokens over every Generate call of the server, the tokens whose KV fits in max_kv_bytes; all in
GetInfo): beyond, RESOURCE_EXHAUSTED
ending "retry after N ms", trailing metadata `retry-after-ms: N` (RETRY_AFTER_KEY): when a row is likely
free (the soonest-finishing request's steps left x the batch's mean step time). After every step the lane
puts each handle's ready events on the call's asyncio queue (loop.call_soon_threadsafe): a stream carries
each token as it is made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from memlm.engine.drafts import DraftSource, SpeculativeConfig
from memlm.engine.engine import Engine
from memlm.engine.requests import (
    ENGINE_MEMORY_KINDS,
    EngineConfig,
    EngineFull,
    Event,
    GenerationRequest,
    RequestHandle,
    ScoreRequest,
    SpalmSettings,
)
from memlm.errors import MemlmError
from memlm.jobs.decoding import (
    GenerationEnd,
    SamplingConfig,
    TokenEvent,
)
from memlm.jobs.knnlm_eval import Retrieval
from memlm.jobs.scoring import SequenceScore
from memlm.jobs.windows import WorkStopped
from memlm.model.memory_config import MemoryConfig
from memlm.memory.memorizing import KnnAttention
from memlm.memory.spalm import SpalmHead
from memlm.model.decoder import Decoder
from memlm.model.tokenizer import Tokenizer
from memlm.retrieval.attribution import (
    SourcedNeighbors,
    TokenAttribution,
    attribute,
)
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.memory.knn_store import KeyValueMemoryFactory
from memlm.retrieval.searcher import Searcher
from memlm.v1 import language_model_pb2 as lm_pb2
from services.lm.client import MEMORY_MODES  # the one kind <-> wire mode map
from services.lm.generate_stream import (
    GenerationRecord,
    generate_responses,
    token_response,
)
from services.lm.results import abort_row_error
from services.lm.scheduler import ModelTurns, StepGate
from services.retrieval.call_searcher import CallSearcher
from services.retrieval.client import CallOptions, Wants
from services.common.server import ServiceError

T = TypeVar("T")
_log = logging.getLogger(__name__)
MAX_LANES = 8
"""Batches (distinct memory settings) running at once; one more setting closes an idle batch or is refused."""
ENGINE_MEMORY_MODES = tuple(MEMORY_MODES[kind] for kind in ENGINE_MEMORY_KINDS)
"""Generate's modes on the engine (memlm.engine.requests.ENGINE_MEMORY_KINDS), GetInfo's engine_memory_modes."""
RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata key of a RESOURCE_EXHAUSTED Generate: milliseconds after which a retry is likely admitted."""


@dataclass(frozen=True)
class LaneKey:
    """What one engine batch is made for: its rows' memory, and whether they search (settings are per request)."""

    memory: MemoryConfig | None
    """MEMORY_MODE_XL's, COMPRESSIVE's, MEMORIZING's or SPALM's sizes, None for MEMORY_MODE_NONE (a plain KV cache)."""
    searches: bool
    """kNN-LM (and SPALM) rows batch apart from base rows: a step waits for its search, so a slow or hung
    retrieval service then holds only calls that asked for it, never base-LM generations.
    (Speculative base-LM rows search only the in-process datastore to draft: speculative is refused
    through a retrieval service.)"""
    attribution: int = 0
    """Top documents per generated token, 0: none. An attributing lane decodes one row at a time
    (max_batch 1): each search is its one row's next token (the engine keeps which row is which to itself)."""
    speculative: bool = False
    """Speculative rows batch in lanes whose engine holds the datastore's draft source."""


@dataclass(frozen=True)
class EngineLimits:
    """The server's admission bounds for Generate (LMLimits' fields, as the engine takes them)."""

    max_batch: int
    """Rows decoded together in one step of one batch."""
    max_queue: int
    """Calls waiting for a row of one batch."""
    max_tokens_in_flight: int
    """Prompt + max_new_tokens summed over every running and waiting Generate call of the server."""
    prefill_chunk: int
    """Prompt tokens prefilled per step over all rows (LMLimits.max_step_tokens: a step stays bounded)."""
    cuda_graphs: bool
    """Batches without a memory decode in fixed-shape steps (LMLimits.cuda_graphs)."""


class Stream:
    """One Generate call in a lane: its engine handle, and its events on the call's event loop."""

    def __init__(self, handle: RequestHandle, loop: asyncio.AbstractEventLoop, deadline: float | None) -> None:
        self.handle = handle
        self.deadline = deadline
        """time.monotonic() of the call's deadline, None: none (the batch's search waits for the latest)."""
        self.produced = 0
        """Tokens delivered so far (the retry hint counts the steps left from it)."""
        self.generations: set[int] = set()
        """Datastore generations whose neighbours chose its tokens (GenerateFinish.datastore_generations)."""
        self.attributions: deque[TokenAttribution | None] = deque()
        """An attributing lane's: one per TokenEvent delivered, in order (filled before the event is)."""
        self._loop = loop
        self._queue: asyncio.Queue[list[Event] | BaseException] = asyncio.Queue()
        self._buffer: deque[Event] = deque()

    def deliver(self, item: list[Event] | BaseException) -> None:
        """From the lane's thread: hand events (or the error that ended the request) to the call."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the call's loop is closed: nobody listens any more
            pass

    async def next_event(self) -> Event:
        """The next TokenEvent or the GenerationEnd; the request's error when it failed."""
        while not self._buffer:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            self._buffer.extend(item)
        return self._buffer.popleft()


class Lane:
    """One engine batch (one LaneKey), stepped by a thread of its own with the model's turn; a lane of memory
    kind "spalm" gives its engine the server's SPALM head (spalm_head), one of kind "memorizing" the server's
    memorizing layer and memory service (memories: each row's kNN memory, memlm.engine.memorizing_rows)."""

    def __init__(self, key: LaneKey, model: Decoder, tokenizer: Tokenizer, searcher: Searcher | None,
                 limits: EngineLimits, turns: ModelTurns, name: str, spalm_head: SpalmHead | None = None,
                 drafts: DraftSource | None = None, memories: Memorizing | None = None) -> None:
        self.key = key
        self._closed = threading.Event()
        self.gate = StepGate(turns, self._closed.is_set, turns.tenant(f"engine:{name}"))
        """This batch's place on the model's turns."""
        self._streams: dict[int, Stream] = {}  # request id -> stream, until its end is delivered
        self._lock = threading.Condition()
        # One batched search a step for every row; its answer (generation and, attributing, the neighbours'
        # documents) is taken for the tokens that step made (_deliver).
        self._searcher = CallSearcher(searcher, self._search_options) if searcher is not None else None
        limits = dataclasses.replace(limits, max_batch=1) if key.attribution else limits
        config = EngineConfig(max_batch=limits.max_batch, prefill_chunk=limits.prefill_chunk,
                              max_queue=limits.max_queue, max_tokens_in_flight=limits.max_tokens_in_flight,
                              memory=key.memory)
        if limits.cuda_graphs and config.xl is None and isinstance(model, Decoder):  # the plain row cache only
            config = dataclasses.replace(config, cuda_graphs=True)
        kind = key.memory.kind if key.memory is not None else "none"
        memories = memories if kind == "memorizing" else None
        self.engine = Engine(model, tokenizer, config, self._searcher,
                             drafts, spalm_head=spalm_head if kind == "spalm" else None,
                             knn_attention=memories.knn_attention if memories is not None else None,
                             knn_service=memories.service if memories is not None else None)
        self._thread = threading.Thread(target=self._run, name=f"memlm-engine-{name}", daemon=True)
        self._thread.start()

    # -- the callers' side ----------------------------------------------------------------------
    def submit(self, request: GenerationRequest | ScoreRequest, loop: asyncio.AbstractEventLoop,
               deadline: float | None) -> Stream:
        """Queue one call (a Score: one input, services.lm.score_engine; EngineFull when this batch's queue is full)."""
        with self._lock:
            handle = self.engine.submit(request)
            stream = Stream(handle, loop, deadline)
            self._streams[handle.request_id] = stream
            self._lock.notify_all()
        return stream

    def cancel(self, stream: Stream) -> None:
        """End a call's request before the next step (its row is free for that step's admissions)."""
        stream.handle.cancel()
        with self._lock:
            self._lock.notify_all()

    def streams(self) -> list[Stream]:
        with self._lock:
            return list(self._streams.values())

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._streams and not self.engine.busy

    def _searching(self) -> list[Stream]:
        return [s for s in self.streams() if _searches(s.handle.request)]

    def latest_deadline(self) -> float | None:
        """The latest deadline of the batch's kNN-LM calls (None when one has none): how long its search may wait."""
        deadlines = [s.deadline for s in self._searching()]
        return None if not deadlines or None in deadlines else max(deadlines)

    def abandoned(self) -> bool:
        """Every kNN-LM caller of the batch gave up (or the server closes): its search may stop."""
        return self._closed.is_set() or all(s.handle.cancelled for s in self._searching())

    def _search_options(self) -> CallOptions:
        """A step's remote search (read as it starts): ends by the batch's latest deadline or once every caller
        gave up, waits without the model's turn, and gives back the documents when the lane attributes."""
        return CallOptions(self.latest_deadline(), self.abandoned, self.gate.outside,
                           Wants.SOURCES if self.key.attribution else Wants.GENERATION)

    def close(self) -> None:
        """Stop the thread after its step in progress (the server stopped; its calls were cancelled); the rows still
        in the batch release their kNN memories (memorizing: a service session is dropped, not left to expire)."""
        self._closed.set()
        with self._lock:
            self._lock.notify_all()
        self._thread.join()
        if self.engine.memorizing is not None:
            self.engine.memorizing.close_all()

    # -- the lane's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closed.is_set() or self.engine.busy)
            if self._closed.is_set() or not self.gate.enter():
                return
            try:
                while self.engine.busy:
                    try:
                        self.engine.step()
                    except Exception as e:  # noqa: BLE001 - step gave it to every row it ended; the next ones run
                        _log.warning("engine step failed, its requests ended with the error: %s", e)
                    self._deliver()
                    if self.gate():  # passes the turn when Score calls wait; True: closing
                        break
            finally:
                self.gate.leave()
            self._deliver()

    def _deliver(self) -> None:
        searched = self._searcher.take_last() if self._searcher is not None else None  # it chose this step's tokens
        for stream in self.streams():
            try:
                events = stream.handle.ready()
            except BaseException as e:  # noqa: BLE001 - the request's error, for its caller
                self._forget(stream)
                stream.deliver(e)
                continue
            request = stream.handle.request
            if searched is not None and isinstance(request, ScoreRequest) and _searches(request):
                # A score row's search is not told apart from the step's others: a live kNN-LM Score counts
                # every step's generation (one too many at most, when the datastore switches meanwhile).
                stream.generations.add(searched.generation)
            if not events:
                continue
            tokens = [e for e in events if isinstance(e, TokenEvent)]
            stream.produced += len(tokens)
            if tokens and (stream.handle.request.knn or stream.handle.request.spalm) is not None:
                if searched is not None:
                    stream.generations.add(searched.generation)
                if self.key.attribution:  # one row: the step's one search, its one token
                    stream.attributions.extend(self._attribute(stream, tokens, searched.sourced if searched else None))
            if isinstance(events[-1], (GenerationEnd, SequenceScore)):
                self._forget(stream)
            stream.deliver(events)

    def _attribute(self, stream: Stream, tokens: list[TokenEvent], found: SourcedNeighbors | None
                   ) -> list[TokenAttribution | None]:
        knn = stream.handle.request.knn
        if found is None or len(tokens) != 1 or found.documents.shape[0] != 1:  # not this row's search: none
            return [None] * len(tokens)
        return attribute(found, np.array([tokens[0].token_id]), np.array([tokens[0].logprob]), knn.temperature,
                         knn.lmbda, self.key.attribution)

    def _forget(self, stream: Stream) -> None:
        with self._lock:
            self._streams.pop(stream.handle.request_id, None)


@dataclass(frozen=True)
class Memorizing:
    """What a server's MEMORY_MODE_MEMORIZING lanes take (LanguageModelServicer.load's)."""

    knn_attention: KnnAttention
    """The memorizing layer's parameters (a `memlm train --memory memorizing` checkpoint's)."""
    service: KeyValueMemoryFactory | None
    """The retrieval server's memory sessions for knn_backend "service"; None: the memories live in process."""


class EnginePool:
    """The server's lanes: the batch of a call's settings (made on first use), the server-wide admission
    bound on tokens in flight, and the retry hint."""

    def __init__(self, model: Decoder, tokenizer: Tokenizer, searcher: Searcher | None, limits: EngineLimits,
                 turns: ModelTurns, spalm_head: SpalmHead | None = None,
                 drafts: Callable[[], DraftSource] | None = None, memories: Memorizing | None = None) -> None:
        """drafts: the datastore's draft source (services.lm.args.FewerSources.drafts), made by the request
        parser (speculative_of) at the first speculative call; a lane reads the one it made. memories: what
        MEMORIZING lanes take (None: the server does not serve it)."""
        self._model, self._tokenizer, self._searcher, self._spalm_head = model, tokenizer, searcher, spalm_head
        self._drafts = drafts
        self._memories = memories
        self.limits = limits
        self._turns = turns
        self._lanes: dict[LaneKey, Lane] = {}
        self._lock = threading.Lock()
        self._made = 0

    def submit(self, key: LaneKey, request: GenerationRequest | ScoreRequest, loop: asyncio.AbstractEventLoop,
               deadline: float | None) -> tuple[Lane, Stream]:
        """The call's lane and stream; EngineFull (with its retry hint) when the server is full."""
        with self._lock:
            streams = [s for lane in self._lanes.values() for s in lane.streams()]
            tokens = sum(s.handle.request.tokens_in_flight for s in streams)
            if tokens + request.tokens_in_flight > self.limits.max_tokens_in_flight:
                raise EngineFull("tokens_in_flight", self._retry_hint(streams))
            lane = self._lanes.get(key) or self._new_lane(key, streams)
            return lane, lane.submit(request, loop, deadline)

    def _new_lane(self, key: LaneKey, streams: list[Stream]) -> Lane:
        if len(self._lanes) >= MAX_LANES:
            idle = next((k for k, lane in self._lanes.items() if lane.idle), None)
            if idle is None:
                raise EngineFull(f"{MAX_LANES} batches of other settings", self._retry_hint(streams))
            self._lanes.pop(idle).close()
        self._made += 1
        drafts = self._drafts() if key.speculative and self._drafts is not None else None
        lane = Lane(key, self._model, self._tokenizer, self._searcher, self.limits, self._turns, str(self._made),
                    self._spalm_head, drafts, self._memories)
        self._lanes[key] = lane
        return lane

    def _retry_hint(self, streams: list[Stream]) -> float:
        """Seconds until some call is likely done: its tokens left x the slowest batch's mean step time."""
        step_s = max((lane.engine.step_time_s for lane in self._lanes.values()), default=0.05)
        left = [s.handle.request.max_new_tokens - s.produced for s in streams
                if isinstance(s.handle.request, GenerationRequest)]
        return max(1, min(left, default=1)) * step_s

    def lanes(self) -> list[Lane]:
        with self._lock:
            return list(self._lanes.values())

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close()


def _searches(request: GenerationRequest | ScoreRequest) -> bool:
    """The request searches the lane's datastore (kNN-LM; speculative drafts)."""
    if isinstance(request, ScoreRequest):
        return request.knn is not None
    return (request.knn or request.speculative) is not None


def retry_after_ms(e: EngineFull) -> int:
    """EngineFull's hint in whole milliseconds (at least 1)."""
    return max(1, round(e.retry_after_s * 1000))


def engine_modes(model: object) -> tuple[int, ...]:
    """ENGINE_MEMORY_MODES for memlm's decoder; none for a transformers model (the cache is the decoder's)."""
    return ENGINE_MEMORY_MODES if isinstance(model, Decoder) else ()


def in_row_cache(model: object, memory: MemoryConfig | None) -> bool:
    """Whether the engine holds a call of this memory in its row cache (engine_modes): memlm's decoder, a memory it
    holds. Every Generate runs on the engine; Score rows, speculative drafts, pointer walks and attribution need
    the row cache (a transformers model's rows run their own forwards, memlm.engine.engine)."""
    return isinstance(model, Decoder) and (memory is None or memory.kind in ENGINE_MEMORY_KINDS)


def engine_request(prompt: list[int], max_new_tokens: int, sampling: SamplingConfig, stop_sequences: list[str],
                   knn: KNNLMConfig | None, boundary: int, eos_id: int | None, deadline: float | None,
                   spalm: SpalmSettings | None = None, speculative: SpeculativeConfig | None = None,
                   fewer: Retrieval | None = None) -> GenerationRequest:
    """A parsed Generate as the engine takes it; deadline: time.monotonic() seconds or None."""
    return GenerationRequest(tuple(prompt), max_new_tokens, sampling, tuple(stop_sequences), boundary_token=boundary,
                             eos_id=eos_id, knn=knn, spalm=spalm, speculative=speculative, fewer=fewer,
                             timeout_s=None if deadline is None else max(1e-6, deadline - time.monotonic()))


async def _next_event(stream: Stream, context: grpc.aio.ServicerContext, deadline: float | None) -> Event:
    """The stream's next event; the error that ended its request as a status (the server keeps serving)."""
    try:
        return await stream.next_event()
    except ServiceError as e:  # the remote retrieval service failed: pass its code on
        await context.abort(e.code, f"retrieval service {e.address}: {e.details}")
    except WorkStopped:  # the batch's search stopped: every caller gave up, its deadline passed or the server closes
        if deadline is not None and time.monotonic() >= deadline:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed; the work was stopped")
        await context.abort(grpc.StatusCode.CANCELLED, "the work was stopped")
    except MemlmError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except Exception as e:  # noqa: BLE001 - this call's row failed in its own work; the others went on
        await abort_row_error(context, e)


async def submit_in_thread(submit: Callable[[], T], abandon: Callable[[T], None]) -> T:
    """submit() in a worker thread (a lane's first submit builds its engine), shielded: when the call is cancelled
    while the thread runs, the thread goes on and what it submitted is given to abandon() as soon as it returns
    (it would never reach the call's handler, and its rows would run for nobody: a cancelled
    call's rows are freed at once). An exception of submit() is raised here, as by a plain await."""
    task = asyncio.ensure_future(asyncio.to_thread(submit))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda done: None if done.cancelled() or done.exception() is not None
                               else abandon(done.result()))
        raise


async def stream_generation(pool: EnginePool, key: LaneKey, request: GenerationRequest, deadline: float | None,
                            context: grpc.aio.ServicerContext, record: Callable[[GenerationRecord], None],
                            ) -> AsyncIterator[lm_pb2.GenerateResponse]:
    """One Generate call through the engine: submit, stream each token as made, end.

    Refused with RESOURCE_EXHAUSTED (retry hint in the message and RETRY_AFTER_KEY) when the server is full.
    record(GenerationRecord) is called once the call ends. The call's request is cancelled when the handler ends
    for any reason, so its row is free before the next step (a call cancelled while its request is being
    submitted too: submit_in_thread)."""
    loop = asyncio.get_running_loop()
    try:
        lane, stream = await submit_in_thread(lambda: pool.submit(key, request, loop, deadline),
                                              lambda submitted: submitted[0].cancel(submitted[1]))
    except EngineFull as e:
        ms = retry_after_ms(e)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {e.what} at its bound "
                            f"(see GetInfo max_batch / max_queue / max_tokens_in_flight); retry after {ms} ms",
                            trailing_metadata=((RETRY_AFTER_KEY, str(ms)),))
    def release() -> None:
        lane.cancel(stream)  # a no-op for a request that ended; otherwise its row is free before the next step

    def token(event: TokenEvent) -> lm_pb2.GenerateResponse:
        return token_response(event, stream.attributions.popleft() if stream.attributions else None)

    async for response in generate_responses(
            context, lambda: _next_event(stream, context, deadline), token, lambda: stream.generations,
            lambda: deadline is not None and time.monotonic() >= deadline, release, record):
        yield response
