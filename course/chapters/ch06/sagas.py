"""Chapter 06's saga demos: runs with their logs, the crash matrix, what the user sees, choreography.

- :func:`demo_orders` makes the three kinds of order (accepted, declined, unshippable).
- :func:`naive_saga`: steps and compensations in memory, no saga log (the failure).
- :func:`crash_matrix`: crash a design before each of its writes, recover in a new
  orchestrator, and tell what every order ended as.
- :func:`timeline`: a slowed-down saga with every step and compensation timed and the
  order's page polled, for the "what the user sees" plot.
- :func:`compensation_race`: the lost update a compensation causes when it writes back
  the value its step read instead of adding the quantity back (the missing isolation).
- :func:`choreography`: the same saga with no orchestrator: services react to each
  other's events on a Redis stream.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

from course import saga
from course.chapters.ch06 import shop
from course.idempotency import SimulatedCrash
from course.kit.faults import VirtualClock

_ids = itertools.count(1)

KINDS = {"accepted": ("EU", 1_000_00), "declined": ("EU", 1_00), "unshippable": ("MOON", 1_000_00)}


async def demo_orders(pool, kind: str, n: int = 1, *, tag: str = "") -> list[dict]:
    """``n`` fresh orders of ``kind``, each with its own stock row (10) and wallet."""
    zone, wallet = KINDS[kind]
    made = []
    for _ in range(n):
        i = next(_ids)
        made.append(
            {
                "order_id": f"{tag}{kind}-{i}",
                "customer": f"{tag}cust-{i}",
                "sku": f"{tag}book-{i}",
                "qty": 2,
                "amount_cents": 25_00,
                "zone": zone,
            }
        )
    await shop.stock_up(
        pool, stock={o["sku"]: 10 for o in made}, wallets={o["customer"]: wallet for o in made}, zones=["EU"]
    )
    return made


async def naive_saga(pool, order: dict, *, sleep=asyncio.sleep) -> str:
    """THE BUG (do not copy): compensations remembered in memory, no saga log.

    Correct while the process lives. When it dies between two steps, nobody knows the
    order exists: its stock stays reserved and its money taken, forever.
    """
    done = []
    for step in shop.ORDER_SAGA:
        try:
            await step.action(pool, order)
        except saga.StepFailed:
            for undo in reversed([*done, step]):
                await undo.compensation(pool, order)
            return "compensated"
        done.append(step)
    return "completed"


async def _nothing_to_recover(pool, **_) -> list[str]:
    return []


def _dying_sleep(plan, clock: VirtualClock, order: dict):
    async def sleep(seconds: float) -> None:
        if await plan.fired(order):
            raise SimulatedCrash("dead")
        await clock.sleep(seconds)

    return sleep


async def crash_matrix(pool, plan, design: str, kinds=("accepted", "declined", "unshippable")) -> list[dict]:
    """Crash ``design`` (``"naive"`` or ``"saga log"``) before each of its writes, then recover.

    For every order: the write it died before, its outcome right after the crash and after
    the recovery (:func:`course.chapters.ch06.shop.outcome`).
    """
    clock = VirtualClock()
    if design == "naive":

        async def run(order, sleep):
            return await naive_saga(pool, order, sleep=sleep)

        recover = _nothing_to_recover
    else:

        async def run(order, sleep):
            return await saga.Orchestrator(shop.ORDER_SAGA, sleep=sleep).run(pool, order["order_id"], order)

        async def recover(pool, sleep):
            return await saga.Orchestrator(shop.ORDER_SAGA, sleep=sleep).recover(pool)

    gate = asyncio.Semaphore(4)

    async def crash(order):
        async with gate:
            try:
                await run(order, _dying_sleep(plan, clock, order))
            except (Exception, SimulatedCrash):  # noqa: BLE001 - the process died here
                pass

    rows = []
    for kind in kinds:
        (dry,) = await demo_orders(pool, kind, tag="dry-")
        await plan.trace(dry)
        await run(dry, clock.sleep)
        names = await plan.traced(dry)
        batch = await demo_orders(pool, kind, len(names), tag=f"{design[:5]}-")
        before = await shop.effects_of(pool, batch)
        await plan.arm_orders([(order, k) for k, order in enumerate(batch, 1)])  # order k dies before write k
        await asyncio.gather(*(crash(order) for order in batch))
        await plan.disarm()
        mids = await shop.effects_of(pool, batch)
        await recover(pool, sleep=clock.sleep)
        after = await shop.effects_of(pool, batch)
        for k, (order, b, m, a) in enumerate(zip(batch, before, mids, after, strict=True), 1):
            rows.append(
                {
                    "kind": kind,
                    "k": k,
                    "write": names[k - 1],
                    "crashed": shop.outcome(order, b, m)[0],
                    "recovered": shop.outcome(order, b, a)[0],
                }
            )
    return rows


# ----------------------------------------------------------------------------- what the user sees


async def timeline(pool, orders: list[dict], *, delay: float = 0.15, poll: float = 0.02) -> dict:
    """Run the orders' sagas at once, each step slowed by ``delay`` s (a remote call), and poll
    each order's page. Returns ``{"spans": [(order, step, phase, t0, t1)], "pages": {order: [(t, status)]}}``."""
    t_start = time.perf_counter()
    spans: list[tuple[str, str, str, float, float]] = []

    def timed(name: str, phase: str, fn):
        async def call(pool, order):
            t0 = time.perf_counter() - t_start
            try:
                await asyncio.sleep(delay)
                await fn(pool, order)
            finally:
                spans.append((order["order_id"], name, phase, t0, time.perf_counter() - t_start))

        return call

    steps = [
        saga.Step(s.name, timed(s.name, "do", s.action), timed(s.name, "undo", s.compensation))
        for s in shop.ORDER_SAGA
    ]
    pages: dict[str, list[tuple[float, str]]] = {o["order_id"]: [] for o in orders}
    running = True

    async def watch():
        while running:
            for o in orders:
                state = saga.read_state(await saga.history(pool, o["order_id"]))
                pages[o["order_id"]].append((time.perf_counter() - t_start, saga.user_status(state)))
            await asyncio.sleep(poll)

    watcher = asyncio.ensure_future(watch())
    try:
        results = await asyncio.gather(
            *(saga.Orchestrator(steps).run(pool, o["order_id"], o) for o in orders)
        )
        await asyncio.sleep(2 * poll)
    finally:
        running = False
        await watcher
    return {
        "spans": spans,
        "pages": pages,
        "results": dict(zip([o["order_id"] for o in orders], results, strict=True)),
    }


# ----------------------------------------------------------------------------- the missing isolation


async def compensation_race(pool, *, commutative: bool) -> dict:
    """Order A reserves 2 of a book (10 in stock), order B reserves 3 of it, then A is compensated.

    ``commutative=True`` undoes A with the shop's :func:`~course.chapters.ch06.shop.release_stock`
    (``available + qty``: it commutes with B's reservation). ``commutative=False`` undoes A by
    writing back the stock A read before its step (a before-image), which erases B's
    reservation. Returns ``{"stock", "expected", "b_holds"}`` after A's compensation.
    """
    a, b = await demo_orders(pool, "accepted", 2, tag="iso-")
    b = dict(b, sku=a["sku"], qty=3)  # the second customer buys the same book
    seen_by_a = (await shop.effects(pool, a))["stock"]
    await shop.reserve_stock(pool, a)
    await shop.reserve_stock(pool, b)
    if commutative:
        await shop.release_stock(pool, a)
    else:
        async with pool.connection() as conn, conn.transaction():
            await conn.execute(
                "UPDATE ch06_reservations SET status = 'released' WHERE order_id = %s AND status = 'reserved'",
                (a["order_id"],),
            )
            await conn.execute("UPDATE ch06_stock SET available = %s WHERE sku = %s", (seen_by_a, a["sku"]))
    stock = (await shop.effects(pool, a))["stock"]
    return {"stock": stock, "expected": seen_by_a - b["qty"], "b_holds": b["qty"], "seen_by_a": seen_by_a}


# ----------------------------------------------------------------------------- choreography

#: Who reacts to what: event type -> (service, what it does, event on success, event on "no").
REACTIONS = {
    "OrderPlaced": ("inventory", shop.reserve_stock, "StockReserved", "OrderRejected"),
    "StockReserved": ("payments", shop.charge_payment, "PaymentTaken", "PaymentDeclined"),
    "PaymentTaken": ("shipping", shop.schedule_shipment, "ShipmentScheduled", "ShippingUnavailable"),
    "PaymentDeclined": ("inventory", shop.release_stock, "StockReleased", None),
    "ShippingUnavailable": ("payments", shop.refund_payment, "PaymentRefunded", None),
    "PaymentRefunded": ("inventory", shop.release_stock, "StockReleased", None),
}


async def choreography(pool, redis, stream: str, orders: list[dict], *, max_events: int = 200) -> list[tuple]:
    """The order saga as a choreography: each service reads the stream and reacts to events.

    No orchestrator and no saga log: the only record of where an order stands is the trail
    of events. Returns ``[(order_id, event, emitted by)]`` in stream order. (Each service
    publishes after its commit, which is a dual write: a real one would use an outbox.)
    """
    await redis.delete(stream)
    for o in orders:
        await redis.xadd(stream, {"type": "OrderPlaced", "order": json.dumps(o), "by": "checkout"})
    trail = []
    last = "0"
    handled = 0
    while handled < max_events:
        got = await redis.xread({stream: last}, count=50)
        if not got:
            break
        for entry_id, f in got[0][1]:
            last = entry_id
            handled += 1
            order = json.loads(f["order"])
            trail.append((order["order_id"], f["type"], f["by"]))
            reaction = REACTIONS.get(f["type"])
            if reaction is None:
                continue
            service, act, ok_event, no_event = reaction
            try:
                await act(pool, order)
                event = ok_event
            except saga.StepFailed:
                event = no_event
            if event:
                await redis.xadd(stream, {"type": event, "order": f["order"], "by": service})
    return trail
