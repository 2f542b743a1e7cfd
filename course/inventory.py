"""Selling stock that many buyers want at once, without overselling (chapter 10).

The database decides, in one statement: a **conditional update**

    UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 RETURNING stock

re-checks ``stock > 0`` after it has the row's lock (PostgreSQL re-reads a row that a
concurrent transaction changed before it updates it), so a buyer who waited sees the
stock the previous buyer left, and no row comes back once it is 0. Reading the stock in
Python and writing it back is the bug the chapter shows first.

A sale is a **reservation**, not a payment: :func:`buy` takes the units and records a
reservation (``held``, with a deadline) in one transaction, commits, then calls the
payment provider with **no transaction open**, and finally confirms (``paid``). Only a
**definite decline** (:class:`course.idempotency.ChargeDeclined`: the provider answered that
it did not charge) gives the units back at once. A timeout, a 5xx or a lost connection is an
*unknown* outcome (the card may have been charged), so the reservation stays ``held`` and is
settled later with the provider, under the same key (the reservation id): by its webhook
(:func:`settle`) or by the reaper (:func:`release_expired`), which asks the provider about
every expired reservation before it releases one, so a paid unit is never put back on sale.
Every write says ``WHERE status = 'held'``, so whichever of the buyer, the webhook and the
reaper comes second changes nothing. Every path locks the reservation row first and the stock
row second, so none of them waits on another in a cycle. The buyer's idempotency key is
unique on the reservation: a retried purchase finds the first one (chapter 03's claim,
``INSERT ... ON CONFLICT DO NOTHING RETURNING``), and the same key for another item or
quantity is refused.

In front of the database, :func:`gate_take` is a Redis ``DECR`` gate that turns away the
crowd once the stock is gone; the database stays the source of truth, and
:func:`reconcile_gate` resets the gate from it (which is also how released units reach the
gate: it is never incremented on its own). For a large stock without a gate,
:func:`take_from_buckets` spreads one item over N rows so buyers wait on N row locks,
not one.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime

from course.idempotency import ChargeDeclined, IdempotencyKeyReused

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
    quantity   integer NOT NULL DEFAULT 1 CHECK (quantity > 0),
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
    quantity: int = 1,
    hold_seconds: float = HOLD_SECONDS,
) -> dict:
    """Reserve ``quantity`` units of ``sku``, pay for them, confirm: the course's reference answer.

    ``pay(buyer, sku, reservation_id)`` returns the payment id; the reservation id is its
    idempotency key at the provider. Returns ``{"status": "paid", "reservation_id",
    "payment_id"}``, ``{"status": "sold_out"}``, ``{"status": "payment_failed", ...}`` (the
    provider declined: the units went back to stock), ``{"status": "payment_unknown", ...}``
    (a timeout, a 5xx, a lost connection: the units stay held until the provider says what
    happened) or ``{"status": "expired", ...}`` (the payment came back after the reaper had
    released the units: the caller refunds it). A repeat of ``key`` returns its reservation as
    it stands; the same key for another item or quantity raises ``IdempotencyKeyReused``.
    """
    if isinstance(quantity, bool) or not isinstance(quantity, int) or quantity < 1:
        raise ValueError(f"quantity must be a positive int, got {quantity!r}")
    try:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO inventory_reservations (key, sku, buyer, quantity, expires_at) "
                "VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s)) "
                "ON CONFLICT (key) DO NOTHING RETURNING id",
                (key, sku, buyer, quantity, hold_seconds),
            )
            claimed = await cur.fetchone()
            if claimed is not None:
                cur = await conn.execute(
                    "UPDATE inventory_items SET stock = stock - %s WHERE sku = %s AND stock >= %s "
                    "RETURNING stock",
                    (quantity, sku, quantity),
                )
                if await cur.fetchone() is None:
                    raise _SoldOut  # rolls back the reservation too
    except _SoldOut:
        return {"status": "sold_out"}
    if claimed is None:  # a repeat: the first call's reservation answers
        return await _repeat(pool, key, (sku, buyer, quantity))
    (rid,) = claimed
    try:
        payment_id = await pay(buyer, sku, rid)  # no transaction open, no lock held
    except ChargeDeclined:  # certain: nothing was charged, so the units can go back now
        await release(pool, rid)
        return {"status": "payment_failed", "reservation_id": rid, "payment_id": None}
    except Exception:  # noqa: BLE001 - a timeout, a 5xx, a reset: the card may have been charged
        return {"status": "payment_unknown", "reservation_id": rid, "payment_id": None}
    return await settle(pool, rid, payment_id)


async def _repeat(pool, key: str, request: tuple) -> dict:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT id, status, payment_id, sku, buyer, quantity FROM inventory_reservations WHERE key = %s",
            (key,),
        )
        row = await cur.fetchone()
    if tuple(row[3:]) != request:
        raise IdempotencyKeyReused(key, f"key {key!r} was first used for {row[5]} x {row[3]!r} by {row[4]!r}")
    return _outcome(row[:3])


async def settle(pool, reservation_id: int, payment_id: str | None) -> dict:
    """Record what the provider said about a held reservation: paid (``payment_id``) or not (None).

    The buyer's confirm, the provider's webhook and the reaper all come here. Only a ``held``
    reservation changes; a second call (or a late one) finds it settled and answers from the
    row: ``paid`` when it was paid, ``expired`` when its units went back to stock first (a
    payment that then arrives is refunded by the caller).
    """
    if payment_id is None:
        await release(pool, reservation_id)
    else:
        async with pool.connection() as conn:
            await conn.execute(
                "UPDATE inventory_reservations SET status = 'paid', payment_id = %s "
                "WHERE id = %s AND status = 'held'",
                (payment_id, reservation_id),
            )
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT id, status, payment_id FROM inventory_reservations WHERE id = %s", (reservation_id,)
        )
        row = await cur.fetchone()
    if payment_id is not None and row[1] == "released":
        return {"status": "expired", "reservation_id": reservation_id, "payment_id": payment_id}
    return _outcome(row)


async def release(pool, reservation_id: int) -> bool:
    """Return a held reservation's units to stock, once: True if this call released them."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(  # the reservation row first, the stock row second: every path's order
            "UPDATE inventory_reservations SET status = 'released' WHERE id = %s AND status = 'held' "
            "RETURNING sku, quantity",
            (reservation_id,),
        )
        row = await cur.fetchone()
        if row is None:
            return False  # paid, or released already (by the reaper): never twice
        await conn.execute("UPDATE inventory_items SET stock = stock + %s WHERE sku = %s", (row[1], row[0]))
        return True


@dataclass
class Reaped:
    """What one pass of the reaper did, by reservation id."""

    released: list[int] = field(default_factory=list)  # the provider said: not charged
    paid: list[int] = field(default_factory=list)  # the provider said: charged (the confirm never came)
    unknown: list[int] = field(default_factory=list)  # the provider could not say: still held


async def release_expired(
    pool,
    ask: Callable[[int], Awaitable[str | None]],
    *,
    as_of: datetime | None = None,
    limit: int = 100,
) -> Reaped:
    """The reaper: settle held reservations past their deadline (``as_of`` defaults to now()).

    A held reservation past its deadline is not necessarily unpaid: the buyer's process may have
    died between the charge and the confirm, or its payment timed out after the card was
    charged. So the reaper asks first: ``ask(reservation_id)`` returns the payment id when the
    charge under that key went through, None when nothing was charged (and, where the provider
    allows it, voids the key, so a charge still in flight fails: Stripe cancels a
    PaymentIntent, a card network voids an authorization), and raises when the provider cannot
    say (the reservation stays held for the next pass). No transaction is open while it asks.
    """
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT id FROM inventory_reservations WHERE status = 'held' "
            "AND expires_at <= coalesce(%s::timestamptz, now()) ORDER BY expires_at, id LIMIT %s",
            (as_of, limit),
        )
        due = [rid for (rid,) in await cur.fetchall()]
    reaped = Reaped()
    for rid in due:
        try:
            payment_id = await ask(rid)
        except Exception:  # noqa: BLE001 - the provider cannot say: leave it held, ask again next pass
            reaped.unknown.append(rid)
            continue
        if payment_id is None:
            if await release(pool, rid):
                reaped.released.append(rid)
        elif (await settle(pool, rid, payment_id))["status"] == "paid":
            reaped.paid.append(rid)
    return reaped


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


async def reconcile_gate(pool, redis, sku: str) -> tuple[int | None, int]:
    """Reset the gate from the source of truth: ``(what the gate said, what the database holds)``.

    The gate only ever goes down. Units the database gets back (a declined payment, the
    reaper) reach the gate here, and so does the unit of a buyer who passed the gate and died
    before the database (or writes a Redis failover lost): the database wins. Run it on a
    schedule and after every failover.
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
