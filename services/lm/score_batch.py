"""Score calls that the engine does not run share forward passes: one library run for concurrent calls.

Used for services.lm.score_engine.score_path's BATCHED calls only (attribution, whose searches carry
provenance; a model the engine does not hold); Score with the engine's modes runs as engine rows.

Score calls that arrive while the model is busy wait for its turn (services.lm.scheduler). Those of one
`ScoreKey` (the same memory mode and sizes, window and stride, kNN-LM settings, top_n and rows per step)
join one batch: when the batch gets the model's turn it takes every call of its key that came meanwhile,
and one library call (memlm.jobs.scoring.score_tokens / score_tokens_segments) scores all their sequences
together, so windows (or segment rows) of different calls fill the same forward steps (each step stays
within max_step_tokens: the rows per step are the key's). Each call gets its own sequences' scores back.
A call that comes while its key's batch is running opens the next batch.

Equal to Score alone? The same windows (segments) are run and scored, but in forward passes over more
rows, which changes float32 rounding only: measured when every Score mode went through here (the same
tokens, greedy flags and alternatives, log-probs equal or 4.8e-7 (2^-21) apart, sliding windows and XL
segment rows alike); the merging itself is tested in tests/services/test_lm_score_batch.py.

The batch's steps are charged to the client of its first call (one tenant of the model's turns). Its
work stops (WorkStopped, within one step) only when every call of the batch gave up (cancelled, past its
deadline, or the server closing); a remote kNN search ends by the latest deadline of the batch.
MEMORY_MODE_MEMORIZING, SPALM and fewer-search Score (per-call memories / heads / walks) run alone.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from memlm.jobs.windows import WorkStopped
from memlm.model.memory_config import MemoryConfig
from memlm.retrieval.knnlm import KNNLMConfig
from services.lm.requests import ScoreArgs
from services.lm.results import ScoreOutcome
from services.lm.scheduler import CallStop, ModelScheduler, StepGate

Run = Callable[[ScoreArgs, StepGate, CallStop], ScoreOutcome]
"""The library call for a (merged) ScoreArgs with the batch's gate (its should_stop) and stop (deadline)."""


@dataclass(frozen=True)
class ScoreKey:
    """What calls must share to be scored in one library call."""

    memory: MemoryConfig | None
    """The memory mode and its sizes (segment included); None: sliding windows."""
    context: int
    """Sliding-window length, tokens (MEMORY_MODE_NONE)."""
    stride: int
    """Sliding-window stride, tokens (MEMORY_MODE_NONE)."""
    knn: KNNLMConfig | None
    """kNN-LM settings, None: the base LM."""
    top_n: int
    """Alternatives per scored token."""
    batch_size: int
    """Windows (segment rows) per forward step: LMLimits.step_rows of the key's window or segment."""
    attribution: int
    """Top documents per scored token, 0: none."""

    @classmethod
    def of(cls, args: ScoreArgs) -> ScoreKey:
        return cls(args.memory, args.context, args.stride, args.knn, args.top_n, args.batch_size, args.attribution)


class _Member:
    def __init__(self, args: ScoreArgs, stop: CallStop, loop: asyncio.AbstractEventLoop) -> None:
        self.args, self.stop, self.loop = args, stop, loop
        self.future: asyncio.Future[ScoreOutcome] = loop.create_future()

    def resolve(self, result: ScoreOutcome | BaseException) -> None:
        def put() -> None:
            if self.future.done():  # its handler is gone
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(put)


class BatchStop:
    """The batch's stop: every member gave up; its deadline is the latest of theirs (None if one has none)."""

    def __init__(self, members: list[_Member]) -> None:
        self._members = members

    def __call__(self) -> bool:
        return all(m.stop() for m in list(self._members))

    @property
    def deadline(self) -> float | None:
        deadlines = [m.stop.deadline for m in list(self._members)]
        return None if None in deadlines else max(deadlines, default=None)

    def expired(self) -> bool:
        return all(m.stop.expired() for m in list(self._members))


class ScoreBatcher:
    """Concurrent Score calls of one ScoreKey in one library call (module docstring)."""

    def __init__(self, scheduler: ModelScheduler, run: Run) -> None:
        self._scheduler = scheduler
        self._run = run
        self._pending: dict[ScoreKey, list[_Member]] = {}
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.batches = 0
        """Library calls made (for tests and logs)."""

    async def score(self, args: ScoreArgs, stop: CallStop, client: str) -> ScoreOutcome:
        """This call's scores, from the batch it joined (WorkStopped, searcher and library errors as alone), and
        the generations the batch's searches were answered by."""
        key = ScoreKey.of(args)
        member = _Member(args, stop, asyncio.get_running_loop())
        with self._lock:
            members = self._pending.get(key)
            opened = members is None
            if opened:
                members = self._pending[key] = []
            members.append(member)
        if opened:
            task = asyncio.get_running_loop().create_task(self._batch(key, members, client))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await member.future

    async def _batch(self, key: ScoreKey, members: list[_Member], client: str) -> None:
        stop = BatchStop(members)
        gate = self._scheduler.gate(stop, client)

        def work() -> None:
            with self._lock:  # the turn is ours: who came meanwhile is in; later calls open the next batch
                del self._pending[key]
            live = [m for m in members if not m.stop()]
            for m in members:
                if m not in live:  # gave up while the batch waited for the turn
                    m.resolve(WorkStopped("stopped: the caller gave up while waiting for the model"))
            if not live:
                return
            merged = replace(live[0].args, token_seqs=[s for m in live for s in m.args.token_seqs],
                             contexts=[c for m in live for c in m.args.contexts])
            self.batches += 1
            out = self._run(merged, gate, stop)
            at = 0
            for m in live:
                n = len(m.args.token_seqs)
                m.resolve(ScoreOutcome(out.scores[at : at + n], None, out.generations))  # batchable: no SPALM gates
                at += n

        try:
            await self._scheduler.run(gate, work)
        except BaseException as e:  # each member's handler turns it into its status
            with self._lock:
                if self._pending.get(key) is members:
                    del self._pending[key]
            for m in members:
                m.resolve(e)
            if not isinstance(e, Exception):
                raise
