"""Messaging under failure: retries, dead letters, per-key order (chapter 05).

A consumer over a Redis Stream and a consumer group, with its state in PostgreSQL:

- **classify** every handler error (:func:`classify`, :func:`is_transient`): transient and
  uncertain errors are retried with chapter 01's capped exponential backoff and full
  jitter (:class:`course.retry.RetryPolicy`, :func:`course.retry.retry_call`); permanent
  ones go straight to the dead-letter stream;
- **apply once**: the message id is recorded in ``mq_processed`` in the same transaction
  as the change (chapter 03's idempotent consumer), and the entry is acknowledged
  (``XACK``) only after that commit: at-least-once delivery, effectively-once effect;
- **dead-letter** with everything an operator needs (:func:`dlq_entry`), then **block
  the key**: its later messages are **parked** in ``mq_parked``, not applied, not lost;
- **one key in order, keys in parallel**: one lane (an asyncio task) per ordering key;
  ``lane_of`` chooses the scope (per key, per partition, or one global lane);
- **take over** a dead consumer's pending entries with ``XAUTOCLAIM`` before reading new ones;
- **replay** a blocked key once its cause is fixed (:func:`replay_key`): the dead message
  first, then the parked ones in stream order, then unblock; throttled over many keys by
  :func:`replay_blocked`; :func:`metrics` reads what to alert on from the servers.

The handler is ``await handle(conn, fields)``: it makes the change on ``conn``, inside the
consumer's transaction, and raises to fail. ``fields`` is the entry as published
(:func:`make_message`). ``setup_schema`` is async: ``await setup_schema(pool)``.

One consumer reads a stream at a time (as one consumer owns a Kafka partition); another
replica takes over its pending entries when it dies. Scale out with more streams
(partitions), never with two consumers racing on one key's messages.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import psycopg
from psycopg.types.json import Jsonb

from course.backoff import FullJitter
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


#: The retry policy of the chapter's consumer: 5 attempts, full jitter from 0.1 s up to 2 s.
DEFAULT_POLICY = RetryPolicy(max_attempts=5, max_elapsed=60.0, backoff=FullJitter(0.1, 2.0), retryable=is_transient)

# ----------------------------------------------------------------------------- messages

#: The fields of every message the chapter publishes (all strings, as Redis stores them).
FIELDS = ("id", "key", "type", "seq", "schema", "correlation_id", "body")


def make_message(
    id: str, key: str, type: str, seq: int, body: dict | str | None = None, *, schema: int = 1, correlation_id=None
) -> dict[str, str]:
    """One message as stream fields: a stable ``id`` (the dedup key), the ordering ``key``, its
    ``seq`` within the key, the ``schema`` version, a ``correlation_id`` and a JSON ``body``."""
    text = body if isinstance(body, str) else json.dumps(body or {}, sort_keys=True)
    return {
        "id": id,
        "key": key,
        "type": type,
        "seq": str(seq),
        "schema": str(schema),
        "correlation_id": correlation_id or f"corr-{id}",
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
DLQ_FIELDS = (
    "source_stream",
    "source_entry_id",
    "attempts",
    "first_failed_at",
    "last_failed_at",
    "error",
    "error_type",
    "reason",
)


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
    error's text and type, and why it is here (``"permanent"`` or ``"exhausted"``)."""
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
"""


async def setup_schema(pool) -> None:
    """Create the consumer's tables (idempotent). Async: pass a pool or an ``AsyncConnection``."""
    if hasattr(pool, "connection") and not hasattr(pool, "execute"):
        async with pool.connection() as conn:
            await conn.execute(SCHEMA)
        return
    await pool.execute(SCHEMA)


# ----------------------------------------------------------------------------- one message


async def apply_once(pool, handle: Handler, *, stream: str, entry_id: str, fields: dict, lane: str) -> str:
    """One attempt, in one transaction: park it if its lane is blocked, skip it if its id was
    applied before, else record the id and apply it. ``"parked"``, ``"duplicate"`` or ``"applied"``."""
    async with pool.connection() as conn, conn.transaction():
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
        await handle(conn, fields)
        return "applied"


async def dead_letter(
    pool, redis, *, stream: str, dlq: str, entry_id: str, fields: dict, lane: str, entry: dict[str, str]
) -> str:
    """Write the dead-letter entry, then block the lane (committed before the caller's XACK)."""
    dlq_id = await redis.xadd(dlq, entry)
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (stream, key) DO NOTHING",
            (stream, lane, entry_id, fields.get("id", ""), dlq_id, Jsonb(fields), entry["reason"]),
        )
    return dlq_id


@dataclass
class Wiring:
    """What one consumer run needs besides the entry: servers, names, policy, injected time."""

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

    def emit(self, event: str, entry_id: str, fields: dict, **extra) -> None:
        if self.log is not None:
            self.log(
                {
                    "event": event,
                    "entry_id": entry_id,
                    "message_id": fields.get("id"),
                    "key": fields.get("key"),
                    "seq": fields.get("seq"),
                    "correlation_id": fields.get("correlation_id"),
                    "at": self.clock(),
                    **extra,
                }
            )


async def process_entry(w: Wiring, entry_id: str, fields: dict, lane: str) -> str:
    """Retry, dead-letter or apply one entry, then XACK it (always after the commit)."""
    state = RetryState()

    async def pause(delay: float) -> None:  # every failure leaves its retry metadata in the log
        w.emit(
            "retry",
            entry_id,
            fields,
            attempt=state.attempt,
            first_failed_at=state.first_failure_at,
            last_failed_at=state.last_failure_at,
            next_retry_at=state.next_retry_at,
            error=str(state.last_error),
            error_type=type(state.last_error).__name__,
        )
        await w.sleep(delay)

    try:
        outcome = await retry_call(
            lambda: apply_once(w.pool, w.handle, stream=w.stream, entry_id=entry_id, fields=fields, lane=lane),
            w.policy,
            clock=w.clock,
            sleep=pause,
            rand=w.rand,
            state=state,
        )
    except Exception as err:  # noqa: BLE001 - classified: permanent, or out of attempts
        reason = "permanent" if state.gave_up == "not retryable" else "exhausted"
        entry = dlq_entry(
            fields,
            stream=w.stream,
            entry_id=entry_id,
            attempts=state.attempt,
            first_failed_at=state.first_failure_at if state.first_failure_at is not None else w.clock(),
            last_failed_at=state.last_failure_at if state.last_failure_at is not None else w.clock(),
            error=err,
            reason=reason,
        )
        await dead_letter(
            w.pool, w.redis, stream=w.stream, dlq=w.dlq, entry_id=entry_id, fields=fields, lane=lane, entry=entry
        )
        w.emit(
            "dead",
            entry_id,
            fields,
            attempt=state.attempt,
            error=str(err),
            error_type=type(err).__name__,
            reason=reason,
        )
        outcome = "dead"
    else:
        w.emit(outcome, entry_id, fields, attempt=state.attempt + 1)
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


async def read_own_pending(redis, stream: str, group: str, consumer: str, count: int = 100):
    """Entries delivered to this consumer name and never acknowledged (after a restart)."""
    out: list[tuple[str, dict | None]] = []
    last = "0"
    while True:
        got = _entries(await redis.xreadgroup(group, consumer, {stream: last}, count=count))
        if not got:
            return out
        out.extend(got)
        last = got[-1][0]


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
    claim_idle_ms: int = 60_000,
    batch: int = 100,
    lane_of: Callable[[dict], str] = by_key,
    log: Callable[[dict], None] | None = None,
) -> Counter:
    """Drain the stream as consumer ``consumer`` of ``group``; return outcome counts.

    Order of work: entries a dead consumer left pending (XAUTOCLAIM, idle longer than
    ``claim_idle_ms``), this consumer's own pending entries, then new ones, read in batches
    until a read finds nothing and every lane is idle. Each lane (``lane_of(fields)``) is a
    task that handles its entries one at a time in stream order; lanes run concurrently, so
    one lane's retries never hold another's messages, whichever batch they came in.
    A production consumer runs this in a loop (or with ``XREADGROUP ... BLOCK``).
    """
    w = Wiring(pool, redis, handle, stream, group, dlq, policy, sleep, rand, clock, log)
    counts: Counter = Counter()
    queues: dict[str, deque] = {}
    lanes: dict[str, asyncio.Task] = {}

    async def run_lane(lane: str) -> None:
        queue = queues[lane]
        while queue:
            entry_id, fields = queue.popleft()
            counts[await process_entry(w, entry_id, fields, lane)] += 1
        del queues[lane], lanes[lane]  # no await since the last check: nothing was added meanwhile

    def dispatch(entries, tg: asyncio.TaskGroup) -> None:
        for entry_id, fields in entries:
            if not fields:  # deleted from the stream while pending: nothing to apply
                tg.create_task(redis.xack(stream, group, entry_id))
                continue
            lane = lane_of(fields)
            w.emit("delivered", entry_id, fields, lane=lane)
            queues.setdefault(lane, deque()).append((entry_id, fields))
            if lane not in lanes:
                lanes[lane] = tg.create_task(run_lane(lane))

    async with asyncio.TaskGroup() as tg:
        taken = dict(await claim_stale(redis, stream, group, consumer, claim_idle_ms, batch))
        taken.update(await read_own_pending(redis, stream, group, consumer, batch))  # both may list one entry
        if taken:
            counts["taken over"] += len(taken)
        dispatch(sorted(taken.items(), key=lambda e: entry_order(e[0])), tg)  # old entries first, in stream order
        while True:
            fresh = await read_new(redis, stream, group, consumer, batch)
            if fresh:
                dispatch(fresh, tg)
                continue
            if not lanes:
                break
            await asyncio.wait(list(lanes.values()), return_when=asyncio.FIRST_COMPLETED)
    return counts


# ----------------------------------------------------------------------------- replay


async def replay_key(pool, redis, handle: Handler, *, stream: str, key: str, dlq: str) -> int:
    """Re-drive a blocked key after its cause is fixed; the number of messages applied.

    In one transaction that holds the key's block row: apply the dead-lettered message,
    then every parked message in stream order (each skipped if its id was applied before),
    delete the parked rows and the block. Then delete the dead-letter entry. A handler
    error rolls everything back (the key stays blocked). A key that is not blocked: 0.
    """
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT entry_id, dlq_id, fields FROM mq_blocked_keys WHERE stream = %s AND key = %s FOR UPDATE",
            (stream, key),
        )
        row = await cur.fetchone()
        if row is None:
            return 0
        dead_entry, dlq_id, dead_fields = row
        cur = await conn.execute(
            f"SELECT entry_id, fields FROM mq_parked WHERE stream = %s AND key = %s ORDER BY {ORDER_BY_ENTRY}",
            (stream, key),
        )
        todo = [(dead_entry, dead_fields), *await cur.fetchall()]
        applied = 0
        for entry_id, fields in todo:
            cur = await conn.execute(
                "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                "ON CONFLICT (message_id) DO NOTHING RETURNING message_id",
                (fields["id"], stream, entry_id),
            )
            if await cur.fetchone() is not None:
                await handle(conn, fields)
                applied += 1
        await conn.execute("DELETE FROM mq_parked WHERE stream = %s AND key = %s", (stream, key))
        await conn.execute("DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key))
    await redis.xdel(dlq, dlq_id)
    return applied


async def replay_blocked(
    pool,
    redis,
    handle: Handler,
    *,
    stream: str,
    dlq: str,
    per_second: float = 10.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> list[tuple[str, int | str]]:
    """Replay every blocked key of ``stream``, oldest block first, at most ``per_second`` keys
    a second, so a fixed bug does not become a thundering herd. ``(key, applied or error)``."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT key FROM mq_blocked_keys WHERE stream = %s ORDER BY blocked_at, key", (stream,)
        )
        keys = [k for (k,) in await cur.fetchall()]
    done: list[tuple[str, int | str]] = []
    for i, key in enumerate(keys):
        if i:
            await sleep(1.0 / per_second)
        try:
            done.append((key, await replay_key(pool, redis, handle, stream=stream, key=key, dlq=dlq)))
        except Exception as err:  # noqa: BLE001 - still broken: the key stays blocked, go on
            done.append((key, f"{type(err).__name__}: {err}"))
    return done


# ----------------------------------------------------------------------------- metrics


async def metrics(pool, redis, *, stream: str, group: str, dlq: str, sample: int = 1000) -> dict:
    """What to alert on, read from the servers: backlog, pending (and the oldest one's idle
    time), dead letters (``XLEN``, the oldest one's age, and by reason and error type over the
    newest ``sample`` of them), blocked keys (and the longest block), parked messages.

    Cheap at any size: a metrics scrape must not read a million dead letters every 15 s."""
    out: dict = {}
    info = await redis.xinfo_groups(stream)
    mine = next((g for g in info if g["name"] == group), {})
    out["lag"] = mine.get("lag")  # Redis 7 only; None on 6.2
    summary = await redis.xpending(stream, group)
    out["pending"] = summary["pending"]
    oldest = await redis.xpending_range(stream, group, "-", "+", 1) if summary["pending"] else []
    out["oldest_pending_idle_s"] = oldest[0]["time_since_delivered"] / 1000 if oldest else 0.0
    out["dlq"] = await redis.xlen(dlq)
    newest = await redis.xrevrange(dlq, count=sample)
    out["dlq_sampled"] = len(newest)
    out["dlq_by_reason"] = dict(Counter(f.get("reason", "?") for _, f in newest))
    out["dlq_by_error_type"] = dict(Counter(f.get("error_type", "?") for _, f in newest))
    oldest_dead = await redis.xrange(dlq, count=1)
    now_ms = int(time.time() * 1000)
    out["oldest_dlq_age_s"] = (now_ms - entry_order(oldest_dead[0][0])[0]) / 1000 if oldest_dead else 0.0
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT count(*), coalesce(extract(epoch FROM now() - min(blocked_at)), 0) FROM mq_blocked_keys "
            "WHERE stream = %s",
            (stream,),
        )
        out["blocked_keys"], longest = await cur.fetchone()
        out["longest_block_s"] = float(longest)
        cur = await conn.execute("SELECT count(*) FROM mq_parked WHERE stream = %s", (stream,))
        (out["parked"],) = await cur.fetchone()
    return out
