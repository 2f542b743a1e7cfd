"""Chapter 11's flush demos: two flushes that deadlock on arrival order, and a lost commit reply.

- :func:`crossed_flushes`: two replicas flush the same two items, one as {a, b} and one as
  {b, a}. A trigger holds each statement on its first row until both hold one (so the race is
  forced, not hoped for), then lets them go: in arrival order each wants the other's row, and
  PostgreSQL aborts one with 40P01; in item order (:data:`course.counters.ADD_DELTAS`) the second
  waits for the first.
- :class:`LosesOneReply` and :func:`lost_reply`: the commit of a flush succeeds and the
  connection drops before the reply, so the counter sees an error for a batch the database has.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import psycopg

from course import counters
from course.kit.lab import LOCK_WAITERS

HOLD = 11_031  # the advisory lock the demo holds while both flushes reach their first row

#: Holds a statement on its first demo row (items 'dl-...') while the demo holds :data:`HOLD`.
HOLD_RIG = f"""
CREATE OR REPLACE FUNCTION ch11_flush_hold() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.item_id LIKE 'dl-%' THEN
        PERFORM pg_advisory_xact_lock_shared({HOLD});
    END IF;
    RETURN NEW;
END $$;
CREATE OR REPLACE TRIGGER ch11_flush_hold BEFORE UPDATE ON view_counts
    FOR EACH ROW EXECUTE FUNCTION ch11_flush_hold();
"""

#: The flush statement as it was first written: rows in the order the views arrived.
ARRIVAL_ORDER = """
INSERT INTO view_counts AS c (item_id, views)
SELECT * FROM unnest(%s::text[], %s::bigint[])
ON CONFLICT (item_id) DO UPDATE SET views = c.views + EXCLUDED.views
"""


async def crossed_flushes(ns, *, sorted_: bool) -> list[str]:
    """Flush {dl-a: 1, dl-b: 1} and {dl-b: 1, dl-a: 1} at once from two sessions; what each did."""
    statement = counters.ADD_DELTAS if sorted_ else ARRIVAL_ORDER
    opts = {"autocommit": True, "options": "-c deadlock_timeout=100ms"}
    holder = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    one = await psycopg.AsyncConnection.connect(ns.database_url, **opts)
    two = await psycopg.AsyncConnection.connect(ns.database_url, **opts)
    try:
        await holder.execute(HOLD_RIG)
        await holder.execute(
            "INSERT INTO view_counts (item_id, views) VALUES ('dl-a', 0), ('dl-b', 0) "
            "ON CONFLICT (item_id) DO UPDATE SET views = 0"
        )
        await holder.execute("SELECT pg_advisory_lock(%s)", (HOLD,))

        async def flush(conn, items: list[str]) -> str:
            try:
                await conn.execute(statement, (items, [1] * len(items)))
                return "committed"
            except psycopg.errors.DeadlockDetected as err:
                return f"40P01 {str(err).splitlines()[0]}"

        first = asyncio.ensure_future(flush(one, ["dl-a", "dl-b"]))
        second = asyncio.ensure_future(flush(two, ["dl-b", "dl-a"]))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # both wait: on the held lock, or on the other's row
            if (await (await holder.execute(LOCK_WAITERS)).fetchone())[0] >= 2:
                break
            await asyncio.sleep(0.01)
        await holder.execute("SELECT pg_advisory_unlock(%s)", (HOLD,))
        done = await asyncio.gather(first, second)
        return [f"replica 1, items (dl-a, dl-b): {done[0]}", f"replica 2, items (dl-b, dl-a): {done[1]}"]
    finally:
        with contextlib.suppress(Exception):
            await holder.execute("DROP TRIGGER IF EXISTS ch11_flush_hold ON view_counts")
        for conn in (holder, one, two):
            await conn.close()


class LosesOneReply:
    """A pool whose connections work, except that once :attr:`armed`, the next one that finished
    its work (its statement or transaction committed) raises as if the reply never arrived."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.armed = False

    @contextlib.asynccontextmanager
    async def connection(self):
        async with self.pool.connection() as conn:
            yield conn
        if self.armed:
            self.armed = False
            raise psycopg.OperationalError("server closed the connection unexpectedly (after COMMIT)")


async def lost_reply(pool, make_counter, item: str, views: int = 100) -> dict:
    """``views`` views, a flush whose reply is lost, then the ticker's retry; what the table holds."""
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM view_counts WHERE item_id = %s", (item,))
    flaky = LosesOneReply(pool)
    counter = make_counter(flaky)
    for _ in range(views):
        counter.buffer[item] += 1
    counter.pending = views
    flaky.armed = True
    try:
        await counter.flush()
        first = "returned"
    except psycopg.OperationalError as err:
        first = f"raised {type(err).__name__}"
    await counter.flush()  # the ticker's next tick
    stored = (await counters.read_counts(pool, [item])).get(item, 0)
    return {"views": views, "first": first, "stored": stored, "left": sum(Counter(counter.buffer).values())}
