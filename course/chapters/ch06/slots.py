"""Chapter 06's CDC demos: a replication slot reading the outbox in commit order, and the WAL an idle slot keeps.

Slots belong to the whole server, so their names carry the namespace's name; every demo
drops its slot and publication when it ends (:func:`cleanup` drops leftovers of a run
that was interrupted). ``ch06_wal_filler`` is the demo table that generates WAL.
"""

from __future__ import annotations

import re
import time

import psycopg

from course import cdc, outbox

FILLER = """
CREATE TABLE IF NOT EXISTS ch06_wal_filler (
    id  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    pad text NOT NULL
)
"""


def names(namespace: str, what: str) -> tuple[str, str]:
    """``(slot, publication)`` for this namespace: slot names are server-wide, [a-z0-9_] only."""
    base = re.sub(r"[^a-z0-9_]", "_", namespace.lower())[:50]
    return f"{base}_{what}", f"ch06_{what}_pub"


async def cleanup(dsn: str, namespace: str) -> None:
    """Drop every slot of this namespace (an idle slot left behind keeps WAL until the disk is full)."""
    base = re.sub(r"[^a-z0-9_]", "_", namespace.lower())[:50]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name LIKE %s AND NOT active",
            (base + "\\_%",),
        )


async def commit_order(dsn: str, namespace: str, redis, stream: str) -> dict:
    """T1 inserts an event first but commits second; T2 inserts second, commits first.

    Shows three readers: a poller that remembers the highest id it has seen (it skips T1's
    event for ever), the outbox relay that looks for unpublished rows (it does not), and the
    slot, which delivers the two transactions in commit order. Then the CDC relay publishes.
    """
    slot, publication = names(namespace, "cdc")
    out: dict = {}
    async with (
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as t1,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as t2,
    ):
        await admin.execute("SET statement_timeout = '10s'")
        await cdc.drop_slot(admin, slot)
        out["start_lsn"] = await cdc.create_slot(admin, slot, publication, ["outbox"])
        try:
            cur = await admin.execute("SELECT coalesce(max(id), 0) FROM outbox")
            cursor = (await cur.fetchone())[0]
            await t1.execute("BEGIN")
            id1 = await outbox.enqueue(
                t1, "order", "cdc-A", "OrderPlaced", {"order_id": "cdc-A", "amount_cents": 100}
            )
            await t2.execute("BEGIN")
            id2 = await outbox.enqueue(
                t2, "order", "cdc-B", "OrderPlaced", {"order_id": "cdc-B", "amount_cents": 200}
            )
            await t2.execute("COMMIT")
            cur = await admin.execute("SELECT id FROM outbox WHERE id > %s ORDER BY id", (cursor,))
            first_poll = [r[0] for r in await cur.fetchall()]
            cursor = max(first_poll, default=cursor)
            await t1.execute("COMMIT")
            cur = await admin.execute("SELECT id FROM outbox WHERE id > %s ORDER BY id", (cursor,))
            second_poll = [r[0] for r in await cur.fetchall()]
            cur = await admin.execute(
                "SELECT id FROM outbox WHERE published_at IS NULL AND id = ANY(%s) ORDER BY id", ([id1, id2],)
            )
            out.update(
                ids={"T1": id1, "T2": id2},
                cursor_polls=(first_poll, second_poll),
                unpublished=[r[0] for r in await cur.fetchall()],
                slot=[
                    (
                        t.xid,
                        t.commit_lsn,
                        [(op, tbl, row["id"], row["aggregate_id"]) for op, tbl, row in t.changes],
                    )
                    for t in await cdc.read(admin, slot, publication, peek=True)
                ],
            )
            out["published"] = await cdc.relay_from_slot(admin, redis, stream, slot, publication)
            out["stream"] = [(f["event_id"], f["aggregate_id"]) for _, f in await redis.xrange(stream)]
            out["after"] = await cdc.read(admin, slot, publication, peek=True)
            await admin.execute("UPDATE outbox SET published_at = now() WHERE id = ANY(%s)", ([id1, id2],))
        finally:
            await cdc.drop_slot(admin, slot, publication)
    return out


async def _read_up_to_now(conn, slot: str) -> None:
    """Confirm everything written so far. A logical slot's restart point moves only at a
    running-transactions record (the server logs one every 15 s or so); log one now, twice,
    so the demo need not wait (``pg_log_standby_snapshot``, PostgreSQL 16+, superuser)."""
    for _ in range(2):
        try:
            await conn.execute("SELECT pg_log_standby_snapshot()")
        except psycopg.Error:
            pass
        cur = await conn.execute("SELECT pg_current_wal_lsn()::text")
        await cdc.advance(conn, slot, (await cur.fetchone())[0])


async def wal_retention(dsn: str, namespace: str, *, rounds: int = 6, rows: int = 2000) -> dict:
    """Two slots, one read after every round of writes and one never read, while a table grows.

    Returns per round the WAL written since the start and the WAL each slot holds back.
    """
    idle, publication = names(namespace, "idle")
    read, _ = names(namespace, "read")
    points = []
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("SET statement_timeout = '10s'")
        await conn.execute(FILLER)
        cur = await conn.execute("SHOW max_slot_wal_keep_size")
        keep = (await cur.fetchone())[0]
        for slot in (idle, read):
            await cdc.drop_slot(conn, slot)
            await cdc.create_slot(conn, slot, publication, ["outbox"])
        try:
            cur = await conn.execute("SELECT pg_current_wal_lsn()::text")
            start = (await cur.fetchone())[0]
            t0 = time.perf_counter()
            for _ in range(rounds):
                await conn.execute(
                    "INSERT INTO ch06_wal_filler (pad) SELECT repeat(md5(g::text), 6) FROM generate_series(1, %s) g",
                    (rows,),
                )
                cur = await conn.execute("SELECT pg_current_wal_lsn()::text")
                now = (await cur.fetchone())[0]
                await _read_up_to_now(conn, read)
                cur = await conn.execute(
                    "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::bigint", (now, start)
                )
                written = (await cur.fetchone())[0]
                held = {}
                for slot in (idle, read):
                    held[slot] = (await cdc.slot_status(conn, slot))["retained_bytes"]
                points.append((written, held[idle], held[read]))
            status = await cdc.slot_status(conn, idle)
            seconds = time.perf_counter() - t0
        finally:
            for slot in (idle, read):
                await cdc.drop_slot(conn, slot)
            await conn.execute(f"DROP PUBLICATION IF EXISTS {publication}")
            await conn.execute("TRUNCATE ch06_wal_filler")
    return {"points": points, "idle_status": status, "max_slot_wal_keep_size": keep, "seconds": seconds}
