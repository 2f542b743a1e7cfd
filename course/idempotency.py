"""Idempotency keys, atomic claims and idempotent consumers (chapter 03).

A retried request must not charge the card twice. The chapter's reference design:

1. **claim** the key before any side effect, atomically, in the database:
   ``INSERT INTO idempotency_keys ... ON CONFLICT (key) DO NOTHING RETURNING key``
   (exactly one caller gets the row back);
2. **do** the side effect (``charge``), outside any database transaction;
3. **store** the response in the key's row (``status = 'done'``) in the same
   transaction that inserts the order.

Every other caller with that key gets the stored response, :class:`RequestInProgress`
(409) while the first is still running, or :class:`IdempotencyKeyReused` (422) when
the body differs (a request hash is compared).

A failed charge is handled by what we *know* about it. A :class:`ChargeDeclined` (the
provider answered that it did not charge: a declined card, a refused request) is
certain: the claim is deleted so the client can try again. Anything else (a timeout, a
reset connection, a 5xx) is uncertain: the money may have moved, so the claim stays
``pending`` and callers get 409 until :func:`reap_pending` re-drives it with the same
key sent to the provider (which answers with the charge it already made, if any).
:func:`purge_expired` deletes old keys in batches.

Queue consumers get the same treatment: :func:`consume_payment_event` records the
event id with ``ON CONFLICT DO NOTHING`` in the transaction that credits the account.

``setup_schema`` is **async**: ``await setup_schema(conn_or_pool)``. It creates the tables
the pattern owns: ``idempotency_keys``, ``orders`` (the graded ``create_order`` writes it),
``accounts`` and ``processed_events`` (the idempotent consumer's).

Retrying 409: chapter 01's :func:`course.retry.is_retryable` does not retry 409 (a
conflict does not go away by itself). Here a 409 means "the first request with your
key is still running", which does go away, so callers retry with
:func:`retry_in_progress` as ``with_retry(..., retryable=retry_in_progress)``.

What chapter 03 shows around it (the check-then-act bug, a fake card, consumers that
credit twice, crash injection, the lock a second INSERT waits on) is in
:mod:`course.chapters.ch03`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

from psycopg.types.json import Jsonb

from course.retry import is_retryable, status_of, with_retry

SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key          text PRIMARY KEY,
    request_hash text NOT NULL,
    status       text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done')),
    request      jsonb,
    response     jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS idempotency_keys_pending ON idempotency_keys (updated_at) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS idempotency_keys_created ON idempotency_keys (created_at);

CREATE TABLE IF NOT EXISTS orders (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer     text NOT NULL,
    amount_cents bigint NOT NULL,
    charge_id    text,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- the idempotent consumer
CREATE TABLE IF NOT EXISTS accounts (
    id            bigint PRIMARY KEY,
    balance_cents bigint NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS processed_events (
    event_id     text PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
"""


async def setup_schema(conn) -> None:
    """Create the pattern's tables (idempotent). Async: pass an ``AsyncConnection`` or a pool."""
    if hasattr(conn, "connection") and not hasattr(conn, "execute"):  # a pool
        async with conn.connection() as c:
            await c.execute(SCHEMA)
        return
    await conn.execute(SCHEMA)


# ----------------------------------------------------------------------------- errors


class IdempotencyError(Exception):
    """Base of the errors an idempotent endpoint answers with; ``status`` is the HTTP status."""

    status = 400

    def __init__(self, key: str, message: str | None = None) -> None:
        super().__init__(message or f"key {key!r}")
        self.key = key


class IdempotencyKeyReused(IdempotencyError):
    """422: the key was first used with a different request body."""

    status = 422


class RequestInProgress(IdempotencyError):
    """409: the first request with this key has not finished yet; retry later."""

    status = 409


class ProviderError(Exception):
    """The payment provider failed and we cannot tell whether it charged (a 5xx, a 409 "in flight").

    Uncertain: the charge may have gone through. Never release the claim on this; let the
    reaper finish the request with the same provider key.
    """

    def __init__(self, status: int = 503, message: str | None = None) -> None:
        super().__init__(message or f"payment provider answered {status}")
        self.status = status


class ChargeDeclined(ProviderError):
    """The provider answered that it did **not** charge (a declined card, 402; a refused request, 4xx).

    Certain: no money moved and none will. Safe to release the claim.
    """

    def __init__(self, status: int = 402, message: str | None = None) -> None:
        super().__init__(status, message or f"the card was declined ({status})")


class SimulatedCrash(BaseException):
    """The process died here. A BaseException, so ``except Exception`` clean-up does not run."""


def retry_in_progress(err: BaseException) -> bool:
    """Chapter 01's classification plus 409: worth another try when the first request is still running.

    The request is keyed, so retrying an uncertain failure is safe here; a declined charge
    (402) and 501 (not implemented) are answers, never retried.
    """
    status = status_of(err)
    if isinstance(err, ChargeDeclined) or status in (402, 501, 505):
        return False
    return isinstance(err, RequestInProgress) or status == 409 or is_retryable(err)


async def call_with_retry(
    fn: Callable[[], Awaitable],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rand: Callable[[], float] | None = None,
    retries: int = 6,
    base_delay: float = 0.05,
    max_delay: float = 1.0,
):
    """Chapter 01's ``with_retry`` with 409 "in progress" counted as retryable."""
    kwargs = {"rand": rand} if rand is not None else {}
    return await with_retry(
        fn,
        retries=retries,
        base_delay=base_delay,
        max_delay=max_delay,
        retryable=retry_in_progress,
        sleep=sleep,
        **kwargs,
    )


# ----------------------------------------------------------------------------- request hashes


def request_hash(body: dict) -> str:
    """SHA-256 of the body as canonical JSON (sorted keys, no spaces): equal bodies, equal hashes."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


# ----------------------------------------------------------------------------- the reference: claim, charge, store


def order_response(order_id: int, body: dict, charge_id: str | None) -> dict:
    """The response an order request gets, and every repeat of it."""
    return {
        "order_id": order_id,
        "customer": body["customer"],
        "amount_cents": body["amount_cents"],
        "charge_id": charge_id,
        "status": "created",
    }


async def claim(pool, key: str, req_hash: str, body: dict) -> bool:
    """Claim ``key`` before any side effect: True if this caller owns it now (one atomic INSERT)."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash, request) VALUES (%s, %s, %s) "
            "ON CONFLICT (key) DO NOTHING RETURNING key",
            (key, req_hash, Jsonb(body)),
        )
        return await cur.fetchone() is not None


async def stored_response(pool, key: str, req_hash: str) -> dict:
    """What a caller that lost the claim gets: the stored response, 409 or 422."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT request_hash, status, response FROM idempotency_keys WHERE key = %s", (key,)
        )
        row = await cur.fetchone()
    if row is None:  # the first request failed and released the key a moment ago
        raise RequestInProgress(key, f"key {key!r} was released by a failed request; retry")
    stored_hash, status, response = row
    if stored_hash != req_hash:
        raise IdempotencyKeyReused(key, f"key {key!r} was first used with a different request body")
    if status != "done":
        raise RequestInProgress(key, f"a request with key {key!r} is still in progress")
    return response


async def release(pool, key: str) -> None:
    """Delete a pending claim so the client can retry after a failure."""
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM idempotency_keys WHERE key = %s AND status = 'pending'", (key,))


async def complete(pool, key: str, response: dict) -> bool:
    """Mark a pending claim done with ``response`` (what a repeat is answered with); False if it was not pending."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE idempotency_keys SET status = 'done', response = %s, updated_at = now() "
            "WHERE key = %s AND status = 'pending' RETURNING key",
            (Jsonb(response), key),
        )
        return await cur.fetchone() is not None


class _AlreadyFinished(Exception):
    pass


async def finish_order(pool, key: str, body: dict, charge_id: str | None) -> dict:
    """Insert the order and store its response in one transaction, if the claim is still pending.

    Whoever finishes first (the request or the reaper) wins; the other rolls back its order
    and returns the stored response, so a key never makes two orders.
    """
    try:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO orders (customer, amount_cents, charge_id) VALUES (%s, %s, %s) RETURNING id",
                (body["customer"], body["amount_cents"], charge_id),
            )
            (order_id,) = await cur.fetchone()
            response = order_response(order_id, body, charge_id)
            cur = await conn.execute(
                "UPDATE idempotency_keys SET status = 'done', response = %s, updated_at = now() "
                "WHERE key = %s AND status = 'pending' RETURNING response",
                (Jsonb(response), key),
            )
            row = await cur.fetchone()
            if row is None:
                raise _AlreadyFinished
    except _AlreadyFinished:
        return await stored_response(pool, key, request_hash(body))
    return row[0]  # read back from jsonb, so the first answer is byte-identical to every replay


async def create_order(pool, idempotency_key: str, body: dict, charge) -> dict:
    """Create one order per key: claim the key, charge once, store and return the response.

    A declined charge (certain: nothing was charged) releases the key, so the client may
    try again. Any other failure (a timeout, a reset, a 5xx: the charge may have gone
    through) keeps the key ``pending``: repeats get 409 until :func:`reap_pending` finishes
    the request with the provider's idempotency key. Either way the error reaches the caller.
    """
    req_hash = request_hash(body)
    if not await claim(pool, idempotency_key, req_hash, body):
        return await stored_response(pool, idempotency_key, req_hash)
    try:
        charge_id = await charge(body["customer"], body["amount_cents"])
    except ChargeDeclined:
        await release(pool, idempotency_key)  # certain: no money moved
        raise
    # any other exception propagates with the claim still pending: uncertain, the reaper decides
    return await finish_order(pool, idempotency_key, body, charge_id)


# ----------------------------------------------------------------------------- the idempotent consumer


class UnknownAccount(Exception):
    """The event names an account that does not exist: a permanent error (dead-letter it)."""


async def consume_payment_event(pool, event: dict) -> None:
    """Credit ``event['amount_cents']`` to the account once, however often the event is delivered.

    The event id is recorded with ON CONFLICT in the same transaction as the credit: either
    both happen or neither does, and a concurrent duplicate waits on the unique index.
    """
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO processed_events (event_id) VALUES (%s) ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
            (event["event_id"],),
        )
        if await cur.fetchone() is None:
            return  # applied before: the duplicate is acknowledged and does nothing
        cur = await conn.execute(
            "UPDATE accounts SET balance_cents = balance_cents + %s WHERE id = %s",
            (event["amount_cents"], event["account_id"]),
        )
        if cur.rowcount == 0:
            raise UnknownAccount(f"event {event['event_id']}: no account {event['account_id']}")


# ----------------------------------------------------------------------------- recovery: the reaper and retention


async def reap_pending(
    pool,
    charge_with_key: Callable[[str, int, str], Awaitable[str]],
    *,
    older_than: float = 60.0,
    as_of: datetime | None = None,
    limit: int = 100,
) -> list[str]:
    """Re-drive claims stuck in ``pending`` longer than ``older_than`` seconds.

    A crash, or an uncertain failure of the charge (a timeout, a 5xx), left them there. Each
    row is leased first (``updated_at`` bumped under ``FOR UPDATE SKIP LOCKED``, so two
    reapers never take the same row), then charged **with the same idempotency key** (the
    provider answers with the charge it already made, if any) and finished like a request.
    A declined charge releases the key; a charge that is still uncertain stays pending and
    a later pass (after ``older_than`` again) retries it. ``as_of`` pretends the reaper runs
    at that time (defaults to the database's now()). Returns the keys it finished.
    """
    async with pool.connection() as conn:
        cur = await conn.execute(
            """
            UPDATE idempotency_keys SET updated_at = now()
            WHERE key IN (
                SELECT key FROM idempotency_keys
                WHERE status = 'pending'
                  AND updated_at < coalesce(%s::timestamptz, now()) - make_interval(secs => %s)
                ORDER BY updated_at
                LIMIT %s
                FOR UPDATE SKIP LOCKED)
            RETURNING key, request
            """,
            (as_of, older_than, limit),
        )
        rows = await cur.fetchall()
    done = []
    for key, request in rows:
        if request is None:  # nothing to re-drive with: let the client retry
            await release(pool, key)
            continue
        try:
            charge_id = await charge_with_key(request["customer"], request["amount_cents"], key)
        except ChargeDeclined:
            await release(pool, key)  # certain: the provider did not charge
            continue
        except Exception:  # noqa: BLE001 - still uncertain: the lease runs out and a later pass tries again
            continue
        await finish_order(pool, key, request, charge_id)
        done.append(key)
    return done


async def purge_expired(
    pool,
    *,
    retention: timedelta = timedelta(hours=24),
    batch: int = 1000,
    as_of: datetime | None = None,
    pause: float = 0.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> list[int]:
    """Delete finished keys older than ``retention`` in batches of ``batch``; rows deleted per batch.

    Each batch is its own short transaction (the pool is autocommit). A DELETE locks only the
    rows it deletes, so one huge DELETE would not block other keys; what it costs is one long
    transaction, which holds back VACUUM for the whole database while it runs, and one burst
    of WAL that replicas must replay (replica lag). ``pause`` seconds between batches let
    replicas catch up. ``SKIP LOCKED`` steps over rows another purge is deleting.
    """
    counts = []
    while True:
        async with pool.connection() as conn:
            cur = await conn.execute(
                """
                DELETE FROM idempotency_keys WHERE key IN (
                    SELECT key FROM idempotency_keys
                    WHERE status = 'done' AND created_at < coalesce(%s::timestamptz, now()) - %s
                    LIMIT %s
                    FOR UPDATE SKIP LOCKED)
                """,
                (as_of, retention, batch),
            )
            counts.append(cur.rowcount)
        if cur.rowcount < batch:
            return counts
        if pause:
            await sleep(pause)
