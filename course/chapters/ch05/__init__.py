"""Chapter 05's demos: messages under failure, measured live on Redis Streams and PostgreSQL.

Only chapter 05's notebook, checks and tests import this package. The patterns live in
:mod:`course.messaging`; here are the runs that show why they are needed: real errors to
classify, consumer processes killed with SIGKILL (ack before vs after the work;
:mod:`course.chapters.ch05.crash_worker`), the five orders of two messages, head-of-line
blocking per ordering scope, a retry queue that reorders, throttled replay, and Dramatiq (a
production task queue) on the same Redis. What breaks when a consumer is replaced, killed by a
message or starved by an outage is in :mod:`course.chapters.ch05.failover`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from course import messaging as mq
from course.backoff import FullJitter
from course.kit import stats
from course.retry import RetryPolicy, RetryState, retry_call

#: The killed consumers of :func:`kill_runs`, run as a file: it imports only redis and psycopg, then forks.
WORKER = Path(__file__).with_name("crash_worker.py")

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
-- the order aggregate of the state-machine demo: created -> paid -> shipped
CREATE TABLE IF NOT EXISTS ch05_orders (
    id    text PRIMARY KEY,
    state text NOT NULL
);
"""


async def setup_schema(pool) -> None:
    """The consumer's tables (:func:`course.messaging.setup_schema`) and the chapter's demo tables."""
    await mq.setup_schema(pool)
    async with pool.connection() as conn:
        await conn.execute(APPLIED_SCHEMA)


async def fresh_stream(pool, redis, stream: str, group: str = "workers") -> tuple[str, str]:
    """Delete ``stream`` and its dead-letter stream, empty the consumer's tables (the demos reuse
    message ids such as A-1), make the group anew."""
    dlq = f"{stream}:dlq"
    lease = mq.lease_key(stream, group)
    await redis.delete(stream, dlq, lease, f"{lease}:fence")
    async with pool.connection() as conn:
        await conn.execute(
            "TRUNCATE ch05_applied, mq_parked, mq_blocked_keys, mq_processed, mq_fence, ch05_orders"
        )
    await mq.ensure_group(redis, stream, group)
    return stream, dlq


async def publish(redis, stream: str, specs, *, body=None) -> list[str]:
    """XADD one message per ``(key, seq)``; the id is ``"<key>-<seq>"``."""
    ids = []
    for key, seq in specs:
        ids.append(await redis.xadd(stream, mq.make_message(f"{key}-{seq}", key, "event", seq, body)))
    return ids


async def applied(pool, stream: str) -> list[str]:
    """Message ids the demo handlers committed on ``stream``, in commit order."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT message_id FROM ch05_applied WHERE stream = %s ORDER BY n", (stream,)
        )
        return [m for (m,) in await cur.fetchall()]


def recorder(stream: str, *, fail: dict | None = None, poison: set | None = None, consumer: str = "demo"):
    """A handler that records each message in ``ch05_applied``; ``fail[id]`` transient failures
    first (a 503), and the ids in ``poison`` fail permanently."""
    fail = dict(fail or {})
    poison = set(poison or ())

    async def handle(conn, fields) -> None:
        mid = fields["id"]
        if mid in poison:
            raise mq.MalformedMessage(f"{mid}: body is not valid JSON")
        if fail.get(mid, 0) > 0:
            fail[mid] -= 1
            raise mq.TransientError(f"{mid}: inventory service answered 503")
        await conn.execute(
            "INSERT INTO ch05_applied (stream, message_id, key, seq, consumer) VALUES (%s, %s, %s, %s, %s)",
            (stream, mid, fields["key"], int(fields["seq"]), consumer),
        )

    return handle


# ----------------------------------------------------------------------------- errors, live


async def live_errors(database_url: str) -> list[tuple[str, BaseException]]:
    """Real errors a consumer meets: from PostgreSQL, from an HTTP dependency, from bad messages."""
    from course.kit.faults import http_errors

    out: list[tuple[str, BaseException]] = []
    for step, err in await http_errors(
        ("429", "503", "502", "504", "reset", "400", "404", "422"), timeout=0.3
    ):
        out.append((f"HTTP dependency: {step}", err))
    try:
        await asyncio.wait_for(asyncio.sleep(1), 0.01)
    except TimeoutError as err:
        out.append(("a call past its deadline", err))
    a = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    b = await psycopg.AsyncConnection.connect(database_url, autocommit=True)
    try:
        await a.execute("CREATE TEMP TABLE IF NOT EXISTS _x (id int)")
        await b.execute("CREATE TABLE IF NOT EXISTS ch05_stock (id int PRIMARY KEY, n int)")
        await b.execute("INSERT INTO ch05_stock VALUES (1, 10) ON CONFLICT (id) DO UPDATE SET n = 10")
        await a.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        await a.execute("SELECT n FROM ch05_stock WHERE id = 1")
        await b.execute("UPDATE ch05_stock SET n = n - 1 WHERE id = 1")  # commits in between
        try:
            await a.execute("UPDATE ch05_stock SET n = n - 1 WHERE id = 1")
        except psycopg.Error as err:
            out.append(("PostgreSQL: concurrent update (REPEATABLE READ)", err))
        await a.execute("ROLLBACK")
        try:
            await a.execute("INSERT INTO mq_blocked_keys (stream, key) VALUES ('s', 'k')")
        except psycopg.Error as err:
            out.append(("PostgreSQL: a required column missing", err))
    finally:
        await a.close()
        await b.close()
    try:
        json.loads("{'amount': 25")
    except ValueError as err:
        out.append(("body is not JSON", err))
    try:
        {"id": "m-1"}["amount"]  # noqa: B018 - the lookup is the point
    except KeyError as err:
        out.append(("required field missing", err))
    out.append(("schema version 9 of 'paid'", mq.UnsupportedSchema("schema 9 is not supported (1-2 are)")))
    out.append(("ship an unpaid order", mq.BusinessRuleViolation("order-91 is 'created', cannot ship")))
    return out


async def wasted_on_permanent(attempts: int = 5) -> dict:
    """Retry a malformed message as if every error were transient, then classified (virtual time)."""
    from course.kit.faults import VirtualClock

    out = {}
    for name, retryable in (("retry everything", lambda err: True), ("classify first", mq.is_transient)):
        clock = VirtualClock()
        calls = 0

        async def handler() -> None:
            nonlocal calls
            calls += 1
            raise mq.MalformedMessage("body is not valid JSON")

        policy = RetryPolicy(attempts, None, FullJitter(0.1, 2.0), retryable)
        state = RetryState()
        try:
            await retry_call(
                handler, policy, clock=clock, sleep=clock.sleep, rand=random.Random(5).random, state=state
            )
        except mq.MalformedMessage:
            pass
        out[name] = {"calls": calls, "waited_s": round(clock(), 3), "gave_up": state.gave_up}
    return out


# ----------------------------------------------------------------------------- a consumer process, killed


@dataclass
class CrashRun:
    ack: str
    hang_at: str
    pending_after_kill: list = field(default_factory=list)
    applied_before_kill: list = field(default_factory=list)
    applied_after_takeover: list = field(default_factory=list)
    takeover: Counter = field(default_factory=Counter)
    seconds: float = 0.0


CRASHES = (("last", "before commit"), ("first", "before commit"), ("last", "after commit"))


async def kill_runs(ns, pool, redis, stream: str, cases=CRASHES) -> list[CrashRun]:
    """For each ``(ack, hang_at)``: a consumer process reads M-1 .. M-4 one at a time and is killed
    with SIGKILL while it holds M-2 (``hang_at`` "before commit" or "after commit"; it acks ``ack`` =
    "first" or "last"); then a second consumer takes over.

    Each case has its stream (``<stream>:<n>``) and its id prefix (``"<n>/M-1"``; the lists in the
    results leave it out). One process imports the clients and forks the killed consumers
    (:mod:`course.chapters.ch05.crash_worker`)."""
    await fresh_stream(pool, redis, stream)
    cfgs = []
    for n, (ack, hang_at) in enumerate(cases):
        s = f"{stream}:{n}"
        await redis.delete(s, f"{s}:dlq", f"{s}:marker", mq.lease_key(s, "workers"))
        await mq.ensure_group(redis, s, "workers")
        for seq in range(1, 5):
            await redis.xadd(s, mq.make_message(f"{n}/M-{seq}", "M", "event", seq))
        cfgs.append(
            {"redis_url": ns.redis_url, "database_url": ns.database_url, "stream": s, "group": "workers",
             "consumer": "worker-1", "ack": ack, "hang_at": hang_at, "hang_on": f"{n}/M-2", "marker": f"{s}:marker",
             "owner": os.getpid()}
        )  # fmt: skip
    proc = await asyncio.create_subprocess_exec(sys.executable, str(WORKER), *map(json.dumps, cfgs))
    runs = []
    try:
        for n, (ack, hang_at) in enumerate(cases):
            runs.append(
                await _kill_and_take_over(pool, redis, proc, cfgs[n], CrashRun(ack, hang_at), f"{n}/")
            )
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    return runs


async def _kill_and_take_over(pool, redis, proc, cfg: dict, run: CrashRun, prefix: str) -> CrashRun:
    t0 = time.perf_counter()
    stream = cfg["stream"]
    pid = None
    for _ in range(1000):
        pid = await redis.get(cfg["marker"])
        if pid or proc.returncode is not None:
            break
        await asyncio.sleep(0.02)
    if pid:
        os.kill(int(pid), signal.SIGKILL)  # no clean-up, no rollback from the process itself
        while _alive(int(pid)):  # until its parent has reaped it
            await asyncio.sleep(0.005)
    await asyncio.sleep(0.06)  # the connection is gone; PostgreSQL rolls back its transaction

    async def done() -> list[str]:
        return [m.removeprefix(prefix) for m in await applied(pool, stream)]

    run.applied_before_kill = await done()
    run.pending_after_kill = await redis.xpending_range(stream, "workers", "-", "+", 10)
    run.takeover = await mq.ordered_consumer(
        pool, redis, recorder(stream, consumer="worker-2"), stream=stream, group="workers", consumer="worker-2",
        dlq=f"{stream}:dlq",
    )  # fmt: skip
    run.applied_after_takeover = await done()
    run.seconds = time.perf_counter() - t0
    return run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def kill_mid_message(ns, pool, redis, *, ack: str, hang_at: str, stream: str) -> CrashRun:
    """One case of :func:`kill_runs`."""
    (run,) = await kill_runs(ns, pool, redis, stream, [(ack, hang_at)])
    return run


# ----------------------------------------------------------------------------- five orders


async def five_orders(pool, redis, stream: str, *, ordered: bool) -> dict[str, dict[str, float]]:
    """Publish A-1 then A-2 (one key). A-1's handler takes 40 ms, A-2's 5 ms. Record when each
    was published, delivered, started, finished and committed (ms since the first publish).

    ``ordered=False``: both are handled at once (a worker pool with no notion of key).
    ``ordered=True``: :func:`course.messaging.ordered_consumer`, one key one lane."""
    stream, dlq = await fresh_stream(pool, redis, stream)
    t0 = time.perf_counter()
    ms = lambda: (time.perf_counter() - t0) * 1000  # noqa: E731
    marks: dict[str, dict[str, float]] = {"A-1": {}, "A-2": {}}
    for seq in (1, 2):
        await redis.xadd(stream, mq.make_message(f"A-{seq}", "A", "event", seq))
        marks[f"A-{seq}"]["publish"] = ms()
    record = recorder(stream)

    async def handle(conn, fields) -> None:
        mid = fields["id"]
        marks[mid].setdefault("start", ms())
        await asyncio.sleep(0.04 if mid == "A-1" else 0.005)
        await record(conn, fields)
        marks[mid]["finish"] = ms()

    if ordered:

        def log(event: dict) -> None:
            stage = {"delivered": "deliver", "applied": "commit"}.get(event["event"])
            if stage:
                marks[event["message_id"]][stage] = ms()

        await mq.ordered_consumer(
            pool, redis, handle, stream=stream, group="workers", consumer="c", dlq=dlq, log=log
        )
        return marks

    reply = await redis.xreadgroup("workers", "c", {stream: ">"}, count=10)
    entries = reply[0][1]
    for _, fields in entries:
        marks[fields["id"]]["deliver"] = ms()

    async def one(entry_id: str, fields: dict) -> None:
        async with pool.connection() as conn:
            async with conn.transaction():
                await handle(conn, fields)
            marks[fields["id"]]["commit"] = ms()
        await redis.xack(stream, "workers", entry_id)

    await asyncio.gather(*(one(e, f) for e, f in entries))
    return marks


ORDERS = ("publish", "deliver", "start", "finish", "commit")


def plot_five_orders(runs: dict[str, dict], ax=None):
    """Per run, one row per message: a dot per stage (publish ... commit), the handler as a bar."""
    from course.kit import plotting

    if ax is None:
        _, ax = plotting.figure(9, 2.8)
    colors = {
        "publish": "#7f8c8d",
        "deliver": "#8e44ad",
        "start": "#2980b9",
        "finish": "#f39c12",
        "commit": "#27ae60",
    }
    rows = []
    for title, marks in runs.items():
        for mid in ("A-1", "A-2"):
            rows.append((f"{title}: {mid}", marks[mid]))
    for y, (_, m) in enumerate(rows):
        ax.barh(y, m["finish"] - m["start"], left=m["start"], color="#d6eaf8", height=0.5)
        for stage in ORDERS:
            ax.plot(m[stage], y, "o", color=colors[stage], label=stage if y == 0 else None, ms=6)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since A-1 was published")
    ax.set_title("Five orders of two messages of one key (bar: the handler running)")
    plotting.legend_outside(ax)
    return ax


# ----------------------------------------------------------------------------- head-of-line blocking


async def head_of_line(pool, redis, stream: str, scope: str, *, keys: int = 4, per_key: int = 8) -> dict:
    """One poison message (K0-1: a 503 on every attempt) at the head of a stream of ``keys`` keys.

    ``scope``: "global" (one FIFO), "partitions" (3 lanes by crc32), "key". Returns when each
    message was committed (s after the start) and what happened to each (applied, parked, dead).
    """
    stream, dlq = await fresh_stream(pool, redis, stream)
    specs = [(f"K{k}", s) for s in range(1, per_key + 1) for k in range(keys)]
    await publish(redis, stream, specs)
    lane_of = {"global": mq.one_lane, "partitions": mq.by_partition(3), "key": mq.by_key}[scope]
    policy = RetryPolicy(4, None, FullJitter(0.04, 0.3), mq.is_transient)
    t0 = time.perf_counter()
    done: dict[str, float] = {}
    status: dict[str, str] = {}

    def log(event: dict) -> None:
        if event["event"] in ("applied", "parked", "dead"):
            status[event["message_id"]] = event["event"]
            done[event["message_id"]] = time.perf_counter() - t0

    await mq.ordered_consumer(
        pool,
        redis,
        recorder(stream, fail={"K0-1": 99}),
        stream=stream,
        group="workers",
        consumer="c",
        dlq=dlq,
        policy=policy,
        lane_of=lane_of,
        log=log,
    )
    lanes = {f"K{k}": lane_of({"key": f"K{k}"}) for k in range(keys)}
    healthy = [done[m] for m in done if status[m] == "applied"]
    return {
        "scope": scope,
        "done": done,
        "status": status,
        "lanes": lanes,
        "counts": dict(Counter(status.values())),
        "healthy_latency": stats.summary([x * 1000 for x in healthy]) if healthy else "none applied",
        "metrics": await mq.metrics(pool, redis, stream=stream, group="workers", dlq=dlq),
    }


def plot_head_of_line(results: list[dict], ax=None):
    """When each message finished, one row per key and scope: applied (dot), parked (x), dead (square)."""
    from course.kit import plotting

    if ax is None:
        _, ax = plotting.figure(9, 3.6)
    style = {
        "applied": ("o", plotting.COLORS["ok"]),
        "parked": ("x", plotting.COLORS["warn"]),
        "dead": ("s", plotting.COLORS["bad"]),
    }
    ticks, labels, seen, y = [], [], set(), 0.0
    for res in results:
        for key in sorted({m.split("-")[0] for m in res["status"]}):
            for mid, state in res["status"].items():
                if mid.split("-")[0] == key:
                    marker, color = style[state]
                    label = state if state not in seen else None
                    ax.plot(res["done"][mid] * 1000, y, marker, color=color, ms=6, label=label)
                    seen.add(state)
            ticks.append(y)
            labels.append(f"{res['scope']}: {key} (lane {res['lanes'][key]})")
            y += 1
        y += 0.6
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms after the consumer started (each message applied, parked or dead-lettered)")
    ax.set_title("One poison message (K0-1) under three ordering scopes")
    plotting.legend_outside(ax)
    return ax


# ----------------------------------------------------------------------------- a retry queue reorders


async def retry_queue_consumer(
    pool, redis, handle, *, stream: str, group: str = "workers", delay: float = 0.05
):
    """THE BUG (do not copy): a failed message goes to a separate retry stream and the main
    stream moves on; a retry worker re-drives it after ``delay``. Fine for independent
    messages; for one key, its later messages commit before it."""
    retry = f"{stream}:retry"
    await redis.delete(retry)

    async def attempt(fields) -> bool:
        try:
            async with pool.connection() as conn, conn.transaction():
                await handle(conn, fields)
            return True
        except Exception:  # noqa: BLE001 - the point: hand it to the retry stream and move on
            return False

    while reply := await redis.xreadgroup(group, "main", {stream: ">"}, count=100):
        for entry_id, fields in reply[0][1]:
            if not await attempt(fields):
                await redis.xadd(retry, fields)
            await redis.xack(stream, group, entry_id)
    await asyncio.sleep(delay)
    for _ in range(5):
        entries = await redis.xrange(retry)
        if not entries:
            break
        for entry_id, fields in entries:
            await redis.xdel(retry, entry_id)
            if not await attempt(fields):
                await redis.xadd(retry, fields)
        await asyncio.sleep(delay)


async def reorder_demo(pool, redis, stream: str) -> dict[str, list[str]]:
    """A-1 fails once (503); A-2, A-3 are fine. The commit order under a retry queue and under
    the per-key ordered consumer."""
    out = {}
    for name in ("retry queue", "per-key lanes"):
        s, dlq = await fresh_stream(pool, redis, f"{stream}:{name.replace(' ', '-')}")
        await publish(redis, s, [("A", 1), ("B", 1), ("A", 2), ("A", 3)])
        handle = recorder(s, fail={"A-1": 1})
        if name == "retry queue":
            await retry_queue_consumer(pool, redis, handle, stream=s)
        else:
            policy = RetryPolicy(4, None, FullJitter(0.02, 0.2), mq.is_transient)
            await mq.ordered_consumer(
                pool, redis, handle, stream=s, group="workers", consumer="c", dlq=dlq, policy=policy
            )
        out[name] = [m for m in await applied(pool, s) if m.startswith("A-")]
    return out


# ----------------------------------------------------------------------------- the order state machine

TRANSITIONS = {"created": None, "paid": "created", "shipped": "paid"}


def order_handler(stream: str, *, flaky: dict | None = None, schemas: tuple[str, ...] = ("1", "2")):
    """Apply order events to ``ch05_orders``: created -> paid -> shipped. A step out of order is a
    :class:`BusinessRuleViolation`, a schema not in ``schemas`` an :class:`UnsupportedSchema` (both
    permanent); ``flaky[id]`` transient failures first."""
    flaky = dict(flaky or {})
    record = recorder(stream)

    async def handle(conn, fields) -> None:
        mid, order, event = fields["id"], fields["key"], fields["type"]
        if fields.get("schema") not in schemas:
            raise mq.UnsupportedSchema(f"{mid}: schema {fields.get('schema')} is not supported")
        if flaky.get(mid, 0) > 0:
            flaky[mid] -= 1
            raise mq.TransientError(f"{mid}: payment service answered 503")
        cur = await conn.execute("SELECT state FROM ch05_orders WHERE id = %s FOR UPDATE", (order,))
        row = await cur.fetchone()
        state = row[0] if row else None
        if state != TRANSITIONS.get(event, "?"):
            raise mq.BusinessRuleViolation(f"{mid}: order {order} is {state!r}, cannot apply {event!r}")
        await conn.execute(
            "INSERT INTO ch05_orders (id, state) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET state = excluded.state",
            (order, event),
        )
        await record(conn, fields)

    return handle


async def order_states(pool, keys) -> dict[str, str]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT id, state FROM ch05_orders WHERE id = ANY(%s) ORDER BY id", (list(keys),)
        )
        return dict(await cur.fetchall())


async def publish_orders(redis, stream: str, events) -> None:
    """XADD ``(order, seq, type)`` events; ``schema`` 1, ids ``"<order>-<seq>"``."""
    for order, seq, kind, *schema in events:
        fields = mq.make_message(
            f"{order}-{seq}", order, kind, seq, {"order": order}, schema=schema[0] if schema else 1
        )
        await redis.xadd(stream, fields)


# ----------------------------------------------------------------------------- Dramatiq beside the port


def dramatiq_demo(redis_url: str, namespace: str) -> dict:
    """Dramatiq on the same Redis: A-1 fails twice (transient), A-2 and A-3 are fine, P-1 fails
    every time, V-1 raises a permanent error (``throws=``). What order commits, what it retried,
    what lands in its dead-letter set."""
    import logging

    import dramatiq
    import redis as redis_sync
    from dramatiq import Worker
    from dramatiq.brokers.redis import RedisBroker

    logging.getLogger("dramatiq").setLevel(logging.CRITICAL)
    broker = RedisBroker(url=redis_url, namespace=namespace)
    committed: list[str] = []
    attempts: Counter = Counter()

    def handle(mid: str, fail_times: int) -> None:
        attempts[mid] += 1
        if mid == "V-1":
            raise mq.UnsupportedSchema(f"{mid}: schema 9")
        if attempts[mid] <= fail_times:
            raise TimeoutError(f"{mid}: attempt {attempts[mid]} timed out")
        committed.append(mid)

    actor = dramatiq.actor(
        handle,
        broker=broker,
        actor_name="ch05_handle",
        max_retries=3,
        min_backoff=20,
        max_backoff=200,
        throws=(mq.PermanentError,),
    )
    broker.flush_all()  # its queues, delay queues and dead letters from an earlier run
    t0 = time.perf_counter()
    for mid, fail_times in (("A-1", 2), ("A-2", 0), ("A-3", 0), ("P-1", 99), ("V-1", 0), ("B-1", 0)):
        actor.send(mid, fail_times)
    worker = Worker(broker, worker_threads=1, worker_timeout=20)
    worker.start()
    try:
        broker.join("default", timeout=20_000)
    finally:
        worker.stop()
    seconds = time.perf_counter() - t0
    client = redis_sync.Redis.from_url(redis_url, decode_responses=True)
    try:
        dead = []
        for raw in client.hgetall(f"{namespace}:default.XQ.msgs").values():
            msg = json.loads(raw)
            dead.append((msg["args"][0], msg["options"].get("retries", 0)))
    finally:
        client.close()
        broker.close()
    return {"committed": committed, "attempts": dict(attempts), "dead": sorted(dead), "seconds": seconds}


# ----------------------------------------------------------------------------- throttled replay


async def throttled_replay(pool, redis, stream: str, *, keys: int = 6, per_second: float = 20.0) -> dict:
    """``keys`` keys each blocked by a malformed first message (two parked behind it); the bug is
    fixed, and :func:`course.messaging.replay_blocked` re-drives them at ``per_second`` keys/s."""
    stream, dlq = await fresh_stream(pool, redis, stream)
    poison = {f"R{k}-1" for k in range(keys)}
    await publish(redis, stream, [(f"R{k}", s) for s in range(1, 4) for k in range(keys)])
    await mq.ordered_consumer(
        pool, redis, recorder(stream, poison=poison), stream=stream, group="workers", consumer="c", dlq=dlq
    )
    before = await mq.metrics(pool, redis, stream=stream, group="workers", dlq=dlq)
    t0 = time.perf_counter()
    done = await mq.replay_blocked(
        pool, redis, recorder(stream), stream=stream, dlq=dlq, per_second=per_second
    )
    seconds = time.perf_counter() - t0
    after = await mq.metrics(pool, redis, stream=stream, group="workers", dlq=dlq)
    order = await applied(pool, stream)
    in_order = all(
        [m for m in order if m.startswith(f"R{k}-")] == [f"R{k}-{s}" for s in range(1, 4)]
        for k in range(keys)
    )
    return {"before": before, "after": after, "replayed": done, "seconds": seconds, "in_order": in_order}


# The claims each run above supports, kept in a module of their own (this one is about the runs)
from course.chapters.ch05 import claims as _claims  # noqa: E402

five_orders_claim = _claims.five_orders_claim
head_of_line_claims = _claims.head_of_line_claims
kill_claims = _claims.kill_claims
order_claims = _claims.order_claims
order_of = _claims.order_of
