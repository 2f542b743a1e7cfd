"""A double-entry ledger that balances under concurrency (chapter 10).

Every movement of money is a **transfer**: one row in ``ledger_transfers`` and postings in
``ledger_postings`` that sum to zero (minus on one account, plus on the other; a deferred
constraint trigger refuses, at commit, a transfer that does not). Postings are
**append-only** (a trigger refuses UPDATE and DELETE): a mistake is corrected by a new,
opposite transfer, never by editing history. Amounts are **integers in minor units**
(cents) of the account's one currency (``ledger_accounts.currency``; a transfer between two
currencies is refused: a conversion is two transfers through an exchange account); a float or
a Decimal is refused before it reaches the database.

Each account caches its balance (``ledger_accounts.balance``), updated in the same
transaction as the postings; the overdraft check is the ``WHERE`` of that update
(``balance >= amount``), so it holds under any concurrency; a ``CHECK`` on the account is
the backstop for code that forgets it. Both accounts are locked **in
id order**, so two transfers in opposite directions never wait on each other in a cycle
(the deadlock the chapter shows live). The transfer row carries the caller's idempotency
key under a unique constraint: a retried transfer finds the first one (chapter 03's claim),
and the same key with a different request raises
:class:`course.idempotency.IdempotencyKeyReused`.

:func:`reconcile` is the check a job runs all day: every transfer sums to zero, every
cached balance equals the sum of its postings, all accounts together sum to zero.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal

import psycopg

from course.backoff import FullJitter
from course.idempotency import IdempotencyKeyReused, request_hash

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_accounts (
    id             bigint PRIMARY KEY,
    name           text NOT NULL,
    balance        bigint NOT NULL DEFAULT 0,
    allow_negative boolean NOT NULL DEFAULT false,
    currency       text NOT NULL DEFAULT 'EUR' CHECK (currency ~ '^[A-Z]{3}$'),  -- ISO 4217: one per account
    -- the backstop: code that skips the overdraft check fails here instead of going negative
    CONSTRAINT ledger_no_overdraft CHECK (allow_negative OR balance >= 0)
);
CREATE TABLE IF NOT EXISTS ledger_transfers (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key          text NOT NULL UNIQUE,
    request_hash text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS ledger_postings (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    transfer_id bigint NOT NULL REFERENCES ledger_transfers (id),
    account_id  bigint NOT NULL REFERENCES ledger_accounts (id),
    amount      bigint NOT NULL CHECK (amount <> 0)
);
CREATE INDEX IF NOT EXISTS ledger_postings_account ON ledger_postings (account_id);
CREATE INDEX IF NOT EXISTS ledger_postings_transfer ON ledger_postings (transfer_id);

CREATE OR REPLACE FUNCTION ledger_postings_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'ledger_postings is append-only: % refused; post a correcting transfer instead', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END $$;
CREATE OR REPLACE TRIGGER ledger_postings_append_only
    BEFORE UPDATE OR DELETE OR TRUNCATE ON ledger_postings
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_postings_append_only();

-- checked at COMMIT, when all of a transfer's postings are in: a transfer that does not sum to
-- zero cannot commit
CREATE OR REPLACE FUNCTION ledger_transfer_balances() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    total numeric;
BEGIN
    SELECT sum(amount) INTO total FROM ledger_postings WHERE transfer_id = NEW.transfer_id;
    IF total <> 0 THEN
        RAISE EXCEPTION 'transfer % does not balance: its postings sum to %, not 0', NEW.transfer_id, total
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'ledger_transfer_balances'
                   AND tgrelid = 'ledger_postings'::regclass) THEN
        CREATE CONSTRAINT TRIGGER ledger_transfer_balances AFTER INSERT ON ledger_postings
            DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION ledger_transfer_balances();
    END IF;
END $$;
"""


async def setup_schema(pool_or_conn) -> None:
    """Create the ledger's tables and the append-only trigger (idempotent)."""
    from course.kit.lab import connection

    async with connection(pool_or_conn) as conn:
        await conn.execute(SCHEMA)


#: A transaction PostgreSQL rolled back so that it can run again: a serialization failure
#: (40001) or a deadlock (40P01). In psycopg these are two siblings, not subclasses of
#: ``TransactionRollback``, so catch them by name.
RETRYABLE = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)


#: The wait before retry k of a transfer PostgreSQL aborted: full jitter, 5 ms doubling to 200 ms (chapter 01).
RETRY_BACKOFF = FullJitter(base=0.005, cap=0.2)


class InsufficientFunds(Exception):
    """The source account may not go below zero and holds less than the amount."""


def check_amount(amount) -> int:
    """``amount`` if it is a positive ``int`` of minor units; TypeError or ValueError otherwise.

    A float cannot hold 0.10 exactly and a Decimal carries fractions of a cent: both are
    refused here, before any row is written, rather than rounded somewhere later.
    """
    if isinstance(amount, bool) or not isinstance(amount, int):
        kind = "Decimal" if isinstance(amount, Decimal) else type(amount).__name__
        raise TypeError(f"amount must be an int of minor units (cents), not {kind} {amount!r}")
    if amount <= 0:
        raise ValueError(f"amount must be positive, got {amount}")
    return amount


async def open_account(
    pool, account_id: int, name: str, *, allow_negative: bool = False, currency: str = "EUR"
) -> None:
    """Create an account at zero in one ``currency`` (system accounts such as a bank's may go negative)."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO ledger_accounts (id, name, allow_negative, currency) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (id) DO NOTHING",
            (account_id, name, allow_negative, currency),
        )


async def _stored(conn, key: str, req_hash: str) -> int:
    cur = await conn.execute("SELECT id, request_hash FROM ledger_transfers WHERE key = %s", (key,))
    tid, stored_hash = await cur.fetchone()
    if stored_hash != req_hash:
        raise IdempotencyKeyReused(key, f"key {key!r} was first used for a different transfer")
    return tid


async def transfer_once(pool, from_id: int, to_id: int, amount: int, key: str) -> int:
    """One attempt of :func:`transfer` (a deadlock or serialization failure propagates)."""
    req_hash = request_hash({"from": from_id, "to": to_id, "amount": amount})
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO ledger_transfers (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING "
            "RETURNING id",
            (key, req_hash),
        )
        row = await cur.fetchone()
        if row is None:  # a repeat of a transfer that committed
            return await _stored(conn, key, req_hash)
        (tid,) = row
        # lock both accounts in id order: opposite transfers queue, they never wait in a cycle
        cur = await conn.execute(
            "SELECT id, currency FROM ledger_accounts WHERE id = ANY(%s) ORDER BY id FOR NO KEY UPDATE",
            ([from_id, to_id],),
        )
        found = dict(await cur.fetchall())
        if set(found) != {from_id, to_id}:
            raise LookupError(f"no account {sorted({from_id, to_id} - set(found))}")
        if found[from_id] != found[to_id]:  # a conversion is two transfers, through an exchange account
            raise ValueError(f"account {from_id} holds {found[from_id]}, account {to_id} {found[to_id]}")
        cur = await conn.execute(
            "UPDATE ledger_accounts SET balance = balance - %s WHERE id = %s "
            "AND (allow_negative OR balance >= %s)",
            (amount, from_id, amount),
        )
        if cur.rowcount == 0:
            raise InsufficientFunds(f"account {from_id} holds less than {amount}")  # rolls the transfer back
        await conn.execute("UPDATE ledger_accounts SET balance = balance + %s WHERE id = %s", (amount, to_id))
        await conn.execute(
            "INSERT INTO ledger_postings (transfer_id, account_id, amount) VALUES (%s, %s, %s), (%s, %s, %s)",
            (tid, from_id, -amount, tid, to_id, amount),
        )
        return tid


async def transfer(pool, from_id: int, to_id: int, amount: int, key: str, *, attempts: int = 5) -> int:
    """Move ``amount`` minor units from ``from_id`` to ``to_id`` once per ``key``; the transfer id.

    Raises TypeError / ValueError for a non-integer or non-positive amount,
    :class:`InsufficientFunds` when ``from_id`` may not go negative and holds too little,
    :class:`~course.idempotency.IdempotencyKeyReused` for a key first used for another transfer.
    Locking in id order prevents deadlocks between this function's callers; a deadlock with
    other code (40P01) or a serialization failure (40001) is retried, ``attempts`` times at most.
    """
    check_amount(amount)
    if from_id == to_id:
        raise ValueError("a transfer needs two different accounts")
    for attempt in range(attempts):
        try:
            return await transfer_once(pool, from_id, to_id, amount, key)
        except RETRYABLE:  # 40001 and 40P01: the whole transaction can run again
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(RETRY_BACKOFF.delay(attempt))  # jittered: the two losers do not meet again
    raise AssertionError("unreachable")


async def balance_at(pool, account_id: int, at) -> int:
    """The balance of ``account_id`` as it stood at ``at``: the sum of its postings of transfers made by then.

    Postings are never edited, so the history answers questions about the past; the cached
    balance only knows the present. ``created_at`` is when the transfer's transaction began, so
    a transfer that began before ``at`` and committed just after it is counted.
    """
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT coalesce(sum(p.amount), 0) FROM ledger_postings p JOIN ledger_transfers t ON t.id = p.transfer_id "
            "WHERE p.account_id = %s AND t.created_at <= %s",
            (account_id, at),
        )
        (total,) = await cur.fetchone()
    return int(total)


async def reconcile(pool) -> dict:
    """What the ledger's own books say is wrong (empty lists when all is well).

    ``unbalanced``: transfers whose postings do not sum to zero, as ``(transfer_id, sum)``;
    ``drifted``: accounts whose cached balance differs from the sum of their postings, as
    ``(account_id, cached, from_postings)``; ``total``: the sum of every posting (0).
    """
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT t.id, coalesce(sum(p.amount), 0) "
            "FROM ledger_transfers t LEFT JOIN ledger_postings p ON p.transfer_id = t.id GROUP BY t.id "
            "HAVING coalesce(sum(p.amount), 0) <> 0 ORDER BY t.id"
        )
        unbalanced = [(tid, int(total)) for tid, total in await cur.fetchall()]
        cur = await conn.execute(
            "SELECT a.id, a.balance, coalesce(sum(p.amount), 0) "
            "FROM ledger_accounts a LEFT JOIN ledger_postings p ON p.account_id = a.id GROUP BY a.id "
            "HAVING a.balance <> coalesce(sum(p.amount), 0) ORDER BY a.id"
        )
        drifted = [(aid, int(cached), int(posted)) for aid, cached, posted in await cur.fetchall()]
        cur = await conn.execute("SELECT coalesce(sum(amount), 0) FROM ledger_postings")
        (total,) = await cur.fetchone()
    return {"unbalanced": unbalanced, "drifted": drifted, "total": int(total)}
