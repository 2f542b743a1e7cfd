"""Timeouts (chapter 01): never wait on a dependency for longer than you can afford.

:func:`call_with_timeout` is the one-line fix for any awaitable. What a hanging dependency
does to a connection pool without it is replayed live by
:func:`course.chapters.ch01.pool_exhaustion`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def call_with_timeout(fn: Callable[[], Awaitable[T]], seconds: float) -> T:
    """Await ``fn()`` for at most ``seconds``; raise ``TimeoutError`` after that (and cancel it)."""
    return await asyncio.wait_for(fn(), seconds)
