"""An event loop's timers, as checks see them: which are pending, and making them due at once.

Standard library only: a learner's process imports it (:mod:`autograder.learner`), and the
in-kernel checks use it on their own loop (:class:`autograder.probes.AnswerLoop`).
"""

from __future__ import annotations


def loop_timers(loop) -> list:
    """The loop's pending timers (``call_later``/``call_at`` handles: ``asyncio.sleep``, timeouts)."""
    return [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]


def fire_timers(loop, old: list) -> int:
    """Make every pending timer that is not in ``old`` due now, as if its interval had passed;
    how many. An asyncio loop keeps its timers in a heap ordered by due time (``_scheduled``)."""
    import heapq

    known = {id(h) for h in old}  # ``old`` keeps those handles alive, so no id is reused meanwhile
    now = loop.time()
    moved = 0
    for h in loop_timers(loop):
        if id(h) not in known and h.when() > now:
            h._when = now  # noqa: SLF001
            moved += 1
    if moved:
        heapq.heapify(loop._scheduled)  # noqa: SLF001
    return moved
