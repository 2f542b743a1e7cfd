"""Selling stock that many buyers want at once, without overselling (chapter 10).

The database decides, in one statement: a **conditional update**

    UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 RETURNING stock

re-checks ``stock > 0`` after it has the row's lock (PostgreSQL re-reads a row that a
concurrent transaction changed before it updates it), so a buyer who waited sees the
stock the previous buyer left, and no row comes back once it is 0. Reading the stock in
Python and writing it back is the bug the chapter shows first.

A sale is a **reservation**, not a payment: :func:`buy` takes a unit and records a
reservation (``held``, with a deadline) in one transaction, commits, then calls the
payment provider with **no transaction open**, and finally confirms (``paid``) or, when the
payment failed, releases the unit. Both the confirm and the release say
``WHERE status = 'held'``, so a reservation the reaper (:func:`release_expired`) returned to
stock is never returned twice nor confirmed after it expired. The buyer's idempotency key is
unique on the reservation: a retried purchase finds the first one (chapter 03's claim,
``INSERT ... ON CONFLICT DO NOTHING RETURNING``).

In front of the database, :func:`gate_take` is a Redis ``DECR`` gate that turns away the
crowd once the stock is gone; the database stays the source of truth and
:func:`reconcile_gate` resets the gate from it. For a large stock without a gate,
:func:`take_from_buckets` spreads one item over N rows so buyers wait on N row locks,
not one.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from datetime import datetime

#: How long a reservation holds its unit before the reaper returns it (ten minutes).
HOLD_SECONDS = 600.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS inventory_items (
    sku   text PRIMARY KEY,
    stock integer NOT NULL
);
CREATE TABLE IF NOT EXISTS inventory_reservations (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key        text NOT NULL UNIQUE,
    sku        text NOT NULL,
    buyer      text NOT NULL,
    status     text NOT NULL DEFAULT 'held' CHECK (status IN ('held', 'paid', 'released')),
    payment_id text,
    expires_at timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS inventory_reservations_held ON inventory_reservations (expires_at) WHERE status = 'held';
CREATE TABLE IF NOT EXISTS inventory_buckets (
    sku    text NOT NULL,
    bucket integer NOT NULL,
    stock  integer NOT NULL CHECK (stock >= 0),
    PRIMARY KEY (sku, bucket)
);
"""


async def setup_schema(pool_or_conn) -> None:
    """Create the pattern's tables (idempotent): items, reservations, stock buckets."""
    from course.kit.lab import connection

    async with connection(pool_or_conn) as conn:
        await conn.execute(SCHEMA)


async def stock_item(pool, sku: str, stock: int) -> None:
    """Put ``sku`` on sale with ``stock`` units (replacing its stock and its reservations)."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("DELETE FROM inventory_reservations WHERE sku = %s", (sku,))
        await conn.execute(
            "INSERT INTO inventory_items (sku, stock) VALUES (%s, %s) ON CONFLICT (sku) DO UPDATE "
            "SET stock = %s",
            (sku, stock, stock),
        )


class _SoldOut(Exception):
    pass


def _outcome(row) -> dict:
    rid, status, payment_id = row
    return {"status": status, "reservation_id": rid, "payment_id": payment_id}


async def buy(
    pool,
    sku: str,
    buyer: str,
    key: str,
    pay: Callable[[str, str, int], Awaitable[str]],
    *,
    hold_seconds: float = HOLD_SECONDS,
) -> dict:
    """Reserve one unit of ``sku``, pay for it, confirm: the course's reference answer.

    Returns ``{"status": "paid", "reservation_id", "payment_id"}``, ``{"status": "sold_out"}``,
    ``{"status": "payment_failed", ...}`` (the payment raised; the unit went back to stock), or
    ``{"status": "expired", ...}`` (the payment came back after the reaper had returned the unit:
    the caller refunds it). A repeat of ``key`` returns its reservation as it stands.
    """
    try:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO inventory_reservations (key, sku, buyer, expires_at) "
                "VALUES (%s, %s, %s, now() + make_interval(secs => %s)) "
                "ON CONFLICT (key) DO NOTHING RETURNING id",
                (key, sku, buyer, hold_seconds),
            )
            claimed = await cur.fetchone()
            if claimed is not None:
                cur = await conn.execute(
                    "UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 "
                    "RETURNING stock",
                    (sku,),
                )
                if await cur.fetchone() is None:
                    raise _SoldOut  # rolls back the reservation too
    except _SoldOut:
        return {"status": "sold_out"}
    if claimed is None:  # a repeat: the first call's reservation answers
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT id, status, payment_id FROM inventory_reservations WHERE key = %s", (key,)
            )
            return _outcome(await cur.fetchone())
    (rid,) = claimed
    try:
        payment_id = await pay(buyer, sku, rid)  # no transaction open, no lock held
    except Exception:  # noqa: BLE001 - a declined or timed-out payment gives the unit back
        await release(pool, rid)
        return {"status": "payment_failed", "reservation_id": rid, "payment_id": None}
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status = 'paid', payment_id = %s WHERE id = %s "
            "AND status = 'held' RETURNING id, status, payment_id",
            (payment_id, rid),
        )
        row = await cur.fetchone()
    if row is None:  # the deadline passed and the reaper returned the unit: refund
        return {"status": "expired", "reservation_id": rid, "payment_id": payment_id}
    return _outcome(row)


async def release(pool, reservation_id: int) -> bool:
    """Return a held reservation's unit to stock, once: True if this call released it."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE inventory_reservations SET status = 'released' WHERE id = %s AND status = 'held' "
            "RETURNING sku",
            (reservation_id,),
        )
        row = await cur.fetchone()
        if row is None:
            return False  # paid, or released already (by the reaper): never twice
        await conn.execute("UPDATE inventory_items SET stock = stock + 1 WHERE sku = %s", row)
        return True


async def release_expired(pool, *, as_of: datetime | None = None, limit: int = 100) -> list[int]:
    """The reaper: release held reservations past their deadline (``as_of`` defaults to now()).

    One statement per batch: the expired rows are marked ``released`` (``SKIP LOCKED``, so
    two reapers share the work) and their units go back to stock in the same transaction.
    """
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            """
            UPDATE inventory_reservations SET status = 'released'
            WHERE id IN (
                SELECT id FROM inventory_reservations
                WHERE status = 'held' AND expires_at <= coalesce(%s::timestamptz, now())
                ORDER BY expires_at LIMIT %s
                FOR UPDATE SKIP LOCKED)
            RETURNING id, sku
            """,
            (as_of, limit),
        )
        rows = await cur.fetchall()
        for _, sku in rows:
            await conn.execute("UPDATE inventory_items SET stock = stock + 1 WHERE sku = %s", (sku,))
    return sorted(rid for rid, _ in rows)


async def sold(pool, sku: str) -> dict[str, int]:
    """Reservations of ``sku`` by status, read from PostgreSQL."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT status, count(*) FROM inventory_reservations WHERE sku = %s GROUP BY status", (sku,)
        )
        return dict(await cur.fetchall())


# ----------------------------------------------------------------------------- a Redis gate in front


def gate_key(sku: str) -> str:
    return f"stock:{{{sku}}}"


async def gate_open(redis, sku: str, stock: int) -> None:
    """Load the gate with the stock the database holds."""
    await redis.set(gate_key(sku), stock)


async def gate_take(redis, sku: str) -> bool:
    """``DECR`` is atomic: a result of 0 or more lets this buyer through to the database.

    Below zero the stock is gone: the buyer is turned away without a database round trip.
    The database's conditional update still decides; the gate only sheds the crowd.
    """
    return await redis.decr(gate_key(sku)) >= 0


async def gate_return(redis, sku: str) -> None:
    """Give a unit back to the gate (an expired or unpaid reservation)."""
    await redis.incr(gate_key(sku))


async def reconcile_gate(pool, redis, sku: str) -> tuple[int | None, int]:
    """Reset the gate from the source of truth: ``(what the gate said, what the database holds)``.

    A crash between the ``DECR`` and the database (or a Redis failover that lost writes)
    leaves the two apart; the database wins.
    """
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s", (sku,))
        (stock,) = await cur.fetchone()
    before = await redis.get(gate_key(sku))
    await redis.set(gate_key(sku), stock)
    return (None if before is None else max(int(before), 0)), stock


# ----------------------------------------------------------------------------- stock in buckets


async def stock_buckets(pool, sku: str, stock: int, buckets: int) -> None:
    """Spread ``stock`` units of ``sku`` over ``buckets`` rows (as evenly as they go)."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("DELETE FROM inventory_buckets WHERE sku = %s", (sku,))
        for b in range(buckets):
            share = stock // buckets + (1 if b < stock % buckets else 0)
            await conn.execute(
                "INSERT INTO inventory_buckets (sku, bucket, stock) VALUES (%s, %s, %s)", (sku, b, share)
            )


async def take_from_buckets(pool, sku: str, buckets: int, rand: random.Random | None = None) -> bool:
    """Take one unit from a random bucket; when that one is empty, from any bucket that is not.

    Each try is a conditional update, so a bucket never goes below zero; False only when
    every bucket is empty.
    """
    start = (rand or random).randrange(buckets)
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_buckets SET stock = stock - 1 WHERE sku = %s AND bucket = %s AND stock > 0 "
            "RETURNING 1",
            (sku, start),
        )
        if await cur.fetchone() is not None:
            return True
        cur = await conn.execute(
            """
            UPDATE inventory_buckets SET stock = stock - 1
            WHERE (sku, bucket) = (
                SELECT sku, bucket FROM inventory_buckets WHERE sku = %s AND stock > 0
                ORDER BY bucket LIMIT 1 FOR UPDATE SKIP LOCKED)
            RETURNING 1
            """,
            (sku,),
        )
        if await cur.fetchone() is not None:
            return True
        cur = await conn.execute(
            "SELECT coalesce(sum(stock), 0) FROM inventory_buckets WHERE sku = %s", (sku,)
        )
        (left,) = await cur.fetchone()
    if left:  # every non-empty bucket was locked a moment ago: wait for one this time
        return await _take_any_waiting(pool, sku)
    return False


async def _take_any_waiting(pool, sku: str) -> bool:
    async with pool.connection() as conn:
        cur = await conn.execute(
            """
            UPDATE inventory_buckets SET stock = stock - 1
            WHERE (sku, bucket) = (
                SELECT sku, bucket FROM inventory_buckets WHERE sku = %s AND stock > 0
                ORDER BY bucket LIMIT 1 FOR UPDATE)
              AND stock > 0
            RETURNING 1
            """,
            (sku,),
        )
        return await cur.fetchone() is not None
