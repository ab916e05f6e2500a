"""A small circuit breaker with exponential back-off, for calls to a dependency that may die or hang.

A dead or hung retrieval service must fail kNN calls fast instead of making every
caller wait out its own deadline. After `failure_threshold` consecutive failures the breaker OPENS: calls
are refused at once (the caller gets UNAVAILABLE without touching the network) for `backoff_s`. Then it is
HALF-OPEN: one trial call goes through; success CLOSES the breaker, failure opens it again for twice the
back-off (up to `max_backoff_s`). `reset()` closes it from outside (the channel saw the service come back).

Thread-safe: the LM server's model thread and grpc's connectivity thread both use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"


@dataclass(frozen=True)
class BreakerConfig:
    """When a breaker opens and how long it stays open."""

    failure_threshold: int = 3
    """Consecutive failures that open the breaker (one slow call under a short caller deadline is not enough)."""
    backoff_s: float = 1.0
    """Seconds the breaker stays open the first time."""
    max_backoff_s: float = 30.0
    """Longest back-off, in seconds; each failed trial doubles the back-off up to this."""

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {self.failure_threshold}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}")


class CircuitBreaker:
    """closed -> open (after failure_threshold failures) -> half-open (after the back-off) -> closed or open.

    clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, config: BreakerConfig = BreakerConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._backoff_s = config.backoff_s
        self._open_until: float | None = None  # None: closed
        self._trial_out = False  # half-open: the one trial call is in flight

    @property
    def state(self) -> str:
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self._open_until is None:
            return CLOSED
        return OPEN if self._clock() < self._open_until or self._trial_out else HALF_OPEN

    def retry_in(self) -> float:
        """Seconds until the next trial call is let through (0 when calls pass now)."""
        with self._lock:
            if self._open_until is None:
                return 0.0
            return max(0.0, self._open_until - self._clock())

    def allow(self) -> bool:
        """True when a call may go out now (closed, or the one trial of half-open); False = refuse it."""
        with self._lock:
            state = self._state()
            if state == HALF_OPEN:
                self._trial_out = True
            return state != OPEN

    def record_success(self) -> None:
        with self._lock:
            self._close()

    def record_failure(self) -> None:
        """A call failed in a way that says the dependency is down or hung (not a bad request)."""
        with self._lock:
            if self._open_until is not None:  # a failed trial (or a straggler): back off longer
                if self._trial_out:
                    self._backoff_s = min(2 * self._backoff_s, self._config.max_backoff_s)
                self._open(self._backoff_s)
                return
            self._failures += 1
            if self._failures >= self._config.failure_threshold:
                self._open(self._backoff_s)

    def record_abandoned(self) -> None:
        """A call that `allow` let through ended with no verdict (cancelled): a trial gives its turn back."""
        with self._lock:
            self._trial_out = False

    def reset(self) -> None:
        """Close the breaker now (the link is known to be back)."""
        with self._lock:
            self._close()

    def _open(self, seconds: float) -> None:
        self._open_until = self._clock() + seconds
        self._trial_out = False

    def _close(self) -> None:
        self._failures = 0
        self._backoff_s = self._config.backoff_s
        self._open_until = None
        self._trial_out = False
