"""PostgreSQL's own timeouts, live (chapter 01): the server side of "every call has a timeout".

The notebook sets ``statement_timeout``, ``lock_timeout`` and
``idle_in_transaction_session_timeout`` inline, so the settings are on the page; this
module holds the demo's table (``ch01_accounts``) and the small helpers around it:
:func:`timed` runs one statement and says how it ended, :func:`activity` reads
``pg_stat_activity`` for the queries tagged with a marker, :func:`abandoned_query` shows a
caller that stops waiting while the server's query runs on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import psycopg

ACCOUNTS_SCHEMA = "CREATE TABLE IF NOT EXISTS ch01_accounts (id int PRIMARY KEY, balance int NOT NULL)"


def setup_accounts(conn: psycopg.Connection) -> None:
    """The lock demo's table, with account 1 (idempotent: the notebook may run twice)."""
    conn.execute(ACCOUNTS_SCHEMA)
    conn.execute("INSERT INTO ch01_accounts VALUES (1, 100) ON CONFLICT (id) DO NOTHING")


def timed(label: str, statement: Callable[[], object]) -> tuple[float, str]:
    """Run ``statement()``, print how long it took and how it ended (one short line), and
    return both: ``(milliseconds, "finished" or the psycopg error's class name)``."""
    t0 = time.perf_counter()
    try:
        statement()
        outcome = "finished"
    except psycopg.Error as err:
        outcome = type(err).__name__
    ms = (time.perf_counter() - t0) * 1000
    print(f"{label:<46} {ms:6.0f} ms  {outcome}")
    return ms, outcome


def activity(ns, marker: str) -> list[tuple[int, str, float]]:
    """``(pid, state, seconds since the query started)`` of every other backend whose query
    contains ``marker`` (tag queries with a comment: ``SELECT ... /* marker */``)."""
    with ns.connect() as admin:
        rows = admin.execute(
            "SELECT pid, state, extract(epoch FROM clock_timestamp() - query_start)::float8 "
            "FROM pg_stat_activity WHERE query LIKE %s AND pid <> pg_backend_pid()",
            (f"%{marker}%",),
        ).fetchall()
    return [(pid, state, round(seconds, 2)) for pid, state, seconds in rows]


def cancel(ns, marker: str) -> int:
    """``pg_cancel_backend`` every query tagged with ``marker``: the server-side stop button."""
    with ns.connect() as admin:
        rows = admin.execute(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE query LIKE %s AND pid <> pg_backend_pid()",
            (f"%{marker}%",),
        ).fetchall()
    return sum(1 for (ok,) in rows if ok)


async def abandoned_query(ns, *, seconds: float = 2.0, patience: float = 0.3) -> list[tuple[int, str, float]]:
    """A blocking driver call run in a thread, and a caller that gives up on it after
    ``patience`` seconds (``asyncio.wait_for`` around ``asyncio.to_thread``): the thread, the
    connection and the server's query all go on. Returns what ``pg_stat_activity`` shows
    after the caller gave up; then cancels the query on the server.

    On a busy machine the thread may not even have sent its query when the caller gives up:
    then ``pg_stat_activity`` is read again (for up to half of ``seconds``) until the query
    shows, which only makes the point stronger: the caller gave up, and the work began anyway.
    """

    def report() -> None:
        try:
            with ns.connect() as conn:
                conn.execute("SELECT pg_sleep(%s) /* abandoned report */", (seconds,))
        except psycopg.errors.QueryCanceled:
            pass  # stopped by cancel() below

    worker = asyncio.ensure_future(asyncio.to_thread(report))
    try:
        await asyncio.wait_for(asyncio.shield(worker), patience)
    except TimeoutError:
        pass
    rows = activity(ns, "abandoned report")
    deadline = time.monotonic() + seconds / 2
    while not rows and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        rows = activity(ns, "abandoned report")
    cancel(ns, "abandoned report")
    await worker  # the thread ends once the server has cancelled its query
    return rows
