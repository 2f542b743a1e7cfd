"""Chapter 05 grading: the wrong consumers and replays learners write are rejected, correct designs pass.

Each wrong answer is kept as source: the correct answer with one plausible change (so the
change, and nothing else, is what the check must catch), or written out whole when the
design itself is the mistake. The failures are injected per message and the kills at named
points (autograder/checks/ch05.py), so every verdict here is the same on every run.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_accepted, assert_rejected, run_source

HEADER = """
import asyncio
import random
import time

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call
"""

# ----------------------------------------------------------------------------- ordered_consumer: correct designs

LANES = (
    HEADER
    + """
async def ordered_consumer(pool, redis, handle, *, stream, group, consumer, dlq, policy, sleep, rand, clock, claim_idle_ms=60_000):
    async def apply(entry_id, fields):
        # one transaction: park if the key is blocked, else record the id and apply the change
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR SHARE", (stream, fields["key"])
            )
            if await cur.fetchone() is not None:
                await conn.execute(
                    "INSERT INTO mq_parked (stream, entry_id, key, fields) VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT DO NOTHING",
                    (stream, entry_id, fields["key"], Jsonb(fields)),
                )
                return
            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:  # a new message id: apply it
                await handle(conn, fields)

    async def process(entry_id, fields):
        state = RetryState()
        try:
            await retry_call(lambda: apply(entry_id, fields), policy, clock=clock, sleep=sleep, rand=rand, state=state)
        except Exception as err:  # permanent, or out of attempts: dead-letter it and block its key
            reason = "permanent" if state.gave_up == "not retryable" else "exhausted"
            entry = dlq_entry(
                fields,
                stream=stream,
                entry_id=entry_id,
                attempts=state.attempt,
                first_failed_at=state.first_failure_at,
                last_failed_at=state.last_failure_at,
                error=err,
                reason=reason,
            )
            dlq_id = await redis.xadd(dlq, entry)
            async with pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb(fields), reason),
                )
        await redis.xack(stream, group, entry_id)  # only after the commit

    waiting = {}  # key -> entries of that key not started yet, in stream order
    lanes = {}  # key -> the task working through them

    async def lane(key):
        while waiting[key]:
            entry_id, fields = waiting[key].pop(0)
            await process(entry_id, fields)
        del waiting[key], lanes[key]

    async with asyncio.TaskGroup() as tg:

        def dispatch(entries):
            for entry_id, fields in entries:
                waiting.setdefault(fields["key"], []).append((entry_id, fields))
                if fields["key"] not in lanes:
                    lanes[fields["key"]] = tg.create_task(lane(fields["key"]))

        cursor = "0-0"
        while True:  # first what a dead consumer left pending
            cursor, claimed, *_ = await redis.xautoclaim(stream, group, consumer, claim_idle_ms, cursor, count=100)
            dispatch(claimed)
            if cursor == "0-0":
                break
        while True:  # then new entries, until there are none and every lane is done
            reply = await redis.xreadgroup(group, consumer, {stream: ">"}, count=100)
            if reply:
                dispatch(reply[0][1])
            elif lanes:
                await asyncio.wait(list(lanes.values()), return_when=asyncio.FIRST_COMPLETED)
            else:
                break
"""
)


def patched(source: str, *changes: tuple[str, str]) -> str:
    """``source`` with each ``old`` replaced by ``new``; every ``old`` must be there."""
    for old, new in changes:
        assert old in source, f"patch target not found: {old!r}"
        source = source.replace(old, new)
    return source


QUEUES_OWN_BACKOFF = (
    HEADER
    + """
async def ordered_consumer(pool, redis, handle, *, stream, group, consumer, dlq, policy, sleep, rand, clock,
                           claim_idle_ms=60_000):
    # one asyncio.Queue and one worker per key; a hand-written retry loop; one entry per read; acks in a pipeline
    queues, workers = {}, []

    async def attempt(entry_id, fields):
        async with pool.connection() as conn:
            async with conn.transaction():
                cur = await conn.execute("SELECT count(*) FROM mq_blocked_keys WHERE stream = %s AND key = %s",
                                         (stream, fields["key"]))
                if (await cur.fetchone())[0]:
                    await conn.execute("INSERT INTO mq_parked (stream, entry_id, key, fields) "
                                       "VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                                       (stream, entry_id, fields["key"], Jsonb(fields)))
                    return
                cur = await conn.execute("SELECT 1 FROM mq_processed WHERE message_id = %s", (fields["id"],))
                if await cur.fetchone():
                    return
                await conn.execute("INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s)",
                                   (fields["id"], stream, entry_id))
                await handle(conn, fields)

    async def one(entry_id, fields):
        first = last = None
        for n in range(1, policy.max_attempts + 1):
            try:
                await attempt(entry_id, fields)
                break
            except Exception as err:
                last = clock()
                first = first if first is not None else last
                if not policy.retryable(err) or n == policy.max_attempts:
                    reason = "exhausted" if policy.retryable(err) else "permanent"
                    entry = {**fields, "source_stream": stream, "source_entry_id": entry_id, "attempts": str(n),
                             "first_failed_at": str(first), "last_failed_at": str(last), "error": str(err),
                             "error_type": type(err).__name__, "reason": reason}
                    dlq_id = await redis.xadd(dlq, entry)
                    async with pool.connection() as conn:
                        await conn.execute(
                            "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
                            "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                            (stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb(fields), reason))
                    break
                window = min(policy.backoff.cap, policy.backoff.base * 2 ** (n - 1))
                await sleep(rand() * window)
        pipe = redis.pipeline()
        pipe.xack(stream, group, entry_id)
        await pipe.execute()

    async def worker(q):
        while True:
            item = await q.get()
            try:
                if item is None:
                    return
                await one(*item)
            finally:
                q.task_done()

    def put(entry_id, fields):
        if fields["key"] not in queues:
            queues[fields["key"]] = asyncio.Queue()
            workers.append(asyncio.create_task(worker(queues[fields["key"]])))
        queues[fields["key"]].put_nowait((entry_id, fields))

    try:
        start = "0-0"
        while True:
            reply = await redis.xautoclaim(stream, group, consumer, claim_idle_ms, start, count=10)
            for entry_id, fields in reply[1]:
                put(entry_id, fields)
            start = reply[0]
            if start == "0-0":
                break
        while True:
            reply = await redis.xreadgroup(group, consumer, {stream: ">"}, count=1)
            if reply:
                for entry_id, fields in reply[0][1]:
                    put(entry_id, fields)
                continue
            busy = [q for q in queues.values() if q._unfinished_tasks]
            if not busy:
                break
            await asyncio.wait([asyncio.ensure_future(q.join()) for q in busy], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for q in queues.values():
            q.put_nowait(None)
        await asyncio.gather(*workers)
"""
)

LOCK_PER_KEY = patched(
    LANES,
    (
        """    waiting = {}  # key -> entries of that key not started yet, in stream order
    lanes = {}  # key -> the task working through them

    async def lane(key):
        while waiting[key]:
            entry_id, fields = waiting[key].pop(0)
            await process(entry_id, fields)
        del waiting[key], lanes[key]
""",
        """    locks = {}  # key -> an asyncio.Lock: waiters are served first come, first served
    lanes = {}  # one task per entry

    async def lane(entry_id, fields):
        async with locks.setdefault(fields["key"], asyncio.Lock()):
            await process(entry_id, fields)
        del lanes[entry_id]
""",
    ),
    (
        """                waiting.setdefault(fields["key"], []).append((entry_id, fields))
                if fields["key"] not in lanes:
                    lanes[fields["key"]] = tg.create_task(lane(fields["key"]))
""",
        """                lanes[entry_id] = tg.create_task(lane(entry_id, fields))
""",
    ),
)


HANDLER_TIMEOUT = patched(  # the handler under a timeout of its own: wait_for runs it in another task on 3.11
    LANES,
    (
        "                await handle(conn, fields)\n",
        "                await asyncio.wait_for(handle(conn, fields), 5)\n",
    ),
)


def test_05_ordered_consumer_stub_is_not_done():
    res = run_source(
        "ordered_consumer",
        HEADER
        + """
async def ordered_consumer(pool, redis, handle, *, stream, group, consumer, dlq, policy, sleep, rand, clock,
                           claim_idle_ms=60_000):
    raise NotImplementedError("not done yet")
""",
    )
    assert res.points == 0 and res.not_done, res.text()


# ----------------------------------------------------------------------------- ordered_consumer: wrong answers

ACK_BEFORE_WORK = patched(
    LANES,
    (
        "        state = RetryState()\n",
        "        await redis.xack(stream, group, entry_id)  # ack first\n        state = RetryState()\n",
    ),
    ("        await redis.xack(stream, group, entry_id)  # only after the commit\n", ""),
)

ACK_INSIDE_TRANSACTION = patched(
    LANES,
    (
        "                await handle(conn, fields)\n",
        "                await handle(conn, fields)\n                await redis.xack(stream, group, entry_id)\n",
    ),
)

IN_MEMORY_DEDUP = patched(
    LANES,
    (
        """            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:  # a new message id: apply it
                await handle(conn, fields)
""",
        """            if fields["id"] not in SEEN:  # a set in this process
                await handle(conn, fields)
        SEEN.add(fields["id"])
""",
    ),
    ("async def ordered_consumer(", "SEEN = set()\n\n\nasync def ordered_consumer("),
)

DEDUP_IN_ITS_OWN_COMMIT = patched(
    LANES,
    (
        """        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT 1 FROM mq_blocked_keys""",
        """        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT 1 FROM mq_blocked_keys""",
    ),
)

RETRY_QUEUE = patched(
    LANES,
    (
        """            await retry_call(lambda: apply(entry_id, fields), policy, clock=clock, sleep=sleep, rand=rand, state=state)
        except Exception as err:  # permanent, or out of attempts: dead-letter it and block its key
""",
        """            await apply(entry_id, fields)
        except Exception as err:
            tries = int(fields.get("tries", "1"))
            if policy.retryable(err) and tries < policy.max_attempts:  # to the back of the stream, try later
                await redis.xadd(stream, {**fields, "tries": str(tries + 1)})
                await redis.xack(stream, group, entry_id)
                return
            state.attempt, state.first_failure_at = tries, clock()
            state.last_failure_at = clock()
            state.gave_up = None if policy.retryable(err) else "not retryable"
""",
    ),
)

SERIAL = (
    HEADER
    + """
async def ordered_consumer(pool, redis, handle, *, stream, group, consumer, dlq, policy, sleep, rand, clock,
                           claim_idle_ms=60_000):
    # one message at a time, in stream order: simple, and every key waits for every other key
    async def apply(entry_id, fields):
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute("SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s",
                                     (stream, fields["key"]))
            if await cur.fetchone():
                await conn.execute("INSERT INTO mq_parked (stream, entry_id, key, fields) VALUES (%s, %s, %s, %s) "
                                   "ON CONFLICT DO NOTHING", (stream, entry_id, fields["key"], Jsonb(fields)))
                return
            cur = await conn.execute("INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                                     "ON CONFLICT DO NOTHING RETURNING 1", (fields["id"], stream, entry_id))
            if await cur.fetchone():
                await handle(conn, fields)

    async def process(entry_id, fields):
        state = RetryState()
        try:
            await retry_call(lambda: apply(entry_id, fields), policy, clock=clock, sleep=sleep, rand=rand, state=state)
        except Exception as err:
            reason = "permanent" if state.gave_up == "not retryable" else "exhausted"
            entry = dlq_entry(fields, stream=stream, entry_id=entry_id, attempts=state.attempt,
                              first_failed_at=state.first_failure_at, last_failed_at=state.last_failure_at,
                              error=err, reason=reason)
            dlq_id = await redis.xadd(dlq, entry)
            async with pool.connection() as conn:
                await conn.execute("INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, "
                                   "reason) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                                   (stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb(fields), reason))
        await redis.xack(stream, group, entry_id)

    _, claimed, *_ = await redis.xautoclaim(stream, group, consumer, claim_idle_ms, "0-0", count=100)
    for entry_id, fields in claimed:
        await process(entry_id, fields)
    while reply := await redis.xreadgroup(group, consumer, {stream: ">"}, count=100):
        for entry_id, fields in reply[0][1]:
            await process(entry_id, fields)
"""
)

BATCH_WAITS_FOR_BATCH = patched(
    LANES,
    (
        'reply = await redis.xreadgroup(group, consumer, {stream: ">"}, count=100)',
        'reply = await redis.xreadgroup(group, consumer, {stream: ">"}, count=2)',
    ),
    (
        """            if reply:
                dispatch(reply[0][1])
""",
        """            if reply:
                dispatch(reply[0][1])
                await asyncio.gather(*lanes.values())  # the whole batch first, then the next read
""",
    ),
)

ALL_AT_ONCE = patched(
    LANES,
    (
        """                waiting.setdefault(fields["key"], []).append((entry_id, fields))
                if fields["key"] not in lanes:
                    lanes[fields["key"]] = tg.create_task(lane(fields["key"]))
""",
        """                lanes[entry_id] = tg.create_task(process(entry_id, fields))  # every entry at once
                lanes[entry_id].add_done_callback(lambda t, e=entry_id: lanes.pop(e, None))
""",
    ),
)

NO_BLOCK = patched(
    LANES,
    (
        """            cur = await conn.execute(
                "SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR SHARE", (stream, fields["key"])
            )
            if await cur.fetchone() is not None:""",
        """            if False:  # skip the dead message and go on with the key""",
    ),
)

RETRIES_PERMANENT = patched(
    LANES,
    (
        "await retry_call(lambda: apply(entry_id, fields), policy,",
        "await retry_call(lambda: apply(entry_id, fields), RetryPolicy(policy.max_attempts, None, policy.backoff, "
        "lambda err: True),",
    ),
)

OWN_LOOP = """
        first = None
        for n in range(1, policy.max_attempts + 1):
            try:
                await apply(entry_id, fields)
                break
            except Exception as err:
                now = clock()
                first = now if first is None else first
                if not policy.retryable(err) or n == policy.max_attempts:
                    entry = dlq_entry(fields, stream=stream, entry_id=entry_id, attempts=n, first_failed_at=first,
                                      last_failed_at=now, error=err,
                                      reason="exhausted" if policy.retryable(err) else "permanent")
                    dlq_id = await redis.xadd(dlq, entry)
                    async with pool.connection() as conn:
                        await conn.execute(
                            "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
                            "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                            (stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb(fields), entry["reason"]))
                    break
                await sleep(DELAY)
        await redis.xack(stream, group, entry_id)  # only after the commit
"""


def own_loop(delay: str, *, unbounded: bool = False) -> str:
    body = OWN_LOOP.replace("DELAY", delay)
    if unbounded:
        body = body.replace("for n in range(1, policy.max_attempts + 1):", "for n in itertools.count(1):")
        body = body.replace("or n == policy.max_attempts", "")
    start = LANES.index("        state = RetryState()\n")
    end = LANES.index("        await redis.xack(stream, group, entry_id)  # only after the commit\n")
    end += len("        await redis.xack(stream, group, entry_id)  # only after the commit\n")
    return "import itertools\n" + LANES[:start] + body.lstrip("\n") + LANES[end:]


NO_JITTER = own_loop("min(policy.backoff.cap, policy.backoff.base * 2 ** (n - 1))")
UNBOUNDED = own_loop("rand() * min(policy.backoff.cap, policy.backoff.base * 2 ** (n - 1))", unbounded=True)

DLQ_WITHOUT_METADATA = patched(
    LANES,
    ("dlq_id = await redis.xadd(dlq, entry)", "dlq_id = await redis.xadd(dlq, fields)  # the message, as it came"),
)

NO_TAKEOVER = patched(
    LANES,
    (
        """        cursor = "0-0"
        while True:  # first what a dead consumer left pending
            cursor, claimed, *_ = await redis.xautoclaim(stream, group, consumer, claim_idle_ms, cursor, count=100)
            dispatch(claimed)
            if cursor == "0-0":
                break
""",
        "",
    ),
)

NEW_BEFORE_CLAIMED = patched(
    LANES,
    (
        """        cursor = "0-0"
        while True:  # first what a dead consumer left pending
""",
        """        fresh = await redis.xreadgroup(group, consumer, {stream: ">"}, count=100)
        if fresh:
            dispatch(fresh[0][1])  # new entries first
        cursor = "0-0"
        while True:
""",
    ),
)


# ----------------------------------------------------------------------------- replay_key

ONE_TRANSACTION = (
    HEADER
    + """
async def replay_key(pool, redis, handle, *, stream, key, dlq):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT entry_id, dlq_id, fields FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR UPDATE",
            (stream, key),
        )
        block = await cur.fetchone()
        if block is None:  # not blocked (or replayed already): nothing to do
            return 0
        dead_entry, dlq_id, dead_fields = block
        cur = await conn.execute(
            "SELECT entry_id, fields FROM mq_parked WHERE stream = %s AND key = %s "
            "ORDER BY split_part(entry_id, '-', 1)::bigint, split_part(entry_id, '-', 2)::bigint",
            (stream, key),
        )
        applied = 0
        for entry_id, fields in [(dead_entry, dead_fields), *await cur.fetchall()]:
            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:
                await handle(conn, fields)
                applied += 1
        await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))
        await conn.execute("DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key))
    await redis.xdel(dlq, dlq_id)  # after the commit
    return applied
"""
)

PER_MESSAGE_COMMITS = (
    HEADER
    + """
async def replay_key(pool, redis, handle, *, stream, key, dlq):
    # each message in its own transaction; the block goes last, so nothing overtakes meanwhile
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT entry_id, dlq_id, fields FROM mq_blocked_keys WHERE stream = %s AND key = %s",
                                 (stream, key))
        block = await cur.fetchone()
        if block is None:
            return 0
        cur = await conn.execute("SELECT entry_id, fields FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))
        parked = sorted(await cur.fetchall(), key=lambda row: tuple(map(int, row[0].split("-"))))
    applied = 0
    for entry_id, fields in [(block[0], block[2]), *parked]:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute("INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                                     "ON CONFLICT DO NOTHING RETURNING 1", (fields["id"], stream, entry_id))
            if await cur.fetchone():
                await handle(conn, fields)
                applied += 1
            await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND entry_id = %s", (stream, entry_id))
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key))
    await redis.xdel(dlq, block[1])
    return applied
"""
)


REPLAY_PARKED_FIRST = patched(
    ONE_TRANSACTION,
    ("[(dead_entry, dead_fields), *await cur.fetchall()]", "[*await cur.fetchall(), (dead_entry, dead_fields)]"),
)
REPLAY_TEXT_ORDER = patched(
    ONE_TRANSACTION,
    ("ORDER BY split_part(entry_id, '-', 1)::bigint, split_part(entry_id, '-', 2)::bigint", "ORDER BY entry_id"),
)
REPLAY_WITHOUT_DEDUP = patched(
    ONE_TRANSACTION,
    (
        """            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:
""",
        """            if True:
""",
    ),
)
REPLAY_UNBLOCK_FIRST = patched(
    PER_MESSAGE_COMMITS,
    (
        """    applied = 0
    for entry_id""",
        """    async with pool.connection() as conn:
        await conn.execute("DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key))
    applied = 0
    for entry_id""",
    ),
)
REPLAY_KEEPS_DEAD_LETTER = patched(ONE_TRANSACTION, ("    await redis.xdel(dlq, dlq_id)  # after the commit\n", ""))
REPLAY_SKIPS_FAILURES = patched(
    PER_MESSAGE_COMMITS,
    (
        """        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute("INSERT INTO mq_processed""",
        """        try:
          async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute("INSERT INTO mq_processed""",
    ),
    (
        """            await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND entry_id = %s", (stream, entry_id))
""",
        """            await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND entry_id = %s", (stream, entry_id))
        except Exception:
            continue  # skip what still fails and replay the rest
""",
    ),
)
REPLAY_LEAVES_PARKED = patched(
    ONE_TRANSACTION,
    ('        await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))\n', ""),
)


# Issue 28 audit: parks a blocked key's entry and also records it in mq_processed ("do nothing else").
PARK_ALSO_PROCESSED = patched(
    LANES,
    (
        """                    (stream, entry_id, fields["key"], Jsonb(fields)),
                )
                return""",
        """                    (stream, entry_id, fields["key"], Jsonb(fields)),
                )
                await conn.execute(
                    "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                    (fields["id"], stream, entry_id),
                )
                return""",
    ),
)

# Issue 28 audit: counts every message it read, not the ones it applied (P-3 is parked twice).
REPLAY_COUNTS_ROWS_READ = patched(
    ONE_TRANSACTION,
    (
        "                await handle(conn, fields)\n                applied += 1\n",
        "                await handle(conn, fields)\n",
    ),
    (
        "            if await cur.fetchone() is not None:",
        "            applied += 1\n            if await cur.fetchone() is not None:",
    ),
)


# Issue 28 audit: a replay of a key that is not blocked (replayed already) returns None, not 0.
REPLAY_NOT_BLOCKED_RETURNS_NONE = patched(
    ONE_TRANSACTION,
    (
        "        if block is None:  # not blocked (or replayed already): nothing to do\n            return 0\n",
        "        if block is None:  # not blocked (or replayed already): nothing to do\n            return\n",
    ),
)

# Issue 28 audit: catches the kill (a BaseException) and dead-letters the entry as if it had failed.
CATCHES_KILL = patched(
    LANES, ("        except Exception as err:  # permanent", "        except BaseException as err:  # permanent")
)


# XACK of a dead-lettered entry before its key's block is committed (acknowledge last).
ACK_BEFORE_BLOCK = patched(
    LANES,
    (
        """            dlq_id = await redis.xadd(dlq, entry)
            async with""",
        """            dlq_id = await redis.xadd(dlq, entry)
            await redis.xack(stream, group, entry_id)
            async with""",
    ),
)

# The block row without the entry's fields (the replay needs them to apply the dead letter).
BLOCK_WITHOUT_FIELDS = patched(
    LANES,
    (
        '(stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb(fields), reason)',
        '(stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb({}), reason)',
    ),
)


# ----------------------------------------------------------------------------- found by audit B

OWN_RETRY_QUEUES = """
import asyncio
import random
import time
from collections import defaultdict, deque

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call


async def _apply_once(pool, handle, stream, entry_id, fields):
    async with pool.connection() as conn:
        async with conn.transaction():
            blocked = await (
                await conn.execute("SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, fields["key"]))
            ).fetchone()
            if blocked:
                await conn.execute(
                    "INSERT INTO mq_parked (stream, entry_id, key, fields) VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (stream, entry_id, fields["key"], Jsonb(fields)),
                )
                return
            fresh = await (
                await conn.execute(
                    "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                    "ON CONFLICT (message_id) DO NOTHING RETURNING 1",
                    (fields["id"], stream, entry_id),
                )
            ).fetchone()
            if fresh:
                await handle(conn, fields)


async def ordered_consumer(pool, redis, handle, *, stream, group, consumer, dlq, policy, sleep, rand, clock,
                           claim_idle_ms=60_000) -> None:
    queues: dict[str, deque] = defaultdict(deque)
    workers: dict[str, asyncio.Task] = {}

    async def handle_entry(entry_id, fields):
        first = last = None
        attempt = 0
        while True:
            try:
                await _apply_once(pool, handle, stream, entry_id, fields)
                break
            except Exception as err:
                now = clock()
                first = now if first is None else first
                last = now
                attempt += 1
                retry = policy.retryable(err)
                if retry and attempt < policy.max_attempts:
                    k = attempt - 1
                    await sleep(rand() * min(policy.backoff.cap, policy.backoff.base * 2**k))
                    continue
                reason = "exhausted" if retry else "permanent"
                dlq_id = await redis.xadd(dlq, dlq_entry(
                    fields, stream=stream, entry_id=entry_id, attempts=attempt, first_failed_at=first,
                    last_failed_at=last, error=err, reason=reason))
                async with pool.connection() as conn:
                    await conn.execute(
                        "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
                        "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                        (stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb(fields), reason),
                    )
                break
        await redis.xack(stream, group, entry_id)

    async def worker(key):
        q = queues[key]
        while q:
            await handle_entry(*q[0])
            q.popleft()
        workers.pop(key, None)
        queues.pop(key, None)

    def submit(entries):
        for entry_id, fields in entries:
            queues[fields["key"]].append((entry_id, fields))
            if fields["key"] not in workers:
                workers[fields["key"]] = asyncio.create_task(worker(fields["key"]))

    cursor = "0-0"
    while True:
        cursor, claimed, *_ = await redis.xautoclaim(stream, group, consumer, claim_idle_ms, cursor)
        submit(claimed)
        if cursor == "0-0":
            break
    try:
        while True:
            reply = await redis.xreadgroup(group, consumer, {stream: ">"}, count=50)
            if reply and reply[0][1]:
                submit(reply[0][1])
                continue
            if not workers:
                return
            done, _ = await asyncio.wait(set(workers.values()), return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # a kill (or a bug) surfaces here
    finally:
        for t in list(workers.values()):
            t.cancel()
"""

TASK_CHAIN_PER_KEY = """
import asyncio
import random
import time

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call


async def ordered_consumer(pool, redis, handle, *, stream, group, consumer, dlq, policy, sleep, rand, clock, claim_idle_ms=60_000):
    async def apply(entry_id, fields):
        # one transaction: park if the key is blocked, else record the id and apply the change
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR SHARE", (stream, fields["key"])
            )
            if await cur.fetchone() is not None:
                await conn.execute(
                    "INSERT INTO mq_parked (stream, entry_id, key, fields) VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT DO NOTHING",
                    (stream, entry_id, fields["key"], Jsonb(fields)),
                )
                return
            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:  # a new message id: apply it
                await handle(conn, fields)

    async def process(entry_id, fields):
        state = RetryState()
        try:
            await retry_call(lambda: apply(entry_id, fields), policy, clock=clock, sleep=sleep, rand=rand, state=state)
        except Exception as err:  # permanent, or out of attempts: dead-letter it and block its key
            reason = "permanent" if state.gave_up == "not retryable" else "exhausted"
            entry = dlq_entry(
                fields,
                stream=stream,
                entry_id=entry_id,
                attempts=state.attempt,
                first_failed_at=state.first_failure_at,
                last_failed_at=state.last_failure_at,
                error=err,
                reason=reason,
            )
            dlq_id = await redis.xadd(dlq, entry)
            async with pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb(fields), reason),
                )
        await redis.xack(stream, group, entry_id)  # only after the commit

    tails: dict[str, asyncio.Task] = {}
    tasks: set[asyncio.Task] = set()

    async def after(prev, entry_id, fields):
        if prev is not None:
            await asyncio.shield(prev)  # a key's entries one at a time, in stream order
        await process(entry_id, fields)

    def dispatch(entries):
        for entry_id, fields in entries:
            key = fields["key"]
            t = asyncio.create_task(after(tails.get(key), entry_id, fields))
            tails[key] = t
            tasks.add(t)

    cursor = "0-0"
    while True:
        cursor, claimed, *_ = await redis.xautoclaim(stream, group, consumer, claim_idle_ms, cursor, count=100)
        dispatch(claimed)
        if cursor == "0-0":
            break
    try:
        while True:
            reply = await redis.xreadgroup(group, consumer, {stream: ">"}, count=10)
            if reply:
                dispatch(reply[0][1])
                continue
            pending = {t for t in tasks if not t.done()}
            for t in tasks - pending:
                t.result()
            tasks.intersection_update(pending)
            if not pending:
                break
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
"""

LOCK_PER_KEY_ROWCOUNT = """
import asyncio
import random
import time

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call


async def ordered_consumer(pool, redis, handle, *, stream, group, consumer, dlq, policy, sleep, rand, clock, claim_idle_ms=60_000):
    async def apply(entry_id, fields):
        # one transaction: park if the key is blocked, else record the id and apply the change
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO mq_parked (stream, entry_id, key, fields) "
                "SELECT b.stream, %s, b.key, %s FROM mq_blocked_keys b WHERE b.stream = %s AND b.key = %s "
                "ON CONFLICT DO NOTHING",
                (entry_id, Jsonb(fields), stream, fields["key"]),
            )
            if cur.rowcount:
                return
            again = await (await conn.execute(
                "SELECT count(*) FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, fields["key"]))).fetchone()
            if again[0]:
                return  # parked before (a redelivery)
            cur = await conn.execute(
                "INSERT INTO mq_processed AS p (message_id, stream, entry_id) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                (fields["id"], stream, entry_id),
            )
            if cur.rowcount == 1:
                await handle(conn, fields)

    async def process(entry_id, fields):
        state = RetryState()
        try:
            await retry_call(lambda: apply(entry_id, fields), policy, clock=clock, sleep=sleep, rand=rand, state=state)
        except Exception as err:  # permanent, or out of attempts: dead-letter it and block its key
            reason = "permanent" if state.gave_up == "not retryable" else "exhausted"
            entry = dlq_entry(
                fields,
                stream=stream,
                entry_id=entry_id,
                attempts=state.attempt,
                first_failed_at=state.first_failure_at,
                last_failed_at=state.last_failure_at,
                error=err,
                reason=reason,
            )
            dlq_id = await redis.xadd(dlq, entry)
            async with pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb(fields), reason),
                )
        await redis.xack(stream, group, entry_id)  # only after the commit

    locks: dict = {}
    running: set = set()

    async def one(entry_id, fields):
        lock = locks.setdefault(fields["key"], asyncio.Lock())
        async with lock:  # asyncio.Lock wakes waiters in FIFO order: stream order per key
            await process(entry_id, fields)

    def start(entries):
        for entry_id, fields in entries:
            running.add(asyncio.ensure_future(one(entry_id, fields)))

    cursor = "0-0"
    while True:
        cursor, claimed, *_ = await redis.xautoclaim(stream, group, consumer, claim_idle_ms, cursor)
        start(claimed)
        if cursor == "0-0":
            break
    while True:
        reply = await redis.xreadgroup(group, consumer, {stream: ">"})
        if reply and reply[0][1]:
            start(reply[0][1])
            continue
        live = [t for t in running if not t.done()]
        for t in [t for t in running if t.done()]:
            running.discard(t)
            t.result()
        if not live:
            return
        await asyncio.wait(live, return_when=asyncio.FIRST_COMPLETED)
"""

CATCHES_BASE_EXCEPTION = """
import asyncio
import random
import time
from collections import defaultdict, deque

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call


async def _apply_once(pool, handle, stream, entry_id, fields):
    async with pool.connection() as conn:
        async with conn.transaction():
            blocked = await (
                await conn.execute("SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, fields["key"]))
            ).fetchone()
            if blocked:
                await conn.execute(
                    "INSERT INTO mq_parked (stream, entry_id, key, fields) VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (stream, entry_id, fields["key"], Jsonb(fields)),
                )
                return
            fresh = await (
                await conn.execute(
                    "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                    "ON CONFLICT (message_id) DO NOTHING RETURNING 1",
                    (fields["id"], stream, entry_id),
                )
            ).fetchone()
            if fresh:
                await handle(conn, fields)


async def ordered_consumer(pool, redis, handle, *, stream, group, consumer, dlq, policy, sleep, rand, clock,
                           claim_idle_ms=60_000) -> None:
    queues: dict[str, deque] = defaultdict(deque)
    workers: dict[str, asyncio.Task] = {}

    async def handle_entry(entry_id, fields):
        first = last = None
        attempt = 0
        while True:
            try:
                await _apply_once(pool, handle, stream, entry_id, fields)
                break
            except BaseException as err:  # be robust
                now = clock()
                first = now if first is None else first
                last = now
                attempt += 1
                retry = policy.retryable(err)
                if retry and attempt < policy.max_attempts:
                    k = attempt - 1
                    await sleep(rand() * min(policy.backoff.cap, policy.backoff.base * 2**k))
                    continue
                reason = "exhausted" if retry else "permanent"
                dlq_id = await redis.xadd(dlq, dlq_entry(
                    fields, stream=stream, entry_id=entry_id, attempts=attempt, first_failed_at=first,
                    last_failed_at=last, error=err, reason=reason))
                async with pool.connection() as conn:
                    await conn.execute(
                        "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
                        "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                        (stream, fields["key"], entry_id, fields["id"], dlq_id, Jsonb(fields), reason),
                    )
                break
        await redis.xack(stream, group, entry_id)

    async def worker(key):
        q = queues[key]
        while q:
            await handle_entry(*q[0])
            q.popleft()
        workers.pop(key, None)
        queues.pop(key, None)

    def submit(entries):
        for entry_id, fields in entries:
            queues[fields["key"]].append((entry_id, fields))
            if fields["key"] not in workers:
                workers[fields["key"]] = asyncio.create_task(worker(fields["key"]))

    cursor = "0-0"
    while True:
        cursor, claimed, *_ = await redis.xautoclaim(stream, group, consumer, claim_idle_ms, cursor)
        submit(claimed)
        if cursor == "0-0":
            break
    try:
        while True:
            reply = await redis.xreadgroup(group, consumer, {stream: ">"}, count=50)
            if reply and reply[0][1]:
                submit(reply[0][1])
                continue
            if not workers:
                return
            done, _ = await asyncio.wait(set(workers.values()), return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # a kill (or a bug) surfaces here
    finally:
        for t in list(workers.values()):
            t.cancel()
"""

REPLAY_PYTHON_SORT = """
import asyncio
from psycopg.rows import dict_row


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


async def replay_key(pool, redis, handle, *, stream, key, dlq) -> int:
    async with pool.connection() as conn:
        async with conn.transaction():
            async with conn.cursor(row_factory=dict_row) as cur:
                await cur.execute(
                    "SELECT * FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR UPDATE", (stream, key)
                )
                block = await cur.fetchone()
                if not block:
                    return 0
                await cur.execute("SELECT entry_id, fields FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))
                parked = sorted(await cur.fetchall(), key=lambda row: _entry_key(row["entry_id"]))
            todo = [(block["entry_id"], block["fields"])] + [(p["entry_id"], p["fields"]) for p in parked]
            count = 0
            for entry_id, fields in todo:
                ins = await conn.execute(
                    "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                    (fields["id"], stream, entry_id),
                )
                if ins.rowcount == 1:
                    await handle(conn, fields)
                    count += 1
            await conn.execute(
                "WITH gone AS (DELETE FROM mq_parked WHERE stream = %s AND key = %s) "
                "DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s",
                (stream, key, stream, key),
            )
        dlq_id = block["dlq_id"]
    if dlq_id:
        await redis.xdel(dlq, dlq_id)
    return count
"""

REPLAY_SAVEPOINT = """
import asyncio
import random
import time

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call


async def replay_key(pool, redis, handle, *, stream, key, dlq):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT entry_id, dlq_id, fields FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR UPDATE",
            (stream, key),
        )
        block = await cur.fetchone()
        if block is None:  # not blocked (or replayed already): nothing to do
            return 0
        dead_entry, dlq_id, dead_fields = block
        cur = await conn.execute(
            "SELECT entry_id, fields FROM mq_parked WHERE stream = %s AND key = %s "
            "ORDER BY split_part(entry_id, '-', 1)::bigint, split_part(entry_id, '-', 2)::bigint",
            (stream, key),
        )
        applied = 0
        for entry_id, fields in [(dead_entry, dead_fields), *await cur.fetchall()]:
            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:
                async with conn.transaction():  # a savepoint around the handler
                    await handle(conn, fields)
                applied += 1
        await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))
        await conn.execute("DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key))
    await redis.xdel(dlq, dlq_id)  # after the commit
    return applied
"""

REPLAY_XDEL_BEFORE_COMMIT = """
import asyncio
import random
import time

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call


async def replay_key(pool, redis, handle, *, stream, key, dlq):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT entry_id, dlq_id, fields FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR UPDATE",
            (stream, key),
        )
        block = await cur.fetchone()
        if block is None:  # not blocked (or replayed already): nothing to do
            return 0
        dead_entry, dlq_id, dead_fields = block
        cur = await conn.execute(
            "SELECT entry_id, fields FROM mq_parked WHERE stream = %s AND key = %s "
            "ORDER BY split_part(entry_id, '-', 1)::bigint, split_part(entry_id, '-', 2)::bigint",
            (stream, key),
        )
        applied = 0
        for entry_id, fields in [(dead_entry, dead_fields), *await cur.fetchall()]:
            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:
                await handle(conn, fields)
                applied += 1
        await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))
        await conn.execute("DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key))
        await redis.xdel(dlq, dlq_id)
    return applied
"""

REPLAY_PARKED_AT_ORDER = """
import asyncio
import random
import time

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call


async def replay_key(pool, redis, handle, *, stream, key, dlq):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT entry_id, dlq_id, fields FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR UPDATE",
            (stream, key),
        )
        block = await cur.fetchone()
        if block is None:  # not blocked (or replayed already): nothing to do
            return 0
        dead_entry, dlq_id, dead_fields = block
        cur = await conn.execute(
            "SELECT entry_id, fields FROM mq_parked WHERE stream = %s AND key = %s "
            "ORDER BY parked_at",
            (stream, key),
        )
        applied = 0
        for entry_id, fields in [(dead_entry, dead_fields), *await cur.fetchall()]:
            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:
                await handle(conn, fields)
                applied += 1
        await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))
        await conn.execute("DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key))
    await redis.xdel(dlq, dlq_id)  # after the commit
    return applied
"""

REPLAY_NO_ORDER = """
import asyncio
import random
import time

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call


async def replay_key(pool, redis, handle, *, stream, key, dlq):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT entry_id, dlq_id, fields FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR UPDATE",
            (stream, key),
        )
        block = await cur.fetchone()
        if block is None:  # not blocked (or replayed already): nothing to do
            return 0
        dead_entry, dlq_id, dead_fields = block
        cur = await conn.execute(
            "SELECT entry_id, fields FROM mq_parked WHERE stream = %s AND key = %s "
            "",
            (stream, key),
        )
        applied = 0
        for entry_id, fields in [(dead_entry, dead_fields), *await cur.fetchall()]:
            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:
                await handle(conn, fields)
                applied += 1
        await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))
        await conn.execute("DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key))
    await redis.xdel(dlq, dlq_id)  # after the commit
    return applied
"""

REPLAY_IGNORES_STREAM = """
import asyncio
import random
import time

from psycopg.types.json import Jsonb

from course.messaging import ConsumerKilled, dlq_entry, is_transient
from course.retry import RetryPolicy, RetryState, retry_call


async def replay_key(pool, redis, handle, *, stream, key, dlq):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT entry_id, dlq_id, fields FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR UPDATE",
            (stream, key),
        )
        block = await cur.fetchone()
        if block is None:  # not blocked (or replayed already): nothing to do
            return 0
        dead_entry, dlq_id, dead_fields = block
        cur = await conn.execute(
            "SELECT entry_id, fields FROM mq_parked WHERE %s::text IS NOT NULL AND key = %s "
            "ORDER BY split_part(entry_id, '-', 1)::bigint, split_part(entry_id, '-', 2)::bigint",
            (stream, key),
        )
        applied = 0
        for entry_id, fields in [(dead_entry, dead_fields), *await cur.fetchall()]:
            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:
                await handle(conn, fields)
                applied += 1
        await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))
        await conn.execute("DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key))
    await redis.xdel(dlq, dlq_id)  # after the commit
    return applied
"""


CORRECT: dict[str, dict[str, str]] = {
    "ordered_consumer": {
        "lanes-retry_call": LANES,
        "queues-own-backoff": QUEUES_OWN_BACKOFF,
        "lock-per-key": LOCK_PER_KEY,
        "handler-timeout": HANDLER_TIMEOUT,
        "own-retry-loop-deques": OWN_RETRY_QUEUES,
        "task-chain-per-key": TASK_CHAIN_PER_KEY,
        "lock-per-key-rowcount-insert-select": LOCK_PER_KEY_ROWCOUNT,
    },
    "replay_key": {
        "one-transaction": ONE_TRANSACTION,
        "per-message": PER_MESSAGE_COMMITS,
        "python-sort-dict-rows": REPLAY_PYTHON_SORT,
        "savepoint-around-handle": REPLAY_SAVEPOINT,
    },
}


WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "ordered_consumer": {
        "ack-before-work": (ACK_BEFORE_WORK, "before its change"),
        "ack-inside-transaction": (ACK_INSIDE_TRANSACTION, "before its change"),
        "in-memory-dedup": (IN_MEMORY_DEDUP, "not shared"),
        "dedup-in-its-own-commit": (DEDUP_IN_ITS_OWN_COMMIT, "commit of its own"),
        "retry-queue-reorders": (RETRY_QUEUE, "overtake"),
        "whole-stream-serial": (SERIAL, "head-of-line"),
        "batch-waits-for-batch": (BATCH_WAITS_FOR_BATCH, "later batch"),
        "all-entries-at-once": (ALL_AT_ONCE, "one at a time"),
        "park-also-processed": (PARK_ALSO_PROCESSED, "parked and also recorded in mq_processed"),
        "ack-before-block": (ACK_BEFORE_BLOCK, "the XACK of P-1 (and others) came before"),
        "block-without-fields": (BLOCK_WITHOUT_FIELDS, "wrong fields"),
        "key-not-blocked": (NO_BLOCK, "block the key"),
        "retries-permanent-errors": (RETRIES_PERMANENT, "permanent error"),
        "no-jitter": (NO_JITTER, "no jitter"),
        "unbounded-attempts": (UNBOUNDED, "unbounded"),
        "dlq-without-metadata": (DLQ_WITHOUT_METADATA, "lacks"),
        "no-takeover": (NO_TAKEOVER, "XAUTOCLAIM"),
        "new-before-claimed": (NEW_BEFORE_CLAIMED, "stream order"),
        "catches-kill": (CATCHES_KILL, "ended with TypeError instead: it caught the kill"),
        "catches-base-exception": (CATCHES_BASE_EXCEPTION, "it caught the kill"),
    },
    "replay_key": {
        "parked-first": (REPLAY_PARKED_FIRST, "dead-lettered message first"),
        "text-order": (REPLAY_TEXT_ORDER, "as text"),
        "without-dedup": (REPLAY_WITHOUT_DEDUP, "once"),
        "unblock-first": (REPLAY_UNBLOCK_FIRST, "overtake"),
        "keeps-dead-letter": (REPLAY_KEEPS_DEAD_LETTER, "XDEL"),
        "skips-failures": (REPLAY_SKIPS_FAILURES, "roll back"),
        "counts-rows-read": (REPLAY_COUNTS_ROWS_READ, "Return how many messages it applied"),
        "leaves-parked": (REPLAY_LEAVES_PARKED, "mq_parked still holds"),
        "not-blocked-returns-none": (REPLAY_NOT_BLOCKED_RETURNS_NONE, "expected 0"),
        "xdel-before-commit": (REPLAY_XDEL_BEFORE_COMMIT, "still committed"),
        "parked-at-order": (REPLAY_PARKED_AT_ORDER, "not by parked_at"),
        "no-order": (REPLAY_NO_ORDER, "not by parked_at"),
        "ignores-stream": (REPLAY_IGNORES_STREAM, "by stream and key"),
    },
}


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in CORRECT.items() for n in d])
def test_05_correct_answers_pass(task, name):
    assert_accepted(task, CORRECT[task][name])


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in WRONG.items() for n in d])
def test_05_wrong_answers_are_rejected_for_the_reason(task, name):
    source, mentions = WRONG[task][name]
    assert_rejected(task, source, mentions=mentions)


def test_05_a_consumer_without_concurrency_across_keys_keeps_at_most_six_points():
    """Other keys never waiting is the point of the chapter: it weighs most (issue 28)."""
    res = run_source("ordered_consumer", SERIAL)
    assert 0 < res.points <= 6, res.text()
