"""Hidden checks of chapter 06: ``order_saga`` and ``outbox_relay``.

Crashes are deterministic: a trigger counts the writes the learner's code makes to the
saga's tables (or the outbox) and, armed at ``k``, fails the k-th write and every later
one, so the process "dies" just before that write (:mod:`course.chapters.ch06.crashes`).
The check visits every ``k`` of a run (one order per ``k``, several orders at once, each
crashing at its own write), then starts a fresh replica of the answer (a new process: no
memory of the old one) and runs the recovery. Transient failures are SQLSTATE
40001 on a refund or a stock return. Races are made to happen every time: a relay is
held at its first publish until the second relay has finished or is blocked in
PostgreSQL; two recoverers are held at the stock row until both are blocked or done.
The verdicts read the servers: the services' tables, ``saga_log``, the outbox, the stream.
"""

from __future__ import annotations

import asyncio
import json

import psycopg

from autograder.harness import Report, error_line, task
from course import outbox, saga
from course.chapters.ch06 import shop
from course.chapters.ch06.crashes import CrashPlan
from course.chapters.ch06.events import RedisProbe, inversions, per_aggregate, settle
from course.idempotency import SimulatedCrash
from course.kit import lab
from course.kit.faults import VirtualClock

BROKEN = (
    ". A compensation gave back more than its step took (it ran for a step that never happened, or twice): give "
    "back only when the row moves from its done status to its undone status (UPDATE ... WHERE status = 'charged' "
    "RETURNING ...), in the same transaction"
)
CALL_LIMIT = 10.0  # real seconds one call may take once its process has "died"
CRASHING_AT_ONCE = 5  # orders crashed at once, each at its own write (5 x 2 nested connections < the pool of 12)

# ----------------------------------------------------------------------------- order_saga


class Orders:
    """Fresh orders, each with its own stock row and wallet, so their effects never mix."""

    KINDS = {
        "completing": ("EU", 1_000_00),
        "declined": ("EU", 1_00),
        "unshippable": ("MOON", 1_000_00),
    }

    def __init__(self, pool) -> None:
        self.pool = pool
        self.n = 0
        self.before: dict[str, dict] = {}
        self.kind: dict[str, str] = {}

    async def new(self, kind: str) -> dict:
        return (await self.many(kind, 1))[0]

    async def many(self, kind: str, n: int) -> list[dict]:
        zone, wallet = self.KINDS[kind]
        made = []
        for _ in range(n):
            self.n += 1
            order = {
                "order_id": f"{kind}-{self.n:03d}",
                "customer": f"cust-{self.n:03d}",
                "sku": f"sku-{self.n:03d}",
                "qty": 2,
                "amount_cents": 25_00,
                "zone": zone,
            }
            self.before[order["order_id"]] = {"stock": 10, "wallet": wallet}
            self.kind[order["order_id"]] = kind
            made.append(order)
        await shop.stock_up(
            self.pool, stock={o["sku"]: 10 for o in made}, wallets={o["customer"]: wallet for o in made}
        )
        return made

    async def outcome(self, order: dict) -> tuple[str, list[str]]:
        return shop.outcome(order, self.before[order["order_id"]], await shop.effects(self.pool, order))


async def _final_rows(pool, saga_ids: list[str]) -> list[tuple[int, str | None]]:
    """:func:`_final_row` of many sagas in one query."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            """
            SELECT s.ord, count(l.id),
                   (array_agg(l.event ORDER BY l.id DESC) FILTER (
                        WHERE l.step = 'saga' AND l.event IN ('completed', 'compensated')))[1]
            FROM unnest(%s::text[]) WITH ORDINALITY AS s(id, ord)
            LEFT JOIN saga_log l ON l.saga_id = s.id
            GROUP BY s.ord ORDER BY s.ord
            """,
            (saga_ids,),
        )
        return [(n, final) for _, n, final in await cur.fetchall()]


async def _final_row(pool, saga_id: str) -> tuple[int, str | None]:
    """(rows in saga_log for the saga, its final saga-level event or None)."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT count(*), (SELECT event FROM saga_log WHERE saga_id = %(s)s AND step = 'saga' "
            "AND event IN ('completed', 'compensated') ORDER BY id DESC LIMIT 1) FROM saga_log WHERE saga_id = %(s)s",
            {"s": saga_id},
        )
        n, final = await cur.fetchone()
    return n, final


def _crash_sleep(plan: CrashPlan, clock: VirtualClock, order: dict | None = None):
    async def sleep(seconds: float) -> None:
        if await plan.fired(order):
            raise SimulatedCrash("the process is dead: its sleep never returns")
        await clock.sleep(seconds)

    return sleep


async def _run_dead(fn, *args, **kwargs) -> str:
    """Call learner code in a process that is dying; whatever it does, it ends here."""
    try:
        result = await asyncio.wait_for(fn(*args, **kwargs), CALL_LIMIT)
    except SimulatedCrash:
        return "died"
    except TimeoutError:
        return "hung"
    except Exception as err:  # noqa: BLE001 - a dying process raises anything
        return error_line(err, 80)
    return f"returned {result!r}"[:80]


@task(
    "order_saga",
    points=6,
    title="an orchestrated order saga with a saga log and recovery",
    needs=("release_stock", "refund_payment", "cancel_shipment", "run_order_saga", "recover_sagas"),
    timeout=120,
    seed=606,
)
async def check_order_saga(r: Report, release_stock, refund_payment, cancel_shipment, run_order_saga, recover_sagas):
    async with lab.scratch("ch06") as ns:
        pool = await ns.pool(max_size=12)
        await saga.setup_schema(pool)
        await shop.setup_schema(pool)
        await shop.stock_up(pool, zones=["EU"])
        control = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            plan = await CrashPlan.install(control, shop.SAGA_TABLES)
            comps = (release_stock, refund_payment, cancel_shipment)
            await _check_saga(r, pool, plan, control, comps, run_order_saga)
        finally:
            await control.close()


async def _expect_end(r: Report, orders: Orders, order: dict, got, want: str, what: str) -> None:
    kind, problems = await orders.outcome(order)
    n, final = await _final_row(orders.pool, order["order_id"])
    ok = got == want and kind == want and final == want
    if ok:
        r.ok(f"{what}: run_order_saga returned {want!r}, the services agree, saga_log ends with (saga, {want})")
        return
    if got != want:
        r.fail(f"{what}: run_order_saga returned {got!r}, expected {want!r}")
    if kind != want:
        r.fail(
            f"{what}: the services hold a {kind} order ({'; '.join(problems) or 'see the tables'}), expected {want}"
            + (BROKEN if kind == "broken" else "")
        )
    if n == 0:
        r.fail(
            f"{what}: run_order_saga wrote nothing to saga_log for {order['order_id']}. Without the saga log a new "
            "process cannot know the saga exists, where it stood, or finish it: log it before its first step"
        )
    r.fail(
        f"{what}: saga_log has {n} row(s) for {order['order_id']} and its final row is "
        f"{'missing' if final is None else repr(final)}; expected a last row (step 'saga', event {want!r})"
    )


async def _check_saga(r: Report, pool, plan: CrashPlan, control, comps, run_order_saga) -> None:
    orders = Orders(pool)
    clock = VirtualClock()

    # --- the visible part: one order completes, one is declined and compensated ---------------
    order = await orders.new("completing")
    got = await run_order_saga(pool, order, sleep=clock.sleep)
    await _expect_end(r, orders, order, got, "completed", f"an order that every service accepts ({order['order_id']})")
    completed = order
    order = await orders.new("declined")
    got = await run_order_saga(pool, order, sleep=clock.sleep)
    await _expect_end(r, orders, order, got, "compensated", "a declined payment")
    if r.public:
        return

    # --- reverse order --------------------------------------------------------------------------
    order = await orders.new("unshippable")
    got = await run_order_saga(pool, order, sleep=clock.sleep)
    await _expect_end(r, orders, order, got, "compensated", "shipping unavailable after stock and payment")
    trail = [(svc, status) for svc, _, status in await shop.audit(pool, [order["order_id"]])]
    undo = [x for x in trail if x in (("payments", "refunded"), ("inventory", "released"))]
    r.expect(
        undo == [("payments", "refunded"), ("inventory", "released")],
        "compensations ran in reverse order: refund_payment, then release_stock",
        f"the services saw {trail}: the refund must come before the stock release (compensate in the reverse "
        "order of the steps: the last step done is the first undone)",
    )

    # --- compensations are idempotent and safe when their step never ran ------------------------
    release_stock, refund_payment, cancel_shipment = comps
    before = await shop.effects(pool, completed)
    for comp in comps:
        await comp(pool, completed)
        await comp(pool, completed)
    after = await shop.effects(pool, completed)
    stock, wallet = after["stock"] - before["stock"], after["wallet"] - before["wallet"]
    r.expect(
        (stock, wallet) == (completed["qty"], completed["amount_cents"]) and after["shipment"] == "cancelled",
        "each compensation called twice on a completed order: stock and money given back once, shipment cancelled",
        f"each compensation called twice on completed order {completed['order_id']}: stock {stock:+d} "
        f"(expected +{completed['qty']}), wallet {wallet:+d} (expected +{completed['amount_cents']}), shipment "
        f"{after['shipment']!r} (expected 'cancelled'). A compensation gives back only when its row moves from "
        "the done status to the undone one, in the same transaction (UPDATE ... WHERE status = 'reserved' "
        "RETURNING ...)",
    )
    ghost = await orders.new("completing")
    before = await shop.effects(pool, ghost)
    for comp in comps:
        await comp(pool, ghost)
    after = await shop.effects(pool, ghost)
    r.expect(
        (after["stock"], after["wallet"]) == (before["stock"], before["wallet"])
        and after["reservation"] != "reserved"
        and after["payment"] != "charged"
        and after["shipment"] != "scheduled",
        "each compensation on an order whose steps never ran changed nothing",
        f"compensations on order {ghost['order_id']}, whose steps never ran, moved the stock by "
        f"{after['stock'] - before['stock']:+d} and the wallet by {after['wallet'] - before['wallet']:+d}: "
        "a compensation must undo only what its step did (recovery compensates steps that may not have run)",
    )

    # --- a compensation that fails transiently is retried -----------------------------------------
    order = await orders.new("unshippable")
    await plan.flaky("refund", 2)
    await plan.flaky("release", 1)
    sleeps = len(clock.sleeps)
    try:
        got = await run_order_saga(pool, order, sleep=clock.sleep)
    except Exception as err:  # noqa: BLE001 - reported
        got = f"raised {error_line(err, 90)}"
    fired = (await plan.flaky_fired("refund"), await plan.flaky_fired("release"))
    await plan.flaky("refund", 0)
    await plan.flaky("release", 0)
    kind, problems = await orders.outcome(order)
    r.note(
        f"{order['order_id']}: the refund failed {fired[0]} time(s) and the stock return {fired[1]} time(s) with "
        f"SerializationFailure (40001); {len(clock.sleeps) - sleeps} sleep(s) in between"
    )
    if kind != "compensated" and isinstance(got, str) and got.startswith("raised"):
        r.fail(
            f"a compensation that failed transiently ended the saga: run_order_saga {got} and left the order "
            f"{kind}. Retry a failing compensation (await sleep(delay) between tries) until it succeeds"
        )
    if kind != "compensated":
        r.fail(
            f"after transient failures of its compensations the order is {kind} ({'; '.join(problems)}): a "
            "compensation that failed was skipped. Retry it until it succeeds, never go on without it"
        )
    await _expect_end(r, orders, order, got, "compensated", "with a refund failing twice and a release once")

    # --- a crash before every write, then recovery in a new process ---------------------------------
    (runner,) = r.replicas("run_order_saga", 1)
    recoverers = r.replicas("recover_sagas", 3)
    gate = asyncio.Semaphore(CRASHING_AT_ONCE)

    async def crash(order):
        async with gate:
            return await _run_dead(runner, pool, order, sleep=_crash_sleep(plan, clock, order))

    for kind_name, want in (("completing", "completed"), ("declined", "compensated"), ("unshippable", "compensated")):
        order = await orders.new(kind_name)
        await plan.trace(order)
        got = await runner(pool, order, sleep=clock.sleep)
        names = await plan.traced(order)
        if got != want:
            r.fail(f"a {kind_name} order ({order['order_id']}) returned {got!r}, expected {want!r}")
        batch = await orders.many(kind_name, len(names))
        await plan.arm_orders([(order, k) for k, order in enumerate(batch, 1)])
        await asyncio.gather(*(crash(order) for order in batch))
        await plan.disarm()
        try:
            await asyncio.wait_for(recoverers[0](pool, sleep=clock.sleep), CALL_LIMIT * 3)
        except TimeoutError:
            r.fail("recover_sagas did not return: does it retry without awaiting sleep, or wait for something?")
        counts: dict[str, int] = {}
        after = await shop.effects_of(pool, batch)
        finals = await _final_rows(pool, [o["order_id"] for o in batch])
        for k, (order, now, (rows, final)) in enumerate(zip(batch, after, finals, strict=True), 1):
            where = f"a crash just before write {k} of {len(names)} ({names[k - 1]})"
            end, problems = shop.outcome(order, orders.before[order["order_id"]], now)
            if end in ("half-done", "broken"):
                if rows == 0:
                    r.fail(
                        f"{kind_name} order, {where}, then recover_sagas() in a new process: the order is {end} "
                        f"({'; '.join(problems)}) and saga_log has no row for it, so recovery could not know it "
                        "existed. Log the saga (its order data) before its first step, and every step as it goes"
                    )
                r.fail(
                    f"{kind_name} order, {where}, then recover_sagas() in a new process: the order is {end} "
                    f"({'; '.join(problems)}); saga_log ends with {final or 'no final row'}. Recovery must finish "
                    "every saga the log shows unfinished: on forward from the step that was started, or on with "
                    "its compensation"
                )
            if rows and final is None:
                r.fail(
                    f"{kind_name} order, {where}: after recover_sagas() the services are {end} but saga_log has no "
                    "final row for it (step 'saga', event 'completed' or 'compensated'): it stays pending forever"
                )
            agree = {"completed": "completed", "compensated": "compensated", "untouched": "compensated"}
            if final is not None and agree[end] != final:
                r.fail(f"{kind_name} order, {where}: saga_log says {final!r} but the services hold a {end} order")
            if end == "completed" and want != "completed":
                r.fail(f"{kind_name} order, {where}: it ended completed although a service said no")
            counts[end] = counts.get(end, 0) + 1
        summary = ", ".join(f"{n} {end}" for end, n in sorted(counts.items()))
        r.ok(f"a {kind_name} order crashed before each of its {len(names)} writes, then recovered: {summary}")

    # --- recovery again changes nothing ----------------------------------------------------------
    ids = list(orders.kind)
    snapshot = {oid: await shop.effects(pool, {"order_id": oid, "sku": "", "customer": ""}) for oid in ids}
    await asyncio.wait_for(recoverers[1](pool, sleep=clock.sleep), CALL_LIMIT * 3)
    again = {oid: await shop.effects(pool, {"order_id": oid, "sku": "", "customer": ""}) for oid in ids}
    changed = [oid for oid in ids if snapshot[oid] != again[oid]]
    r.expect(
        not changed,
        f"recover_sagas() run again over {len(ids)} orders changed nothing",
        f"recover_sagas() run again changed finished orders: {changed[:5]}",
    )

    # --- two recoverers at once ----------------------------------------------------------------------
    await _two_recoverers(r, pool, plan, control, orders, runner, r.replicas("recover_sagas", 2), clock)


async def _two_recoverers(r: Report, pool, plan, control, orders: Orders, runner, pair, clock) -> None:
    order = await orders.new("unshippable")
    await plan.trace(order)
    await runner(pool, order, sleep=clock.sleep)
    names = await plan.traced(order)
    at = next((i + 1 for i, n in enumerate(names) if n.startswith("update ch06_reservations")), None)
    if at is None:
        r.fail("release_stock never updated ch06_reservations: mark the reservation 'released'")
    order = await orders.new("unshippable")
    await plan.arm_orders([(order, at)])
    await _run_dead(runner, pool, order, sleep=_crash_sleep(plan, clock, order))
    await plan.disarm()
    r.note(
        f"{order['order_id']}: crashed just before write {at} ({names[at - 1]}); two replicas run recover_sagas() "
        "at once while the check holds the stock row, until both are blocked or done"
    )
    locker = await psycopg.AsyncConnection.connect(control.info.dsn, autocommit=True)
    try:
        await locker.execute("BEGIN")
        await locker.execute("SELECT 1 FROM ch06_stock WHERE sku = %s FOR UPDATE", (order["sku"],))
        tasks = [asyncio.ensure_future(rec(pool, sleep=clock.sleep)) for rec in pair]
        await settle(control, tasks, limit=2.0)
        await locker.execute("COMMIT")
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), CALL_LIMIT * 2)
    finally:
        await locker.close()
    errors = [x for x in results if isinstance(x, BaseException)]
    end, problems = await orders.outcome(order)
    if end == "broken":
        r.fail(
            f"two recoverers at once left order {order['order_id']} {end}: {'; '.join(problems)}. Both saw the "
            "reservation still 'reserved' and both gave the stock back: move the row to 'released' and give back "
            "only if that UPDATE returned the row, in one transaction (then the second waits, sees 'released', "
            "and does nothing)"
        )
    _, final = await _final_row(pool, order["order_id"])
    r.expect(
        end in ("compensated", "untouched") and final == "compensated",
        "two recoverers at once: the order ended compensated, stock and money back once"
        + (f" ({len(errors)} recoverer(s) raised: {error_line(errors[0], 60)})" if errors else ""),
        f"two recoverers at once: the order is {end} ({'; '.join(problems)}), saga_log final row {final!r}",
    )


# ----------------------------------------------------------------------------- outbox_relay


async def _outbox_rows(pool, aggregate_id: str | None = None) -> list[tuple]:
    async with pool.connection() as conn:
        if aggregate_id is None:
            cur = await conn.execute(
                "SELECT id, aggregate_type, aggregate_id, event_type, payload, published_at FROM outbox ORDER BY id"
            )
        else:
            cur = await conn.execute(
                "SELECT id, aggregate_type, aggregate_id, event_type, payload, published_at FROM outbox "
                "WHERE aggregate_id = %s ORDER BY id",
                (aggregate_id,),
            )
        return await cur.fetchall()


async def _order_exists(pool, order_id: str) -> bool:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT 1 FROM ch06_orders WHERE order_id = %s", (order_id,))
        return await cur.fetchone() is not None


async def _more_events(pool, order_id: str, status: str, event_type: str) -> int:
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("UPDATE ch06_orders SET status = %s WHERE order_id = %s", (status, order_id))
        return await outbox.enqueue(conn, "order", order_id, event_type, {"order_id": order_id, "status": status})


async def _drain(relay, pool, probe, stream: str, limit: int = 10, rounds: int = 50) -> list[str]:
    errors = []
    for _ in range(rounds):
        try:
            n = await asyncio.wait_for(relay(pool, probe, stream, limit=limit), CALL_LIMIT)
        except Exception as err:  # noqa: BLE001 - reported
            errors.append(error_line(err, 80))
            continue
        if n == 0:
            break
    return errors


def _order(i: int, prefix: str) -> dict:
    return {"order_id": f"{prefix}-{i}", "customer": f"cust-{i}", "amount_cents": 1000 + 10 * i}


@task(
    "outbox_relay",
    points=5,
    title="transactional outbox and a relay that keeps each order's events in order",
    needs=("place_order", "relay_batch"),
    timeout=90,
    seed=607,
)
async def check_outbox_relay(r: Report, place_order, relay_batch):
    async with lab.scratch("ch06") as ns:
        pool = await ns.pool(max_size=12)
        await outbox.setup_schema(pool)
        await shop.setup_schema(pool)
        redis = ns.redis()
        control = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            plan = await CrashPlan.install(control, ("ch06_orders", "outbox"))
            await _check_outbox(r, pool, redis, ns.key_prefix, plan, control, place_order, relay_batch)
        finally:
            await control.close()


async def _check_outbox(r: Report, pool, redis, prefix: str, plan, control, place_order, relay_batch) -> None:
    stream = f"{prefix}orders"
    # --- the visible part: one order, one event, one relay call -----------------------------------
    order = _order(1, "first")
    probe = RedisProbe(redis)
    await place_order(pool, probe, stream, order)
    if probe.xadds:
        r.fail(
            f"place_order published {probe.xadds} entry(ies) to the stream itself: a dual write. If Redis fails "
            "after the commit the event is lost; if the commit fails after the XADD the event is a phantom. Write "
            "the event to outbox in the order's transaction and let relay_batch publish it"
        )
    rows = await _outbox_rows(pool, order["order_id"])
    r.expect(
        await _order_exists(pool, order["order_id"]),
        f"place_order({order}) inserted the ch06_orders row",
    )
    r.expect(
        len(rows) == 1 and rows[0][3] == "OrderPlaced" and rows[0][5] is None,
        f"and one unpublished OrderPlaced row in outbox (id {rows[0][0] if rows else '?'})",
        f"outbox holds {len(rows)} row(s) for {order['order_id']}: {[(x[3], x[5]) for x in rows]}; expected one "
        "'OrderPlaced' row with published_at NULL, inserted in the same transaction as the order",
    )
    r.expect(
        isinstance(rows[0][4], dict) and rows[0][4].get("order_id") == order["order_id"],
        "its payload is the order",
        f"its payload is {rows[0][4]!r}: expected the order dict (Jsonb(order))",
    )
    n = await relay_batch(pool, probe, stream, limit=10)
    entries = await redis.xrange(stream)
    event_id = rows[0][0]
    fields = entries[0][1] if entries else {}
    r.expect(
        n == 1 and len(entries) == 1,
        "relay_batch published it: returned 1, one stream entry",
        f"relay_batch returned {n!r} and the stream has {len(entries)} entries; expected 1 and 1",
    )
    try:
        payload = json.loads(fields.get("payload", ""))
    except ValueError:
        payload = None
    r.expect(
        fields.get("event_id") == str(event_id)
        and fields.get("aggregate_id") == order["order_id"]
        and fields.get("event_type") == "OrderPlaced"
        and isinstance(payload, dict)
        and payload.get("order_id") == order["order_id"],
        f"the entry carries event_id={event_id}, aggregate_id, event_type and the payload as JSON",
        f"the entry is {fields}: expected event_id={str(event_id)!r} (the outbox id: consumers drop duplicates by "
        "it), aggregate_id, event_type and payload (JSON text)",
    )
    rows = await _outbox_rows(pool, order["order_id"])
    r.expect(rows[0][5] is not None, "the row is marked published", "the row's published_at is still NULL")
    n = await relay_batch(pool, probe, stream, limit=10)
    r.expect(n == 0 and probe.xadds == 1, "a second call publishes nothing", f"a second call returned {n}")
    if r.public:
        return

    # --- place_order is one transaction -------------------------------------------------------------
    for k in (1, 2):
        order = _order(k, "atomic")
        await plan.arm(k)
        how = await _run_dead(place_order, pool, RedisProbe(redis), stream, order)
        await plan.disarm()
        has_order = await _order_exists(pool, order["order_id"])
        has_event = bool(await _outbox_rows(pool, order["order_id"]))
        if has_order and not has_event:
            r.fail(
                f"a crash before write {k} of place_order ({how}) left the order without its event: a lost event. "
                "Insert the order and its outbox row in one transaction"
            )
        if has_event and not has_order:
            r.fail(
                f"a crash before write {k} of place_order ({how}) left an event for an order that does not exist: "
                "a phantom event. Insert the order and its outbox row in one transaction"
            )
    r.ok("a crash before either write of place_order leaves neither the order nor its event")

    # --- two relays at once keep each order's events in order ----------------------------------------
    await redis.delete(stream)
    await _mark_all_published(pool)
    ids = [f"agg-{i}" for i in range(1, 7)]
    for i, oid in enumerate(ids):
        await place_order(pool, redis, stream, {"order_id": oid, "customer": f"c{i}", "amount_cents": 500 + i})
    for status, kind in (("paid", "OrderPaid"), ("shipped", "OrderShipped")):
        for oid in ids:
            await _more_events(pool, oid, status, kind)
    expected = {oid: [row[0] for row in await _outbox_rows(pool, oid)] for oid in ids}
    a, b = r.replicas("relay_batch", 2)
    r.note(
        "6 orders with 3 events each, ids alternating between orders; two replicas of relay_batch(limit=4) at once: "
        "the first is held at its first publish until the second has returned or is blocked in PostgreSQL"
    )
    probe_a, probe_b = RedisProbe(redis, hold=True), RedisProbe(redis)
    calls: list[tuple[str, int]] = []

    async def call(name, relay, probe):
        before = probe.xadds
        n = await relay(pool, probe, stream, limit=4)
        calls.append((name, probe.xadds - before))
        return n

    task_a = asyncio.ensure_future(call("first", a, probe_a))
    held = asyncio.ensure_future(probe_a.held.wait())
    await asyncio.wait([task_a, held], timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
    held.cancel()
    task_b = asyncio.ensure_future(call("second", b, probe_b))
    await settle(control, [task_b], limit=2.0)
    probe_a.release()
    first = await asyncio.wait_for(asyncio.gather(task_a, task_b, return_exceptions=True), CALL_LIMIT)
    errors = [error_line(x, 80) for x in first if isinstance(x, BaseException)]
    rounds = 0
    for rounds in range(1, 40):  # noqa: B007 - the count is reported
        got = await asyncio.wait_for(
            asyncio.gather(call("first", a, probe_a), call("second", b, probe_b), return_exceptions=True),
            CALL_LIMIT,
        )
        errors += [error_line(x, 80) for x in got if isinstance(x, BaseException)]
        if all(g == 0 for g in got if not isinstance(g, BaseException)) and not await _unpublished(pool):
            break
    over = [(name, n) for name, n in calls if n > 4]
    r.expect(
        not over,
        f"every call published at most limit=4 events ({len(calls)} calls)",
        f"calls of relay_batch(limit=4) published {[n for _, n in over]} events: publish at most `limit` per call",
    )
    order_seen = per_aggregate(await redis.xrange(stream))
    missing = {oid: sorted(set(expected[oid]) - set(order_seen.get(oid, []))) for oid in ids}
    missing = {k: v for k, v in missing.items() if v}
    r.expect(
        not missing,
        "every event reached the stream",
        f"events never reached the stream: {missing} (relay errors: {errors[:3]})",
    )
    bad = inversions({oid: order_seen[oid] for oid in ids})
    if bad:
        agg, pairs = next(iter(bad.items()))
        early, late = pairs[0]
        r.fail(
            f"two relays at once published order {agg}'s events out of order: event {late} reached the stream "
            f"before event {early} (stream order {order_seen[agg]}; {len(bad)} of 6 orders affected). The second "
            "relay skipped the rows the first had claimed and published the order's next event first. Keep one "
            "order's events with one relay at a time: one active relay (an advisory lock), relays that own "
            "partitions of the aggregate ids, or FOR UPDATE that waits instead of SKIP LOCKED"
        )
    r.ok(f"and each order's events in id order (drained in {rounds} more round(s) of both relays)")

    # --- a crash between publishing and marking -------------------------------------------------------
    await _mark_all_published(pool)
    ids = [f"dup-{i}" for i in range(1, 4)]
    for i, oid in enumerate(ids):
        await place_order(pool, redis, stream, {"order_id": oid, "customer": f"d{i}", "amount_cents": 700 + i})
        await _more_events(pool, oid, "paid", "OrderPaid")
    wanted = {row[0] for oid in ids for row in await _outbox_rows(pool, oid)}
    c, d = r.replicas("relay_batch", 2)
    before = len(await redis.xrange(stream))
    probe = RedisProbe(redis)
    await plan.arm(1)
    how = await _run_dead(c, pool, probe, stream, limit=10)
    await plan.disarm()
    published_before_crash = probe.xadds
    errors = await _drain(d, pool, RedisProbe(redis), stream)
    entries = (await redis.xrange(stream))[before:]
    seen = [int(f.get("event_id", -1)) for _, f in entries if f.get("event_id", "").isdigit()]
    r.note(
        f"a relay crashed at its first write to outbox ({how}) after {published_before_crash} XADD(s); "
        f"a new relay then drained the outbox"
    )
    r.expect(
        wanted <= set(seen),
        f"every event reached the stream ({len(seen)} entries for {len(wanted)} events: "
        f"{len(seen) - len(set(seen))} duplicate(s), harmless: they carry the same event_id)",
        f"after the crash, events {sorted(wanted - set(seen))} never reached the stream (relay errors: {errors[:3]})",
    )
    by_id: dict[str, set] = {}
    for _, f in entries:
        by_id.setdefault(f.get("event_id"), set()).add(json.dumps(f, sort_keys=True))
    r.expect(
        all(len(v) == 1 for v in by_id.values()),
        "each duplicate is identical to its first delivery",
        "a republished event differs from its first delivery: publish the same fields (the outbox row) every time",
    )

    # --- Redis fails in the middle of a publish ---------------------------------------------------------
    await _mark_all_published(pool)
    ids = [f"lost-{i}" for i in range(1, 4)]
    for i, oid in enumerate(ids):
        await place_order(pool, redis, stream, {"order_id": oid, "customer": f"e{i}", "amount_cents": 900 + i})
        await _more_events(pool, oid, "paid", "OrderPaid")
    wanted = {row[0]: row for oid in ids for row in await _outbox_rows(pool, oid)}
    e, f_ = r.replicas("relay_batch", 2)
    before = len(await redis.xrange(stream))
    failing = RedisProbe(redis, fail_at=2)
    how = await _run_dead(e, pool, failing, stream, limit=10)
    errors = await _drain(f_, pool, RedisProbe(redis), stream)
    entries = (await redis.xrange(stream))[before:]
    seen = {int(f.get("event_id", -1)) for _, f in entries if f.get("event_id", "").isdigit()}
    lost = sorted(set(wanted) - seen)
    r.note(f"Redis failed at the second XADD of a relay call ({how}); a new relay then drained the outbox")
    if lost:
        row = wanted[lost[0]]
        r.fail(
            f"event {lost[0]} ({row[2]} {row[3]}) never reached the stream: it was marked published although its "
            "XADD failed (marked before publishing, or marked in spite of the error). Mark a row only after its "
            "publish succeeded, in the transaction that claimed it"
        )
    r.ok("no event was lost: the ones whose publish failed were published by the next relay")


async def _unpublished(pool) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM outbox WHERE published_at IS NULL")
        return (await cur.fetchone())[0]


async def _mark_all_published(pool) -> None:
    async with pool.connection() as conn:
        await conn.execute("UPDATE outbox SET published_at = now() WHERE published_at IS NULL")


#: The course's own reference implementation of each task (issue 26): while a task is graded,
#: a learner's answer that is, wraps or calls one of these earns nothing for it. The checks
#: themselves may still use them as rigs.
REFERENCES: dict[str, list[str]] = {
    "order_saga": ["course.saga:Orchestrator"],
    "outbox_relay": ["course.outbox:relay_batch"],
}
