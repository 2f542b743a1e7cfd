"""The fault rig of chapter 07: a gate and one-shot crashes inside PostgreSQL, and ``race``.

Races in this chapter are real (several connections at once) and still give the same
result every run, because the database holds the writers:

- a **gate** on a table: while it is closed, every INSERT, UPDATE or DELETE of that table
  waits in a BEFORE trigger on an advisory lock that the gate's own connection holds.
  :func:`race` starts the writers, waits until each one is either finished or waiting on a
  lock inside PostgreSQL (``pg_stat_activity``), then opens the gate. So every writer has
  read (the version, the checkpoint, the indexed version) before any of them writes.
  With ``order=[3, 2]`` the gate is keyed by the row's ``version`` column and opens for
  version 3 first, then (once that writer is done or held again) for version 2; with
  ``stagger=True`` the writers start one at a time, each once the previous one is held,
  so which one takes the row lock first is fixed too;
- a **crash** at a table: the N-th write to it after arming raises, exactly once (a
  sequence counts, and sequences ignore rollbacks), as if the process died there.

The rig owns ``ch07_gates``, ``ch07_crashes``, the ``ch07_crash_*`` sequences and the
trigger function ``ch07_rig()``; it sits on tables owned by :mod:`course.eventstore`,
:mod:`course.projections` and :mod:`course.search`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import psycopg

from course import projections, search
from course.kit.lab import LOCK_WAITERS

RIGGED = ("es_events", "account_balances", "projection_checkpoints", "search_documents")
GATE_LOCK = 707_002
SETTLE_LIMIT = 2.0  # real seconds to wait for writers to be held before opening the gate anyway

RIG = """
CREATE TABLE IF NOT EXISTS ch07_gates (table_name text PRIMARY KEY, by_version boolean NOT NULL DEFAULT false);
CREATE TABLE IF NOT EXISTS ch07_crashes (table_name text PRIMARY KEY, nth bigint NOT NULL DEFAULT 0);
CREATE OR REPLACE FUNCTION ch07_rig() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    keyed  boolean;
    target bigint;
    image  jsonb := to_jsonb(CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END);
BEGIN
    SELECT by_version INTO keyed FROM ch07_gates WHERE table_name = TG_TABLE_NAME;
    IF FOUND THEN
        PERFORM pg_advisory_xact_lock_shared(%(gate)s, CASE WHEN keyed THEN (image->>'version')::int ELSE 0 END);
    END IF;
    SELECT nth INTO target FROM ch07_crashes WHERE table_name = TG_TABLE_NAME;
    IF target > 0 AND nextval('ch07_crash_' || TG_TABLE_NAME) = target THEN
        RAISE EXCEPTION 'injected crash at % on %: the process died here', TG_OP, TG_TABLE_NAME;
    END IF;
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;
"""


async def install(pool) -> None:
    """Create the chapter's tables and put the rig on them (idempotent)."""
    await projections.setup_schema(pool)
    await search.setup_schema(pool)
    async with pool.connection() as conn:
        await conn.execute(RIG.replace("%(gate)s", str(GATE_LOCK)))
        for table in RIGGED:
            await conn.execute(f"CREATE SEQUENCE IF NOT EXISTS ch07_crash_{table}")
            await conn.execute(f"DROP TRIGGER IF EXISTS ch07_rig ON {table}")
            await conn.execute(
                f"CREATE TRIGGER ch07_rig BEFORE INSERT OR UPDATE OR DELETE ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION ch07_rig()"
            )


# ----------------------------------------------------------------------------- crashes


async def arm_crash(pool, table: str, nth: int = 1) -> None:
    """Make the ``nth`` write to ``table`` from now on raise, once."""
    async with pool.connection() as conn:
        await conn.execute(f"SELECT setval('ch07_crash_{table}', 1, false)")
        await conn.execute(
            "INSERT INTO ch07_crashes (table_name, nth) VALUES (%s, %s) "
            "ON CONFLICT (table_name) DO UPDATE SET nth = EXCLUDED.nth",
            (table, nth),
        )


async def disarm(pool, table: str) -> bool:
    """Stop crashing at ``table``; whether the armed crash had fired."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE ch07_crashes c SET nth = 0 FROM (SELECT nth FROM ch07_crashes WHERE table_name = %s) old "
            "WHERE c.table_name = %s RETURNING old.nth",
            (table, table),
        )
        row = await cur.fetchone()
    return row is not None and row[0] > 0 and await crash_fired(pool, table, row[0])


async def crash_fired(pool, table: str, nth: int = 1) -> bool:
    """Whether the crash armed at ``table`` has fired (its write count reached ``nth``)."""
    async with pool.connection() as conn:
        cur = await conn.execute(f"SELECT last_value, is_called FROM ch07_crash_{table}")
        last, called = await cur.fetchone()
    return bool(called) and last >= nth


# ----------------------------------------------------------------------------- the gate


class Gate:
    """Hold every write to ``tables`` inside PostgreSQL until :meth:`open` (an async context).

    ``async with Gate(database_url, ["es_events"]) as gate: ... await gate.open()``.
    With ``keys=[3, 2]`` writes are held by their row's ``version``; ``open(3)`` lets the
    writes of version 3 through and keeps the others held.
    """

    def __init__(self, database_url: str, tables, keys: list[int] | None = None) -> None:
        self.database_url = database_url
        self.tables = list(tables)
        self.keys = list(keys) if keys else [0]
        self.held: list[int] = []
        self.conn: psycopg.AsyncConnection | None = None

    async def __aenter__(self) -> Gate:
        self.conn = await psycopg.AsyncConnection.connect(self.database_url, autocommit=True)
        for key in self.keys:
            await self.conn.execute("SELECT pg_advisory_lock(%s, %s)", (GATE_LOCK, key))
            self.held.append(key)
        for table in self.tables:
            await self.conn.execute(
                "INSERT INTO ch07_gates VALUES (%s, %s) ON CONFLICT (table_name) DO UPDATE SET by_version = "
                "EXCLUDED.by_version",
                (table, self.keys != [0]),
            )
        return self

    async def open(self, key: int | None = None) -> None:
        """Let the writes of ``key`` through (all of them when ``key`` is None)."""
        if self.conn is None:
            return
        for k in [key] if key is not None else list(self.held):
            if k in self.held:
                self.held.remove(k)
                await self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", (GATE_LOCK, k))
        if not self.held:
            await self.conn.execute("DELETE FROM ch07_gates WHERE table_name = ANY(%s)", (self.tables,))

    async def __aexit__(self, *exc) -> None:
        try:
            await self.open()
        finally:
            if self.conn is not None:
                await self.conn.close()


@dataclass
class RaceLog:
    """What :func:`race` saw when it opened the gate."""

    writers: int
    held: int = 0  # writers waiting on a lock in PostgreSQL when the gate opened
    finished_early: int = 0  # writers done before the gate opened (they never wrote the table)
    stalled: bool = False  # some writer neither finished nor waited in PostgreSQL within SETTLE_LIMIT

    def line(self) -> str:
        text = f"{self.held} of {self.writers} writers held in PostgreSQL when the gate opened"
        if self.finished_early:
            text += f", {self.finished_early} finished before it"
        if self.stalled:
            text += f" (the rest did not reach the database within {SETTLE_LIMIT:g} s)"
        return text


async def _waiting(watcher) -> int:
    cur = await watcher.execute(LOCK_WAITERS)
    return (await cur.fetchone())[0]


async def _settle(watcher, tasks, limit: float) -> tuple[bool, int]:
    """Wait until every unfinished task waits on a PostgreSQL lock; (settled, how many wait)."""
    deadline = time.monotonic() + limit
    while True:
        await asyncio.sleep(0.002)
        pending = sum(not t.done() for t in tasks)
        waiting = await _waiting(watcher) if pending else 0
        if waiting >= pending:
            return True, waiting
        if time.monotonic() > deadline:
            return False, waiting


async def race(
    database_url: str,
    tables,
    calls: list[Callable[[], Awaitable]],
    *,
    order: list[int] | None = None,
    stagger: bool = False,
    limit: float = SETTLE_LIMIT,
) -> tuple[list, RaceLog]:
    """Run ``calls`` at once with a gate on ``tables``; results (or exceptions) in call order.

    The gate opens once every writer is finished or held in PostgreSQL. With ``order`` it
    is keyed by ``version`` and opens one version at a time, in that order, settling
    between (see :class:`Gate`). With ``stagger`` the calls start one at a time, each once
    the ones before it are held: the first call reaches the table (and its row lock) first.
    """
    log = RaceLog(len(calls))
    watcher = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    tasks: list[asyncio.Task] = []
    try:
        async with Gate(database_url, tables, keys=order) as gate:
            try:
                for call in calls if stagger else []:
                    tasks.append(asyncio.ensure_future(call()))
                    settled, log.held = await _settle(watcher, tasks, limit)
                    log.stalled |= not settled
                if not stagger:
                    tasks = [asyncio.ensure_future(call()) for call in calls]
                    settled, log.held = await _settle(watcher, tasks, limit)
                    log.stalled = not settled
                log.finished_early = sum(t.done() for t in tasks)
                for key in order or []:
                    await gate.open(key)
                    settled, _ = await _settle(watcher, tasks, limit)
                    log.stalled |= not settled
            finally:
                await gate.open()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await watcher.close()
    return list(results), log
