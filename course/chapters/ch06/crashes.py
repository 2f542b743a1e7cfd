"""Deterministic faults inside PostgreSQL for chapter 06: crashes at every write, transient failures.

**A crash before the k-th write.** A trigger on every table a piece of code writes counts
its row writes (all of them, or one order's: :class:`CrashPlan`). Armed at ``k``, the k-th write and every one after it fail: the process
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
    alias   text PRIMARY KEY,
    run     text NOT NULL,
    counter text NOT NULL,
    at      bigint,
    tracing boolean NOT NULL DEFAULT false
);
CREATE UNLOGGED TABLE IF NOT EXISTS ch06_crash_trace (
    run  text NOT NULL,
    n    bigint NOT NULL,
    what text NOT NULL,
    PRIMARY KEY (run, n)
);
CREATE OR REPLACE FUNCTION ch06_crash_point() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    plan record;
    k    bigint;
    r    jsonb;
    what text;
BEGIN
    r := to_jsonb(COALESCE(NEW, OLD));
    SELECT p.run, p.counter, p.at, p.tracing INTO plan FROM ch06_crash_plan p
    WHERE p.alias IN (r->>'saga_id', r->>'order_id', r->>'aggregate_id', r->>'sku', r->>'customer', '*')
    ORDER BY p.alias = '*' LIMIT 1;
    IF NOT FOUND THEN
        RETURN COALESCE(NEW, OLD);
    END IF;
    k := nextval(plan.counter);
    what := lower(TG_OP) || ' ' || TG_TABLE_NAME || CASE
        WHEN TG_TABLE_NAME = 'saga_log' THEN format(' (%s, %s)', r->>'step', r->>'event')
        WHEN TG_TABLE_NAME = 'outbox' AND TG_OP = 'INSERT' THEN format(' (%s %s)', r->>'aggregate_id', r->>'event_type')
        WHEN TG_OP <> 'DELETE' AND r ? 'status' THEN format(' (%s)', r->>'status')
        ELSE '' END;
    IF plan.tracing THEN
        INSERT INTO ch06_crash_trace VALUES (plan.run, k, what) ON CONFLICT DO NOTHING;
    END IF;
    IF plan.at IS NOT NULL AND k >= plan.at THEN
        RAISE EXCEPTION 'injected crash: the process died before this write (%)', what;
    END IF;
    RETURN COALESCE(NEW, OLD);
END $$;
CREATE OR REPLACE FUNCTION ch06_crash_arm(p_run text, p_aliases text[], p_at bigint, p_tracing boolean)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    seq text := 'ch06_crash_n_' || left(md5(p_run), 16);
BEGIN
    EXECUTE format('CREATE SEQUENCE IF NOT EXISTS %I', seq);
    PERFORM setval(seq, 1, false);
    DELETE FROM ch06_crash_trace WHERE run = p_run;
    DELETE FROM ch06_crash_plan WHERE run = p_run;
    INSERT INTO ch06_crash_plan (alias, run, counter, at, tracing)
    SELECT a, p_run, seq, p_at, p_tracing FROM unnest(p_aliases) a
    ON CONFLICT (alias) DO UPDATE SET run = EXCLUDED.run, counter = EXCLUDED.counter, at = EXCLUDED.at,
        tracing = EXCLUDED.tracing;
END $$;
CREATE OR REPLACE FUNCTION ch06_crash_count(p_run text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    seq text := 'ch06_crash_n_' || left(md5(p_run), 16);
    n   bigint;
BEGIN
    EXECUTE format('SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM %I', seq) INTO n;
    RETURN n;
EXCEPTION WHEN undefined_table THEN
    RETURN 0;
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

    A *run* is whose writes are counted: every write (``arm(k)``, the whole process), or
    one order's (``arm_orders``): a write belongs to an order when its row's ``saga_id``,
    ``order_id``, ``aggregate_id``, ``sku`` or ``customer`` is one of the order's, so many
    orders can crash at different points at the same time.
    """

    def __init__(self, conn) -> None:
        self.conn = conn

    @classmethod
    async def install(cls, conn, tables) -> CrashPlan:
        await conn.execute(SCHEMA)
        for table in tables:
            await conn.execute(
                sql.SQL("DROP TRIGGER IF EXISTS ch06_crash ON {}").format(sql.Identifier(table))
            )
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

    @staticmethod
    def _run(order: dict | None) -> tuple[str, list[str]]:
        if order is None:
            return "*", ["*"]
        aliases = [order[k] for k in ("order_id", "sku", "customer") if order.get(k)]
        return order["order_id"], list(dict.fromkeys(aliases))

    async def _arm(self, runs: list[tuple[dict | None, int | None, bool]]) -> None:
        rows = [(*self._run(order), at, tracing) for order, at, tracing in runs]
        await self.conn.execute(
            "SELECT ch06_crash_arm(r, string_to_array(a, chr(31)), at, t) "
            "FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::boolean[]) AS x(r, a, at, t)",
            (
                [r[0] for r in rows],
                [chr(31).join(r[1]) for r in rows],
                [r[2] for r in rows],
                [r[3] for r in rows],
            ),
        )

    async def arm(self, at: int) -> None:
        """From now on, the ``at``-th write (1 = the next) and every later one fail, whoever writes."""
        await self.disarm()
        await self._arm([(None, at, False)])

    async def arm_orders(self, plans: list[tuple[dict, int]]) -> None:
        """``[(order, k)]``: each order's k-th write and every later one of that order fail."""
        await self._arm([(order, at, False) for order, at in plans])

    async def disarm(self) -> None:
        """Writes go through again (the processes were restarted)."""
        await self.conn.execute("DELETE FROM ch06_crash_plan")

    async def fired(self, order: dict | None = None) -> bool:
        """Has the armed crash (of ``order``, or the global one) fired?"""
        run = self._run(order)[0]
        cur = await self.conn.execute(
            "SELECT at IS NOT NULL AND ch06_crash_count(%s) >= at FROM ch06_crash_plan WHERE run = %s LIMIT 1",
            (run, run),
        )
        row = await cur.fetchone()
        return bool(row and row[0])

    async def trace(self, order: dict | None = None) -> None:
        """Start a dry run: count and name every write (of ``order``, or all), fail none."""
        if order is None:
            await self.disarm()
        await self._arm([(order, None, True)])

    async def traced(self, order: dict | None = None) -> list[str]:
        """End the dry run: the names of write 1, 2, ... N (a write whose transaction rolled back
        left no name and reads as such)."""
        run = self._run(order)[0]
        cur = await self.conn.execute("SELECT ch06_crash_count(%s)", (run,))
        count = int((await cur.fetchone())[0])
        cur = await self.conn.execute(
            "SELECT n, what FROM ch06_crash_trace WHERE run = %s ORDER BY n", (run,)
        )
        names = dict(await cur.fetchall())
        await self.conn.execute("DELETE FROM ch06_crash_plan WHERE run = %s", (run,))
        return [names.get(n, "a write whose transaction rolled back") for n in range(1, count + 1)]

    async def flaky(self, point: str, failures: int) -> None:
        """The next ``failures`` refunds (``point="refund"``) or stock returns (``"release"``) fail with 40001."""
        await self.conn.execute(
            "UPDATE ch06_flaky_plan SET failures = %s WHERE point = %s", (failures, point)
        )
        await self.conn.execute(
            sql.SQL("SELECT setval({}, 1, false)").format(sql.Literal(f"ch06_flaky_{point}"))
        )

    async def flaky_fired(self, point: str) -> int:
        """How many injected transient failures of ``point`` have fired since :meth:`flaky`."""
        cur = await self.conn.execute(
            sql.SQL("SELECT last_value, is_called FROM {}").format(sql.Identifier(f"ch06_flaky_{point}"))
        )
        last, called = await cur.fetchone()
        cur = await self.conn.execute("SELECT failures FROM ch06_flaky_plan WHERE point = %s", (point,))
        planned = (await cur.fetchone())[0]
        return min(int(last) if called else 0, planned)
