"""Budgets that keep retries and timeouts honest (chapter 01).

- :class:`RetryBudget`: a token bucket that caps retries as a share of traffic. Every
  request deposits ``ratio`` of a token, every retry spends a whole one, so during an
  outage retries add at most ``ratio`` to the load instead of multiplying it (the idea of
  Finagle's RetryBudget and gRPC's retry throttling).
- :class:`Deadline`: the time a request has left, passed down a call chain, so each inner
  call's timeout fits inside its caller's remaining time (gRPC deadlines, Go's context).
  Between hosts it travels as the time *remaining* (:meth:`Deadline.to_header`,
  :meth:`Deadline.from_header`), never as an absolute time: two hosts' clocks disagree.
- :func:`call_next_hop`: one hop of a call chain with the deadline passed down.

Chapter 01 measures them on a virtual clock (:func:`course.chapters.ch01.outage_load`,
:func:`course.chapters.ch01.call_chain`, :func:`course.chapters.ch01.skewed_hop`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

#: The header that carries a deadline between services: milliseconds left, as Envoy's
#: ``x-envoy-expected-rq-timeout-ms`` does (gRPC sends ``grpc-timeout``, also a duration).
DEADLINE_HEADER = "x-request-timeout-ms"


class RetryBudget:
    """Allow retries only while they stay below ``ratio`` of the requests.

    ``reserve`` tokens are there at the start (and the bucket never holds more than
    ``cap``), so a quiet client can still retry a few times.

        budget = RetryBudget(ratio=0.1)
        budget.record_request()                         # once per first attempt
        await with_retry(call, retryable=budget.retryable(is_retryable))
    """

    def __init__(self, ratio: float = 0.1, *, reserve: float = 10.0, cap: float | None = None) -> None:
        if not 0 <= ratio <= 1:
            raise ValueError("ratio is a share of requests, between 0 and 1")
        self.ratio = ratio
        self.cap = cap if cap is not None else max(reserve, 10.0)
        self.tokens = float(reserve)
        self.allowed = 0
        self.denied = 0
        self._lock = threading.Lock()

    def record_request(self) -> None:
        with self._lock:
            self.tokens = min(self.cap, self.tokens + self.ratio)

    def try_spend(self) -> bool:
        """Take a token for one retry; False (and no retry) when the bucket is empty."""
        with self._lock:
            if self.tokens >= 1:
                self.tokens -= 1
                self.allowed += 1
                return True
            self.denied += 1
            return False

    def retryable(self, predicate: Callable[[BaseException], bool]) -> Callable[[BaseException], bool]:
        """A ``retryable=`` for :func:`course.retry.with_retry` that also asks the budget."""

        def check(err: BaseException) -> bool:
            return predicate(err) and self.try_spend()

        return check

    def __repr__(self) -> str:
        return (
            f"RetryBudget(ratio={self.ratio:g}, tokens={self.tokens:.2f}, "
            f"allowed={self.allowed}, denied={self.denied})"
        )


# ----------------------------------------------------------------------------- deadlines


class DeadlineExceeded(Exception):
    """The caller's time is up: no point starting (or retrying) the work."""


@dataclass
class Deadline:
    """An absolute point in time on this host's ``clock``; pass it down instead of a fixed
    timeout. To another host it travels as the time left (:meth:`to_header`)."""

    at: float
    clock: Callable[[], float]

    @classmethod
    def after(cls, seconds: float, clock: Callable[[], float]) -> Deadline:
        return cls(clock() + seconds, clock)

    def remaining(self) -> float:
        return max(0.0, self.at - self.clock())

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0

    def within(self, *, reserve: float) -> Deadline:
        """The deadline to hand to a callee: ``reserve`` seconds earlier, kept for this layer."""
        return Deadline(self.at - reserve, self.clock)

    def timeout(self, own: float, *, reserve: float = 0.0) -> float:
        """The timeout for an inner call: its own limit, but never past what is left minus
        ``reserve`` (time this layer keeps for its own work, such as answering)."""
        left = self.remaining() - reserve
        if left <= 0:
            raise DeadlineExceeded(f"{self.remaining():.3f} s left, {reserve:.3f} s reserved")
        return min(own, left)

    def to_header(self) -> str:
        """The time left, in whole milliseconds: what crosses to another host."""
        return str(int(self.remaining() * 1000))

    @classmethod
    def from_header(
        cls, value: str | None, clock: Callable[[], float], *, default: float | None = None
    ) -> Deadline:
        """The deadline a caller sent, on *this* host's clock. Without the header: ``default``
        seconds from now (or raise ``ValueError`` when there is no default)."""
        if value is None or not value.strip().isdigit():
            if default is None:
                raise ValueError(f"no deadline in {value!r}")
            return cls.after(default, clock)
        return cls.after(int(value) / 1000, clock)


async def call_next_hop(
    call: Callable[[Deadline], Awaitable[T]],
    deadline: Deadline,
    *,
    own_timeout: float,
    attempts: int = 1,
    reserve: float = 0.0,
    min_timeout: float = 0.001,
    wait_for: Callable[[Awaitable[T], float], Awaitable[T]] = asyncio.wait_for,
) -> T:
    """Call the next service with the deadline passed down: the deadline hop.

    Each try gets ``min(own_timeout, time left - reserve)``; ``call`` receives the deadline
    to pass on (``reserve`` seconds earlier, kept for this hop's own answer). Less than
    ``min_timeout`` left: no try at all (:class:`DeadlineExceeded`), instead of work nobody
    will wait for. ``wait_for`` is injectable so a virtual clock can drive it.
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    inner = deadline.within(reserve=reserve)
    last: Exception | None = None
    for _ in range(attempts):
        left = deadline.remaining() - reserve
        if left < min_timeout:
            why = f"{deadline.remaining():.3f} s left, {reserve:.3f} s reserved"
            if last is None:
                raise DeadlineExceeded(why)
            raise DeadlineExceeded(f"{why}: no time for another try after {last!r}") from last
        timeout = min(own_timeout, left)
        try:
            return await wait_for(call(inner), timeout)
        except Exception as err:  # noqa: BLE001 - a timeout or the callee's failure: maybe try again
            last = err
    raise last  # type: ignore[misc] - the loop ran at least once
