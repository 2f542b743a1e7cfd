"""The transactional outbox and its polling relay into a Redis stream (chapter 06).

Writing a row and publishing its event are two systems; no transaction spans both, so
any order of the two loses an event (commit, then the publish fails) or invents one
(publish, then the commit fails). The outbox makes them one write: the event is a row
in ``outbox``, inserted **in the same transaction** as the change it describes
(:func:`enqueue`). A relay then copies committed rows to the broker:

1. claim a batch of unpublished rows, oldest first (``FOR UPDATE``, so two relays never
   hold the same row);
2. publish each one (``XADD``), in id order;
3. mark them published (``published_at = now()``) and commit.

A crash between 2 and 3 publishes the batch again on the next run: delivery is **at
least once**, and every entry carries its ``event_id`` (the outbox id) so consumers drop
duplicates (chapter 03's idempotent consumer). Marking before publishing would turn that
crash into a lost event instead.

**Ordering.** ``FOR UPDATE SKIP LOCKED`` lets several relays work at once, but then a
second relay can publish an aggregate's later event while the first still holds its
earlier one (chapter 06 shows it). :func:`relay_batch` keeps per-aggregate order by
partitioning: an aggregate's events always fall in partition
``hashtext(aggregate_id) mod partitions``, a partition is served only by the relay that
holds its transaction-level advisory lock, and inside a partition rows go in id order.
Relays share the partitions between them by who gets each lock first.

Within one aggregate, id order is commit order only if writers of the aggregate are
serialized (they update the aggregate's row before inserting its event, as
``place_order`` and friends do). CDC (:mod:`course.cdc`) reads in commit order instead.
The table's columns follow Debezium's outbox event router (aggregate type, aggregate id,
type, payload).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable

from psycopg.types.json import Jsonb

from course.backoff import LoopErrors

SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    event_type     text NOT NULL,
    payload        jsonb NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at   timestamptz
);
CREATE INDEX IF NOT EXISTS outbox_unpublished ON outbox (id) WHERE published_at IS NULL;
"""

PARTITIONS = 8
#: The first key of the relays' advisory locks (the second is the partition number).
LOCK_CLASS = 60601


async def setup_schema(pool) -> None:
    """Create the ``outbox`` table (idempotent)."""
    async with pool.connection() as conn:
        await conn.execute(SCHEMA)


async def enqueue(conn, aggregate_type: str, aggregate_id: str, event_type: str, payload: dict) -> int:
    """Insert an event row on ``conn``, inside the caller's transaction; its id (the event id)."""
    cur = await conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES (%s, %s, %s, %s) RETURNING id",
        (aggregate_type, aggregate_id, event_type, Jsonb(payload)),
    )
    return (await cur.fetchone())[0]


COLUMNS = "id, aggregate_type, aggregate_id, event_type, payload"


def fields(row) -> dict[str, str]:
    """A claimed outbox row ``(id, aggregate_type, aggregate_id, event_type, payload)`` as stream fields."""
    event_id, aggregate_type, aggregate_id, event_type, payload = row
    return {
        "event_id": str(event_id),
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "event_type": event_type,
        "payload": json.dumps(payload, sort_keys=True),
    }


async def publish(redis, stream: str, rows) -> None:
    """XADD each row, in order, in one round trip (a pipeline without MULTI: order is kept)."""
    if not rows:
        return
    pipe = redis.pipeline(transaction=False)
    for row in rows:
        pipe.xadd(stream, fields(row))
    await pipe.execute()


async def relay_batch(
    pool,
    redis,
    stream: str,
    *,
    limit: int = 100,
    partitions: int = PARTITIONS,
    rand: Callable[[], float] = random.random,
) -> int:
    """Publish up to ``limit`` unpublished events; per-aggregate order holds across relays.

    Visits the partitions from a random one; a partition whose advisory lock another relay
    holds is skipped. Returns how many events it published.
    """
    published = 0
    start = int(rand() * partitions)
    for i in range(partitions):
        if published >= limit:
            break
        part = (start + i) % partitions
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", (LOCK_CLASS, part))
            if not (await cur.fetchone())[0]:
                continue  # another relay serves this partition right now
            cur = await conn.execute(
                f"SELECT {COLUMNS} FROM outbox WHERE published_at IS NULL "
                "AND (hashtext(aggregate_id) & 2147483647) %% %s = %s ORDER BY id LIMIT %s FOR UPDATE",
                (partitions, part, limit - published),
            )
            rows = await cur.fetchall()
            await publish(redis, stream, rows)  # a failure here rolls the claim back: nothing is marked
            if rows:
                await conn.execute(
                    "UPDATE outbox SET published_at = clock_timestamp() WHERE id = ANY(%s)",
                    ([r[0] for r in rows],),
                )
        published += len(rows)
    return published


async def relay_forever(
    pool,
    redis,
    stream: str,
    *,
    interval: float = 0.1,
    stop: asyncio.Event,
    limit: int = 100,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    relay: Callable[..., Awaitable[int]] = relay_batch,
    errors: LoopErrors | None = None,
) -> int:
    """Poll every ``interval`` seconds until ``stop`` is set; drain without sleeping while a
    batch comes back full. Returns the number of events published.

    An error (Redis or PostgreSQL away) does not end the loop: it is counted in ``errors``
    (a :class:`~course.backoff.LoopErrors`, pass one to read it) and the next round comes
    after a jittered backoff; the unpublished rows simply wait.
    """
    errors = errors if errors is not None else LoopErrors()
    total = 0
    while not stop.is_set():
        try:
            n = await relay(pool, redis, stream, limit=limit)
        except Exception as err:  # noqa: BLE001 - a relay that dies on its first error relays nothing
            await sleep(errors.failed(err))
            continue
        errors.succeeded()
        total += n
        if n < limit:
            await sleep(interval)
    return total


async def backlog(pool) -> tuple[int, float | None]:
    """``(unpublished events, age in seconds of the oldest)``: what to alert on."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT count(*), extract(epoch FROM clock_timestamp() - min(created_at)) "
            "FROM outbox WHERE published_at IS NULL"
        )
        n, age = await cur.fetchone()
    return n, (float(age) if age is not None else None)


async def purge_published(pool, *, older_than: float = 3600.0, batch: int = 1000) -> int:
    """Delete published rows older than ``older_than`` seconds, ``batch`` at a time; rows deleted."""
    total = 0
    while True:
        async with pool.connection() as conn:
            cur = await conn.execute(
                "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox WHERE published_at < "
                "clock_timestamp() - make_interval(secs => %s) ORDER BY id LIMIT %s)",
                (older_than, batch),
            )
        total += cur.rowcount
        if cur.rowcount < batch:
            return total
