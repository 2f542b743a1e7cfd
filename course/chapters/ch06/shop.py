"""The shop of chapter 06: three local services, each with its own tables, and the orders table.

========== =========================================== ========================= ==========================
service    tables                                      step (given)              compensation
========== =========================================== ========================= ==========================
inventory  ``ch06_stock``, ``ch06_reservations``       :func:`reserve_stock`     :func:`release_stock`
payments   ``ch06_wallets``, ``ch06_payments``         :func:`charge_payment`    :func:`refund_payment`
shipping   ``ch06_zones``, ``ch06_shipments``          :func:`schedule_shipment` :func:`cancel_shipment`
========== =========================================== ========================= ==========================

In production each service has its own database; here they share one, and no step or
compensation ever touches another service's tables or shares a transaction with it.
Every step is one local transaction keyed by the order id, so running it twice changes
nothing the second time; each compensation is one local transaction that moves a row from
its "done" status to its "undone" status and gives back the stock or the money only when
that move happened, so it too is idempotent and safe when its step never ran.

``ch06_audit`` records, by trigger, every status a service row takes, in order: the
chapter reads it to show (and the checks to verify) the order of compensations.
``ch06_orders`` is the table of the dual-write and outbox sections.

An order is ``{"order_id", "customer", "sku", "qty", "amount_cents", "zone"}``.
"""

from __future__ import annotations

from course.saga import Step, StepFailed

SCHEMA = """
CREATE TABLE IF NOT EXISTS ch06_stock (
    sku       text PRIMARY KEY,
    available int NOT NULL CHECK (available >= 0)
);
CREATE TABLE IF NOT EXISTS ch06_reservations (
    order_id text PRIMARY KEY,
    sku      text NOT NULL,
    qty      int NOT NULL,
    status   text NOT NULL CHECK (status IN ('reserved', 'released'))
);
CREATE TABLE IF NOT EXISTS ch06_wallets (
    customer      text PRIMARY KEY,
    balance_cents bigint NOT NULL CHECK (balance_cents >= 0)
);
CREATE TABLE IF NOT EXISTS ch06_payments (
    order_id     text PRIMARY KEY,
    customer     text NOT NULL,
    amount_cents bigint NOT NULL,
    status       text NOT NULL CHECK (status IN ('charged', 'refunded'))
);
CREATE TABLE IF NOT EXISTS ch06_zones (
    zone text PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS ch06_shipments (
    order_id text PRIMARY KEY,
    zone     text NOT NULL,
    status   text NOT NULL CHECK (status IN ('scheduled', 'cancelled'))
);
CREATE TABLE IF NOT EXISTS ch06_orders (
    order_id     text PRIMARY KEY,
    customer     text NOT NULL,
    amount_cents bigint NOT NULL CHECK (amount_cents > 0),
    status       text NOT NULL DEFAULT 'placed',
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS ch06_audit (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    service  text NOT NULL,
    order_id text NOT NULL,
    status   text NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION ch06_audit_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR OLD.status IS DISTINCT FROM NEW.status THEN
        INSERT INTO ch06_audit (service, order_id, status) VALUES (TG_ARGV[0], NEW.order_id, NEW.status);
    END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS ch06_audit_reservations ON ch06_reservations;
CREATE TRIGGER ch06_audit_reservations AFTER INSERT OR UPDATE ON ch06_reservations
    FOR EACH ROW EXECUTE FUNCTION ch06_audit_status('inventory');
DROP TRIGGER IF EXISTS ch06_audit_payments ON ch06_payments;
CREATE TRIGGER ch06_audit_payments AFTER INSERT OR UPDATE ON ch06_payments
    FOR EACH ROW EXECUTE FUNCTION ch06_audit_status('payments');
DROP TRIGGER IF EXISTS ch06_audit_shipments ON ch06_shipments;
CREATE TRIGGER ch06_audit_shipments AFTER INSERT OR UPDATE ON ch06_shipments
    FOR EACH ROW EXECUTE FUNCTION ch06_audit_status('shipping');
"""

TABLES = ("ch06_stock", "ch06_reservations", "ch06_wallets", "ch06_payments", "ch06_shipments")
#: Every table the order saga writes: the services' and the saga log.
SAGA_TABLES = ("saga_log", *TABLES)


async def setup_schema(pool) -> None:
    """Create the shop's tables and audit triggers (idempotent)."""
    async with pool.connection() as conn:
        await conn.execute(SCHEMA)


async def stock_up(pool, *, stock: dict | None = None, wallets: dict | None = None, zones=()) -> None:
    """Set stock levels and wallet balances, and open shipping zones (upserts, one transaction)."""
    stock, wallets = stock or {}, wallets or {}
    async with pool.connection() as conn, conn.transaction():
        if stock:
            await conn.execute(
                "INSERT INTO ch06_stock SELECT * FROM unnest(%s::text[], %s::int[]) "
                "ON CONFLICT (sku) DO UPDATE SET available = EXCLUDED.available",
                (list(stock), list(stock.values())),
            )
        if wallets:
            await conn.execute(
                "INSERT INTO ch06_wallets SELECT * FROM unnest(%s::text[], %s::bigint[]) "
                "ON CONFLICT (customer) DO UPDATE SET balance_cents = EXCLUDED.balance_cents",
                (list(wallets), list(wallets.values())),
            )
        if zones:
            await conn.execute(
                "INSERT INTO ch06_zones SELECT unnest(%s::text[]) ON CONFLICT DO NOTHING", (list(zones),)
            )


# ----------------------------------------------------------------------------- business answers


class OutOfStock(StepFailed):
    """Inventory said no: not enough stock for the order."""


class PaymentDeclined(StepFailed):
    """Payments said no: the wallet cannot cover the amount."""


class ShippingUnavailable(StepFailed):
    """Shipping said no: the carrier does not serve the order's zone."""


# ----------------------------------------------------------------------------- the steps (given)


async def reserve_stock(pool, order: dict) -> None:
    """Inventory: take ``qty`` of ``sku`` out of stock for this order, once. Raises OutOfStock."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO ch06_reservations (order_id, sku, qty, status) VALUES (%s, %s, %s, 'reserved') "
            "ON CONFLICT (order_id) DO NOTHING RETURNING order_id",
            (order["order_id"], order["sku"], order["qty"]),
        )
        if await cur.fetchone() is None:
            return  # this order has a reservation row already: a retry changes nothing
        cur = await conn.execute(
            "UPDATE ch06_stock SET available = available - %s WHERE sku = %s AND available >= %s",
            (order["qty"], order["sku"], order["qty"]),
        )
        if cur.rowcount == 0:
            raise OutOfStock(f"{order['sku']}: fewer than {order['qty']} in stock")  # rolls the row back too


async def charge_payment(pool, order: dict) -> None:
    """Payments: take ``amount_cents`` from the customer's wallet for this order, once. Raises PaymentDeclined."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO ch06_payments (order_id, customer, amount_cents, status) VALUES (%s, %s, %s, 'charged') "
            "ON CONFLICT (order_id) DO NOTHING RETURNING order_id",
            (order["order_id"], order["customer"], order["amount_cents"]),
        )
        if await cur.fetchone() is None:
            return
        cur = await conn.execute(
            "UPDATE ch06_wallets SET balance_cents = balance_cents - %s WHERE customer = %s AND balance_cents >= %s",
            (order["amount_cents"], order["customer"], order["amount_cents"]),
        )
        if cur.rowcount == 0:
            raise PaymentDeclined(f"{order['customer']}: cannot cover {order['amount_cents']} cents")


async def schedule_shipment(pool, order: dict) -> None:
    """Shipping: book a delivery to the order's zone, once. Raises ShippingUnavailable."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT 1 FROM ch06_zones WHERE zone = %s", (order["zone"],))
        if await cur.fetchone() is None:
            raise ShippingUnavailable(f"no carrier serves zone {order['zone']!r}")
        await conn.execute(
            "INSERT INTO ch06_shipments (order_id, zone, status) VALUES (%s, %s, 'scheduled') "
            "ON CONFLICT (order_id) DO NOTHING",
            (order["order_id"], order["zone"]),
        )


# ----------------------------------------------------------------------------- the compensations (reference)


async def release_stock(pool, order: dict) -> None:
    """Undo :func:`reserve_stock`: the row moves reserved -> released, and only then the stock goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s AND status = 'reserved' "
            "RETURNING sku, qty",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            sku, qty = row
            await conn.execute("UPDATE ch06_stock SET available = available + %s WHERE sku = %s", (qty, sku))


async def refund_payment(pool, order: dict) -> None:
    """Undo :func:`charge_payment`: charged -> refunded, and only then the money goes back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "UPDATE ch06_payments SET status = 'refunded' WHERE order_id = %s AND status = 'charged' "
            "RETURNING customer, amount_cents",
            (order["order_id"],),
        )
        row = await cur.fetchone()
        if row is not None:
            await conn.execute(
                "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s",
                (row[1], row[0]),
            )


async def cancel_shipment(pool, order: dict) -> None:
    """Undo :func:`schedule_shipment`: scheduled -> cancelled (nothing to give back)."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE ch06_shipments SET status = 'cancelled' WHERE order_id = %s AND status = 'scheduled'",
            (order["order_id"],),
        )


#: The order saga: inventory, then payments, then shipping, each with its compensation.
ORDER_SAGA = (
    Step("reserve_stock", reserve_stock, release_stock),
    Step("charge_payment", charge_payment, refund_payment),
    Step("schedule_shipment", schedule_shipment, cancel_shipment),
)


# ----------------------------------------------------------------------------- reading the services' state


async def effects(pool, order: dict) -> dict:
    """What the three services hold for ``order``, and the stock and wallet it touches."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            """
            SELECT (SELECT status FROM ch06_reservations WHERE order_id = %(id)s),
                   (SELECT status FROM ch06_payments WHERE order_id = %(id)s),
                   (SELECT status FROM ch06_shipments WHERE order_id = %(id)s),
                   (SELECT available FROM ch06_stock WHERE sku = %(sku)s),
                   (SELECT balance_cents FROM ch06_wallets WHERE customer = %(customer)s)
            """,
            {"id": order["order_id"], "sku": order["sku"], "customer": order["customer"]},
        )
        reservation, payment, shipment, stock, wallet = await cur.fetchone()
    return {
        "reservation": reservation,
        "payment": payment,
        "shipment": shipment,
        "stock": stock,
        "wallet": wallet,
    }


async def effects_of(pool, orders: list[dict]) -> list[dict]:
    """:func:`effects` of many orders in one query, in the same order."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            """
            SELECT o.ord,
                   (SELECT status FROM ch06_reservations WHERE order_id = o.id),
                   (SELECT status FROM ch06_payments WHERE order_id = o.id),
                   (SELECT status FROM ch06_shipments WHERE order_id = o.id),
                   (SELECT available FROM ch06_stock WHERE sku = o.sku),
                   (SELECT balance_cents FROM ch06_wallets WHERE customer = o.customer)
            FROM unnest(%s::text[], %s::text[], %s::text[]) WITH ORDINALITY AS o(id, sku, customer, ord)
            ORDER BY o.ord
            """,
            ([o["order_id"] for o in orders], [o["sku"] for o in orders], [o["customer"] for o in orders]),
        )
        rows = await cur.fetchall()
    keys = ("reservation", "payment", "shipment", "stock", "wallet")
    return [dict(zip(keys, row[1:], strict=True)) for row in rows]


def outcome(order: dict, before: dict, after: dict) -> tuple[str, list[str]]:
    """``("completed" | "compensated" | "untouched" | "half-done" | "broken", problems)``.

    ``before`` and ``after`` come from :func:`effects`. Completed: reserved, charged and
    scheduled, the stock down by ``qty`` and the wallet by ``amount_cents``, once each.
    Compensated: nothing left in force and the stock and wallet back where they were.
    """
    stock = after["stock"] - before["stock"]
    wallet = after["wallet"] - before["wallet"]
    live = {
        "reserved": after["reservation"] == "reserved",
        "charged": after["payment"] == "charged",
        "scheduled": after["shipment"] == "scheduled",
    }
    problems = []
    if live["reserved"] and stock != -order["qty"]:
        problems.append(
            f"stock moved by {stock:+d} with the reservation in force (expected {-order['qty']:+d})"
        )
    if not live["reserved"] and stock != 0:
        problems.append(f"stock moved by {stock:+d} with no reservation in force (expected +0)")
    if live["charged"] and wallet != -order["amount_cents"]:
        problems.append(
            f"wallet moved by {wallet:+d} with the payment in force (expected {-order['amount_cents']:+d})"
        )
    if not live["charged"] and wallet != 0:
        problems.append(f"wallet moved by {wallet:+d} with no payment in force (expected +0)")
    if problems:
        return "broken", problems
    if all(live.values()):
        return "completed", []
    if not any(live.values()):
        touched = any(after[k] is not None for k in ("reservation", "payment", "shipment"))
        return ("compensated" if touched else "untouched"), []
    held = [name for name, on in live.items() if on]
    return "half-done", [f"{', '.join(held)} but not {', '.join(n for n, on in live.items() if not on)}"]


async def audit(pool, order_ids=None) -> list[tuple[str, str, str]]:
    """``[(service, order_id, status), ...]`` in the order the services' transactions wrote them."""
    async with pool.connection() as conn:
        if order_ids is None:
            cur = await conn.execute("SELECT service, order_id, status FROM ch06_audit ORDER BY id")
        else:
            cur = await conn.execute(
                "SELECT service, order_id, status FROM ch06_audit WHERE order_id = ANY(%s) ORDER BY id",
                (list(order_ids),),
            )
        return [tuple(row) for row in await cur.fetchall()]
