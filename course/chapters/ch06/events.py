"""Chapter 06's event demos: the dual write, the outbox, the relay's ordering trap, relay latency.

- :func:`place_order_dual_write` and :func:`place_order_publish_first`: the two orders of a
  dual write, each losing or inventing an event when the second write fails.
- :func:`place_order_outbox`: the outbox version (the order and its event in one transaction).
- :func:`relay_skip_locked`: the plain polling relay, correct alone, out of order per
  aggregate when two run at once (the trap); :func:`ordering_race` makes that happen every
  time by holding the first relay's publish (:class:`RedisProbe`) until the second is done.
- :func:`relay_latency`: end-to-end latency of a polling relay against its interval, and of
  :func:`relay_listening`, a relay that ``NOTIFY`` wakes (the interval is its fallback).
- :func:`ledger_consumer`: a downstream consumer that credits a revenue account once per
  event id, through chapter 03's :func:`course.idempotency.consume_payment_event`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict

import psycopg
import redis.exceptions
from psycopg import sql

from course import idempotency, outbox
from course.kit.lab import LOCK_WAITERS

# ----------------------------------------------------------------------------- placing an order


async def place_order_outbox(pool, order: dict) -> int:
    """The order row and its ``OrderPlaced`` event in one transaction; the event id."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
            (order["order_id"], order["customer"], order["amount_cents"]),
        )
        return await outbox.enqueue(conn, "order", order["order_id"], "OrderPlaced", order)


async def order_event(pool, order_id: str, status: str, event_type: str) -> int:
    """A later event of an order (paid, shipped): update the row, then insert its event, one transaction.

    The row's update comes first, so two writers of one order are serialized by its row
    lock and the ids of one order's events follow their commit order.
    """
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("UPDATE ch06_orders SET status = %s WHERE order_id = %s", (status, order_id))
        return await outbox.enqueue(
            conn, "order", order_id, event_type, {"order_id": order_id, "status": status}
        )


def _event(order: dict) -> dict[str, str]:
    return {"aggregate_id": order["order_id"], "event_type": "OrderPlaced", "payload": json.dumps(order)}


async def place_order_dual_write(pool, redis, stream: str, order: dict) -> None:
    """THE BUG (do not copy): commit the order, then publish. A failed publish loses the event."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
            (order["order_id"], order["customer"], order["amount_cents"]),
        )
    await redis.xadd(stream, _event(order))


async def place_order_publish_first(pool, redis, stream: str, order: dict) -> None:
    """THE BUG, reversed (do not copy): publish, then commit. A failed commit leaves a phantom event."""
    await redis.xadd(stream, _event(order))
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO ch06_orders (order_id, customer, amount_cents) VALUES (%s, %s, %s)",
            (order["order_id"], order["customer"], order["amount_cents"]),
        )


async def orders_and_events(pool, redis, stream: str, order_ids) -> list[tuple[str, bool, int]]:
    """``[(order_id, row exists, entries in the stream)]``: what each side believes happened."""
    entries = await redis.xrange(stream)
    counts: dict[str, int] = defaultdict(int)
    for _, f in entries:
        counts[f.get("aggregate_id", "")] += 1
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT order_id FROM ch06_orders WHERE order_id = ANY(%s)", (list(order_ids),)
        )
        rows = {r[0] for r in await cur.fetchall()}
    return [(oid, oid in rows, counts[oid]) for oid in order_ids]


# ----------------------------------------------------------------------------- relays


async def relay_skip_locked(pool, redis, stream: str, *, limit: int = 100) -> int:
    """The plain relay: claim the oldest unpublished rows with SKIP LOCKED, publish, mark.

    Correct when one instance runs. Two at once: the second skips the rows the first holds
    and may publish an aggregate's later event before the first publishes its earlier one.
    """
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            f"SELECT {outbox.COLUMNS} FROM outbox WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED",
            (limit,),
        )
        rows = await cur.fetchall()
        await outbox.publish(redis, stream, rows)
        if rows:
            await conn.execute(
                "UPDATE outbox SET published_at = clock_timestamp() WHERE id = ANY(%s)",
                ([r[0] for r in rows],),
            )
    return len(rows)


class RedisProbe:
    """A ``redis.asyncio`` client as a relay sees it, with the check's hands on its publishes.

    Counts XADDs (direct, through ``execute_command`` or a pipeline). With ``hold=True`` the
    first publish waits at a gate (``held`` is set) until :meth:`release`. With
    ``fail_at=n`` the publish that would make the n-th XADD raises a ConnectionError,
    as if Redis went away then. Everything else goes straight to the real client.
    """

    def __init__(self, client, *, hold: bool = False, fail_at: int | None = None) -> None:
        self._client = client
        self.xadds = 0
        self.hold = hold
        self.fail_at = fail_at
        self.failed = False
        self.held = asyncio.Event()
        self._gate = asyncio.Event()
        if not hold:
            self._gate.set()

    def release(self) -> None:
        self._gate.set()

    async def _before(self, n: int) -> None:
        if not self._gate.is_set():
            self.held.set()
            await self._gate.wait()
        if self.fail_at is not None and not self.failed and self.xadds + n >= self.fail_at:
            self.failed = True
            raise redis.exceptions.ConnectionError("Connection closed by server (injected: Redis went away)")

    async def xadd(self, name, fields, *args, **kwargs):
        await self._before(1)
        result = await self._client.xadd(name, fields, *args, **kwargs)
        self.xadds += 1
        return result

    async def execute_command(self, *args, **kwargs):
        n = 1 if args and str(args[0]).upper() == "XADD" else 0
        if n:
            await self._before(1)
        result = await self._client.execute_command(*args, **kwargs)
        self.xadds += n
        return result

    def pipeline(self, transaction: bool = True, shard_hint=None):
        return _PipelineProbe(self, self._client.pipeline(transaction=transaction, shard_hint=shard_hint))

    def __getattr__(self, name):
        return getattr(self._client, name)


class _PipelineProbe:
    def __init__(self, probe: RedisProbe, pipe) -> None:
        self._probe = probe
        self._pipe = pipe
        self._queued = 0

    def xadd(self, *args, **kwargs):
        self._pipe.xadd(*args, **kwargs)
        self._queued += 1
        return self

    async def execute(self, *args, **kwargs):
        n, self._queued = self._queued, 0
        if n:
            await self._probe._before(n)
        result = await self._pipe.execute(*args, **kwargs)
        self._probe.xadds += n
        return result

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self._pipe.reset()

    def __getattr__(self, name):
        attr = getattr(self._pipe, name)
        if callable(attr) and name not in ("reset", "execute_command", "immediate_execute_command"):

            def queued(*args, **kwargs):
                attr(*args, **kwargs)
                return self

            return queued
        return attr


async def settle(watcher, tasks, *, limit: float = 2.0) -> bool:
    """Wait until every task in ``tasks`` is done or blocked on a PostgreSQL lock (``limit`` s at most)."""
    deadline = time.monotonic() + limit
    while True:
        running = sum(not t.done() for t in tasks)
        if not running:
            return True
        cur = await watcher.execute(LOCK_WAITERS)
        if (await cur.fetchone())[0] >= running:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)


async def interleaved_orders(
    pool, aggregates: int = 6, per_aggregate: int = 3, prefix: str = "o"
) -> list[str]:
    """``aggregates`` orders, then their later events round-robin: ids alternate between orders."""
    ids = [f"{prefix}-{i + 1}" for i in range(aggregates)]
    for i, oid in enumerate(ids):
        await place_order_outbox(pool, {"order_id": oid, "customer": f"c{i + 1}", "amount_cents": 1000 + i})
    later = [("paid", "OrderPaid"), ("shipped", "OrderShipped"), ("delivered", "OrderDelivered")]
    for status, kind in later[: per_aggregate - 1]:
        for oid in ids:
            await order_event(pool, oid, status, kind)
    return ids


async def ordering_race(
    pool, watcher, first, second, stream: str, *, limit: int = 4, rounds: int = 30
) -> dict:
    """Two relays at once, the first held at its first publish until the second is done or blocked.

    ``first`` and ``second`` are ``(relay, redis)`` pairs, ``relay(pool, redis, stream, limit=)``.
    Afterwards both keep relaying until the outbox is drained. Returns the stream's entries
    and what each call published.
    """
    (relay_a, redis_a), (relay_b, redis_b) = first, second
    probe_a = RedisProbe(redis_a, hold=True)
    probe_b = RedisProbe(redis_b)
    calls: list[tuple[str, int]] = []

    async def call(name, relay, probe):
        before = probe.xadds
        n = await relay(pool, probe, stream, limit=limit)
        calls.append((name, probe.xadds - before))
        return n

    task_a = asyncio.ensure_future(call("A", relay_a, probe_a))
    held = asyncio.ensure_future(probe_a.held.wait())
    await asyncio.wait([task_a, held], timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
    held.cancel()
    task_b = asyncio.ensure_future(call("B", relay_b, probe_b))
    await settle(watcher, [task_b])
    probe_a.release()
    await asyncio.gather(task_a, task_b, return_exceptions=True)
    for _ in range(rounds):
        got = await asyncio.gather(
            call("A", relay_a, probe_a), call("B", relay_b, probe_b), return_exceptions=True
        )
        if all(g == 0 for g in got if not isinstance(g, BaseException)):
            break
    return {"entries": await probe_a.xrange(stream), "calls": calls}


def per_aggregate(entries) -> dict[str, list[int]]:
    """Event ids per aggregate, in stream order (duplicates kept)."""
    seen: dict[str, list[int]] = defaultdict(list)
    for _, f in entries:
        try:
            seen[f.get("aggregate_id", "?")].append(int(f.get("event_id", -1)))
        except ValueError:
            seen[f.get("aggregate_id", "?")].append(-1)
    return dict(seen)


def inversions(order: dict[str, list[int]]) -> dict[str, list[tuple[int, int]]]:
    """Per aggregate, pairs ``(a, b)`` where event ``b`` reached the stream before the earlier ``a``
    (first deliveries only: a duplicate of an event already delivered is dropped by consumers)."""
    out = {}
    for agg, ids in order.items():
        firsts: list[int] = []
        for i in ids:
            if i not in firsts:
                firsts.append(i)
        bad = [(a, b) for x, b in enumerate(firsts) for a in firsts[x + 1 :] if a < b]
        if bad:
            out[agg] = bad
    return out


# ----------------------------------------------------------------------------- latency of a polling relay


async def relay_listening(
    database_url: str,
    pool,
    redis,
    stream: str,
    *,
    channel: str,
    interval: float,
    stop: asyncio.Event,
    limit: int = 50,
    relay=relay_skip_locked,
) -> int:
    """A relay that ``NOTIFY`` wakes: drain, then sleep until a notification on ``channel`` or
    ``interval`` seconds, whichever comes first. Returns the number of events published.

    ``LISTEN`` runs on a connection of its own, before the first drain, so nothing committed
    in between is missed. A notification is delivered only if the writer's transaction
    commits; one sent while this connection is down is lost, which is why the interval
    stays as a fallback poll.
    """
    total = 0
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as listener:
        await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        while not stop.is_set():
            while (n := await relay(pool, redis, stream, limit=limit)) == limit:  # drain a backlog
                total += n
            total += n
            async for _ in listener.notifies(timeout=interval, stop_after=1):
                pass  # woken by a commit, or the interval passed
    return total


async def relay_latency(
    pool,
    redis,
    stream: str,
    *,
    interval: float,
    events: int = 20,
    gap: float = 0.023,
    notify: str | None = None,
    database_url: str | None = None,
) -> list[float]:
    """Seconds from each event's commit to its arrival in the stream, with a relay polling every
    ``interval``; with ``notify`` (a channel), each writer also sends ``NOTIFY`` in its transaction
    and the relay is :func:`relay_listening` (it needs ``database_url`` for its own connection)."""
    stop = asyncio.Event()

    async def nap(seconds: float) -> None:  # the relay's sleep, cut short when the measurement ends
        try:
            await asyncio.wait_for(stop.wait(), seconds)
        except TimeoutError:
            pass

    if notify:
        relay = asyncio.ensure_future(
            relay_listening(database_url, pool, redis, stream, channel=notify, interval=interval, stop=stop)
        )
    else:
        relay = asyncio.ensure_future(
            outbox.relay_forever(
                pool,
                redis,
                stream,
                interval=interval,
                stop=stop,
                limit=50,
                relay=relay_skip_locked,
                sleep=nap,
            )
        )
    run = f"lat-{interval}-{time.monotonic_ns()}-"  # this call's order ids
    committed: dict[str, float] = {}
    arrived: dict[str, float] = {}
    newest = await redis.xrevrange(stream, count=1)
    last = newest[0][0] if newest else "0-0"  # read everything after this: nothing can slip past

    async def reader():
        nonlocal last
        while len(arrived) < events:
            got = await redis.xread({stream: last}, block=1000, count=100)
            now = time.perf_counter()
            for _, entries in got or []:
                for entry_id, f in entries:
                    last = entry_id
                    key = json.loads(f["payload"]).get("order_id", "")
                    if key.startswith(run):
                        arrived.setdefault(key, now)

    read = asyncio.ensure_future(reader())
    try:
        for i in range(events):
            oid = f"{run}{i}"
            async with pool.connection() as conn, conn.transaction():
                await outbox.enqueue(conn, "order", oid, "OrderPlaced", {"order_id": oid})
                if notify:
                    await conn.execute("SELECT pg_notify(%s, '')", (notify,))  # delivered at COMMIT
            committed[oid] = time.perf_counter()
            await asyncio.sleep(gap)
        await asyncio.wait_for(read, timeout=5 + 2 * interval)
    finally:
        stop.set()
        if notify:  # wake the listening relay now rather than after its interval
            async with pool.connection() as conn:
                await conn.execute("SELECT pg_notify(%s, '')", (notify,))
        read.cancel()
        await asyncio.gather(relay, read, return_exceptions=True)
    # an event can reach the stream before its writer, resumed, has noted the commit time: 0 then
    return [max(0.0, arrived[oid] - committed[oid]) for oid in committed]


async def dead_tuples(pool, table: str = "outbox") -> int:
    """Dead row versions PostgreSQL counts for ``table`` (each marked or deleted outbox row leaves one)."""
    async with pool.connection() as conn:
        await conn.execute("SELECT pg_stat_force_next_flush()")
        cur = await conn.execute("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = %s", (table,))
        row = await cur.fetchone()
    return int(row[0]) if row else 0


# ----------------------------------------------------------------------------- downstream


async def ledger_consumer(pool, redis, stream: str, *, account_id: int, last: str = "0") -> tuple[int, str]:
    """Credit ``account_id`` with each OrderPlaced's amount, once per event id (chapter 03's consumer).

    Reads the stream after ``last``; returns ``(deliveries processed, last entry id)``.
    """
    entries = await redis.xrange(stream, min=f"({last}" if last != "0" else "-")
    for entry_id, f in entries:
        if f.get("event_type") == "OrderPlaced":
            payload = json.loads(f["payload"])
            event = {
                "event_id": f"outbox-{f['event_id']}",
                "account_id": account_id,
                "amount_cents": int(payload["amount_cents"]),
            }
            await idempotency.consume_payment_event(pool, event)
        last = entry_id
    return len(entries), last
