"""course.bulkhead (chapter 02): the reference bulkhead, and the live PostgreSQL flood demo (course.chapters.ch02)."""

from __future__ import annotations

import asyncio

import pytest

from course.bulkhead import Bulkhead, BulkheadFullError
from course.chapters.ch02 import MODES, pool_flood
from course.kit import lab


def run(coro):
    return asyncio.run(coro)


def test_limit_queue_and_rejection():
    async def scenario():
        gate = asyncio.Event()
        bh = Bulkhead(2, max_queue=1)
        tasks = [asyncio.ensure_future(bh.call(gate.wait)) for _ in range(5)]
        await asyncio.sleep(0)
        snapshot = (bh.running, bh.waiting, bh.rejected)
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return snapshot, [type(r).__name__ for r in results], bh.max_running

    snapshot, results, peak = run(scenario())
    assert snapshot == (2, 1, 2)
    assert results == ["bool"] * 3 + ["BulkheadFullError"] * 2
    assert peak == 2


def test_permits_come_back_after_errors_and_cancellations():
    async def scenario():
        bh = Bulkhead(1, max_queue=1)

        async def boom():
            raise ValueError("no")

        with pytest.raises(ValueError):
            await bh.call(boom)
        hung = asyncio.ensure_future(bh.call(asyncio.Event().wait))
        waiting = asyncio.ensure_future(bh.call(asyncio.Event().wait))
        await asyncio.sleep(0)
        hung.cancel()
        waiting.cancel()
        await asyncio.gather(hung, waiting, return_exceptions=True)
        return bh.running, bh.waiting, await bh.call(lambda: asyncio.sleep(0, "free"))

    assert run(scenario()) == (0, 0, "free")


def test_max_wait_turns_a_long_wait_into_a_rejection():
    async def scenario():
        bh = Bulkhead(1, max_queue=5, max_wait=0.01)
        holder = asyncio.ensure_future(bh.call(asyncio.Event().wait))
        await asyncio.sleep(0)
        try:
            await bh.call(lambda: asyncio.sleep(0))
        finally:
            holder.cancel()
            await asyncio.gather(holder, return_exceptions=True)

    with pytest.raises(BulkheadFullError):
        run(scenario())


def test_pool_flood_runs_every_layout_on_the_live_database():
    async def scenario():
        async with lab.scratch("ch02-flood") as ns:
            return {
                mode: await pool_flood(ns, mode, searchers=12, search_seconds=0.05, payments=4, interval=0.01)
                for mode in MODES
            }

    runs = run(scenario())
    for mode, flood in runs.items():
        assert len(flood.payments_ms) == 4, mode
        assert flood.search_done > 0, mode
    assert runs["shared pool + bulkheads"].search_rejected > 0
    assert runs["shared pool"].search_rejected == 0
