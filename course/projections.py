"""Projections: read models built from the event store, idempotent and rebuildable (chapter 07).

CQRS splits the model that takes commands (the event streams of :mod:`course.eventstore`)
from the models that answer queries (tables shaped for one screen, here
``account_balances``). A **projector** turns events into read-model rows. Three rules make
it safe under at-least-once delivery, crashes and several replicas:

1. its **checkpoint** (the last ``position`` applied, in ``projection_checkpoints``) is
   written in the **same transaction** as the read-model rows: a crash between the two
   rolls both back, so a redelivery applies the events exactly once;
2. it **locks** the checkpoint row (``SELECT ... FOR UPDATE``) before it decides which
   events are new, so two replicas handed the same batch cannot both apply it;
3. it can **rebuild** from zero: empty the read model, reset the checkpoint, replay every
   event. A rebuild must give the same rows as the incremental run (no ``now()``, no
   state kept anywhere else).

A read model lags its events. :func:`wait_for` is read-your-writes with the version a
command returned: wait until the row has caught up, or give up and read the write model.

``setup_schema`` is async: ``await setup_schema(pool)``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

from course import eventstore
from course.backoff import LoopErrors
from course.eventstore import Event
from course.kit.lab import connection

SCHEMA = """
CREATE TABLE IF NOT EXISTS projection_checkpoints (
    name       text        PRIMARY KEY,
    position   bigint      NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS account_balances (
    account_id    text    PRIMARY KEY,
    owner         text    NOT NULL,
    balance_cents bigint  NOT NULL,
    version       integer NOT NULL
);
INSERT INTO projection_checkpoints (name, position) VALUES ('account_balances', 0) ON CONFLICT (name) DO NOTHING;
"""

BALANCES = "account_balances"


async def setup_schema(pool_or_conn) -> None:
    """Create the event store, ``projection_checkpoints`` and ``account_balances`` (idempotent)."""
    await eventstore.setup_schema(pool_or_conn)
    async with connection(pool_or_conn) as conn:
        await conn.execute(SCHEMA)


def as_event(item) -> Event:
    """An :class:`Event` from an Event or the dict form checks and learners pass around."""
    if isinstance(item, Event):
        return item
    return Event(item["type"], item.get("data", {}), item["stream_id"], item["version"], item["position"])


# ----------------------------------------------------------------------------- the projector

ApplyOne = Callable[[object, Event], Awaitable[None]]


class Projector:
    """Applies events to a read model with its checkpoint in the same transaction.

    ``apply_one(conn, event)`` changes the read model for one event, on ``conn`` inside
    the projector's transaction. ``tables`` are emptied by :meth:`rebuild`.
    """

    def __init__(self, name: str, apply_one: ApplyOne, tables: Iterable[str]) -> None:
        self.name = name
        self.apply_one = apply_one
        self.tables = tuple(tables)

    async def apply_batch(self, pool, events: Iterable) -> int:
        """Apply the events of ``events`` that are past the checkpoint; how many were applied."""
        events = sorted((as_event(e) for e in events), key=lambda e: e.position)
        async with pool.connection() as conn, conn.transaction():
            checkpoint = await self._lock_checkpoint(conn)
            applied = 0
            for event in events:
                if event.position <= checkpoint:
                    continue  # delivered before: already in the read model
                await self.apply_one(conn, event)
                checkpoint = event.position
                applied += 1
            if applied:
                await conn.execute(
                    "UPDATE projection_checkpoints SET position = %s, updated_at = now() WHERE name = %s",
                    (checkpoint, self.name),
                )
        return applied

    async def _lock_checkpoint(self, conn) -> int:
        """The checkpoint, row-locked until the transaction ends: a second replica waits here,
        then sees the checkpoint this one committed."""
        select = "SELECT position FROM projection_checkpoints WHERE name = %s FOR UPDATE"
        row = await (await conn.execute(select, (self.name,))).fetchone()
        if row is None:
            await conn.execute(
                "INSERT INTO projection_checkpoints (name) VALUES (%s) ON CONFLICT (name) DO NOTHING",
                (self.name,),
            )
            row = await (await conn.execute(select, (self.name,))).fetchone()
        return row[0]

    async def checkpoint(self, pool) -> int:
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT position FROM projection_checkpoints WHERE name = %s", (self.name,)
            )
            row = await cur.fetchone()
        return row[0] if row else 0

    async def catch_up(self, pool, batch: int = 200) -> int:
        """Read the event store from the checkpoint and apply until there is nothing new."""
        total = 0
        while True:
            events = await eventstore.read_all(pool, await self.checkpoint(pool), limit=batch)
            if not events:
                return total
            total += await self.apply_batch(pool, events)

    async def lag(self, pool) -> int:
        """Events in the store that the read model has not seen yet."""
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM es_events WHERE position > "
                "coalesce((SELECT position FROM projection_checkpoints WHERE name = %s), 0)",
                (self.name,),
            )
            return (await cur.fetchone())[0]

    async def rebuild(self, pool, batch: int = 200) -> int:
        """Empty the read model, reset the checkpoint (one transaction), replay everything."""
        async with pool.connection() as conn, conn.transaction():
            for table in self.tables:
                await conn.execute(f"DELETE FROM {table}")  # noqa: S608 - our own table names
            await conn.execute(
                "INSERT INTO projection_checkpoints (name, position) VALUES (%s, 0) "
                "ON CONFLICT (name) DO UPDATE SET position = 0, updated_at = now()",
                (self.name,),
            )
        return await self.catch_up(pool, batch)

    async def run(
        self,
        pool,
        stop: asyncio.Event,
        interval: float = 0.05,
        sleep=asyncio.sleep,
        errors: LoopErrors | None = None,
    ) -> None:
        """Poll and apply until ``stop`` is set (a projector process in a few lines).

        An error does not end it: the batch rolled back with its checkpoint, so the next
        round retries it after a jittered backoff; ``errors`` counts them (its ``streak``
        growing means one event keeps failing: alert on it).
        """
        errors = errors if errors is not None else LoopErrors()
        while not stop.is_set():
            try:
                await self.catch_up(pool)
            except Exception as err:  # noqa: BLE001 - a projector that dies on its first error goes stale silently
                await sleep(errors.failed(err))
                continue
            errors.succeeded()
            await sleep(interval)


# ----------------------------------------------------------------------------- the balances read model


async def apply_balance_event(conn, event: Event) -> None:
    """``account_balances``: one row per account with its balance and the version it reflects."""
    if event.type == "AccountOpened":
        await conn.execute(
            "INSERT INTO account_balances (account_id, owner, balance_cents, version) VALUES (%s, %s, 0, %s)",
            (event.stream_id, event.data["owner"], event.version),
        )
        return
    sign = {"Deposited": 1, "Withdrawn": -1}.get(event.type)
    delta = sign * event.data["amount_cents"] if sign else 0
    await conn.execute(
        "UPDATE account_balances SET balance_cents = balance_cents + %s, version = %s WHERE account_id = %s",
        (delta, event.version, event.stream_id),
    )


balances = Projector(BALANCES, apply_balance_event, tables=[BALANCES])


async def apply_events(pool, events: list) -> int:
    """The reference answer of chapter 07's ``account_projection`` task (``apply_events``)."""
    return await balances.apply_batch(pool, events)


async def rebuild_balances(pool) -> int:
    """The reference ``rebuild_balances``: empty, reset, replay every event."""
    return await balances.rebuild(pool)


async def read_balances(pool) -> dict[str, tuple]:
    """``{account_id: (owner, balance_cents, version)}``, the read model as a dict."""
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT account_id, owner, balance_cents, version FROM account_balances")
        return {row[0]: tuple(row[1:]) for row in await cur.fetchall()}


# ----------------------------------------------------------------------------- read your writes


async def wait_for(
    pool,
    account_id: str,
    version: int,
    *,
    timeout: float = 1.0,
    poll: float = 0.01,
    sleep=asyncio.sleep,
    clock=time.monotonic,
) -> tuple | None:
    """The balance row once it reflects ``version`` (a command's answer), or None after ``timeout``.

    None means the projection is behind: answer from the write model
    (``eventstore.load``) or tell the user the change is on its way; never the stale row.
    """
    deadline = clock() + timeout
    while True:
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT owner, balance_cents, version FROM account_balances WHERE account_id = %s",
                (account_id,),
            )
            row = await cur.fetchone()
        if row is not None and row[2] >= version:
            return tuple(row)
        if clock() >= deadline:
            return None
        await sleep(poll)
