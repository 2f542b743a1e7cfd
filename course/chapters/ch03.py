"""Chapter 03 (idempotency): the failures the notebook shows, and the demos around the pattern.

The pattern itself (the key table, claim, finish, release, ``create_order``, the
idempotent consumer, the reaper and the purge) is :mod:`course.idempotency`; this module
holds what exists to show it:

- :class:`Card`: a fake card network (50 ms per charge) that can write every charge to
  ``ch03_charges``, so a double charge is a SELECT away;
- :func:`create_order_check_then_insert`: the bug (look, then act), and
  :func:`create_order_claimed`, the reference instrumented for the same
  :func:`plot_timeline`; :func:`fire`, :func:`outcome` and :func:`charges_in_burst` drive them;
- :func:`create_order_one_transaction`: the other correct design (one transaction across
  the charge);
- :func:`create_client_order`: client-generated ids (table ``client_orders``);
- :func:`make_locked_create_order`: check-then-insert behind a per-key ``asyncio.Lock``, one
  replica per call (right in one process, wrong in two);
- :func:`consume_naive`, :func:`consume_dedup_first` and :func:`consume_credit_first`:
  consumers that lose or double a credit (the last two keep the dedup record and the credit
  in two separate commits, in either order), with triggers that inject a crash at one
  statement (:func:`install_crash_points`, :func:`arm_crash`; the ``consume_payment_event``
  checks use them too) and :func:`deliver`, an at-least-once redelivery loop;
- :func:`insert_wait_demo`: what a second INSERT of the same key waits on, in ``pg_locks``.

:func:`setup_demo_tables` creates the chapter's own tables; the pattern's come from
:func:`course.idempotency.setup_schema`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import psycopg
from psycopg.types.json import Jsonb

from course.idempotency import (
    ChargeDeclined,
    IdempotencyKeyReused,
    RequestInProgress,
    call_with_retry,
    claim,
    finish_order,
    order_response,
    release,
    request_hash,
    stored_response,
)
from course.kit.plotting import COLORS, figure, legend_outside

DEMO_SCHEMA = """
-- the card network's statement: what the fake card charged (the side effect)
CREATE TABLE IF NOT EXISTS ch03_charges (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    charge_id    text NOT NULL,
    customer     text NOT NULL,
    amount_cents bigint NOT NULL,
    charged_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- "idempotent or not?": an invoice whose status is set, beside an account that is credited
CREATE TABLE IF NOT EXISTS ch03_invoices (
    id     int PRIMARY KEY,
    status text NOT NULL
);

-- client-generated ids: the id itself is the idempotency key
CREATE TABLE IF NOT EXISTS client_orders (
    id           uuid PRIMARY KEY,
    customer     text NOT NULL,
    amount_cents bigint NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
"""


async def setup_demo_tables(pool) -> None:
    """Create the chapter's demo tables (idempotent). Async: ``await setup_demo_tables(pool)``."""
    async with pool.connection() as conn:
        await conn.execute(DEMO_SCHEMA)


async def reset_demo(pool) -> None:
    """Empty the tables the demos write (keys, orders, charges, events, accounts), ids from 1 again,
    so a notebook run shows the same rows however often it runs in one kernel."""
    async with pool.connection() as conn:
        await conn.execute(
            "TRUNCATE ch03_charges, ch03_invoices, client_orders, idempotency_keys, orders, processed_events, "
            "accounts RESTART IDENTITY"
        )


# ----------------------------------------------------------------------------- the side effect


@dataclass
class Card:
    """A fake card network: ``await card.charge(customer, amount_cents)`` takes money and returns a charge id.

    It is slow on purpose (``delay`` seconds, 50 ms by default) so that concurrent requests
    really overlap. With ``pool`` it also writes every charge to the ``ch03_charges`` table, so a
    double charge can be shown with a SELECT. ``fail`` is a list of outcomes for the next calls
    (``"ok"`` or an exception to raise), consumed one per call.
    """

    pool: object | None = None
    delay: float = 0.05
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    fail: list = field(default_factory=list)
    calls: list[tuple[str, int]] = field(default_factory=list)
    charged: list[tuple[str, str, int]] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1), repr=False)

    async def charge(self, customer: str, amount_cents: int) -> str:
        self.calls.append((customer, amount_cents))
        await self.sleep(self.delay)
        outcome = self.fail.pop(0) if self.fail else "ok"
        if isinstance(outcome, BaseException):
            raise outcome
        charge_id = f"ch_{next(self._ids):05d}"
        self.charged.append((charge_id, customer, amount_cents))
        if self.pool is not None:
            async with self.pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO ch03_charges (charge_id, customer, amount_cents) VALUES (%s, %s, %s)",
                    (charge_id, customer, amount_cents),
                )
        return charge_id

    __call__ = charge


_DEFAULT_CARD = Card()


async def charge(customer: str, amount_cents: int) -> str:
    """The chapter's side effect: charge a card through the default fake :class:`Card` (50 ms)."""
    return await _DEFAULT_CARD.charge(customer, amount_cents)


# ----------------------------------------------------------------------------- the failure: check, then act


class Timeline:
    """Spans of concurrent requests for a timeline plot: ``async with tl.span("lookup"): ...``.

    The lane is the running task's name (name tasks ``req 1``, ``req 2``, ...).
    """

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.spans: list[tuple[str, str, float, float]] = []

    @contextlib.asynccontextmanager
    async def span(self, step: str):
        start = time.perf_counter() - self.t0
        try:
            yield
        finally:
            task = asyncio.current_task()
            lane = task.get_name() if task else "main"
            self.spans.append((lane, step, start, time.perf_counter() - self.t0))


_NO_TIMELINE = Timeline()


async def create_order_check_then_insert(
    pool,
    idempotency_key: str,
    body: dict,
    charge,
    *,
    lookup_timeout_ms: int | None = None,
    timeline: Timeline | None = None,
) -> dict:
    """THE BUG (do not copy): look for the key with SELECT, and if absent charge, then insert.

    Two bugs in one: concurrent requests all see "absent" and all charge; and any error
    of the lookup (here a statement timeout) is taken as "absent" too.
    """
    tl = timeline or _NO_TIMELINE
    async with pool.connection() as conn:
        row = None
        async with tl.span("SELECT key"):
            try:
                if lookup_timeout_ms is not None:
                    await conn.execute(f"SET statement_timeout = {int(lookup_timeout_ms)}")
                cur = await conn.execute(
                    "SELECT response FROM idempotency_keys WHERE key = %s", (idempotency_key,)
                )
                row = await cur.fetchone()
            except psycopg.Error:
                row = None  # BUG: "could not look" is not "not there"
            finally:
                if lookup_timeout_ms is not None:
                    with contextlib.suppress(psycopg.Error):
                        await conn.execute("SET statement_timeout = 0")
        if row is not None:
            return row[0]
    async with tl.span("charge"):
        charge_id = await charge(body["customer"], body["amount_cents"])
    async with tl.span("INSERT"), pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
            (body["customer"], body["amount_cents"], charge_id),
        )
        (order_id,) = await cur.fetchone()
        response = order_response(order_id, body, charge_id)
        await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash, status, response) VALUES (%s, %s, 'done', %s)",
            (idempotency_key, request_hash(body), Jsonb(response)),
        )
    return response


async def create_order_claimed(
    pool, idempotency_key: str, body: dict, charge, *, timeline: Timeline | None = None
):
    """The reference :func:`create_order`, instrumented for the same timeline plot."""
    tl = timeline or _NO_TIMELINE
    req_hash = request_hash(body)
    async with tl.span("INSERT claim"):
        claimed = await claim(pool, idempotency_key, req_hash, body)
    if not claimed:
        async with tl.span("read stored"):
            return await stored_response(pool, idempotency_key, req_hash)
    try:
        async with tl.span("charge"):
            charge_id = await charge(body["customer"], body["amount_cents"])
    except Exception:
        await release(pool, idempotency_key)
        raise
    async with tl.span("store response"):
        return await finish_order(pool, idempotency_key, body, charge_id)


async def fire(n: int, make_call: Callable[[int], Awaitable]) -> list:
    """Start ``n`` calls at once as tasks named ``req 1`` .. ``req n``; results or exceptions, in order."""
    tasks = [asyncio.create_task(make_call(i), name=f"req {i + 1}") for i in range(n)]
    return await asyncio.gather(*tasks, return_exceptions=True)


def outcome(result) -> str:
    """One short line for what a request got: an order, a stored response or an error."""
    if isinstance(result, BaseException):
        text = str(result).splitlines()[0] if str(result) else ""
        return f"{type(result).__name__}{': ' + text[:70] if text else ''}"
    if isinstance(result, dict) and "order_id" in result:
        return f"order {result['order_id']} (charge {result.get('charge_id')})"
    return repr(result)


async def charges_in_burst(pool, handler, n: int, *, gap: float = 0.0, delay: float = 0.05) -> int:
    """How many times the card is charged when ``n`` requests with one key arrive ``gap`` s apart.

    ``handler`` is a ``create_order``-shaped function; requests that get 409 retry (real sleeps).
    """
    card = Card(delay=delay)
    key = f"burst-{time.perf_counter_ns()}"
    body = {"customer": key, "amount_cents": 100}

    async def one(i: int):
        await asyncio.sleep(i * gap)
        return await call_with_retry(lambda: handler(pool, key, body, card.charge), base_delay=0.02)

    await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    return len(card.charged)


def plot_timeline(timeline: Timeline, title: str, ax=None):
    """A Gantt chart of the spans: one lane per request, one colour per step."""
    if ax is None:
        _, ax = figure(8, 3.6)
    lanes = sorted(
        {lane for lane, *_ in timeline.spans}, key=lambda s: int(s.split()[-1]) if s[-1].isdigit() else 0
    )
    colours = {
        "SELECT key": "#2e86c1",
        "INSERT claim": "#2e86c1",
        "charge": "#c0392b",
        "INSERT": "#27ae60",
        "store response": "#27ae60",
        "read stored": "#8e44ad",
    }
    seen = set()
    for lane, step, start, end in timeline.spans:
        y = lanes.index(lane)
        label = step if step not in seen else None
        seen.add(step)
        ax.barh(
            y,
            (end - start) * 1000,
            left=start * 1000,
            color=colours.get(step, "grey"),
            label=label,
            height=0.6,
        )
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first request")
    ax.set_title(title, fontsize=10)
    legend_outside(ax, "below", ncols=4)
    return ax


def plot_window(gaps_ms, naive, claimed, sizes, naive_n, claimed_n):
    """Charges for two requests ``gap`` ms apart, and per burst size: check-then-act against the claim."""
    fig, (a, b) = figure(12, 3.4, ncols=2)
    a.plot(gaps_ms, naive, "o-", color=COLORS["bad"], label="check, then act")
    a.plot(gaps_ms, claimed, "s--", color=COLORS["ok"], label="claim first")
    a.axvline(50, color=COLORS["neutral"], linestyle=":", label="the charge takes 50 ms")
    a.set(xlabel="second request arrives after (ms)", ylabel="charges", yticks=[0, 1, 2], ylim=(-0.2, 2.4))
    a.set_title("2 requests, one key", fontsize=10)
    legend_outside(a, "below", ncols=2)
    width = 0.38
    xs = range(len(sizes))
    b.bar([x - width / 2 for x in xs], naive_n, width, color=COLORS["bad"], label="check, then act")
    b.bar([x + width / 2 for x in xs], claimed_n, width, color=COLORS["ok"], label="claim first")
    b.set_xticks(list(xs), [str(n) for n in sizes])
    b.set(xlabel="concurrent requests with one key", ylabel="charges")
    b.set_title("charges per burst", fontsize=10)
    legend_outside(b, "below", ncols=2)
    return fig


# ----------------------------------------------------------------------------- the other correct design


async def create_order_one_transaction(pool, idempotency_key: str, body: dict, charge) -> dict:
    """The other correct design: claim, charge and store in one transaction.

    A concurrent caller's INSERT waits on the unique index until the first commits (then
    it conflicts and reads the stored response) or rolls back (then it claims the key
    itself). No 409 while the first runs, but a connection and a transaction stay open
    across the charge. An uncertain failure must still leave the claim behind, so the
    transaction commits the pending row before the error goes up; a decline rolls it back.
    """
    req_hash = request_hash(body)
    uncertain: Exception | None = None
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash, request) VALUES (%s, %s, %s) "
            "ON CONFLICT (key) DO NOTHING RETURNING key",
            (idempotency_key, req_hash, Jsonb(body)),
        )
        if await cur.fetchone() is None:  # the first caller committed: read what it left
            cur = await conn.execute(
                "SELECT request_hash, status, response FROM idempotency_keys WHERE key = %s",
                (idempotency_key,),
            )
            stored_hash, status, response = await cur.fetchone()
            if stored_hash != req_hash:
                raise IdempotencyKeyReused(idempotency_key)
            if status != "done":
                raise RequestInProgress(idempotency_key)
            return response
        try:
            charge_id = await charge(body["customer"], body["amount_cents"])
        except ChargeDeclined:
            raise  # the transaction rolls back: the key is free again
        except Exception as err:  # noqa: BLE001 - uncertain: commit the pending claim, then raise
            uncertain = err
        else:
            cur = await conn.execute(
                "INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                (body["customer"], body["amount_cents"], charge_id),
            )
            (order_id,) = await cur.fetchone()
            response = order_response(order_id, body, charge_id)
            cur = await conn.execute(
                "UPDATE idempotency_keys SET status = 'done', response = %s WHERE key = %s RETURNING response",
                (Jsonb(response), idempotency_key),
            )
            (stored,) = await cur.fetchone()
    if uncertain is not None:
        raise uncertain
    return stored


def make_locked_create_order():
    """One replica of a service whose ``create_order`` guards check-then-insert with a per-key
    ``asyncio.Lock`` (a typical mistake). Each call makes a new replica with its own locks:
    correct inside one process, and two replicas charge twice.
    """
    locks: dict[str, asyncio.Lock] = {}

    async def create_order(pool, idempotency_key: str, body: dict, charge) -> dict:
        async with locks.setdefault(idempotency_key, asyncio.Lock()):
            async with pool.connection() as conn:
                cur = await conn.execute(
                    "SELECT response FROM idempotency_keys WHERE key = %s", (idempotency_key,)
                )
                row = await cur.fetchone()
            if row is not None:
                return row[0]
            charge_id = await charge(body["customer"], body["amount_cents"])
            async with pool.connection() as conn, conn.transaction():
                cur = await conn.execute(
                    "INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                    (body["customer"], body["amount_cents"], charge_id),
                )
                (order_id,) = await cur.fetchone()
                response = order_response(order_id, body, charge_id)
                await conn.execute(
                    "INSERT INTO idempotency_keys (key, request_hash, status, response) VALUES (%s, %s, 'done', %s) "
                    "ON CONFLICT (key) DO NOTHING",
                    (idempotency_key, request_hash(body), Jsonb(response)),
                )
            return response

    return create_order


# ----------------------------------------------------------------------------- client-generated ids


async def create_client_order(pool, order_id: str, body: dict) -> dict:
    """Client-generated id: the id is the key. A repeat is a no-op; a different body is 422."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO client_orders (id, customer, amount_cents) VALUES (%s, %s, %s) "
            "ON CONFLICT (id) DO NOTHING RETURNING id",
            (order_id, body["customer"], body["amount_cents"]),
        )
        created = await cur.fetchone() is not None
        cur = await conn.execute(
            "SELECT customer, amount_cents FROM client_orders WHERE id = %s", (order_id,)
        )
        customer, amount = await cur.fetchone()
    if (customer, amount) != (body["customer"], body["amount_cents"]):
        raise IdempotencyKeyReused(order_id, f"order {order_id} exists with a different body")
    return {"order_id": str(order_id), "customer": customer, "amount_cents": amount, "created": created}


# ----------------------------------------------------------------------------- consumers that credit twice


async def consume_naive(pool, event: dict) -> None:
    """No deduplication at all: every delivery credits again (``balance = balance + amount``)."""
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
            (event["amount_cents"], event["account_id"]),
        )


async def consume_dedup_first(pool, event: dict) -> None:
    """THE BUG (do not copy): record the event id, commit, then credit in a second commit.

    A crash between the two commits loses the credit: the redelivery finds the id
    recorded and skips the event.
    """
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING RETURNING event_id",
            (event["event_id"],),
        )
        if await cur.fetchone() is None:
            return
        await conn.execute(
            "UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
            (event["amount_cents"], event["account_id"]),
        )


async def consume_credit_first(pool, event: dict) -> None:
    """THE BUG (do not copy): credit, commit, then record the event id in a second commit.

    A crash between the two commits doubles the credit: the redelivery finds no record
    and credits again.
    """
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT 1 FROM processed_events WHERE event_id = %s", (event["event_id"],))
        if await cur.fetchone() is not None:
            return
        await conn.execute(
            "UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
            (event["amount_cents"], event["account_id"]),
        )
        await conn.execute(
            "INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT DO NOTHING", (event["event_id"],)
        )


CRASH_POINTS = """
CREATE SEQUENCE IF NOT EXISTS ch03_crash_credit_seq;
CREATE SEQUENCE IF NOT EXISTS ch03_crash_dedup_seq;
SELECT setval('ch03_crash_credit_seq', 1000000), setval('ch03_crash_dedup_seq', 1000000);
CREATE OR REPLACE FUNCTION ch03_crash_point() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- sequences ignore rollbacks, so an armed crash fires exactly once
    IF nextval(TG_ARGV[0]::regclass) = 1 THEN
        RAISE EXCEPTION 'injected crash %: the consumer died here', TG_ARGV[1];
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS ch03_crash_credit ON accounts;
CREATE TRIGGER ch03_crash_credit BEFORE UPDATE ON accounts
    FOR EACH ROW EXECUTE FUNCTION ch03_crash_point('ch03_crash_credit_seq', 'at the credit (UPDATE accounts)');
DROP TRIGGER IF EXISTS ch03_crash_dedup ON processed_events;
CREATE TRIGGER ch03_crash_dedup BEFORE INSERT ON processed_events
    FOR EACH ROW EXECUTE FUNCTION ch03_crash_point('ch03_crash_dedup_seq', 'at the dedup record (INSERT INTO processed_events)');
"""

_CRASH_SEQ = {"credit": "ch03_crash_credit_seq", "dedup": "ch03_crash_dedup_seq"}


async def install_crash_points(conn) -> None:
    """Triggers that make the next credit or dedup insert fail once, when armed (sync-free, async conn)."""
    await conn.execute(CRASH_POINTS)


async def arm_crash(conn, where: str) -> None:
    """Make the next ``UPDATE accounts`` (``where="credit"``) or ``INSERT INTO processed_events``
    (``where="dedup"``) fail once, as if the consumer died at that statement."""
    await conn.execute(f"SELECT setval('{_CRASH_SEQ[where]}', 1, false)")


async def crash_fired(conn, where: str) -> bool:
    """Whether the armed crash at ``where`` has fired since it was armed."""
    cur = await conn.execute(f"SELECT last_value, is_called FROM {_CRASH_SEQ[where]}")
    last, called = await cur.fetchone()
    return bool(called) and last < 1000000


async def deliver(consume, pool, event: dict, *, attempts: int = 5) -> list[str]:
    """At-least-once delivery: redeliver ``event`` until ``consume`` returns (a failure is a nack).

    Returns what each attempt did ("ok" or the error), like a broker's delivery log.
    """
    log = []
    for _ in range(attempts):
        try:
            await consume(pool, event)
        except Exception as err:  # noqa: BLE001 - a failed delivery is redelivered
            log.append(f"{type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        log.append("ok")
        break
    return log


# ----------------------------------------------------------------------------- two sessions


async def insert_wait_demo(database_url: str, *, first_finishes: str = "commit") -> dict:
    """Two sessions insert the same key; what does the second wait on?

    Session A inserts key 'k' and keeps its transaction open. Session B runs
    ``INSERT ... ON CONFLICT DO NOTHING`` for 'k' and blocks. The result holds B's
    pg_stat_activity wait, the pg_locks rows involved, what B got once A finished
    (``first_finishes`` is "commit" or "rollback") and how long B waited.
    """
    a = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    b = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    watch = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    try:
        await a.execute("DELETE FROM idempotency_keys WHERE key = 'k'")
        await a.execute("BEGIN")
        await a.execute("INSERT INTO idempotency_keys (key, request_hash) VALUES ('k', 'A')")
        a_pid, b_pid = a.info.backend_pid, b.info.backend_pid

        async def b_insert():
            t0 = time.perf_counter()
            cur = await b.execute(
                "INSERT INTO idempotency_keys (key, request_hash) VALUES ('k', 'B') "
                "ON CONFLICT (key) DO NOTHING RETURNING key"
            )
            return await cur.fetchone(), time.perf_counter() - t0

        task = asyncio.create_task(b_insert())
        activity = None
        for _ in range(500):
            cur = await watch.execute(
                "SELECT wait_event_type, wait_event, pg_blocking_pids(pid) FROM pg_stat_activity WHERE pid = %s",
                (b_pid,),
            )
            activity = await cur.fetchone()
            if activity and activity[0] == "Lock":
                break
            await asyncio.sleep(0.002)
        cur = await watch.execute(
            """
            SELECT l.pid, CASE l.pid WHEN %s THEN 'A' WHEN %s THEN 'B' END AS session,
                   l.locktype, l.mode, l.granted, l.transactionid::text
            FROM pg_locks l
            WHERE l.pid IN (%s, %s) AND l.locktype IN ('transactionid')
            ORDER BY session, l.granted DESC
            """,
            (a_pid, b_pid, a_pid, b_pid),
        )
        locks = await cur.fetchall()
        await a.execute(first_finishes.upper())
        returned, waited = await task
        return {
            "a_pid": a_pid,
            "b_pid": b_pid,
            "b_wait": activity,
            "locks": locks,
            "b_returned": returned,
            "b_waited_s": waited,
        }
    finally:
        for c in (a, b, watch):
            await c.close()
