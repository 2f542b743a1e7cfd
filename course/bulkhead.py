"""Bulkheads (chapter 02): a slow dependency may fill its own compartment, never the whole ship.

- :class:`Bulkhead`: at most ``limit`` calls at once, up to ``max_queue`` more waiting
  (optionally for at most ``max_wait`` seconds), the rest rejected at once with
  :class:`BulkheadFullError`. The reference answer to the ``bulkhead`` task.

The chapter's live demo on PostgreSQL (slow searches flood the connections while payments
measures its latency) is :func:`course.chapters.ch02.pool_flood`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
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
            except TimeoutError:
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
