"""An event store on PostgreSQL: append with an expected version, fold, snapshots, upcasting (chapter 07).

State is not a row that gets overwritten; it is the **fold** of a stream of events:
``[Opened, Deposited 1000, Withdrawn 300]`` *is* the account, and its balance of 700 is
computed from them. The store is one table, ``es_events``, owned by this module:

- every event has a ``stream_id`` (one aggregate: ``acc-42``) and a ``version`` that
  counts 1, 2, 3, ... inside its stream, with ``UNIQUE (stream_id, version)``;
- a global ``position`` orders all events for projections (:mod:`course.projections`);
- :func:`append` takes the version the writer last saw (**optimistic concurrency**):
  when another writer got there first it raises :class:`ConcurrencyConflict`, and the
  caller reloads, decides again and retries (:func:`execute`). Two writers that read
  version 3 both try to write version 4; the unique index lets exactly one through.

Appends also take one transaction-level advisory lock, so events commit in the order of
their ``position``. Without it a projector that tails ``position > checkpoint`` can skip
an event whose transaction drew a lower position but committed later (the eventsourcing
package takes an EXCLUSIVE table lock for the same reason). Chapter 07 shows the skip.

Snapshots (``es_snapshots``) store a folded state at a version, so loading a long stream
reads the snapshot plus the events after it. Upcasters turn old event shapes into the
current one on read, so stored events never need rewriting.

``setup_schema`` is async: ``await setup_schema(pool)``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from course.kit.lab import connection

SCHEMA = """
CREATE TABLE IF NOT EXISTS es_events (
    position    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream_id   text        NOT NULL,
    version     integer     NOT NULL CHECK (version > 0),
    type        text        NOT NULL,
    data        jsonb       NOT NULL DEFAULT '{}',
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    UNIQUE (stream_id, version)
);
CREATE TABLE IF NOT EXISTS es_snapshots (
    stream_id text        PRIMARY KEY,
    version   integer     NOT NULL,
    state     jsonb       NOT NULL,
    taken_at  timestamptz NOT NULL DEFAULT now()
);
"""

#: Key of the advisory lock that makes appends commit in ``position`` order.
APPEND_LOCK = 707_001


async def setup_schema(pool_or_conn) -> None:
    """Create ``es_events`` and ``es_snapshots`` (idempotent)."""
    async with connection(pool_or_conn) as conn:
        await conn.execute(SCHEMA)


# ----------------------------------------------------------------------------- events and errors


class ConcurrencyConflict(Exception):
    """The stream moved on since the writer read it: reload, decide again, retry."""

    def __init__(self, stream_id: str, expected: int, actual: int | None = None) -> None:
        seen = "" if actual is None else f", it is at {actual}"
        super().__init__(f"stream {stream_id!r}: expected version {expected}{seen}")
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual


@dataclass(frozen=True)
class Event:
    """One stored event. ``data`` is a JSON object; ``position`` is global, ``version`` per stream."""

    type: str
    data: dict = field(default_factory=dict)
    stream_id: str = ""
    version: int = 0
    position: int = 0

    def as_dict(self) -> dict:
        return {
            "position": self.position,
            "stream_id": self.stream_id,
            "version": self.version,
            "type": self.type,
            "data": self.data,
        }


def _new_event(item) -> tuple[str, dict]:
    """``("Deposited", {...})`` from an :class:`Event`, a dict with type/data, or a pair."""
    if isinstance(item, Event):
        return item.type, item.data
    if isinstance(item, dict):
        return item["type"], item.get("data", {})
    kind, data = item
    return kind, data


# ----------------------------------------------------------------------------- append and read


async def current_version(conn, stream_id: str) -> int:
    cur = await conn.execute(
        "SELECT coalesce(max(version), 0) FROM es_events WHERE stream_id = %s", (stream_id,)
    )
    return (await cur.fetchone())[0]


async def append(pool_or_conn, stream_id: str, expected_version: int, events: Iterable) -> int:
    """Append ``events`` to ``stream_id`` if it is still at ``expected_version``; the new version.

    All or nothing, in one transaction. ``expected_version`` is the number of events the
    writer saw (0 for a new stream). Raises :class:`ConcurrencyConflict` when the stream is
    at another version, before the insert (read in the transaction) or at it (the unique
    index on ``(stream_id, version)`` caught a writer that committed in between).
    """
    items = [_new_event(e) for e in events]
    if not items:
        return expected_version
    async with connection(pool_or_conn) as conn:
        try:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))
                actual = await current_version(conn, stream_id)
                if actual != expected_version:
                    raise ConcurrencyConflict(stream_id, expected_version, actual)
                async with conn.cursor() as cur:
                    await cur.executemany(
                        "INSERT INTO es_events (stream_id, version, type, data) VALUES (%s, %s, %s, %s)",
                        [
                            (stream_id, expected_version + i, kind, Jsonb(data))
                            for i, (kind, data) in enumerate(items, 1)
                        ],
                    )
        except psycopg.errors.UniqueViolation:
            raise ConcurrencyConflict(stream_id, expected_version) from None
    return expected_version + len(items)


def _row_event(row) -> Event:
    position, stream_id, version, kind, data = row
    return upcast(Event(kind, data, stream_id, version, position))


async def read_stream(
    pool_or_conn, stream_id: str, after_version: int = 0, up_to_version: int | None = None
) -> list[Event]:
    """The events of one stream with ``after_version < version <= up_to_version``, upcast, in order."""
    async with connection(pool_or_conn) as conn:
        cur = await conn.execute(
            "SELECT position, stream_id, version, type, data FROM es_events "
            "WHERE stream_id = %s AND version > %s AND (%s::int IS NULL OR version <= %s::int) ORDER BY version",
            (stream_id, after_version, up_to_version, up_to_version),
        )
        return [_row_event(row) for row in await cur.fetchall()]


async def read_all(pool_or_conn, after_position: int = 0, limit: int = 500) -> list[Event]:
    """Events of every stream with ``position > after_position``, upcast, in position order."""
    async with connection(pool_or_conn) as conn:
        cur = await conn.execute(
            "SELECT position, stream_id, version, type, data FROM es_events "
            "WHERE position > %s ORDER BY position LIMIT %s",
            (after_position, limit),
        )
        return [_row_event(row) for row in await cur.fetchall()]


# ----------------------------------------------------------------------------- upcasting

#: ``(type, shape test, converter)``: an old event shape and how to read it today.
UPCASTERS: list[tuple[str, Callable[[dict], bool], Callable[[dict], dict]]] = []


def upcaster(kind: str, applies: Callable[[dict], bool]):
    """Register ``fn(data) -> data`` that turns an old shape of ``kind`` into the current one."""

    def register(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
        UPCASTERS.append((kind, applies, fn))
        return fn

    return register


def upcast(event: Event) -> Event:
    """The event in today's shape (stored rows are never rewritten)."""
    data = event.data
    for kind, applies, fn in UPCASTERS:
        if kind == event.type and applies(data):
            data = fn(data)
    return (
        event
        if data is event.data
        else Event(event.type, data, event.stream_id, event.version, event.position)
    )


# ----------------------------------------------------------------------------- fold and snapshots


def fold(events: Iterable[Event], evolve: Callable[[Any, Event], Any], initial: Any = None) -> Any:
    """The state after ``events``: ``evolve(evolve(initial, e1), e2) ...``."""
    state = initial
    for event in events:
        state = evolve(state, event)
    return state


async def load(
    pool_or_conn, stream_id: str, evolve, initial=None, *, snapshots: bool = True
) -> tuple[Any, int]:
    """``(state, version)`` of a stream: its snapshot (if any) plus the events after it."""
    state, version = initial, 0
    async with connection(pool_or_conn) as conn:
        if snapshots:
            cur = await conn.execute(
                "SELECT version, state FROM es_snapshots WHERE stream_id = %s", (stream_id,)
            )
            row = await cur.fetchone()
            if row is not None:
                version, state = row
        events = await read_stream(conn, stream_id, after_version=version)
    state = fold(events, evolve, state)
    return state, (events[-1].version if events else version)


async def save_snapshot(pool_or_conn, stream_id: str, version: int, state) -> bool:
    """Store ``state`` as of ``version`` unless a newer snapshot is there; True if stored.

    A snapshot is a cache of the fold: losing it costs a longer load, never a wrong one.
    ``state`` must be JSON (a dict); change :func:`evolve` and the snapshots must go.
    """
    async with connection(pool_or_conn) as conn:
        cur = await conn.execute(
            "INSERT INTO es_snapshots (stream_id, version, state) VALUES (%s, %s, %s) "
            "ON CONFLICT (stream_id) DO UPDATE SET version = EXCLUDED.version, state = EXCLUDED.state, taken_at = now() "
            "WHERE es_snapshots.version < EXCLUDED.version RETURNING version",
            (stream_id, version, Jsonb(state)),
        )
        return await cur.fetchone() is not None


async def execute(
    pool,
    stream_id: str,
    decide: Callable[[Any], list],
    evolve,
    initial=None,
    *,
    retries: int = 5,
    snapshot_every: int | None = None,
    on_conflict: Callable[[ConcurrencyConflict], Awaitable[None] | None] | None = None,
) -> int:
    """Run a command: load, ``decide(state) -> new events``, append; on a conflict reload and retry.

    Returns the stream's version after the append, the token a client passes back to read
    its own write (:func:`course.projections.wait_for`). ``decide`` raises to refuse.
    """
    for attempt in range(retries + 1):
        state, version = await load(pool, stream_id, evolve, initial)
        new = decide(state)
        try:
            after = await append(pool, stream_id, version, new)
        except ConcurrencyConflict as err:
            if on_conflict is not None:
                maybe = on_conflict(err)
                if maybe is not None:
                    await maybe
            if attempt == retries:
                raise
            continue
        if snapshot_every and after // snapshot_every > version // snapshot_every:
            # Fold exactly the events this append wrote (version, after]: a writer that appended
            # after us must not slip into a snapshot labelled `after`, or load() applies it twice.
            mine = await read_stream(pool, stream_id, version, up_to_version=after)
            await save_snapshot(pool, stream_id, after, fold(mine, evolve, state))
        return after
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- the worked example: an account


class Refused(Exception):
    """A command the account's rules refuse (no event is written)."""


def account_evolve(state: dict | None, event: Event) -> dict:
    """One step of an account's fold. The state is a JSON dict, so it can be snapshotted."""
    if event.type == "AccountOpened":
        return {"owner": event.data["owner"], "balance_cents": 0, "events": 1}
    if state is None:
        raise ValueError(f"{event.type} before AccountOpened in {event.stream_id}")
    state = dict(state, events=state["events"] + 1)
    if event.type == "Deposited":
        state["balance_cents"] += event.data["amount_cents"]
    elif event.type == "Withdrawn":
        state["balance_cents"] -= event.data["amount_cents"]
    return state


def open_account(owner: str) -> Callable[[dict | None], list]:
    def decide(state):
        if state is not None:
            raise Refused("the account is open already")
        return [("AccountOpened", {"owner": owner})]

    return decide


def deposit(amount_cents: int) -> Callable[[dict | None], list]:
    def decide(state):
        if state is None:
            raise Refused("no such account")
        if amount_cents <= 0:
            raise Refused("deposits are positive")
        return [("Deposited", {"amount_cents": amount_cents})]

    return decide


def withdraw(amount_cents: int) -> Callable[[dict | None], list]:
    def decide(state):
        if state is None:
            raise Refused("no such account")
        if amount_cents > state["balance_cents"]:
            raise Refused(f"insufficient funds: {state['balance_cents']} < {amount_cents}")
        return [("Withdrawn", {"amount_cents": amount_cents})]

    return decide


# Deposits were once stored as {"amount": 12.5} (euros, a float). Read them as integer cents.
@upcaster("Deposited", lambda data: "amount_cents" not in data and "amount" in data)
def _deposited_v1(data: dict) -> dict:
    return {"amount_cents": round(data["amount"] * 100), "upcast_from": "v1"}


def dumps(event: Event) -> str:
    """A short, readable line for an event (notebooks print these)."""
    return f"#{event.position:<4} {event.stream_id} v{event.version} {event.type} {json.dumps(event.data)}"
