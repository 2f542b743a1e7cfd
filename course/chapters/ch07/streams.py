"""Chapter 07's event-sourcing demos: the overdraft race, the double-clicked deposit that optimistic
concurrency applies twice (and the idempotency key that stops it), fold time and snapshots, the
skipped late commit, projection lag as a user sees it, and a crash between apply and checkpoint."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid

import psycopg
from psycopg.types.json import Jsonb

from course import eventstore as es
from course import projections
from course.chapters.ch07 import rig

# ----------------------------------------------------------------------------- the overdraft race


async def append_unchecked(pool, stream_id: str, events) -> int:
    """The append that ignores what the writer read: next version computed at insert time.

    It never conflicts: on a unique violation it just tries the next version. Every
    decision made on a stale state gets written.
    """
    while True:
        try:
            async with pool.connection() as conn, conn.transaction():
                for kind, data in events:
                    cur = await conn.execute(
                        "INSERT INTO es_events (stream_id, version, type, data) "
                        "SELECT %s, coalesce(max(version), 0) + 1, %s, %s FROM es_events WHERE stream_id = %s "
                        "RETURNING version",
                        (stream_id, kind, Jsonb(data), stream_id),
                    )
                    (version,) = await cur.fetchone()
            return version
        except psycopg.errors.UniqueViolation:
            continue


async def withdraw_unchecked(pool, stream_id: str, amount_cents: int) -> int:
    """Load, decide, append without an expected version."""
    state, _ = await es.load(pool, stream_id, es.account_evolve)
    new = es.withdraw(amount_cents)(state)
    return await append_unchecked(pool, stream_id, new)


async def overdraft_race(pool, database_url: str, stream_id: str, *, n: int = 5, checked: bool) -> dict:
    """``n`` concurrent withdrawals of the whole balance (100.00) from one account.

    Every writer loads the account before any of them appends (a gate on ``es_events``).
    ``checked=False`` appends without an expected version; ``checked=True`` uses
    :func:`course.eventstore.execute` (expected version, reload and retry on conflict).
    """
    await es.append(
        pool, stream_id, 0, [("AccountOpened", {"owner": "ada"}), ("Deposited", {"amount_cents": 10_000})]
    )
    conflicts: list[str] = []

    async def one():
        if not checked:
            return await withdraw_unchecked(pool, stream_id, 10_000)
        return await es.execute(
            pool,
            stream_id,
            es.withdraw(10_000),
            es.account_evolve,
            on_conflict=lambda err: conflicts.append(str(err)),
        )

    results, log = await rig.race(database_url, ["es_events"], [one] * n)
    state, version = await es.load(pool, stream_id, es.account_evolve, snapshots=False)
    return {
        "results": results,
        "log": log,
        "balance_cents": state["balance_cents"],
        "version": version,
        "conflicts": conflicts,
    }


def outcome(result) -> str:
    if isinstance(result, BaseException):
        return f"{type(result).__name__}: {str(result).splitlines()[0]}"
    return f"appended, stream at version {result}"


# ----------------------------------------------------------------------------- a double click: one intent, twice


def keyed_evolve(state: dict | None, event: es.Event) -> dict:
    """:func:`course.eventstore.account_evolve`, plus the idempotency keys the stream has seen.

    (A real account keeps a window of them, as chapter 03 keeps its keys for a day.)
    """
    new = es.account_evolve(state, event)
    key = event.data.get("idempotency_key")
    return dict(new, keys=[*new.get("keys", []), key]) if key else new


def deposit_once(amount_cents: int, key: str):
    """Decide a deposit carrying the client's idempotency key; nothing if the stream has that key."""
    deposit = es.deposit(amount_cents)

    def decide(state):
        if state is not None and key in state.get("keys", ()):
            return []  # this intent is in the stream already: append nothing, answer with the version
        return [(kind, dict(data, idempotency_key=key)) for kind, data in deposit(state)]

    return decide


async def double_click(
    pool, database_url: str, stream_id: str, *, keyed: bool, amount_cents: int = 5_000
) -> dict:
    """One deposit sent twice at once (a double click), through :func:`course.eventstore.execute`.

    Both requests load the account before either appends (the rig's gate), so one of them
    conflicts, reloads and decides again. ``keyed=False``: a deposit is always allowed, so the
    retry appends it a second time. ``keyed=True``: both carry one idempotency key, and the
    retry finds it in the stream.
    """
    await es.append(pool, stream_id, 0, [("AccountOpened", {"owner": "ada"})])
    key = f"deposit-{uuid.uuid4().hex[:8]}"  # one key per intent: both clicks send it
    decide = deposit_once(amount_cents, key) if keyed else es.deposit(amount_cents)
    evolve = keyed_evolve if keyed else es.account_evolve
    conflicts: list[str] = []

    async def click():
        return await es.execute(
            pool, stream_id, decide, evolve, on_conflict=lambda err: conflicts.append(str(err))
        )

    results, log = await rig.race(database_url, ["es_events"], [click, click])
    events = await es.read_stream(pool, stream_id)
    state = es.fold(events, es.account_evolve)
    return {
        "results": results,
        "log": log,
        "conflicts": len(conflicts),
        "deposits": sum(e.type == "Deposited" for e in events),
        "balance_cents": state["balance_cents"],
        "meant_cents": amount_cents,
    }


# ----------------------------------------------------------------------------- fold time and snapshots


async def fill_stream(pool, stream_id: str, n: int, amount_cents: int = 100) -> None:
    """A stream of ``n`` events (open, then deposits), written in one statement (0: an empty stream).

    A stream of that name from an earlier run goes first, with its read-model row: its new
    events take new positions, and the balances projector must meet its AccountOpened again
    as a new account (else the notebook's second run stops at the catch-up on a duplicate key).
    """
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("DELETE FROM es_events WHERE stream_id = %s", (stream_id,))
        await conn.execute("DELETE FROM es_snapshots WHERE stream_id = %s", (stream_id,))
        await conn.execute("DELETE FROM account_balances WHERE account_id = %s", (stream_id,))
        await conn.execute(
            "INSERT INTO es_events (stream_id, version, type, data) "
            "SELECT %s, g, CASE WHEN g = 1 THEN 'AccountOpened' ELSE 'Deposited' END, "
            "CASE WHEN g = 1 THEN jsonb_build_object('owner', 'bench') "
            "ELSE jsonb_build_object('amount_cents', %s::int) END FROM generate_series(1, %s) g",
            (stream_id, amount_cents, n),
        )


async def time_load(pool, stream_id: str, *, snapshots: bool, repeats: int) -> float:
    """Median milliseconds to load (read + fold) a stream."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await es.load(pool, stream_id, es.account_evolve, snapshots=snapshots)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


async def fold_vs_length(
    pool, lengths, *, every: int = 100, repeats: int = 5
) -> list[tuple[int, float, float, int]]:
    """``(events, ms without snapshot, ms with a snapshot, events read after the snapshot)``."""
    rows = []
    for n in lengths:
        stream_id = f"bench-{n}"
        await fill_stream(pool, stream_id, n)
        full = await time_load(pool, stream_id, snapshots=False, repeats=repeats)
        at = n - every // 2 if n > every else 0  # a snapshot every ``every`` events leaves ~every/2 after it
        if at:
            state = es.fold((await es.read_stream(pool, stream_id))[:at], es.account_evolve)
            await es.save_snapshot(pool, stream_id, at, state)
        snap = await time_load(pool, stream_id, snapshots=True, repeats=repeats)
        rows.append((n, full, snap, n - at))
    async with pool.connection() as conn:  # benchmark streams only: the read models need not replay them
        await conn.execute("DELETE FROM es_events WHERE stream_id LIKE 'bench-%%'")
        await conn.execute("DELETE FROM es_snapshots WHERE stream_id LIKE 'bench-%%'")
    return rows


def plot_fold(rows, ax=None):
    from course.kit import plotting

    if ax is None:
        _, ax = plotting.figure(8, 3.2)
    n = [r[0] for r in rows]
    ax.plot(n, [r[1] for r in rows], "o-", color=plotting.COLORS["bad"], label="fold every event")
    ax.plot(n, [r[2] for r in rows], "s-", color=plotting.COLORS["ok"], label="snapshot + events after it")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="events in the stream",
        ylabel="load time (ms, median)",
        title="Loading an aggregate: full fold vs snapshot",
    )
    plotting.legend_outside(ax)
    return ax


# ----------------------------------------------------------------------------- the skipped late commit


async def late_commit(database_url: str, pool, *, locked: bool) -> dict:
    """Two appends; the one with the lower position commits last. Does a tailing reader see it?

    ``locked=False``: plain inserts (positions are handed out at insert, commits happen in
    any order). ``locked=True``: both take the store's append lock first, as
    :func:`course.eventstore.append` does.
    """
    run = uuid.uuid4().hex[:6]  # new streams each time: the notebook runs again in the same database
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT coalesce(max(position), 0) FROM es_events")
        (checkpoint,) = await cur.fetchone()
    slow = await psycopg.AsyncConnection.connect(database_url)
    seen: list[int] = []
    try:
        if locked:
            await slow.execute("SELECT pg_advisory_xact_lock(%s)", (es.APPEND_LOCK,))
        cur = await slow.execute(
            "INSERT INTO es_events (stream_id, version, type, data) VALUES (%s, 1, 'AccountOpened', %s) RETURNING position",
            (f"late-slow-{locked}-{run}", Jsonb({"owner": "slow"})),
        )
        (slow_position,) = await cur.fetchone()

        async def fast():
            if locked:
                return await es.append(
                    pool, f"late-fast-{locked}-{run}", 0, [("AccountOpened", {"owner": "fast"})]
                )
            async with pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO es_events (stream_id, version, type, data) VALUES (%s, 1, 'AccountOpened', %s)",
                    (f"late-fast-{locked}-{run}", Jsonb({"owner": "fast"})),
                )

        fast_task = asyncio.ensure_future(fast())
        await asyncio.sleep(0.1)  # the fast writer commits (or, locked, waits for the slow one)
        for event in await es.read_all(pool, checkpoint):  # the projector's poll while the slow one is open
            seen.append(event.position)
            checkpoint = event.position
        await slow.commit()
        await fast_task
        for event in await es.read_all(pool, checkpoint):  # and its next poll
            seen.append(event.position)
            checkpoint = event.position
    finally:
        await slow.close()
    return {"slow_position": slow_position, "seen": seen, "skipped": slow_position not in seen}


# ----------------------------------------------------------------------------- projection lag, seen by a user


async def lag_trials(pool, *, trials: int, interval: float, wait_timeout: float = 1.0) -> dict:
    """A user deposits, then reads their balance at once, ``trials`` times, with a projector
    that polls every ``interval`` seconds. How often is the first read stale, and how long
    does read-your-writes (:func:`course.projections.wait_for` with the returned version) wait?"""
    stream_id = "lag-user"
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM es_events WHERE stream_id = %s", (stream_id,))
        await conn.execute("DELETE FROM account_balances WHERE account_id = %s", (stream_id,))
    await es.execute(pool, stream_id, es.open_account("user"), es.account_evolve)
    stop = asyncio.Event()
    runner = asyncio.ensure_future(projections.balances.run(pool, stop, interval=interval))
    stale, waits, fell_back = 0, [], 0
    try:
        await projections.wait_for(pool, stream_id, 1, timeout=5)
        for _ in range(trials):
            version = await es.execute(pool, stream_id, es.deposit(100), es.account_evolve)
            async with pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT version FROM account_balances WHERE account_id = %s", (stream_id,)
                )
                (seen,) = await cur.fetchone()
            stale += seen < version
            t0 = time.perf_counter()
            row = await projections.wait_for(pool, stream_id, version, timeout=wait_timeout)
            waits.append((time.perf_counter() - t0) * 1000)
            fell_back += row is None
            await asyncio.sleep(interval * 0.37)  # users do not click in step with the projector
    finally:
        stop.set()
        await runner
    return {"trials": trials, "stale": stale, "waits_ms": waits, "fell_back": fell_back}


# ----------------------------------------------------------------------------- a crash between apply and checkpoint


async def apply_then_checkpoint(pool, events) -> int:
    """A projector with its checkpoint in a **separate** transaction after the rows."""
    events = [projections.as_event(e) for e in events]
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT position FROM projection_checkpoints WHERE name = 'account_balances'"
        )
        (checkpoint,) = await cur.fetchone()
    new = [e for e in events if e.position > checkpoint]
    if not new:
        return 0
    async with pool.connection() as conn, conn.transaction():
        for event in new:
            await projections.apply_balance_event(conn, event)
    async with pool.connection() as conn:  # a crash here: rows committed, checkpoint not
        await conn.execute(
            "UPDATE projection_checkpoints SET position = %s WHERE name = 'account_balances'",
            (new[-1].position,),
        )
    return len(new)


async def crash_and_redeliver(pool, apply, stream_id: str) -> dict:
    """Deposit 10.00 three times, deliver the batch with a crash at the checkpoint, redeliver."""
    await projections.balances.rebuild(pool)
    await es.execute(pool, stream_id, es.open_account("crash"), es.account_evolve)
    await projections.balances.catch_up(pool)
    for _ in range(3):
        await es.execute(pool, stream_id, es.deposit(1000), es.account_evolve)
    batch = await es.read_all(pool, await projections.balances.checkpoint(pool))
    await rig.arm_crash(pool, "projection_checkpoints")
    log = []
    for _ in range(3):  # at-least-once: redeliver until it returns
        try:
            log.append(f"applied {await apply(pool, batch)}")
            break
        except psycopg.Error as err:
            log.append(f"{type(err).__name__}: {str(err).splitlines()[0]}")
    await rig.disarm(pool, "projection_checkpoints")
    balance = (await projections.read_balances(pool))[stream_id][1]
    truth, _ = await es.load(pool, stream_id, es.account_evolve, snapshots=False)
    return {"log": log, "balance_cents": balance, "truth_cents": truth["balance_cents"]}
