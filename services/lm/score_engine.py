"""The Score rpc on the decoding engine: Score calls from different clients share forward passes.

`score_path` is the one rule for where a Score runs:
- ENGINE: MEMORY_MODE_NONE (the server's sliding windows), XL and COMPRESSIVE, with or without kNN-LM, with
  top_n alternatives, on memlm's decoder. Each input is a memlm.engine ScoreRequest in the running batch of
  the call's settings (services.lm.engine: the lane of its memory and whether it searches, shared with the
  Generate calls of those settings): a row reads the input's windows one after another (or its XL segments),
  in the same steps as other calls' score rows and the Generate rows; the step's kNN-LM score rows share one
  search. Scores are memlm.jobs.scoring's per-token functions over the engine's forward passes
  (memlm.engine.score_rows): the same tokens, greedy flags and alternatives, log-probs within float32 rounding.
- BATCHED: attribution (its searches carry provenance, one library call a batch) and a model the engine does
  not hold (transformers'): the library through services.lm.score_batch (calls of one key share a library call).
- ALONE: SPALM (its head's gate per token), MEMORIZING (a per-call writable memory) and fewer searches
  (pointer / adaptive walks follow the call's own steps): one library call with the call's own turns.

Engine Score calls are admitted like Generate calls (max_queue per batch, max_tokens_in_flight: the tokens each
request's windows read): a call's requests beyond the bounds wait for its own earlier ones to end, and the call
is refused (RESOURCE_EXHAUSTED with a retry hint) only when none of its own is in; a cancelled call's rows are
free before the next step; past its deadline a call answers DEADLINE_EXCEEDED at once (its rows end at the
next step, a search in progress by the batch's latest deadline).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import grpc

from memlm.engine.requests import FINISH_DEADLINE, EngineFull, ScoreRequest
from memlm.engine.score_rows import ScoreEnded, join_scores, split
from memlm.errors import MemlmError
from memlm.jobs.scoring import SequenceScore, score_tokens
from memlm.model.decoder import Decoder
from services.lm.args import ScoreArgs
from services.lm.engine import (
    RETRY_AFTER_KEY,
    EnginePool,
    Lane,
    LaneKey,
    Stream,
    in_row_cache,
    retry_after_ms,
    submit_in_thread,
)
from services.lm.results import LIBRARY_ERRORS, ScoreOutcome, abort_library_error, abort_row_error

ENGINE, BATCHED, ALONE = "engine", "batched", "alone"
"""Where a Score runs (score_path; module docstring)."""
ENGINE_SCORE_KINDS = ("xl", "compressive")
"""The memories (MemoryConfig.kind) whose Score rows the engine holds besides MEMORY_MODE_NONE's windows: of the
engine's (memlm.engine.requests.ENGINE_MEMORY_KINDS), those whose rows score (memlm.engine.score_rows); SPALM
scores are memlm.jobs.spalm_scoring's, MEMORIZING's the library's (its rows generate only)."""


def score_path(args: ScoreArgs, model: object) -> str:
    """ENGINE, BATCHED or ALONE for a validated Score (module docstring)."""
    if args.spalm is not None or args.retrieval is not None:
        return ALONE
    if args.memory is not None and args.memory.kind not in ENGINE_SCORE_KINDS:
        return ALONE  # MEMORIZING
    if args.attribution or not in_row_cache(model, args.memory):  # in_row_cache: memlm's decoder, a memory it holds
        return BATCHED
    return ENGINE


def score_requests(args: ScoreArgs, boundary: int, deadline: float | None, max_batch: int) -> list[list[ScoreRequest]]:
    """Per input its engine requests ([] for an empty continuation: nothing to run); deadline: monotonic s.

    An input's sliding windows are split over up to args.batch_size rows (the windows a library pass would
    run together, LMLimits.step_rows), at most max_batch rows for the whole call, so that a long text is
    read by several rows side by side (memlm.engine.score_rows.split); XL rows read their segments in one row."""
    timeout = None if deadline is None else max(1e-6, deadline - time.monotonic())
    window = (args.context, args.stride) if args.memory is None else None
    live = sum(1 for tokens in args.token_seqs if tokens)
    parts = min(args.batch_size, max(1, max_batch // max(1, live)))
    return [split(ScoreRequest(tuple(tokens), boundary, tuple(context), timeout, window, args.knn, args.top_n), parts)
            if tokens else [] for tokens, context in zip(args.token_seqs, args.contexts)]


def _submit_some(pool: EnginePool, key: LaneKey, requests: list[ScoreRequest], loop: asyncio.AbstractEventLoop,
                 deadline: float | None) -> tuple[list[tuple[Lane, Stream]], EngineFull | None]:
    """As many of `requests` (in order) as the lane admits now, and the refusal that stopped the rest (None)."""
    submitted: list[tuple[Lane, Stream]] = []
    for request in requests:
        try:
            submitted.append(pool.submit(key, request, loop, deadline))
        except EngineFull as e:
            return submitted, e
    return submitted, None


async def _submit(pool: EnginePool, key: LaneKey, requests: list[ScoreRequest], deadline: float | None
                  ) -> tuple[list[tuple[Lane, Stream]], EngineFull | None]:
    """_submit_some in a worker thread; a call cancelled meanwhile cancels every stream it submitted as soon as the
    thread returns (services.lm.engine.submit_in_thread): they never reach the caller's `running`."""
    loop = asyncio.get_running_loop()

    def abandon(submitted: tuple[list[tuple[Lane, Stream]], EngineFull | None]) -> None:
        for lane, stream in submitted[0]:
            lane.cancel(stream)

    return await submit_in_thread(lambda: _submit_some(pool, key, requests, loop, deadline), abandon)


async def _result(stream: Stream, context: grpc.aio.ServicerContext, deadline: float | None) -> SequenceScore:
    """The input's SequenceScore; its request's error as a status; DEADLINE_EXCEEDED as soon as the deadline
    passes (the engine's step may be waiting on a remote search)."""
    try:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        return await asyncio.wait_for(stream.next_event(), timeout)
    except asyncio.TimeoutError:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed; the work was stopped")
    except ScoreEnded as e:
        code = grpc.StatusCode.DEADLINE_EXCEEDED if e.reason == FINISH_DEADLINE else grpc.StatusCode.CANCELLED
        await context.abort(code, f"{e}; the work was stopped")
    except LIBRARY_ERRORS as e:  # WorkStopped: the batch's search stopped (every caller gave up, or the server closes)
        await abort_library_error(context, e, deadline is not None and time.monotonic() >= deadline)
    except Exception as e:  # noqa: BLE001 - this input's row failed in its own work; the others went on
        await abort_row_error(context, e)


async def score_on_engine(pool: EnginePool, model: Decoder, args: ScoreArgs, boundary: int, deadline: float | None,
                          context: grpc.aio.ServicerContext) -> ScoreOutcome:
    """A Score whose score_path is ENGINE: every input a request (or several: split) in the lane of its settings,
    submitted as the lane admits them; the scores in input order and the datastore generations its searches
    were answered by. The call's requests are cancelled when the handler ends for any reason."""
    requests = score_requests(args, boundary, deadline, pool.limits.max_batch)
    key = LaneKey(args.memory, args.knn is not None)
    waiting = deque(r for parts in requests for r in parts)
    running: deque[tuple[Lane, Stream]] = deque()
    done: list[SequenceScore] = []
    generations: set[int] = set()
    try:
        while waiting or running:
            if waiting:  # a call over the queue's bound waits for its own rows, never beside a full queue
                try:
                    submitted, full = await _submit(pool, key, list(waiting), deadline)
                except MemlmError as e:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                for _ in submitted:
                    waiting.popleft()
                running.extend(submitted)
                if full is not None and not running:  # none of its own to wait for: the server is full
                    ms = retry_after_ms(full)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {full.what} at its bound "
                                        f"(see GetInfo max_batch / max_queue / max_tokens_in_flight); retry after {ms} ms",
                                        trailing_metadata=((RETRY_AFTER_KEY, str(ms)),))
            done.append(await _result(running[0][1], context, deadline))
            generations |= running.popleft()[1].generations
    finally:  # a no-op for requests that ended; otherwise their rows are free before the next step
        for lane, stream in running:
            lane.cancel(stream)
    results = iter(done)
    scores = [join_scores([next(results) for _ in parts]) if parts else _empty(model, args, i, boundary)
              for i, parts in enumerate(requests)]
    return ScoreOutcome(scores, None, generations)


def _empty(model: Decoder, args: ScoreArgs, i: int, boundary: int) -> SequenceScore:
    """The library's score of an input with nothing to score (no forward pass runs)."""
    return score_tokens(model, [[]], context=args.context, stride=args.stride, boundary_token=boundary,
                        contexts=[args.contexts[i]], top_n=args.top_n)[0]
