"""Bulkheads and backpressure (chapter 02): a slow dependency may fill its own compartment, never the whole ship.

- :class:`Bulkhead`: at most ``limit`` calls at once, up to ``max_queue`` more waiting
  (optionally for at most ``max_wait`` seconds), the rest rejected at once with
  :class:`BulkheadFullError`. The reference answer to the ``bulkhead`` task.
- :func:`offer`: put work on a bounded queue the backpressure way: block between pipeline
  stages, reject at the edge, or shed the least valuable work first.

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

    def __init__(
        self, limit: int, max_queue: int = 0, *, max_wait: float | None = None, name: str = "bulkhead"
    ):
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


# ----------------------------------------------------------------------------- backpressure

OFFER_MODES = ("block", "reject", "shed")


async def offer(
    queue: asyncio.Queue, item, *, mode: str = "reject", low_value: bool = False, shed_at: float = 0.5
) -> bool:
    """Hand ``item`` to a bounded ``queue``; True if it was taken.

    - ``"block"`` (between pipeline stages): wait for room, so the slowdown travels upstream
      to whoever can slow down;
    - ``"reject"`` (at the edge of a service): never wait; False when the queue is full, and
      the handler answers ``503`` (or ``429``) with ``Retry-After`` while its client still
      listens;
    - ``"shed"``: like ``reject``, but ``low_value`` work is turned away as soon as the queue
      is ``shed_at`` full, keeping the rest of the room for the work that matters.

    An unbounded queue (``asyncio.Queue()``) never says no: that is the bug, not a mode.
    """
    if mode not in OFFER_MODES:
        raise ValueError(f"mode is one of {OFFER_MODES}")
    if queue.maxsize <= 0:
        raise ValueError("backpressure needs a bounded queue: asyncio.Queue(maxsize)")
    if mode == "block":
        await queue.put(item)
        return True
    if mode == "shed" and low_value and queue.qsize() >= queue.maxsize * shed_at:
        return False
    try:
        queue.put_nowait(item)
    except asyncio.QueueFull:
        return False
    return True
