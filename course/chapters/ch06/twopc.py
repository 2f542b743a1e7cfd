"""Two-phase commit, live: PostgreSQL's ``PREPARE TRANSACTION`` as the participants' "yes" vote.

The coordinator reserves stock on the inventory connection and takes money on the
payments connection (two participants; in production two databases), asks both to
prepare (phase 1), then commits both (phase 2). A prepared transaction survives the
session that made it (and a server restart): it keeps its row locks, owned by no
session, until someone runs ``COMMIT PREPARED`` or ``ROLLBACK PREPARED``. If the
coordinator dies between the phases, every participant is stuck "in doubt": it voted yes,
so it may not roll back alone, and it does not know whether the others voted yes too.

Needs ``max_prepared_transactions > 0`` (the course's servers start with 16); prepared
transactions are per server, so their names carry the namespace's prefix, and
:func:`clear` rolls back any this chapter left behind (a database with prepared
transactions cannot be dropped).
"""

from __future__ import annotations

import asyncio
import time

import psycopg


async def supported(conn) -> tuple[bool, str]:
    """``(answer, why)``: does this server accept PREPARE TRANSACTION?"""
    cur = await conn.execute("SHOW max_prepared_transactions")
    n = int((await cur.fetchone())[0])
    if n == 0:
        return False, (
            "max_prepared_transactions is 0 on this server, so PREPARE TRANSACTION is refused; start PostgreSQL "
            "with -c max_prepared_transactions=16 (the course's own servers do) to run this demo"
        )
    return True, f"max_prepared_transactions = {n}"


async def clear(dsn: str, prefix: str) -> list[str]:
    """Roll back this namespace's prepared transactions; their names."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND gid LIKE %s",
            (prefix + "%",),
        )
        gids = [row[0] for row in await cur.fetchall()]
        for gid in gids:
            await conn.execute(f"ROLLBACK PREPARED '{gid}'")
    return gids


async def _prepare(conn, gid: str, statement: str, params) -> None:
    """A participant does its part in a transaction and votes yes."""
    await conn.execute("BEGIN")
    cur = await conn.execute(statement, params)
    if cur.rowcount != 1:
        await conn.execute("ROLLBACK")
        raise RuntimeError(f"{gid}: the participant votes no")
    await conn.execute(f"PREPARE TRANSACTION '{gid}'")


async def _participants(dsn: str):
    return (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True),
        await psycopg.AsyncConnection.connect(dsn, autocommit=True),
    )


RESERVE = "UPDATE ch06_stock SET available = available - %s WHERE sku = %s AND available >= %s"
CHARGE = (
    "UPDATE ch06_wallets SET balance_cents = balance_cents - %s WHERE customer = %s AND balance_cents >= %s"
)


async def prepared_now(conn, prefix: str) -> list[tuple]:
    """``[(gid, seconds prepared, locks held)]`` of this namespace's prepared transactions."""
    cur = await conn.execute(
        """
        SELECT p.gid, extract(epoch FROM now() - p.prepared)::float,
               (SELECT count(*) FROM pg_locks l WHERE l.pid IS NULL AND l.virtualtransaction = x.virtualtransaction
                AND coalesce(l.relation::regclass::text, '') NOT LIKE 'ch06\\_crash%%')
        FROM pg_prepared_xacts p
        JOIN pg_locks x ON x.locktype = 'transactionid' AND x.transactionid = p.transaction AND x.pid IS NULL
        WHERE p.gid LIKE %s ORDER BY p.gid
        """,
        (prefix + "%",),
    )
    return await cur.fetchall()


async def two_phase_commit(dsn: str, order: dict, prefix: str) -> dict:
    """The happy path: both prepare, both commit. Phase timings and the prepared list in between."""
    gids = (f"{prefix}{order['order_id']}-inventory", f"{prefix}{order['order_id']}-payments")
    inv, pay = await _participants(dsn)
    t0 = time.perf_counter()
    await _prepare(inv, gids[0], RESERVE, (order["qty"], order["sku"], order["qty"]))
    await _prepare(pay, gids[1], CHARGE, (order["amount_cents"], order["customer"], order["amount_cents"]))
    t1 = time.perf_counter()
    between = await prepared_now(inv, prefix)
    for conn, gid in ((inv, gids[0]), (pay, gids[1])):
        await conn.execute(f"COMMIT PREPARED '{gid}'")
    t2 = time.perf_counter()
    await inv.close()
    await pay.close()
    return {"phase1_ms": (t1 - t0) * 1000, "phase2_ms": (t2 - t1) * 1000, "prepared": between}


async def coordinator_dies(
    dsn: str, order: dict, other: dict, prefix: str, *, operator_after: float = 1.0
) -> dict:
    """Both participants prepare, then the coordinator dies. Another customer's order waits on the
    stock row until an operator commits the prepared transactions ``operator_after`` seconds later.

    Returns what the server showed meanwhile: the prepared transactions and their locks, the
    blocked session (its wait event and the pids blocking it), a plain read of the same row,
    whether the other customer was still waiting when the operator acted, and how long it waited.
    """
    gids = (f"{prefix}{order['order_id']}-inventory", f"{prefix}{order['order_id']}-payments")
    inv, pay = await _participants(dsn)
    await _prepare(inv, gids[0], RESERVE, (order["qty"], order["sku"], order["qty"]))
    await _prepare(pay, gids[1], CHARGE, (order["amount_cents"], order["customer"], order["amount_cents"]))
    await inv.close()  # the coordinator process dies: its sessions go, the prepared transactions stay
    await pay.close()
    died = time.perf_counter()
    seen: dict = {}
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watch,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as customer,
    ):
        try:
            cur = await watch.execute(
                """
                SELECT p.gid, l.locktype, coalesce(l.relation::regclass::text, ''), l.mode, l.granted
                FROM pg_locks l
                JOIN pg_locks x ON x.virtualtransaction = l.virtualtransaction AND x.locktype = 'transactionid'
                                AND x.pid IS NULL
                JOIN pg_prepared_xacts p ON p.transaction = x.transactionid
                WHERE l.pid IS NULL AND p.gid LIKE %s
                  AND coalesce(l.relation::regclass::text, '') NOT LIKE 'ch06\\_crash%%'  -- the chapter's fault tool
                ORDER BY p.gid, l.locktype
                """,
                (prefix + "%",),
            )
            seen["locks"] = await cur.fetchall()
            cur = await watch.execute(
                "SELECT count(*) FROM pg_stat_activity a JOIN pg_prepared_xacts p ON a.backend_xid = p.transaction "
                "WHERE p.gid LIKE %s",
                (prefix + "%",),
            )
            seen["sessions"] = (await cur.fetchone())[0]  # sessions running the prepared transactions: none
            pid = customer.info.backend_pid
            start = time.perf_counter()
            blocked = asyncio.ensure_future(
                customer.execute(RESERVE, (other["qty"], other["sku"], other["qty"]))
            )
            await asyncio.sleep(min(0.3, operator_after / 2))
            cur = await watch.execute(
                "SELECT state, wait_event_type, wait_event, pg_blocking_pids(pid), "
                "extract(epoch FROM now() - query_start)::float FROM pg_stat_activity WHERE pid = %s",
                (pid,),
            )
            seen["blocked"] = await cur.fetchone()
            cur = await watch.execute("SELECT available FROM ch06_stock WHERE sku = %s", (order["sku"],))
            seen["read"] = (await cur.fetchone())[0]
            await asyncio.sleep(max(0.0, operator_after - (time.perf_counter() - died)))
            seen["prepared"] = await prepared_now(watch, prefix)
            seen["still_waiting"] = not blocked.done()  # when the operator acts: blocked all along?
            for gid in gids:  # the operator (or the recovered coordinator) finishes phase 2
                await watch.execute(f"COMMIT PREPARED '{gid}'")
            await blocked
            seen["waited_s"] = time.perf_counter() - start
            cur = await watch.execute("SELECT available FROM ch06_stock WHERE sku = %s", (order["sku"],))
            seen["after"] = (await cur.fetchone())[0]
        finally:
            await clear(dsn, prefix)
    return seen


async def local_step_lock_ms(pool, order: dict, n: int = 20) -> list[float]:
    """How long a saga's local step holds the stock row: the reserve_stock transaction, timed ``n`` times."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        async with pool.connection() as conn, conn.transaction():
            await conn.execute(RESERVE, (order["qty"], order["sku"], order["qty"]))
            await conn.execute(
                "INSERT INTO ch06_reservations VALUES (%s, %s, %s, 'reserved') ON CONFLICT DO NOTHING",
                (f"{order['order_id']}-{i}", order["sku"], order["qty"]),
            )
        out.append((time.perf_counter() - t0) * 1000)
    return out
