"""Hedged reads and the fan-out tail (chapter 01).

A hedged read sends the same idempotent read to a second replica when the first has not
answered after about the p95 latency, takes whichever answer comes first and cancels the
other. One slow replica then no longer sets your p99, for a few percent more requests.
Only for idempotent reads: a hedged write is a duplicate write.

:func:`fanout_slow_share` shows why this matters most for fan-out: a request that waits on
100 shards, each slow 1% of the time, is slow 1 - 0.99**100 = 63% of the time.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import httpx
import numpy as np

from course.kit.faults import FlakyService, Schedule
from course.kit.stats import percentile

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


# ----------------------------------------------------------------------------- live measurement


def replica_schedule(n: int, *, slow_share: float, fast: float, slow: float, seed: int) -> Schedule:
    """A replica that answers in ``fast`` s, but in ``slow`` s for a random ``slow_share`` of calls."""
    rng = random.Random(seed)
    steps = [f"slow:{slow if rng.random() < slow_share else fast}" for _ in range(n)]
    return Schedule(steps, then="repeat")


@dataclass
class ReadRun:
    label: str
    latencies_ms: list[float] = field(default_factory=list)
    stats: HedgeStats = field(default_factory=HedgeStats)

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


async def measure_reads(
    urls: Sequence[str],
    *,
    n: int,
    hedge_after: float | None,
    concurrency: int = 8,
    label: str = "",
    client: httpx.AsyncClient | None = None,
    into: ReadRun | None = None,
) -> ReadRun:
    """``n`` reads against the replicas at ``urls``, ``concurrency`` at a time; hedged after
    ``hedge_after`` s, or plain reads of ``urls[0]`` when it is None. Results are added to
    ``into`` (a new :class:`ReadRun` by default)."""
    run = into or ReadRun(label or ("plain" if hedge_after is None else f"hedged after {hedge_after * 1000:.0f} ms"))
    gate = asyncio.Semaphore(concurrency)
    own = client is None
    http = client or httpx.AsyncClient(timeout=5.0, limits=httpx.Limits(max_connections=4 * concurrency))
    try:

        async def get(url: str) -> int:
            resp = await http.get(url + "/profile")
            resp.raise_for_status()
            return resp.status_code

        async def one() -> None:
            async with gate:
                t0 = time.perf_counter()
                if hedge_after is None:
                    run.stats.requests += 1
                    await get(urls[0])
                else:
                    await hedged(get, urls, hedge_after=hedge_after, stats=run.stats)
                run.latencies_ms.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(one() for _ in range(n)))
    finally:
        if own:
            await http.aclose()
    return run


async def hedging_demo(
    n: int = 400,
    *,
    slow_share: float = 0.03,
    fast: float = 0.005,
    slow: float = 0.5,
    seed: int = 11,
    concurrency: int = 4,
) -> tuple[ReadRun, ReadRun, float]:
    """Two live replicas (FlakyService), each slow for ``slow_share`` of reads.

    A warm-up of plain reads gives the p95 that becomes the hedge delay; then ``n`` plain and
    ``n`` hedged reads run side by side over one client, so both see the same machine at the
    same moment. Returns (plain, hedged, hedge_after_seconds)."""
    a = FlakyService(replica_schedule(997, slow_share=slow_share, fast=fast, slow=slow, seed=seed), name="replica-a")
    b = FlakyService(
        replica_schedule(991, slow_share=slow_share, fast=fast, slow=slow, seed=seed + 1), name="replica-b"
    )
    limits = httpx.Limits(max_connections=4 * concurrency, max_keepalive_connections=4 * concurrency)
    async with a, b, httpx.AsyncClient(timeout=5.0, limits=limits) as client:
        urls = [a.url, b.url]
        # the p95 under the same load as the measurement below: both streams at once
        warmup = await measure_reads(
            urls, n=max(120, n // 3), hedge_after=None, client=client, concurrency=2 * concurrency
        )
        hedge_after = warmup.p(95) / 1000
        plain = ReadRun("plain")
        hedged_run = ReadRun(f"hedged after {hedge_after * 1000:.0f} ms")
        await asyncio.gather(
            measure_reads(urls, n=n, hedge_after=None, client=client, into=plain, concurrency=concurrency),
            measure_reads(urls, n=n, hedge_after=hedge_after, client=client, into=hedged_run, concurrency=concurrency),
        )
    return plain, hedged_run, hedge_after


# ----------------------------------------------------------------------------- fan-out


def fanout_slow_share(shards: int, p_slow: float = 0.01, *, trials: int = 20_000, seed: int = 100) -> float:
    """Measured share of fan-out requests that wait on at least one slow shard."""
    rng = np.random.default_rng(seed)
    slow = rng.random((trials, shards)) < p_slow
    return float(slow.any(axis=1).mean())


def plot_fanout(p_slow: float = 0.01, *, max_shards: int = 200, p_slow_hedged: float | None = None, trials=20_000):
    """Share of slow requests against fan-out width: formula, simulation, and with hedging."""
    import matplotlib.pyplot as plt

    widths = np.unique(np.linspace(1, max_shards, 25).astype(int))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(widths, 1 - (1 - p_slow) ** widths, color="#c0392b", label=f"1 - (1 - {p_slow:g})^N")
    measured = [fanout_slow_share(w, p_slow, trials=trials, seed=int(w)) for w in widths]
    ax.plot(widths, measured, "o", ms=3, color="#c0392b", label="simulated")
    if p_slow_hedged is not None:
        ax.plot(widths, 1 - (1 - p_slow_hedged) ** widths, color="#2e86c1", label=f"hedged (p = {p_slow_hedged:.2g})")
    ax.axvline(100, color="grey", ls=":", lw=1)
    ax.set(xlabel="shards a request waits on (N)", ylabel="share of slow requests", ylim=(0, 1.02))
    ax.set_title(f"The fan-out tail: each shard slow {p_slow:.0%} of the time")
    ax.legend()
    fig.tight_layout()
    return fig
