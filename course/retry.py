"""Retries with capped exponential backoff and full jitter (chapter 01).

``with_retry`` is the reference answer to chapter 01's graded task and the retry that
later chapters reuse (chapter 03 retries a request that got 409 "in progress").
``is_retryable`` says which errors are worth another try.

Beyond the graded task: :func:`retry_call` adds the limits a production retry needs
(attempts, total time, longest wait, any :mod:`course.backoff` strategy) and the metadata
to log (:class:`RetryState`). Retry budgets and deadlines are in :mod:`course.budgets`,
hedged reads in :mod:`course.hedging`, delay strategies in :mod:`course.backoff`; what
chapter 01 measures with them (retries at every layer, the real errors of a flaky HTTP
service) is in :mod:`course.chapters.ch01`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from course.backoff import Backoff, FullJitter

T = TypeVar("T")

RETRYABLE_STATUS = frozenset({408, 429})


def status_of(err: BaseException) -> int | None:
    """The HTTP status an error carries, if any (httpx errors or a ``status`` attribute)."""
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code
    status = getattr(err, "status", None)
    if isinstance(status, int) and not isinstance(status, bool):
        return status
    return None


def is_retryable(err: BaseException) -> bool:
    """Worth another try: timeouts, connection errors, 408, 429 and 5xx; nothing else."""
    if isinstance(err, (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException)):
        return True
    if isinstance(err, (httpx.TransportError, ConnectionError)):
        return True
    status = status_of(err)
    if status is not None:
        return status in RETRYABLE_STATUS or 500 <= status <= 599
    return False


async def with_retry(
    fn: Callable[[], Awaitable[T]],
    *,
    retries: int = 4,
    base_delay: float = 0.1,
    max_delay: float = 2.0,
    retryable: Callable[[BaseException], bool] = is_retryable,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rand: Callable[[], float] = random.random,
) -> T:
    """Await ``fn()`` up to ``retries + 1`` times, sleeping a full-jitter backoff between tries.

    After failed attempt ``k`` (from 0) it sleeps ``rand() * min(max_delay, base_delay * 2**k)``.
    The last error is re-raised unchanged when it is not retryable or the tries are spent.
    """
    for attempt in range(retries + 1):
        try:
            return await fn()
        except Exception as err:
            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2**attempt))
    raise AssertionError("unreachable")  # the loop returns or raises


# ----------------------------------------------------------------------------- limits and metadata


@dataclass
class RetryState:
    """What a retry loop knows about one operation: the metadata worth logging and storing.

    Chapter 05 keeps the same fields on a message that waits in a retry queue.
    """

    attempt: int = 0  # failed attempts so far
    first_failure_at: float | None = None
    last_failure_at: float | None = None
    next_retry_at: float | None = None
    last_error: BaseException | None = None
    delays: list[float] = field(default_factory=list)
    gave_up: str | None = None  # why the loop stopped retrying, if it did

    def as_row(self) -> dict:
        return {
            "attempt": self.attempt,
            "first_failure_at": self.first_failure_at,
            "last_failure_at": self.last_failure_at,
            "next_retry_at": self.next_retry_at,
            "last_error": f"{type(self.last_error).__name__}: {self.last_error}" if self.last_error else None,
        }


@dataclass(frozen=True)
class RetryPolicy:
    """Three limits, because one is never enough: attempts, total time and the longest wait.

    ``max_elapsed`` counts from the first call; a retry whose wait would end past it is not
    started (the caller hears the error now rather than after a pointless wait).
    """

    max_attempts: int = 5
    max_elapsed: float | None = 10.0
    backoff: Backoff = field(default_factory=lambda: FullJitter(0.1, 2.0))
    retryable: Callable[[BaseException], bool] = is_retryable


async def retry_call(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy = RetryPolicy(),
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rand: Callable[[], float] = random.random,
    on_retry: Callable[[RetryState], None] | None = None,
    state: RetryState | None = None,
) -> T:
    """``with_retry`` grown up: any :mod:`course.backoff` strategy, a total-time limit and
    metadata. ``on_retry(state)`` is called before each wait (log it, export a metric);
    ``state`` (if given) is filled in place, so the caller can read it after a failure."""
    state = state if state is not None else RetryState()
    started = clock()
    previous: float | None = None
    while True:
        try:
            return await fn()
        except Exception as err:
            now = clock()
            state.attempt += 1
            state.first_failure_at = now if state.first_failure_at is None else state.first_failure_at
            state.last_failure_at = now
            state.last_error = err
            state.next_retry_at = None
            if not policy.retryable(err):
                state.gave_up = "not retryable"
                raise
            if state.attempt >= policy.max_attempts:
                state.gave_up = f"{policy.max_attempts} attempts spent"
                raise
            delay = policy.backoff.delay(state.attempt - 1, previous, rand)
            if policy.max_elapsed is not None and now + delay - started > policy.max_elapsed:
                state.gave_up = (
                    f"next try at {now + delay - started:.2f} s would pass the {policy.max_elapsed:g} s limit"
                )
                raise
            previous = delay
            state.delays.append(delay)
            state.next_retry_at = now + delay
            if on_retry is not None:
                on_retry(state)
            await sleep(delay)
