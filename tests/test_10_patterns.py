"""Chapter 10's reference code (course/inventory.py, course/ledger.py) and its demos
(course/chapters/ch10.py) against live PostgreSQL and Redis."""

from __future__ import annotations

import random
from decimal import Decimal

import psycopg
import pytest

from course import inventory, ledger
from course.chapters import ch10
from course.idempotency import ChargeDeclined, IdempotencyKeyReused, ProviderError, SimulatedCrash
from course.kit import lab


@pytest.fixture(scope="module")
def ns():
    with lab.scratch_sync("t10") as namespace:
        with namespace.connect() as conn:
            conn.execute(inventory.SCHEMA)
            conn.execute(ledger.SCHEMA)
        yield namespace


def run(ns, fn):
    """Run ``fn(pool)`` in a fresh event loop with a pool of its own."""
    import asyncio

    async def main():
        pool = await ns.pool(min_size=12, max_size=12)
        try:
            return await fn(pool)
        finally:
            await ns.aclose()

    return asyncio.run(main())


async def _pay(buyer, sku, rid):
    return f"pay-{rid}"


def test_read_then_write_oversells_and_every_fix_sells_exactly_the_stock(ns):
    async def go(pool):
        return [await ch10.oversell(ns, pool, name, stock=1, buyers=6) for name in ch10.BUYERS]

    sales = run(ns, go)
    assert sales[0].sold == 6 and sales[0].left == 0
    assert [s.sold for s in sales[1:]] == [1, 1, 1, 1]
    assert sales[3].aborts == sales[4].aborts == 5  # REPEATABLE READ, SERIALIZABLE: each loser aborted once


def test_buy_sells_each_unit_once_and_a_repeated_key_buys_once(ns):
    async def go(pool):
        import asyncio

        await inventory.stock_item(pool, "p-mug", 2)
        got = await asyncio.gather(*(inventory.buy(pool, "p-mug", f"b{i}", f"p-mug-{i}", _pay) for i in range(6)))
        again = await inventory.buy(pool, "p-mug", "b0", "p-mug-0", _pay)
        return got, again, await inventory.sold(pool, "p-mug")

    got, again, sold = run(ns, go)
    assert sorted(g["status"] for g in got) == ["paid", "paid"] + ["sold_out"] * 4
    assert sold == {"paid": 2}
    assert again["status"] in ("paid", "sold_out")


async def _stock(pool, sku):
    async with pool.connection() as conn:
        return (await (await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s", (sku,))).fetchone())[0]


async def _later(pool):
    async with pool.connection() as conn:
        return (await (await conn.execute("SELECT now() + interval '1 hour'")).fetchone())[0]


def test_a_declined_payment_returns_the_unit_once_even_after_the_reaper(ns):
    async def go(pool):
        await inventory.stock_item(pool, "p-lamp", 1)

        async def nothing_charged(rid):
            return None

        async def reaper_then_decline(buyer, sku, rid):
            await inventory.release_expired(pool, nothing_charged, as_of=await _later(pool))
            raise ChargeDeclined(402)

        got = await inventory.buy(pool, "p-lamp", "ada", "p-lamp-1", reaper_then_decline)
        return got, await _stock(pool, "p-lamp")

    got, stock = run(ns, go)
    assert got["status"] == "payment_failed"
    assert stock == 1


def test_a_timed_out_payment_keeps_the_unit_until_the_provider_says_what_happened(ns):
    async def go(pool):
        charged = {}
        await inventory.stock_item(pool, "p-vase", 2)

        async def charged_then_timeout(buyer, sku, rid):
            charged[rid] = f"pay-{rid}"
            raise TimeoutError("no answer")

        async def never_reached(buyer, sku, rid):
            raise ProviderError(503)

        async def ask(rid):
            return charged.get(rid)

        first = await inventory.buy(pool, "p-vase", "ada", "p-vase-1", charged_then_timeout)
        second = await inventory.buy(pool, "p-vase", "bob", "p-vase-2", never_reached)
        held = await _stock(pool, "p-vase"), await inventory.sold(pool, "p-vase")
        reaped = await inventory.release_expired(pool, ask, as_of=await _later(pool))
        return first, second, held, reaped, await _stock(pool, "p-vase"), await inventory.sold(pool, "p-vase")

    first, second, held, reaped, stock, sold = run(ns, go)
    assert first["status"] == second["status"] == "payment_unknown"
    assert held == (0, {"held": 2})
    assert (reaped.paid, reaped.released) == ([first["reservation_id"]], [second["reservation_id"]])
    assert (stock, sold) == (1, {"paid": 1, "released": 1})


def test_the_reaper_leaves_a_reservation_held_when_the_provider_cannot_say(ns):
    async def go(pool):
        await inventory.stock_item(pool, "p-cup", 1)

        async def dies(buyer, sku, rid):
            raise SimulatedCrash("gone")

        async def provider_down(rid):
            raise ProviderError(503)

        with pytest.raises(SimulatedCrash):
            await inventory.buy(pool, "p-cup", "ada", "p-cup-1", dies)
        reaped = await inventory.release_expired(pool, provider_down, as_of=await _later(pool))
        return reaped, await inventory.sold(pool, "p-cup")

    reaped, sold = run(ns, go)
    assert len(reaped.unknown) == 1 and not reaped.released and sold == {"held": 1}


def test_a_purchase_of_several_units_and_a_key_reused_for_another_item(ns):
    async def go(pool):
        await inventory.stock_item(pool, "p-pen", 5)
        three = await inventory.buy(pool, "p-pen", "ada", "p-pen-1", _pay, quantity=3)
        too_many = await inventory.buy(pool, "p-pen", "bob", "p-pen-2", _pay, quantity=3)
        with pytest.raises(IdempotencyKeyReused):
            await inventory.buy(pool, "p-pen", "ada", "p-pen-1", _pay, quantity=1)
        return three, too_many, await _stock(pool, "p-pen")

    three, too_many, stock = run(ns, go)
    assert three["status"] == "paid" and too_many == {"status": "sold_out"} and stock == 2


def test_the_gate_lets_through_only_the_stock_and_reconcile_resets_it(ns):
    async def go(pool):
        run_ = await ch10.gate_demo(pool, ns.redis(), stock=3, buyers=40)
        await inventory.gate_take(ns.redis(), "gated")  # a buyer that passes the gate, then dies
        return run_, await inventory.reconcile_gate(pool, ns.redis(), "gated")

    run_, (before, after) = run(ns, go)
    assert (run_.db_calls, run_.sold, run_.turned_away) == (3, 3, 37)
    assert (before, after) == (0, 0)


def test_buckets_never_go_below_zero_and_sell_every_unit(ns):
    async def go(pool):
        import asyncio

        await inventory.stock_buckets(pool, "p-b", 10, 4)
        got = await asyncio.gather(*(inventory.take_from_buckets(pool, "p-b", 4, random.Random(i)) for i in range(14)))
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT min(stock), sum(stock) FROM inventory_buckets WHERE sku = 'p-b'")
            return got, await cur.fetchone()

    got, (least, left) = run(ns, go)
    assert sum(got) == 10 and least == 0 and left == 0


def test_transfer_balances_refuses_bad_amounts_and_is_idempotent(ns):
    async def go(pool):
        await ch10.fresh_ledger(pool, {1: ("a", 1_000), 2: ("b", 0)})
        tid = await ledger.transfer(pool, 1, 2, 300, "t-1")
        assert await ledger.transfer(pool, 1, 2, 300, "t-1") == tid
        with pytest.raises(IdempotencyKeyReused):
            await ledger.transfer(pool, 1, 2, 301, "t-1")
        for bad in (3.0, Decimal("3"), True):
            with pytest.raises(TypeError):
                await ledger.transfer(pool, 1, 2, bad, "t-bad")
        for bad in (0, -5):
            with pytest.raises(ValueError):
                await ledger.transfer(pool, 1, 2, bad, "t-bad")
        with pytest.raises(ledger.InsufficientFunds):
            await ledger.transfer(pool, 1, 2, 701, "t-over")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            async with pool.connection() as conn:
                await conn.execute("DELETE FROM ledger_postings")
        return await ledger.reconcile(pool)

    assert run(ns, go) == {"unbalanced": [], "drifted": [], "total": 0}


def test_a_transfer_between_two_currencies_is_refused_and_history_gives_a_past_balance(ns):
    async def go(pool):
        await ch10.fresh_ledger(pool, {1: ("a", 1_000), 2: ("b", 0)})
        await ledger.open_account(pool, 5, "usd wallet", currency="USD")
        with pytest.raises(ValueError, match="EUR"):
            await ledger.transfer(pool, 1, 5, 100, "fx-1")
        async with pool.connection() as conn:
            (before,) = await (await conn.execute("SELECT now()")).fetchone()
        await ledger.transfer(pool, 1, 2, 300, "later-1")
        return await ledger.balance_at(pool, 1, before), await ledger.balance_at(pool, 1, await _later(pool))

    assert run(ns, go) == (1_000, 700)


def test_reconcile_finds_a_drifted_balance_the_constraints_cannot_see(ns):
    async def go(pool):
        await ch10.fresh_ledger(pool, {1: ("a", 1_000), 2: ("b", 0)})
        async with pool.connection() as conn:
            await conn.execute("UPDATE ledger_accounts SET balance = balance + 5 WHERE id = 2")
        return await ledger.reconcile(pool)

    assert run(ns, go) == {"unbalanced": [], "drifted": [(2, 5, 0)], "total": 0}


def test_the_schema_refuses_an_overdraft_and_a_transfer_that_does_not_balance(ns):
    async def go(pool):
        await ch10.fresh_ledger(pool, {1: ("a", 1_000), 2: ("b", 0)})
        async with pool.connection() as conn:
            with pytest.raises(psycopg.errors.CheckViolation, match="ledger_no_overdraft"):
                await conn.execute("UPDATE ledger_accounts SET balance = balance - 1001 WHERE id = 1")
            with pytest.raises(psycopg.errors.CheckViolation, match="does not balance"):
                async with conn.transaction():
                    cur = await conn.execute(
                        "INSERT INTO ledger_transfers (key, request_hash) VALUES ('x', '-') RETURNING id"
                    )
                    (tid,) = await cur.fetchone()
                    await conn.execute(
                        "INSERT INTO ledger_postings (transfer_id, account_id, amount) VALUES (%s, 1, 7)", (tid,)
                    )
        return await ledger.reconcile(pool)

    assert run(ns, go) == {"unbalanced": [], "drifted": [], "total": 0}


def test_opposite_lock_order_deadlocks_and_id_order_does_not(ns):
    async def go(pool):
        await ch10.fresh_ledger(pool, {1: ("a", 1_000), 2: ("b", 1_000)})
        return await ch10.deadlock_demo(ns, ordered=False), await ch10.deadlock_demo(ns, ordered=True)

    crossed, ordered = run(ns, go)
    assert any("40P01" in line for line in crossed)
    assert not any("40P01" in line for line in ordered) and "no deadlock" in ordered[-1]


def test_an_exclusion_constraint_books_one_of_six_overlapping_slots_and_a_back_to_back_one(ns):
    got = run(ns, lambda pool: ch10.bookings_demo(pool, guests=6))
    assert got["crowd"].count("booked") == 1 and got["crowd"].count("refused (23P01)") == 5
    assert got["back_to_back"] == got["other_room"] == "booked"
