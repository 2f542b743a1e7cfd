"""Chapter 03's reference code (course/idempotency.py, payments.py, orders_app.py) and its demos
(course/chapters/ch03.py) against live PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from psycopg.types.json import Jsonb

from course import idempotency as idem
from course import orders_app
from course.chapters import ch03
from course.kit import lab
from course.payments import PaymentProvider, PaymentsClient
from course.retry import is_retryable


@pytest.fixture(scope="module")
def ns():
    with lab.scratch_sync("t03") as namespace:
        with namespace.connect() as conn:
            conn.execute(idem.SCHEMA)
            conn.execute(ch03.DEMO_SCHEMA)
            conn.execute("INSERT INTO accounts (id) SELECT g FROM generate_series(1, 20) g")
            conn.execute(ch03.CRASH_POINTS)
        yield namespace


def run(ns, fn):
    """Run ``fn(pool)`` in a fresh event loop with a pool of its own."""

    async def main():
        pool = await ns.pool(max_size=12)
        try:
            return await fn(pool)
        finally:
            await ns.aclose()

    return asyncio.run(main())


async def balance(pool, account: int) -> int:
    async with pool.connection() as conn:
        return (await (await conn.execute("SELECT balance_cents FROM accounts WHERE id = %s", (account,))).fetchone())[
            0
        ]


def test_03_request_hash_ignores_key_order_not_values():
    assert idem.request_hash({"a": 1, "b": 2}) == idem.request_hash({"b": 2, "a": 1})
    assert idem.request_hash({"a": 1}) != idem.request_hash({"a": 2})


def test_03_409_in_progress_is_retried_here_but_not_by_chapter_01_rules():
    err = idem.RequestInProgress("k")
    assert err.status == 409 and not is_retryable(err) and idem.retry_in_progress(err)
    assert not idem.retry_in_progress(idem.IdempotencyKeyReused("k"))
    assert idem.retry_in_progress(idem.ProviderError(503))
    assert not idem.retry_in_progress(idem.ChargeDeclined())  # an answer, not a failure to get one


def test_03_check_then_insert_charges_every_concurrent_request(ns):
    async def go(pool):
        card = ch03.Card(delay=0.03)
        body = {"customer": "u1", "amount_cents": 100}
        await ch03.fire(5, lambda i: ch03.create_order_check_then_insert(pool, "u-cti", body, card.charge))
        return len(card.charged)

    assert run(ns, go) == 5


def test_03_claim_charges_once_and_every_caller_gets_the_same_answer(ns):
    async def go(pool):
        card = ch03.Card(delay=0.03)
        body = {"customer": "u2", "amount_cents": 100}
        results = await ch03.fire(
            8, lambda i: idem.call_with_retry(lambda: idem.create_order(pool, "u-claim", body, card.charge))
        )
        return card, results

    card, results = run(ns, go)
    assert len(card.charged) == 1
    assert all(r == results[0] for r in results) and results[0]["charge_id"] == card.charged[0][0]


def test_03_one_transaction_design_charges_once(ns):
    async def go(pool):
        card = ch03.Card(delay=0.03)
        body = {"customer": "u3", "amount_cents": 100}
        results = await ch03.fire(6, lambda i: ch03.create_order_one_transaction(pool, "u-1tx", body, card.charge))
        return card, results

    card, results = run(ns, go)
    assert len(card.charged) == 1 and all(r == results[0] for r in results)


async def _status(pool, key: str):
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT status FROM idempotency_keys WHERE key = %s", (key,))).fetchone()
    return None if row is None else row[0]


def test_03_a_declined_charge_releases_the_key(ns):
    async def go(pool):
        card = ch03.Card(delay=0, fail=[idem.ChargeDeclined()])
        body = {"customer": "u4", "amount_cents": 100}
        with pytest.raises(idem.ChargeDeclined):
            await idem.create_order(pool, "u-declined", body, card.charge)
        released = await _status(pool, "u-declined")
        return released, await idem.create_order(pool, "u-declined", body, card.charge), card

    released, response, card = run(ns, go)
    assert released is None and len(card.calls) == 2 and response["charge_id"] == card.charged[0][0]


@pytest.mark.parametrize("design", ["pending-row", "one-transaction"])
def test_03_an_uncertain_failure_keeps_the_key_pending_until_the_reaper_finishes_it(ns, design):
    create = idem.create_order if design == "pending-row" else ch03.create_order_one_transaction
    key = f"u-uncertain-{design}"

    async def go(pool):
        card = ch03.Card(delay=0, fail=[TimeoutError("no answer in 2 s")])
        body = {"customer": key, "amount_cents": 100}
        with pytest.raises(TimeoutError):
            await create(pool, key, body, card.charge)
        pending = await _status(pool, key)
        with pytest.raises(idem.RequestInProgress):
            await create(pool, key, body, card.charge)
        keyed = []

        async def charge_keyed(customer, cents, provider_key):
            keyed.append(provider_key)
            return "ch_from_the_provider"

        later = datetime.now(UTC) + timedelta(seconds=90)
        reaped = await idem.reap_pending(pool, charge_keyed, as_of=later)
        final = await create(pool, key, body, card.charge)
        return pending, reaped, keyed, final, card

    pending, reaped, keyed, final, card = run(ns, go)
    assert pending == "pending" and key in reaped and keyed == [key]
    assert len(card.calls) == 1 and final["charge_id"] == "ch_from_the_provider"


def test_03_the_reaper_releases_a_key_the_provider_declines_and_keeps_an_uncertain_one(ns):
    async def go(pool):
        for key in ("u-reap-declined", "u-reap-unsure"):
            async with pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO idempotency_keys (key, request_hash, request, updated_at) "
                    "VALUES (%s, 'h', %s, now() - interval '5 minutes')",
                    (key, Jsonb({"customer": key, "amount_cents": 1})),
                )

        async def provider(customer, cents, key):
            if key == "u-reap-declined":
                raise idem.ChargeDeclined()
            raise idem.ProviderError(502)

        reaped = await idem.reap_pending(pool, provider, older_than=60)
        states = [await _status(pool, k) for k in ("u-reap-declined", "u-reap-unsure")]
        async with pool.connection() as conn:
            await conn.execute("DELETE FROM idempotency_keys WHERE key LIKE 'u-reap-%'")
        return reaped, states

    reaped, states = run(ns, go)
    assert reaped == [] and states == [None, "pending"]


def test_03_two_replicas_with_an_in_process_lock_charge_twice(ns):
    async def go(pool):
        one, two = ch03.make_locked_create_order(), ch03.make_locked_create_order()
        card = ch03.Card(delay=0.03)
        body = {"customer": "u-rep", "amount_cents": 100}
        await ch03.fire(6, lambda i: one(pool, "u-rep-1", body, card.charge))
        single = len(card.charged)
        await ch03.fire(6, lambda i: (one, two)[i % 2](pool, "u-rep-2", body, card.charge))
        return single, len(card.charged) - single

    assert run(ns, go) == (1, 2)


def test_03_two_sessions_second_insert_waits_on_first_transaction(ns):
    seen = asyncio.run(ch03.insert_wait_demo(ns.database_url))
    assert seen["b_wait"][:2] == ("Lock", "transactionid") and seen["b_wait"][2] == [seen["a_pid"]]
    assert seen["b_returned"] is None
    assert asyncio.run(ch03.insert_wait_demo(ns.database_url, first_finishes="rollback"))["b_returned"] == ("k",)


def test_03_consumers_with_two_commits_lose_or_double_a_credit_after_a_crash(ns):
    async def go(pool):
        out = {}
        for account, (consume, crash) in enumerate(
            [
                (ch03.consume_dedup_first, "credit"),
                (ch03.consume_credit_first, "dedup"),
                (idem.consume_payment_event, "dedup"),
                (idem.consume_payment_event, "credit"),
            ],
            start=5,
        ):
            event = {"event_id": f"t-crash-{account}", "account_id": account, "amount_cents": 300}
            async with pool.connection() as conn:
                await ch03.arm_crash(conn, crash)
            log = await ch03.deliver(consume, pool, event)
            await asyncio.gather(*(consume(pool, event) for _ in range(3)))
            out[(consume.__name__, crash)] = (log, await balance(pool, account) // 300)
        return out

    out = run(ns, go)
    assert out[("consume_dedup_first", "credit")][1] == 0  # the record committed, the credit lost
    assert out[("consume_credit_first", "dedup")][1] == 2  # the credit committed twice
    assert out[("consume_payment_event", "dedup")][1] == 1 and out[("consume_payment_event", "credit")][1] == 1
    log = out[("consume_credit_first", "dedup")][0]
    assert log[0].startswith("RaiseException") and log[-1] == "ok"


def test_03_reaper_redrives_a_crashed_claim_with_the_same_provider_key(ns):
    async def go(pool, provider):
        client = PaymentsClient(provider.url)

        async def charge_then_crash(customer, cents):
            await client.charge(customer, cents, idempotency_key="t-reap")
            raise idem.SimulatedCrash

        body = {"customer": "u5", "amount_cents": 4200}
        with pytest.raises(idem.SimulatedCrash):
            await idem.create_order(pool, "t-reap", body, charge_then_crash)
        with pytest.raises(idem.RequestInProgress):
            await idem.create_order(pool, "t-reap", body, client.charge_with_key("t-reap"))
        assert await idem.reap_pending(pool, client.charge_keyed) == []  # too young to reap
        later = datetime.now(UTC) + timedelta(seconds=90)
        assert await idem.reap_pending(pool, client.charge_keyed, as_of=later) == ["t-reap"]
        return await idem.create_order(pool, "t-reap", body, client.charge_with_key("t-reap"))

    with PaymentProvider(latency=0) as provider:
        response = run(ns, lambda pool: go(pool, provider))
        assert [c[0] for c in provider.statement()] == [response["charge_id"]]
        assert provider.replayed == 1


def test_03_purge_deletes_old_finished_keys_in_batches(ns):
    async def go(pool):
        async with pool.connection() as conn:
            await conn.execute(
                "INSERT INTO idempotency_keys (key, request_hash, status, response, created_at) "
                "SELECT 'purge-' || g, 'h', CASE WHEN g <= 25 THEN 'done' ELSE 'pending' END, '{}', "
                "now() - interval '3 days' FROM generate_series(1, 30) g"
            )
        batches = await idem.purge_expired(pool, batch=10)
        async with pool.connection() as conn:
            left = (
                await (await conn.execute("SELECT count(*) FROM idempotency_keys WHERE key LIKE 'purge-%'")).fetchone()
            )[0]
        return batches, left

    batches, left = run(ns, go)
    assert batches == [10, 10, 5] and left == 5  # pending rows are the reaper's, not the purge's


def test_03_client_generated_id_upsert(ns):
    async def go(pool):
        oid = "6f1c2a4e-0000-4000-8000-000000000001"
        first = await ch03.create_client_order(pool, oid, {"customer": "u6", "amount_cents": 10})
        second = await ch03.create_client_order(pool, oid, {"customer": "u6", "amount_cents": 10})
        with pytest.raises(idem.IdempotencyKeyReused):
            await ch03.create_client_order(pool, oid, {"customer": "u6", "amount_cents": 11})
        return first, second

    first, second = run(ns, go)
    assert first["created"] and not second["created"] and first["order_id"] == second["order_id"]


def test_03_orders_app_status_codes(ns):
    async def go(pool):
        card = ch03.Card(delay=0)
        app = orders_app.make_app(idem.create_order, card.charge, pool=pool)
        body = {"customer": "u7", "amount_cents": 100}
        async with orders_app.client(app) as http:
            codes = {
                "no key": (await orders_app.post_order(http, None, body)).status_code,
                "bad body": (await orders_app.post_order(http, "a1", {"customer": "u7"})).status_code,
                "created": (await orders_app.post_order(http, "a1", body)).status_code,
                "replay": (await orders_app.post_order(http, "a1", body)).status_code,
                "other body": (await orders_app.post_order(http, "a1", dict(body, amount_cents=5))).status_code,
                "wrong path": (await http.post("/nope")).status_code,
                "wrong method": (await http.get("/orders")).status_code,
            }
            async with pool.connection() as conn:
                await conn.execute(
                    "INSERT INTO idempotency_keys (key, request_hash) VALUES ('a2', %s)", (idem.request_hash(body),)
                )
            busy = await orders_app.post_order(http, "a2", body)
            card.fail.append(idem.ChargeDeclined())
            declined = await orders_app.post_order(http, "a3", body)
            card.fail.append(idem.ProviderError(503))
            unsure = await orders_app.post_order(http, "a4", body)
            after = await orders_app.post_order(http, "a4", body)
        async with pool.connection() as conn:
            await conn.execute("DELETE FROM idempotency_keys WHERE key IN ('a2', 'a4')")
        return codes, busy, declined, unsure, after

    codes, busy, declined, unsure, after = run(ns, go)
    assert codes == {
        "no key": 400,
        "bad body": 400,
        "created": 201,
        "replay": 201,
        "other body": 422,
        "wrong path": 404,
        "wrong method": 405,
    }
    assert busy.status_code == 409 and busy.headers["retry-after"] == "1"
    assert declined.status_code == 402
    assert unsure.status_code == 502 and after.status_code == 409  # the key waits for the reaper


def test_03_the_served_orders_app_opens_its_own_pool_and_says_not_done_for_a_stub(ns):
    from course.kit.notebook import not_done
    from course.kit.serve import Service

    async def stub(pool, idempotency_key, body, charge):
        raise NotImplementedError("not done yet")

    async def go(url):
        body = {"customer": "u8", "amount_cents": 100}
        async with httpx.AsyncClient(base_url=url) as http:
            created = await orders_app.post_order(http, "served-1", body)
            replay = await orders_app.post_order(http, "served-1", body)
        return created, replay

    card = ch03.Card(delay=0)
    with Service(orders_app.make_app(idem.create_order, card.charge, database_url=ns.database_url), name="t03") as svc:
        created, replay = asyncio.run(go(svc.url))
    assert created.status_code == 201 and replay.json() == created.json() and len(card.charged) == 1

    async def mine(url):
        async with httpx.AsyncClient(base_url=url) as http:
            try:
                await orders_app.post_order_with_retry(http, "served-2", {"customer": "u8", "amount_cents": 1})
            except httpx.HTTPStatusError as err:
                return err

    with Service(orders_app.make_app(stub, card.charge, database_url=ns.database_url), name="t03") as svc:
        err = asyncio.run(mine(svc.url))
    assert err.response.status_code == 501 and not_done(err) == "stub"


def test_03_provider_honours_its_idempotency_key():
    async def go(provider):
        client = PaymentsClient(provider.url)
        first = await client.charge("p", 100, idempotency_key="pk")
        again = await client.charge("p", 100, idempotency_key="pk")
        with pytest.raises(idem.ProviderError) as reused:
            await client.charge("p", 999, idempotency_key="pk")
        provider.fail_next(1)
        with pytest.raises(idem.ProviderError) as down:
            await client.charge("p", 100)
        provider.drop_responses(1)
        with pytest.raises(httpx.TransportError):
            await client.charge("p", 100, idempotency_key="lost")
        replay = await client.charge("p", 100, idempotency_key="lost")
        return first, again, reused.value.status, down.value.status, replay

    with PaymentProvider(latency=0) as provider:
        first, again, reused, down, replay = asyncio.run(go(provider))
        assert first == again and reused == 422 and down == 503
        assert len(provider.charges) == 2 and replay == provider.charges[1].id


def test_03_provider_replays_a_declined_card_instead_of_trying_it_again():
    async def go(provider):
        client = PaymentsClient(provider.url)
        provider.decline_next(1)
        errors = []
        for _ in range(2):
            with pytest.raises(idem.ChargeDeclined) as declined:
                await client.charge("d", 100, idempotency_key="declined-key")
            errors.append(declined.value.status)
        attempts = provider.attempts
        fresh = await client.charge("d", 100, idempotency_key="new-key")
        return errors, attempts, fresh

    with PaymentProvider(latency=0) as provider:
        errors, attempts, fresh = asyncio.run(go(provider))
        assert errors == [402, 402] and attempts == 1 and provider.replayed == 1
        assert [c[0] for c in provider.statement()] == [fresh]


def test_03_provider_answers_409_while_the_first_request_runs():
    async def go(provider):
        client = PaymentsClient(provider.url)
        results = await asyncio.gather(
            client.charge("q", 100, idempotency_key="busy"),
            client.charge("q", 100, idempotency_key="busy"),
            return_exceptions=True,
        )
        return results

    with PaymentProvider(latency=0.1) as provider:
        results = asyncio.run(go(provider))
        statuses = sorted(getattr(r, "status", 200) for r in results)
        assert statuses == [200, 409] and len(provider.charges) == 1
