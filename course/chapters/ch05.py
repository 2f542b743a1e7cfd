"""Chapter 05's demos: messages under failure, measured live on Redis Streams and PostgreSQL.

Only chapter 05's notebook, checks and tests import this module. The patterns themselves
live in :mod:`course.messaging`.
"""

from __future__ import annotations

APPLIED_SCHEMA = """
-- what the demo handlers (and the checks' handlers) applied, one row per applied message
CREATE TABLE IF NOT EXISTS ch05_applied (
    n          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream     text NOT NULL,
    message_id text NOT NULL,
    key        text NOT NULL,
    seq        int NOT NULL,
    consumer   text,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS ch05_applied_stream ON ch05_applied (stream, key, n);
"""


async def setup_schema(pool) -> None:
    """The consumer's tables (:func:`course.messaging.setup_schema`) and the chapter's demo tables."""
    from course import messaging

    await messaging.setup_schema(pool)
    async with pool.connection() as conn:
        await conn.execute(APPLIED_SCHEMA)
