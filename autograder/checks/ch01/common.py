"""What all of chapter 01's checks use: a real-time limit on every call under test."""

from __future__ import annotations

import asyncio

#: real seconds one call under test may take; with injected time, correct code needs milliseconds
REAL_LIMIT = 3.0


class Cut(Exception):
    """A call under test outlived REAL_LIMIT."""


async def bounded(awaitable, limit: float = REAL_LIMIT):
    """Await ``awaitable`` for at most ``limit`` real seconds; raise :class:`Cut` past that.

    Unlike ``asyncio.wait_for``, a ``TimeoutError`` raised by the code under test comes
    through as itself, not as a cut."""
    job = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({job}, timeout=limit)
    if job not in done:
        job.cancel()
        await asyncio.wait({job}, timeout=1.0)
        raise Cut(f"no answer after {limit:g} s of real time")
    return job.result()


def cut_message(what: str) -> str:
    return (
        f"{what}: no answer after {REAL_LIMIT:g} s of real time, though every sleep is injected and virtual. "
        "Does with_retry sleep for real (time.sleep or asyncio.sleep instead of the sleep argument) or never return?"
    )
