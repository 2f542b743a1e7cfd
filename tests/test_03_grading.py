"""Chapter 03 grading: the wrong answers learners write are rejected, correct designs pass.

Each wrong answer is kept as the source a learner would type into the answer cell. The
races are orchestrated by the check (autograder/checks/ch03.py), so every verdict here is
the same on every run.
"""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import (
    assert_accepted,
    assert_rejected,
    correct_params,
    notebook_with_answers,
    run_source,
    solution_source,
    wrong_params,
)

HEADER = """
from psycopg.types.json import Jsonb
from course.idempotency import ChargeDeclined, IdempotencyKeyReused, RequestInProgress, request_hash
"""

# ----------------------------------------------------------------------------- create_order: correct designs

PENDING_ROW = (
    HEADER
    + """
async def create_order(pool, idempotency_key, body, charge):
    h = request_hash(body)
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash, request) VALUES (%s, %s, %s) "
            "ON CONFLICT (key) DO NOTHING RETURNING key",
            (idempotency_key, h, Jsonb(body)))
        claimed = await cur.fetchone() is not None
        if not claimed:
            cur = await conn.execute(
                "SELECT request_hash, status, response FROM idempotency_keys WHERE key = %s", (idempotency_key,))
            row = await cur.fetchone()
            if row is None:
                raise RequestInProgress(idempotency_key)
            if row[0] != h:
                raise IdempotencyKeyReused(idempotency_key)
            if row[1] != "done":
                raise RequestInProgress(idempotency_key)
            return row[2]
    try:
        charge_id = await charge(body["customer"], body["amount_cents"])
    except ChargeDeclined:
        async with pool.connection() as conn:
            await conn.execute("DELETE FROM idempotency_keys WHERE key = %s", (idempotency_key,))
        raise
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
            (body["customer"], body["amount_cents"], charge_id))
        (order_id,) = await cur.fetchone()
        response = {"order_id": order_id, "charge_id": charge_id}
        await conn.execute("UPDATE idempotency_keys SET status = 'done', response = %s WHERE key = %s",
                           (Jsonb(response), idempotency_key))
    return response
"""
)

CLASSIFIED_BY_STATUS = PENDING_ROW.replace(
    """    except ChargeDeclined:
        async with pool.connection() as conn:
            await conn.execute("DELETE FROM idempotency_keys WHERE key = %s", (idempotency_key,))
        raise
""",
    """    except Exception as err:
        status = getattr(err, "status", None)
        if status is not None and 400 <= status < 500 and status != 409:  # the provider said no: certain
            async with pool.connection() as conn:
                await conn.execute("DELETE FROM idempotency_keys WHERE key = %s AND status = 'pending'",
                                   (idempotency_key,))
        raise  # anything else is uncertain: the claim stays pending for the reaper
""",
)

ONE_TRANSACTION = (
    HEADER
    + """
async def create_order(pool, idempotency_key, body, charge):
    h = request_hash(body)
    uncertain = None
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash, request) VALUES (%s, %s, %s) "
            "ON CONFLICT (key) DO NOTHING RETURNING key",
            (idempotency_key, h, Jsonb(body)))
        if await cur.fetchone() is None:
            cur = await conn.execute("SELECT request_hash, status, response FROM idempotency_keys WHERE key = %s",
                                     (idempotency_key,))
            stored_hash, status, response = await cur.fetchone()
            if stored_hash != h:
                raise IdempotencyKeyReused(idempotency_key)
            if status != "done":
                raise RequestInProgress(idempotency_key)
            return response
        try:
            charge_id = await charge(body["customer"], body["amount_cents"])
        except ChargeDeclined:
            raise                       # rolls the claim back: the key is free
        except Exception as err:
            uncertain = err             # commit the pending claim for the reaper, then raise
        else:
            cur = await conn.execute(
                "INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                (body["customer"], body["amount_cents"], charge_id))
            (order_id,) = await cur.fetchone()
            response = {"order_id": order_id}
            await conn.execute("UPDATE idempotency_keys SET status = 'done', response = %s WHERE key = %s",
                               (Jsonb(response), idempotency_key))
    if uncertain is not None:
        raise uncertain
    return response
"""
)

UNIQUE_VIOLATION_CLAIM = (
    HEADER
    + """
import psycopg

async def create_order(pool, idempotency_key, body, charge):
    h = request_hash(body)
    try:
        async with pool.connection() as conn:
            await conn.execute("INSERT INTO idempotency_keys (key, request_hash, request) VALUES (%s, %s, %s)",
                               (idempotency_key, h, Jsonb(body)))
    except psycopg.errors.UniqueViolation:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT request_hash, status, response FROM idempotency_keys WHERE key = %s",
                                     (idempotency_key,))
            row = await cur.fetchone()
        if row is None or row[1] != "done":
            if row is not None and row[0] != h:
                raise IdempotencyKeyReused(idempotency_key)
            raise RequestInProgress(idempotency_key)
        if row[0] != h:
            raise IdempotencyKeyReused(idempotency_key)
        return row[2]
    try:
        charge_id = await charge(body["customer"], body["amount_cents"])
    except ChargeDeclined:
        async with pool.connection() as conn:
            await conn.execute("DELETE FROM idempotency_keys WHERE key = %s AND status = 'pending'", (idempotency_key,))
        raise
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                                 (body["customer"], body["amount_cents"], charge_id))
        (order_id,) = await cur.fetchone()
        cur = await conn.execute(
            "UPDATE idempotency_keys SET status = 'done', response = %s WHERE key = %s RETURNING response",
            (Jsonb({"id": order_id, "status": "created"}), idempotency_key))
        return (await cur.fetchone())[0]
"""
)

# ----------------------------------------------------------------------------- create_order: wrong answers

CHECK_THEN_INSERT = (
    HEADER
    + """
async def create_order(pool, idempotency_key, body, charge):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT response FROM idempotency_keys WHERE key = %s", (idempotency_key,))
        row = await cur.fetchone()
        if row is not None:
            return row[0]
    charge_id = await charge(body["customer"], body["amount_cents"])
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                                 (body["customer"], body["amount_cents"], charge_id))
        (order_id,) = await cur.fetchone()
        response = {"order_id": order_id}
        await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash, status, response) VALUES (%s, %s, 'done', %s) "
            "ON CONFLICT (key) DO NOTHING",
            (idempotency_key, request_hash(body), Jsonb(response)))
    return response
"""
)

CHECK_THEN_INSERT_IN_TRANSACTION = (
    HEADER
    + """
async def create_order(pool, idempotency_key, body, charge):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT response FROM idempotency_keys WHERE key = %s", (idempotency_key,))
        row = await cur.fetchone()
        if row is not None:
            return row[0]
        charge_id = await charge(body["customer"], body["amount_cents"])
        cur = await conn.execute("INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                                 (body["customer"], body["amount_cents"], charge_id))
        (order_id,) = await cur.fetchone()
        response = {"order_id": order_id}
        await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash, status, response) VALUES (%s, %s, 'done', %s)",
            (idempotency_key, request_hash(body), Jsonb(response)))
    return response
"""
)

# The mistake issue 11 found scoring full marks: right in one process, two charges with two replicas.
IN_PROCESS_LOCK_PER_KEY = (
    HEADER
    + """
import asyncio
from collections import defaultdict

_locks = defaultdict(asyncio.Lock)

async def create_order(pool, idempotency_key, body, charge):
    async with _locks[idempotency_key]:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT request_hash, response FROM idempotency_keys WHERE key = %s",
                                     (idempotency_key,))
            row = await cur.fetchone()
        if row is not None:
            if row[0] != request_hash(body):
                raise IdempotencyKeyReused(idempotency_key)
            return row[1]
        charge_id = await charge(body["customer"], body["amount_cents"])
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                (body["customer"], body["amount_cents"], charge_id))
            (order_id,) = await cur.fetchone()
            response = {"order_id": order_id}
            await conn.execute(
                "INSERT INTO idempotency_keys (key, request_hash, status, response) VALUES (%s, %s, 'done', %s)",
                (idempotency_key, request_hash(body), Jsonb(response)))
        return response
"""
)

IN_PROCESS_SINGLE_FLIGHT = (
    HEADER
    + """
import asyncio

_inflight = {}   # key -> the task creating that order, in this process

async def _create(pool, idempotency_key, body, charge):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT response FROM idempotency_keys WHERE key = %s", (idempotency_key,))
        row = await cur.fetchone()
    if row is not None:
        return row[0]
    charge_id = await charge(body["customer"], body["amount_cents"])
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
            (body["customer"], body["amount_cents"], charge_id))
        (order_id,) = await cur.fetchone()
        response = {"order_id": order_id}
        await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash, status, response) VALUES (%s, %s, 'done', %s)",
            (idempotency_key, request_hash(body), Jsonb(response)))
    return response

async def create_order(pool, idempotency_key, body, charge):
    task = _inflight.get(idempotency_key)
    if task is None:
        task = _inflight[idempotency_key] = asyncio.ensure_future(_create(pool, idempotency_key, body, charge))
        task.add_done_callback(lambda _t: _inflight.pop(idempotency_key, None))
    return await asyncio.shield(task)
"""
)

CLAIM_WITHOUT_STORED_RESPONSE = (
    HEADER
    + """
async def create_order(pool, idempotency_key, body, charge):
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING RETURNING key",
            (idempotency_key, request_hash(body)))
        if await cur.fetchone() is None:
            return {}  # already handled
    charge_id = await charge(body["customer"], body["amount_cents"])
    async with pool.connection() as conn:
        cur = await conn.execute("INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                                 (body["customer"], body["amount_cents"], charge_id))
        (order_id,) = await cur.fetchone()
    return {"order_id": order_id}
"""
)

CLAIM_THEN_NEW_ORDER_ON_REPEAT = (
    HEADER
    + """
async def create_order(pool, idempotency_key, body, charge):
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING RETURNING key",
            (idempotency_key, request_hash(body)))
        claimed = await cur.fetchone() is not None
    charge_id = await charge(body["customer"], body["amount_cents"]) if claimed else None
    async with pool.connection() as conn:
        cur = await conn.execute("INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                                 (body["customer"], body["amount_cents"], charge_id))
        (order_id,) = await cur.fetchone()
    return {"order_id": order_id}
"""
)

PENDING_RETURNS_NONE = (
    HEADER
    + """
async def create_order(pool, idempotency_key, body, charge):
    h = request_hash(body)
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash, request) VALUES (%s, %s, %s) "
            "ON CONFLICT (key) DO NOTHING RETURNING key",
            (idempotency_key, h, Jsonb(body)))
        if await cur.fetchone() is None:
            cur = await conn.execute("SELECT request_hash, response FROM idempotency_keys WHERE key = %s", (idempotency_key,))
            stored_hash, response = await cur.fetchone()
            if stored_hash != h:
                raise IdempotencyKeyReused(idempotency_key)
            return response  # None while the first request is still running
    try:
        charge_id = await charge(body["customer"], body["amount_cents"])
    except ChargeDeclined:
        async with pool.connection() as conn:
            await conn.execute("DELETE FROM idempotency_keys WHERE key = %s", (idempotency_key,))
        raise
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                                 (body["customer"], body["amount_cents"], charge_id))
        (order_id,) = await cur.fetchone()
        response = {"order_id": order_id}
        await conn.execute("UPDATE idempotency_keys SET status = 'done', response = %s WHERE key = %s",
                           (Jsonb(response), idempotency_key))
    return response
"""
)

_RELEASE_ON_DECLINE = """    except ChargeDeclined:
        async with pool.connection() as conn:
            await conn.execute("DELETE FROM idempotency_keys WHERE key = %s", (idempotency_key,))
        raise
"""

NO_RELEASE_ON_FAILURE = PENDING_ROW.replace(
    """    try:
        charge_id = await charge(body["customer"], body["amount_cents"])
"""
    + _RELEASE_ON_DECLINE,
    """    charge_id = await charge(body["customer"], body["amount_cents"])
""",
)

# What the task used to ask: any failure releases the key, so a timeout lets the retry charge again.
RELEASE_ON_ANY_FAILURE = PENDING_ROW.replace(
    _RELEASE_ON_DECLINE, _RELEASE_ON_DECLINE.replace("ChargeDeclined", "Exception")
)

RELEASE_ON_PROVIDER_ERROR = PENDING_ROW.replace(
    _RELEASE_ON_DECLINE, _RELEASE_ON_DECLINE.replace("ChargeDeclined", "(ChargeDeclined, ProviderError)")
).replace(
    "from course.idempotency import ChargeDeclined,", "from course.idempotency import ProviderError, ChargeDeclined,"
)

NO_REQUEST_STORED = PENDING_ROW.replace(
    """            "INSERT INTO idempotency_keys (key, request_hash, request) VALUES (%s, %s, %s) "
            "ON CONFLICT (key) DO NOTHING RETURNING key",
            (idempotency_key, h, Jsonb(body)))""",
    """            "INSERT INTO idempotency_keys (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING RETURNING key",
            (idempotency_key, h))""",
)

NO_REQUEST_HASH = PENDING_ROW.replace(
    """            if row[0] != h:
                raise IdempotencyKeyReused(idempotency_key)
""",
    "",
)

FAILURE_SWALLOWED = PENDING_ROW.replace(
    _RELEASE_ON_DECLINE,
    _RELEASE_ON_DECLINE.replace("        raise\n", '        return {"error": "payment failed"}\n'),
)


def test_03_the_kept_variants_differ_from_the_design_they_break():
    for variant in (NO_RELEASE_ON_FAILURE, RELEASE_ON_ANY_FAILURE, RELEASE_ON_PROVIDER_ERROR, NO_REQUEST_STORED,
                    NO_REQUEST_HASH, FAILURE_SWALLOWED, CLASSIFIED_BY_STATUS):  # fmt: skip
        assert variant != PENDING_ROW


def test_03_create_order_stub_scores_zero():
    res = run_source(
        "create_order", "async def create_order(pool, idempotency_key, body, charge):\n    raise NotImplementedError\n"
    )
    assert res.points == 0 and "not done yet" in res.text()


# ----------------------------------------------------------------------------- consume_payment_event

CONSUMER_CREDIT_FIRST_IN_TRANSACTION = """
import psycopg

async def consume_payment_event(pool, event):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
                           (event["amount_cents"], event["account_id"]))
        cur = await conn.execute(
            "INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING RETURNING event_id",
            (event["event_id"],))
        if await cur.fetchone() is None:
            raise psycopg.Rollback()  # a duplicate: undo the credit, acknowledge quietly
"""

CONSUMER_SELECT_THEN_INSERT_IN_TRANSACTION = """
async def consume_payment_event(pool, event):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT 1 FROM processed_events WHERE event_id = %s", (event["event_id"],))
        if await cur.fetchone():
            return
        await conn.execute("UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
                           (event["amount_cents"], event["account_id"]))
        await conn.execute("INSERT INTO processed_events (event_id) VALUES (%s)", (event["event_id"],))
"""


CONSUMER_NO_DEDUP = """
async def consume_payment_event(pool, event):
    async with pool.connection() as conn:
        await conn.execute("UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
                           (event["amount_cents"], event["account_id"]))
"""

CONSUMER_CHECK_THEN_INSERT = """
async def consume_payment_event(pool, event):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT 1 FROM processed_events WHERE event_id = %s", (event["event_id"],))
        if await cur.fetchone():
            return
        await conn.execute("UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
                           (event["amount_cents"], event["account_id"]))
        await conn.execute("INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING",
                           (event["event_id"],))
"""

CONSUMER_DEDUP_OUTSIDE_TRANSACTION = """
async def consume_payment_event(pool, event):
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING RETURNING event_id",
            (event["event_id"],))
        if await cur.fetchone() is None:
            return
        await conn.execute("UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
                           (event["amount_cents"], event["account_id"]))
"""

CONSUMER_CREDIT_THEN_DEDUP_SEPARATE_COMMITS = """
async def consume_payment_event(pool, event):
    async with pool.connection() as conn:
        # one delivery of an event at a time (a session advisory lock), then check, credit, record
        await conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (event["event_id"],))
        try:
            cur = await conn.execute("SELECT 1 FROM processed_events WHERE event_id = %s", (event["event_id"],))
            if await cur.fetchone():
                return
            await conn.execute("UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
                               (event["amount_cents"], event["account_id"]))
            await conn.execute("INSERT INTO processed_events (event_id) VALUES (%s)", (event["event_id"],))
        finally:
            await conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (event["event_id"],))
"""

# Right in one process (a lock per event, the id remembered after the commit), twice with two replicas.
CONSUMER_IN_MEMORY_DEDUP_WITH_LOCK = """
import asyncio
from collections import defaultdict

_seen = set()
_locks = defaultdict(asyncio.Lock)

async def consume_payment_event(pool, event):
    event_id = event["event_id"]
    async with _locks[event_id]:
        if event_id in _seen:
            return
        async with pool.connection() as conn, conn.transaction():
            await conn.execute("UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
                               (event["amount_cents"], event["account_id"]))
            await conn.execute("INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING",
                               (event_id,))
        _seen.add(event_id)
"""

CONSUMER_IN_MEMORY_SET = """
processed = set()

async def consume_payment_event(pool, event):
    if event["event_id"] in processed:
        return
    processed.add(event["event_id"])
    async with pool.connection() as conn:
        await conn.execute("UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
                           (event["amount_cents"], event["account_id"]))
"""

CONSUMER_READ_MODIFY_WRITE = """
async def consume_payment_event(pool, event):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING RETURNING event_id",
            (event["event_id"],))
        if await cur.fetchone() is None:
            return
        cur = await conn.execute("SELECT balance_cents FROM accounts WHERE id = %s", (event["account_id"],))
        (balance,) = await cur.fetchone()
        await conn.execute("UPDATE accounts SET balance_cents = %s WHERE id = %s",
                           (balance + event["amount_cents"], event["account_id"]))
"""

CONSUMER_SWALLOWS_ERRORS = """
async def consume_payment_event(pool, event):
    try:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING RETURNING event_id",
                (event["event_id"],))
            if await cur.fetchone() is None:
                return
            await conn.execute("UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
                               (event["amount_cents"], event["account_id"]))
    except Exception as err:
        print("could not apply", event["event_id"], err)
"""


# ----------------------------------------------------------------------------- the tables

HASH_OF_THE_AMOUNT_ONLY = PENDING_ROW.replace(
    "    h = request_hash(body)\n", '    h = request_hash({"amount_cents": body["amount_cents"]})\n'
)

HASH_OF_THE_CUSTOMER_ONLY = PENDING_ROW.replace(
    "    h = request_hash(body)\n", '    h = request_hash({"customer": body["customer"]})\n'
)

ORDER_WITHOUT_CHARGE_ID = PENDING_ROW.replace(
    """            "INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
            (body["customer"], body["amount_cents"], charge_id))""",
    """            "INSERT INTO orders (customer, amount_cents) VALUES (%s, %s) RETURNING id",
            (body["customer"], body["amount_cents"]))""",
)

RESPONSE_WITHOUT_THE_ORDER_ID = PENDING_ROW.replace(
    'response = {"order_id": order_id, "charge_id": charge_id}',
    'response = {"status": "created", "charge_id": charge_id}',
)

REPEAT_REBUILDS_THE_RESPONSE = PENDING_ROW.replace(
    "            return row[2]\n", '            return {"order_id": row[2]["order_id"]}  # "the id is all they need"\n'
)

_SOLUTION_CREATE_ORDER = HEADER + solution_source("03", "create_order")
_ONE_TRANSACTION = """    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO orders"""
assert _ONE_TRANSACTION in _SOLUTION_CREATE_ORDER
# the order and the stored response in two autocommit statements: a crash between them leaves an order
# behind a pending key, and the reaper makes a second one
ORDER_AND_RESPONSE_IN_TWO_COMMITS = _SOLUTION_CREATE_ORDER.replace(
    _ONE_TRANSACTION, _ONE_TRANSACTION.replace("as conn, conn.transaction():", "as conn:")
)

WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "create_order": {
        "check then insert": (CHECK_THEN_INSERT, "charged 10 times"),
        "check then insert in a transaction": (CHECK_THEN_INSERT_IN_TRANSACTION, "charged 10 times"),
        "in-process lock per key": (
            IN_PROCESS_LOCK_PER_KEY,
            "two replicas with one key: 2 charges; state kept in one process is not shared",
        ),
        "in-process single flight": (
            IN_PROCESS_SINGLE_FLIGHT,
            "two replicas with one key: 2 charges; state kept in one process is not shared",
        ),
        "claim without a stored response": (CLAIM_WITHOUT_STORED_RESPONSE, "expected the stored response"),
        "claim, then a new order on repeat": (CLAIM_THEN_NEW_ORDER_ON_REPEAT, "order(s)"),
        "pending returns None": (PENDING_RETURNS_NONE, "identical"),
        "no release on a decline": (NO_RELEASE_ON_FAILURE, "stuck forever"),
        "release on any failure": (RELEASE_ON_ANY_FAILURE, "the charge may have gone through"),
        "order and response in two commits": (ORDER_AND_RESPONSE_IN_TWO_COMMITS, "half of the last step committed"),
        "release on a provider error": (RELEASE_ON_PROVIDER_ERROR, "the charge may have gone through"),
        "no request stored": (NO_REQUEST_STORED, "request column is empty"),
        "no request hash": (NO_REQUEST_HASH, "IdempotencyKeyReused"),
        "hash of the amount only": (HASH_OF_THE_AMOUNT_ONLY, "'hopper'"),
        "hash of the customer only": (HASH_OF_THE_CUSTOMER_ONLY, "999"),
        "failure swallowed": (FAILURE_SWALLOWED, "let the error reach the caller"),
        "order without the charge id": (ORDER_WITHOUT_CHARGE_ID, "the id charge returned"),
        "response without the order id": (RESPONSE_WITHOUT_THE_ORDER_ID, "does not name the order id"),
        "repeat rebuilds the response": (REPEAT_REBUILDS_THE_RESPONSE, "expected the stored response"),
    },
    "consume_payment_event": {
        "no dedup": (CONSUMER_NO_DEDUP, "the same event delivered again"),
        "check then insert": (CONSUMER_CHECK_THEN_INSERT, "credited 5 times"),
        "dedup insert outside the transaction": (CONSUMER_DEDUP_OUTSIDE_TRANSACTION, "never credited"),
        "credit, then dedup, separate commits": (CONSUMER_CREDIT_THEN_DEDUP_SEPARATE_COMMITS, "credited again"),
        "in-memory dedup with a lock": (
            CONSUMER_IN_MEMORY_DEDUP_WITH_LOCK,
            "two replicas with one event: credited 2 times; state kept in one process is not shared",
        ),
        "in-memory set": (
            CONSUMER_IN_MEMORY_SET,
            "two replicas with one event: credited 2 times; state kept in one process is not shared",
        ),
        "read, modify, write": (CONSUMER_READ_MODIFY_WRITE, "lost"),
        "swallows errors": (CONSUMER_SWALLOWS_ERRORS, "swallowed"),
    },
}

#: answers that only import the course's reference (course.idempotency) are not correct answers (REFERENCES)
CORRECT: dict[str, dict[str, str]] = {
    "create_order": {
        "solution": HEADER + solution_source("03", "create_order"),
        "pending row, 409": PENDING_ROW,
        "classified by status": CLASSIFIED_BY_STATUS,
        "one transaction": ONE_TRANSACTION,
        "unique violation claim": UNIQUE_VIOLATION_CLAIM,
    },
    "consume_payment_event": {
        "solution": HEADER + solution_source("03", "consume_payment_event"),
        "credit first in a transaction": CONSUMER_CREDIT_FIRST_IN_TRANSACTION,
        "select then insert in a transaction": CONSUMER_SELECT_THEN_INSERT_IN_TRANSACTION,
    },
}


@pytest.mark.parametrize(("task_id", "source", "mentions"), wrong_params(WRONG))
def test_03_wrong_answers_are_rejected_for_their_mistake(task_id, source, mentions):
    assert_rejected(task_id, source, mentions=mentions)


@pytest.mark.parametrize(("task_id", "source"), correct_params(CORRECT))
def test_03_correct_answers_get_full_marks(task_id, source):
    assert_accepted(task_id, source)


# ----------------------------------------------------------------------------- the notebook as a whole


@pytest.mark.slow
def test_03_course_check_scores_a_wrong_notebook_below_full_marks(tmp_path):
    from autograder.check import check

    wrong = {"create_order": CHECK_THEN_INSERT, "consume_payment_event": CONSUMER_DEDUP_OUTSIDE_TRANSACTION}
    path = notebook_with_answers("03_idempotency", wrong, tmp_path)
    res = check(path)
    shutil.rmtree(tmp_path, ignore_errors=True)
    by_task = {t.id: t for t in res.tasks}
    assert res.score == 0, res
    assert not by_task["create_order"].passed and not by_task["consume_payment_event"].passed
