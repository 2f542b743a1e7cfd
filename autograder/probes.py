"""What every chapter's checks do alike: fire a concurrent burst, tally its outcomes, clean up.

Checks in ``autograder/checks/chNN.py`` import these instead of writing their own, so a
report reads the same in every chapter: ``10 x a response, 2 x UniqueViolation: ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

from autograder.harness import Report, error_line


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


# ----------------------------------------------------------------------------- watching a learner's Redis traffic

#: ``await hook(commands, send)``: ``commands`` are the argument tuples sent in one round trip
#: (one for a command, several for a pipeline); ``send()`` sends them and returns the reply.
RoundTripHook = Callable[[list[tuple], Callable[[], Awaitable]], Awaitable]


def hooked_redis(url: str, hook: RoundTripHook, **kwargs):
    """A ``redis.asyncio.Redis`` (``decode_responses=True``) whose every round trip goes through ``hook``.

    Commands, pipelines (``MULTI`` or not), ``WATCH`` mode and scripts all pass through it, so a
    check can count round trips and what they returned, hold a write back until other callers
    have caught up, or act just before a write reaches the server.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.client import Pipeline

    class HookedPipeline(Pipeline):
        async def execute(self, raise_on_error: bool = True):
            stack = [args for args, _ in self.command_stack]
            return await hook(stack, lambda: super(HookedPipeline, self).execute(raise_on_error))

        async def immediate_execute_command(self, *args, **options):
            return await hook([args], lambda: super(HookedPipeline, self).immediate_execute_command(*args, **options))

    class HookedRedis(aioredis.Redis):
        async def execute_command(self, *args, **options):
            return await hook([args], lambda: super(HookedRedis, self).execute_command(*args, **options))

        def pipeline(self, transaction: bool = True, shard_hint=None):
            return HookedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)

    kwargs.setdefault("decode_responses", True)
    return HookedRedis.from_url(url, **kwargs)
