"""Hidden checks of chapter 11: ``view_counter`` and ``send_message``.

Both run as two replicas of the learner's answer (``r.replicas``). Races are forced, never
left to timing: the check holds a ``view_counts`` row (``SELECT ... FOR UPDATE`` in an open
transaction) until every flush it started is waiting on it, holds a chat INSERT inside
PostgreSQL (the rig's ``hold:`` trigger waits on an advisory lock the check owns), or takes
``SHARE`` on ``chat_messages`` so that every sender has read before any can insert. A
failed flush is a one-shot trigger on the N-th row written (:mod:`course.chapters.ch11.rig`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import psycopg

from autograder.harness import Report, error_line, task
from autograder.probes import SETTLE_LIMIT, Crowd, tally
from course.chapters.ch11 import rig
from course.kit import lab
from course.kit.lab import LOCK_WAITERS

try:  # issue 28's interface; written to it even before autograder/rules.py is in the tree
    from autograder.rules import Rule
except ImportError:  # pragma: no cover - until the grader-rules branch is merged
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Rule:  # type: ignore[no-redef]
        text: str
        check: str
        wrong: str | None = None
        not_graded: bool = False


REPLICAS = 2


async def _waiters(watcher) -> int:
    cur = await watcher.execute(LOCK_WAITERS)
    return (await cur.fetchone())[0]


async def _settle(watcher, tasks: list[asyncio.Task], waiting: int) -> bool:
    """Until ``waiting`` sessions wait on a PostgreSQL lock or every task is done; False on a stall."""
    deadline = time.monotonic() + SETTLE_LIMIT
    while True:
        await asyncio.sleep(0.002)
        if all(t.done() for t in tasks):
            return True
        if await _waiters(watcher) >= waiting:
            return True
        if time.monotonic() > deadline:
            return False


async def _outcome(t: asyncio.Task):
    try:
        return await t
    except Exception as err:  # noqa: BLE001 - learner code may raise anything; reported
        return err


# ============================================================================= view_counter


async def _counts(pool) -> dict[str, int]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT item_id, views FROM view_counts ORDER BY item_id")
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


async def _try(call):
    try:
        await call
        return None
    except Exception as err:  # noqa: BLE001 - reported
        return err


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
    c = ViewCounter(pool, max_views=10)
    for item in ["a"] * 6 + ["b"] * 3:
        await c.view(item)
        want[item] += 1
    early = await _counts(pool)
    r.expect(
        not early,
        "9 views with max_views=10: nothing written yet (they wait in the buffer)",
        f"9 views with max_views=10: view_counts already holds {early}. Write nothing until max_views views "
        "are buffered (or flush() is called): one write per view is the design this task replaces",
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
    for item in "aac":
        await c.view(item)
        want[item] += 1
    await c.close()
    got = await _counts(pool)
    r.expect(
        got == dict(want),
        "3 more views, then close(): every view is in view_counts",
        f"3 more views, then close(): view_counts holds {got}, expected {dict(want)} ({_verdict(got, want)}). "
        "A graceful shutdown must flush the buffer",
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
        for _ in range(20):
            await asyncio.sleep(0)
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
        flushes = [asyncio.create_task(_try(x.flush())) for x in (a, b)]
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


# ============================================================================= send_message


async def _seqs(pool, conversation: str) -> list[tuple[int, str]]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT seq, body FROM chat_messages WHERE conversation_id = %s ORDER BY seq", (conversation,)
        )
        return [(int(s), b) for s, b in await cur.fetchall()]


def _gapless(rows) -> bool:
    return [s for s, _ in rows] == list(range(1, len(rows) + 1))


@task("send_message", points=6, title="per-conversation sequence numbers across two replicas", timeout=60, seed=1102)
async def check_send_message(r: Report, send_message) -> None:
    async with lab.scratch("ch11") as ns:
        pool = await ns.pool(max_size=16)
        await rig.install(pool)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            await _check_send_message(r, send_message, pool, watcher, ns)
        finally:
            await watcher.close()


async def _check_send_message(r: Report, send_message, pool, watcher, ns) -> None:
    got = [await send_message(pool, "c-1", "ada", f"hello {i}") for i in range(1, 4)]
    r.expect(
        got == [1, 2, 3],
        "3 messages in conversation c-1 returned 1, 2, 3",
        f"3 messages in a new conversation returned {_shown(got)}, expected [1, 2, 3]: the numbers count the "
        "conversation's messages from 1, with no gaps (a timestamp or a global id is not a sequence number)",
    )
    other = await send_message(pool, "c-2", "bob", "hi")
    r.expect(
        other == 1,
        "the first message of conversation c-2 returned 1",
        f"the first message of conversation c-2 returned {other!r}, expected 1: numbers are per conversation",
    )
    rows = await _seqs(pool, "c-1")
    r.expect(
        rows == [(1, "hello 1"), (2, "hello 2"), (3, "hello 3")],
        "chat_messages holds them with those numbers",
        f"chat_messages holds {rows} for c-1, expected [(1, 'hello 1'), (2, 'hello 2'), (3, 'hello 3')]",
    )
    if r.public:
        return

    replicas = r.replicas("send_message", REPLICAS)

    # --- ten concurrent senders, every one past its reads before any may insert --------------------
    r.note("10 concurrent sends to conversation race, alternating between two replicas; the check holds")
    r.note("SHARE on chat_messages until every sender is waiting on a lock, so all have read before any inserts")
    locker = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    try:
        await locker.execute("BEGIN")
        await locker.execute("LOCK TABLE chat_messages IN SHARE MODE")

        async def release() -> None:
            await locker.execute("COMMIT")

        crowd = Crowd(10, watcher, on_settled=release)
        results = await crowd.run(lambda i: replicas[i % REPLICAS](pool, "race", f"u{i}", f"m{i}"))
        if not crowd.released:
            await locker.execute("COMMIT")
    finally:
        await locker.close()
    if crowd.stalls:
        r.note(
            f"the senders did not settle within {SETTLE_LIMIT:g} s of real time: some waited outside PostgreSQL "
            "(an asyncio.Lock kept in one process, which the other replica never sees)"
        )
    rows = await _seqs(pool, "race")
    errors = [x for x in results if isinstance(x, BaseException)]
    returned = sorted(x for x in results if not isinstance(x, BaseException))
    by_body = {b: s for s, b in rows}
    matches = all(by_body.get(f"m{i}") == x for i, x in enumerate(results) if not isinstance(x, BaseException))
    ok = not errors and returned == list(range(1, 11)) and _gapless(rows) and len(rows) == 10 and matches
    seen = (
        "some raised or repeated a number (how many varies: the senders that waited in the process raced "
        "after the release)"
        if crowd.stalls
        else f"{tally(results, ok='a number')}; returned {returned}; stored seqs {[s for s, _ in rows]}"
    )
    r.expect(
        ok,
        "10 concurrent sends on two replicas: numbers 1..10, each once, each stored with its message",
        f"10 concurrent sends on two replicas: {seen}. Senders that read max(seq) (or a counter) before any of them wrote all "
        "picked the same number; a lock held in one process does not stop the other replica. Take the "
        "number with one statement that locks the conversation's counter row (UPDATE ... RETURNING), in the "
        "transaction that inserts the message",
    )

    # --- a refused insert uses up no number --------------------------------------------------------
    await send_message(pool, "gap", "ada", "one")
    failed = await _try(replicas[0](pool, "gap", "ada", "reject: the database refuses this one"))
    nxt = await _try_value(replicas[1](pool, "gap", "ada", "two"))
    rows = await _seqs(pool, "gap")
    r.expect(
        failed is not None and nxt == 2 and [s for s, _ in rows] == [1, 2],
        "a send the database refused used up no number: the next message got 2",
        f"message 1, then a send the database refused ({'raised' if failed else 'returned normally'}), then "
        f"another: it got {nxt!r}, stored seqs {[s for s, _ in rows]}; expected 2 and [1, 2]. The refused "
        "send used up a number that nobody will ever store (a gap clients wait for forever): take the number "
        "in the transaction that inserts the message, so a rollback gives it back",
    )

    # --- a held send: other conversations go on, this one never shows a hole ------------------------
    await send_message(pool, "held", "ada", "first")
    locker = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    try:
        await locker.execute("SELECT pg_advisory_lock(%s)", (rig.HOLD_LOCK,))
        held = asyncio.create_task(replicas[0](pool, "held", "ada", "hold: stuck in its insert"))
        await _settle(watcher, [held], 1)
        r.note("a send to conversation held is held by the check inside its INSERT; meanwhile the same")
        r.note("replica sends to conversation free, and the other replica sends to held")
        free = asyncio.create_task(replicas[0](pool, "free", "bob", "not blocked"))
        await _settle(watcher, [free], 2)
        free_done = free.done()
        if not free_done:
            await locker.execute("SELECT pg_advisory_unlock(%s)", (rig.HOLD_LOCK,))
            await asyncio.gather(held, free, return_exceptions=True)
            r.fail(
                "a send to conversation free did not finish while a send to conversation held was in progress: "
                "one lock serialises every conversation (a LOCK TABLE, one counter row or advisory lock for "
                "all, or a lock in the process). Lock only the conversation's own counter row"
            )
        free_seq = await _outcome(free)
        second = asyncio.create_task(replicas[1](pool, "held", "bob", "second"))
        await _settle(watcher, [second], 2)
        visible = await _seqs(pool, "held")
        await locker.execute("SELECT pg_advisory_unlock(%s)", (rig.HOLD_LOCK,))
    finally:
        await locker.close()
    held_seq, second_seq = await _outcome(held), await _outcome(second)
    r.expect(
        free_seq == 1,
        "conversation free went on while held was held: its first message got 1",
        f"conversation free's first message returned {free_seq!r}, expected 1",
    )
    r.expect(
        _gapless(visible),
        f"while message 2 of held was uncommitted, readers saw seqs {[s for s, _ in visible]} (no hole)",
        f"while message 2 of conversation held was still uncommitted, another send committed: readers saw seqs "
        f"{[s for s, _ in visible]}, a hole a client takes for a lost message. A sequence or a counter "
        "taken outside the message's transaction hands out 3 before 2 is stored: take the number by "
        "locking the conversation's counter row in the transaction that inserts the message",
    )
    rows = await _seqs(pool, "held")
    r.expect(
        held_seq == 2 and second_seq == 3 and [s for s, _ in rows] == [1, 2, 3],
        "after the release: the held send got 2, the other replica's send 3",
        f"after the release: the held send returned {held_seq!r}, the other replica's {second_seq!r}; stored "
        f"seqs {[s for s, _ in rows]}; expected 2, 3 and [1, 2, 3]",
    )

    # --- many conversations at once ------------------------------------------------------------------
    convs = [f"room-{k}" for k in range(4)]
    plan = [(convs[r.random.randrange(4)], i) for i in range(24)]
    r.note("24 sends to 4 new conversations at once, alternating between the replicas")
    results = await asyncio.gather(
        *(replicas[i % REPLICAS](pool, conv, "u", f"p{i}") for conv, i in plan), return_exceptions=True
    )
    bad = []
    for conv in convs:
        rows = await _seqs(pool, conv)
        mine = sorted(
            x for (c, _), x in zip(plan, results, strict=True) if c == conv and not isinstance(x, BaseException)
        )
        n = sum(1 for c, _ in plan if c == conv)
        if not (_gapless(rows) and len(rows) == n and mine == list(range(1, n + 1))):
            bad.append(f"{conv}: {n} sends returned {mine}, stored {[s for s, _ in rows]}")
    r.expect(
        not bad,
        "each conversation numbered its own messages 1..n, gap-free",
        f"24 concurrent sends to 4 conversations ({tally(results, ok='a number')}): " + "; ".join(bad[:2]),
    )


def _shown(values: list) -> str:
    """``values``, or their size when they are timestamps (which differ on every run)."""
    if all(isinstance(v, int) and abs(v) < 10**6 for v in values):
        return str(values)
    return f"{len(values)} numbers of {len(str(max(values, key=lambda v: len(str(v)))))} digits"


async def _try_value(call):
    try:
        return await call
    except Exception as err:  # noqa: BLE001 - reported
        return err


# ============================================================================= issue 28's tables

RULES: dict[str, list[Rule]] = {
    "view_counter": [
        Rule(
            "Nothing is written to the database until max_views views are buffered",
            "check_view_counter: 9 views with max_views=10 must leave view_counts empty",
            wrong="one UPDATE per view",
        ),
        Rule(
            "The view that fills the buffer to max_views flushes it",
            "check_view_counter: the 10th view must put all 10 in view_counts without a flush() call",
            wrong="flushes only on close",
        ),
        Rule(
            "close() is the graceful shutdown: it flushes everything still buffered",
            "check_view_counter: views after the last flush must be in view_counts after close()",
            wrong="close drops the buffer",
        ),
        Rule(
            "Views that arrive while a flush is writing are not lost",
            "check_view_counter: holds v1's row during a flush and adds 15 views meanwhile",
            wrong="clear after the write",
        ),
        Rule(
            "Two replicas flushing the same item at the same time must both count",
            "check_view_counter: holds v2's row until both replicas' flushes wait on it, then compares totals",
            wrong="read, then write the total",
        ),
        Rule(
            "A flush the database refuses keeps its views",
            "check_view_counter: the 2nd row of a flush fails once; the retry must count each view once",
            wrong="drop the batch on failure",
        ),
        Rule(
            "commits all of it or nothing",
            "check_view_counter: a flush whose 2nd row fails must not count the 1st row twice on retry",
            wrong="item by item, all put back",
        ),
        Rule(
            "at most one row per item per flush",
            "check_view_counter: counts rows written (a trigger and a sequence) for 860 views on two replicas",
            wrong="a +1 per buffered view in the flush",
        ),
        Rule(
            "the batched counter of this chapter",
            "check_view_counter: counts rows written (a trigger and a sequence) for 860 views on two replicas",
            wrong="one UPDATE per view",
        ),
        Rule(
            "adding to what is there",
            "check_view_counter: holds v2's row until both replicas' flushes wait on it, then compares totals",
            wrong="read, then write the total",
        ),
        Rule(
            "the checks call it directly",
            "check_view_counter: calls flush() while holding v1's row and adds views meanwhile",
            wrong="clear after the write",
        ),
        Rule(
            "What must hold, and what the hidden checks do to see it",
            "check_view_counter: the list below it, each rule with its own row here",
            wrong="read, then write the total",
        ),
        Rule(
            "so both flushes are waiting on it when it is released",
            "check_view_counter: holds v2's row until both replicas' flushes wait on it, then compares totals",
            wrong="read, then write the total",
        ),
    ],
    "send_message": [
        Rule(
            "The first message of a conversation gets 1",
            "check_send_message: 3 sends to a new conversation must return 1, 2, 3",
            wrong="timestamp as order",
        ),
        Rule(
            "numbers are per conversation",
            "check_send_message: a second conversation's first message must return 1",
            wrong="one global sequence",
        ),
        Rule(
            "under concurrent senders on two replicas",
            "check_send_message: 10 senders held under SHARE on chat_messages until all have read",
            wrong="max(seq) + 1 without a lock",
        ),
        Rule(
            "A send that fails uses up no number",
            "check_send_message: a refused INSERT, then the next send must get the next number",
            wrong="separate counter statement",
        ),
        Rule(
            "never sees a hole",
            "check_send_message: holds message 2 in its INSERT and reads committed seqs while another send runs",
            wrong="counter committed before the message",
        ),
        Rule(
            "A send to another conversation is never blocked",
            "check_send_message: a send to another conversation must finish while one is held",
            wrong="one lock for all conversations",
        ),
        Rule(
            "return its sequence number within its conversation",
            "check_send_message: a second conversation's first message must return 1",
            wrong="one global sequence",
        ),
        Rule(
            "The check sends 10 messages to one conversation at once",
            "check_send_message: 10 senders held under SHARE on chat_messages until all have read",
            wrong="max(seq) + 1 without a lock",
        ),
        Rule(
            "let the error reach the caller; the next message must get the next number",
            "check_send_message: a refused INSERT, then the next send must get the next number",
            wrong="separate counter statement",
        ),
        Rule(
            "3 must not be committed while 2 is not",
            "check_send_message: holds message 2 in its INSERT and reads committed seqs while another send runs",
            wrong="counter committed before the message",
        ),
        Rule(
            "the same replica sends to another conversation, which must finish",
            "check_send_message: a send to another conversation must finish while one is held",
            wrong="one lock for all conversations",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {
    "view_counter": ["course.counters:BatchedCounter"],
    "send_message": ["course.chat:send_message"],
}
