"""Hidden checks of ``order_saga``: crashes before every write, transient failures, two recoverers."""

from __future__ import annotations

import asyncio

import psycopg

from autograder.harness import Report, error_line, task
from course import saga
from course.chapters.ch06 import shop
from course.chapters.ch06.crashes import CrashPlan
from course.chapters.ch06.events import settle
from course.idempotency import SimulatedCrash
from course.kit import lab
from course.kit.faults import VirtualClock

BROKEN = (
    ". A compensation gave back more than its step took (it ran for a step that never happened, or twice): give "
    "back only when the row moves from its done status to its undone status (UPDATE ... WHERE status = 'charged' "
    "RETURNING ...), in the same transaction"
)
REFUND_FAILURES = 6  # more than a fixed handful of tries: a compensation is never given up
CALL_LIMIT = 10.0  # real seconds one call may take once its process has "died"
CRASHING_AT_ONCE = 5  # orders crashed at once, each at its own write (5 x 2 nested connections < the pool of 12)


# ----------------------------------------------------------------------------- order_saga


class Orders:
    """Fresh orders, each with its own stock row and wallet, so their effects never mix."""

    KINDS = {
        "completing": ("EU", 1_000_00),
        "declined": ("EU", 1_00),
        "unshippable": ("MOON", 1_000_00),
        "blipped": ("EU", 1_000_00),  # its first payment insert fails with a serialization failure (40001)
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


BLIP_SQL = """
CREATE SEQUENCE IF NOT EXISTS ch06_check_blip;
CREATE OR REPLACE FUNCTION ch06_check_blip() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.order_id LIKE 'blipped-%' AND nextval('ch06_check_blip') = 1 THEN
        RAISE EXCEPTION 'could not serialize access due to concurrent update (injected by the check)'
            USING ERRCODE = '40001';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS ch06_check_blip ON ch06_payments;
CREATE TRIGGER ch06_check_blip BEFORE INSERT ON ch06_payments
    FOR EACH ROW EXECUTE FUNCTION ch06_check_blip();
"""


async def _events(pool, saga_id: str) -> list[tuple[str, str]]:
    """``(step, event)`` of a saga's log, in the order it was written."""
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT step, event FROM saga_log WHERE saga_id = %s ORDER BY id", (saga_id,))
        return [(step, event) for step, event in await cur.fetchall()]


async def _expect_all_compensated(r: Report, pool, order: dict, what: str) -> None:
    """Every step the log says was started has its compensated row, the failed one included."""
    events = await _events(pool, order["order_id"])
    started = [step for step, event in events if event == "started" and step != "saga"]
    undone = {step for step, event in events if event == "compensated"}
    missing = [step for step in started if step not in undone]
    r.expect(
        not missing,
        f"{what}: saga_log has a compensated row for every step that was started, the failed one included",
        f"{what}: saga_log shows {', '.join(missing)} started but never compensated ({events}). Compensate every "
        "step that was started, the failed one included (a step can commit and still fail on its way back), in "
        "reverse order, and log (step, 'compensated') after each",
    )


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
    declined = order
    if r.public:
        return
    await _expect_all_compensated(r, pool, declined, "a declined payment")

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
    await _expect_all_compensated(r, pool, order, "shipping unavailable")

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

    # --- a give-back adds to the stock there is when it writes, not to the stock it read -------------
    await _check_give_back_adds(r, pool, control, orders, release_stock)

    # --- a compensation that fails transiently is retried, however many tries it takes ---------------
    order = await orders.new("unshippable")
    await plan.flaky("refund", REFUND_FAILURES)
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
    slept = len(clock.sleeps) - sleeps
    r.note(
        f"{order['order_id']}: the refund is made to fail {REFUND_FAILURES} times and the stock return once with "
        f"SerializationFailure (40001); it failed {fired[0]} and {fired[1]} time(s), {slept} sleep(s) in between"
    )
    if kind == "compensated" and slept == 0:
        r.fail(
            f"the compensations were retried ({fired[0]} failed refunds, {fired[1]} failed stock returns) but the "
            "injected sleep was never awaited: the waits between tries must go through `sleep` (the check's "
            "virtual clock), never asyncio.sleep or time.sleep, which wait for real"
        )
    if kind != "compensated":
        seen = f"the order is {kind} ({'; '.join(problems)})"
        if isinstance(got, str) and got.startswith("raised"):
            seen = f"run_order_saga {got} and {seen}"
        if slept == 0:
            cause = (
                "no sleep was awaited, so a compensation that failed was skipped or ended the saga, not retried. "
                "Retry it after await sleep(delay) until it succeeds"
            )
        elif fired[0] < REFUND_FAILURES and fired[0] > 1:
            cause = (
                f"your code retried ({slept} sleeps) but stopped after {fired[0]} failed refunds: a compensation "
                "is retried until it succeeds, however many tries it takes, never given up and never skipped"
            )
        else:
            cause = (
                f"your code retried ({slept} sleeps); likely causes: a compensation whose status change and "
                "give-back are two transactions (the status committed, the give-back failed, and the retry finds "
                "the row already moved and gives nothing back), or a retry that gave up and went on without it"
            )
        r.fail(f"after transient failures of its compensations {seen}: {cause}")
    await _expect_end(
        r, orders, order, got, "compensated", f"with a refund failing {REFUND_FAILURES} times and a release once"
    )

    # --- a step that fails for a reason that is not a business "no" ----------------------------------
    await _check_step_blip(r, pool, control, orders, run_order_saga, clock)

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
        # the cause of a "no" can go away before recovery runs (a customer tops up a wallet): a saga whose log
        # already says failed, or has a compensated step, must still be compensated, never run forward again
        rescued = set()
        for o in batch:
            events = await _events(pool, o["order_id"])
            if (
                events
                and not any(step == "saga" and ev != "begin" for step, ev in events)
                and any(ev == "failed" or (ev == "compensated" and step != "saga") for step, ev in events)
            ):
                rescued.add(o["order_id"])
                await control.execute(
                    "UPDATE ch06_wallets SET balance_cents = balance_cents + %s WHERE customer = %s",
                    (TOP_UP, o["customer"]),
                )
                orders.before[o["order_id"]]["wallet"] += TOP_UP
        unfinished = sorted(
            o["order_id"]
            for o, (rows, final) in zip(batch, await _final_rows(pool, [o["order_id"] for o in batch]), strict=True)
            if rows and final is None
        )
        try:
            returned = await asyncio.wait_for(recoverers[0](pool, sleep=clock.sleep), CALL_LIMIT * 3)
        except TimeoutError:
            r.fail("recover_sagas did not return: does it retry without awaiting sleep, or wait for something?")
        # sorted in the feedback: which of the sagas that crashed at once logged first depends on timing
        shown = sorted(map(str, returned)) if isinstance(returned, list | tuple) else returned
        if not isinstance(returned, list | tuple) or sorted(map(str, returned)) != unfinished:
            r.fail(
                f"after the {kind_name} crashes, {len(unfinished)} saga(s) had a begin row and no final row; "
                f"recover_sagas() finished them and returned {shown!r:.160}; expected their saga ids "
                f"({unfinished[:3]}...): return the ids of the sagas it finished, each once"
            )
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
            if end == "completed" and order["order_id"] in rescued:
                r.fail(
                    f"{kind_name} order, {where}: its log already said a step had failed, and by the time recovery "
                    "ran the cause was gone (the customer could pay): recovery ran the saga forward again and it "
                    "ended completed. A saga whose log has a failed row, or a step's compensated row, goes on "
                    "compensating: it never runs forward again"
                )
            elif end == "completed" and want != "completed":
                r.fail(f"{kind_name} order, {where}: it ended completed although a service said no")
            counts[end] = counts.get(end, 0) + 1
        summary = ", ".join(f"{n} {end}" for end, n in sorted(counts.items()))
        r.ok(f"a {kind_name} order crashed before each of its {len(names)} writes, then recovered: {summary}")

    # --- recovery again changes nothing ----------------------------------------------------------
    ids = list(orders.kind)
    snapshot = {oid: await shop.effects(pool, {"order_id": oid, "sku": "", "customer": ""}) for oid in ids}
    returned = await asyncio.wait_for(recoverers[1](pool, sleep=clock.sleep), CALL_LIMIT * 3)
    r.expect(
        not returned,
        "and returned no saga ids",
        f"recover_sagas() run again, with every saga finished, returned {returned!r:.160}; expected [] (it finished none)",
    )
    again = {oid: await shop.effects(pool, {"order_id": oid, "sku": "", "customer": ""}) for oid in ids}
    changed = [oid for oid in ids if snapshot[oid] != again[oid]]
    r.expect(
        not changed,
        f"recover_sagas() run again over {len(ids)} orders changed nothing",
        f"recover_sagas() run again changed finished orders: {changed[:5]}",
    )

    # --- two recoverers at once ----------------------------------------------------------------------
    await _two_recoverers(r, pool, plan, control, orders, runner, r.replicas("recover_sagas", 2), clock)


async def _check_give_back_adds(r: Report, pool, control, orders: Orders, release_stock) -> None:
    """release_stock held at the stock row while another order takes 3 of the same sku: the give-back must
    land on top of that (available + qty), not write back the stock it read before it waited."""
    order = await orders.new("completing")
    await shop.reserve_stock(pool, order)
    before = (await shop.effects(pool, order))["stock"]
    locker = await psycopg.AsyncConnection.connect(control.info.dsn, autocommit=True)
    try:
        await locker.execute("BEGIN")
        await locker.execute("SELECT 1 FROM ch06_stock WHERE sku = %s FOR UPDATE", (order["sku"],))
        task = asyncio.ensure_future(release_stock(pool, order))
        await settle(control, [task], limit=2.0)
        await locker.execute("UPDATE ch06_stock SET available = available - 3 WHERE sku = %s", (order["sku"],))
        await locker.execute("COMMIT")
        await asyncio.wait_for(task, CALL_LIMIT)
    finally:
        await locker.close()
    after = (await shop.effects(pool, order))["stock"]
    want = before - 3 + order["qty"]
    r.expect(
        after == want,
        "release_stock held at the stock row while another order took 3 of the sku: both changes kept",
        f"release_stock was held at the stock row while another order took 3 of the same sku: the stock went from "
        f"{before} to {after}, expected {want} ({before} - 3 + {order['qty']}). The give-back wrote back a value "
        "computed from what it read before it waited, erasing the other change (a lost update): give back with a "
        "commutative update, SET available = available + qty",
    )


async def _check_step_blip(r: Report, pool, control, orders: Orders, run_order_saga, clock) -> None:
    """charge_payment raises SerializationFailure once (a transient error, not StepFailed): the saga must not
    be compensated for it. Either it propagates and recovery completes the saga, or the orchestrator retried."""
    await control.execute(BLIP_SQL)
    await control.execute("SELECT setval('ch06_check_blip', 1, false)")
    order = await orders.new("blipped")
    try:
        try:
            got = await asyncio.wait_for(run_order_saga(pool, order, sleep=clock.sleep), CALL_LIMIT)
        except TimeoutError:
            got = "hung"
        except Exception as err:  # noqa: BLE001 - expected: it propagates
            got = err
    finally:
        await control.execute("DROP TRIGGER IF EXISTS ch06_check_blip ON ch06_payments")
    r.note(
        f"{order['order_id']}: charge_payment raises SerializationFailure (40001) once, a transient database error "
        "and not StepFailed; then, if run_order_saga raised, recover_sagas() in a new process"
    )
    if isinstance(got, BaseException):
        (recover,) = r.replicas("recover_sagas", 1)
        try:
            await asyncio.wait_for(recover(pool, sleep=clock.sleep), CALL_LIMIT * 3)
        except Exception as err:  # noqa: BLE001 - reported
            r.fail(f"after run_order_saga raised {error_line(got, 60)}, recover_sagas() raised {error_line(err, 80)}")
    end, problems = await orders.outcome(order)
    _, final = await _final_row(pool, order["order_id"])
    if end == "completed" and final == "completed":
        r.ok(
            "a step that raised a transient error (not StepFailed) was not compensated: the saga ended completed"
            + (" after recovery" if isinstance(got, BaseException) else "")
        )
        return
    if isinstance(got, BaseException) and end in ("compensated", "untouched") and final == "compensated":
        r.ok("the transient error propagated; recovery rolled the saga back (the text accepts that)")
        return
    said = f"raised {error_line(got, 60)}" if isinstance(got, BaseException) else f"returned {got!r}"
    r.fail(
        f"charge_payment raised SerializationFailure once (a transient error, not StepFailed); run_order_saga "
        f"{said}, and the order ended {end} ({'; '.join(problems) or 'see the tables'}), saga_log final row "
        f"{final!r}; expected completed (or, after run_order_saga raised, rolled back by recovery). Only StepFailed "
        "is a service saying no: any other exception from a step propagates (the process may be dying), and "
        "recovery then finishes the saga"
    )


TOP_UP = 1_000_00  # cents: what a declined customer has by the time recovery runs


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
