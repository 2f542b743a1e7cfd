"""Who made a call that crossed the wire, and how that caller's task ended.

Each call from the other side is served in a task of this side's own, so ``asyncio.current_task()``
in a callee says nothing of who called. Every call carries the caller's task number (the same for
every call one task makes); :func:`caller` gives a check that token (in one process, the task
itself), and :func:`ended` how the task behind it ended (chapter 05 reads a caught kill from it).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import weakref

ROOT = 0  # the handle of each side's root object (autograder.wire.ROOT)

#: Who made the call being served: (this connection, the calling side's task number), see :func:`caller`.
_caller: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("caller", default=None)
_task_numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_next_task = itertools.count(1)


_endings: dict[int, object] = {}  # task number -> how it ended (see ending_of), the last 10,000
_conns: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> Conn, for ended()


def _task_number() -> int | None:
    """A number for the running task, the same for every call it makes (``id()`` can be reused)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return None
    if task is None:
        return None
    number = _task_numbers.get(task)
    if number is None:
        number = _task_numbers[task] = next(_next_task)
        task.add_done_callback(lambda t, n=number: _record_ending(n, t))
    return number


#: A task serving the other side's call ends "returned" whatever its callee raised (the error is the
#: reply): what the callee raised, by task, for :func:`_how`.
_raised: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _how(task: asyncio.Future):
    if not task.done():
        return None
    if task.cancelled():
        return "cancelled"
    err = _raised.get(task) or task.exception()
    if err is None:
        return "returned"
    if isinstance(err, asyncio.CancelledError):
        return "cancelled"
    return [f"{c.__module__}.{c.__qualname__}" for c in type(err).__mro__]


def _record_ending(number: int, task: asyncio.Future) -> None:
    _endings[number] = _how(task)
    while len(_endings) > 10_000:
        _endings.pop(next(iter(_endings)))


def ending_of(number: int):
    """How this side's task ``number`` ended: None while it runs, "returned", "cancelled", or the
    ``module.qualname`` of its exception's classes."""
    return _endings.get(number)


async def ended(token):
    """How the task behind a :func:`caller` token ended (see :func:`ending_of`), asked of the side it
    ran on; in one process, of the task itself."""
    if isinstance(token, asyncio.Future):
        return _how(token)
    if not isinstance(token, tuple):
        return None
    conn = _conns.get(token[0])
    if conn is None or not conn.alive:
        return None
    return await conn.call_async(ROOT, "method", "task_ended", (token[1],), {})


def caller():
    """The task a call came from: ``asyncio.current_task()`` in one process; across the wire, a
    token that is the same for every call the other side's task makes (each call is served in a
    task of its own here, so the task this side runs in says nothing of who called)."""
    remote = _caller.get()
    if remote is not None:
        return remote
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None
