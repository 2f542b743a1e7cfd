"""Budgets that keep retries and timeouts honest (chapter 01).

- :class:`RetryBudget`: a token bucket that caps retries as a share of traffic. Every
  request deposits ``ratio`` of a token, every retry spends a whole one, so during an
  outage retries add at most ``ratio`` to the load instead of multiplying it (the idea of
  Finagle's RetryBudget and gRPC's retry throttling).
- :class:`Deadline`: the time a request has left, passed down a call chain, so each inner
  call's timeout fits inside its caller's remaining time (gRPC deadlines, Go's context).

Chapter 01 measures both on a virtual clock (:func:`course.chapters.ch01.outage_load`,
:func:`course.chapters.ch01.call_chain`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


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
            f"RetryBudget(ratio={self.ratio:g}, tokens={self.tokens:.2f}, allowed={self.allowed}, denied={self.denied})"
        )


# ----------------------------------------------------------------------------- deadlines


class DeadlineExceeded(Exception):
    """The caller's time is up: no point starting (or retrying) the work."""


@dataclass
class Deadline:
    """An absolute point in time on ``clock``; pass it down instead of a fixed timeout."""

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
