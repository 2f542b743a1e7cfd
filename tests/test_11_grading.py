"""Chapter 11 grading: the wrong answers learners write are rejected, correct designs pass.

WRONG[task][name] = (source, mentions): a learner's answer cell, rejected, and a phrase the
feedback must contain (the real mistake). CORRECT[task][name] = source: accepted. The races
are forced by the check (autograder/checks/ch11/), so every verdict is the same every run.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_accepted, assert_rejected, notebook_with_answers

# ----------------------------------------------------------------------------- view_counter

COUNTER = """
from collections import Counter

class ViewCounter:
    def __init__(self, pool, max_views=100):
        self.pool = pool
        self.max_views = max_views
        self.buffer = Counter()

    async def view(self, item_id):
        self.buffer[item_id] += 1
        if sum(self.buffer.values()) >= self.max_views:
            await self.flush()

    async def flush(self):
        if not self.buffer:
            return
        batch, self.buffer = self.buffer, Counter()
        try:
            async with self.pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO view_counts AS c (item_id, views) SELECT * FROM unnest(%s::text[], %s::bigint[]) "
                    "ON CONFLICT (item_id) DO UPDATE SET views = c.views + EXCLUDED.views",
                    (list(batch), list(batch.values())))
        except Exception:
            self.buffer.update(batch)
            raise

    async def close(self):
        await self.flush()
"""

# A dataclass with generated __init__, annotations and no method of its own on the first lines:
# the grader must run it (and its replicas) as the notebook does, not under the grader's own
# ``from __future__ import annotations``.
AS_DATACLASS = """
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ViewCounter:
    pool: Any
    max_views: int = 100
    buffer: Counter = field(default_factory=Counter)

    async def view(self, item_id: str) -> None:
        self.buffer[item_id] += 1
        if sum(self.buffer.values()) >= self.max_views:
            await self.flush()

    async def flush(self) -> None:
        if not self.buffer:
            return
        batch, self.buffer = self.buffer, Counter()
        try:
            async with self.pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO view_counts AS c (item_id, views) SELECT * FROM unnest(%s::text[], %s::bigint[]) "
                    "ON CONFLICT (item_id) DO UPDATE SET views = c.views + EXCLUDED.views",
                    (list(batch), list(batch.values())))
        except Exception:
            self.buffer.update(batch)
            raise

    async def close(self) -> None:
        await self.flush()
"""

ONE_TRANSACTION_PER_ITEM = """
import asyncio
from collections import defaultdict

class ViewCounter:
    def __init__(self, pool, max_views=100):
        self.pool, self.max_views = pool, max_views
        self.buffer = defaultdict(int)
        self.n = 0
        self.lock = asyncio.Lock()

    async def view(self, item_id):
        self.buffer[item_id] += 1
        self.n += 1
        if self.n >= self.max_views:
            await self.flush()

    async def flush(self):
        async with self.lock:
            batch, self.buffer, self.n = dict(self.buffer), defaultdict(int), 0
            if not batch:
                return
            try:
                async with self.pool.connection() as conn, conn.transaction():
                    for item, n in sorted(batch.items()):
                        await conn.execute(
                            "INSERT INTO view_counts (item_id, views) VALUES (%s, %s) ON CONFLICT (item_id) "
                            "DO UPDATE SET views = view_counts.views + EXCLUDED.views", (item, n))
            except Exception:
                for item, n in batch.items():
                    self.buffer[item] += n
                    self.n += n
                raise

    async def close(self):
        await self.flush()
"""

SWALLOW_AND_KEEP = """
from collections import Counter

class ViewCounter:
    def __init__(self, pool, max_views=100):
        self.pool, self.max_views, self.buffer = pool, max_views, Counter()

    async def view(self, item_id):
        self.buffer[item_id] += 1
        if self.buffer.total() >= self.max_views:
            await self.flush()

    async def flush(self):
        batch, self.buffer = self.buffer, Counter()
        written = set()
        try:
            async with self.pool.connection() as conn:
                for item, n in batch.items():   # autocommit, one per item: forget only what committed
                    await conn.execute(
                        "INSERT INTO view_counts (item_id, views) VALUES (%s, %s) ON CONFLICT (item_id) "
                        "DO UPDATE SET views = view_counts.views + EXCLUDED.views", (item, n))
                    written.add(item)
        except Exception:
            for item, n in batch.items():
                if item not in written:
                    self.buffer[item] += n      # the ticker retries; an error here is logged, not raised

    async def close(self):
        await self.flush()
"""

# ----------------------------------------------------------------------------- wrong answers

PER_VIEW = """
class ViewCounter:
    def __init__(self, pool, max_views=100):
        self.pool = pool

    async def view(self, item_id):
        async with self.pool.connection() as conn:
            await conn.execute(
                "INSERT INTO view_counts (item_id, views) VALUES (%s, 1) ON CONFLICT (item_id) "
                "DO UPDATE SET views = view_counts.views + 1", (item_id,))

    async def flush(self):
        pass

    async def close(self):
        pass
"""

ONLY_ON_CLOSE = COUNTER.replace(
    """        if sum(self.buffer.values()) >= self.max_views:
            await self.flush()
""",
    "",
)

CLOSE_DROPS = COUNTER.replace(
    """    async def close(self):
        await self.flush()""",
    """    async def close(self):
        self.buffer.clear()""",
)

CLEAR_AFTER_WRITE = """
from collections import Counter

class ViewCounter:
    def __init__(self, pool, max_views=100):
        self.pool, self.max_views, self.buffer = pool, max_views, Counter()

    async def view(self, item_id):
        self.buffer[item_id] += 1
        if sum(self.buffer.values()) >= self.max_views:
            await self.flush()

    async def flush(self):
        if not self.buffer:
            return
        async with self.pool.connection() as conn:
            await conn.execute(
                "INSERT INTO view_counts AS c (item_id, views) SELECT * FROM unnest(%s::text[], %s::bigint[]) "
                "ON CONFLICT (item_id) DO UPDATE SET views = c.views + EXCLUDED.views",
                (list(self.buffer), list(self.buffer.values())))
        self.buffer.clear()

    async def close(self):
        await self.flush()
"""

READ_THEN_WRITE = """
from collections import Counter

class ViewCounter:
    def __init__(self, pool, max_views=100):
        self.pool, self.max_views, self.buffer = pool, max_views, Counter()

    async def view(self, item_id):
        self.buffer[item_id] += 1
        if sum(self.buffer.values()) >= self.max_views:
            await self.flush()

    async def flush(self):
        batch, self.buffer = self.buffer, Counter()
        try:
            async with self.pool.connection() as conn:
                for item, n in batch.items():
                    cur = await conn.execute("SELECT views FROM view_counts WHERE item_id = %s", (item,))
                    row = await cur.fetchone()
                    total = (row[0] if row else 0) + n
                    await conn.execute(
                        "INSERT INTO view_counts (item_id, views) VALUES (%s, %s) ON CONFLICT (item_id) "
                        "DO UPDATE SET views = EXCLUDED.views", (item, total))
        except Exception:
            self.buffer.update(batch)
            raise

    async def close(self):
        await self.flush()
"""

DROP_ON_FAILURE = COUNTER.replace(
    """        except Exception:
            self.buffer.update(batch)
            raise""",
    """        except Exception as err:
            print("flush failed, skipping:", err)""",
)

ITEM_BY_ITEM_ALL_BACK = """
from collections import Counter

class ViewCounter:
    def __init__(self, pool, max_views=100):
        self.pool, self.max_views, self.buffer = pool, max_views, Counter()

    async def view(self, item_id):
        self.buffer[item_id] += 1
        if sum(self.buffer.values()) >= self.max_views:
            await self.flush()

    async def flush(self):
        batch, self.buffer = self.buffer, Counter()
        try:
            async with self.pool.connection() as conn:
                for item, n in batch.items():
                    await conn.execute(
                        "INSERT INTO view_counts (item_id, views) VALUES (%s, %s) ON CONFLICT (item_id) "
                        "DO UPDATE SET views = view_counts.views + EXCLUDED.views", (item, n))
        except Exception:
            self.buffer.update(batch)
            raise

    async def close(self):
        await self.flush()
"""

# ----------------------------------------------------------------------------- send_message

ROW_LOCK = """
async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO chat_conversations AS c (id, last_seq) VALUES (%s, 1) "
            "ON CONFLICT (id) DO UPDATE SET last_seq = c.last_seq + 1 RETURNING last_seq", (conversation_id,))
        (seq,) = await cur.fetchone()
        await conn.execute("INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                           (conversation_id, seq, sender, body))
    return seq
"""

UPDATE_THEN_INSERT_ROW = """
async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn:
        async with conn.transaction():
            await conn.execute("INSERT INTO chat_conversations (id) VALUES (%s) ON CONFLICT DO NOTHING",
                               (conversation_id,))
            cur = await conn.execute(
                "UPDATE chat_conversations SET last_seq = last_seq + 1 WHERE id = %s RETURNING last_seq",
                (conversation_id,))
            seq = (await cur.fetchone())[0]
            await conn.execute(
                "INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                (conversation_id, seq, sender, body))
        return seq
"""

MAX_PLUS_ONE_UNDER_LOCK = """
async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("INSERT INTO chat_conversations (id) VALUES (%s) ON CONFLICT DO NOTHING",
                           (conversation_id,))
        await conn.execute("SELECT 1 FROM chat_conversations WHERE id = %s FOR UPDATE", (conversation_id,))
        cur = await conn.execute("SELECT coalesce(max(seq), 0) + 1 FROM chat_messages WHERE conversation_id = %s",
                                 (conversation_id,))
        (seq,) = await cur.fetchone()
        await conn.execute("INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                           (conversation_id, seq, sender, body))
    return seq
"""

TIMESTAMP = """
import time

async def send_message(pool, conversation_id, sender, body):
    seq = time.time_ns() // 1000
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                           (conversation_id, seq, sender, body))
    return seq
"""

GLOBAL_SEQUENCE = """
async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn:
        await conn.execute("CREATE SEQUENCE IF NOT EXISTS my_msg_seq")
        cur = await conn.execute(
            "INSERT INTO chat_messages (conversation_id, seq, sender, body) "
            "VALUES (%s, nextval('my_msg_seq'), %s, %s) RETURNING seq", (conversation_id, sender, body))
        return (await cur.fetchone())[0]
"""

MAX_PLUS_ONE = """
async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT coalesce(max(seq), 0) + 1 FROM chat_messages WHERE conversation_id = %s",
                                 (conversation_id,))
        (seq,) = await cur.fetchone()
        await conn.execute("INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                           (conversation_id, seq, sender, body))
    return seq
"""

IN_PROCESS_LOCK = """
import asyncio
_locks = {}

async def send_message(pool, conversation_id, sender, body):
    lock = _locks.setdefault(conversation_id, asyncio.Lock())
    async with lock:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT coalesce(max(seq), 0) + 1 FROM chat_messages WHERE conversation_id = %s", (conversation_id,))
            (seq,) = await cur.fetchone()
            await conn.execute(
                "INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                (conversation_id, seq, sender, body))
    return seq
"""

SEPARATE_COUNTER_STATEMENT = """
async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO chat_conversations AS c (id, last_seq) VALUES (%s, 1) "
            "ON CONFLICT (id) DO UPDATE SET last_seq = c.last_seq + 1 RETURNING last_seq", (conversation_id,))
        (seq,) = await cur.fetchone()   # committed at once (autocommit), then the insert
        await conn.execute("INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                           (conversation_id, seq, sender, body))
    return seq
"""

COUNTER_COMMITTED_FIRST = """
async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn:   # autocommit: the counter's new value is committed at once
        cur = await conn.execute(
            "INSERT INTO chat_conversations AS c (id, last_seq) VALUES (%s, 1) "
            "ON CONFLICT (id) DO UPDATE SET last_seq = c.last_seq + 1 RETURNING last_seq", (conversation_id,))
        (seq,) = await cur.fetchone()
        try:
            await conn.execute(
                "INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                (conversation_id, seq, sender, body))
        except Exception:
            await conn.execute(  # hand the number back, if nobody took the next one meanwhile
                "UPDATE chat_conversations SET last_seq = last_seq - 1 WHERE id = %s AND last_seq = %s",
                (conversation_id, seq))
            raise
    return seq
"""

GLOBAL_LOCK = ROW_LOCK.replace(
    """    async with pool.connection() as conn, conn.transaction():
""",
    """    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(42)")  # one sender at a time, everywhere
""",
)

ONE_ROW_PER_VIEW_IN_FLUSH = """
from collections import Counter

class ViewCounter:
    def __init__(self, pool, max_views=100):
        self.pool, self.max_views, self.buffer = pool, max_views, Counter()

    async def view(self, item_id):
        self.buffer[item_id] += 1
        if sum(self.buffer.values()) >= self.max_views:
            await self.flush()

    async def flush(self):
        batch, self.buffer = self.buffer, Counter()
        try:
            async with self.pool.connection() as conn, conn.transaction():
                for item, n in batch.items():
                    await conn.execute("INSERT INTO view_counts (item_id) VALUES (%s) ON CONFLICT DO NOTHING", (item,))
                    for _ in range(n):  # one +1 per buffered view
                        await conn.execute("UPDATE view_counts SET views = views + 1 WHERE item_id = %s", (item,))
        except Exception:
            self.buffer.update(batch)
            raise

    async def close(self):
        await self.flush()
"""

# the kept solution, plus a ticker of its own started in __init__: it writes 9 views that are not
# max_views yet. The check fires the timers a counter leaves running at once, so the interval
# (0.2 s, or a minute that no grading run lasts) makes no difference
TICKER = (
    COUNTER.replace(
        """from collections import Counter
""",
        """import asyncio
from collections import Counter
""",
    )
    .replace(
        """        self.buffer = Counter()
""",
        """        self.buffer = Counter()
        self._ticker = asyncio.get_running_loop().create_task(self._tick(TICK))

    async def _tick(self, interval):
        while True:
            await asyncio.sleep(interval)
            try:
                await self.flush()
            except Exception:
                pass
""",
    )
    .replace(
        """    async def close(self):
        await self.flush()""",
        """    async def close(self):
        self._ticker.cancel()
        await self.flush()""",
    )
)
TICKER_FAST, TICKER_SLOW = TICKER.replace("TICK", "0.2"), TICKER.replace("TICK", "60")
assert "create_task(self._tick(0.2))" in TICKER_FAST and "self._ticker.cancel()" in TICKER_SLOW

# max(seq) + 1 retried on a duplicate key: three tries are not enough for 10 senders (the check forces
# each round of retries to read before any of it inserts: 3 numbers, 7 errors on every run); tried
# until it inserts, it is correct (unique, gap-free, never a hole: the key refuses a taken number)
MAX_PLUS_ONE_THREE_TRIES = """
import psycopg

async def send_message(pool, conversation_id, sender, body):
    for attempt in range(3):
        try:
            async with pool.connection() as conn, conn.transaction():
                cur = await conn.execute(
                    "SELECT coalesce(max(seq), 0) + 1 FROM chat_messages WHERE conversation_id = %s",
                    (conversation_id,))
                (seq,) = await cur.fetchone()
                await conn.execute(
                    "INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                    (conversation_id, seq, sender, body))
            return seq
        except psycopg.errors.UniqueViolation:
            if attempt == 2:
                raise
"""
MAX_PLUS_ONE_RETRIED = """
import psycopg

async def send_message(pool, conversation_id, sender, body):
    while True:
        try:
            async with pool.connection() as conn, conn.transaction():
                cur = await conn.execute(
                    "SELECT coalesce(max(seq), 0) + 1 FROM chat_messages WHERE conversation_id = %s",
                    (conversation_id,))
                (seq,) = await cur.fetchone()
                await conn.execute(
                    "INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                    (conversation_id, seq, sender, body))
            return seq
        except psycopg.errors.UniqueViolation:
            continue  # another sender took that number: read the maximum again
"""

# ----------------------------------------------------------------------------- found by the outside audit
# The conversation row ensured with ON CONFLICT DO NOTHING, its counter read, then written back: a
# sender whose ON CONFLICT waited on another's uncommitted update reads later than the rest, so how
# many senders collide varies; the feedback names what went wrong, not how often.
READ_THEN_WRITE_COUNTER = """
import psycopg
import asyncio

async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("INSERT INTO chat_conversations (id) VALUES (%s) ON CONFLICT DO NOTHING", (conversation_id,))
        cur = await conn.execute("SELECT last_seq FROM chat_conversations WHERE id=%s", (conversation_id,))
        (last,) = await cur.fetchone()
        seq = last + 1
        await conn.execute("UPDATE chat_conversations SET last_seq=%s WHERE id=%s", (seq, conversation_id))
        await conn.execute("INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s,%s,%s,%s)",
                           (conversation_id, seq, sender, body))
    return seq
"""

# The database's refusal is swallowed: the caller is told the message was sent.
SWALLOWED_ERROR = """
import psycopg
import asyncio

async def _send(pool, conversation_id, sender, body):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO chat_conversations AS c (id, last_seq) VALUES (%s, 1) "
            "ON CONFLICT (id) DO UPDATE SET last_seq = c.last_seq + 1 RETURNING last_seq", (conversation_id,))
        (seq,) = await cur.fetchone()
        await conn.execute("INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s,%s,%s,%s)",
                           (conversation_id, seq, sender, body))
    return seq

async def send_message(pool, conversation_id, sender, body):
    try:
        return await _send(pool, conversation_id, sender, body)
    except Exception:
        return -1
"""

# One statement: a CTE takes the number and inserts the message.
CTE_SINGLE_STATEMENT = """
import psycopg
import asyncio

async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn:
        cur = await conn.execute(
            "WITH s AS (INSERT INTO chat_conversations AS c (id, last_seq) VALUES (%(c)s, 1) "
            "ON CONFLICT (id) DO UPDATE SET last_seq = c.last_seq + 1 RETURNING last_seq) "
            "INSERT INTO chat_messages (conversation_id, seq, sender, body) "
            "SELECT %(c)s, s.last_seq, %(s)s, %(b)s FROM s RETURNING seq",
            {"c": conversation_id, "s": sender, "b": body})
        return (await cur.fetchone())[0]
"""

# A per-conversation advisory lock, then max(seq) + 1.
ADVISORY_PER_CONVERSATION = """
import psycopg
import asyncio

async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 11))", (conversation_id,))
        cur = await conn.execute("SELECT coalesce(max(seq), 0) + 1 FROM chat_messages WHERE conversation_id=%s", (conversation_id,))
        (seq,) = await cur.fetchone()
        await conn.execute("INSERT INTO chat_conversations (id, last_seq) VALUES (%s, %s) "
                           "ON CONFLICT (id) DO UPDATE SET last_seq = EXCLUDED.last_seq", (conversation_id, seq))
        await conn.execute("INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s,%s,%s,%s)",
                           (conversation_id, seq, sender, body))
    return seq
"""

# One statement per flush over jsonb_each_text.
FLUSH_JSONB = """
from collections import Counter
import json

class ViewCounter:
    def __init__(self, pool, max_views: int = 100):
        self.pool = pool
        self.max_views = max_views
        self.buffer = Counter()

    async def view(self, item_id: str) -> None:
        self.buffer[item_id] += 1
        if sum(self.buffer.values()) >= self.max_views:
            await self.flush()

    async def flush(self) -> None:
        if not self.buffer:
            return
        batch, self.buffer = self.buffer, Counter()
        try:
            async with self.pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO view_counts (item_id, views) "
                    "SELECT key, value::bigint FROM jsonb_each_text(%s::jsonb) "
                    "ON CONFLICT (item_id) DO UPDATE SET views = view_counts.views + EXCLUDED.views",
                    (json.dumps(dict(batch)),))
        except Exception:
            for k, v in batch.items():
                self.buffer[k] += v
            raise

    async def close(self) -> None:
        await self.flush()

"""

# The counter row looked up with FOR UPDATE and inserted when missing: two first senders of a new
# conversation both find no row (FOR UPDATE locks nothing that does not exist) and both insert it.
CREATE_ROW_RACE = """
async def send_message(pool, conversation_id, sender, body):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT last_seq FROM chat_conversations WHERE id = %s FOR UPDATE", (conversation_id,))
        row = await cur.fetchone()
        if row is None:
            await conn.execute("INSERT INTO chat_conversations (id, last_seq) VALUES (%s, 1)", (conversation_id,))
            seq = 1
        else:
            seq = row[0] + 1
            await conn.execute("UPDATE chat_conversations SET last_seq = %s WHERE id = %s", (seq, conversation_id))
        await conn.execute("INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
                           (conversation_id, seq, sender, body))
    return seq
"""

# The flush overwrites the stored total with the batch's count (a total where a delta belongs).
OVERWRITES_TOTAL = COUNTER.replace("views = c.views + EXCLUDED.views", "views = EXCLUDED.views")
assert OVERWRITES_TOTAL != COUNTER

WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "view_counter": {
        "one UPDATE per view": (PER_VIEW, "one write per view"),
        "flushes only on close": (ONLY_ON_CLOSE, "must flush once max_views views are buffered"),
        "close drops the buffer": (CLOSE_DROPS, "graceful shutdown must flush"),
        "clear after the write": (CLEAR_AFTER_WRITE, "cleared (or overwrote) the buffer after its write"),
        "read, then write the total": (READ_THEN_WRITE, "lost update"),
        "drop the batch on failure": (DROP_ON_FAILURE, "views were dropped"),
        "item by item, all put back": (ITEM_BY_ITEM_ALL_BACK, "commits all of it or nothing"),
        "a +1 per buffered view in the flush": (ONE_ROW_PER_VIEW_IN_FLUSH, "the views are not batched"),
        "a ticker in __init__": (TICKER_FAST, "belongs to the service, not to ViewCounter"),
        "a slow ticker in __init__": (TICKER_SLOW, "belongs to the service, not to ViewCounter"),
        "the flush overwrites the total": (OVERWRITES_TOTAL, "instead of adding it"),
    },
    "send_message": {
        "timestamp as order": (TIMESTAMP, "a timestamp or a global id is not a sequence number"),
        "one global sequence": (GLOBAL_SEQUENCE, "numbers are per conversation"),
        "max(seq) + 1 without a lock": (MAX_PLUS_ONE, "all picked the same number"),
        "a lock in one process": (IN_PROCESS_LOCK, "a lock held in one process does not stop the other replica"),
        "separate counter statement": (SEPARATE_COUNTER_STATEMENT, "used up a number"),
        "counter committed before the message": (COUNTER_COMMITTED_FIRST, "a hole a client takes for a lost"),
        "one lock for all conversations": (GLOBAL_LOCK, "one lock serialises every conversation"),
        "max(seq) + 1, three tries": (
            MAX_PLUS_ONE_THREE_TRIES,
            'some raised UniqueViolation: duplicate key value violates unique constraint "chat_messages_pkey"; '
            "the stored seqs are not 1..10. Senders that read max(seq) (or a counter) before any of them wrote "
            "all picked the same number",
        ),
        "read the counter, write it back": (READ_THEN_WRITE_COUNTER, "all picked the same number"),
        "the refused send returns normally": (SWALLOWED_ERROR, "returned normally, as if the message were stored"),
        "the counter row created after a lookup": (CREATE_ROW_RACE, "locks no row that does not exist yet"),
    },
}

# The course's own references (course.counters.BatchedCounter, course.chat.send_message) are not
# listed: REFERENCES in autograder/checks/ch11/__init__.py names them, and the grader gives zero to an answer
# that only imports them. tests/test_11_patterns.py tests them directly.
CORRECT: dict[str, dict[str, str]] = {
    "view_counter": {
        "one statement, swap the buffer": COUNTER,
        "one transaction per flush, a lock": ONE_TRANSACTION_PER_ITEM,
        "autocommit rows, put back only the unwritten": SWALLOW_AND_KEEP,
        "one statement over jsonb_each_text": FLUSH_JSONB,
        "a dataclass": AS_DATACLASS,
    },
    "send_message": {
        "upsert the counter row, RETURNING": ROW_LOCK,
        "ensure the row, then UPDATE RETURNING": UPDATE_THEN_INSERT_ROW,
        "max(seq) + 1 under the conversation's row lock": MAX_PLUS_ONE_UNDER_LOCK,
        "max(seq) + 1, retried until it inserts": MAX_PLUS_ONE_RETRIED,
        "one CTE statement": CTE_SINGLE_STATEMENT,
        "an advisory lock per conversation": ADVISORY_PER_CONVERSATION,
    },
}

_WRONG = [(task, name) for task, cases in WRONG.items() for name in cases]
_CORRECT = [(task, name) for task, cases in CORRECT.items() for name in cases]


@pytest.mark.parametrize(("task", "name"), _WRONG, ids=[f"{t}: {n}" for t, n in _WRONG])
def test_11_wrong_answer_is_rejected_for_its_mistake(task, name):
    source, mentions = WRONG[task][name]
    assert_rejected(task, source, mentions=mentions)


@pytest.mark.parametrize(("task", "name"), _CORRECT, ids=[f"{t}: {n}" for t, n in _CORRECT])
def test_11_correct_design_is_accepted(task, name):
    assert_accepted(task, CORRECT[task][name])


@pytest.mark.slow
def test_a_dataclass_answer_gets_full_marks_through_course_check(tmp_path):
    """The real grading path (sandboxed runner, replicas made from the answer cell) runs a
    ``@dataclass`` answer as the kernel does: under the grader's own future imports a
    dataclass defined in a module-less cell crashed its replicas."""
    from autograder.check import check

    path = notebook_with_answers("11_counting_and_fanout", {"view_counter": AS_DATACLASS}, tmp_path)
    scores = {t.id: (t.points, t.max_points) for t in check(path).tasks}
    assert scores["view_counter"][0] == scores["view_counter"][1], scores
