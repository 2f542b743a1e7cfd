"""The check's rig for chapter 10: concurrent callers moved one step at a time through PostgreSQL.

:class:`Contest` is :class:`course.chapters.ch10.Race` with a turnstile at COMMIT:

- it holds the contended row (``SELECT ... FOR NO KEY UPDATE`` in a transaction of its own) and
  starts the callers, in waves if asked;
- a deferred constraint trigger on the contended table (:func:`install_turnstile`) makes every
  transaction that updated a row of it wait, at its COMMIT, on an advisory lock the check holds.
  So nothing a caller wrote becomes visible before the check says so;
- the check acts only when the crowd is *settled*: every caller still running waits on a
  PostgreSQL lock and the waits form no cycle (a deadlock is left to PostgreSQL to break, and
  the check waits for it instead of moving on while the cycle stands). Then it lets one commit
  through the turnstile, or, when no one waits there, takes its next step (start the next
  wave, release the held row).

So every caller that retries (after a serialization failure or a deadlock) has made its next
attempt, read what it reads and queued for the row, before the transaction it lost to commits:
a bounded retry runs out after the same number of rounds on every run, and a value read
before the other transaction committed is written back on every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import psycopg

TURNSTILE_CLASS = 10_010  # advisory lock space (classid) of the turnstile's keys

TURNSTILE_FUNCTION = f"""
CREATE OR REPLACE FUNCTION ch10_turnstile() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    k bigint;
BEGIN
    -- the key the check holds now (pg_locks is not read through the transaction's snapshot)
    SELECT max(l.objid::bigint) INTO k FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.classid = {TURNSTILE_CLASS}::oid AND l.objsubid = 2
       AND l.granted AND l.mode = 'ExclusiveLock'
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());
    IF k IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock_shared({TURNSTILE_CLASS}, k::int);
    END IF;
    RETURN NULL;
END $$;
"""

WAITS = """
SELECT DISTINCT l.pid, pg_blocking_pids(l.pid) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE NOT l.granted AND a.datname = current_database() AND l.pid <> pg_backend_pid()
"""

AT_TURNSTILE = f"""
SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND classid = {TURNSTILE_CLASS}::oid AND objsubid = 2 AND NOT granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


async def install_turnstile(conn, table: str) -> None:
    """Commits of transactions that updated ``table`` wait at the turnstile while a :class:`Contest` runs."""
    await conn.execute(TURNSTILE_FUNCTION)
    await conn.execute(f"DROP TRIGGER IF EXISTS ch10_turnstile ON {table}")
    await conn.execute(
        f"CREATE CONSTRAINT TRIGGER ch10_turnstile AFTER UPDATE ON {table} "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ch10_turnstile()"
    )


def _cycle(waits: dict[int, list[int]]) -> bool:
    """Whether the waits-for graph among the waiting backends has a cycle (a deadlock not yet broken)."""
    state: dict[int, int] = {}

    def visit(pid: int) -> bool:
        state[pid] = 1
        for nxt in waits.get(pid, ()):
            if nxt not in waits:
                continue
            if state.get(nxt) == 1 or (nxt not in state and visit(nxt)):
                return True
        state[pid] = 2
        return False

    return any(pid not in state and visit(pid) for pid in waits)


class Contest:
    """Hold the row ``SELECT 1 FROM table WHERE where`` selects, run callers, move them step by step.

        async with Contest(ns, "inventory_items", "sku = %s", ("mug",)) as contest:
            contest.start(buy(...) for _ in range(8))
            results = await contest.run()

    ``run(*steps)``: at each settle the check lets the commit waiting at the turnstile through,
    or else takes the next of ``steps`` (coroutine functions), and, when they are all taken,
    releases the held row. ``stalls`` counts settles that did not come within ``limit`` real
    seconds (a caller waiting on something else than PostgreSQL: an ``asyncio.Lock``); the check
    moves on anyway. The table must have the turnstile (:func:`install_turnstile`).
    """

    def __init__(self, ns, table: str, where: str, params: tuple, *, limit: float = 2.0) -> None:
        self.ns, self.table, self.where, self.params, self.limit = ns, table, where, params, limit
        self.tasks: list[asyncio.Future] = []
        self.stalls = 0
        self.admitted = 0
        self.released = False
        self.key = 1

    async def __aenter__(self) -> Contest:
        self.watcher = await psycopg.AsyncConnection.connect(self.ns.database_url, autocommit=True)
        self.gate = await psycopg.AsyncConnection.connect(self.ns.database_url, autocommit=True)
        self.locker = await psycopg.AsyncConnection.connect(self.ns.database_url, autocommit=True)
        await self.gate.execute("SELECT pg_advisory_lock(%s, %s)", (TURNSTILE_CLASS, self.key))
        await self.locker.execute("BEGIN")
        await self.locker.execute(f"SELECT 1 FROM {self.table} WHERE {self.where} FOR NO KEY UPDATE", self.params)
        return self

    async def __aexit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            await self.release()
        with contextlib.suppress(Exception):
            await self.gate.execute("SELECT pg_advisory_unlock_all()")
        for t in self.tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for conn in (self.locker, self.gate, self.watcher):
            await conn.close()

    def start(self, calls) -> None:
        self.tasks += [asyncio.ensure_future(c) for c in calls]

    async def release(self) -> None:
        """Let the held row go."""
        if not self.released:
            self.released = True
            await self.locker.execute("COMMIT")

    async def open(self) -> None:
        """Let every commit through from now on."""
        await self.gate.execute("SELECT pg_advisory_unlock_all()")

    async def settle(self) -> bool:
        """Until every unfinished caller waits on a PostgreSQL lock, in no cycle: True; False after ``limit``."""
        deadline = time.monotonic() + self.limit
        while True:
            await asyncio.sleep(0.002)
            running = sum(not t.done() for t in self.tasks)
            if running == 0:
                return True
            cur = await self.watcher.execute(WAITS)
            waits = {pid: list(blockers or ()) for pid, blockers in await cur.fetchall()}
            if len(waits) >= running and not _cycle(waits):
                return True
            if time.monotonic() > deadline:
                return False

    async def _at_turnstile(self) -> int:
        cur = await self.watcher.execute(AT_TURNSTILE)
        return (await cur.fetchone())[0]

    async def _admit(self) -> None:
        # take the next key before letting the current one go: a commit that comes later waits on it
        await self.gate.execute("SELECT pg_advisory_lock(%s, %s)", (TURNSTILE_CLASS, self.key + 1))
        await self.gate.execute("SELECT pg_advisory_unlock(%s, %s)", (TURNSTILE_CLASS, self.key))
        self.key += 1
        self.admitted += 1

    async def run(self, *steps) -> list:
        steps = [*steps, self.release]
        while not all(t.done() for t in self.tasks):
            settled = await self.settle()
            if all(t.done() for t in self.tasks):
                break
            self.stalls += not settled
            if await self._at_turnstile():
                await self._admit()
            elif steps:
                await steps.pop(0)()
            elif settled:
                break  # every caller waits on something the check does not hold: nothing left to move
        await self.open()
        return await asyncio.gather(*self.tasks, return_exceptions=True)
