"""Chapter 11's rig: what the checks (and the notebook's failure demos) do to the tables.

- Every row written to ``view_counts`` draws a number from ``ch11_view_writes`` (a sequence:
  it counts rows even in a transaction that rolls back), so a check counts database writes.
- :func:`fail_view_write` arms a one-shot failure: the N-th row written from now raises, once,
  inside the writer's statement, as a database that refuses a flush would.
- A message whose body starts with ``hold:`` waits in its INSERT until the check releases
  :data:`HOLD_LOCK`; one starting with ``reject:`` is refused by the database.
"""

from __future__ import annotations

HOLD_LOCK = 11_011  # the advisory lock a held chat insert waits on

SCHEMA = """
CREATE SEQUENCE IF NOT EXISTS ch11_view_writes;
CREATE TABLE IF NOT EXISTS ch11_faults (
    name    text PRIMARY KEY,
    fail_at bigint NOT NULL
);
CREATE OR REPLACE FUNCTION ch11_view_write() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    n bigint := nextval('ch11_view_writes');
BEGIN
    IF EXISTS (SELECT 1 FROM ch11_faults WHERE name = 'view_counts' AND fail_at = n) THEN
        RAISE EXCEPTION 'the database refused this write (row write % to view_counts, injected)', n;
    END IF;
    RETURN NEW;
END $$;
CREATE OR REPLACE TRIGGER ch11_view_write AFTER INSERT OR UPDATE ON view_counts
    FOR EACH ROW EXECUTE FUNCTION ch11_view_write();
CREATE OR REPLACE FUNCTION ch11_chat_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.body LIKE 'reject:%%' THEN
        RAISE EXCEPTION 'the database refused this message (injected)';
    END IF;
    IF NEW.body LIKE 'hold:%%' THEN
        PERFORM pg_advisory_xact_lock_shared(%(hold)s);
    END IF;
    RETURN NEW;
END $$;
CREATE OR REPLACE TRIGGER ch11_chat_insert BEFORE INSERT ON chat_messages
    FOR EACH ROW EXECUTE FUNCTION ch11_chat_insert();
"""


async def install(pool) -> None:
    """The tables of both patterns, then the rig's sequence, fault table and triggers."""
    from course import chat, counters

    await counters.setup_schema(pool)
    await chat.setup_schema(pool)
    async with pool.connection() as conn:
        await conn.execute(SCHEMA.replace("%%", "%").replace("%(hold)s", str(HOLD_LOCK)))


async def view_writes(pool) -> int:
    """Rows written to ``view_counts`` so far (failed statements' rows included)."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT last_value + (CASE WHEN is_called THEN 0 ELSE -1 END) FROM ch11_view_writes"
        )
        return int((await cur.fetchone())[0])


async def fail_view_write(pool, nth: int) -> int:
    """Arm a failure of the ``nth`` row written to ``view_counts`` from now; returns its number."""
    at = await view_writes(pool) + nth
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO ch11_faults (name, fail_at) VALUES ('view_counts', %s) "
            "ON CONFLICT (name) DO UPDATE SET fail_at = EXCLUDED.fail_at",
            (at,),
        )
    return at


async def disarm(pool) -> None:
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM ch11_faults")
