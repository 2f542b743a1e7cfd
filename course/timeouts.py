"""Timeouts: what a hanging dependency does to a connection pool, and the fix (chapter 01).

:func:`pool_exhaustion` replays the failure live: a few calls to an endpoint that never
answers take every connection of a small httpx pool, and healthy calls queue behind them.
Without a timeout nothing ever frees the pool; with one, the hung calls fail fast and the
healthy calls go through. :func:`call_with_timeout` is the one-line fix for any awaitable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from course.kit.faults import FlakyService, Schedule

T = TypeVar("T")


async def call_with_timeout(fn: Callable[[], Awaitable[T]], seconds: float) -> T:
    """Await ``fn()`` for at most ``seconds``; raise ``TimeoutError`` after that (and cancel it)."""
    return await asyncio.wait_for(fn(), seconds)


@dataclass
class CallRecord:
    kind: str  # "hanging" or "healthy"
    started: float  # seconds since the run started
    ended: float | None = None  # None: still waiting when the observation window closed
    outcome: str = "waiting"


@dataclass
class PoolRun:
    label: str
    max_connections: int
    observe: float
    calls: list[CallRecord] = field(default_factory=list)

    def healthy(self) -> list[CallRecord]:
        return [c for c in self.calls if c.kind == "healthy"]

    def healthy_done(self) -> list[CallRecord]:
        return [c for c in self.healthy() if c.outcome == "200"]

    def summary(self) -> str:
        done = self.healthy_done()
        lat = sorted((c.ended - c.started) * 1000 for c in done)
        worst = f"slowest {lat[-1]:.0f} ms" if lat else "none finished"
        hung = [c for c in self.calls if c.kind == "hanging"]
        hung_outcomes = sorted({c.outcome for c in hung})
        return (
            f"{self.label}: {len(done)}/{len(self.healthy())} healthy calls answered within {self.observe:g} s "
            f"({worst}); the {len(hung)} calls to the hanging endpoint ended as {', '.join(hung_outcomes)}"
        )


async def pool_exhaustion(
    timeout: httpx.Timeout | float | None,
    *,
    label: str = "",
    hanging: int = 5,
    healthy: int = 20,
    max_connections: int = 5,
    observe: float = 1.5,
) -> PoolRun:
    """``hanging`` calls to an endpoint that never answers, then ``healthy`` calls, all through
    one httpx client with ``max_connections`` connections. Watch for ``observe`` seconds.

    ``timeout=None`` is httpx's "no timeout at all" (note: httpx's default is 5 s, the
    ``requests`` library's default is none). Calls still waiting when the window closes are
    cancelled and reported as ``waiting``.
    """
    run = PoolRun(label or f"timeout={timeout!r}", max_connections, observe)
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    async with FlakyService(Schedule(["hang"] * hanging, then="ok"), name="reports") as svc:
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            t0 = time.perf_counter()

            async def one(kind: str, path: str) -> None:
                rec = CallRecord(kind, time.perf_counter() - t0)
                run.calls.append(rec)
                try:
                    resp = await client.get(svc.url + path)
                    rec.outcome = str(resp.status_code)
                except httpx.HTTPError as err:
                    rec.outcome = type(err).__name__
                except asyncio.CancelledError:
                    rec.outcome = "waiting"
                    raise
                rec.ended = time.perf_counter() - t0

            tasks = [asyncio.create_task(one("hanging", "/report")) for _ in range(hanging)]
            while svc.count < hanging:  # the slow calls hold their connections first
                await asyncio.sleep(0.005)
            tasks += [asyncio.create_task(one("healthy", "/price")) for _ in range(healthy)]
            _, pending = await asyncio.wait(tasks, timeout=observe - (time.perf_counter() - t0))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return run


def plot_pool_runs(*runs: PoolRun):
    """One timeline per run: a bar per call from start to end (or to the window's edge)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), sharey=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    colors = {"200": "#27ae60", "waiting": "#c0392b"}
    for ax, run in zip(axes, runs, strict=True):
        for y, call in enumerate(run.calls):
            end = call.ended if call.ended is not None else run.observe
            color = colors.get(call.outcome, "#e67e22")
            ax.barh(y, end - call.started, left=call.started, color=color, height=0.7)
        ax.axvline(run.observe, color="grey", ls=":", lw=1)
        ax.set_xlim(0, run.observe * 1.05)
        ax.set_xlabel("seconds")
        ax.set_title(f"{run.label}\n{len(run.healthy_done())}/{len(run.healthy())} healthy calls answered", fontsize=10)
    axes[0].set_ylabel("call (first the hanging ones, then the healthy ones)")
    axes[0].invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#27ae60", "#e67e22", "#c0392b")]
    fig.legend(handles, ["answered 200", "timed out (fails fast)", "still waiting"], loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
