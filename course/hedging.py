"""Hedged reads and the fan-out tail (chapter 01).

A hedged read sends the same idempotent read to a second replica when the first has not
answered after about the p95 latency, takes whichever answer comes first and cancels the
other. One slow replica then no longer sets your p99, for a few percent more requests.
Only for idempotent reads: a hedged write is a duplicate write.

It matters most for fan-out: a request that waits on 100 shards, each slow 1% of the
time, is slow 1 - 0.99**100 = 63% of the time. Chapter 01 measures both
(:func:`course.chapters.ch01.hedging_demo`, :func:`course.chapters.ch01.plot_fanout`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class HedgeStats:
    requests: int = 0
    hedges: int = 0  # second requests sent
    hedge_wins: int = 0  # answers that came from the hedge
    cancelled: int = 0  # losers cancelled

    @property
    def extra_load(self) -> float:
        return self.hedges / self.requests if self.requests else 0.0


async def hedged(
    call: Callable[[R], Awaitable[T]],
    replicas: Sequence[R],
    *,
    hedge_after: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    stats: HedgeStats | None = None,
) -> T:
    """``call(replicas[0])``; if no answer after ``hedge_after`` s, also ``call(replicas[1])``
    (and so on). The first success wins, the rest are cancelled. A replica that fails fast
    triggers the next one at once; if every replica fails, the first error is raised."""
    if not replicas:
        raise ValueError("hedged() needs at least one replica")
    stats = stats if stats is not None else HedgeStats()
    stats.requests += 1
    running: dict[asyncio.Task, int] = {}
    errors: list[BaseException] = []
    launched = 0

    def launch() -> None:
        nonlocal launched
        running[asyncio.ensure_future(call(replicas[launched]))] = launched
        launched += 1

    launch()
    timer: asyncio.Task | None = None
    try:
        while running:
            if timer is None and launched < len(replicas):
                timer = asyncio.ensure_future(sleep(hedge_after))
            waiting = set(running) | ({timer} if timer else set())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is timer:
                    continue
                index = running.pop(task)
                if task.exception() is None:
                    if index > 0:
                        stats.hedge_wins += 1
                    return task.result()
                errors.append(task.exception())
            hedge_now = timer in done or (not running and launched < len(replicas))
            if hedge_now and launched < len(replicas):
                if timer is not None and not timer.done():
                    timer.cancel()
                timer = None
                stats.hedges += 1
                launch()
        raise errors[0]
    finally:
        if timer is not None:
            timer.cancel()
        for task in running:
            task.cancel()
            stats.cancelled += 1
        if running:
            await asyncio.gather(*running, return_exceptions=True)
