"""Chapter 03's reference code (course/idempotency.py, payments.py, orders_app.py) and its demos
(course/chapters/ch03.py) against live PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import httpx
import pytest

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


def test_03_failed_charge_releases_the_key(ns):
    async def go(pool):
        card = ch03.Card(delay=0, fail=[idem.ProviderError(503)])
        body = {"customer": "u4", "amount_cents": 100}
        with pytest.raises(idem.ProviderError):
            await idem.create_order(pool, "u-fail", body, card.charge)
        return await idem.create_order(pool, "u-fail", body, card.charge), card

    response, card = run(ns, go)
    assert len(card.calls) == 2 and response["charge_id"] == card.charged[0][0]


def test_03_two_sessions_second_insert_waits_on_first_transaction(ns):
    seen = asyncio.run(ch03.insert_wait_demo(ns.database_url))
    assert seen["b_wait"][:2] == ("Lock", "transactionid") and seen["b_wait"][2] == [seen["a_pid"]]
    assert seen["b_returned"] is None
    assert asyncio.run(ch03.insert_wait_demo(ns.database_url, first_finishes="rollback"))["b_returned"] == ("k",)


def test_03_consumer_outside_transaction_double_credits_after_a_crash(ns):
    async def go(pool):
        event = {"event_id": "t-crash-1", "account_id": 5, "amount_cents": 300}
        async with pool.connection() as conn:
            await ch03.arm_crash(conn, "dedup")
        log = await ch03.deliver(ch03.consume_outside_transaction, pool, event)
        bad = await balance(pool, 5)
        event = {"event_id": "t-crash-2", "account_id": 6, "amount_cents": 300}
        async with pool.connection() as conn:
            await ch03.arm_crash(conn, "dedup")
        await ch03.deliver(idem.consume_payment_event, pool, event)
        await asyncio.gather(*(idem.consume_payment_event(pool, event) for _ in range(4)))
        return log, bad, await balance(pool, 6)

    log, bad, good = run(ns, go)
    assert log[0].startswith("RaiseException") and log[-1] == "ok"
    assert bad == 600 and good == 300


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
        app = orders_app.make_app(pool, idem.create_order, card.charge)
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
            card.fail.append(idem.ProviderError(503))
            failed = await orders_app.post_order(http, "a3", body)
        return codes, busy, failed

    codes, busy, failed = run(ns, go)
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
    assert failed.status_code == 502


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
