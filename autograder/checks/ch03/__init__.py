"""Hidden checks of chapter 03 (idempotency): ``create_order`` and ``consume_payment_event``.

Races here are real (concurrent callers on live PostgreSQL) and the verdicts are still
deterministic, because a :class:`~autograder.probes.Crowd` decides when the race moves on: the first charge
(or the account row the credits need) is held until every other caller has either
started a charge, been answered, gone to sleep in its retry backoff, or is blocked inside
PostgreSQL on a lock (seen in ``pg_stat_activity``). A check-then-insert therefore lets
all ten callers past its SELECT every time, not just when the timing happens to be bad.
Backoff sleeps run on a VirtualClock that the crowd advances only when nothing else can move.

Both tasks are graded as two replicas of a service (``r.replicas``): the concurrent callers
alternate between two copies of the answer that share no module state, as two processes
would, so a lock, dict or set kept in one process fails with the reason.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable

import psycopg

from autograder.harness import Report, error_line, task
from autograder.probes import SETTLE_LIMIT, Crowd, tally
from course.chapters.ch03 import arm_crash, crash_fired, install_crash_points
from course.idempotency import (
    ChargeDeclined,
    IdempotencyKeyReused,
    ProviderError,
    RequestInProgress,
    reap_pending,
    retry_in_progress,
    setup_schema,
)
from course.kit import lab
from course.kit.faults import VirtualClock
from course.retry import with_retry


class CheckCard:
    """The ``charge`` the check passes in: records calls, can fail, can hold in a crowd."""

    def __init__(self, crowd: Crowd | None = None, fail: list | None = None) -> None:
        self.crowd = crowd
        self.fail = list(fail or [])
        self.calls: list[tuple] = []
        self.callers: list[int | None] = []  # which crowd caller charged (its replica is caller % 2)
        self.charged: list[str] = []

    async def __call__(self, customer: str, amount_cents: int) -> str:
        self.calls.append((customer, amount_cents))
        self.callers.append(self.crowd._who.get() if self.crowd is not None else None)
        if self.crowd is not None:
            await self.crowd.hold()
        await asyncio.sleep(0)
        if self.fail:
            raise self.fail.pop(0)
        charge_id = f"ch_check_{len(self.charged) + 1:04d}"
        self.charged.append(charge_id)
        return charge_id


def _mentions(value, target: int) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, str)):
        return str(value) == str(target)
    if isinstance(value, dict):
        return any(_mentions(v, target) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_mentions(v, target) for v in value)
    return False


async def _orders(pool, customer: str) -> list[int]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id FROM orders WHERE customer = %s ORDER BY id", (customer,))
        return [row[0] for row in await cur.fetchall()]


async def _stored(pool, key: str):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT status, response FROM idempotency_keys WHERE key = %s", (key,))
        return await cur.fetchone()


REPLICAS = 2
IN_PROCESS = "state kept in one process is not shared"


def _per_replica(callers: list[int | None]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for caller in callers:
        if caller is not None:
            counts[caller % REPLICAS] = counts.get(caller % REPLICAS, 0) + 1
    return counts


def _retrying(create_order, pool, key: str, body: dict, charge, sleep, rand) -> Callable[[], Awaitable]:
    """A client that retries 409 "in progress" (and chapter 01's retryable errors) with backoff."""

    async def call():
        return await with_retry(
            lambda: create_order(pool, key, body, charge),
            retries=6,
            base_delay=0.1,
            max_delay=2.0,
            retryable=retry_in_progress,
            sleep=sleep,
            rand=rand,
        )

    return call


@task("create_order", points=6, title="idempotent order creation", timeout=60, seed=303)
async def check_create_order(r: Report, create_order) -> None:
    async with lab.scratch("ch03") as ns:
        pool = await ns.pool(max_size=14)
        await setup_schema(pool)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            await _check_create_order(r, create_order, pool, watcher)
        finally:
            await watcher.close()


async def _check_create_order(r: Report, create_order, pool, watcher) -> None:
    # --- one call, then the same call again ---------------------------------------------
    card = CheckCard()
    body = {"customer": "ada", "amount_cents": 1250}
    first = await create_order(pool, "key-ada-1", body, card)
    r.expect(
        isinstance(first, dict),
        f"create_order(pool, 'key-ada-1', {body}, charge) returned {first!r}"
        + ("" if isinstance(first, dict) else ", expected a dict"),
    )
    try:
        json.dumps(first)
        jsonable = True
    except (TypeError, ValueError):
        jsonable = False
    r.expect(jsonable, "the response is JSON-able" if jsonable else f"the response {first!r} is not JSON-able")
    r.expect(
        card.calls == [("ada", 1250)],
        "charge was called once, with ('ada', 1250)"
        if card.calls == [("ada", 1250)]
        else f"charge was called {len(card.calls)} time(s) with {card.calls}, expected once with ('ada', 1250)",
    )
    ids = await _orders(pool, "ada")
    r.expect(len(ids) == 1, f"orders has {len(ids)} row(s) for customer 'ada', expected 1")
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT charge_id FROM orders WHERE id = %s", (ids[0],))
        (stored_charge,) = await cur.fetchone()
    r.expect(
        stored_charge == card.charged[0],
        f"the order row holds charge_id {stored_charge!r}, the id charge returned",
        f"the order row holds charge_id {stored_charge!r}, expected {card.charged[0]!r}, the id charge returned: "
        "insert it with the order (customer, amount_cents, charge_id)",
    )
    r.expect(
        _mentions(first, ids[0]),
        f"the response names the order id {ids[0]}"
        if _mentions(first, ids[0])
        else f"the response {first} does not name the order id {ids[0]}: return a dict with it (e.g. 'order_id')",
    )
    again = await create_order(pool, "key-ada-1", body, card)
    n_orders = len(await _orders(pool, "ada"))
    repeat_ok = again == first and len(card.calls) == 1 and n_orders == 1
    r.expect(
        repeat_ok,
        "the same call again returned the stored response, with no new charge and no new order"
        if repeat_ok
        else f"the same call again returned {again!r}, charged {len(card.calls)} time(s) in all and left "
        f"{n_orders} order(s); expected the stored response, one charge, one order",
    )
    if r.public:
        return

    # --- ten concurrent calls with one key, on two replicas ----------------------------------
    replicas = r.replicas("create_order", REPLICAS)
    r.note("10 concurrent calls with key 'key-race', alternating between two replicas of create_order")
    r.note("(two copies of your answer cell sharing no module state, as two processes of the service);")
    r.note("a caller that gets RequestInProgress retries with backoff (chapter 01's with_retry, virtual clock)")
    crowd = Crowd(10, watcher)
    card = CheckCard(crowd)
    body = {"customer": "grace", "amount_cents": 4200}
    results = await crowd.run(
        lambda i: _retrying(replicas[i % REPLICAS], pool, "key-race", body, card, crowd.sleep, r.random.random)()
    )
    if crowd.stalls:
        r.note(
            f"the callers did not settle within {SETTLE_LIMIT:g} s of real time {crowd.stalls} time(s): "
            "some waited outside PostgreSQL (an asyncio.Lock, an Event, a real sleep). Raise RequestInProgress "
            "instead, or let PostgreSQL make them wait"
        )
    r.note(
        f"while the first charge was held: {crowd.charging_at_release} caller(s) inside charge, "
        f"{crowd.sleeping_at_release} backing off after 409, {crowd.blocked_at_release} waiting on a "
        "PostgreSQL lock"
    )
    per_replica = _per_replica(card.callers)
    if len(card.calls) > 1 and len(per_replica) == REPLICAS and all(n == 1 for n in per_replica.values()):
        r.fail(
            f"two replicas with one key: {len(card.calls)} charges; {IN_PROCESS}: each replica's own lock or "
            "memory let its first caller through. Claim the key in PostgreSQL (INSERT ... ON CONFLICT DO NOTHING "
            "RETURNING), which every replica sees"
        )
    ids = await _orders(pool, "grace")
    r.expect(
        len(card.calls) == 1,
        "the card was charged once"
        if len(card.calls) == 1
        else f"10 concurrent calls with one key: the card was charged {len(card.calls)} times, expected once. "
        + (
            "Several calls looked for the key, found nothing and charged: claim the key atomically "
            "(INSERT ... ON CONFLICT DO NOTHING RETURNING) before the charge"
            if len(card.calls) > 1
            else "no call charged"
        ),
    )
    r.expect(len(ids) == 1, f"10 concurrent calls with one key: {len(ids)} order(s) created, expected 1")
    answers = [x for x in results if not isinstance(x, BaseException)]
    r.expect(
        len(answers) == 10,
        f"all 10 callers got a response ({tally(results, ok='a response')})"
        if len(answers) == 10
        else f"10 concurrent calls with one key ended with: {tally(results, ok='a response')}; expected 10 responses. "
        "A caller that loses the claim returns the stored response, or raises RequestInProgress "
        "while the first call is still running (it is retried)",
    )
    distinct = {json.dumps(a, sort_keys=True, default=str) for a in answers}
    r.expect(
        len(distinct) == 1 and _mentions(answers[0], ids[0]),
        "all 10 responses are identical and name the order"
        if len(distinct) == 1 and _mentions(answers[0], ids[0])
        else f"the 10 responses are not one identical response naming order {ids[0]}: {sorted(distinct)[:3]}. "
        "Store the first response with the key and return that stored response to every repeat",
    )
    stored = await _stored(pool, "key-race")
    r.expect(
        stored is not None and stored[1] == answers[0],
        "idempotency_keys holds that response for 'key-race'"
        if stored is not None and stored[1] == answers[0]
        else f"idempotency_keys row for 'key-race' is {stored!r}; expected the response {answers[0]!r} stored in "
        "its response column",
    )

    # --- the same key with another body: another amount, then another customer -------------------
    for other in ({"customer": "grace", "amount_cents": 999}, {"customer": "hopper", "amount_cents": 4200}):
        try:
            got = await create_order(pool, "key-race", other, card)
            outcome = f"returned {got!r}"
            reused = False
        except Exception as err:  # noqa: BLE001 - any error is reported
            reused = isinstance(err, IdempotencyKeyReused) or getattr(err, "status", None) == 422
            outcome = f"raised {error_line(err)}"
        r.expect(
            reused,
            f"the same key with a different body ({other}) {outcome}"
            + (
                ""
                if reused
                else ": expected IdempotencyKeyReused (422). Compare a hash of the whole request body (every "
                "field) with the one stored for the key"
            ),
        )
    hopper = len(await _orders(pool, "hopper"))
    r.expect(
        len(card.calls) == 1 and len(await _orders(pool, "grace")) == 1 and hopper == 0,
        f"and they charged nothing: {len(card.calls)} charge(s), "
        f"{len(await _orders(pool, 'grace')) + hopper} order(s) in all",
    )

    # --- a declined charge releases the key -----------------------------------------------------
    clock = VirtualClock()
    card = CheckCard(fail=[ChargeDeclined(402, "the card was declined (402): nothing was charged")])
    body = {"customer": "linus", "amount_cents": 700}
    try:
        got = await create_order(pool, "key-declined", body, card)
        r.fail(
            f"charge raised ChargeDeclined(402) but create_order returned {got!r}: let the error reach the caller "
            "(after releasing the key)"
        )
    except Exception as err:  # noqa: BLE001
        r.ok(f"a declined charge: create_order raised {error_line(err)}")
    try:
        got = await _retrying(create_order, pool, "key-declined", body, card, clock.sleep, r.random.random)()
        outcome = None
    except Exception as err:  # noqa: BLE001
        got, outcome = None, err
    if outcome is not None:
        stuck = isinstance(outcome, RequestInProgress) or getattr(outcome, "status", None) == 409
        r.fail(
            f"after a declined charge, the next call with the same key raised {error_line(outcome)}"
            + (
                f" after {len(clock.sleeps)} retries: the key stayed claimed, so it is stuck forever. A decline is "
                "certain (nothing was charged): release the key (delete the pending row) when charge raises "
                "ChargeDeclined"
                if stuck
                else ""
            )
        )
    ids = await _orders(pool, "linus")
    r.expect(
        isinstance(got, dict) and len(card.calls) == 2 and len(ids) == 1 and _mentions(got, ids[0]),
        f"the next call with the same key charged again and succeeded: {len(card.calls)} charge attempt(s), "
        f"{len(ids)} order(s), response {got!r}",
    )

    # --- an uncertain failure keeps the key pending ---------------------------------------------
    for key, customer, error in (
        ("key-timeout", "ada-timeout", TimeoutError("the provider did not answer within 2 s")),
        ("key-5xx", "ada-5xx", ProviderError(500, "payment provider answered 500")),
    ):
        await _check_uncertain(r, create_order, pool, key, customer, error)
    await _check_store_crash(r, create_order, pool)
    await _check_distinct_keys(r, create_order, pool)


async def _check_uncertain(r: Report, create_order, pool, key: str, customer: str, error: Exception) -> None:
    card = CheckCard(fail=[error])
    body = {"customer": customer, "amount_cents": 1500}
    what = error_line(error)
    try:
        got = await create_order(pool, key, body, card)
        r.fail(f"charge raised {what} but create_order returned {got!r}: let the error reach the caller")
    except Exception as err:  # noqa: BLE001
        r.ok(f"an uncertain failure ({what}): create_order raised {error_line(err)}")
    stored = await _stored(pool, key)
    r.expect(
        stored is not None and stored[0] == "pending",
        f"the key stayed pending after {what}",
        f"after {what}, the key's row "
        + (
            "is gone: the key was released, but the charge may have gone through, so the client's retry would charge "
            "again. Release only when the provider declined (ChargeDeclined); otherwise keep the claim pending "
            "for the reaper"
            if stored is None
            else f"is {stored!r}; expected it still 'pending' (the outcome of the charge is unknown)"
        ),
    )
    calls = len(card.calls)
    try:
        got = await create_order(pool, key, body, card)
        outcome = f"returned {got!r}"
        busy = False
    except Exception as err:  # noqa: BLE001
        busy = isinstance(err, RequestInProgress) or getattr(err, "status", None) == 409
        outcome = f"raised {error_line(err)}"
    r.expect(
        busy and len(card.calls) == calls,
        f"the next call with '{key}' {outcome} and charged nothing",
        f"the next call with '{key}' {outcome} and made {len(card.calls) - calls} charge(s); expected "
        "RequestInProgress and no charge while the first outcome is unknown",
    )
    # the reaper (course.idempotency.reap_pending) re-drives it with the provider's key
    provider = CheckCard()

    async def keyed(customer: str, amount_cents: int, provider_key: str) -> str:
        return await provider(customer, amount_cents)

    async with pool.connection() as conn:
        cur = await conn.execute("SELECT request FROM idempotency_keys WHERE key = %s", (key,))
        row = await cur.fetchone()
    reaped = await reap_pending(pool, keyed, older_than=0)
    r.expect(
        key in reaped,
        f"the reaper re-drove '{key}' from its stored request and finished it",
        f"the reaper could not finish '{key}': "
        + (
            "its row was gone"
            if row is None
            else "its request column is empty, so it had nothing to charge again with and released the key. "
            "Store the body in idempotency_keys.request when you claim the key"
            if row[0] is None
            else f"its request column holds {row[0]!r}, expected the body {body}"
        ),
    )
    try:
        final = await create_order(pool, key, body, card)
    except Exception as err:  # noqa: BLE001
        final = err
    ids = await _orders(pool, customer)
    r.expect(
        isinstance(final, dict) and len(ids) == 1 and _mentions(final, ids[0]) and len(card.calls) == calls,
        f"after the reaper, the client's retry got the stored response for order {ids[0] if ids else '?'}",
        f"after the reaper finished '{key}', the client's retry got {final!r} with {len(ids)} order(s) and "
        f"{len(card.calls) - calls} new charge(s); expected the stored response and no charge",
    )


#: Triggers that kill one statement of the owner's last step, as a crash there would: the order's INSERT
#: (customer 'crash-order') or the UPDATE that stores the response (key 'key-crash-store').
STORE_CRASH = """
CREATE OR REPLACE FUNCTION ch03_check_crash() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'orders' THEN
        IF NEW.customer = 'crash-order' THEN
            RAISE EXCEPTION 'the check killed the service at this statement (%)', TG_TABLE_NAME;
        END IF;
    ELSIF NEW.key = 'key-crash-store' AND NEW.status = 'done' THEN
        RAISE EXCEPTION 'the check killed the service at this statement (%)', TG_TABLE_NAME;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER ch03_check_crash_orders BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION ch03_check_crash();
CREATE TRIGGER ch03_check_crash_keys BEFORE UPDATE ON idempotency_keys FOR EACH ROW EXECUTE FUNCTION ch03_check_crash();
"""


async def _check_store_crash(r: Report, create_order, pool) -> None:
    # --- a crash while the order is inserted or the response stored: both commit, or neither ----
    async with pool.connection() as conn:
        await conn.execute(STORE_CRASH)
    crashed = {}
    try:
        for key, customer, step in (
            ("key-crash-store", "crash-store", "storing the response"),
            ("key-crash-order", "crash-order", "inserting the order"),
        ):
            body = {"customer": customer, "amount_cents": 2100}
            card = CheckCard()
            try:
                got = await create_order(pool, key, body, card)
                crashed[key] = (customer, step, f"returned {got!r}")
            except Exception as err:  # noqa: BLE001 - the crash the check injected
                crashed[key] = (customer, step, f"raised {error_line(err)}")
    finally:
        async with pool.connection() as conn:
            await conn.execute(
                "DROP TRIGGER IF EXISTS ch03_check_crash_orders ON orders; "
                "DROP TRIGGER IF EXISTS ch03_check_crash_keys ON idempotency_keys"
            )
    for key, (customer, step, outcome) in crashed.items():
        if "the check killed the service" not in outcome:
            r.fail(
                f"the check stopped the service while {step} (a trigger on that statement), but create_order "
                f"{outcome}: let a database error reach the caller (and insert the order with INSERT INTO orders, "
                "store the response with an UPDATE of idempotency_keys)"
            )
        ids = await _orders(pool, customer)
        stored = await _stored(pool, key)
        half = (ids and (stored is None or stored[0] != "done")) or (
            not ids and stored is not None and stored[0] == "done"
        )
        r.expect(
            not half,
            f"killed while {step} (create_order {outcome}): no order and no stored response, the key still "
            f"{stored[0] if stored else 'released'}",
            f"killed while {step} (create_order {outcome}): {len(ids)} order(s) for the key, its row "
            f"{'is gone' if stored is None else repr(stored[0])}: half of the last step committed. "
            + (
                "The reaper (or the client's retry) finishes a pending key by inserting an order again: two orders "
                "for one key."
                if ids
                else "The stored response names an order that does not exist."
            )
            + " Insert the order and store the response in one transaction (async with conn.transaction():)",
        )
    provider = CheckCard()

    async def keyed(customer: str, amount_cents: int, provider_key: str) -> str:
        return await provider(customer, amount_cents)

    await reap_pending(pool, keyed, older_than=0)
    counts = {customer: len(await _orders(pool, customer)) for customer, _, _ in crashed.values()}
    r.expect(
        all(n <= 1 for n in counts.values()),
        f"after the reaper re-drove the crashed keys: orders per customer {counts}, none twice",
        f"after the reaper re-drove the crashed keys: orders per customer {counts}; one key made two orders "
        "(the order committed before the crash, the reaper made another): one transaction for the order and the "
        "stored response",
    )


async def _check_distinct_keys(r: Report, create_order, pool) -> None:
    # --- 100 distinct keys at once ---------------------------------------------------------------
    card = CheckCard()
    bodies = [{"customer": f"bulk-{i:03d}", "amount_cents": 100 + i} for i in range(100)]
    results = await asyncio.gather(
        *(create_order(pool, f"key-bulk-{i:03d}", b, card) for i, b in enumerate(bodies)), return_exceptions=True
    )
    answers = [x for x in results if not isinstance(x, BaseException)]
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*), count(DISTINCT customer) FROM orders WHERE customer LIKE 'bulk-%'")
        n_orders, n_customers = await cur.fetchone()
    r.expect(
        len(answers) == 100 and len(card.calls) == 100 and n_orders == 100 and n_customers == 100,
        f"100 distinct keys at once: {len(answers)} responses ({tally(results, ok='a response')}), {len(card.calls)} charges, "
        f"{n_orders} orders for {n_customers} customers; expected 100 of each",
    )


async def _balances(pool) -> dict[int, int]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, balance_cents FROM accounts ORDER BY id")
        return dict(await cur.fetchall())


async def _redeliver(consume, pool, event: dict, attempts: int = 4) -> tuple[bool, list[str]]:
    log = []
    for _ in range(attempts):
        try:
            await consume(pool, event)
        except Exception as err:  # noqa: BLE001 - a failed delivery is redelivered, like a broker would
            log.append(error_line(err))
            continue
        return True, log
    return False, log


async def _crowd_deliveries(consume, pool, watcher, ns, events: list[dict], account_ids: list[int]):
    """Deliver ``events`` concurrently while the check holds the accounts' rows; release once settled."""
    locker = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    try:
        await locker.execute("BEGIN")
        await locker.execute("SELECT id FROM accounts WHERE id = ANY(%s) FOR UPDATE", (account_ids,))

        async def release() -> None:
            await locker.execute("COMMIT")

        crowd = Crowd(len(events), watcher, on_settled=release)
        results = await crowd.run(lambda i: consume(pool, events[i]))
        if not crowd.released:
            await locker.execute("COMMIT")
    finally:
        await locker.close()
    failed = [events[i] for i, x in enumerate(results) if isinstance(x, BaseException)]
    errors = [x for x in results if isinstance(x, BaseException)]
    return crowd, failed, errors


@task("consume_payment_event", points=4, title="idempotent consumer", timeout=60, seed=304)
async def check_consume_payment_event(r: Report, consume_payment_event) -> None:
    async with lab.scratch("ch03") as ns:
        pool = await ns.pool(max_size=16)
        await setup_schema(pool)
        async with pool.connection() as conn:
            await conn.execute("INSERT INTO accounts (id, balance_cents) VALUES (1, 0), (2, 0), (3, 0), (4, 0)")
            await install_crash_points(conn)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            await _check_consume(r, consume_payment_event, pool, watcher, ns)
        finally:
            await watcher.close()


async def _check_consume(r: Report, consume, pool, watcher, ns) -> None:
    consume_payment_event = consume
    event = {"event_id": "evt-1", "account_id": 1, "amount_cents": 500}
    await consume_payment_event(pool, event)
    balances = await _balances(pool)
    r.expect(balances[1] == 500, f"one delivery of {event}: account 1 holds {balances[1]}, expected 500")
    await consume_payment_event(pool, event)
    balances = await _balances(pool)
    r.expect(balances[1] == 500, f"the same event delivered again: account 1 holds {balances[1]}, expected 500")
    if r.public:
        return

    # --- five concurrent deliveries, on two replicas ---------------------------------------------
    replicas = r.replicas("consume_payment_event", REPLICAS)

    turn = itertools.count()

    async def on_replicas(pool, event: dict) -> None:
        return await replicas[next(turn) % REPLICAS](pool, event)

    event = {"event_id": "evt-5x", "account_id": 2, "amount_cents": 1500}
    r.note(f"{event} delivered 5 times at once to two replicas of your consumer")
    r.note("(copies of your answer cell sharing no module state); account 2's row is held until every delivery")
    r.note("is blocked, done or waiting on a lock; a delivery that raises is redelivered")
    crowd, failed, errors = await _crowd_deliveries(on_replicas, pool, watcher, ns, [event] * 5, [2])
    for e in failed:
        ok, log = await _redeliver(consume, pool, e)
        r.expect(ok, f"a redelivery of {e['event_id']} kept failing: {log}")
    if errors:
        r.note(
            f"{len(errors)} of the 5 deliveries raised ({', '.join(sorted({error_line(x) for x in errors}))}) "
            "and were redelivered"
        )
    balances = await _balances(pool)
    if balances[2] == REPLICAS * 1500:
        r.fail(
            f"two replicas with one event: credited {REPLICAS} times; {IN_PROCESS}: each replica remembered the "
            "event in its own memory (or its own lock). Record the event id in processed_events, which every "
            "replica sees, in the transaction that credits the account"
        )
    r.expect(
        balances[2] == 1500,
        "five deliveries credited account 2 once: 1500"
        if balances[2] == 1500
        else f"five concurrent deliveries of one event left account 2 at {balances[2]}, expected 1500 "
        f"(credited {balances[2] / 1500:g} times). Record the event id with INSERT ... ON CONFLICT DO NOTHING "
        "in the transaction that credits the account, and credit only when the insert returned a row",
    )

    # --- crashes between the dedup record and the credit ----------------------------------------
    for where, event in (
        ("credit", {"event_id": "evt-crash-credit", "account_id": 3, "amount_cents": 700}),
        ("dedup", {"event_id": "evt-crash-dedup", "account_id": 4, "amount_cents": 900}),
    ):
        async with pool.connection() as conn:
            await arm_crash(conn, where)
        before = (await _balances(pool))[event["account_id"]]
        ok, log = await _redeliver(consume, pool, event)
        async with pool.connection() as conn:
            fired = await crash_fired(conn, where)
        statement = "UPDATE accounts" if where == "credit" else "INSERT INTO processed_events"
        r.expect(
            fired,
            f"crash injected at {statement} while consuming {event['event_id']}"
            if fired
            else f"the check arms a crash at {statement}, but consuming {event['event_id']} never ran it: "
            + (
                "credit with UPDATE accounts SET balance_cents = balance_cents + ..."
                if where == "credit"
                else "record the event id in processed_events"
            ),
        )
        r.expect(ok, f"{event['event_id']} was delivered until it succeeded: {log + ['ok'] if ok else log}")
        got = (await _balances(pool))[event["account_id"]] - before
        amount = event["amount_cents"]
        if got == 0 and ok and not log:
            r.fail(
                f"the crash at {statement} was swallowed: the delivery of {event['event_id']} returned normally, so "
                "the broker acknowledged it and the credit is lost. Let the error reach the caller"
            )
        if got == amount:
            r.ok(f"after a crash at {statement} and a redelivery, account {event['account_id']} was credited once")
        elif got == 0:
            r.fail(
                f"after a crash at {statement} and a redelivery, account {event['account_id']} was never credited: "
                "the dedup record was committed without the credit, so the redelivery skipped it. Do both in one "
                "transaction"
            )
        else:
            r.fail(
                f"after a crash at {statement} and a redelivery, account {event['account_id']} was credited "
                f"{got} ({got / amount:g} times {amount}): the credit was committed without its dedup record, so "
                "the redelivery credited again. Do both in one transaction"
            )

    # --- distinct events all apply -------------------------------------------------------------
    before = await _balances(pool)
    events = []
    for i in range(8):
        account = 1 + i % 4
        events.append(
            {"event_id": f"evt-batch-{i}", "account_id": account, "amount_cents": r.random.randint(1, 99) * 10}
        )
    deliveries = events + events[::3]  # some delivered twice
    r.note(
        f"{len(events)} distinct events on accounts 1-4 delivered at once to the two replicas, "
        f"{len(events[::3])} of them twice"
    )
    crowd, failed, errors = await _crowd_deliveries(on_replicas, pool, watcher, ns, deliveries, [1, 2, 3, 4])
    for e in failed:
        ok, log = await _redeliver(consume, pool, e)
        r.expect(ok, f"a redelivery of {e['event_id']} kept failing: {log}")
    after = await _balances(pool)
    expected = dict(before)
    for e in events:
        expected[e["account_id"]] += e["amount_cents"]
    delta = {a: after[a] - before[a] for a in after}
    want = {a: expected[a] - before[a] for a in after}
    r.expect(
        after == expected,
        "every distinct event applied once: credits per account " + str(delta)
        if after == expected
        # the accounts that end wrong are fixed by the held rows; by how much depends on which write lands last
        else f"distinct events delivered at once left account(s) {sorted(a for a in after if after[a] != expected[a])} "
        f"with another balance than the credits {want} per account: an update was lost or doubled (credit with "
        "balance_cents = balance_cents + amount, in one statement)",
    )


from autograder.checks.ch03.rules import REFERENCES, RULES  # noqa: E402 - the rule tables, kept beside the checks

__all__ = ["REFERENCES", "RULES"]

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 2
