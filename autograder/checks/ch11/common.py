"""What both of chapter 11's checks use: the replica count, waiting until callers block in
PostgreSQL (:func:`settle`), and calls whose exception is the outcome (:func:`attempt`)."""

from __future__ import annotations

import asyncio
import time

from autograder.probes import SETTLE_LIMIT
from course.kit.lab import LOCK_WAITERS

REPLICAS = 2


async def waiters(watcher) -> int:
    cur = await watcher.execute(LOCK_WAITERS)
    return (await cur.fetchone())[0]


async def settle(watcher, tasks: list[asyncio.Task], waiting: int) -> bool:
    """Until ``waiting`` sessions wait on a PostgreSQL lock or every task is done; False on a stall."""
    deadline = time.monotonic() + SETTLE_LIMIT
    while True:
        await asyncio.sleep(0.002)
        if all(t.done() for t in tasks):
            return True
        if await waiters(watcher) >= waiting:
            return True
        if time.monotonic() > deadline:
            return False


async def outcome(t: asyncio.Task):
    try:
        return await t
    except Exception as err:  # noqa: BLE001 - learner code may raise anything; reported
        return err


async def attempt(call):
    try:
        await call
        return None
    except Exception as err:  # noqa: BLE001 - reported
        return err


async def attempt_value(call):
    try:
        return await call
    except Exception as err:  # noqa: BLE001 - reported
        return err
