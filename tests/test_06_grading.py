"""Chapter 06 grading: the wrong sagas and relays learners write are rejected, correct designs pass.

Each answer is kept as the source a learner would type into the answer cell. The crashes
(before every write), the transient failures and the races (two recoverers, two relays)
are made by the checks (autograder/checks/ch06.py), so every verdict is the same on every run.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_accepted, assert_rejected

# ----------------------------------------------------------------------------- order_saga: pieces

HEADER = """
import asyncio
from psycopg.types.json import Jsonb
from course.chapters.ch06.shop import StepFailed, reserve_stock, charge_payment, schedule_shipment
"""

RELEASE = """
async def release_stock(pool, order):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s AND status = 'reserved' "
            "RETURNING sku, qty", (order["order_id"],))
        row = await cur.fetchone()
        if row is not None:
            await conn.execute("UPDATE ch06_stock SET available = available + %s WHERE sku = %s", (row[1], row[0]))
"""

REFUND = """
async def refund_payment(pool, order):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents", (order["order_id"],))
        row = await cur.fetchone()
        if row is not None:
            await conn.execute("UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s",
                               (row[1], row[0]))
"""

CANCEL = """
async def cancel_shipment(pool, order):
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
            (order["order_id"],))
"""

COMPENSATIONS = RELEASE + REFUND + CANCEL

STEPS = """
STEPS = [
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


async def log(pool, saga_id, step, event, data=None):
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                           (saga_id, step, event, Jsonb(data) if data is not None else None))


async def until_done(undo, pool, order, sleep):
    delay = 0.05
    while True:
        try:
            return await undo(pool, order)
        except Exception:
            await sleep(delay)
            delay = min(2 * delay, 2.0)
"""

# forward recovery: the task's own definition
COMPENSATE = """
async def compensate(pool, order, started, compensated, sleep):
    for name, _, undo in reversed(STEPS):
        if name in started and name not in compensated:
            await until_done(undo, pool, order, sleep)
            await log(pool, order["order_id"], name, "compensated")
    await log(pool, order["order_id"], "saga", "compensated")
    return "compensated"
"""

FORWARD = """
async def forward(pool, order, done, sleep):
    started = set(done)
    for name, action, _ in STEPS:
        if name in done:
            continue
        await log(pool, order["order_id"], name, "started")
        started.add(name)
        try:
            await action(pool, order)
        except StepFailed as err:
            await log(pool, order["order_id"], name, "failed", {"error": str(err)})
            return await compensate(pool, order, started, set(), sleep)
        await log(pool, order["order_id"], name, "done")
    await log(pool, order["order_id"], "saga", "completed")
    return "completed"


async def run_order_saga(pool, order, *, sleep=asyncio.sleep):
    await log(pool, order["order_id"], "saga", "begin", order)
    return await forward(pool, order, set(), sleep)
"""

RECOVER = """
async def recover_sagas(pool, *, sleep=asyncio.sleep):
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id HAVING bool_or(step = 'saga' AND event = 'begin') "
            "AND NOT bool_or(step = 'saga' AND event IN ('completed', 'compensated')) ORDER BY min(id)")
        ids = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in ids:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id",
                                     (saga_id,))
            rows = await cur.fetchall()
        order = next(data for step, event, data in rows if step == "saga" and event == "begin")
        started = {step for step, event, _ in rows if event == "started"}
        done = {step for step, event, _ in rows if event == "done"}
        compensated = {step for step, event, _ in rows if event == "compensated" and step != "saga"}
        if compensated or any(event == "failed" for _, event, _ in rows):
            await compensate(pool, order, started, compensated, sleep)
        else:
            await forward(pool, order, done, sleep)
        finished.append(saga_id)
    return finished
"""

SAGA = HEADER + COMPENSATIONS + STEPS + COMPENSATE + FORWARD + RECOVER

# ----------------------------------------------------------------------------- order_saga: correct designs

# Backward recovery: a restarted orchestrator aborts whatever was in flight, compensating every
# started step (the in-flight one included), each saga claimed with an advisory lock.
BACKWARD = (
    HEADER
    + COMPENSATIONS
    + STEPS
    + COMPENSATE
    + FORWARD
    + """
async def recover_sagas(pool, *, sleep=asyncio.sleep):
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id HAVING NOT bool_or(step = 'saga' "
            "AND event IN ('completed', 'compensated'))")
        ids = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in ids:
        async with pool.connection() as claim:
            got = await (await claim.execute("SELECT pg_try_advisory_lock(hashtext(%s))", (saga_id,))).fetchone()
            if not got[0]:
                continue
            try:
                cur = await claim.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id",
                                          (saga_id,))
                rows = await cur.fetchall()
                if any(s == "saga" and e in ("completed", "compensated") for s, e, _ in rows):
                    continue
                order = next(d for s, e, d in rows if s == "saga" and e == "begin")
                started = {s for s, e, _ in rows if e == "started"}
                compensated = {s for s, e, _ in rows if e == "compensated"}
                await compensate(pool, order, started, compensated, sleep)
                finished.append(saga_id)
            finally:
                await claim.execute("SELECT pg_advisory_unlock(hashtext(%s))", (saga_id,))
    return finished
"""
)

# Only "done" is logged: recovery re-runs the first step not done (steps are idempotent),
# and compensates the done steps plus the one that failed.
DONE_ONLY = (
    HEADER
    + COMPENSATIONS
    + STEPS
    + COMPENSATE
    + """
async def forward(pool, order, done, sleep):
    for name, action, _ in STEPS:
        if name in done:
            continue
        try:
            await action(pool, order)
        except StepFailed as err:
            await log(pool, order["order_id"], name, "failed", {"error": str(err)})
            return await compensate(pool, order, set(done) | {name}, set(), sleep)
        await log(pool, order["order_id"], name, "done")
        done = done | {name}
    await log(pool, order["order_id"], "saga", "completed")
    return "completed"


async def run_order_saga(pool, order, *, sleep=asyncio.sleep):
    await log(pool, order["order_id"], "saga", "begin", order)
    return await forward(pool, order, set(), sleep)


async def recover_sagas(pool, *, sleep=asyncio.sleep):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT saga_id, step, event, data FROM saga_log ORDER BY id")
        rows = await cur.fetchall()
    sagas = {}
    for saga_id, step, event, data in rows:
        sagas.setdefault(saga_id, []).append((step, event, data))
    finished = []
    for saga_id, log_rows in sagas.items():
        if any(s == "saga" and e in ("completed", "compensated") for s, e, _ in log_rows):
            continue
        order = next(d for s, e, d in log_rows if s == "saga" and e == "begin")
        done = {s for s, e, _ in log_rows if e == "done"}
        failed = {s for s, e, _ in log_rows if e == "failed"}
        compensated = {s for s, e, _ in log_rows if e == "compensated"}
        if failed or compensated:
            await compensate(pool, order, done | failed, compensated, sleep)
        else:
            await forward(pool, order, done, sleep)
        finished.append(saga_id)
    return finished
"""
)

# ----------------------------------------------------------------------------- order_saga: wrong answers

WRONG_ORDER = SAGA.replace("for name, _, undo in reversed(STEPS):", "for name, _, undo in STEPS:")

NON_IDEMPOTENT_RELEASE = SAGA.replace(
    RELEASE,
    """
async def release_stock(pool, order):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("UPDATE ch06_stock SET available = available + %s WHERE sku = %s",
                           (order["qty"], order["sku"]))
        await conn.execute("UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s",
                           (order["order_id"],))
""",
)

BLIND_REFUND = SAGA.replace(
    REFUND,
    """
async def refund_payment(pool, order):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s", (order["order_id"],))
        await conn.execute("UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s",
                           (order["amount_cents"], order["customer"]))
""",
)

# The refund's two writes in two transactions: a failure between them loses the money.
SPLIT_REFUND = SAGA.replace(
    REFUND,
    """
async def refund_payment(pool, order):
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents", (order["order_id"],))
        row = await cur.fetchone()
        if row is not None:
            await conn.execute("UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s",
                               (row[1], row[0]))
""",
)

# Check, then act: idempotent one call at a time, not when two recoverers run it at once.
CHECK_THEN_RELEASE = SAGA.replace(
    RELEASE,
    """
async def release_stock(pool, order):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status, sku, qty FROM ch06_reservations WHERE order_id = %s",
                                 (order["order_id"],))
        row = await cur.fetchone()
        if row is None or row[0] != "reserved":
            return
        async with conn.transaction():
            await conn.execute("UPDATE ch06_stock SET available = available + %s WHERE sku = %s", (row[2], row[1]))
            await conn.execute("UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s",
                               (order["order_id"],))
""",
)

SKIPS_FAILED_COMPENSATION = SAGA.replace(
    """            await until_done(undo, pool, order, sleep)""",
    """            try:
                await undo(pool, order)
            except Exception as err:
                print("compensation failed, moving on:", err)""",
)

# Retries a failing compensation, but gives up after three tries (the text says: until it succeeds).
GIVES_UP_AFTER_THREE = SAGA.replace(
    """async def until_done(undo, pool, order, sleep):
    delay = 0.05
    while True:
        try:
            return await undo(pool, order)
        except Exception:
            await sleep(delay)
            delay = min(2 * delay, 2.0)""",
    """async def until_done(undo, pool, order, sleep):
    delay = 0.05
    for attempt in range(3):
        try:
            return await undo(pool, order)
        except Exception:
            if attempt == 2:
                raise
            await sleep(delay)
            delay = min(2 * delay, 2.0)""",
)

# Issue 28 audit: recovery works but does not return the ids of the sagas it finished.
RECOVER_RETURNS_NOTHING = SAGA.replace("    return finished\n", "    return []\n")

# Retries with asyncio.sleep, not the injected sleep (a real wait; shortened here to keep the test fast).
REAL_SLEEP = SAGA.replace("            await sleep(delay)\n", "            await asyncio.sleep(delay / 50)\n")

NO_RETRY = SAGA.replace(
    """            await until_done(undo, pool, order, sleep)""", """            await undo(pool, order)"""
)

# No saga log: compensations in memory, nothing for a new process to recover from.
NO_LOG = (
    HEADER
    + COMPENSATIONS
    + """
STEPS = [
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


async def run_order_saga(pool, order, *, sleep=asyncio.sleep):
    done = []
    for name, action, undo in STEPS:
        try:
            await action(pool, order)
        except StepFailed:
            for undo_done in reversed(done + [undo]):
                while True:
                    try:
                        await undo_done(pool, order)
                        break
                    except Exception:
                        await sleep(0.1)
            return "compensated"
        done.append(undo)
    return "completed"


async def recover_sagas(pool, *, sleep=asyncio.sleep):
    return []
"""
)

# The log kept in the process: a new process starts with an empty dict.
IN_MEMORY_LOG = SAGA.replace(
    """async def log(pool, saga_id, step, event, data=None):
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                           (saga_id, step, event, Jsonb(data) if data is not None else None))
""",
    """SAGA_LOG = []


async def log(pool, saga_id, step, event, data=None):
    SAGA_LOG.append((saga_id, step, event, data))
    if step == "saga" and event in ("completed", "compensated"):
        async with pool.connection() as conn:  # only the outcome reaches the database
            await conn.execute("INSERT INTO saga_log (saga_id, step, event) VALUES (%s, 'saga', 'begin'), "
                               "(%s, %s, %s)", (saga_id, saga_id, step, event))
""",
).replace(
    """    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id HAVING bool_or(step = 'saga' AND event = 'begin') "
            "AND NOT bool_or(step = 'saga' AND event IN ('completed', 'compensated')) ORDER BY min(id)")
        ids = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in ids:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id",
                                     (saga_id,))
            rows = await cur.fetchall()
""",
    """    ids = {s for s, *_ in SAGA_LOG} - {s for s, st, e, _ in SAGA_LOG if st == "saga" and e != "begin"}
    finished = []
    for saga_id in ids:
        rows = [(st, e, d) for s, st, e, d in SAGA_LOG if s == saga_id]
""",
)

# Backward recovery that compensates only the steps logged done: the step that was in
# flight when the process died (committed, not yet logged) is never undone.
BACKWARD_SKIPS_IN_FLIGHT = BACKWARD.replace(
    """                started = {s for s, e, _ in rows if e == "started"}""",
    """                started = {s for s, e, _ in rows if e == "done"}""",
)


# ----------------------------------------------------------------------------- outbox_relay

PLACE = """
import json
from psycopg.types.json import Jsonb


async def place_order(pool, redis, stream, order):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
                           (order["order_id"], order["customer"], order["amount_cents"]))
        await conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                           "VALUES ('order', %s, 'OrderPlaced', %s)", (order["order_id"], Jsonb(order)))
"""

FIELDS = """
def fields(event_id, aggregate_id, event_type, payload):
    return {"event_id": str(event_id), "aggregate_id": aggregate_id, "event_type": event_type,
            "payload": json.dumps(payload)}
"""

# one relay at a time: a transaction-level advisory lock the second relay waits for
LEADER_WAITS = (
    PLACE
    + FIELDS
    + """
async def relay_batch(pool, redis, stream, *, limit=10):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(6061)")
        cur = await conn.execute("SELECT id, aggregate_id, event_type, payload FROM outbox "
                                 "WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE", (limit,))
        rows = await cur.fetchall()
        for row in rows:
            await redis.xadd(stream, fields(*row))
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
"""
)

# no SKIP LOCKED: the second relay waits on the first one's rows, then re-checks them
WAITS_ON_ROWS = LEADER_WAITS.replace('        await conn.execute("SELECT pg_advisory_xact_lock(6061)")\n', "")

# the second relay gets out at once when another holds the leader lock, and publishes with a pipeline
LEADER_SKIPS = (
    PLACE
    + FIELDS
    + """
async def relay_batch(pool, redis, stream, *, limit=10):
    async with pool.connection() as conn, conn.transaction():
        leader = await (await conn.execute("SELECT pg_try_advisory_xact_lock(6062)")).fetchone()
        if not leader[0]:
            return 0
        cur = await conn.execute("SELECT id, aggregate_id, event_type, payload FROM outbox "
                                 "WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED", (limit,))
        rows = await cur.fetchall()
        if not rows:
            return 0
        pipe = redis.pipeline(transaction=False)
        for row in rows:
            pipe.xadd(stream, fields(*row))
        await pipe.execute()
        await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
"""
)

# SKIP LOCKED, but only the oldest unpublished event of each order is eligible
HEADS_ONLY = (
    PLACE
    + FIELDS
    + """
async def relay_batch(pool, redis, stream, *, limit=10):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT id, aggregate_id, event_type, payload FROM outbox o WHERE published_at IS NULL "
            "AND NOT EXISTS (SELECT 1 FROM outbox p WHERE p.aggregate_id = o.aggregate_id "
            "AND p.published_at IS NULL AND p.id < o.id) "
            "ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED", (limit,))
        rows = await cur.fetchall()
        for row in rows:
            await redis.xadd(stream, fields(*row))
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
"""
)

# the course's own relay: partitions of aggregate ids, each behind an advisory lock
COURSE_RELAY = (
    PLACE
    + """
from course import outbox


async def relay_batch(pool, redis, stream, *, limit=10):
    return await outbox.relay_batch(pool, redis, stream, limit=limit)
"""
)

SKIP_LOCKED = LEADER_WAITS.replace('        await conn.execute("SELECT pg_advisory_xact_lock(6061)")\n', "").replace(
    "FOR UPDATE", "FOR UPDATE SKIP LOCKED"
)

IN_PROCESS_LOCK = (
    PLACE
    + FIELDS
    + """
import asyncio

ONE_AT_A_TIME = asyncio.Lock()  # one relay at a time... in this process


async def relay_batch(pool, redis, stream, *, limit=10):
    async with ONE_AT_A_TIME, pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT id, aggregate_id, event_type, payload FROM outbox "
                                 "WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED", (limit,))
        rows = await cur.fetchall()
        for row in rows:
            await redis.xadd(stream, fields(*row))
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
"""
)

IGNORES_LIMIT = (
    PLACE
    + FIELDS
    + """
async def relay_batch(pool, redis, stream, *, limit=10):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT id, aggregate_id, event_type, payload FROM outbox "
                                 "WHERE published_at IS NULL ORDER BY id FOR UPDATE SKIP LOCKED")
        rows = await cur.fetchall()
        for row in rows:
            await redis.xadd(stream, fields(*row))
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
"""
)

DUAL_WRITE = (
    FIELDS
    + """
import json


async def place_order(pool, redis, stream, order):
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
                           (order["order_id"], order["customer"], order["amount_cents"]))
    await redis.xadd(stream, fields(order["order_id"], order["order_id"], "OrderPlaced", order))


async def relay_batch(pool, redis, stream, *, limit=10):
    return 0
"""
)

TWO_COMMITS = LEADER_WAITS.replace(
    '    async with pool.connection() as conn, conn.transaction():\n        await conn.execute("INSERT INTO ch06_orders',
    '    async with pool.connection() as conn:\n        await conn.execute("INSERT INTO ch06_orders',
)

# marks, commits, then publishes (one relay at a time, so the order holds): a failed XADD loses the event
MARK_FIRST = (
    PLACE
    + FIELDS
    + """
async def relay_batch(pool, redis, stream, *, limit=10):
    async with pool.connection() as conn:
        await conn.execute("SELECT pg_advisory_lock(6063)")
        try:
            cur = await conn.execute(
                "UPDATE outbox SET published_at = now() WHERE id IN (SELECT id FROM outbox "
                "WHERE published_at IS NULL ORDER BY id LIMIT %s) RETURNING id, aggregate_id, event_type, payload",
                (limit,))
            rows = sorted(await cur.fetchall())
            for row in rows:
                await redis.xadd(stream, fields(*row))
        finally:
            await conn.execute("SELECT pg_advisory_unlock(6063)")
    return len(rows)
"""
)

# Issue 28: claims its rows by marking them published first, with no lock: the second relay takes the
# order's next events and publishes them first. No SKIP LOCKED anywhere: the feedback must not blame it.
MARK_FIRST_UNLOCKED = (
    PLACE
    + FIELDS
    + """
async def relay_batch(pool, redis, stream, *, limit=10):
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE outbox SET published_at = now() WHERE id IN (SELECT id FROM outbox "
            "WHERE published_at IS NULL ORDER BY id LIMIT %s) RETURNING id, aggregate_id, event_type, payload",
            (limit,))
        rows = sorted(await cur.fetchall())
    for row in rows:
        await redis.xadd(stream, fields(*row))
    return len(rows)
"""
)

# Returns the limit it asked for, not how many it published.
RETURNS_LIMIT = LEADER_WAITS.replace("    return len(rows)", "    return limit if rows else 0")

SWALLOWS_PUBLISH_ERROR = LEADER_WAITS.replace(
    "            await redis.xadd(stream, fields(*row))",
    "            try:\n                await redis.xadd(stream, fields(*row))\n"
    "            except Exception as err:\n                print('publish failed:', err)",
)

FRESH_EVENT_ID = LEADER_WAITS.replace(
    '    return {"event_id": str(event_id),', '    import uuid\n    return {"event_id": str(uuid.uuid4()),'
)


# SKIP LOCKED one row per transaction: the second relay reaches the held order's next event only on a
# later call, so the check lets it run again while the first is held
SKIP_LOCKED_ROW_AT_A_TIME = """
import json
from psycopg.types.json import Jsonb


async def place_order(pool, redis, stream, order):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
                           (order["order_id"], order["customer"], order["amount_cents"]))
        await conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                           "VALUES ('order', %s, 'OrderPlaced', %s)", (order["order_id"], Jsonb(order)))

def fields(event_id, aggregate_id, event_type, payload):
    return {"event_id": str(event_id), "aggregate_id": aggregate_id, "event_type": event_type,
            "payload": json.dumps(payload)}

async def relay_batch(pool, redis, stream, *, limit=10):
    n = 0
    while n < limit:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute("SELECT id, aggregate_id, event_type, payload FROM outbox "
                                     "WHERE published_at IS NULL ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED")
            row = await cur.fetchone()
            if row is None:
                break
            await redis.xadd(stream, fields(*row))
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = %s", (row[0],))
        n += 1
    return n
"""

PER_AGGREGATE_ADVISORY = """
import json
from psycopg.types.json import Jsonb


async def place_order(pool, redis, stream, order):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
                           (order["order_id"], order["customer"], order["amount_cents"]))
        await conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                           "VALUES ('order', %s, 'OrderPlaced', %s)", (order["order_id"], Jsonb(order)))

def fields(event_id, aggregate_id, event_type, payload):
    return {"event_id": str(event_id), "aggregate_id": aggregate_id, "event_type": event_type,
            "payload": json.dumps(payload)}

async def relay_batch(pool, redis, stream, *, limit=10):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT DISTINCT aggregate_id FROM outbox WHERE published_at IS NULL")
        mine = [a for (a,) in await cur.fetchall()
                if (await (await conn.execute("SELECT pg_try_advisory_xact_lock(hashtext(%s))", (a,))).fetchone())[0]]
        cur = await conn.execute("SELECT id, aggregate_id, event_type, payload FROM outbox "
                                 "WHERE published_at IS NULL AND aggregate_id = ANY(%s) ORDER BY id LIMIT %s FOR UPDATE",
                                 (mine, limit))
        rows = await cur.fetchall()
        for row in rows:
            await redis.xadd(stream, fields(*row))
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
"""

SKIP_LOCKED_RECHECK_EARLIER = """
import json
from psycopg.types.json import Jsonb


async def place_order(pool, redis, stream, order):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
                           (order["order_id"], order["customer"], order["amount_cents"]))
        await conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                           "VALUES ('order', %s, 'OrderPlaced', %s)", (order["order_id"], Jsonb(order)))

def fields(event_id, aggregate_id, event_type, payload):
    return {"event_id": str(event_id), "aggregate_id": aggregate_id, "event_type": event_type,
            "payload": json.dumps(payload)}

async def relay_batch(pool, redis, stream, *, limit=10):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT id, aggregate_id, event_type, payload FROM outbox "
                                 "WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED", (limit,))
        rows, blocked = [], set()
        for row in await cur.fetchall():
            if row[1] in blocked:
                continue
            cur = await conn.execute("SELECT 1 FROM outbox WHERE aggregate_id = %s AND published_at IS NULL AND id < %s "
                                     "AND id <> ALL(%s)", (row[1], row[0], [r[0] for r in rows]))
            if await cur.fetchone():
                blocked.add(row[1])
                continue
            rows.append(row)
        for row in rows:
            await redis.xadd(stream, fields(*row))
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
"""

PROCESS_LOCK_PLUS_FOR_UPDATE = """
import json
from psycopg.types.json import Jsonb


async def place_order(pool, redis, stream, order):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
                           (order["order_id"], order["customer"], order["amount_cents"]))
        await conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                           "VALUES ('order', %s, 'OrderPlaced', %s)", (order["order_id"], Jsonb(order)))

def fields(event_id, aggregate_id, event_type, payload):
    return {"event_id": str(event_id), "aggregate_id": aggregate_id, "event_type": event_type,
            "payload": json.dumps(payload)}

import asyncio
LOCK = asyncio.Lock()

async def relay_batch(pool, redis, stream, *, limit=10):
    async with LOCK:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute("SELECT id, aggregate_id, event_type, payload FROM outbox "
                                     "WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE", (limit,))
            rows = await cur.fetchall()
            for row in rows:
                await redis.xadd(stream, fields(*row))
            if rows:
                await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
        return len(rows)
"""


# ----------------------------------------------------------------------------- found by audit B

SAGA_FAILED_STEP_NOT_COMPENSATED = '''
import asyncio
from psycopg.types.json import Jsonb

from course.chapters.ch06.shop import StepFailed, charge_payment, reserve_stock, schedule_shipment

async def release_stock(pool, order: dict) -> None:
    """Undo reserve_stock: reserved -> released, and only then the stock goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s AND status = 'reserved' "
            "RETURNING sku, qty",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute("UPDATE ch06_stock SET available = available + %s WHERE sku = %s", (row[1], row[0]))


async def refund_payment(pool, order: dict) -> None:
    """Undo charge_payment: charged -> refunded, and only then the money goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute(
                "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s", (row[1], row[0])
            )


async def cancel_shipment(pool, order: dict) -> None:
    """Undo schedule_shipment: scheduled -> cancelled."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
            (order["order_id"],),
        )


STEPS = [  # (name, step, compensation), in the order the saga runs them
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


async def finish_saga(pool, order: dict, log_rows: list, *, sleep) -> str:
    """Drive a saga to its end from what its log says so far (log_rows: [(step, event), ...])."""
    saga_id = order["order_id"]

    async def log(step, event, data=None):
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                (saga_id, step, event, Jsonb(data) if data is not None else None),
            )

    started = [step for step, event in log_rows if event == "started"]
    done = {step for step, event in log_rows if event == "done"}
    undone = {step for step, event in log_rows if event == "compensated" and step != "saga"}
    compensating = bool(undone) or any(event == "failed" for _, event in log_rows)

    if not compensating:
        for name, step, _ in STEPS:
            if name in done:
                continue
            await log(name, "started")
            started.append(name)
            try:
                await step(pool, order)
            except StepFailed as err:
                await log(name, "failed", {"error": str(err)})
                started.remove(name)  # it failed: nothing to undo
                break
            await log(name, "done")
        else:
            await log("saga", "completed")
            return "completed"

    for name, _, compensation in reversed(STEPS):
        if name not in started or name in undone:
            continue
        delay = 0.05
        while True:
            try:
                await compensation(pool, order)
                break
            except Exception:  # a compensation cannot say no: it is retried until it succeeds
                await sleep(delay)
                delay = min(2 * delay, 2.0)
        await log(name, "compensated")
    await log("saga", "compensated")
    return "compensated"


async def run_order_saga(pool, order: dict, *, sleep=asyncio.sleep) -> str:
    """Run a new order saga; 'completed' or 'compensated'."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, 'saga', 'begin', %s)",
            (order["order_id"], Jsonb(order)),
        )
    return await finish_saga(pool, order, [], sleep=sleep)


async def recover_sagas(pool, *, sleep=asyncio.sleep) -> list[str]:
    """Finish every saga the log shows unfinished; the ids finished."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id "
            "HAVING bool_or(step = 'saga' AND event = 'begin') "
            "AND NOT bool_or(step = 'saga' AND event IN ('completed', 'compensated')) ORDER BY min(id)"
        )
        unfinished = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in unfinished:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id", (saga_id,))
            rows = await cur.fetchall()
        order = next(data for step, event, data in rows if step == "saga" and event == "begin")
        await finish_saga(pool, order, [(step, event) for step, event, _ in rows], sleep=sleep)
        finished.append(saga_id)
    return finished
    ### END SOLUTION
'''

SAGA_RECOVERY_RESTARTS_FROM_SCRATCH = '''
import asyncio
from psycopg.types.json import Jsonb

from course.chapters.ch06.shop import StepFailed, charge_payment, reserve_stock, schedule_shipment

async def release_stock(pool, order: dict) -> None:
    """Undo reserve_stock: reserved -> released, and only then the stock goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s AND status = 'reserved' "
            "RETURNING sku, qty",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute("UPDATE ch06_stock SET available = available + %s WHERE sku = %s", (row[1], row[0]))


async def refund_payment(pool, order: dict) -> None:
    """Undo charge_payment: charged -> refunded, and only then the money goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute(
                "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s", (row[1], row[0])
            )


async def cancel_shipment(pool, order: dict) -> None:
    """Undo schedule_shipment: scheduled -> cancelled."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
            (order["order_id"],),
        )


STEPS = [  # (name, step, compensation), in the order the saga runs them
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


async def finish_saga(pool, order: dict, log_rows: list, *, sleep) -> str:
    """Drive a saga to its end from what its log says so far (log_rows: [(step, event), ...])."""
    saga_id = order["order_id"]

    async def log(step, event, data=None):
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                (saga_id, step, event, Jsonb(data) if data is not None else None),
            )

    started = [step for step, event in log_rows if event == "started"]
    done = {step for step, event in log_rows if event == "done"}
    undone = {step for step, event in log_rows if event == "compensated" and step != "saga"}
    compensating = bool(undone) or any(event == "failed" for _, event in log_rows)

    if not compensating:
        for name, step, _ in STEPS:
            if name in done:
                continue
            await log(name, "started")
            started.append(name)
            try:
                await step(pool, order)
            except StepFailed as err:
                await log(name, "failed", {"error": str(err)})
                break
            await log(name, "done")
        else:
            await log("saga", "completed")
            return "completed"

    for name, _, compensation in reversed(STEPS):
        if name not in started or name in undone:
            continue
        delay = 0.05
        while True:
            try:
                await compensation(pool, order)
                break
            except Exception:  # a compensation cannot say no: it is retried until it succeeds
                await sleep(delay)
                delay = min(2 * delay, 2.0)
        await log(name, "compensated")
    await log("saga", "compensated")
    return "compensated"


async def run_order_saga(pool, order: dict, *, sleep=asyncio.sleep) -> str:
    """Run a new order saga; 'completed' or 'compensated'."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, 'saga', 'begin', %s)",
            (order["order_id"], Jsonb(order)),
        )
    return await finish_saga(pool, order, [], sleep=sleep)


async def recover_sagas(pool, *, sleep=asyncio.sleep) -> list[str]:
    """Finish every saga the log shows unfinished; the ids finished."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id "
            "HAVING bool_or(step = 'saga' AND event = 'begin') "
            "AND NOT bool_or(step = 'saga' AND event IN ('completed', 'compensated')) ORDER BY min(id)"
        )
        unfinished = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in unfinished:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id", (saga_id,))
            rows = await cur.fetchall()
        order = next(data for step, event, data in rows if step == "saga" and event == "begin")
        await finish_saga(pool, order, [], sleep=sleep)  # steps are idempotent: just run it again
        finished.append(saga_id)
    return finished
    ### END SOLUTION
'''

SAGA_RECOVERY_IGNORES_FAILED = '''
import asyncio
from psycopg.types.json import Jsonb

from course.chapters.ch06.shop import StepFailed, charge_payment, reserve_stock, schedule_shipment

async def release_stock(pool, order: dict) -> None:
    """Undo reserve_stock: reserved -> released, and only then the stock goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s AND status = 'reserved' "
            "RETURNING sku, qty",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute("UPDATE ch06_stock SET available = available + %s WHERE sku = %s", (row[1], row[0]))


async def refund_payment(pool, order: dict) -> None:
    """Undo charge_payment: charged -> refunded, and only then the money goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute(
                "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s", (row[1], row[0])
            )


async def cancel_shipment(pool, order: dict) -> None:
    """Undo schedule_shipment: scheduled -> cancelled."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
            (order["order_id"],),
        )


STEPS = [  # (name, step, compensation), in the order the saga runs them
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


async def finish_saga(pool, order: dict, log_rows: list, *, sleep) -> str:
    """Drive a saga to its end from what its log says so far (log_rows: [(step, event), ...])."""
    saga_id = order["order_id"]

    async def log(step, event, data=None):
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                (saga_id, step, event, Jsonb(data) if data is not None else None),
            )

    started = [step for step, event in log_rows if event == "started"]
    done = {step for step, event in log_rows if event == "done"}
    undone = {step for step, event in log_rows if event == "compensated" and step != "saga"}
    compensating = bool(undone)

    if not compensating:
        for name, step, _ in STEPS:
            if name in done:
                continue
            await log(name, "started")
            started.append(name)
            try:
                await step(pool, order)
            except StepFailed as err:
                await log(name, "failed", {"error": str(err)})
                break
            await log(name, "done")
        else:
            await log("saga", "completed")
            return "completed"

    for name, _, compensation in reversed(STEPS):
        if name not in started or name in undone:
            continue
        delay = 0.05
        while True:
            try:
                await compensation(pool, order)
                break
            except Exception:  # a compensation cannot say no: it is retried until it succeeds
                await sleep(delay)
                delay = min(2 * delay, 2.0)
        await log(name, "compensated")
    await log("saga", "compensated")
    return "compensated"


async def run_order_saga(pool, order: dict, *, sleep=asyncio.sleep) -> str:
    """Run a new order saga; 'completed' or 'compensated'."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, 'saga', 'begin', %s)",
            (order["order_id"], Jsonb(order)),
        )
    return await finish_saga(pool, order, [], sleep=sleep)


async def recover_sagas(pool, *, sleep=asyncio.sleep) -> list[str]:
    """Finish every saga the log shows unfinished; the ids finished."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id "
            "HAVING bool_or(step = 'saga' AND event = 'begin') "
            "AND NOT bool_or(step = 'saga' AND event IN ('completed', 'compensated')) ORDER BY min(id)"
        )
        unfinished = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in unfinished:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id", (saga_id,))
            rows = await cur.fetchall()
        order = next(data for step, event, data in rows if step == "saga" and event == "begin")
        await finish_saga(pool, order, [(step, event) for step, event, _ in rows], sleep=sleep)
        finished.append(saga_id)
    return finished
    ### END SOLUTION
'''

SAGA_RELEASE_WRITES_BACK_WHAT_IT_READ = '''
import asyncio
from psycopg.types.json import Jsonb

from course.chapters.ch06.shop import StepFailed, charge_payment, reserve_stock, schedule_shipment

async def release_stock(pool, order: dict) -> None:
    """Undo reserve_stock: reserved -> released, and only then the stock goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s AND status = 'reserved' "
            "RETURNING sku, qty",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            cur = await conn.execute("SELECT available FROM ch06_stock WHERE sku = %s", (row[0],))
            (available,) = await cur.fetchone()
            await conn.execute("UPDATE ch06_stock SET available = %s WHERE sku = %s", (available + row[1], row[0]))


async def refund_payment(pool, order: dict) -> None:
    """Undo charge_payment: charged -> refunded, and only then the money goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute(
                "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s", (row[1], row[0])
            )


async def cancel_shipment(pool, order: dict) -> None:
    """Undo schedule_shipment: scheduled -> cancelled."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
            (order["order_id"],),
        )


STEPS = [  # (name, step, compensation), in the order the saga runs them
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


async def finish_saga(pool, order: dict, log_rows: list, *, sleep) -> str:
    """Drive a saga to its end from what its log says so far (log_rows: [(step, event), ...])."""
    saga_id = order["order_id"]

    async def log(step, event, data=None):
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                (saga_id, step, event, Jsonb(data) if data is not None else None),
            )

    started = [step for step, event in log_rows if event == "started"]
    done = {step for step, event in log_rows if event == "done"}
    undone = {step for step, event in log_rows if event == "compensated" and step != "saga"}
    compensating = bool(undone) or any(event == "failed" for _, event in log_rows)

    if not compensating:
        for name, step, _ in STEPS:
            if name in done:
                continue
            await log(name, "started")
            started.append(name)
            try:
                await step(pool, order)
            except StepFailed as err:
                await log(name, "failed", {"error": str(err)})
                break
            await log(name, "done")
        else:
            await log("saga", "completed")
            return "completed"

    for name, _, compensation in reversed(STEPS):
        if name not in started or name in undone:
            continue
        delay = 0.05
        while True:
            try:
                await compensation(pool, order)
                break
            except Exception:  # a compensation cannot say no: it is retried until it succeeds
                await sleep(delay)
                delay = min(2 * delay, 2.0)
        await log(name, "compensated")
    await log("saga", "compensated")
    return "compensated"


async def run_order_saga(pool, order: dict, *, sleep=asyncio.sleep) -> str:
    """Run a new order saga; 'completed' or 'compensated'."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, 'saga', 'begin', %s)",
            (order["order_id"], Jsonb(order)),
        )
    return await finish_saga(pool, order, [], sleep=sleep)


async def recover_sagas(pool, *, sleep=asyncio.sleep) -> list[str]:
    """Finish every saga the log shows unfinished; the ids finished."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id "
            "HAVING bool_or(step = 'saga' AND event = 'begin') "
            "AND NOT bool_or(step = 'saga' AND event IN ('completed', 'compensated')) ORDER BY min(id)"
        )
        unfinished = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in unfinished:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id", (saga_id,))
            rows = await cur.fetchall()
        order = next(data for step, event, data in rows if step == "saga" and event == "begin")
        await finish_saga(pool, order, [(step, event) for step, event, _ in rows], sleep=sleep)
        finished.append(saga_id)
    return finished
    ### END SOLUTION
'''

SAGA_COMPENSATES_ANY_STEP_ERROR = '''
import asyncio
from psycopg.types.json import Jsonb

from course.chapters.ch06.shop import StepFailed, charge_payment, reserve_stock, schedule_shipment

async def release_stock(pool, order: dict) -> None:
    """Undo reserve_stock: reserved -> released, and only then the stock goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s AND status = 'reserved' "
            "RETURNING sku, qty",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute("UPDATE ch06_stock SET available = available + %s WHERE sku = %s", (row[1], row[0]))


async def refund_payment(pool, order: dict) -> None:
    """Undo charge_payment: charged -> refunded, and only then the money goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute(
                "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s", (row[1], row[0])
            )


async def cancel_shipment(pool, order: dict) -> None:
    """Undo schedule_shipment: scheduled -> cancelled."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
            (order["order_id"],),
        )


STEPS = [  # (name, step, compensation), in the order the saga runs them
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


async def finish_saga(pool, order: dict, log_rows: list, *, sleep) -> str:
    """Drive a saga to its end from what its log says so far (log_rows: [(step, event), ...])."""
    saga_id = order["order_id"]

    async def log(step, event, data=None):
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                (saga_id, step, event, Jsonb(data) if data is not None else None),
            )

    started = [step for step, event in log_rows if event == "started"]
    done = {step for step, event in log_rows if event == "done"}
    undone = {step for step, event in log_rows if event == "compensated" and step != "saga"}
    compensating = bool(undone) or any(event == "failed" for _, event in log_rows)

    if not compensating:
        for name, step, _ in STEPS:
            if name in done:
                continue
            await log(name, "started")
            started.append(name)
            try:
                await step(pool, order)
            except Exception as err:  # any failure: compensate
                await log(name, "failed", {"error": str(err)})
                break
            await log(name, "done")
        else:
            await log("saga", "completed")
            return "completed"

    for name, _, compensation in reversed(STEPS):
        if name not in started or name in undone:
            continue
        delay = 0.05
        while True:
            try:
                await compensation(pool, order)
                break
            except Exception:  # a compensation cannot say no: it is retried until it succeeds
                await sleep(delay)
                delay = min(2 * delay, 2.0)
        await log(name, "compensated")
    await log("saga", "compensated")
    return "compensated"


async def run_order_saga(pool, order: dict, *, sleep=asyncio.sleep) -> str:
    """Run a new order saga; 'completed' or 'compensated'."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, 'saga', 'begin', %s)",
            (order["order_id"], Jsonb(order)),
        )
    return await finish_saga(pool, order, [], sleep=sleep)


async def recover_sagas(pool, *, sleep=asyncio.sleep) -> list[str]:
    """Finish every saga the log shows unfinished; the ids finished."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id "
            "HAVING bool_or(step = 'saga' AND event = 'begin') "
            "AND NOT bool_or(step = 'saga' AND event IN ('completed', 'compensated')) ORDER BY min(id)"
        )
        unfinished = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in unfinished:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id", (saga_id,))
            rows = await cur.fetchall()
        order = next(data for step, event, data in rows if step == "saga" and event == "begin")
        await finish_saga(pool, order, [(step, event) for step, event, _ in rows], sleep=sleep)
        finished.append(saga_id)
    return finished
    ### END SOLUTION
'''

SAGA_CTE_COMPENSATION = '''
import asyncio
from psycopg.types.json import Jsonb

from course.chapters.ch06.shop import StepFailed, charge_payment, reserve_stock, schedule_shipment

async def release_stock(pool, order: dict) -> None:
    """Undo reserve_stock: reserved -> released, and only then the stock goes back."""
    async with pool.connection() as conn:
        await conn.execute(
            "WITH moved AS (UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s AND status = 'reserved' "
            "RETURNING sku, qty) UPDATE ch06_stock s SET available = s.available + m.qty FROM moved m WHERE s.sku = m.sku",
            (order["order_id"],),
        )


async def refund_payment(pool, order: dict) -> None:
    """Undo charge_payment: charged -> refunded, and only then the money goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute(
                "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s", (row[1], row[0])
            )


async def cancel_shipment(pool, order: dict) -> None:
    """Undo schedule_shipment: scheduled -> cancelled."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
            (order["order_id"],),
        )


STEPS = [  # (name, step, compensation), in the order the saga runs them
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


async def finish_saga(pool, order: dict, log_rows: list, *, sleep) -> str:
    """Drive a saga to its end from what its log says so far (log_rows: [(step, event), ...])."""
    saga_id = order["order_id"]

    async def log(step, event, data=None):
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                (saga_id, step, event, Jsonb(data) if data is not None else None),
            )

    started = [step for step, event in log_rows if event == "started"]
    done = {step for step, event in log_rows if event == "done"}
    undone = {step for step, event in log_rows if event == "compensated" and step != "saga"}
    compensating = bool(undone) or any(event == "failed" for _, event in log_rows)

    if not compensating:
        for name, step, _ in STEPS:
            if name in done:
                continue
            await log(name, "started")
            started.append(name)
            try:
                await step(pool, order)
            except StepFailed as err:
                await log(name, "failed", {"error": str(err)})
                break
            await log(name, "done")
        else:
            await log("saga", "completed")
            return "completed"

    for name, _, compensation in reversed(STEPS):
        if name not in started or name in undone:
            continue
        delay = 0.05
        while True:
            try:
                await compensation(pool, order)
                break
            except Exception:  # a compensation cannot say no: it is retried until it succeeds
                await sleep(delay)
                delay = min(2 * delay, 2.0)
        await log(name, "compensated")
    await log("saga", "compensated")
    return "compensated"


async def run_order_saga(pool, order: dict, *, sleep=asyncio.sleep) -> str:
    """Run a new order saga; 'completed' or 'compensated'."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, 'saga', 'begin', %s)",
            (order["order_id"], Jsonb(order)),
        )
    return await finish_saga(pool, order, [], sleep=sleep)


async def recover_sagas(pool, *, sleep=asyncio.sleep) -> list[str]:
    """Finish every saga the log shows unfinished; the ids finished."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id "
            "HAVING bool_or(step = 'saga' AND event = 'begin') "
            "AND NOT bool_or(step = 'saga' AND event IN ('completed', 'compensated')) ORDER BY min(id)"
        )
        unfinished = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in unfinished:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id", (saga_id,))
            rows = await cur.fetchall()
        order = next(data for step, event, data in rows if step == "saga" and event == "begin")
        await finish_saga(pool, order, [(step, event) for step, event, _ in rows], sleep=sleep)
        finished.append(saga_id)
    return finished
    ### END SOLUTION
'''

SAGA_FOR_UPDATE_COMPENSATION = '''
import asyncio
from psycopg.types.json import Jsonb

from course.chapters.ch06.shop import StepFailed, charge_payment, reserve_stock, schedule_shipment

async def release_stock(pool, order: dict) -> None:
    """Undo reserve_stock: reserved -> released, and only then the stock goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT sku, qty, status FROM ch06_reservations WHERE order_id = %s FOR UPDATE", (order["order_id"],)
        )
        row = await cur.fetchone()
        if row is None or row[2] != "reserved":
            return
        await conn.execute("UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s", (order["order_id"],))
        await conn.execute("UPDATE ch06_stock SET available = available + %s WHERE sku = %s", (row[1], row[0]))


async def refund_payment(pool, order: dict) -> None:
    """Undo charge_payment: charged -> refunded, and only then the money goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute(
                "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s", (row[1], row[0])
            )


async def cancel_shipment(pool, order: dict) -> None:
    """Undo schedule_shipment: scheduled -> cancelled."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
            (order["order_id"],),
        )


STEPS = [  # (name, step, compensation), in the order the saga runs them
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


async def finish_saga(pool, order: dict, log_rows: list, *, sleep) -> str:
    """Drive a saga to its end from what its log says so far (log_rows: [(step, event), ...])."""
    saga_id = order["order_id"]

    async def log(step, event, data=None):
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                (saga_id, step, event, Jsonb(data) if data is not None else None),
            )

    started = [step for step, event in log_rows if event == "started"]
    done = {step for step, event in log_rows if event == "done"}
    undone = {step for step, event in log_rows if event == "compensated" and step != "saga"}
    compensating = bool(undone) or any(event == "failed" for _, event in log_rows)

    if not compensating:
        for name, step, _ in STEPS:
            if name in done:
                continue
            await log(name, "started")
            started.append(name)
            try:
                await step(pool, order)
            except StepFailed as err:
                await log(name, "failed", {"error": str(err)})
                break
            await log(name, "done")
        else:
            await log("saga", "completed")
            return "completed"

    for name, _, compensation in reversed(STEPS):
        if name not in started or name in undone:
            continue
        delay = 0.05
        while True:
            try:
                await compensation(pool, order)
                break
            except Exception:  # a compensation cannot say no: it is retried until it succeeds
                await sleep(delay)
                delay = min(2 * delay, 2.0)
        await log(name, "compensated")
    await log("saga", "compensated")
    return "compensated"


async def run_order_saga(pool, order: dict, *, sleep=asyncio.sleep) -> str:
    """Run a new order saga; 'completed' or 'compensated'."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, 'saga', 'begin', %s)",
            (order["order_id"], Jsonb(order)),
        )
    return await finish_saga(pool, order, [], sleep=sleep)


async def recover_sagas(pool, *, sleep=asyncio.sleep) -> list[str]:
    """Finish every saga the log shows unfinished; the ids finished."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT saga_id FROM saga_log GROUP BY saga_id "
            "HAVING bool_or(step = 'saga' AND event = 'begin') "
            "AND NOT bool_or(step = 'saga' AND event IN ('completed', 'compensated')) ORDER BY min(id)"
        )
        unfinished = [row[0] for row in await cur.fetchall()]
    finished = []
    for saga_id in unfinished:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id", (saga_id,))
            rows = await cur.fetchall()
        order = next(data for step, event, data in rows if step == "saga" and event == "begin")
        await finish_saga(pool, order, [(step, event) for step, event, _ in rows], sleep=sleep)
        finished.append(saga_id)
    return finished
    ### END SOLUTION
'''

SAGA_FROM_SCRATCH_CLASS = '''
import asyncio
from psycopg.types.json import Jsonb
from course.chapters.ch06.shop import StepFailed, charge_payment, reserve_stock, schedule_shipment


async def _tx(pool, *statements):
    """Run statements in one transaction; return the rows of the first RETURNING."""
    async with pool.connection() as conn, conn.transaction():
        out = []
        for sql, args in statements:
            cur = await conn.execute(sql, args)
            out.append(await cur.fetchall() if cur.description else None)
        return out


async def release_stock(pool, order: dict) -> None:
    async with pool.connection() as conn:
        async with conn.transaction():
            moved = await (await conn.execute(
                "UPDATE ch06_reservations r SET status = 'released' WHERE r.order_id = %(o)s AND r.status = 'reserved' "
                "RETURNING r.sku, r.qty", {"o": order["order_id"]})).fetchall()
            for sku, qty in moved:
                await conn.execute("UPDATE ch06_stock SET available = available + %(q)s WHERE sku = %(s)s", {"q": qty, "s": sku})


async def refund_payment(pool, order: dict) -> None:
    async with pool.connection() as conn:
        async with conn.transaction():
            moved = await (await conn.execute(
                "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
                "RETURNING customer, amount_cents", [order["order_id"]])).fetchall()
            for customer, cents in moved:
                await conn.execute(
                    "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s", [cents, customer])


async def cancel_shipment(pool, order: dict) -> None:
    await _tx(pool, ("UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
                     [order["order_id"]]))


STEPS = [
    ("reserve_stock", reserve_stock, release_stock),
    ("charge_payment", charge_payment, refund_payment),
    ("schedule_shipment", schedule_shipment, cancel_shipment),
]


class Saga:
    def __init__(self, pool, order, sleep):
        self.pool, self.order, self.sleep = pool, order, sleep
        self.id = order["order_id"]

    async def log(self, step, event, data=None):
        async with self.pool.connection() as conn:
            await conn.execute("INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
                               (self.id, step, event, None if data is None else Jsonb(data)))

    async def undo(self, started, undone):
        for name, _, comp in STEPS[::-1]:
            if name in started and name not in undone:
                attempt = 0
                while True:
                    try:
                        await comp(self.pool, self.order)
                        break
                    except Exception:
                        attempt += 1
                        await self.sleep(min(0.01 * 2 ** attempt, 1.0))
                await self.log(name, "compensated")
        await self.log("saga", "compensated")
        return "compensated"

    async def forward(self, started, done):
        for name, fn, _ in STEPS:
            if name in done:
                continue
            await self.log(name, "started")
            started.add(name)
            try:
                await fn(self.pool, self.order)
            except StepFailed:
                await self.log(name, "failed")
                return await self.undo(started, set())
            await self.log(name, "done")
            done.add(name)
        await self.log("saga", "completed")
        return "completed"


async def run_order_saga(pool, order: dict, *, sleep=asyncio.sleep) -> str:
    saga = Saga(pool, order, sleep)
    await saga.log("saga", "begin", order)
    return await saga.forward(set(), set())


async def recover_sagas(pool, *, sleep=asyncio.sleep) -> list[str]:
    async with pool.connection() as conn:
        begins = await (await conn.execute(
            "SELECT b.saga_id, b.data FROM saga_log b WHERE b.step = 'saga' AND b.event = 'begin' "
            "AND NOT EXISTS (SELECT 1 FROM saga_log f WHERE f.saga_id = b.saga_id AND f.step = 'saga' "
            "AND f.event IN ('completed', 'compensated')) ORDER BY b.id")).fetchall()
    finished = []
    for saga_id, order in begins:
        async with pool.connection() as conn:
            events = await (await conn.execute(
                "SELECT step, event FROM saga_log WHERE saga_id = %s AND step <> 'saga' ORDER BY id", (saga_id,))).fetchall()
        started = {s for s, e in events if e == "started"}
        done = {s for s, e in events if e == "done"}
        undone = {s for s, e in events if e == "compensated"}
        saga = Saga(pool, order, sleep)
        if undone or any(e == "failed" for _, e in events):
            await saga.undo(started, undone)
        else:
            await saga.forward(started, done)
        finished.append(saga_id)
    return finished
'''

RELAY_NO_ORDER_BY = '''
import json

from psycopg.types.json import Jsonb

async def place_order(pool, redis, stream: str, order: dict) -> None:
    """The order and its OrderPlaced event in one transaction (and no publish from here)."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
            (order["order_id"], order["customer"], order["amount_cents"]),
        )
        await conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', %s, 'OrderPlaced', %s)",
            (order["order_id"], Jsonb(order)),
        )


async def relay_batch(pool, redis, stream: str, *, limit: int = 10) -> int:
    """Publish up to `limit` unpublished events, at least once, each order's in id order; how many."""
    async with pool.connection() as conn, conn.transaction():
        # one relay at a time: a second one waits here, then finds the rows the first published
        await conn.execute("SELECT pg_advisory_xact_lock(60602)")
        cur = await conn.execute(
            "SELECT id, aggregate_id, event_type, payload FROM outbox WHERE published_at IS NULL "
            "LIMIT %s FOR UPDATE",
            (limit,),
        )
        rows = await cur.fetchall()
        for event_id, aggregate_id, event_type, payload in rows:
            await redis.xadd(
                stream,
                {
                    "event_id": str(event_id),
                    "aggregate_id": aggregate_id,
                    "event_type": event_type,
                    "payload": json.dumps(payload),
                },
            )
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
    ### END SOLUTION
'''

RELAY_CURSOR_POLLER = '''
import json

from psycopg.types.json import Jsonb

async def place_order(pool, redis, stream: str, order: dict) -> None:
    """The order and its OrderPlaced event in one transaction (and no publish from here)."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
            (order["order_id"], order["customer"], order["amount_cents"]),
        )
        await conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', %s, 'OrderPlaced', %s)",
            (order["order_id"], Jsonb(order)),
        )


_last_seen = [0]


async def relay_batch(pool, redis, stream: str, *, limit: int = 10) -> int:
    """Publish up to `limit` unpublished events, at least once, each order's in id order; how many."""
    async with pool.connection() as conn, conn.transaction():
        # one relay at a time: a second one waits here, then finds the rows the first published
        await conn.execute("SELECT pg_advisory_xact_lock(60602)")
        cur = await conn.execute(
            "SELECT id, aggregate_id, event_type, payload FROM outbox WHERE published_at IS NULL AND id > %s "
            "ORDER BY id LIMIT %s FOR UPDATE",
            (_last_seen[0], limit),
        )
        rows = await cur.fetchall()
        for event_id, aggregate_id, event_type, payload in rows:
            await redis.xadd(
                stream,
                {
                    "event_id": str(event_id),
                    "aggregate_id": aggregate_id,
                    "event_type": event_type,
                    "payload": json.dumps(payload),
                },
            )
        if rows:
            _last_seen[0] = rows[-1][0]
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
    ### END SOLUTION
'''

RELAY_EVENT_TYPE_HARDCODED = '''
import json

from psycopg.types.json import Jsonb

async def place_order(pool, redis, stream: str, order: dict) -> None:
    """The order and its OrderPlaced event in one transaction (and no publish from here)."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
            (order["order_id"], order["customer"], order["amount_cents"]),
        )
        await conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', %s, 'OrderPlaced', %s)",
            (order["order_id"], Jsonb(order)),
        )


async def relay_batch(pool, redis, stream: str, *, limit: int = 10) -> int:
    """Publish up to `limit` unpublished events, at least once, each order's in id order; how many."""
    async with pool.connection() as conn, conn.transaction():
        # one relay at a time: a second one waits here, then finds the rows the first published
        await conn.execute("SELECT pg_advisory_xact_lock(60602)")
        cur = await conn.execute(
            "SELECT id, aggregate_id, event_type, payload FROM outbox WHERE published_at IS NULL "
            "ORDER BY id LIMIT %s FOR UPDATE",
            (limit,),
        )
        rows = await cur.fetchall()
        for event_id, aggregate_id, event_type, payload in rows:
            await redis.xadd(
                stream,
                {
                    "event_id": str(event_id),
                    "aggregate_id": aggregate_id,
                    "event_type": "OrderPlaced",
                    "payload": json.dumps(payload),
                },
            )
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
    ### END SOLUTION
'''

RELAY_SESSION_ADVISORY_LOCK = '''
import json

from psycopg.types.json import Jsonb

async def place_order(pool, redis, stream: str, order: dict) -> None:
    """The order and its OrderPlaced event in one transaction (and no publish from here)."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
            (order["order_id"], order["customer"], order["amount_cents"]),
        )
        await conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', %s, 'OrderPlaced', %s)",
            (order["order_id"], Jsonb(order)),
        )


async def relay_batch(pool, redis, stream: str, *, limit: int = 10) -> int:
    """Publish up to `limit` unpublished events, at least once, each order's in id order; how many."""
    async with pool.connection() as lockconn:
      await lockconn.execute("SELECT pg_advisory_lock(4242)")
      try:
       async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT id, aggregate_id, event_type, payload FROM outbox WHERE published_at IS NULL "
            "ORDER BY id LIMIT %s FOR UPDATE",
            (limit,),
        )
        rows = await cur.fetchall()
        for event_id, aggregate_id, event_type, payload in rows:
            await redis.xadd(
                stream,
                {
                    "event_id": str(event_id),
                    "aggregate_id": aggregate_id,
                    "event_type": event_type,
                    "payload": json.dumps(payload),
                },
            )
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
      finally:
        await lockconn.execute("SELECT pg_advisory_unlock(4242)")
    return len(rows)
    ### END SOLUTION
'''

RELAY_PIPELINE = '''
import json

from psycopg.types.json import Jsonb

async def place_order(pool, redis, stream: str, order: dict) -> None:
    """The order and its OrderPlaced event in one transaction (and no publish from here)."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
            (order["order_id"], order["customer"], order["amount_cents"]),
        )
        await conn.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', %s, 'OrderPlaced', %s)",
            (order["order_id"], Jsonb(order)),
        )


async def relay_batch(pool, redis, stream: str, *, limit: int = 10) -> int:
    """Publish up to `limit` unpublished events, at least once, each order's in id order; how many."""
    async with pool.connection() as conn, conn.transaction():
        # one relay at a time: a second one waits here, then finds the rows the first published
        await conn.execute("SELECT pg_advisory_xact_lock(60602)")
        cur = await conn.execute(
            "SELECT id, aggregate_id, event_type, payload FROM outbox WHERE published_at IS NULL "
            "ORDER BY id LIMIT %s FOR UPDATE",
            (limit,),
        )
        rows = await cur.fetchall()
        pipe = redis.pipeline(transaction=False)
        for event_id, aggregate_id, event_type, payload in rows:
            pipe.xadd(
                stream,
                {
                    "event_id": str(event_id),
                    "aggregate_id": aggregate_id,
                    "event_type": event_type,
                    "payload": json.dumps(payload),
                },
            )
        if rows:
            await pipe.execute()
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
    ### END SOLUTION
'''

RELAY_CTE_PLACE_ORDER_TRY_LOCK = '''
import json

from psycopg.types.json import Jsonb

async def place_order(pool, redis, stream: str, order: dict) -> None:
    """The order and its OrderPlaced event in one transaction (and no publish from here)."""
    async with pool.connection() as conn:
        await conn.execute(
            "WITH o AS (INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%(id)s, %(c)s, %(a)s) "
            "RETURNING order_id) INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "SELECT 'order', o.order_id, 'OrderPlaced', %(p)s FROM o",
            {"id": order["order_id"], "c": order["customer"], "a": order["amount_cents"], "p": Jsonb(order)},
        )


async def relay_batch(pool, redis, stream: str, *, limit: int = 10) -> int:
    """Publish up to `limit` unpublished events, at least once, each order's in id order; how many."""
    async with pool.connection() as conn, conn.transaction():
        # one relay at a time: a second one waits here, then finds the rows the first published
        got = await (await conn.execute("SELECT pg_try_advisory_xact_lock(60602)")).fetchone()
        if not got[0]:
            return 0  # another relay is publishing: it will get these rows
        cur = await conn.execute(
            "SELECT id, aggregate_id, event_type, payload FROM outbox WHERE published_at IS NULL "
            "ORDER BY id LIMIT %s FOR UPDATE",
            (limit,),
        )
        rows = await cur.fetchall()
        for event_id, aggregate_id, event_type, payload in rows:
            await redis.xadd(
                stream,
                {
                    "event_id": str(event_id),
                    "aggregate_id": aggregate_id,
                    "event_type": event_type,
                    "payload": json.dumps(payload),
                },
            )
        if rows:
            await conn.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([r[0] for r in rows],))
    return len(rows)
    ### END SOLUTION
'''


CORRECT: dict[str, dict[str, str]] = {
    "order_saga": {
        "forward": SAGA,
        "backward": BACKWARD,
        "done-only": DONE_ONLY,
        "cte-compensation": SAGA_CTE_COMPENSATION,
        "for-update-compensation": SAGA_FOR_UPDATE_COMPENSATION,
        "from-scratch-class": SAGA_FROM_SCRATCH_CLASS,
    },
    "outbox_relay": {
        "leader-waits": LEADER_WAITS,
        "waits-on-rows": WAITS_ON_ROWS,
        "leader-skips": LEADER_SKIPS,
        "heads-only": HEADS_ONLY,
        "per-aggregate-advisory-lock": PER_AGGREGATE_ADVISORY,
        "skip-locked-recheck-earlier": SKIP_LOCKED_RECHECK_EARLIER,
        "process-lock-plus-for-update": PROCESS_LOCK_PLUS_FOR_UPDATE,
        "session-advisory-lock": RELAY_SESSION_ADVISORY_LOCK,
        "pipeline-of-xadds": RELAY_PIPELINE,
        "cte-place-order-try-lock": RELAY_CTE_PLACE_ORDER_TRY_LOCK,
    },
}


# Answers that only call the course's own answer (REFERENCES in the chapter's check module). Once the
# grader's reference guard (issue 28, autograder/rules.py) is in, they earn nothing; until then they pass.
CALLS_THE_REFERENCE: dict[str, dict[str, str]] = {
    "outbox_relay": {"course-relay": COURSE_RELAY},
}


WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "order_saga": {
        "wrong-order": (WRONG_ORDER, "reverse order"),
        "non-idempotent-release": (NON_IDEMPOTENT_RELEASE, "called twice"),
        "blind-refund": (BLIND_REFUND, "ran for a step that never happened"),
        "split-refund": (SPLIT_REFUND, "wallet moved"),
        "check-then-release": (CHECK_THEN_RELEASE, "two recoverers"),
        "skips-failed-compensation": (SKIPS_FAILED_COMPENSATION, "was skipped"),
        "gives-up-after-three": (GIVES_UP_AFTER_THREE, "stopped after 3 failed refunds"),
        "recover-returns-nothing": (RECOVER_RETURNS_NOTHING, "return the ids of the sagas it finished"),
        "real-sleep": (REAL_SLEEP, "never asyncio.sleep"),
        "no-retry": (NO_RETRY, "ended the saga"),
        "no-log": (NO_LOG, "without the saga log"),
        "in-memory-log": (IN_MEMORY_LOG, "half-done"),
        "backward-skips-in-flight": (BACKWARD_SKIPS_IN_FLIGHT, "half-done"),
        "failed-step-not-compensated": (SAGA_FAILED_STEP_NOT_COMPENSATED, "started but never compensated"),
        "recovery-restarts-from-scratch": (SAGA_RECOVERY_RESTARTS_FROM_SCRATCH, "never runs forward again"),
        "recovery-ignores-failed": (SAGA_RECOVERY_IGNORES_FAILED, "never runs forward again"),
        "release-writes-back-what-it-read": (SAGA_RELEASE_WRITES_BACK_WHAT_IT_READ, "lost update"),
        "compensates-any-step-error": (SAGA_COMPENSATES_ANY_STEP_ERROR, "Only StepFailed is a service saying no"),
    },
    "outbox_relay": {
        "dual-write": (DUAL_WRITE, "dual write"),
        "two-commits": (TWO_COMMITS, "lost event"),
        "skip-locked": (SKIP_LOCKED, "out of order"),
        "skip-locked-one-row-per-transaction": (SKIP_LOCKED_ROW_AT_A_TIME, "out of order"),
        "in-process-lock": (IN_PROCESS_LOCK, "out of order"),
        "returns-limit": (RETURNS_LIMIT, "relay_batch returned 10"),
        "ignores-limit": (IGNORES_LIMIT, "at most `limit`"),
        "mark-first-unlocked": (MARK_FIRST_UNLOCKED, "Likely causes: rows claimed by marking them published first"),
        "mark-first": (MARK_FIRST, "never reached the stream"),
        "swallows-publish-error": (SWALLOWS_PUBLISH_ERROR, "never reached the stream"),
        "fresh-event-id": (FRESH_EVENT_ID, "event_id"),
        "no-order-by": (RELAY_NO_ORDER_BY, "without ORDER BY id"),
        "cursor-poller": (RELAY_CURSOR_POLLER, "WHERE id > last_seen"),
        "event-type-hardcoded": (RELAY_EVENT_TYPE_HARDCODED, "publish each row's own fields"),
    },
}


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in CORRECT.items() for n in d])
def test_06_correct_answers_pass(task, name):
    assert_accepted(task, CORRECT[task][name])


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in WRONG.items() for n in d])
def test_06_wrong_answers_are_rejected_for_the_reason(task, name):
    source, mentions = WRONG[task][name]
    assert_rejected(task, source, mentions=mentions)
