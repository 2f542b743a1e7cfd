"""Chapter 10 grading: the wrong answers learners write are rejected, correct designs pass.

Each answer is kept as the source a learner would type into the answer cell. The races are
forced by the check (autograder/checks/ch10 holds the contended row until every caller
waits on it, and lets each commit through only once every other caller waits again), so every
verdict here is the same on every run.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_accepted, assert_rejected

BUY_HEADER = """
import asyncio
import psycopg
from course.idempotency import ChargeDeclined
from course.inventory import HOLD_SECONDS
"""

# ----------------------------------------------------------------------------- buy: correct designs

BUY_CONDITIONAL = (
    BUY_HEADER
    + """
async def buy(pool, sku, buyer, key, pay):
    async with pool.connection() as conn:
        async with conn.transaction():
            cur = await conn.execute(
                "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
                "VALUES (%s, %s, %s, now() + make_interval(secs => %s)) "
                "ON CONFLICT (key) DO NOTHING RETURNING id",
                (key, sku, buyer, HOLD_SECONDS))
            row = await cur.fetchone()
            if row is not None:
                cur = await conn.execute(
                    "UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 RETURNING stock",
                    (sku,))
                if await cur.fetchone() is None:
                    await conn.execute("DELETE FROM inventory_reservations WHERE id = %s", row)
                    return {"status": "sold_out"}
        if row is None:
            cur = await conn.execute(
                "SELECT id, status, payment_id FROM inventory_reservations WHERE key = %s", (key,))
            rid, status, payment_id = await cur.fetchone()
            return {"status": status, "reservation_id": rid, "payment_id": payment_id}
    rid = row[0]
    try:
        payment_id = await pay(buyer, sku, rid)
    except ChargeDeclined:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "UPDATE inventory_reservations SET status = 'released' WHERE id = %s AND status = 'held' "
                "RETURNING sku", (rid,))
            if await cur.fetchone() is not None:
                await conn.execute("UPDATE inventory_items SET stock = stock + 1 WHERE sku = %s", (sku,))
        return {"status": "payment_failed", "reservation_id": rid}
    except Exception:  # unknown: maybe charged
        return {"status": "payment_unknown", "reservation_id": rid}
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status = 'paid', payment_id = %s "
            "WHERE id = %s AND status = 'held' RETURNING id", (payment_id, rid))
        if await cur.fetchone() is None:
            cur = await conn.execute("SELECT status FROM inventory_reservations WHERE id = %s", (rid,))
            if (await cur.fetchone())[0] != "paid":
                return {"status": "expired", "reservation_id": rid, "payment_id": payment_id}
    return {"status": "paid", "reservation_id": rid, "payment_id": payment_id}
"""
)

# the same, with the stock row locked first (SELECT ... FOR UPDATE) and the check in Python
BUY_FOR_UPDATE = BUY_CONDITIONAL.replace(
    """                cur = await conn.execute(
                    "UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 RETURNING stock",
                    (sku,))
                if await cur.fetchone() is None:""",
    """                cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s FOR UPDATE", (sku,))
                (stock,) = await cur.fetchone()
                if stock > 0:
                    await conn.execute("UPDATE inventory_items SET stock = %s WHERE sku = %s", (stock - 1, sku))
                else:""",
)

# read-then-write, but under SERIALIZABLE with a retry on 40001
BUY_SERIALIZABLE = (
    BUY_HEADER
    + """
async def reserve(conn, sku, buyer, key):
    \"\"\"One serializable attempt: the reservation's id, None for a repeat, "sold_out".\"\"\"
    async with conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        cur = await conn.execute(
            "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
            "VALUES (%s, %s, %s, now() + make_interval(secs => %s)) ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, sku, buyer, HOLD_SECONDS))
        row = await cur.fetchone()
        if row is None:
            return None
        cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s", (sku,))
        (stock,) = await cur.fetchone()
        if stock <= 0:
            await conn.execute("DELETE FROM inventory_reservations WHERE id = %s", row)
            return "sold_out"
        await conn.execute("UPDATE inventory_items SET stock = %s WHERE sku = %s", (stock - 1, sku))
        return row[0]


async def buy(pool, sku, buyer, key, pay):
    async with pool.connection() as conn:
        while True:
            try:
                rid = await reserve(conn, sku, buyer, key)
                break
            except psycopg.errors.SerializationFailure:
                await asyncio.sleep(0)
        if rid == "sold_out":
            return {"status": "sold_out"}
        if rid is None:
            cur = await conn.execute("SELECT id, status FROM inventory_reservations WHERE key = %s", (key,))
            rid, status = await cur.fetchone()
            return {"status": status, "reservation_id": rid}
    try:
        payment_id = await pay(buyer, sku, rid)
    except ChargeDeclined:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "UPDATE inventory_reservations SET status = 'released' WHERE id = %s AND status = 'held' "
                "RETURNING sku", (rid,))
            if await cur.fetchone() is not None:
                await conn.execute("UPDATE inventory_items SET stock = stock + 1 WHERE sku = %s", (sku,))
        return {"status": "payment_failed", "reservation_id": rid}
    except Exception:  # unknown: maybe charged
        return {"status": "payment_unknown", "reservation_id": rid}
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status = 'paid', payment_id = %s "
            "WHERE id = %s AND status = 'held' RETURNING id", (payment_id, rid))
        status = "paid" if await cur.fetchone() is not None else "expired"
        if status == "expired":
            cur = await conn.execute("SELECT status FROM inventory_reservations WHERE id = %s", (rid,))
            status = "paid" if (await cur.fetchone())[0] == "paid" else "expired"
    return {"status": status, "reservation_id": rid, "payment_id": payment_id}
"""
)

# an advisory lock per item around read-then-write
BUY_ADVISORY = BUY_FOR_UPDATE.replace(
    """cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s FOR UPDATE", (sku,))""",
    """await conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (sku,))
                cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s", (sku,))""",
)

# the course's own design, written out: reservation and stock in one transaction rolled back by an exception
BUY_ROLLBACK = (
    BUY_HEADER
    + """
class SoldOut(Exception):
    pass


async def buy(pool, sku, buyer, key, pay):
    try:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
                "VALUES (%s, %s, %s, now() + %s * interval '1 second') ON CONFLICT (key) DO NOTHING RETURNING id",
                (key, sku, buyer, HOLD_SECONDS))
            row = await cur.fetchone()
            if row is not None:
                cur = await conn.execute(
                    "UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0", (sku,))
                if cur.rowcount == 0:
                    raise SoldOut
    except SoldOut:
        return {"status": "sold_out"}
    async with pool.connection() as conn:
        if row is None:
            cur = await conn.execute("SELECT id, status FROM inventory_reservations WHERE key = %s", (key,))
            rid, status = await cur.fetchone()
            return {"status": status, "reservation_id": rid}
    rid = row[0]
    try:
        payment_id = await pay(buyer, sku, rid)
    except ChargeDeclined:
        async with pool.connection() as conn:
            await conn.execute(
                "WITH r AS (UPDATE inventory_reservations SET status = 'released' "
                "WHERE id = %s AND status = 'held' RETURNING sku) "
                "UPDATE inventory_items i SET stock = stock + 1 FROM r WHERE i.sku = r.sku", (rid,))
        return {"status": "payment_failed", "reservation_id": rid}
    except Exception:  # unknown: maybe charged
        return {"status": "payment_unknown", "reservation_id": rid}
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status = 'paid', payment_id = %s WHERE id = %s AND status <> 'released'",
            (payment_id, rid))
    return {"status": "paid" if cur.rowcount else "expired", "reservation_id": rid, "payment_id": payment_id}
"""
)

# the key claimed by a plain INSERT: a repeat's UniqueViolation rolls the transaction back, then the
# stored reservation is read and returned
BUY_UNIQUE_VIOLATION = (
    BUY_HEADER
    + """
async def buy(pool, sku, buyer, key, pay):
    async with pool.connection() as conn:
        try:
            async with conn.transaction():
                cur = await conn.execute(
                    "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
                    "VALUES (%s, %s, %s, now() + make_interval(secs => %s)) RETURNING id",
                    (key, sku, buyer, HOLD_SECONDS))
                row = await cur.fetchone()
                cur = await conn.execute(
                    "UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 RETURNING stock",
                    (sku,))
                if await cur.fetchone() is None:
                    await conn.execute("DELETE FROM inventory_reservations WHERE id = %s", row)
                    return {"status": "sold_out"}
        except psycopg.errors.UniqueViolation:
            cur = await conn.execute(
                "SELECT id, status, payment_id FROM inventory_reservations WHERE key = %s", (key,))
            rid, status, payment_id = await cur.fetchone()
            return {"status": status, "reservation_id": rid, "payment_id": payment_id}
"""
    + BUY_CONDITIONAL[BUY_CONDITIONAL.index("    rid = row[0]\n") :]
)

# ----------------------------------------------------------------------------- buy: wrong answers

WRONG_BUY = {
    "read_then_write": (
        BUY_CONDITIONAL.replace(
            """                cur = await conn.execute(
                    "UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 RETURNING stock",
                    (sku,))
                if await cur.fetchone() is None:""",
            """                cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s", (sku,))
                (stock,) = await cur.fetchone()
                if stock > 0:
                    await conn.execute("UPDATE inventory_items SET stock = %s WHERE sku = %s", (stock - 1, sku))
                else:""",
        ),
        "oversold",
    ),
    "skip_locked_gives_up": (
        BUY_FOR_UPDATE.replace('FOR UPDATE", (sku,))', 'FOR UPDATE SKIP LOCKED", (sku,))').replace(
            "(stock,) = await cur.fetchone()\n                if stock > 0:",
            "found = await cur.fetchone()\n                stock = found[0] if found else 0\n                if stock > 0:",
        ),
        "every unit sold",
    ),
    # SERIALIZABLE, but the retry on 40001 is bounded: every retry round has one winner, so a buyer
    # that lost every round gives up and says sold_out while units are left
    "serializable_retry_2_attempts": (
        BUY_SERIALIZABLE.replace(
            """        while True:
            try:
                rid = await reserve(conn, sku, buyer, key)
                break
            except psycopg.errors.SerializationFailure:
                await asyncio.sleep(0)
""",
            """        for attempt in range(2):
            try:
                rid = await reserve(conn, sku, buyer, key)
                break
            except psycopg.errors.SerializationFailure:
                await asyncio.sleep(0)
        else:
            return {"status": "sold_out"}  # gives up while units are left
""",
        ),
        "every unit sold",
    ),
    "serializable_retry_3_attempts": (
        BUY_SERIALIZABLE.replace(
            """        while True:
            try:
                rid = await reserve(conn, sku, buyer, key)
                break
            except psycopg.errors.SerializationFailure:
                await asyncio.sleep(0)
""",
            """        for attempt in range(3):
            try:
                rid = await reserve(conn, sku, buyer, key)
                break
            except psycopg.errors.SerializationFailure:
                await asyncio.sleep(0)
        else:
            return {"status": "sold_out"}  # gives up while units are left
""",
        ),
        "every unit sold",
    ),
    "lock_across_pay": (
        BUY_HEADER
        + """
async def buy(pool, sku, buyer, key, pay):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
            "VALUES (%s, %s, %s, now() + make_interval(secs => %s)) ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, sku, buyer, HOLD_SECONDS))
        row = await cur.fetchone()
        if row is None:
            cur = await conn.execute("SELECT id, status FROM inventory_reservations WHERE key = %s", (key,))
            rid, status = await cur.fetchone()
            return {"status": status, "reservation_id": rid}
        cur = await conn.execute(
            "UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 RETURNING stock", (sku,))
        if await cur.fetchone() is None:
            await conn.execute("DELETE FROM inventory_reservations WHERE id = %s", row)
            return {"status": "sold_out"}
        payment_id = await pay(buyer, sku, row[0])  # the stock row stays locked over the network
        await conn.execute("UPDATE inventory_reservations SET status = 'paid', payment_id = %s WHERE id = %s",
                           (payment_id, row[0]))
        return {"status": "paid", "reservation_id": row[0], "payment_id": payment_id}
""",
        "no transaction open",
    ),
    "no_release_on_failure": (
        BUY_CONDITIONAL.replace(
            """        return {"status": "payment_failed", "reservation_id": rid}""",
            """        pass""",
        ).replace(
            """            if await cur.fetchone() is not None:
                await conn.execute("UPDATE inventory_items SET stock = stock + 1 WHERE sku = %s", (sku,))""",
            """            pass""",
        ),
        "back in stock",
    ),
    "no_deadline": (
        BUY_CONDITIONAL.replace("now() + make_interval(secs => %s)", "now() + make_interval(secs => %s * 10)"),
        "expires_at = now() + HOLD_SECONDS",
    ),
    "release_unguarded": (
        BUY_CONDITIONAL.replace(
            "SET status = 'released' WHERE id = %s AND status = 'held' ", "SET status = 'released' WHERE id = %s "
        ),
        "still held",
    ),
    "confirm_unguarded": (
        BUY_CONDITIONAL.replace("WHERE id = %s AND status = 'held' RETURNING id", "WHERE id = %s RETURNING id"),
        "still held",
    ),
    "select_then_insert_key": (
        BUY_CONDITIONAL.replace(
            """    async with pool.connection() as conn:
        async with conn.transaction():""",
            """    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT id, status, payment_id FROM inventory_reservations WHERE key = %s", (key,))
        seen = await cur.fetchone()
        if seen is not None:
            return {"status": seen[1], "reservation_id": seen[0], "payment_id": seen[2]}
        async with conn.transaction():""",
            1,
        ).replace("ON CONFLICT (key) DO NOTHING RETURNING id", "RETURNING id"),
        "ON CONFLICT",
    ),
    "in_process_lock": (
        BUY_HEADER
        + """
LOCKS = {}


async def buy(pool, sku, buyer, key, pay):
    lock = LOCKS.setdefault(sku, asyncio.Lock())
    async with lock:  # one buyer at a time... in this process
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
                "VALUES (%s, %s, %s, now() + make_interval(secs => %s)) ON CONFLICT (key) DO NOTHING RETURNING id",
                (key, sku, buyer, HOLD_SECONDS))
            row = await cur.fetchone()
            if row is None:
                cur = await conn.execute("SELECT id, status FROM inventory_reservations WHERE key = %s", (key,))
                rid, status = await cur.fetchone()
                return {"status": status, "reservation_id": rid}
            cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s", (sku,))
            (stock,) = await cur.fetchone()
            if stock <= 0:
                await conn.execute("DELETE FROM inventory_reservations WHERE id = %s", row)
                return {"status": "sold_out"}
            await conn.execute("UPDATE inventory_items SET stock = %s WHERE sku = %s", (stock - 1, sku))
    payment_id = await pay(buyer, sku, row[0])
    async with pool.connection() as conn:
        await conn.execute("UPDATE inventory_reservations SET status = 'paid', payment_id = %s "
                           "WHERE id = %s AND status = 'held'", (payment_id, row[0]))
    return {"status": "paid", "reservation_id": row[0], "payment_id": payment_id}
""",
        "oversold",
    ),
}

# ----------------------------------------------------------------------------- transfer: correct designs

TRANSFER_HEADER = """
import asyncio
from decimal import Decimal
import psycopg
from course.idempotency import IdempotencyKeyReused, request_hash
from course.ledger import InsufficientFunds
"""

TRANSFER_ID_ORDER = (
    TRANSFER_HEADER
    + """
async def transfer(pool, from_id, to_id, amount, key):
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError(f"amount must be an int of cents, not {type(amount).__name__}")
    if amount <= 0:
        raise ValueError("amount must be positive")
    h = request_hash({"from": from_id, "to": to_id, "amount": amount})
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO ledger_transfers (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, h))
        row = await cur.fetchone()
        if row is None:
            cur = await conn.execute("SELECT id, request_hash FROM ledger_transfers WHERE key = %s", (key,))
            tid, stored = await cur.fetchone()
            if stored != h:
                raise IdempotencyKeyReused(key)
            return tid
        tid = row[0]
        await conn.execute("SELECT id FROM ledger_accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                           ([from_id, to_id],))
        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s "
            "WHERE id = %s AND (allow_negative OR balance >= %s)", (amount, from_id, amount))
        if cur.rowcount == 0:
            raise InsufficientFunds(f"account {from_id}")
        await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id = %s", (amount, to_id))
        await conn.execute(
            "INSERT INTO ledger_postings (transfer_id, account_id, amount) VALUES (%s, %s, %s), (%s, %s, %s)",
            (tid, from_id, -amount, tid, to_id, amount))
        return tid
"""
)

# no explicit lock: the two updates themselves run in id order
TRANSFER_UPDATE_ORDER = TRANSFER_ID_ORDER.replace(
    """        await conn.execute("SELECT id FROM ledger_accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                           ([from_id, to_id],))
        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s "
            "WHERE id = %s AND (allow_negative OR balance >= %s)", (amount, from_id, amount))
        if cur.rowcount == 0:
            raise InsufficientFunds(f"account {from_id}")
        await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id = %s", (amount, to_id))
""",
    """        for acc in sorted([from_id, to_id]):
            if acc == from_id:
                cur = await conn.execute(
                    "UPDATE ledger_accounts SET balance = balance - %s "
                    "WHERE id = %s AND (allow_negative OR balance >= %s)", (amount, from_id, amount))
                if cur.rowcount == 0:
                    raise InsufficientFunds(f"account {from_id}")
            else:
                await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id = %s", (amount, to_id))
""",
)

# source first (the deadlock-prone order), but the whole transaction is retried on 40P01 / 40001
TRANSFER_RETRY = (
    TRANSFER_ID_ORDER.replace(
        "async def transfer(pool, from_id, to_id, amount, key):", "async def _once(pool, from_id, to_id, amount, key):"
    ).replace(
        """        await conn.execute("SELECT id FROM ledger_accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                           ([from_id, to_id],))
""",
        "",
    )
    + """

async def transfer(pool, from_id, to_id, amount, key):
    for attempt in range(10):
        try:
            return await _once(pool, from_id, to_id, amount, key)
        except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
            if attempt == 9:
                raise
"""
)

# the same, with a random pause before each retry
TRANSFER_RETRY_JITTER = TRANSFER_RETRY.replace("import asyncio\n", "import asyncio\nimport random\n", 1).replace(
    """            if attempt == 9:
                raise
""",
    """            if attempt == 9:
                raise
            await asyncio.sleep(random.uniform(0, 0.05))
""",
)

# serializable, read the balance in Python, retry on every transaction-rollback error
TRANSFER_SERIALIZABLE = (
    TRANSFER_HEADER
    + """
async def _once(pool, from_id, to_id, amount, key):
    h = request_hash({"from": from_id, "to": to_id, "amount": amount})
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
        cur = await conn.execute("SELECT id, request_hash FROM ledger_transfers WHERE key = %s", (key,))
        found = await cur.fetchone()
        if found is not None:
            if found[1] != h:
                raise IdempotencyKeyReused(key)
            return found[0]
        cur = await conn.execute("SELECT balance, allow_negative FROM ledger_accounts WHERE id = %s", (from_id,))
        balance, allow_negative = await cur.fetchone()
        if not allow_negative and balance < amount:
            raise InsufficientFunds(f"account {from_id} holds {balance}")
        cur = await conn.execute("INSERT INTO ledger_transfers (key, request_hash) VALUES (%s, %s) RETURNING id", (key, h))
        (tid,) = await cur.fetchone()
        await conn.execute("UPDATE ledger_accounts SET balance = balance - %s WHERE id = %s", (amount, from_id))
        await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id = %s", (amount, to_id))
        await conn.execute(
            "INSERT INTO ledger_postings (transfer_id, account_id, amount) VALUES (%s, %s, %s), (%s, %s, %s)",
            (tid, from_id, -amount, tid, to_id, amount))
        return tid


async def transfer(pool, from_id, to_id, amount, key):
    if type(amount) is not int:
        raise TypeError("amount must be an int of minor units")
    if amount <= 0:
        raise ValueError("amount must be positive")
    while True:
        try:
            return await _once(pool, from_id, to_id, amount, key)
        except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected, psycopg.errors.UniqueViolation):
            await asyncio.sleep(0)
"""
)

# advisory locks on both accounts, smaller id first
TRANSFER_ADVISORY = TRANSFER_ID_ORDER.replace(
    """        await conn.execute("SELECT id FROM ledger_accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                           ([from_id, to_id],))
""",
    """        for acc in sorted([from_id, to_id]):
            await conn.execute("SELECT pg_advisory_xact_lock(10, %s)", (acc,))
""",
)

# ----------------------------------------------------------------------------- transfer: wrong answers

WRONG_TRANSFER = {
    "float_money": (
        TRANSFER_ID_ORDER.replace(
            """    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError(f"amount must be an int of cents, not {type(amount).__name__}")
""",
            """    amount = int(round(amount))
""",
        ),
        "minor units",
    ),
    "one_posting": (
        TRANSFER_ID_ORDER.replace(
            """            "INSERT INTO ledger_postings (transfer_id, account_id, amount) VALUES (%s, %s, %s), (%s, %s, %s)",
            (tid, from_id, -amount, tid, to_id, amount))""",
            """            "INSERT INTO ledger_postings (transfer_id, account_id, amount) VALUES (%s, %s, %s)",
            (tid, to_id, amount))""",
        ),
        "postings",
    ),
    "update_posting": (
        TRANSFER_ID_ORDER.replace(
            """        await conn.execute(
            "INSERT INTO ledger_postings""",
            """        await conn.execute("UPDATE ledger_postings SET amount = amount WHERE transfer_id = %s", (tid,))
        await conn.execute(
            "INSERT INTO ledger_postings""",
        ),
        "append-only",
    ),
    "python_balance_check": (
        TRANSFER_ID_ORDER.replace(
            """        await conn.execute("SELECT id FROM ledger_accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                           ([from_id, to_id],))
        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s "
            "WHERE id = %s AND (allow_negative OR balance >= %s)", (amount, from_id, amount))
        if cur.rowcount == 0:
            raise InsufficientFunds(f"account {from_id}")
""",
            """        cur = await conn.execute("SELECT balance, allow_negative FROM ledger_accounts WHERE id = %s", (from_id,))
        balance, allow_negative = await cur.fetchone()
        if not allow_negative and balance < amount:
            raise InsufficientFunds(f"account {from_id}")
        for acc in sorted([from_id, to_id]):
            await conn.execute("SELECT 1 FROM ledger_accounts WHERE id = %s FOR UPDATE", (acc,))
        await conn.execute("UPDATE ledger_accounts SET balance = balance - %s WHERE id = %s", (amount, from_id))
""",
        ),
        "only the table's CHECK",
    ),
    "source_first_no_retry": (
        TRANSFER_ID_ORDER.replace(
            """        await conn.execute("SELECT id FROM ledger_accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                           ([from_id, to_id],))
""",
            "",
        ),
        "DeadlockDetected",
    ),
    "source_first_select_for_update": (
        TRANSFER_ID_ORDER.replace(
            """        await conn.execute("SELECT id FROM ledger_accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                           ([from_id, to_id],))
""",
            """        for acc in (from_id, to_id):
            await conn.execute("SELECT id FROM ledger_accounts WHERE id = %s FOR UPDATE", (acc,))
""",
        ),
        "DeadlockDetected",
    ),
    # source first, retried, but on the parent class a reader would guess: psycopg's DeadlockDetected
    # is not a TransactionRollback, so the deadlock still reaches the caller
    "retry_on_transaction_rollback": (
        TRANSFER_RETRY.replace(
            "except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):",
            "except psycopg.errors.TransactionRollback:",
        ),
        "not a subclass of TransactionRollback",
    ),
    "python_computed_balance": (
        TRANSFER_ID_ORDER.replace(
            """        await conn.execute("SELECT id FROM ledger_accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE",
                           ([from_id, to_id],))
        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s "
            "WHERE id = %s AND (allow_negative OR balance >= %s)", (amount, from_id, amount))
        if cur.rowcount == 0:
            raise InsufficientFunds(f"account {from_id}")
        await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id = %s", (amount, to_id))
""",
            """        cur = await conn.execute("SELECT id, balance, allow_negative FROM ledger_accounts WHERE id = ANY(%s)",
                                 ([from_id, to_id],))
        acc = {r[0]: r for r in await cur.fetchall()}
        if not acc[from_id][2] and acc[from_id][1] < amount:
            raise InsufficientFunds(f"account {from_id}")
        for a, delta in sorted([(from_id, -amount), (to_id, amount)]):
            await conn.execute("UPDATE ledger_accounts SET balance = %s WHERE id = %s", (acc[a][1] + delta, a))
""",
        ),
        "lost",
    ),
    # source first with a retry on deadlock, but the destination's balance read first and written back:
    # the deadlock's loser re-reads it while the other transfer has not committed yet
    "dest_writeback_retry": (
        TRANSFER_RETRY.replace(
            """        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s \"""",
            """        cur = await conn.execute("SELECT balance FROM ledger_accounts WHERE id = %s", (to_id,))
        (to_balance,) = await cur.fetchone()
        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s \"""",
        ).replace(
            """await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id = %s", (amount, to_id))""",
            """await conn.execute("UPDATE ledger_accounts SET balance = %s WHERE id = %s", (to_balance + amount, to_id))""",
        ),
        "an update was lost",
    ),
    # both balances read, checked and written back, source first, with a retry on deadlock
    "writeback_retry": (
        TRANSFER_RETRY.replace(
            """        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s "
            "WHERE id = %s AND (allow_negative OR balance >= %s)", (amount, from_id, amount))
        if cur.rowcount == 0:
            raise InsufficientFunds(f"account {from_id}")
        await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id = %s", (amount, to_id))
""",
            """        cur = await conn.execute("SELECT id, balance, allow_negative FROM ledger_accounts WHERE id = ANY(%s)",
                                 ([from_id, to_id],))
        acc = {r[0]: r for r in await cur.fetchall()}
        if not acc[from_id][2] and acc[from_id][1] < amount:
            raise InsufficientFunds(f"account {from_id}")
        await conn.execute("UPDATE ledger_accounts SET balance = %s WHERE id = %s", (acc[from_id][1] - amount, from_id))
        await conn.execute("UPDATE ledger_accounts SET balance = %s WHERE id = %s", (acc[to_id][1] + amount, to_id))
""",
        ),
        "an update was lost",
    ),
    "no_idempotency": (
        TRANSFER_ID_ORDER.replace(
            'ON CONFLICT (key) DO NOTHING RETURNING id",\n            (key, h))',
            'ON CONFLICT (key) DO NOTHING RETURNING id",\n            (key + str(id(conn)) + str(asyncio.get_running_loop().time()), h))',
        ),
        "ON CONFLICT (key) DO NOTHING",
    ),
    # the key looked up first, then a plain INSERT: right one after another, a UniqueViolation for a
    # repeat that arrives while the first transfer has not committed
    "lookup_then_insert": (
        TRANSFER_ID_ORDER.replace(
            """        cur = await conn.execute(
            "INSERT INTO ledger_transfers (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, h))
        row = await cur.fetchone()
        if row is None:
            cur = await conn.execute("SELECT id, request_hash FROM ledger_transfers WHERE key = %s", (key,))
            tid, stored = await cur.fetchone()
            if stored != h:
                raise IdempotencyKeyReused(key)
            return tid
        tid = row[0]
""",
            """        cur = await conn.execute("SELECT id, request_hash FROM ledger_transfers WHERE key = %s", (key,))
        found = await cur.fetchone()
        if found is not None:
            if found[1] != h:
                raise IdempotencyKeyReused(key)
            return found[0]
        cur = await conn.execute(
            "INSERT INTO ledger_transfers (key, request_hash) VALUES (%s, %s) RETURNING id", (key, h))
        tid = (await cur.fetchone())[0]
""",
        ),
        "a lookup before a plain insert races",
    ),
}

# amounts taken for major units and converted to cents: 250 becomes 25,000, more than account 1 holds
WRONG_TRANSFER["major_units"] = (
    TRANSFER_ID_ORDER.replace(
        """    h = request_hash({"from": from_id, "to": to_id, "amount": amount})""",
        """    h = request_hash({"from": from_id, "to": to_id, "amount": amount})
    amount = amount * 100  # euros to cents""",
    ),
    "convert nothing",
)
assert WRONG_TRANSFER["major_units"][0] != TRANSFER_ID_ORDER

# the key claimed by a plain INSERT in a savepoint: a repeat's UniqueViolation (raised once the first
# transfer commits) rolls the savepoint back, and the stored transfer answers
TRANSFER_UNIQUE_VIOLATION = TRANSFER_ID_ORDER.replace(
    """        cur = await conn.execute(
            "INSERT INTO ledger_transfers (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, h))
        row = await cur.fetchone()
""",
    """        try:
            async with conn.transaction():
                cur = await conn.execute(
                    "INSERT INTO ledger_transfers (key, request_hash) VALUES (%s, %s) RETURNING id", (key, h))
                row = await cur.fetchone()
        except psycopg.errors.UniqueViolation:
            row = None
""",
)

# ----------------------------------------------------------------------------- found by the outside audit
# The reservation committed on its own, then the stock taken in a second statement: when the stock
# update fails, a 'held' reservation stays with no unit taken (the reaper would later add one back).
BUY_TWO_TRANSACTIONS = """
import asyncio
import psycopg
from course.idempotency import ChargeDeclined
from course.inventory import HOLD_SECONDS

async def _existing(pool, key):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, status FROM inventory_reservations WHERE key=%s", (key,))
        rid, status = await cur.fetchone()
    return {"status": status, "reservation_id": rid}

async def buy(pool, sku, buyer, key, pay):

    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
            "VALUES (%s,%s,%s, now() + make_interval(secs => %s)) ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, sku, buyer, HOLD_SECONDS))
        row = await cur.fetchone()
        if row is None:
            return await _existing(pool, key)
        cur = await conn.execute("UPDATE inventory_items SET stock = stock - 1 WHERE sku=%s AND stock > 0", (sku,))
        if cur.rowcount == 0:
            await conn.execute("DELETE FROM inventory_reservations WHERE id=%s", (row[0],))
            return {"status": "sold_out"}
    claimed = row[0]


    rid = claimed
    try:
        payment_id = await pay(buyer, sku, rid)
    except ChargeDeclined:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "UPDATE inventory_reservations SET status='released' WHERE id=%s AND status='held' RETURNING id", (rid,))
            if await cur.fetchone() is not None:
                await conn.execute("UPDATE inventory_items SET stock = stock + 1 WHERE sku=%s", (sku,))
        return {"status": "payment_failed", "reservation_id": rid}
    except Exception:  # unknown: maybe charged
        return {"status": "payment_unknown", "reservation_id": rid}
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status='paid', payment_id=%s WHERE id=%s AND status='held' RETURNING id",
            (payment_id, rid))
        ok = await cur.fetchone() is not None
        if not ok:
            cur = await conn.execute("SELECT status FROM inventory_reservations WHERE id=%s", (rid,))
            ok = (await cur.fetchone())[0] == "paid"
    return {"status": "paid" if ok else "expired", "reservation_id": rid, "payment_id": payment_id}

"""

WRONG_BUY["two_transactions"] = (BUY_TWO_TRANSACTIONS, "committed separately")

# isinstance(True, int) holds: True moves one cent.
TRANSFER_BOOL_AMOUNT = """
import asyncio
import psycopg
from course.idempotency import IdempotencyKeyReused, request_hash
from course.ledger import InsufficientFunds

async def transfer(pool, from_id, to_id, amount, key):

    if not isinstance(amount, int):
        raise TypeError("int")
    if amount <= 0:
        raise ValueError("amount")

    h = request_hash({"from": from_id, "to": to_id, "amount": amount})
    async with pool.connection() as conn, conn.transaction():

        cur = await conn.execute(
            "INSERT INTO ledger_transfers (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, h))
        row = await cur.fetchone()
        if row is None:
            cur = await conn.execute("SELECT id, request_hash FROM ledger_transfers WHERE key=%s", (key,))
            tid, old = await cur.fetchone()
            if old != h:
                raise IdempotencyKeyReused(key, "key reused")
            return tid
        tid = row[0]


        await conn.execute("SELECT 1 FROM ledger_accounts WHERE id IN (%s, %s) ORDER BY id FOR UPDATE", (from_id, to_id))
        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s WHERE id=%s AND (allow_negative OR balance >= %s)",
            (amount, from_id, amount))
        if cur.rowcount == 0:
            raise InsufficientFunds("no")
        await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id=%s", (amount, to_id))


        await conn.execute(
            "INSERT INTO ledger_postings (transfer_id, account_id, amount) VALUES (%s,%s,%s), (%s,%s,%s)",
            (tid, from_id, -amount, tid, to_id, amount))
        return tid

"""

# The transfer row and both balances committed, the postings in a second transaction.
TRANSFER_POSTINGS_SECOND_TRANSACTION = """
import asyncio
import psycopg
from course.idempotency import IdempotencyKeyReused, request_hash
from course.ledger import InsufficientFunds

async def transfer(pool, from_id, to_id, amount, key):

    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError("amount must be int")
    if amount <= 0:
        raise ValueError("amount must be positive")

    h = request_hash({"from": from_id, "to": to_id, "amount": amount})
    async with pool.connection() as conn, conn.transaction():

        cur = await conn.execute(
            "INSERT INTO ledger_transfers (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, h))
        row = await cur.fetchone()
        if row is None:
            cur = await conn.execute("SELECT id, request_hash FROM ledger_transfers WHERE key=%s", (key,))
            tid, old = await cur.fetchone()
            if old != h:
                raise IdempotencyKeyReused(key, "key reused")
            return tid
        tid = row[0]


        await conn.execute("SELECT 1 FROM ledger_accounts WHERE id IN (%s, %s) ORDER BY id FOR UPDATE", (from_id, to_id))
        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s WHERE id=%s AND (allow_negative OR balance >= %s)",
            (amount, from_id, amount))
        if cur.rowcount == 0:
            raise InsufficientFunds("no")
        await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id=%s", (amount, to_id))


        pass
    async with pool.connection() as conn2:
        await conn2.execute(
            "INSERT INTO ledger_postings (transfer_id, account_id, amount) VALUES (%s,%s,%s), (%s,%s,%s)",
            (tid, from_id, -amount, tid, to_id, amount))
    return tid

"""

WRONG_TRANSFER["bool_amount"] = (TRANSFER_BOOL_AMOUNT, "an amount of True")
WRONG_TRANSFER["postings_second_transaction"] = (TRANSFER_POSTINGS_SECOND_TRANSACTION, "postings the database refused")

# A one-statement sold-out test: a CTE takes the unit, or deletes the new reservation when none is left.
BUY_CTE_RESERVE = """
import asyncio
import psycopg
from course.idempotency import ChargeDeclined
from course.inventory import HOLD_SECONDS

async def _existing(pool, key):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, status FROM inventory_reservations WHERE key=%s", (key,))
        rid, status = await cur.fetchone()
    return {"status": status, "reservation_id": rid}

async def buy(pool, sku, buyer, key, pay):
    async with pool.connection() as conn:
        async with conn.transaction():
            cur = await conn.execute(
                "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
                "VALUES (%s,%s,%s, now() + make_interval(secs => %s)) ON CONFLICT (key) DO NOTHING RETURNING id",
                (key, sku, buyer, HOLD_SECONDS))
            row = await cur.fetchone()
            if row is None:
                return await _existing(pool, key)
            cur = await conn.execute(
                "WITH t AS (UPDATE inventory_items SET stock = stock - 1 WHERE sku=%s AND stock > 0 RETURNING 1) "
                "DELETE FROM inventory_reservations WHERE id=%s AND NOT EXISTS (SELECT 1 FROM t) RETURNING id",
                (sku, row[0]))
            if await cur.fetchone() is not None:
                return {"status": "sold_out"}
    claimed = row[0]

    rid = claimed
    try:
        payment_id = await pay(buyer, sku, rid)
    except ChargeDeclined:
        async with pool.connection() as conn:
            await conn.execute(
                "WITH r AS (UPDATE inventory_reservations SET status='released' WHERE id=%s AND status='held' RETURNING sku) "
                "UPDATE inventory_items i SET stock = i.stock + 1 FROM r WHERE i.sku = r.sku", (rid,))
        return {"status": "payment_failed", "reservation_id": rid}
    except Exception:  # unknown: maybe charged
        return {"status": "payment_unknown", "reservation_id": rid}
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status='paid', payment_id=%s WHERE id=%s AND status='held'",
            (payment_id, rid))
        status = "paid" if cur.rowcount == 1 else "expired"
        if status == "expired":
            cur = await conn.execute("SELECT status FROM inventory_reservations WHERE id=%s", (rid,))
            status = "paid" if (await cur.fetchone())[0] == "paid" else "expired"
    return {"status": status, "reservation_id": rid, "payment_id": payment_id}
"""

# Sold out signalled by an exception that rolls the reservation back; a release in one CTE statement.
BUY_ROLLBACK_BY_EXCEPTION = """
import asyncio
import psycopg
from course.idempotency import ChargeDeclined
from course.inventory import HOLD_SECONDS

async def _existing(pool, key):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, status FROM inventory_reservations WHERE key=%s", (key,))
        rid, status = await cur.fetchone()
    return {"status": status, "reservation_id": rid}

class SoldOut(Exception):
    pass

async def buy(pool, sku, buyer, key, pay):

    try:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
                "VALUES (%s,%s,%s, now() + make_interval(secs => %s)) ON CONFLICT (key) DO NOTHING RETURNING id",
                (key, sku, buyer, HOLD_SECONDS))
            row = await cur.fetchone()
            if row is not None:
                cur = await conn.execute(
                    "UPDATE inventory_items SET stock = stock - 1 WHERE sku=%s AND stock > 0 RETURNING stock", (sku,))
                if await cur.fetchone() is None:
                    raise SoldOut()
    except SoldOut:
        return {"status": "sold_out"}
    if row is None:
        return await _existing(pool, key)
    claimed = row[0]


    rid = claimed
    try:
        payment_id = await pay(buyer, sku, rid)
    except ChargeDeclined:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "UPDATE inventory_reservations SET status='released' WHERE id=%s AND status='held' RETURNING id", (rid,))
            if await cur.fetchone() is not None:
                await conn.execute("UPDATE inventory_items SET stock = stock + 1 WHERE sku=%s", (sku,))
        return {"status": "payment_failed", "reservation_id": rid}
    except Exception:  # unknown: maybe charged
        return {"status": "payment_unknown", "reservation_id": rid}
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status='paid', payment_id=%s WHERE id=%s AND status='held' RETURNING id",
            (payment_id, rid))
        ok = await cur.fetchone() is not None
        if not ok:
            cur = await conn.execute("SELECT status FROM inventory_reservations WHERE id=%s", (rid,))
            ok = (await cur.fetchone())[0] == "paid"
    return {"status": "paid" if ok else "expired", "reservation_id": rid, "payment_id": payment_id}

"""

# A repeat answers with the status only; a paid purchase without its payment_id.
BUY_REPEAT_WITHOUT_RESERVATION_ID = """
import asyncio
import psycopg
from course.idempotency import ChargeDeclined
from course.inventory import HOLD_SECONDS

async def _existing(pool, key):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, status FROM inventory_reservations WHERE key=%s", (key,))
        rid, status = await cur.fetchone()
    return {"status": status}

async def buy(pool, sku, buyer, key, pay):

    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
            "VALUES (%s,%s,%s, now() + %s * interval '1 second') ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, sku, buyer, HOLD_SECONDS))
        row = await cur.fetchone()
        if row is not None:
            cur = await conn.execute("UPDATE inventory_items SET stock = stock - 1 WHERE sku=%s AND stock > 0", (sku,))
            if cur.rowcount == 0:
                await conn.execute("DELETE FROM inventory_reservations WHERE id=%s", (row[0],))
                return {"status": "sold_out"}
    if row is None:
        return await _existing(pool, key)
    claimed = row[0]


    rid = claimed
    try:
        payment_id = await pay(buyer, sku, rid)
    except ChargeDeclined:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "UPDATE inventory_reservations SET status='released' WHERE id=%s AND status='held' RETURNING id", (rid,))
            if await cur.fetchone() is not None:
                await conn.execute("UPDATE inventory_items SET stock = stock + 1 WHERE sku=%s", (sku,))
        return {"status": "payment_failed", "reservation_id": rid}
    except Exception:  # unknown: maybe charged
        return {"status": "payment_unknown", "reservation_id": rid}
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status='paid', payment_id=%s WHERE id=%s AND status='held' RETURNING id",
            (payment_id, rid))
        ok = await cur.fetchone() is not None
        if not ok:
            cur = await conn.execute("SELECT status FROM inventory_reservations WHERE id=%s", (rid,))
            ok = (await cur.fetchone())[0] == "paid"
    return {"status": "paid" if ok else "expired", "reservation_id": rid, "payment_id": payment_id}

"""

BUY_PAID_WITHOUT_PAYMENT_ID = """
import asyncio
import psycopg
from course.idempotency import ChargeDeclined
from course.inventory import HOLD_SECONDS

async def _existing(pool, key):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, status FROM inventory_reservations WHERE key=%s", (key,))
        rid, status = await cur.fetchone()
    return {"status": status, "reservation_id": rid}

async def buy(pool, sku, buyer, key, pay):

    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
            "VALUES (%s,%s,%s, now() + %s * interval '1 second') ON CONFLICT (key) DO NOTHING RETURNING id",
            (key, sku, buyer, HOLD_SECONDS))
        row = await cur.fetchone()
        if row is not None:
            cur = await conn.execute("UPDATE inventory_items SET stock = stock - 1 WHERE sku=%s AND stock > 0", (sku,))
            if cur.rowcount == 0:
                await conn.execute("DELETE FROM inventory_reservations WHERE id=%s", (row[0],))
                return {"status": "sold_out"}
    if row is None:
        return await _existing(pool, key)
    claimed = row[0]


    rid = claimed
    try:
        payment_id = await pay(buyer, sku, rid)
    except ChargeDeclined:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "UPDATE inventory_reservations SET status='released' WHERE id=%s AND status='held' RETURNING id", (rid,))
            if await cur.fetchone() is not None:
                await conn.execute("UPDATE inventory_items SET stock = stock + 1 WHERE sku=%s", (sku,))
        return {"status": "payment_failed", "reservation_id": rid}
    except Exception:  # unknown: maybe charged
        return {"status": "payment_unknown", "reservation_id": rid}
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status='paid', payment_id=%s WHERE id=%s AND status='held' RETURNING id",
            (payment_id, rid))
        ok = await cur.fetchone() is not None
        if not ok:
            cur = await conn.execute("SELECT status FROM inventory_reservations WHERE id=%s", (rid,))
            ok = (await cur.fetchone())[0] == "paid"
    return {"status": "paid" if ok else "expired", "reservation_id": rid}

"""

# The reference of an earlier edition: any exception from pay releases the unit, a timeout included.
# A timeout is an unknown outcome: the provider may have charged the card, and the unit is sold again.
WRONG_BUY["release_on_timeout"] = (
    BUY_CONDITIONAL.replace("    except ChargeDeclined:\n", "    except Exception:\n").replace(
        """    except Exception:  # unknown: maybe charged
        return {"status": "payment_unknown", "reservation_id": rid}
""",
        "",
    ),
    "unknown outcome",
)

# The confirm that finds the reservation settled says 'expired' without reading the row: when the
# reaper found the charge and marked it paid, the caller refunds a purchase that is paid and sold.
WRONG_BUY["expired_when_reaper_paid"] = (
    BUY_CONDITIONAL.replace(
        """            cur = await conn.execute("SELECT status FROM inventory_reservations WHERE id = %s", (rid,))
            if (await cur.fetchone())[0] != "paid":
                return {"status": "expired", "reservation_id": rid, "payment_id": payment_id}""",
        """            return {"status": "expired", "reservation_id": rid, "payment_id": payment_id}""",
    ),
    "answer from the row",
)

WRONG_BUY["repeat_without_reservation_id"] = (BUY_REPEAT_WITHOUT_RESERVATION_ID, "no 'reservation_id'")
WRONG_BUY["paid_without_payment_id"] = (BUY_PAID_WITHOUT_PAYMENT_ID, "no 'payment_id'")

WRONG: dict[str, dict[str, tuple[str, str]]] = {"buy": WRONG_BUY, "transfer": WRONG_TRANSFER}

CORRECT: dict[str, dict[str, str]] = {
    "buy": {
        "a CTE decides, sold out deletes the reservation": BUY_CTE_RESERVE,
        "sold out raised inside the transaction": BUY_ROLLBACK_BY_EXCEPTION,
        "conditional_update": BUY_CONDITIONAL,
        "for_update": BUY_FOR_UPDATE,
        "serializable_retry": BUY_SERIALIZABLE,
        "advisory_lock": BUY_ADVISORY,
        "rollback_by_exception": BUY_ROLLBACK,
        "insert_unique_violation": BUY_UNIQUE_VIOLATION,
    },
    "transfer": {
        "id_order_for_update": TRANSFER_ID_ORDER,
        "updates_in_id_order": TRANSFER_UPDATE_ORDER,
        "source_first_with_retry": TRANSFER_RETRY,
        "serializable_retry": TRANSFER_SERIALIZABLE,
        "advisory_locks": TRANSFER_ADVISORY,
        "source_first_with_retry_and_jitter": TRANSFER_RETRY_JITTER,
        "insert_unique_violation_savepoint": TRANSFER_UNIQUE_VIOLATION,
    },
}


@pytest.mark.parametrize(
    ("task_id", "name"), [(t, n) for t, entries in WRONG.items() for n in entries], ids=lambda x: x
)
def test_wrong_answer_is_rejected_for_its_reason(task_id: str, name: str) -> None:
    source, mentions = WRONG[task_id][name]
    assert_rejected(task_id, source, mentions=mentions)


@pytest.mark.parametrize(
    ("task_id", "name"), [(t, n) for t, entries in CORRECT.items() for n in entries], ids=lambda x: x
)
def test_correct_variant_is_accepted(task_id: str, name: str) -> None:
    assert_accepted(task_id, CORRECT[task_id][name])


def test_the_reference_answer_called_directly_is_listed() -> None:
    from autograder.checks import ch10

    assert ch10.REFERENCES["buy"] == ["course.inventory:buy"]
    assert "course.ledger:transfer" in ch10.REFERENCES["transfer"]
