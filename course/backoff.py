"""Backoff strategies: how long to wait before retry number k (chapter 01).

Every strategy answers one question, ``delay(attempt, previous, rand)``: the wait before the
next try, given how many tries have failed (``attempt``, counted from 0 for the wait after
the first failure), the previous wait (only decorrelated jitter uses it) and a source of
uniform random numbers in [0, 1) (injected, so tests and plots are repeatable).

=============  ==============================================  =========================
strategy       wait after failure k                            used by
=============  ==============================================  =========================
none           0                                               naive "retry 3 times"
fixed          base                                            cron-style polling
linear         base * (k + 1)                                  some queue consumers
exponential    min(cap, base * 2**k)                           "capped exponential"
full jitter    uniform(0, min(cap, base * 2**k))               AWS SDKs, tenacity, ch01
equal jitter   e/2 + uniform(0, e/2), e = min(cap, base*2**k)  the 2015 blog's middle way
decorrelated   min(cap, uniform(base, 3 * previous))           the 2015 blog's alternative
=============  ==============================================  =========================

The names and formulas follow Marc Brooker, "Exponential Backoff And Jitter" (AWS
Architecture Blog, 2015); :mod:`course.chapters.ch01.herd` replays that post's simulation with them, and
:func:`course.chapters.ch01.plot_strategies` draws them side by side.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

Rand = Callable[[], float]


@dataclass(frozen=True)
class Backoff:
    """A delay strategy with a base delay and a cap (seconds, or any unit you like)."""

    base: float = 0.1
    cap: float = 2.0
    name = "backoff"
    jittered = False

    def exponential(self, attempt: int) -> float:
        """``min(cap, base * 2**attempt)``, safe for huge attempts."""
        if attempt >= 64:  # 2**64 * base overflows nothing, but is past any cap
            return self.cap
        return min(self.cap, self.base * 2**attempt)

    def delay(self, attempt: int, previous: float | None = None, rand: Rand = random.random) -> float:
        raise NotImplementedError

    def delays(self, n: int, rand: Rand = random.random) -> list[float]:
        """The first ``n`` waits of one client, threading ``previous`` through."""
        out: list[float] = []
        previous: float | None = None
        for attempt in range(n):
            previous = self.delay(attempt, previous, rand)
            out.append(previous)
        return out


@dataclass(frozen=True)
class NoBackoff(Backoff):
    name = "none"

    def delay(self, attempt: int, previous: float | None = None, rand: Rand = random.random) -> float:
        return 0.0


@dataclass(frozen=True)
class Fixed(Backoff):
    name = "fixed"

    def delay(self, attempt: int, previous: float | None = None, rand: Rand = random.random) -> float:
        return min(self.cap, self.base)


@dataclass(frozen=True)
class Linear(Backoff):
    name = "linear"

    def delay(self, attempt: int, previous: float | None = None, rand: Rand = random.random) -> float:
        return min(self.cap, self.base * (attempt + 1))


@dataclass(frozen=True)
class Exponential(Backoff):
    name = "exponential"

    def delay(self, attempt: int, previous: float | None = None, rand: Rand = random.random) -> float:
        return self.exponential(attempt)


@dataclass(frozen=True)
class FullJitter(Backoff):
    name = "full jitter"
    jittered = True

    def delay(self, attempt: int, previous: float | None = None, rand: Rand = random.random) -> float:
        return rand() * self.exponential(attempt)


@dataclass(frozen=True)
class EqualJitter(Backoff):
    name = "equal jitter"
    jittered = True

    def delay(self, attempt: int, previous: float | None = None, rand: Rand = random.random) -> float:
        half = self.exponential(attempt) / 2
        return half + rand() * half


@dataclass(frozen=True)
class DecorrelatedJitter(Backoff):
    name = "decorrelated jitter"
    jittered = True

    def delay(self, attempt: int, previous: float | None = None, rand: Rand = random.random) -> float:
        prev = self.base if previous is None else previous
        low, high = self.base, max(self.base, prev * 3)
        return min(self.cap, low + rand() * (high - low))


STRATEGIES: dict[str, type[Backoff]] = {
    cls.name: cls
    for cls in (NoBackoff, Fixed, Linear, Exponential, FullJitter, EqualJitter, DecorrelatedJitter)
}


def make(name: str, base: float = 0.1, cap: float = 2.0) -> Backoff:
    """``make("full jitter", base=0.1, cap=2.0)``."""
    try:
        return STRATEGIES[name](base, cap)
    except KeyError:
        raise KeyError(f"no strategy {name!r}; known: {', '.join(STRATEGIES)}") from None


def sample(strategy: Backoff, attempts: int, clients: int, *, seed: int = 0) -> list[list[float]]:
    """``clients`` independent delay sequences of ``attempts`` waits each (seeded)."""
    rng = random.Random(seed)
    return [strategy.delays(attempts, rng.random) for _ in range(clients)]


@dataclass
class LoopErrors:
    """What a background loop keeps so that it survives its errors: catch, back off, count, go on.

    A relay, a projector or an aggregator that dies on its first error stops silently while
    the service around it looks healthy (the backlog grows, nobody is paged). Instead::

        errors = LoopErrors()
        while not stop.is_set():
            try:
                await step()
            except Exception as err:
                await sleep(errors.failed(err))  # full-jitter backoff on the streak
                continue
            errors.succeeded()

    ``count`` and ``last`` are what a health endpoint or a metric reports; ``streak`` drives
    the backoff and resets on the first success.
    """

    backoff: Backoff = FullJitter(0.05, 5.0)
    rand: Rand = random.random
    count: int = 0
    streak: int = 0
    last: str | None = None

    def failed(self, err: BaseException) -> float:
        """Record ``err``; the seconds to wait before the next try.

        Called from the loop's ``except Exception``: when the loop's task is being cancelled
        and a client library turned the cancel into an error of its own, the cancel goes on
        (raised here), so that stopping a loop always stops it."""
        _raise_if_cancelling(err)
        self.count += 1
        self.last = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        delay = self.backoff.delay(self.streak, rand=self.rand)
        self.streak += 1
        return delay

    def succeeded(self) -> None:
        """Reset the streak. A cancel that a library swallowed on the way (Python 3.11's
        ``asyncio.wait_for`` returns the result when its future finishes as the cancel
        arrives) is raised here, so the loop still stops at the end of its round."""
        _raise_if_cancelling(None)
        self.streak = 0


def _raise_if_cancelling(err: BaseException | None) -> None:
    """Raise CancelledError when the running task has been asked to stop."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop: a synchronous caller
        return
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from err
