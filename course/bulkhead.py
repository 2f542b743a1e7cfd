"""Bulkheads (chapter 02): a slow dependency may fill its own compartment, never the whole ship.

- :class:`Bulkhead`: at most ``limit`` calls at once, up to ``max_queue`` more waiting
  (optionally for at most ``max_wait`` seconds), the rest rejected at once with
  :class:`BulkheadFullError`. The reference answer to the ``bulkhead`` task.
- :func:`pool_flood`: the chapter's live demo on PostgreSQL: slow ``pg_sleep`` search
  queries flood the connections while a payments caller measures its latency, with one
  shared ``psycopg_pool`` pool, a pool per dependency, or a shared pool behind a
  :class:`Bulkhead` per dependency.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


class BulkheadFullError(Exception):
    """Raised at once when a bulkhead's running slots and its queue are all taken."""

    def __init__(self, name: str = "bulkhead", limit: int = 0, max_queue: int = 0) -> None:
        self.name, self.limit, self.max_queue = name, limit, max_queue
        super().__init__(f"bulkhead {name!r} is full: {limit} running and {max_queue} waiting")


class Bulkhead:
    """Bounded concurrency for one dependency, with a bounded queue in front.

    Permits are released in ``finally`` blocks, so a call that raises, a running call that
    is cancelled and a waiting call that is cancelled all give their place back.
    """

    def __init__(self, limit: int, max_queue: int = 0, *, max_wait: float | None = None, name: str = "bulkhead"):
        if limit < 1 or max_queue < 0:
            raise ValueError("limit must be at least 1 and max_queue at least 0")
        self.limit, self.max_queue, self.max_wait, self.name = limit, max_queue, max_wait, name
        self._slots = asyncio.Semaphore(limit)
        self._admitted = 0  # running + waiting
        self.running = 0
        self.max_running = 0
        self.rejected = 0

    @property
    def waiting(self) -> int:
        return self._admitted - self.running

    def __repr__(self) -> str:
        return f"Bulkhead({self.name!r}, running {self.running}/{self.limit}, waiting {self.waiting}/{self.max_queue})"

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        if self._admitted >= self.limit + self.max_queue:
            self.rejected += 1
            raise BulkheadFullError(self.name, self.limit, self.max_queue)
        self._admitted += 1
        try:
            try:
                if self.max_wait is None:
                    await self._slots.acquire()
                else:
                    await asyncio.wait_for(self._slots.acquire(), self.max_wait)
            except (asyncio.TimeoutError, TimeoutError):
                self.rejected += 1
                raise BulkheadFullError(self.name, self.limit, self.max_queue) from None
            try:
                self.running += 1
                self.max_running = max(self.max_running, self.running)
                return await fn()
            finally:
                self.running -= 1
                self._slots.release()
        finally:
            self._admitted -= 1


# ----------------------------------------------------------------------------- the live demo


@dataclass
class FloodRun:
    """Payments latencies (ms) and search counts from one :func:`pool_flood` run."""

    mode: str
    payments_ms: list[float] = field(default_factory=list)
    payments_failed: int = 0
    search_done: int = 0
    search_rejected: int = 0
    search_failed: int = 0
    seconds: float = 0.0


PAYMENTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS ch02_payments (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    amount integer NOT NULL,
    at     timestamptz NOT NULL DEFAULT now()
)
"""

MODES = ("shared pool", "pool per dependency", "shared pool + bulkheads")


async def pool_flood(
    ns,
    mode: str,
    *,
    connections: int = 8,
    payments_share: int = 3,
    searchers: int = 24,
    search_seconds: float = 0.25,
    payments: int = 40,
    interval: float = 0.04,
    wait_timeout: float = 1.0,
) -> FloodRun:
    """Flood the database with slow searches while a payments caller measures its latency.

    ``connections`` is the budget in every mode. ``shared pool``: one pool of that size for
    both dependencies. ``pool per dependency``: ``payments_share`` connections for payments,
    the rest for search. ``shared pool + bulkheads``: one pool, with a :class:`Bulkhead` per
    dependency of the same sizes in front (search may queue as many calls again, then is
    rejected). Payments waits at most ``wait_timeout`` s for a connection.
    """
    if mode not in MODES:
        raise ValueError(f"mode is one of {MODES}")
    search_size = connections - payments_share
    if mode == "pool per dependency":
        pay_pool = await ns.pool(min_size=payments_share, max_size=payments_share)
        search_pool = await ns.pool(min_size=search_size, max_size=search_size)
    else:
        pay_pool = search_pool = await ns.pool(min_size=connections, max_size=connections)
    guard_search = guard_pay = None
    if mode == "shared pool + bulkheads":
        guard_search = Bulkhead(search_size, max_queue=search_size, name="search")
        guard_pay = Bulkhead(payments_share, max_queue=payments_share * 4, name="payments")
    async with pay_pool.connection() as conn:
        await conn.execute(PAYMENTS_SCHEMA)

    run = FloodRun(mode)
    stop = asyncio.Event()

    async def one_search() -> None:
        async with search_pool.connection(timeout=30) as conn:
            await conn.execute("SELECT pg_sleep(%s)", (search_seconds,))

    async def searcher() -> None:
        while not stop.is_set():
            try:
                await (guard_search.call(one_search) if guard_search else one_search())
                run.search_done += 1
            except BulkheadFullError:
                run.search_rejected += 1
                await asyncio.sleep(search_seconds / 5)  # the caller got a fast 503 and comes back later
            except Exception:  # noqa: BLE001 - counted, the flood goes on
                run.search_failed += 1

    async def one_payment() -> None:
        async with pay_pool.connection(timeout=wait_timeout) as conn:
            await conn.execute("INSERT INTO ch02_payments (amount) VALUES (%s)", (100,))

    async def payment() -> None:
        t0 = time.perf_counter()
        try:
            await (guard_pay.call(one_payment) if guard_pay else one_payment())
        except Exception:  # noqa: BLE001 - a pool timeout or a full bulkhead: the payment failed
            run.payments_failed += 1
        run.payments_ms.append((time.perf_counter() - t0) * 1000)

    started = time.perf_counter()
    flood = [asyncio.create_task(searcher()) for _ in range(searchers)]
    await asyncio.sleep(search_seconds / 2)  # let the flood take the connections first
    paying = []
    for _ in range(payments):  # open loop: payments arrive on schedule, however slow the last one was
        paying.append(asyncio.create_task(payment()))
        await asyncio.sleep(interval)
    await asyncio.gather(*paying)
    stop.set()
    await asyncio.gather(*flood, return_exceptions=True)
    run.seconds = time.perf_counter() - started
    for pool in {id(pay_pool): pay_pool, id(search_pool): search_pool}.values():
        await pool.close()
    return run
