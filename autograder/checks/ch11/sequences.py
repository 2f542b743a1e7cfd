"""Chapter 11's ``send_message`` check: per-conversation sequence numbers across two replicas.

The check holds a chat INSERT inside PostgreSQL (the rig's ``hold:`` trigger waits on an
advisory lock the check owns), or takes ``SHARE`` on ``chat_messages`` so that every sender has
read before any can insert, and takes it again for every later round (a sender that retries
after a duplicate key reads again before any of that round inserts: :func:`_in_rounds`).
"""

from __future__ import annotations

import asyncio
import time

import psycopg

from autograder.checks.ch11.common import REPLICAS
from autograder.checks.ch11.common import attempt as _try
from autograder.checks.ch11.common import attempt_value as _try_value
from autograder.checks.ch11.common import outcome as _outcome
from autograder.checks.ch11.common import settle as _settle
from autograder.harness import Report, task
from autograder.probes import SETTLE_LIMIT, label, tally
from course.chapters.ch11 import rig
from course.kit import lab
from course.kit.lab import LOCK_WAITERS


async def _seqs(pool, conversation: str) -> list[tuple[int, str]]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT seq, body FROM chat_messages WHERE conversation_id = %s ORDER BY seq", (conversation,)
        )
        return [(int(s), b) for s, b in await cur.fetchall()]


def _gapless(rows) -> bool:
    return [s for s, _ in rows] == list(range(1, len(rows) + 1))


SHARE = "LOCK TABLE chat_messages IN SHARE MODE"


async def _quiet(watcher, tasks: list[asyncio.Task], lockers: list[int]) -> bool:
    """Until every task still running waits on a PostgreSQL lock (the check's own sessions
    ``lockers`` not counted) or all are done; False after SETTLE_LIMIT s of real time."""
    deadline = time.monotonic() + SETTLE_LIMIT
    while True:
        await asyncio.sleep(0.002)
        left = sum(not t.done() for t in tasks)
        if not left:
            return True
        cur = await watcher.execute(LOCK_WAITERS + " AND l.pid <> ALL(%s)", (lockers,))
        if (await cur.fetchone())[0] >= left:
            return True
        if time.monotonic() > deadline:
            return False


async def _take_share(conn) -> None:
    await conn.execute("BEGIN")
    await conn.execute(f"SET LOCAL lock_timeout = '{int(SETTLE_LIMIT * 1000)}ms'")
    await conn.execute(SHARE)


async def _share_asked(watcher, pid: int) -> bool:
    cur = await watcher.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'relation' AND mode = 'ShareLock'", (pid,)
    )
    return (await cur.fetchone())[0] > 0


async def _in_rounds(n: int, watcher, database_url: str, make_call) -> tuple[list, str | None]:
    """``make_call(i)`` for ``i < n``, all at once, in rounds the check forces; the results in
    call order and, when the rounds could not be forced, why.

    The check holds ``SHARE`` on ``chat_messages`` (every INSERT waits on it) until every caller
    still running waits on a PostgreSQL lock: all of them have read before any inserts. Before
    it lets them go, a second session of the check asks for ``SHARE`` again; that request queues
    behind the callers' INSERTs, which PostgreSQL grants at the release, and ahead of any INSERT
    asked for later. So the callers let go insert, and one that comes back for another try (a
    retry after a duplicate key) reads and then waits for the next round, whatever the scheduler
    does: every round, and so every outcome, is the same on every run."""
    conns = [await psycopg.AsyncConnection.connect(database_url, autocommit=True) for _ in range(2)]
    pids = [c.info.backend_pid for c in conns]
    held, spare = conns
    why = None
    tasks: list[asyncio.Task] = []
    try:
        await held.execute("BEGIN")
        await held.execute(SHARE)
        tasks = [asyncio.create_task(make_call(i)) for i in range(n)]
        while not all(t.done() for t in tasks):
            if not await _quiet(watcher, tasks, pids):
                why = (
                    f"the senders did not settle within {SETTLE_LIMIT:g} s of real time: some waited outside "
                    "PostgreSQL (an asyncio.Lock kept in one process, which the other replica never sees)"
                )
                break
            if all(t.done() for t in tasks):
                break
            take = asyncio.create_task(_take_share(spare))
            while not take.done() and not await _share_asked(watcher, spare.info.backend_pid):
                await asyncio.sleep(0.002)
            await held.execute("COMMIT")
            try:
                await take
            except psycopg.Error:  # lock_timeout, or a deadlock's victim: the rest runs unforced
                await spare.execute("ROLLBACK")
                why = (
                    f"a round of senders did not finish its inserts within {SETTLE_LIMIT:g} s of real time; "
                    "the later rounds ran unforced"
                )
                break
            held, spare = spare, held
    finally:
        for conn in conns:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await conn.execute("ROLLBACK")
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for conn in conns:
            await conn.close()
    return results, why


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

    # --- ten concurrent senders, every one past its reads before any may insert, round after round ----
    r.note("10 concurrent sends to conversation race, alternating between two replicas; the check holds")
    r.note("SHARE on chat_messages until every sender still running waits on a lock, then lets them insert")
    r.note("and takes SHARE again: in every round (retries too) all have read before any inserts")
    results, unforced = await _in_rounds(
        10, watcher, ns.database_url, lambda i: replicas[i % REPLICAS](pool, "race", f"u{i}", f"m{i}")
    )
    if unforced:
        r.note(unforced)
    rows = await _seqs(pool, "race")
    errors = [x for x in results if isinstance(x, BaseException)]
    returned = sorted(x for x in results if not isinstance(x, BaseException))
    by_body = {b: s for s, b in rows}
    matches = all(by_body.get(f"m{i}") == x for i, x in enumerate(results) if not isinstance(x, BaseException))
    ok = not errors and returned == list(range(1, 11)) and _gapless(rows) and len(rows) == 10 and matches
    if unforced:
        seen = (
            "some raised or repeated a number (how many varies: the senders the check could not hold raced "
            "as the scheduler let them)"
        )
    else:
        # What went wrong, not how often: how many senders read before another's write also depends on
        # the answer's own waits (an INSERT ... ON CONFLICT that waits on another sender's uncommitted
        # update of the conversation's row before it reads), which the check cannot order.
        kinds = sorted({label(x, "a number") for x in results if isinstance(x, BaseException)})
        bad = []
        if kinds:
            bad.append("some raised " + " / ".join(kinds))
        if len(set(returned)) < len(returned):
            bad.append("some returned the same number")
        if not (_gapless(rows) and len(rows) == len(results)):
            bad.append("the stored seqs are not 1..10")
        elif not matches:
            bad.append("a returned number is stored with another sender's message")
        seen = "; ".join(bad) or "the numbers returned were not 1..10"
    if any(_row_race(x) for x in errors):
        r.fail(
            "10 concurrent sends to a new conversation on two replicas: some raised UniqueViolation on "
            "chat_conversations' primary key. The first senders each looked for the conversation's counter row, "
            "found none (SELECT ... FOR UPDATE locks no row that does not exist yet) and inserted one; every "
            "INSERT but the first was refused. Create the row and take the number in one statement: INSERT INTO "
            "chat_conversations ... ON CONFLICT (id) DO UPDATE SET last_seq = last_seq + 1 RETURNING last_seq "
            "(or INSERT ... ON CONFLICT DO NOTHING, then UPDATE ... RETURNING)"
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
    if failed is None and nxt == 2 and [s for s, _ in rows] == [1, 2]:
        r.fail(
            "message 1, then a send the database refused: send_message returned normally, as if the message were "
            "stored (no number was used up: the next one got 2). Let the error reach the caller: a client told "
            "that its message was sent never sends it again"
        )
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
    # Which of the two gets 2 is the design's choice (a counter row gives it to the held send, max + 1
    # with a retry to the other one); the text asks for unique, gap-free numbers, each with its message.
    stored = {b: s for s, b in rows}
    r.expect(
        (held_seq, second_seq) in ((2, 3), (3, 2))
        and [s for s, _ in rows] == [1, 2, 3]
        and stored.get("hold: stuck in its insert") == held_seq
        and stored.get("second") == second_seq,
        "after the release: the held send and the other replica's got 2 and 3, each stored with its message",
        f"after the release: the held send returned {held_seq!r}, the other replica's {second_seq!r}; stored "
        f"{[(s, b) for s, b in rows]}; expected 2 and 3 in either order, each stored with its own message, "
        "and seqs [1, 2, 3]",
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
        f"24 concurrent sends to 4 conversations ({tally(sorted(results, key=lambda x: label(x, 'a number')), ok='a number')}): "
        + "; ".join(bad[:2]),
    )


def _row_race(err: BaseException) -> bool:
    """A duplicate key on the conversations table: two senders both created the counter row."""
    if not isinstance(err, psycopg.errors.UniqueViolation):
        return False
    diag = getattr(err, "diag", None)
    return getattr(diag, "table_name", None) == "chat_conversations" or "chat_conversations_pkey" in str(err)


def _shown(values: list) -> str:
    """``values``, or their size when they are timestamps (which differ on every run)."""
    if all(isinstance(v, int) and abs(v) < 10**6 for v in values):
        return str(values)
    return f"{len(values)} numbers of {len(str(max(values, key=lambda v: len(str(v)))))} digits"
