"""Chapter 11's ``view_counter`` check: a batched view counter shared by two replicas.

The check holds a ``view_counts`` row (``SELECT ... FOR UPDATE`` in an open transaction) until
every flush it started is waiting on it; a failed flush is a one-shot trigger on the N-th row
written (:mod:`course.chapters.ch11.rig`). A timer the answer leaves running (a ticker started in
``__init__``, a delayed flush) is fired at once, however long its interval (:func:`_fire_timers`):
a grading run is far shorter than any real interval, so waiting for it would prove nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import psycopg

from autograder.checks.ch11.common import REPLICAS
from autograder.checks.ch11.common import attempt as _try
from autograder.checks.ch11.common import settle as _settle
from autograder.harness import Report, error_line, task
from autograder.probes import SETTLE_LIMIT, AnswerLoop
from autograder.probes import settled as until_idle
from course.chapters.ch11 import rig
from course.kit import lab

TIMER_WAIT = 0.5  # real seconds a fired timer's flush may take to reach view_counts


async def _counts(pool) -> dict[str, int]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT item_id, views FROM view_counts ORDER BY item_id")
        return {k: int(v) for k, v in await cur.fetchall()}


async def _counts_seen(watcher) -> dict[str, int]:
    cur = await watcher.execute("SELECT item_id, views FROM view_counts ORDER BY item_id")
    return {k: int(v) for k, v in await cur.fetchall()}


def _diff(got: dict, want: dict) -> str:
    keys = sorted(set(got) | set(want))
    parts = [f"{k}: {got.get(k, 0)} (expected {want.get(k, 0)})" for k in keys if got.get(k, 0) != want.get(k, 0)]
    return ", ".join(parts[:4])


def _verdict(got: dict, want: dict) -> str:
    more = sum(max(0, got.get(k, 0) - v) for k, v in want.items()) + sum(v for k, v in got.items() if k not in want)
    less = sum(max(0, v - got.get(k, 0)) for k, v in want.items())
    if more and not less:
        return f"{more} view(s) counted twice"
    if less and not more:
        return f"{less} view(s) lost"
    return f"{less} view(s) lost and {more} counted twice"


async def _rows_now(watcher) -> int:
    cur = await watcher.execute("SELECT count(*) FROM view_counts")
    return (await cur.fetchone())[0]


async def _after_timers(answer: AnswerLoop, old, watcher) -> bool:
    """Fire the timers the answer left running since ``old`` (a ticker's sleep, a delayed flush),
    again for the ones they set next, until view_counts has a row or TIMER_WAIT s of real time
    have passed; True if a row was written. Nothing to wait for when the answer left no timer."""
    await until_idle()  # let a task made in __init__ or view() run up to its first wait
    if not answer.fire(old):
        return False
    deadline = time.monotonic() + TIMER_WAIT
    while time.monotonic() < deadline:
        await asyncio.sleep(0.005)
        if await _rows_now(watcher):
            return True
        answer.fire(old)
    return bool(await _rows_now(watcher))


@task(
    "view_counter",
    points=6,
    title="a batched view counter shared by two replicas",
    needs=("ViewCounter",),
    timeout=60,
    seed=1101,
)
async def check_view_counter(r: Report, ViewCounter) -> None:
    async with lab.scratch("ch11") as ns:
        pool = await ns.pool(max_size=12)
        await rig.install(pool)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            await _check_view_counter(r, ViewCounter, pool, watcher, ns)
        finally:
            await watcher.close()


async def _check_view_counter(r: Report, ViewCounter, pool, watcher, ns) -> None:
    want: Counter[str] = Counter()
    answer = AnswerLoop(r)
    old = answer.mark()
    c = ViewCounter(pool, max_views=10)
    for item in ["a"] * 6 + ["b"] * 3:
        await c.view(item)
        want[item] += 1
    r.note("9 views with max_views=10; then every timer the counter left running (a ticker, a delayed")
    r.note("flush) is fired at once, as if its interval had passed, however long that interval is")
    early = await _counts_seen(watcher)  # not through the pool: the check leaves no timer of its own
    running = answer.left_running(old)
    if early and not running:
        r.fail(
            f"9 views with max_views=10: view_counts already holds {early}. Write nothing until max_views views "
            "are buffered (or flush() is called): one write per view is the design this task replaces"
        )
    timed = bool(early) or await _after_timers(answer, old, watcher)
    r.expect(
        not timed,
        "nothing written, even after those timers went off: the 9 views wait in the buffer",
        "9 views with max_views=10: a timer or task the counter started itself wrote to view_counts. Write "
        "nothing until max_views views are buffered (or flush() is called): the ticker that calls flush() "
        "every N ms belongs to the service, not to ViewCounter",
    )
    await c.view("b")
    want["b"] += 1
    got = await _counts(pool)
    r.expect(
        got == dict(want),
        "the 10th view flushed: view_counts holds {'a': 6, 'b': 4}",
        f"after the 10th view (max_views=10), view_counts holds {got}, expected {dict(want)}: view() must "
        "flush once max_views views are buffered",
    )
    before_close = dict(want)
    for item in "aac":
        await c.view(item)
        want[item] += 1
    await c.close()
    got = await _counts(pool)
    last = Counter("aac")
    overwrote = (
        got != dict(want) and all(got.get(k) == n for k, n in last.items()) and any(before_close.get(k) for k in last)
    )
    r.expect(
        got == dict(want),
        "3 more views, then close(): every view is in view_counts",
        f"3 more views, then close(): view_counts holds {got}, expected {dict(want)} ({_verdict(got, want)}). "
        + (
            "The last flush set each total to that flush's own count instead of adding it: a flush writes "
            "deltas, so the upsert adds them (ON CONFLICT (item_id) DO UPDATE SET views = view_counts.views + "
            "EXCLUDED.views)"
            if overwrote
            else "A graceful shutdown must flush the buffer"
        ),
    )
    if r.public:
        return

    # --- two replicas, many views: exact totals, bounded writes ----------------------------------
    a, b = (R(pool, max_views=100) for R in r.replicas("ViewCounter", REPLICAS))
    items = ["v1", "v2", "v3", "v4"]
    before = await rig.view_writes(pool)
    r.note("860 views of 4 items, alternating between two replicas (max_views=100), then close() on both")
    for i in range(860):
        item = items[r.random.randrange(4)]
        await (a, b)[i % 2].view(item)
        want[item] += 1
    for replica in (a, b):
        await replica.close()
    writes = await rig.view_writes(pool) - before
    got = await _counts(pool)
    r.expect(
        got == dict(want),
        "after both replicas closed, every view was counted exactly once",
        f"two replicas, 860 views, both closed: {_diff(got, want)}; {_verdict(got, want)}. Add each flush's "
        "deltas in one statement (views = views + EXCLUDED.views), which both replicas can do at once",
    )
    bound = REPLICAS * (430 // 100 + 1) * len(items)
    r.expect(
        writes <= bound,
        f"{writes} rows written for 860 views (at most {bound}: one per item per flush)",
        f"{writes} rows written to view_counts for 860 views, expected at most {bound} (one per item per "
        "flush, a flush every 100 views): the views are not batched",
    )

    # --- views while a flush is waiting on the database ------------------------------------------
    a = r.replicas("ViewCounter", 1)[0](pool, max_views=100)
    for item in ["v1"] * 20 + ["v2"] * 10:
        await a.view(item)
        want[item] += 1
    r.note("30 views buffered; the check holds the row of v1 and calls flush(); 15 more views arrive while")
    r.note("that flush waits on the database; then the row is released and the replica closed")
    locker = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    try:
        await locker.execute("BEGIN")
        await locker.execute("SELECT 1 FROM view_counts WHERE item_id = 'v1' FOR UPDATE")
        flush = asyncio.create_task(_try(a.flush()))
        settled = await _settle(watcher, [flush], 1)
        if flush.done():
            r.note("that flush returned without waiting for v1's row (it did not write v1)")
        elif not settled:
            r.note(f"that flush did not reach PostgreSQL within {SETTLE_LIMIT:g} s; going on")
        late = [asyncio.create_task(_try(a.view(item))) for item in ["v1"] * 10 + ["v3"] * 5]
        await until_idle()  # the late views run up to where they wait
        want.update(["v1"] * 10 + ["v3"] * 5)
        await locker.execute("COMMIT")
    finally:
        await locker.close()
    errors = [e for e in [await flush, *[await t for t in late]] if e is not None]
    if errors:
        r.note(f"raised meanwhile: {', '.join(sorted({error_line(e, 80) for e in errors}))}")
    await _try(a.close())
    got = await _counts(pool)
    r.expect(
        got == dict(want),
        "the 15 views that arrived during the flush were counted too",
        f"views that arrived while a flush was writing: {_diff(got, want)}; {_verdict(got, want)}. The flush "
        "cleared (or overwrote) the buffer after its write, dropping what came in meanwhile: take the buffer "
        "out (swap in an empty one) before the write",
    )

    # --- two replicas flush one row at once ------------------------------------------------------
    a, b = (R(pool, max_views=100) for R in r.replicas("ViewCounter", REPLICAS))
    for replica, n in ((a, 7), (b, 11)):
        for _ in range(n):
            await replica.view("v2")
            want["v2"] += 1
    r.note("replica 1 holds 7 views of v2, replica 2 holds 11; both flush while the check holds v2's row")
    locker = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    try:
        await locker.execute("BEGIN")
        await locker.execute("SELECT 1 FROM view_counts WHERE item_id = 'v2' FOR UPDATE")
        # one after the other into the row's lock queue (replica 1 first), so the same flush comes second
        # on every run: a lost update then loses the same replica's views, and the feedback says one number
        flushes = [asyncio.create_task(_try(a.flush()))]
        await _settle(watcher, flushes, 1)
        flushes.append(asyncio.create_task(_try(b.flush())))
        await _settle(watcher, flushes, 2)
        await locker.execute("COMMIT")
    finally:
        await locker.close()
    for f in flushes:
        await f
    for replica in (a, b):
        await _try(replica.close())
    got = await _counts(pool)
    r.expect(
        got == dict(want),
        f"two flushes of one row at once: both counted (v2 = {want['v2']})",
        f"two replicas flushed v2 at once: {_diff(got, want)}; {_verdict(got, want)}. Reading the total and "
        "writing total + delta loses one replica's flush (a lost update): add in the database, "
        "views = views + delta",
    )

    # --- a flush the database refuses once --------------------------------------------------------
    a = r.replicas("ViewCounter", 1)[0](pool, max_views=100)
    for item in ["f1"] * 4 + ["f2"] * 5 + ["f3"] * 6:
        await a.view(item)
        want[item] += 1
    await rig.fail_view_write(pool, 2)
    r.note("15 views of f1, f2, f3 buffered; the database refuses the 2nd row that flush() writes, once;")
    r.note("then flush() is called again and the replica closed")
    first = await _try(a.flush())
    r.note(f"the first flush {'raised ' + error_line(first, 90) if first else 'returned normally'}")
    await _try(a.flush())
    await _try(a.close())
    await rig.disarm(pool)
    got = await _counts(pool)
    if got != dict(want):
        more = any(got.get(k, 0) > v for k, v in want.items())
        r.fail(
            f"after one failed flush, a retry and close(): {_diff(got, want)}; {_verdict(got, want)}. "
            + (
                "Rows written before the failure were committed, then put back and written again: write a "
                "flush in one statement (or one transaction), so it commits all of it or nothing"
                if more
                else "The failed flush's views were dropped: put them back in the buffer when the write "
                "fails, so the next flush writes them"
            )
        )
    r.ok("a failed flush kept its views; the retry wrote each exactly once")
