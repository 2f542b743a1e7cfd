"""Budgets that keep retries and timeouts honest (chapter 01).

- :class:`RetryBudget`: a token bucket that caps retries as a share of traffic. Every
  request deposits ``ratio`` of a token, every retry spends a whole one, so during an
  outage retries add at most ``ratio`` to the load instead of multiplying it (the idea of
  Finagle's RetryBudget and gRPC's retry throttling).
- :class:`Deadline`: the time a request has left, passed down a call chain, so each inner
  call's timeout fits inside its caller's remaining time (gRPC deadlines, Go's context).
- :func:`outage_load` and :func:`call_chain` measure both on a virtual clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from course.kit.faults import FlakyDependency, Schedule, VirtualClock


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


async def outage_load(requests: int = 1000, *, retries: int = 4, budget: RetryBudget | None = None) -> dict:
    """``requests`` requests, one every 10 ms, against a dependency that is down throughout.

    Returns how many calls reached the dependency, with ``retries`` retries per request,
    with or without a :class:`RetryBudget`. Virtual time: instant and repeatable.
    """
    from course.retry import is_retryable, with_retry

    clock = VirtualClock()
    dep = FlakyDependency(Schedule("fail", then="repeat"), clock=clock, name="inventory")
    retryable = budget.retryable(is_retryable) if budget else is_retryable

    async def one(i: int) -> None:
        await clock.sleep(i * 0.01)
        if budget:
            budget.record_request()
        with contextlib.suppress(Exception):
            await with_retry(dep, retries=retries, base_delay=0.05, sleep=clock.sleep, retryable=retryable)

    await asyncio.gather(*(one(i) for i in range(requests)))
    return {"requests": requests, "calls": dep.count, "amplification": dep.count / requests}


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


@dataclass
class Hop:
    """One service in a chain: ``work`` seconds of its own, then a call to the next hop."""

    name: str
    work: float
    timeout: float  # its own fixed timeout for the call below
    attempts: int = 1


@dataclass
class ChainRun:
    label: str
    answered_at: float  # when the user got an answer (or gave up)
    outcome: str
    busy: dict = field(default_factory=dict)  # hop -> seconds of work it did
    wasted: float = 0.0  # seconds of work done after the user was answered
    calls: dict = field(default_factory=dict)  # hop -> calls it received


async def wait_for_virtual(task: asyncio.Future, seconds: float, clock: VirtualClock):
    """``asyncio.wait_for`` on a virtual clock; the task is left running (not cancelled) when
    time runs out, as a remote server would keep working after its caller gave up."""
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
    if task.done():
        return task.result()
    raise TimeoutError(f"no answer within {seconds:.3g} s")


async def call_chain(hops: list[Hop], user_timeout: float, *, propagate: bool) -> ChainRun:
    """A request enters at ``hops[0]``; the user (or the load balancer) waits ``user_timeout``.

    Each hop does ``work`` seconds of its own, then calls the next hop with its fixed
    ``timeout`` and up to ``attempts`` tries (``propagate=False``), or with the smaller of
    that timeout and the deadline's remaining time, refusing work whose deadline has passed
    (``propagate=True``). Each hop runs as its own task, as a remote server would: a caller
    that gives up does not stop the callee. Virtual time throughout.
    """
    clock = VirtualClock()
    run = ChainRun("deadline propagated" if propagate else "fixed timeouts per hop", 0.0, "")
    tasks: list[asyncio.Task] = []
    user_answered = False

    async def serve(i: int, deadline: Deadline) -> str:
        hop = hops[i]
        run.calls[hop.name] = run.calls.get(hop.name, 0) + 1
        done = 0.0
        while done < hop.work - 1e-12:  # this hop's own work, in 10 ms slices
            if propagate and deadline.expired:
                raise DeadlineExceeded(f"{hop.name}: the deadline passed, work abandoned")
            dt = min(0.01, hop.work - done)
            await clock.sleep(dt)
            done += dt
            run.busy[hop.name] = run.busy.get(hop.name, 0.0) + dt
            if user_answered:
                run.wasted += dt
        if i + 1 == len(hops):
            return "rows"
        last: BaseException | None = None
        # the callee gets this hop's deadline minus time kept back for answering
        inner = deadline.within(reserve=0.02) if propagate else deadline
        for _ in range(hop.attempts):
            limit = min(hop.timeout, inner.remaining()) if propagate else hop.timeout
            if limit <= 0:
                last = DeadlineExceeded(f"{hop.name}: no time left to call {hops[i + 1].name}")
                break
            callee = asyncio.ensure_future(serve(i + 1, inner))
            tasks.append(callee)
            try:
                return await wait_for_virtual(callee, limit, clock)
            except Exception as err:  # noqa: BLE001 - a timeout or the callee's own failure
                last = err
        raise TimeoutError(f"{hop.name}: the call to {hops[i + 1].name} failed ({last})")

    deadline = Deadline.after(user_timeout, clock)
    entry = asyncio.ensure_future(serve(0, deadline))
    tasks.append(entry)
    try:
        await wait_for_virtual(entry, user_timeout, clock)
        run.outcome = "200"
    except Exception:  # noqa: BLE001 - the user sees a 504 either way
        run.outcome = "504"
    run.answered_at = clock()
    user_answered = True
    while any(not t.done() for t in tasks):  # let the servers behind finish what they started
        await asyncio.gather(*tasks, return_exceptions=True)
    return run
