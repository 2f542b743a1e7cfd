"""The consumer of :mod:`course.messaging` (chapter 05): errors and their classes, messages, the
dead-letter entry, the tables, one attempt, one entry's retries, reading the stream, and
:func:`ordered_consumer`. The owner's lease and fencing token are in :mod:`course.messaging.ownership`,
replay and metrics in :mod:`course.messaging.replay`."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import psycopg
from psycopg.types.json import Jsonb

from course.backoff import FullJitter
from course.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, CircuitOpenError
from course.messaging.ownership import LEASE_MS, LeaseLost, check_fence, renew_lease, take_ownership
from course.retry import RetryPolicy, RetryState, is_retryable, retry_call, status_of

Handler = Callable[[psycopg.AsyncConnection, dict], Awaitable[None]]

# ----------------------------------------------------------------------------- errors


class PermanentError(Exception):
    """No retry can fix this message: send it to the dead-letter stream at once."""


class MalformedMessage(PermanentError):
    """The body is not valid JSON, or a required field is missing or has the wrong type."""


class UnsupportedSchema(PermanentError):
    """The message's schema version is one this consumer does not understand."""


class BusinessRuleViolation(PermanentError):
    """The message asks for something the domain forbids (ship an unpaid order)."""


class TransientError(Exception):
    """Worth another try: the cause may go away by itself (an overloaded dependency)."""


class ConsumerKilled(BaseException):
    """The consumer process died here. A BaseException: ``except Exception`` does not catch
    it, so no clean-up code runs, exactly as with a ``kill -9``."""


class DeliveryLimitExceeded(PermanentError):
    """Redis delivered the entry more than ``max_deliveries`` times: every delivery before ended
    without an acknowledgement (the consumer died on it). Dead-lettered without another try."""


#: PostgreSQL errors that a retry of the whole transaction fixes (SQLSTATE 40001, 40P01, 55P03).
RETRYABLE_DB_ERRORS = (
    psycopg.errors.SerializationFailure,
    psycopg.errors.DeadlockDetected,
    psycopg.errors.LockNotAvailable,
)


def classify(err: BaseException) -> str:
    """``"transient"``, ``"uncertain"`` or ``"permanent"``.

    Transient: the request was refused and nothing happened (429, 503, a serialization
    failure or deadlock that rolled the transaction back). Uncertain: it may have taken
    effect before it failed (a timeout, a reset connection, 500/502/504, a connection that
    broke around COMMIT), so a retry is safe only because the consumer is idempotent.
    Permanent: malformed data, a missing field, a broken business rule, an unsupported
    schema, any other 4xx: a retry fails the same way.
    """
    if isinstance(err, PermanentError):
        return "permanent"
    if isinstance(err, (TransientError, *RETRYABLE_DB_ERRORS)):
        return "transient"
    if isinstance(err, psycopg.OperationalError):
        return "uncertain"
    status = status_of(err)
    if status is not None:
        if status in (429, 503):
            return "transient"
        return "uncertain" if status in (408, 500, 502, 504) or status > 504 else "permanent"
    if is_retryable(err):  # chapter 01: timeouts, connection errors, httpx transport errors
        return "uncertain"
    return "permanent"


def is_transient(err: BaseException) -> bool:
    """Retry it? True for transient and uncertain errors (safe here: the consumer is idempotent)."""
    return classify(err) != "permanent"


def dependency_down(err: BaseException) -> bool:
    """Does this failure say the dependency is down (what the outage breaker counts)? Transient and
    uncertain errors do; a conflict between two transactions (40001, 40P01, 55P03) does not."""
    return is_transient(err) and not isinstance(err, RETRYABLE_DB_ERRORS)


def outage_breaker(clock: Callable[[], float]) -> CircuitBreaker:
    """The consumer's shared gate (chapter 02's breaker): opens when at least half of the last 10
    attempts, all lanes together, failed on the dependency; every lane then waits 5 s (its retry
    budget untouched) and one probe finds out whether the dependency is back."""
    return CircuitBreaker(0.5, 10, 5.0, clock=clock, is_failure=dependency_down, name="dependency")


#: The retry policy of the chapter's consumer: 5 attempts, full jitter from 0.1 s up to 2 s.
DEFAULT_POLICY = RetryPolicy(
    max_attempts=5, max_elapsed=60.0, backoff=FullJitter(0.1, 2.0), retryable=is_transient
)
#: The consumer's other defaults (:func:`ordered_consumer` says how they relate).
MAX_IN_FLIGHT = 200  # entries read and not yet finished, all lanes together
MAX_DELIVERIES = 5  # as SQS's maxReceiveCount or RabbitMQ's delivery-limit
CLAIM_IDLE_MS = 300_000  # without a lease only: five times DEFAULT_POLICY.max_elapsed

# ----------------------------------------------------------------------------- messages

#: The fields of every message the chapter publishes (all strings, as Redis stores them).
FIELDS = ("id", "key", "type", "seq", "schema", "correlation_id", "body")


def make_message(
    id: str,
    key: str,
    type: str,
    seq: int,
    body: dict | str | None = None,
    *,
    schema: int = 1,
    correlation_id=None,
) -> dict[str, str]:
    """One message as stream fields: a stable ``id`` (the dedup key), the ordering ``key``, its
    ``seq`` within the key, the ``schema`` version, a ``correlation_id`` and a JSON ``body``."""
    text = body if isinstance(body, str) else json.dumps(body or {}, sort_keys=True)
    corr = correlation_id or f"corr-{id}"
    return {
        "id": id,
        "key": key,
        "type": type,
        "seq": str(seq),
        "schema": str(schema),
        "correlation_id": corr,
        "body": text,
    }


def entry_order(entry_id: str) -> tuple[int, int]:
    """Sort key of a stream entry id ``"<ms>-<seq>"``: as two numbers, never as text
    (``"5-10"`` comes after ``"5-9"``)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


#: The same order in SQL, for a column holding entry ids.
ORDER_BY_ENTRY = "split_part(entry_id, '-', 1)::bigint, split_part(entry_id, '-', 2)::bigint"


async def ensure_group(redis, stream: str, group: str, start: str = "0") -> None:
    """Create the consumer group (and the stream) unless it exists."""
    try:
        await redis.xgroup_create(stream, group, id=start, mkstream=True)
    except Exception as err:  # noqa: BLE001 - redis.ResponseError BUSYGROUP: it exists
        if "BUSYGROUP" not in str(err):
            raise


# ----------------------------------------------------------------------------- the dead-letter entry

#: What a dead-letter entry adds to the message's own fields.
DLQ_FIELDS = ("source_stream", "source_entry_id", "attempts", "first_failed_at", "last_failed_at", "error", "error_type",
              "reason")  # fmt: skip


def dlq_entry(
    fields: dict,
    *,
    stream: str,
    entry_id: str,
    attempts: int,
    first_failed_at: float,
    last_failed_at: float,
    error: BaseException,
    reason: str,
) -> dict[str, str]:
    """The dead-letter entry: every original field as published (body, id, type, key, seq,
    schema, correlation id) plus where it came from, how often and when it failed, the last
    error's text and type, and why it is here (``"permanent"``, ``"exhausted"`` or ``"deliveries"``)."""
    return {
        **{k: str(v) for k, v in fields.items()},
        "source_stream": stream,
        "source_entry_id": entry_id,
        "attempts": str(attempts),
        "first_failed_at": repr(float(first_failed_at)),
        "last_failed_at": repr(float(last_failed_at)),
        "error": str(error)[:500],
        "error_type": type(error).__name__,
        "reason": reason,
    }


# ----------------------------------------------------------------------------- tables

SCHEMA = """
-- ids of applied messages, written in the transaction that applies the message
CREATE TABLE IF NOT EXISTS mq_processed (
    message_id   text PRIMARY KEY,
    stream       text NOT NULL,
    entry_id     text NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now()
);
-- a key whose message was dead-lettered; its later messages wait in mq_parked
CREATE TABLE IF NOT EXISTS mq_blocked_keys (
    stream     text NOT NULL,
    key        text NOT NULL,
    entry_id   text NOT NULL,
    message_id text NOT NULL,
    dlq_id     text NOT NULL,
    fields     jsonb NOT NULL,
    reason     text NOT NULL,
    blocked_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, key)
);
-- later messages of a blocked key, kept (and acknowledged) until replay_key
CREATE TABLE IF NOT EXISTS mq_parked (
    stream    text NOT NULL,
    entry_id  text NOT NULL,
    key       text NOT NULL,
    fields    jsonb NOT NULL,
    parked_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, entry_id)
);
CREATE INDEX IF NOT EXISTS mq_parked_key ON mq_parked (stream, key);
-- the fencing token of each stream's newest owner: a transaction carrying an older one is refused
CREATE TABLE IF NOT EXISTS mq_fence (
    stream   text PRIMARY KEY,
    token    bigint NOT NULL,
    owner    text NOT NULL,
    taken_at timestamptz NOT NULL DEFAULT now()
);
"""


async def setup_schema(pool) -> None:
    """Create the consumer's tables (idempotent). Async: pass a pool or an ``AsyncConnection``."""
    if hasattr(pool, "connection") and not hasattr(pool, "execute"):
        async with pool.connection() as conn:
            await conn.execute(SCHEMA)
        return
    await pool.execute(SCHEMA)


# ----------------------------------------------------------------------------- one message


async def apply_once(
    pool,
    handle: Handler,
    *,
    stream: str,
    entry_id: str,
    fields: dict,
    lane: str,
    token: int | None = None,
    deliveries: int = 1,
    max_deliveries: int | None = None,
) -> str:
    """One attempt, in one transaction: refuse it if ``token`` is stale (:func:`check_fence`), park
    it if its lane is blocked, skip it if its id was applied before, refuse it untried past
    ``max_deliveries`` (:class:`DeliveryLimitExceeded`), else record the id and apply it.
    ``"parked"``, ``"duplicate"`` or ``"applied"``."""
    async with pool.connection() as conn, conn.transaction():
        if token is not None:
            await check_fence(conn, stream, token)
        cur = await conn.execute(
            "SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR SHARE", (stream, lane)
        )
        if await cur.fetchone() is not None:
            await conn.execute(
                "INSERT INTO mq_parked (stream, entry_id, key, fields) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (stream, entry_id) DO NOTHING",
                (stream, entry_id, lane, Jsonb(fields)),
            )
            return "parked"
        cur = await conn.execute(
            "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
            "ON CONFLICT (message_id) DO NOTHING RETURNING message_id",
            (fields["id"], stream, entry_id),
        )
        if await cur.fetchone() is None:
            return "duplicate"
        if max_deliveries is not None and deliveries > max_deliveries:
            raise DeliveryLimitExceeded(
                f"{fields['id']}: delivered {deliveries} times, more than max_deliveries={max_deliveries}; "
                "no earlier delivery was acknowledged (it killed the consumer?)"
            )
        await handle(conn, fields)
        return "applied"


async def dead_letter(
    pool,
    redis,
    *,
    stream: str,
    dlq: str,
    entry_id: str,
    fields: dict,
    lane: str,
    entry: dict[str, str],
    token: int | None = None,
) -> str:
    """Write the dead-letter entry and block the lane, in a transaction committed before the caller's
    XACK; with a ``token``, only while it is still the stream's (checked first)."""
    async with pool.connection() as conn, conn.transaction():
        if token is not None:
            await check_fence(conn, stream, token)
        dlq_id = await redis.xadd(dlq, entry)
        await conn.execute(
            "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (stream, key) DO NOTHING",
            (stream, lane, entry_id, fields.get("id", ""), dlq_id, Jsonb(fields), entry["reason"]),
        )
    return dlq_id


@dataclass
class Wiring:
    """What one consumer run needs besides the entry: servers, names, policy, injected time, and
    what it holds: its fencing token, the shared outage breaker, its counts."""

    pool: object
    redis: object
    handle: Handler
    stream: str
    group: str
    dlq: str
    policy: RetryPolicy = DEFAULT_POLICY
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    rand: Callable[[], float] = random.random
    clock: Callable[[], float] = time.time
    log: Callable[[dict], None] | None = None
    token: int | None = None
    gate: CircuitBreaker | None = None
    max_deliveries: int | None = None
    counts: Counter = field(default_factory=Counter)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set when an admitted attempt ends

    def note(self, event: str, **extra) -> None:
        if self.log is not None:
            self.log({"event": event, "at": self.clock(), **extra})

    def emit(self, event: str, entry_id: str, fields: dict, **extra) -> None:
        self.note(event, entry_id=entry_id, message_id=fields.get("id"), key=fields.get("key"), seq=fields.get("seq"),
                  correlation_id=fields.get("correlation_id"), **extra)  # fmt: skip

    async def attempt(self, entry_id: str, fields: dict, lane: str, deliveries: int) -> str:
        """One :func:`apply_once`, through the outage breaker (which raises CircuitOpenError while open)."""

        async def once() -> str:
            try:
                return await apply_once(
                    self.pool, self.handle, stream=self.stream, entry_id=entry_id, fields=fields, lane=lane,
                    token=self.token, deliveries=deliveries, max_deliveries=self.max_deliveries,
                )  # fmt: skip
            finally:  # wake the lanes waiting for a half-open breaker's probe to settle
                self.settled.set()
                self.settled = asyncio.Event()

        return await (self.gate.call(once) if self.gate is not None else once())

    def pause_left(self) -> float:
        """How long the breaker still keeps the dependency closed off (0 when it is closed)."""
        if self.gate is None or self.gate.state == CLOSED:
            return 0.0
        if self.gate.state == OPEN:
            return max(0.0, self.gate.opened_at + self.gate.cooldown - self.clock())
        return self.gate.cooldown  # half-open: a probe is in flight; it closes or reopens the breaker

    async def wait_out(self, entry_id: str, fields: dict) -> None:
        """The dependency is down: wait, without spending an attempt of this message, until the breaker's
        cooldown ends, or (half-open) until its probe has settled."""
        self.counts["paused"] += 1
        self.emit("paused", entry_id, fields, breaker=self.gate.state, seconds=self.pause_left())
        if self.gate.state == HALF_OPEN:
            await self.settled.wait()
        else:  # at least 1 ms: a float remainder of the cooldown could be too small to move a clock
            await self.sleep(max(self.pause_left(), 0.001))


#: What stops a message's retries without a verdict on it: a lost lease, an open breaker.
_NOT_ITS_FAULT = (LeaseLost, CircuitOpenError)


async def process_entry(w: Wiring, entry_id: str, fields: dict, lane: str, deliveries: int = 1) -> str:
    """Retry, dead-letter or apply one entry, then XACK it (always after the commit).

    While the outage breaker is open the entry waits, its attempts untouched; one that ran out of
    attempts while the breaker was not closed starts again with a fresh budget once it is: an
    outage is not a bad message. A lost lease (:class:`LeaseLost`) propagates: no dead letter, no ack.
    """
    policy = replace(
        w.policy, retryable=lambda err: not isinstance(err, _NOT_ITS_FAULT) and w.policy.retryable(err)
    )

    def logged(state: RetryState) -> None:  # every failure leaves its retry metadata in the log
        w.emit("retry", entry_id, fields, attempt=state.attempt, first_failed_at=state.first_failure_at,
               last_failed_at=state.last_failure_at, next_retry_at=state.next_retry_at,
               error=str(state.last_error), error_type=type(state.last_error).__name__)  # fmt: skip

    while True:
        state = RetryState()
        try:
            outcome = await retry_call(
                lambda: w.attempt(entry_id, fields, lane, deliveries), policy, clock=w.clock, sleep=w.sleep,
                rand=w.rand, on_retry=logged, state=state,
            )  # fmt: skip
        except CircuitOpenError:
            await w.wait_out(entry_id, fields)
            continue
        except LeaseLost:
            raise
        except Exception as err:  # noqa: BLE001 - classified: permanent, or out of attempts
            if state.gave_up != "not retryable" and w.pause_left() > 0:  # the outage, not the message
                await w.wait_out(entry_id, fields)
                continue
            over = isinstance(err, DeliveryLimitExceeded)
            reason = (
                "deliveries" if over else "permanent" if state.gave_up == "not retryable" else "exhausted"
            )
            now = w.clock()
            entry = dlq_entry(
                fields, stream=w.stream, entry_id=entry_id,
                attempts=deliveries - 1 if over else state.attempt,
                first_failed_at=now if state.first_failure_at is None else state.first_failure_at,
                last_failed_at=now if state.last_failure_at is None else state.last_failure_at,
                error=err, reason=reason,
            )  # fmt: skip
            await dead_letter(
                w.pool, w.redis, stream=w.stream, dlq=w.dlq, entry_id=entry_id, fields=fields, lane=lane,
                entry=entry, token=w.token,
            )  # fmt: skip
            w.emit("dead", entry_id, fields, attempt=state.attempt, error=str(err),
                   error_type=type(err).__name__, reason=reason)  # fmt: skip
            outcome = "dead"
        else:
            w.emit(outcome, entry_id, fields, attempt=state.attempt + 1)
        break
    await w.redis.xack(w.stream, w.group, entry_id)
    return outcome


# ----------------------------------------------------------------------------- reading the stream


def _entries(reply) -> list[tuple[str, dict]]:
    """Entries of an XREADGROUP reply (one stream), in order."""
    out: list[tuple[str, dict]] = []
    for _stream, entries in reply or []:
        out.extend(entries)
    return out


async def claim_stale(redis, stream: str, group: str, consumer: str, min_idle_ms: int, count: int = 100):
    """Every entry pending longer than ``min_idle_ms`` (a dead consumer's), now this consumer's."""
    out: list[tuple[str, dict | None]] = []
    cursor = "0-0"
    while True:
        reply = await redis.xautoclaim(stream, group, consumer, min_idle_ms, cursor, count=count)
        cursor, entries = reply[0], reply[1]
        out.extend(entries)
        if cursor in ("0-0", b"0-0"):
            return out


async def take_pending(
    redis, stream: str, group: str, consumer: str, min_idle_ms: int, count: int = 100
) -> int:
    """Move to ``consumer`` every entry pending longer than ``min_idle_ms`` (0: all of them, whoever
    holds them): ``XPENDING`` page by page, then ``XCLAIM ... JUSTID`` (ids only: nothing read into
    memory, the delivery count left to the read that follows). The number moved."""
    moved, start = 0, "-"
    while True:
        rows = await redis.xpending_range(stream, group, start, "+", count, idle=min_idle_ms or None)
        ids = [row["message_id"] for row in rows if row["consumer"] != consumer]
        if ids:
            moved += len(await redis.xclaim(stream, group, consumer, min_idle_ms, ids, justid=True))
        if len(rows) < count:
            return moved
        start = f"({rows[-1]['message_id']}"  # exclusive: after the last one seen


async def read_own_pending(redis, stream: str, group: str, consumer: str, count: int = 100, after: str = "0"):
    """Entries delivered to this consumer name and never acknowledged, after ``after``, at most ``count``
    (XREADGROUP with an id: each read adds one to the entry's delivery count)."""
    return _entries(await redis.xreadgroup(group, consumer, {stream: after}, count=count))


async def delivery_counts(redis, stream: str, group: str, consumer: str, entries) -> dict[str, int]:
    """``times_delivered`` of each of ``entries`` (consecutive entries of this consumer's pending list)."""
    if not entries:
        return {}
    rows = await redis.xpending_range(stream, group, entries[0][0], entries[-1][0], len(entries), consumer)
    return {row["message_id"]: row["times_delivered"] for row in rows}


async def read_new(redis, stream: str, group: str, consumer: str, count: int = 100):
    """Entries never delivered to anyone (``>``), without blocking."""
    return _entries(await redis.xreadgroup(group, consumer, {stream: ">"}, count=count))


def by_key(fields: dict) -> str:
    """The default ordering scope: one lane per message key."""
    return fields.get("key", "")


def by_partition(partitions: int) -> Callable[[dict], str]:
    """One lane per partition, ``crc32(key) % partitions`` (stable across processes)."""
    import zlib

    return lambda fields: f"p{zlib.crc32(fields.get('key', '').encode()) % partitions}"


def one_lane(fields: dict) -> str:
    """A single global FIFO: every message waits for every earlier one."""
    return "*"


# ----------------------------------------------------------------------------- the consumer


async def ordered_consumer(
    pool,
    redis,
    handle: Handler,
    *,
    stream: str,
    group: str,
    consumer: str,
    dlq: str,
    policy: RetryPolicy = DEFAULT_POLICY,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rand: Callable[[], float] = random.random,
    clock: Callable[[], float] = time.time,
    claim_idle_ms: int = CLAIM_IDLE_MS,
    batch: int = 100,
    lane_of: Callable[[dict], str] = by_key,
    log: Callable[[dict], None] | None = None,
    lease_ms: int | None = LEASE_MS,
    max_in_flight: int = MAX_IN_FLIGHT,
    max_deliveries: int | None = MAX_DELIVERIES,
    breaker: Callable[[Callable[[], float]], CircuitBreaker] | None = outage_breaker,
) -> Counter:
    """Drain the stream as consumer ``consumer`` of ``group``; return outcome counts.

    1. **Own the stream** (:func:`take_ownership`): ``{"not owner": 1}`` at once while another consumer
       holds the lease. The lease is renewed every ``lease_ms / 3`` and released at the end; a lost one
       stops the run (``"lease lost"``), its entries left pending for the new owner.
    2. **Old entries first**: with a lease, every pending entry (the last owner's whole list, however
       briefly idle); without one (``lease_ms=None``: one consumer at a time is then your promise),
       those idle longer than ``claim_idle_ms``, and this name's own. Then new ones (``>``) in batches,
       until a read finds nothing and every lane is idle.
    3. **Lanes**: each ``lane_of(fields)`` is a task that handles its entries one at a time in stream
       order; lanes run concurrently, so one lane's retries never hold another's messages.
    4. **Bounded**: at most ``max_in_flight`` entries read and not finished; at the cap it reads nothing
       (the log says ``"at capacity"``) until lanes have finished half a batch.
    5. **Poison and outages**: past ``max_deliveries`` (Redis's ``times_delivered``) an entry is
       dead-lettered untried; while ``breaker(clock)`` (shared by all lanes) is open, lanes wait and
       nothing new is read (:func:`process_entry`).

    ``claim_idle_ms`` must stay well above the longest a *live* consumer keeps an entry unacknowledged,
    since XPENDING's idle time counts all of it: its wait in its lane behind the others read with it,
    its retries (up to ``policy.max_elapsed``) and the handler. The default, 5 minutes, is five times
    ``DEFAULT_POLICY.max_elapsed``. A production consumer runs this in a loop (or with ``BLOCK``).
    """
    w = Wiring(
        pool,
        redis,
        handle,
        stream,
        group,
        dlq,
        policy,
        sleep,
        rand,
        clock,
        log,
        max_deliveries=max_deliveries,
    )
    counts = w.counts
    lease = None
    if lease_ms is not None:
        lease = await take_ownership(
            pool, redis, stream=stream, group=group, consumer=consumer, lease_ms=lease_ms
        )
        if lease is None:
            w.note("not owner", consumer=consumer)
            counts["not owner"] += 1
            return counts
        w.token = lease.fence
    w.gate = breaker(clock) if breaker is not None else None
    queues: dict[str, deque] = {}
    lanes: dict[str, asyncio.Task] = {}
    flight = {"entries": 0, "full": False}
    renew_every = lease_ms / 3000 if lease_ms is not None else None
    renewed = time.monotonic()  # the lease lives in Redis's real time, whatever clock the retries use

    async def run_lane(lane: str) -> None:
        queue = queues[lane]
        while queue:
            entry_id, fields, deliveries = queue.popleft()
            counts[await process_entry(w, entry_id, fields, lane, deliveries)] += 1
            flight["entries"] -= 1
        del queues[lane], lanes[lane]  # no await since the last check: nothing was added meanwhile

    def dead() -> bool:  # a lane that ended still listed ended with an error: the TaskGroup raises it
        return any(task.done() for task in lanes.values())

    def dispatch(entries, tg: asyncio.TaskGroup, deliveries: dict | None = None) -> None:
        if dead():  # the group is shutting down (with Python 3.11 the cancel it sends us can be lost)
            return
        for entry_id, fields in entries:
            if not fields:  # deleted from the stream (XDEL, XTRIM) while pending: nothing to apply
                tg.create_task(redis.xack(stream, group, entry_id))
                continue
            lane = lane_of(fields)
            times = (deliveries or {}).get(entry_id, 1)
            w.emit("delivered", entry_id, fields, lane=lane, deliveries=times)
            queues.setdefault(lane, deque()).append((entry_id, fields, times))
            flight["entries"] += 1
            if lane not in lanes:
                lanes[lane] = tg.create_task(run_lane(lane))

    async def drain() -> None:
        nonlocal renewed
        async with asyncio.TaskGroup() as tg:
            await take_pending(
                redis, stream, group, consumer, 0 if lease_ms is not None else claim_idle_ms, batch
            )
            history: str | None = "0"  # this name's pending entries (all just taken), then new ones
            while not dead():
                if renew_every is not None and time.monotonic() - renewed >= renew_every:
                    if not await renew_lease(redis, lease, lease_ms):
                        raise LeaseLost(f"{consumer} lost the lease on {stream}")
                    renewed = time.monotonic()
                room = max_in_flight - flight["entries"]
                if w.pause_left() > 0 and w.gate.state == OPEN:  # the dependency is down: read nothing
                    if not lanes:
                        await sleep(max(w.pause_left(), 0.001))
                        continue
                elif room < max(1, min(batch, max_in_flight) // 2):
                    if not flight["full"]:
                        w.note("at capacity", in_flight=flight["entries"])
                    flight["full"] = True
                else:
                    flight["full"] = False
                    got = (await read_own_pending(redis, stream, group, consumer, min(batch, room), history)
                           if history is not None else [])  # fmt: skip
                    if got:
                        counts["taken over"] += len(got)
                        dispatch(got, tg, await delivery_counts(redis, stream, group, consumer, got))
                        history = got[-1][0]
                        continue
                    history = None
                    fresh = await read_new(redis, stream, group, consumer, min(batch, room))
                    if fresh:
                        dispatch(fresh, tg)
                        continue
                    if not lanes:
                        break
                await asyncio.wait(
                    list(lanes.values()), timeout=renew_every, return_when=asyncio.FIRST_COMPLETED
                )

    lost = False
    try:  # the lanes' TaskGroup runs in a task of its own: a lane's crash cancels the group's parent
        await asyncio.create_task(drain())  # task, and on Python 3.11 that cancel can outlive the group
    except* LeaseLost:
        lost = True
    if lost:
        w.note("lease lost", consumer=consumer)
        counts["lease lost"] += 1
    elif lease is not None:
        await lease.release()  # the next consumer need not wait for it to expire
    return counts
