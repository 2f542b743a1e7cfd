"""Deterministic faults inside PostgreSQL for chapter 06: crashes at every write, transient failures.

**A crash before the k-th write.** A trigger on every table a piece of code writes counts
its row writes. Armed at ``k``, the k-th write and every one after it fail: the process
"died" just before that write, so nothing it does afterwards lands (its compensations
and log rows fail too). Enumerating ``k = 1 .. N`` visits every boundary between two
local transactions (a crash in the middle of a transaction rolls it back, the same as a
crash just before it). Sequences are not transactional, so the count survives the
rollbacks. A dry run with :meth:`CrashPlan.trace` names each write
(``insert saga_log (charge_payment, done)``) so a report can say where the crash was.

**Transient failures.** :meth:`CrashPlan.flaky` makes the next ``n`` refunds (a wallet
balance going up) or stock returns (available going up) fail with SQLSTATE 40001
(serialization failure), the error a retry is made for.

The code under test needs no hooks: it cannot tell an injected crash from a real one.
"""

from __future__ import annotations

from psycopg import sql

SCHEMA = """
CREATE TABLE IF NOT EXISTS ch06_crash_plan (
    id      int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    at      bigint,
    tracing boolean NOT NULL DEFAULT false
);
INSERT INTO ch06_crash_plan (id) VALUES (1) ON CONFLICT DO NOTHING;
CREATE UNLOGGED TABLE IF NOT EXISTS ch06_crash_trace (
    n    bigint PRIMARY KEY,
    what text NOT NULL
);
CREATE SEQUENCE IF NOT EXISTS ch06_crash_writes;
CREATE SEQUENCE IF NOT EXISTS ch06_crash_fired MINVALUE 0 START 0;
CREATE OR REPLACE FUNCTION ch06_crash_point() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    plan record;
    k    bigint;
    r    jsonb;
    what text;
BEGIN
    SELECT at, tracing INTO plan FROM ch06_crash_plan WHERE id = 1;
    IF plan.at IS NULL AND NOT plan.tracing THEN
        RETURN COALESCE(NEW, OLD);
    END IF;
    k := nextval('ch06_crash_writes');
    r := to_jsonb(COALESCE(NEW, OLD));
    what := lower(TG_OP) || ' ' || TG_TABLE_NAME || CASE
        WHEN TG_TABLE_NAME = 'saga_log' THEN format(' (%s, %s)', r->>'step', r->>'event')
        WHEN TG_TABLE_NAME = 'outbox' AND TG_OP = 'INSERT' THEN format(' (%s %s)', r->>'aggregate_id', r->>'event_type')
        WHEN TG_OP <> 'DELETE' AND r ? 'status' THEN format(' (%s)', r->>'status')
        ELSE '' END;
    IF plan.tracing THEN
        INSERT INTO ch06_crash_trace VALUES (k, what) ON CONFLICT DO NOTHING;
    END IF;
    IF plan.at IS NOT NULL AND k >= plan.at THEN
        IF (SELECT last_value FROM ch06_crash_fired) = 0 THEN
            PERFORM setval('ch06_crash_fired', k);
        END IF;
        RAISE EXCEPTION 'injected crash: the process died before this write (%)', what;
    END IF;
    RETURN COALESCE(NEW, OLD);
END $$;

CREATE TABLE IF NOT EXISTS ch06_flaky_plan (
    point    text PRIMARY KEY,
    failures int NOT NULL DEFAULT 0
);
INSERT INTO ch06_flaky_plan (point) VALUES ('refund'), ('release') ON CONFLICT DO NOTHING;
CREATE SEQUENCE IF NOT EXISTS ch06_flaky_refund;
CREATE SEQUENCE IF NOT EXISTS ch06_flaky_release;
CREATE OR REPLACE FUNCTION ch06_flaky() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF nextval('ch06_flaky_' || TG_ARGV[0]) <= (SELECT failures FROM ch06_flaky_plan WHERE point = TG_ARGV[0]) THEN
        RAISE EXCEPTION 'injected transient failure (%): could not serialize access', TG_ARGV[0]
            USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN NEW;
END $$;
"""

FLAKY_TRIGGERS = """
DROP TRIGGER IF EXISTS ch06_flaky_refund ON ch06_wallets;
CREATE TRIGGER ch06_flaky_refund BEFORE UPDATE ON ch06_wallets
    FOR EACH ROW WHEN (NEW.balance_cents > OLD.balance_cents) EXECUTE FUNCTION ch06_flaky('refund');
DROP TRIGGER IF EXISTS ch06_flaky_release ON ch06_stock;
CREATE TRIGGER ch06_flaky_release BEFORE UPDATE ON ch06_stock
    FOR EACH ROW WHEN (NEW.available > OLD.available) EXECUTE FUNCTION ch06_flaky('release');
"""


class CrashPlan:
    """The control side of the faults, on a connection of its own (autocommit).

    ``await CrashPlan.install(conn, tables)`` puts the crash trigger on ``tables`` (and the
    transient-failure triggers on the shop's stock and wallets when they are among them).
    """

    def __init__(self, conn) -> None:
        self.conn = conn

    @classmethod
    async def install(cls, conn, tables) -> CrashPlan:
        await conn.execute(SCHEMA)
        for table in tables:
            await conn.execute(sql.SQL("DROP TRIGGER IF EXISTS ch06_crash ON {}").format(sql.Identifier(table)))
            await conn.execute(
                sql.SQL(
                    "CREATE TRIGGER ch06_crash BEFORE INSERT OR UPDATE OR DELETE ON {} "
                    "FOR EACH ROW EXECUTE FUNCTION ch06_crash_point()"
                ).format(sql.Identifier(table))
            )
        if {"ch06_wallets", "ch06_stock"} <= set(tables):
            await conn.execute(FLAKY_TRIGGERS)
        plan = cls(conn)
        await plan.disarm()
        return plan

    async def _reset(self, at: int | None, tracing: bool) -> None:
        await self.conn.execute(
            "WITH plan AS (UPDATE ch06_crash_plan SET at = %s, tracing = %s WHERE id = 1 RETURNING id) "
            "SELECT setval('ch06_crash_writes', 1, false), setval('ch06_crash_fired', 0) FROM plan",
            (at, tracing),
        )

    async def arm(self, at: int) -> None:
        """From now on, the ``at``-th write (1 = the next) and every later one fail."""
        await self._reset(at, False)

    async def disarm(self) -> None:
        """Writes go through again (the process was restarted)."""
        await self._reset(None, False)

    async def fired(self) -> int:
        """The number of the write the crash fired at, or 0 if it has not fired."""
        cur = await self.conn.execute("SELECT last_value FROM ch06_crash_fired")
        return int((await cur.fetchone())[0])

    async def trace(self) -> None:
        """Start a dry run: count and name every write, fail none."""
        await self.conn.execute("TRUNCATE ch06_crash_trace")
        await self._reset(None, True)

    async def traced(self) -> list[str]:
        """End the dry run: the name of write 1, 2, ... N (a write whose transaction rolled back
        left no name and reads as such)."""
        cur = await self.conn.execute("SELECT last_value, is_called FROM ch06_crash_writes")
        last, called = await cur.fetchone()
        count = int(last) if called else 0
        cur = await self.conn.execute("SELECT n, what FROM ch06_crash_trace ORDER BY n")
        names = dict(await cur.fetchall())
        await self.disarm()
        return [names.get(n, "a write whose transaction rolled back") for n in range(1, count + 1)]

    async def flaky(self, point: str, failures: int) -> None:
        """The next ``failures`` refunds (``point="refund"``) or stock returns (``"release"``) fail with 40001."""
        await self.conn.execute("UPDATE ch06_flaky_plan SET failures = %s WHERE point = %s", (failures, point))
        await self.conn.execute(sql.SQL("SELECT setval({}, 1, false)").format(sql.Literal(f"ch06_flaky_{point}")))

    async def flaky_fired(self, point: str) -> int:
        """How many injected transient failures of ``point`` have fired since :meth:`flaky`."""
        cur = await self.conn.execute(
            sql.SQL("SELECT last_value, is_called FROM {}").format(sql.Identifier(f"ch06_flaky_{point}"))
        )
        last, called = await cur.fetchone()
        cur = await self.conn.execute("SELECT failures FROM ch06_flaky_plan WHERE point = %s", (point,))
        planned = (await cur.fetchone())[0]
        return min(int(last) if called else 0, planned)
