"""Circuit breakers (chapter 02): stop calling a dependency that is down, and find out when it is back.

- :class:`CircuitBreaker`: closed, open and half-open; a count-based or time-based window of
  outcomes; a minimum number of calls before it may trip; exactly one probe in half-open
  while everybody else still fails fast; the reference answer to the ``circuit_breaker`` task.
- :class:`CircuitOpenError`: what a rejected call raises, with ``retry_after`` for a
  ``503`` + ``Retry-After`` at the edge.
- :func:`counts_as_failure`: only timeouts, connection errors, 408 and 5xx say the
  dependency is sick; other 4xx (and 429) are answers, not illness.

Error classification is chapter 01's (:func:`course.retry.is_retryable`, :func:`course.retry.status_of`).
The flawed sketch the chapter starts from, the outage timeline and the demos beside it are
in :mod:`course.chapters.ch02`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

from course.retry import is_retryable, status_of

T = TypeVar("T")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class CircuitOpenError(Exception):
    """Raised instead of calling the dependency while the breaker is open (or a probe is in flight)."""

    def __init__(self, name: str = "breaker", retry_after: float = 0.0, reason: str = "open") -> None:
        self.name = name
        self.retry_after = max(0.0, float(retry_after))
        self.reason = reason
        super().__init__(f"circuit {name!r} is {reason}; retry in {self.retry_after:.3g} s")

    @property
    def retry_after_header(self) -> str:
        """The ``Retry-After`` header value: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after)))


def counts_as_failure(err: BaseException) -> bool:
    """Does this error say the dependency is sick? Timeouts, connection errors, 408 and 5xx do.

    A 404 or a 422 is the dependency answering correctly about a bad request, and 429 is it
    protecting itself as designed: neither should open the circuit (429 is handled with
    ``Retry-After`` and backoff instead). Bugs in our own code (a ``KeyError``) are not the
    dependency's fault either.
    """
    if isinstance(err, CircuitOpenError):
        return False
    status = status_of(err)
    if status is not None:
        return status == 408 or 500 <= status <= 599
    return is_retryable(err)


# ----------------------------------------------------------------------------- windows


class CountWindow:
    """The outcomes of the last ``size`` calls."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("window size must be at least 1")
        self.size = size
        self._outcomes: deque[bool] = deque(maxlen=size)  # True = failed

    def record(self, failed: bool, now: float) -> None:
        self._outcomes.append(failed)

    def stats(self, now: float) -> tuple[int, int]:
        """(calls, failures) in the window."""
        return len(self._outcomes), sum(self._outcomes)

    def clear(self) -> None:
        self._outcomes.clear()


class TimeWindow:
    """The outcomes of the calls that finished in the last ``seconds``."""

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError("window length must be positive")
        self.seconds = float(seconds)
        self._outcomes: deque[tuple[float, bool]] = deque()
        self._failures = 0

    def _evict(self, now: float) -> None:
        while self._outcomes and self._outcomes[0][0] <= now - self.seconds:
            _, failed = self._outcomes.popleft()
            self._failures -= failed

    def record(self, failed: bool, now: float) -> None:
        self._evict(now)
        self._outcomes.append((now, failed))
        self._failures += failed

    def stats(self, now: float) -> tuple[int, int]:
        self._evict(now)
        return len(self._outcomes), self._failures

    def clear(self) -> None:
        self._outcomes.clear()
        self._failures = 0


# ----------------------------------------------------------------------------- the breaker


class CircuitBreaker:
    """A circuit breaker for one dependency.

    Closed: calls go through and their outcomes fill the window. Once the window holds at
    least ``min_calls`` outcomes and the failure rate reaches ``threshold``, it opens.
    Open: calls raise :class:`CircuitOpenError` at once, without calling ``fn``, until
    ``cooldown`` seconds have passed on ``clock``. Half-open: the first caller becomes the
    probe; every other caller is rejected while it runs. A probe that succeeds closes the
    breaker with an empty window; one that fails opens it again for a fresh ``cooldown``.

    ``window="count"`` keeps the last ``window_size`` calls; ``window="time"`` keeps the
    calls of the last ``window_size`` seconds (then ``min_calls`` defaults to 10).
    """

    def __init__(
        self,
        threshold: float = 0.5,
        window_size: float = 10,
        cooldown: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        is_failure: Callable[[BaseException], bool] = counts_as_failure,
        min_calls: int | None = None,
        window: str = "count",
        name: str = "breaker",
    ) -> None:
        if not 0 < threshold <= 1:
            raise ValueError("threshold is a failure rate in (0, 1]")
        if window == "count":
            self.window: CountWindow | TimeWindow = CountWindow(int(window_size))
            default_min = int(window_size)
        elif window == "time":
            self.window = TimeWindow(window_size)
            default_min = 10
        else:
            raise ValueError("window is 'count' or 'time'")
        self.threshold = threshold
        self.cooldown = float(cooldown)
        self.clock = clock
        self.is_failure = is_failure
        self.min_calls = default_min if min_calls is None else min_calls
        self.name = name
        self.state = CLOSED
        self.opened_at = -math.inf
        self.transitions: list[tuple[float, str]] = [(clock(), CLOSED)]
        self.rejected = 0
        self._probing = False
        self._generation = 0  # bumped on every transition: late results of an old state are ignored

    def __repr__(self) -> str:
        calls, failures = self.window.stats(self.clock())
        return f"CircuitBreaker({self.name!r}, state={self.state}, window {failures}/{calls} failed)"

    def _set(self, state: str) -> None:
        self.state = state
        self._generation += 1
        self.transitions.append((self.clock(), state))

    def _admit(self) -> bool:
        """Let a call through (True if it is the half-open probe) or raise CircuitOpenError."""
        now = self.clock()
        if self.state == OPEN:
            if now - self.opened_at < self.cooldown:
                self.rejected += 1
                raise CircuitOpenError(self.name, self.opened_at + self.cooldown - now)
            self._set(HALF_OPEN)
        if self.state == HALF_OPEN:
            if self._probing:
                self.rejected += 1
                raise CircuitOpenError(
                    self.name, min(self.cooldown, 1.0), reason="half-open, a probe is in flight"
                )
            self._probing = True
            return True
        return False

    def _trip(self) -> None:
        self.opened_at = self.clock()
        self._set(OPEN)

    def _record(self, failed: bool, probe: bool, generation: int) -> None:
        if probe:
            self._probing = False
            if failed:
                self._trip()
            else:
                self.window.clear()
                self._set(CLOSED)
            return
        if self.state != CLOSED or generation != self._generation:
            return  # a call that started before the last transition: its outcome is stale
        now = self.clock()
        self.window.record(failed, now)
        calls, failures = self.window.stats(now)
        if failed and calls >= self.min_calls and failures / calls >= self.threshold:
            self.window.clear()
            self._trip()

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Await ``fn()`` through the breaker; raise :class:`CircuitOpenError` instead when open."""
        probe = self._admit()
        generation = self._generation
        try:
            result = await fn()
        except Exception as err:
            self._record(self.is_failure(err), probe, generation)
            raise
        except BaseException:  # cancelled: no verdict on the dependency, free the probe slot
            if probe:
                self._probing = False
            raise
        self._record(False, probe, generation)
        return result
