"""What every chapter's checks do alike: fire a concurrent burst, tally its outcomes, clean up.

Checks in ``autograder/checks/chNN.py`` import these instead of writing their own, so a
report reads the same in every chapter: ``10 x a response, 2 x UniqueViolation: ...``.
:class:`Crowd` makes a race between concurrent callers on PostgreSQL happen every time
(chapters 03 and 12).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

from autograder.harness import Report, error_line
from course.kit.faults import VirtualClock


async def burst(n: int, call: Callable[[], Awaitable]) -> list:
    """Start ``call()`` ``n`` times at once; results and exceptions, in call order."""
    return await asyncio.gather(*(call() for _ in range(n)), return_exceptions=True)


def label(outcome, ok: str | None = None) -> str:
    """One outcome as a report word: ``ok`` (or its repr) for a value, ``Type: message`` for an error."""
    if isinstance(outcome, BaseException):
        return error_line(outcome, 120)
    return ok if ok is not None else repr(outcome)[:120]


def tally(outcomes: Iterable, ok: str | None = None, top: int | None = None) -> str:
    """``"8 x a response, 2 x UniqueViolation: duplicate key ..."``, most frequent first."""
    counts = Counter(label(x, ok) for x in outcomes)
    return ", ".join(f"{n} x {what}" for what, n in counts.most_common(top))


def fmt(values) -> str:
    """A list of numbers as ``[0.1, 0.2031, 0.4]`` (4 significant digits), others as repr."""
    return "[" + ", ".join(f"{v:.4g}" if isinstance(v, (int, float)) else repr(v) for v in values) + "]"


class Spawned(list):
    """Tasks a check starts; at the end every one is cancelled or has its outcome retrieved,
    so no "exception was never retrieved" warning leaks into a later notebook cell."""

    def __call__(self, coro) -> asyncio.Future:
        fut = asyncio.ensure_future(coro)
        self.append(fut)
        return fut

    async def settle(self) -> None:
        for fut in self:
            if not fut.done():
                fut.cancel()
        await asyncio.gather(*self, return_exceptions=True)


@contextlib.contextmanager
def seeded_random(r: Report):
    """Seed the ``random`` module from the report's seed for one check (restored afterwards),
    for learner code that draws from ``random`` itself rather than an injected source."""
    state = random.getstate()
    random.seed(r.random.getrandbits(64))
    try:
        yield
    finally:
        random.setstate(state)


# ----------------------------------------------------------------------------- races on PostgreSQL

SETTLE_LIMIT = 2.0  # real seconds a crowd may take to settle before the check moves it on anyway
LOCK_WAITERS = (
    "SELECT count(*) FROM pg_stat_activity "
    "WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
)


class Crowd:
    """``n`` concurrent callers whose progress the check can see.

    Each caller is "calling" (running learner code), "charging" (held in ``charge``),
    "sleeping" (in its retry backoff, on a VirtualClock) or "done". The crowd is *settled*
    when every caller still "calling" is blocked on a PostgreSQL lock. At the first settle
    the crowd runs ``on_settled`` (open the charge gate, or commit the transaction that
    holds the accounts); at later settles it wakes the earliest sleeper by advancing the clock.
    """

    def __init__(self, n: int, watcher, on_settled: Callable[[], Awaitable[None]] | None = None) -> None:
        self.n = n
        self.watcher = watcher
        self.clock = VirtualClock(auto=False)
        self.state = ["calling"] * n
        self.wake = [0.0] * n
        self.gate = asyncio.Event()
        self.on_settled = on_settled
        self.released = False
        self.stalls = 0
        self.charging_at_release = 0
        self.sleeping_at_release = 0
        self.blocked_at_release = 0
        self._who: contextvars.ContextVar[int | None] = contextvars.ContextVar("caller", default=None)

    async def sleep(self, seconds: float) -> None:
        i = self._who.get()
        if i is None:
            await self.clock.sleep(seconds)
            return
        self.state[i] = "sleeping"
        self.wake[i] = self.clock() + seconds
        try:
            await self.clock.sleep(seconds)
        finally:
            self.state[i] = "calling"

    async def hold(self) -> None:
        """Called inside ``charge``: wait here until the crowd has settled once."""
        i = self._who.get()
        if i is None or self.gate.is_set():
            return
        self.state[i] = "charging"
        try:
            await self.gate.wait()
        finally:
            self.state[i] = "calling"

    async def _blocked(self) -> int:
        cur = await self.watcher.execute(LOCK_WAITERS)
        return (await cur.fetchone())[0]

    async def _settle(self) -> tuple[bool, int]:
        deadline = time.monotonic() + SETTLE_LIMIT
        while True:
            await asyncio.sleep(0.002)
            calling = self.state.count("calling")
            blocked = await self._blocked() if calling else 0
            if blocked >= calling:
                return True, blocked
            if time.monotonic() > deadline:
                return False, blocked

    async def run(self, make_call: Callable[[int], Awaitable]) -> list:
        async def one(i: int):
            self._who.set(i)
            try:
                return await make_call(i)
            finally:
                self.state[i] = "done"

        tasks = [asyncio.create_task(one(i)) for i in range(self.n)]
        while not all(t.done() for t in tasks):
            settled, blocked = await self._settle()
            if all(t.done() for t in tasks):
                break
            self.stalls += not settled
            if not self.released:
                self.released = True
                self.charging_at_release = self.state.count("charging")
                self.sleeping_at_release = self.state.count("sleeping")
                self.blocked_at_release = blocked
                self.gate.set()
                if self.on_settled is not None:
                    await self.on_settled()
                continue
            sleepers = [i for i, s in enumerate(self.state) if s == "sleeping"]
            if sleepers:
                t = min(self.wake[i] for i in sleepers)
                for i in sleepers:
                    if self.wake[i] <= t:
                        self.state[i] = "calling"
                self.clock.advance(max(0.0, t - self.clock()))
        return await asyncio.gather(*tasks, return_exceptions=True)
