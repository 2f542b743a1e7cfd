"""Chapter 06's patterns and demos against the live servers: the saga orchestrator, the outbox
relay, CDC from a slot, two-phase commit, and the crash tool the checks rely on."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from course import cdc, outbox, saga
from course.chapters.ch06 import events, sagas, shop, slots, twopc
from course.chapters.ch06.crashes import CrashPlan
from course.idempotency import SimulatedCrash
from course.kit.faults import VirtualClock


@pytest.fixture
async def shop_ns(ans):
    pool = await ans.pool(max_size=8)
    await saga.setup_schema(pool)
    await outbox.setup_schema(pool)
    await shop.setup_schema(pool)
    control = await psycopg.AsyncConnection.connect(ans.database_url, autocommit=True)
    plan = await CrashPlan.install(control, shop.SAGA_TABLES + ("ch06_orders", "outbox"))
    yield ans, pool, plan
    await control.close()


async def _needs(ns, what: str) -> None:
    """Skip when the server lacks a setting (servers of your own; the course's have both)."""
    async with await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True) as conn:
        ok, why = await (twopc.supported(conn) if what == "2pc" else cdc.available(conn))
    if not ok:
        pytest.skip(why)


def _dying_sleep(plan: CrashPlan, order: dict, clock: VirtualClock):
    """The sleep of a process that has died: once its crash fired, it never returns."""

    async def sleep(seconds: float) -> None:
        if await plan.fired(order):
            raise SimulatedCrash("dead")
        await clock.sleep(seconds)

    return sleep


async def test_a_saga_logs_every_decision_and_completes(shop_ns):
    _, pool, _ = shop_ns
    (order,) = await sagas.demo_orders(pool, "accepted")
    assert await saga.Orchestrator(shop.ORDER_SAGA).run(pool, order["order_id"], order) == "completed"
    events_ = [(s, e) for s, e, _ in await saga.history(pool, order["order_id"])]
    assert events_[0] == ("saga", "begin") and events_[-1] == ("saga", "completed")
    assert [e for s, e in events_ if s == "charge_payment"] == ["started", "done"]
    assert saga.user_status(saga.read_state(await saga.history(pool, order["order_id"]))) == "confirmed"


async def test_a_business_no_compensates_the_started_steps_in_reverse_order(shop_ns):
    _, pool, _ = shop_ns
    (order,) = await sagas.demo_orders(pool, "unshippable")
    before = await shop.effects(pool, order)
    assert await saga.Orchestrator(shop.ORDER_SAGA).run(pool, order["order_id"], order) == "compensated"
    assert [st for _, _, st in await shop.audit(pool, [order["order_id"]])] == [
        "reserved",
        "charged",
        "refunded",
        "released",
    ]
    assert shop.outcome(order, before, await shop.effects(pool, order))[0] == "compensated"


async def test_a_failing_compensation_is_retried_until_it_succeeds(shop_ns):
    _, pool, plan = shop_ns
    (order,) = await sagas.demo_orders(pool, "unshippable")
    await plan.flaky("refund", 2)
    orch = saga.Orchestrator(shop.ORDER_SAGA, sleep=VirtualClock().sleep)
    assert await orch.run(pool, order["order_id"], order) == "compensated"
    await plan.flaky("refund", 0)
    assert [step for step, _ in orch.retries] == ["charge_payment", "charge_payment"]
    assert (await shop.effects(pool, order))["payment"] == "refunded"


@pytest.mark.parametrize("at", [2, 9, 13, 16])
async def test_recovery_finishes_a_saga_that_crashed_before_any_write(shop_ns, at):
    _, pool, plan = shop_ns
    (order,) = await sagas.demo_orders(pool, "unshippable")
    before = await shop.effects(pool, order)
    clock = VirtualClock()
    await plan.arm_orders([(order, at)])
    with pytest.raises((psycopg.Error, SimulatedCrash)):
        await saga.Orchestrator(shop.ORDER_SAGA, sleep=_dying_sleep(plan, order, clock)).run(
            pool, order["order_id"], order
        )
    assert await plan.fired(order)
    await plan.disarm()
    assert order["order_id"] in await saga.unfinished(pool)
    assert await saga.Orchestrator(shop.ORDER_SAGA, sleep=clock.sleep).recover(pool) == [order["order_id"]]
    assert shop.outcome(order, before, await shop.effects(pool, order))[0] == "compensated"
    assert await saga.unfinished(pool) == []


async def test_the_crash_tool_names_each_write_of_one_order(shop_ns):
    _, pool, plan = shop_ns
    (order,) = await sagas.demo_orders(pool, "accepted")
    await plan.trace(order)
    await saga.Orchestrator(shop.ORDER_SAGA).run(pool, order["order_id"], order)
    names = await plan.traced(order)
    assert names[0] == "insert saga_log (saga, begin)" and names[-1] == "insert saga_log (saga, completed)"
    assert "update ch06_stock" in names and len(names) == 13


async def test_without_a_saga_log_a_crash_leaves_the_order_half_done(shop_ns):
    _, pool, plan = shop_ns
    rows = await sagas.crash_matrix(pool, plan, "naive", kinds=("accepted",))
    assert {r["recovered"] for r in rows} == {"untouched", "half-done"}
    rows = await sagas.crash_matrix(pool, plan, "saga log", kinds=("accepted",))
    assert {r["recovered"] for r in rows} <= {"untouched", "completed"}


async def test_the_choreographed_saga_compensates_through_events(shop_ns):
    ns, pool, _ = shop_ns
    (order,) = await sagas.demo_orders(pool, "unshippable")
    trail = await sagas.choreography(pool, ns.redis(), f"{ns.key_prefix}choreo", [order])
    assert [event for _, event, _ in trail][-3:] == ["ShippingUnavailable", "PaymentRefunded", "StockReleased"]


async def test_two_relays_with_skip_locked_reorder_an_aggregate_and_the_partitioned_relay_does_not(shop_ns):
    ns, pool, _ = shop_ns
    r = ns.redis()
    async with await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True) as watcher:
        for relay, prefix, reordered in ((events.relay_skip_locked, "skip", True), (outbox.relay_batch, "part", False)):
            stream = f"{ns.key_prefix}{prefix}"
            await events.interleaved_orders(pool, 6, 3, prefix=prefix)
            raced = await events.ordering_race(pool, watcher, (relay, r), (relay, r), stream, limit=4)
            order = events.per_aggregate(raced["entries"])
            assert sum(len(ids) for ids in order.values()) == 18
            assert bool(events.inversions(order)) is reordered


async def test_a_compensation_that_writes_back_what_it_read_erases_another_orders_reservation(shop_ns):
    _, pool, _ = shop_ns
    lost = await sagas.compensation_race(pool, commutative=False)
    kept = await sagas.compensation_race(pool, commutative=True)
    assert (lost["stock"], lost["expected"]) == (10, 7)
    assert kept["stock"] == kept["expected"] == 7


async def test_notify_wakes_the_relay_long_before_its_polling_interval(shop_ns):
    ns, pool, _ = shop_ns
    stream = f"{ns.key_prefix}woken"
    latencies = await events.relay_latency(
        pool, ns.redis(), stream, interval=5.0, events=3, gap=0.01, notify="ch06_test", database_url=ns.database_url
    )
    assert len(latencies) == 3 and max(latencies) < 2.5  # polling alone would wait up to 5 s


async def test_a_crash_between_publish_and_mark_publishes_again_with_the_same_event_id(shop_ns):
    ns, pool, plan = shop_ns
    r = ns.redis()
    stream = f"{ns.key_prefix}dup"
    ids = [
        await events.place_order_outbox(pool, {"order_id": f"d{i}", "customer": "c", "amount_cents": 10})
        for i in range(3)
    ]
    await plan.arm(1)
    with pytest.raises(psycopg.Error):
        await events.relay_skip_locked(pool, r, stream)
    await plan.disarm()
    assert await events.relay_skip_locked(pool, r, stream) == 3
    published = [int(f["event_id"]) for _, f in await r.xrange(stream)]
    assert published == ids + ids
    assert await outbox.backlog(pool) == (0, None)


async def test_the_dual_writes_lose_and_invent_events(shop_ns):
    ns, pool, _ = shop_ns
    r = ns.redis()
    stream = f"{ns.key_prefix}dw"
    await events.place_order_publish_first(pool, r, stream, {"order_id": "ok", "customer": "c", "amount_cents": 5})
    with pytest.raises(psycopg.errors.CheckViolation):
        await events.place_order_publish_first(pool, r, stream, {"order_id": "bad", "customer": "c", "amount_cents": 0})
    assert await events.orders_and_events(pool, r, stream, ["ok", "bad"]) == [("ok", True, 1), ("bad", False, 1)]


async def test_cdc_delivers_the_outbox_in_commit_order(shop_ns):
    ns, pool, _ = shop_ns
    await _needs(ns, "cdc")
    r = ns.redis()
    seen = await slots.commit_order(ns.database_url, ns.name, r, f"{ns.key_prefix}cdc")
    t1, t2 = seen["ids"]["T1"], seen["ids"]["T2"]
    assert seen["cursor_polls"] == ([t2], [])  # the id cursor skipped T1's event
    assert [changes[0][2] for _, _, changes in seen["slot"]] == [str(t2), str(t1)]
    assert seen["published"] == 2 and seen["after"] == []
    async with await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True) as conn:
        cur = await conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE %s", (ns.name + "%",))
        assert (await cur.fetchone())[0] == 0


async def test_the_decoder_reads_updates_and_deletes(ans):
    await _needs(ans, "cdc")
    async with await psycopg.AsyncConnection.connect(ans.database_url, autocommit=True) as conn:
        await conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        slot, pub = slots.names(ans.name, "unit")
        await cdc.create_slot(conn, slot, pub, ["t"])
        try:
            await conn.execute("INSERT INTO t VALUES (1, 'a'), (2, NULL)")
            await conn.execute("UPDATE t SET v = 'b' WHERE id = 1")
            await conn.execute("DELETE FROM t WHERE id = 2")
            txns = await cdc.read(conn, slot, pub, peek=False)
        finally:
            await cdc.drop_slot(conn, slot, pub)
    changes = [c for t in txns for c in t.changes]
    assert changes == [
        ("insert", "t", {"id": "1", "v": "a"}),
        ("insert", "t", {"id": "2", "v": None}),
        ("update", "t", {"id": "1", "v": "b"}),
        ("delete", "t", {"id": "2", "v": None}),
    ]


async def test_an_idle_slot_holds_back_all_the_wal_written_since(shop_ns):
    ns, _, _ = shop_ns
    await _needs(ns, "cdc")
    wal = await slots.wal_retention(ns.database_url, ns.name, rounds=2, rows=500)
    (w1, idle1, _), (w2, idle2, read2) = wal["points"]
    assert idle2 >= w2 > w1 and idle2 > idle1 and read2 < idle2
    assert wal["idle_status"]["wal_status"] == "reserved"


async def test_a_prepared_transaction_blocks_writers_until_it_is_resolved(shop_ns):
    ns, pool, _ = shop_ns
    await _needs(ns, "2pc")
    prefix = f"{ns.name}-"
    order, other = await sagas.demo_orders(pool, "accepted", 2)
    other = dict(other, sku=order["sku"])
    seen = await twopc.coordinator_dies(ns.database_url, order, other, prefix, operator_after=0.3)
    state, wait_type, wait_event, blockers, _ = seen["blocked"]
    assert (wait_type, wait_event, blockers) == ("Lock", "transactionid", [0])
    assert seen["read"] == 10 and seen["after"] == 10 - order["qty"] - other["qty"]
    assert {gid.rsplit("-", 1)[1] for gid, *_ in seen["locks"]} == {"inventory", "payments"}
    assert await twopc.clear(ns.database_url, prefix) == []


async def test_two_recoverers_never_drive_one_saga_twice(shop_ns):
    _, pool, plan = shop_ns
    (order,) = await sagas.demo_orders(pool, "unshippable")
    before = await shop.effects(pool, order)
    clock = VirtualClock()
    await plan.arm_orders([(order, 14)])  # the refund's credit: the process dies while compensating
    with pytest.raises(SimulatedCrash):
        await saga.Orchestrator(shop.ORDER_SAGA, sleep=_dying_sleep(plan, order, clock)).run(
            pool, order["order_id"], order
        )
    await plan.disarm()
    got = await asyncio.gather(*(saga.Orchestrator(shop.ORDER_SAGA, sleep=clock.sleep).recover(pool) for _ in range(2)))
    assert sorted(len(g) for g in got) in ([0, 1], [1, 1])
    assert shop.outcome(order, before, await shop.effects(pool, order))[0] == "compensated"
    finals = [e for s, e, _ in await saga.history(pool, order["order_id"]) if s == "saga" and e != "begin"]
    assert finals == ["compensated"]


async def test_recovery_never_drives_a_saga_that_a_live_instance_is_running(ans):
    """A restarting instance's recover() ran a live saga's steps a second time (a shipped order
    whose stock was being released): run() now holds the same lock recover() takes."""
    pool = await ans.pool(max_size=6)
    await saga.setup_schema(pool)
    inside, release, calls = asyncio.Event(), asyncio.Event(), []

    async def slow_reserve(pool_, data):
        calls.append("reserve")
        inside.set()
        await release.wait()  # the live instance is in the middle of its first step

    async def ship(pool_, data):
        calls.append("ship")

    async def nothing(pool_, data):
        pass

    steps = [saga.Step("reserve", slow_reserve, nothing), saga.Step("ship", ship, nothing)]
    live = asyncio.ensure_future(saga.Orchestrator(steps).run(pool, "o-1", {"order": 1}))
    await asyncio.wait_for(inside.wait(), 10)
    assert await saga.unfinished(pool) == ["o-1"]
    assert await saga.Orchestrator(steps).recover(pool) == []  # the live instance holds it
    with pytest.raises(saga.SagaBusy):
        await saga.Orchestrator(steps).run(pool, "o-1", {"order": 1})
    release.set()
    assert await asyncio.wait_for(live, 10) == "completed"
    assert calls == ["reserve", "ship"], calls


async def test_a_compensation_that_hits_a_bug_stops_instead_of_retrying_forever(ans):
    pool = await ans.pool(max_size=4)
    await saga.setup_schema(pool)

    async def fails(pool_, data):
        raise saga.StepFailed("declined")

    async def buggy_undo(pool_, data):
        raise KeyError("amount")  # a programming error: retrying it forever hides it

    async def ok(pool_, data):
        pass

    orch = saga.Orchestrator(
        [saga.Step("reserve", ok, buggy_undo), saga.Step("pay", fails, ok)], sleep=VirtualClock().sleep
    )
    with pytest.raises(KeyError):
        await orch.run(pool, "o-2", {})
    assert await saga.unfinished(pool) == ["o-2"] and len(orch.retries) == 1


async def test_the_outbox_relay_loop_survives_an_error_and_counts_it():
    from course.backoff import LoopErrors

    stop, calls, errors = asyncio.Event(), [], LoopErrors()

    async def relay(pool, redis, stream, limit):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("redis went away")
        if len(calls) == 3:
            stop.set()
        return 0

    clock = VirtualClock()
    await outbox.relay_forever(None, None, "s", stop=stop, sleep=clock.sleep, relay=relay, errors=errors)
    assert len(calls) == 3 and errors.count == 1 and errors.streak == 0


async def test_the_cdc_relay_drains_a_long_slot_one_page_at_a_time(shop_ns, monkeypatch):
    """It peeked the whole slot at once: a slot far behind was decoded into memory in one go."""
    ns, pool, _ = shop_ns
    await _needs(ns, "cdc")
    r = ns.redis()
    async with await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True) as conn:
        slot, pub = slots.names(ns.name, "paged")
        await cdc.create_slot(conn, slot, pub, ["outbox"])
        try:
            for i in range(12):
                async with pool.connection() as w, w.transaction():
                    await outbox.enqueue(w, "order", f"o-{i}", "OrderPlaced", {"i": i})
            sizes, real_read = [], cdc.read

            async def read(*args, **kwargs):
                got = await real_read(*args, **kwargs)
                sizes.append(sum(len(t.changes) for t in got))
                return got

            monkeypatch.setattr(cdc, "read", read)
            stream = f"{ns.key_prefix}paged"
            assert await cdc.relay_from_slot(conn, r, stream, slot, pub, page=3) == 12
            assert max(sizes) <= 3 and sizes[-1] == 0, sizes
            assert [f["aggregate_id"] for _, f in await r.xrange(stream)] == [f"o-{i}" for i in range(12)]
        finally:
            await cdc.drop_slot(conn, slot, pub)


async def test_a_loop_being_cancelled_stops_even_when_the_cancel_comes_back_as_another_error():
    """A client library may turn a cancel into its own exception; LoopErrors re-raises the cancel."""
    from course.backoff import LoopErrors

    errors, started = LoopErrors(), asyncio.Event()

    async def loop():
        while True:
            try:
                started.set()
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError as err:
                    raise ConnectionError("connection closed while reading") from err  # as a client might
            except Exception as err:  # noqa: BLE001 - the loop survives its errors
                await asyncio.sleep(errors.failed(err))

    task = asyncio.ensure_future(loop())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    assert errors.count == 0


async def test_a_loop_stops_when_a_library_swallows_its_cancel():
    """Python 3.11's asyncio.wait_for returns the result (and drops the cancel) when its future
    finishes as the cancel arrives; a loaded CI run hung on such a loop. succeeded() stops it."""
    from course.backoff import LoopErrors

    errors, rounds = LoopErrors(), []

    async def loop():
        while True:
            try:
                rounds.append(1)
                try:
                    await asyncio.sleep(0.001)
                except asyncio.CancelledError:
                    pass  # swallowed, as the library did
            except Exception as err:  # noqa: BLE001 - the loop survives its errors
                await asyncio.sleep(errors.failed(err))
                continue
            errors.succeeded()

    task = asyncio.ensure_future(loop())
    while not rounds:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
