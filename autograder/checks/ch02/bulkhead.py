"""Hidden checks of ``bulkhead``: bulkheads filled with calls that block on events the check
controls, so "how many are running" and "who was rejected at once" are exact, not timed."""

from __future__ import annotations

import asyncio

from autograder.harness import Report, task
from autograder.probes import Spawned
from course.bulkhead import BulkheadFullError
from course.kit.faults import VirtualClock, _until_idle

# ----------------------------------------------------------------------------- bulkhead


class Blocking:
    """A dependency whose calls wait on ``gate`` (set it to let them finish); counts concurrency."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.gate = gate or asyncio.Event()
        self.entered = 0
        self.running = 0
        self.max_running = 0

    async def __call__(self) -> str:
        self.entered += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.gate.wait()
            return "done"
        finally:
            self.running -= 1


def _state(tasks: list[asyncio.Future]) -> tuple[int, int, int, int]:
    """(pending, ok, rejected with BulkheadFullError, other errors)."""
    pending = sum(1 for t in tasks if not t.done())
    done = [t for t in tasks if t.done() and not t.cancelled()]
    ok = sum(1 for t in done if t.exception() is None)
    full = sum(1 for t in done if isinstance(t.exception(), BulkheadFullError))
    return pending, ok, full, len(done) - ok - full


async def _cleanup(*tasks: asyncio.Future) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@task(
    "bulkhead",
    points=4,
    title="bulkhead: bounded concurrency and queue per dependency",
    needs=("Bulkhead",),
    timeout=30,
    seed=202,
)
async def check_bulkhead(r: Report, Bulkhead) -> None:
    spawn = Spawned()
    try:
        await _check_bulkhead(r, Bulkhead, spawn)
    finally:
        await spawn.settle()


async def _check_bulkhead(r: Report, Bulkhead, spawn: Spawned) -> None:
    dep = Blocking()
    bh = Bulkhead(3, max_queue=2)
    tasks = [spawn(bh.call(dep)) for _ in range(10)]
    await _until_idle()
    pending, ok, full, other = _state(tasks)
    r.expect(
        dep.entered == 3 and full == 5 and pending == 5 and other == 0,
        "10 calls at once into Bulkhead(3, max_queue=2): 3 running, 2 waiting, 5 rejected at once with BulkheadFullError"
        if dep.entered == 3 and full == 5 and pending == 5
        else f"10 calls at once into Bulkhead(3, max_queue=2): {dep.entered} running, {pending - dep.entered} waiting, "
        f"{full} rejected with BulkheadFullError, {other} other errors; expected 3, 2, 5, 0"
        + (" (an unbounded queue lets every caller wait)" if full == 0 and other == 0 and dep.entered <= 3 else "")
        + (f" ({other} calls raised another error: a full bulkhead raises BulkheadFullError)" if other else "")
        + (" (at most limit calls of fn run at once)" if dep.entered > 3 else ""),
    )
    dep.gate.set()
    await _until_idle()
    pending, ok, full, other = _state(tasks)
    results = {t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None}
    r.expect(
        ok == 5 and pending == 0 and dep.max_running == 3 and results == {"done"},
        "released: the 3 running and then the 2 waiting calls finished and returned fn's value; never more than 3 at once"
        if ok == 5 and pending == 0 and dep.max_running == 3
        else f"released the dependency: {ok} calls finished, {pending} still pending, at most {dep.max_running} ran at "
        "once; expected 5 finished and 3 at once",
    )
    if r.public:
        return

    clock = VirtualClock()

    async def varied() -> str:
        varied.running += 1
        varied.peak = max(varied.peak, varied.running)
        await clock.sleep(r.random.uniform(0.1, 2.0))
        varied.running -= 1
        return "ok"

    varied.running = varied.peak = 0
    bh = Bulkhead(4, max_queue=100)
    results = await asyncio.gather(*(bh.call(varied) for _ in range(60)), return_exceptions=True)
    done = sum(1 for x in results if x == "ok")
    r.expect(
        done == 60 and varied.peak == 4,
        f"60 calls of random length through Bulkhead(4, max_queue=100): all finished, at most {varied.peak} at once"
        if done == 60 and varied.peak == 4
        else f"60 calls of random length through Bulkhead(4, max_queue=100): {done} finished, {varied.peak} ran at "
        "once at the peak; expected all 60 and exactly 4 at once",
    )

    # --- a hung dependency fills its own bulkhead only
    hung = Blocking()
    search, payments = Bulkhead(2, max_queue=1), Bulkhead(2, max_queue=1)
    stuck = [spawn(search.call(hung)) for _ in range(4)]
    await _until_idle()
    quick = Blocking()
    quick.gate.set()

    async def five_payments() -> list:
        return [await payments.call(quick) for _ in range(5)]

    pay_task = spawn(five_payments())
    await _until_idle()
    r.expect(
        pay_task.done() and pay_task.exception() is None and quick.entered == 5,
        "search hung with its bulkhead full (2 running, 1 waiting, 1 rejected); 5 payments through their own "
        "bulkhead finished at once"
        if pay_task.done() and pay_task.exception() is None
        else f"search hung with its bulkhead full; 5 payments through another Bulkhead: "
        f"{'still waiting' if not pay_task.done() else 'raised ' + repr(pay_task.exception())}, "
        f"{quick.entered} reached payments. Bulkheads must not share permits",
    )
    await _cleanup(*stuck, pay_task)

    # --- permits come back when a call raises
    bh = Bulkhead(2, max_queue=0)

    async def broken() -> str:
        raise ValueError("card declined")

    raised = []
    for _ in range(6):
        try:
            await bh.call(broken)
            raised.append("no error")
        except Exception as err:  # noqa: BLE001 - recorded
            raised.append(type(err).__name__)
    if set(raised) - {"ValueError", "BulkheadFullError"}:  # BulkheadFullError alone: a leaked permit, below
        r.fail(
            f"6 calls whose fn raises ValueError through Bulkhead(2) raised {sorted(set(raised))}: call must let fn's "
            "errors propagate unchanged (wrapped, swallowed or replaced?)"
        )
    after = Blocking()
    tasks = [spawn(bh.call(after)) for _ in range(3)]
    await _until_idle()
    pending, ok, full, other = _state(tasks)
    r.expect(
        raised == ["ValueError"] * 6 and after.entered == 2 and full == 1,
        "6 calls that raised ValueError each passed it on; then 2 of 3 calls ran and 1 was rejected: no permit leaked"
        if raised == ["ValueError"] * 6 and after.entered == 2 and full == 1
        else f"6 calls that raise ValueError through Bulkhead(2) raised {sorted(set(raised))}; then 3 calls at once: "
        f"{after.entered} ran, {full} rejected; expected 2 and 1 (a permit not returned in `finally` leaks on an error)",
    )
    await _cleanup(*tasks)

    # --- permits come back when a running call is cancelled
    bh = Bulkhead(2, max_queue=0)
    first = Blocking()
    running = [spawn(bh.call(first)) for _ in range(2)]
    await _until_idle()
    await _cleanup(*running)
    second = Blocking()
    tasks = [spawn(bh.call(second)) for _ in range(3)]
    await _until_idle()
    pending, ok, full, other = _state(tasks)
    r.expect(
        second.entered == 2 and full == 1,
        "2 running calls cancelled; then 2 of 3 new calls ran and 1 was rejected: the permits came back"
        if second.entered == 2 and full == 1
        else f"cancelled 2 running calls in Bulkhead(2); then 3 calls at once: {second.entered} ran, {full} rejected; "
        "expected 2 and 1 (CancelledError is a BaseException: `except Exception` does not release the permit)",
    )
    await _cleanup(*tasks)

    # --- and when a waiting call is cancelled
    bh = Bulkhead(1, max_queue=2)
    gate = asyncio.Event()
    dep = Blocking(gate)
    a, b, c = (spawn(bh.call(dep)) for _ in range(3))
    await _until_idle()
    b.cancel()
    await _until_idle()
    d = spawn(bh.call(dep))
    e = spawn(bh.call(dep))
    await _until_idle()

    def fate(t: asyncio.Future) -> str:
        if not t.done():
            return "waits"
        return "was rejected" if isinstance(t.exception(), BulkheadFullError) else f"ended with {t.exception()!r}"

    r.expect(
        fate(d) == "waits" and fate(e) == "was rejected",
        "1 running and 2 waiting in Bulkhead(1, max_queue=2); one waiter cancelled; a new call took its place in the "
        "queue and the next was rejected"
        if fate(d) == "waits" and fate(e) == "was rejected"
        else f"1 running and 2 waiting in Bulkhead(1, max_queue=2), then one waiter cancelled and 2 new calls: the "
        f"first {fate(d)}, the second {fate(e)}; expected the first to wait in the freed place and the second to be "
        "rejected (a cancelled waiter must give its place back)",
    )
    gate.set()
    await _until_idle()
    finished = [t for t in (a, c, d) if t.done() and not t.cancelled() and t.exception() is None]
    r.expect(
        len(finished) == 3 and dep.entered == 3 and dep.max_running == 1,
        "released: the running call and both waiters finished, one at a time; the cancelled one never ran"
        if len(finished) == 3 and dep.entered == 3
        else f"released the dependency: {len(finished)} of the 3 live calls finished, {dep.entered} reached it, "
        f"{dep.max_running} at once; expected 3, 3, 1",
    )
    await _cleanup(a, b, c, d, e)
