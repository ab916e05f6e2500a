"""The LM server's model turns: one forward step on the model at a time, steps of concurrent calls interleaved.

With one model thread running each call to its end, a small Score would wait behind all the forward
batches of a maximal one, and a cancelled call would still finish the batch in progress. Here every
call's library work runs on a worker thread of its own, but only the thread holding the model's TURN runs
a forward step. The turn passes at step boundaries, which the library already marks: it polls its
`should_stop` before every forward batch, segment and decode step (memlm.jobs.windows.ShouldStop). A call's
`StepGate` is that should_stop: it answers whether the call gave up and, when other calls wait, may hand
the turn on. Who gets it: the waiting call whose client (its tenant) has held the model for the least time
(`ModelTurns`, the rule of Linux's CFS), so a client sending maximal 1024-token steps gets as much model
time as one sending 15-token Scores, not one step per their step (round-robin by steps gave it 2x a small
client's p99 on 2 cores, benchmarks/availability.py); within one client the turn rotates step by step. A
one-step Score thus waits for at most one step of whoever holds the model plus its fair share, never for
all of a long call. The step itself is bounded by the request parser (LMLimits.max_step_tokens), so
"within one step" is a bound in tokens.

Waiting that does not use the model gives the turn away meanwhile: a remote kNN search runs
with the turn released (`StepGate.outside`, a services.retrieval.call_searcher.CallSearcher's turn_away), and
other calls' steps run while it waits. A call that gives up while queued for the turn leaves the queue within
POLL_S and never runs again.

The step order changes nothing in the results: each call's steps run in its own order on its own state,
and torch runs one step at a time (the turn), so a call's floats are those it gets alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from memlm.jobs.windows import ShouldStop, WorkStopped

T = TypeVar("T")

POLL_S = 0.02
"""How often a call queued for the turn checks whether it gave up, in seconds (a cancelled or expired call
leaves the queue this long after at most; its own CallStop holds only Events and a deadline)."""


class CallStop:
    """Whether one rpc's library work should stop: its handler ended (client cancelled, connection lost:
    `set()` in the handler's finally), its deadline passed, or the server is closing (`closing`, set by
    LanguageModelServicer.close). Called on the call's worker between steps (memlm.jobs.windows.ShouldStop),
    so it reads only thread-safe Events and the clock."""

    def __init__(self, context: grpc.aio.ServicerContext, closing: threading.Event) -> None:
        remaining = context.time_remaining()
        self.deadline = None if remaining is None else time.monotonic() + remaining
        """time.monotonic() at the call's deadline; None = no deadline."""
        self._ended = threading.Event()
        self._closing = closing

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def __call__(self) -> bool:
        return self._ended.is_set() or self._closing.is_set() or self.expired()

    def set(self) -> None:
        self._ended.set()


class Tenant:
    """One client's share of the model (a tenant, services.common.tenants: more connections buy no more share):
    the model seconds it has been charged. Its calls take the turn in order of their tenants' charge, so each client gets an equal share of
    model TIME whatever the size of its steps (Linux CFS's rule: least charged first)."""

    def __init__(self) -> None:
        self.charged = 0.0
        """Model seconds held by this client's calls (lifted to the least charged present on its return,
        so a client that was away banks no credit)."""


class ModelTurns:
    """A fair lock over the model: one holder; at every step boundary the turn goes to the waiting call
    whose client has been charged least (ties: the longest waiting), so a client sending maximal steps
    gets the model as long as each client sending small ones, not once per their step. Within one client
    (equal charge) the turn rotates step by step. No barging: a waiter is handed the turn directly.

    clock: monotonic seconds (tests pass a fake one); max_tenants: clients remembered (least recent forgotten)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_tenants: int = 4096) -> None:
        self._cond = threading.Condition()
        self._clock = clock
        self._holder: StepGate | None = None
        self._since = 0.0  # clock() when the holder got the turn or was last charged
        self._waiting: list[StepGate] = []
        self._queued = 0  # arrival numbers of waiters (ties)
        self._tenants: OrderedDict[str, Tenant] = OrderedDict()
        self._max_tenants = max_tenants
        self.entries = 0
        """Jobs that asked for the turn so far (for tests and logs)."""

    def clients(self) -> tuple[str, ...]:
        """Keys of the shares remembered, least recently used first (for tests and logs)."""
        with self._cond:
            return tuple(self._tenants)

    def tenant(self, key: str) -> Tenant:
        """The client `key`'s share (created on first use)."""
        with self._cond:
            tenant = self._tenants.pop(key, None) or Tenant()
            self._tenants[key] = tenant
            while len(self._tenants) > self._max_tenants:
                self._tenants.popitem(last=False)
            return tenant

    def acquire(self, who: StepGate, stop: ShouldStop) -> bool:
        """Wait for the turn; False (not holding it) when stop() says the caller gave up first."""
        with self._cond:
            self.entries += 1
            present = [g.tenant.charged for g in (self._holder, *self._waiting)
                       if g is not None and g.tenant is not who.tenant]
            if present:  # back from elsewhere (a new call, a search, the network): no credit for the absence
                who.tenant.charged = max(who.tenant.charged, min(present))
            if self._holder is None and not self._waiting:
                self._grant(who)
                return True
            self._queue(who)
            return self._wait(who, stop)

    def _queue(self, who: StepGate) -> None:
        self._queued += 1
        who.queued = self._queued
        self._waiting.append(who)

    def _grant(self, who: StepGate | None) -> None:
        # With the lock held: `who` (None: nobody) holds the turn from now.
        if who is not None and who in self._waiting:
            self._waiting.remove(who)
        self._holder = who
        self._since = self._clock()
        self._cond.notify_all()

    def _charge(self) -> None:
        now = self._clock()
        self._holder.tenant.charged += now - self._since
        self._since = now

    def _next(self) -> StepGate | None:
        return min(self._waiting, key=lambda g: (g.tenant.charged, g.queued), default=None)

    def _wait(self, who: StepGate, stop: ShouldStop) -> bool:
        # Called with the lock held and `who` queued.
        while self._holder is not who:
            if stop():
                self._waiting.remove(who)
                return False
            self._cond.wait(POLL_S)
        return True

    def release(self, who: StepGate) -> None:
        """Charge the holder and hand the turn to the next waiter (or to nobody)."""
        with self._cond:
            assert self._holder is who, "released a turn it does not hold"
            self._charge()
            self._grant(self._next())

    def pass_on(self, who: StepGate, stop: ShouldStop) -> bool:
        """At a step boundary of the holder: charge it; when a waiter's client is charged no more than its
        own, hand the turn over and queue (in one move, so nobody passes in between); True once `who` holds
        the turn again, False when stop() said the caller gave up while queued."""
        with self._cond:
            assert self._holder is who, "passed on a turn it does not hold"
            self._charge()
            nxt = self._next()
            if nxt is None or nxt.tenant.charged > who.tenant.charged:
                return True
            self._queue(who)
            self._grant(nxt)
            return self._wait(who, stop)

    def waiting(self) -> int:
        """Calls queued for the turn now (for tests and logs)."""
        with self._cond:
            return len(self._waiting)


class StepGate:
    """One call's place on the model: enter/leave around each job, and the should_stop its library work
    polls between steps (which also passes the turn on when others wait). Used from one thread at a time."""

    def __init__(self, turns: ModelTurns, stop: ShouldStop, tenant: Tenant) -> None:
        self._turns = turns
        self._stop = stop
        self.tenant = tenant
        """The client whose share this call's steps are charged to."""
        self.queued = 0
        """Arrival number of its latest wait for the turn (ties between equally charged clients)."""
        self.holding = False
        """Whether this call holds the model's turn now."""
        self.steps = 0
        """Step boundaries passed (polls), for tests and logs."""

    def enter(self) -> bool:
        """Take the turn for a job; False when the call gave up while queued (or before)."""
        if self._stop():
            return False
        self.holding = self._turns.acquire(self, self._stop)
        return self.holding

    def leave(self) -> None:
        if self.holding:
            self.holding = False
            self._turns.release(self)

    def __call__(self) -> bool:
        """ShouldStop: True when the call gave up; otherwise yield the turn to waiting calls first."""
        self.steps += 1
        if self._stop():
            return True
        if self.holding and not self._turns.pass_on(self, self._stop):
            self.holding = False
            return True
        return False

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Run the body without the turn (a wait that does not use the model), then take it back;
        WorkStopped when the call gave up meanwhile."""
        had = self.holding
        self.leave()
        try:
            yield
        finally:
            if had and not self.enter():
                raise WorkStopped("stopped: the caller gave up during a remote search")


class ModelScheduler:
    """Worker threads for calls' library work, one step on the model at a time (ModelTurns).

    workers: calls whose work can be under way at once (the server's max_concurrent_rpcs: every admitted
    call takes its turn; none waits behind another's whole work)."""

    def __init__(self, workers: int) -> None:
        self.turns = ModelTurns()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="memlm-lm")

    def gate(self, stop: ShouldStop, client: str) -> StepGate:
        """A call's gate; client: who it is for the model's fair share (the call's tenant name)."""
        return StepGate(self.turns, stop, self.turns.tenant(client))

    async def run(self, gate: StepGate, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a worker while holding the turn (passed on at gate's polls); WorkStopped when the
        call gave up before it got the turn."""

        def job() -> T:
            if not gate.enter():
                raise WorkStopped("stopped: the caller gave up while waiting for the model")
            try:
                return fn(*args)
            finally:
                gate.leave()

        return await asyncio.get_running_loop().run_in_executor(self._executor, job)

    async def run_free(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on a worker without the turn (tokenizing, encoding: CPU work, but no model step)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def submit(self, fn: Callable[[], object]) -> None:
        """Run fn on a worker without the turn (freeing a finished call's state uses no model step)."""
        self._executor.submit(fn)

    def close(self) -> None:
        """Join the workers (their calls' stops are set: each ends within one step); drop queued jobs."""
        self._executor.shutdown(wait=True, cancel_futures=True)
