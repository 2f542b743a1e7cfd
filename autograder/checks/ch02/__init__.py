"""Hidden checks of chapter 02 (circuit breakers, bulkheads and backpressure).

``circuit_breaker``: a 30-second outage of a dependency on a virtual clock (fail fast, one
probe, recovery), then the rules the task states: a 404 counts as a success, a call still in
flight when the breaker opens does not close it. ``bulkhead`` (its checks are in
:mod:`autograder.checks.ch02.bulkhead`) fills bulkheads with calls that block on events the
check controls, so "how many are running" and "who was rejected at once" are exact, not timed.
"""

from __future__ import annotations

import asyncio

from autograder.harness import Report, task
from autograder.probes import Spawned, seeded_random
from course.breaker import CircuitOpenError
from course.kit.faults import DependencyError, VirtualClock, _until_idle

OUTAGE = (10.0, 40.0)  # the dependency is down from t=10 s to t=40 s: 30 seconds
COOLDOWN = 10.0


class Payments:
    """The dependency under the breaker: down during OUTAGE (503s and timeouts), else "paid".

    ``gate``: when set to an ``asyncio.Event``, a call waits on it before answering, so the
    check can hold a probe in flight while other callers arrive.
    """

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.calls: list[float] = []
        self.gate: asyncio.Event | None = None
        self.blip = False  # the next call fails once with a 503, whatever the time
        self.status: int | None = None  # every call fails with this status (a 404, say)

    async def __call__(self) -> str:
        self.calls.append(self.clock())
        if self.gate is not None:
            await self.gate.wait()
        if self.status is not None:
            raise DependencyError(self.status, f"payments answered {self.status}")
        if self.blip:
            self.blip = False
            raise DependencyError(503, "payments answered 503")
        if OUTAGE[0] <= self.clock() < OUTAGE[1]:
            if len(self.calls) % 2:
                raise TimeoutError("payments did not answer within the timeout")
            raise DependencyError(503, "payments answered 503")
        return "paid"


async def _attempt(breaker, fn) -> tuple[str, object]:
    """("ok", value), ("open", CircuitOpenError), ("error", the dependency's error) or ("other", err)."""
    try:
        return "ok", await breaker.call(fn)
    except CircuitOpenError as err:
        return "open", err
    except (DependencyError, TimeoutError) as err:
        return "error", err
    except Exception as err:  # noqa: BLE001 - reported to the learner
        return "other", err


def _seen(outcome: tuple[str, object]) -> str:
    kind, value = outcome
    if kind == "ok":
        return f"returned {value!r}"
    if kind == "open":
        return "raised CircuitOpenError"
    if kind == "cancelled":
        return "was cancelled (by the breaker?)"
    return f"raised {type(value).__name__}: {value}"


@task(
    "circuit_breaker",
    points=6,
    title="circuit breaker: fail fast through a 30-second outage, one probe, recovery",
    needs=("CircuitBreaker",),
    timeout=30,
    seed=202,
)
async def check_circuit_breaker(r: Report, CircuitBreaker) -> None:
    spawn = Spawned()
    try:
        with seeded_random(r):  # a breaker that draws from module random draws the same on every run
            await _check_breaker(r, CircuitBreaker, spawn)
    finally:
        await spawn.settle()


async def _check_breaker(r: Report, CircuitBreaker, spawn: Spawned) -> None:
    clock = VirtualClock(auto=False)
    pay = Payments(clock)

    def at(t: float) -> None:
        clock.advance(max(0.0, t - clock()))

    r.note(f"CircuitBreaker(threshold=0.5, window_size=10, cooldown={COOLDOWN:g}, clock=<virtual clock>)")
    r.note(f"payments is down from t={OUTAGE[0]:g} s to t={OUTAGE[1]:g} s (503s and timeouts); one call a second")
    br = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock)
    r.expect(br.state == "closed", f"a new breaker's state is {br.state!r}, expected 'closed'")

    for t in range(10):
        at(t)
        out = await _attempt(br, pay)
        if out[0] != "ok":
            r.fail(f"healthy call at t={t} s {_seen(out)}, expected 'paid'")
    r.expect(
        len(pay.calls) == 10,
        f"10 healthy calls at t=0..9 s: all returned 'paid', payments called {len(pay.calls)} times",
    )

    # --- the outage begins: the breaker must trip within one window
    failing, t = 0, OUTAGE[0]
    while True:
        at(t)
        before = len(pay.calls)
        out = await _attempt(br, pay)
        if out[0] == "open":
            break
        if out[0] == "other":
            r.fail(
                f"call at t={t:g} s during the outage {_seen(out)}: neither the dependency's own error nor "
                "CircuitOpenError. Was the dependency's error wrapped or replaced, or a rejection raised as another "
                "type? Reject with CircuitOpenError (from course.breaker); let every other error propagate unchanged"
            )
        if out[0] == "ok" or len(pay.calls) != before + 1:
            r.fail(f"call at t={t:g} s during the outage {_seen(out)} with {len(pay.calls) - before} calls to payments")
        failing += 1
        if failing > 10:
            r.fail(
                "11 failing calls in a row during the outage and the breaker still calls payments: it should open "
                "once half of a 10-call window failed (does it read time from clock= and count 503s and timeouts?)"
            )
        t += 1
    tripped_at = t - 1
    r.expect(
        failing >= 3,
        f"the breaker opened after {failing} failing calls that followed 10 healthy ones"
        + ("" if failing >= 3 else ": 2 failures in a 10-call window are far below a 0.5 threshold"),
    )
    r.expect(br.state == "open", f"after tripping, state reads {br.state!r}, expected 'open'")
    calls_at_trip = len(pay.calls)
    for dt in range(1, int(COOLDOWN)):
        at(tripped_at + dt)
        out = await _attempt(br, pay)
        if out[0] != "open" or len(pay.calls) != calls_at_trip:
            r.fail(
                f"call at t={tripped_at + dt:g} s, {dt} s into the {COOLDOWN:g} s cooldown, {_seen(out)} and "
                f"payments was called {len(pay.calls) - calls_at_trip} times; expected CircuitOpenError and no call"
            )
    r.ok(f"{int(COOLDOWN) - 1} calls during the cooldown failed fast with CircuitOpenError, payments not called")
    if r.public:
        return

    await _check_window_rules(r, CircuitBreaker)

    # --- half-open: exactly one probe while concurrent callers are rejected
    probe_at = tripped_at + COOLDOWN + 0.5
    at(probe_at)
    pay.gate = asyncio.Event()
    probe = spawn(_attempt(br, pay))
    await _until_idle()
    r.expect(
        len(pay.calls) == calls_at_trip + 1 and not probe.done(),
        f"after the cooldown (t={probe_at:g} s) one call went through as the probe and is waiting on payments"
        if len(pay.calls) == calls_at_trip + 1 and not probe.done()
        else f"after the cooldown (t={probe_at:g} s) a call {_seen(probe.result()) if probe.done() else 'waited'} "
        f"with {len(pay.calls) - calls_at_trip} calls to payments; expected one probe call, still in flight"
        + (
            " (the cooldown has passed on the clock passed as clock=: read time only from it)"
            if probe.done() and probe.result()[0] == "open"
            else ""
        ),
    )
    r.expect(br.state == "half-open", f"while the probe is in flight, state reads {br.state!r}, expected 'half-open'")
    others = spawn(asyncio.gather(*(_attempt(br, pay) for _ in range(5))))
    await _until_idle()
    let_through = len(pay.calls) - calls_at_trip - 1
    rejected = sum(1 for o in others.result() if o[0] == "open") if others.done() else 0
    r.expect(
        let_through == 0 and rejected == 5,
        "5 concurrent callers during the probe: all 5 rejected with CircuitOpenError, payments not called"
        if let_through == 0 and rejected == 5
        else f"5 concurrent callers (asyncio.gather) while the probe was in flight: {let_through} were let through to "
        f"payments, {rejected} rejected; half-open admits exactly one probe, everyone else fails fast",
    )
    pay.gate.set()
    pay.gate = None
    await _until_idle()
    out = probe.result()
    others.cancel()
    r.expect(
        out[0] == "error",
        f"the probe failed (payments still down at t={probe_at:g} s) and its {_seen(out)[7:]} reached the caller"
        if out[0] == "error"
        else f"the probe at t={probe_at:g} s {_seen(out)}; expected the dependency's own error",
    )
    r.expect(br.state == "open", f"after a failed probe, state reads {br.state!r}, expected 'open'")

    # --- a failed probe reopens with a fresh cooldown; probe until the outage is over
    probes = 1
    last_probe = probe_at
    while True:
        calls = len(pay.calls)
        for dt in (1.0, COOLDOWN - 1):
            at(last_probe + dt)
            out = await _attempt(br, pay)
            if out[0] != "open" or len(pay.calls) != calls:
                r.fail(
                    f"{dt:g} s after the failed probe at t={last_probe:g} s a call {_seen(out)} with "
                    f"{len(pay.calls) - calls} calls to payments; a failed probe opens the breaker for a fresh "
                    f"{COOLDOWN:g} s cooldown, counted from the probe"
                )
        last_probe += COOLDOWN + 0.5
        at(last_probe)
        out = await _attempt(br, pay)
        probes += 1
        if len(pay.calls) != calls + 1:
            r.fail(
                f"the cooldown after the probe at t={last_probe - COOLDOWN - 0.5:g} s had passed, yet at "
                f"t={last_probe:g} s a call {_seen(out)} with {len(pay.calls) - calls} calls to payments; "
                "expected one probe"
            )
        if out[0] == "ok":
            break
        if br.state != "open" or probes > 6:
            r.fail(f"after the failed probe at t={last_probe:g} s state reads {br.state!r}, expected 'open'")
    r.expect(
        last_probe >= OUTAGE[1] and br.state == "closed",
        f"{probes} probes in all; the one at t={last_probe:g} s (outage over) succeeded and closed the breaker",
    )
    down_calls = [c for c in pay.calls if OUTAGE[0] <= c < OUTAGE[1]]
    r.note(
        f"payments was called {len(down_calls)} times during the 30 s outage ({failing} before tripping, the rest probes)"
    )

    # --- traffic recovers, counting afresh
    calls = len(pay.calls)
    pay.blip = True
    outcomes = []
    for i in range(20):
        at(last_probe + 1 + i)
        outcomes.append(await _attempt(br, pay))
    reached = len(pay.calls) - calls
    ok = sum(1 for o in outcomes if o[0] == "ok")
    r.expect(
        reached == 20 and ok == 19 and outcomes[0][0] == "error",
        "after recovery 20 calls, the first a one-off 503: all 20 reached payments, 19 returned 'paid'"
        if reached == 20 and ok == 19
        else f"after recovery 20 calls, the first a one-off 503: {reached} reached payments, {ok} returned 'paid', "
        f"state {br.state!r}; a breaker that closes must start counting afresh (old failures must not count again)",
    )

    # --- 4xx are answers, not illness
    clock2 = VirtualClock(auto=False)
    pay2 = Payments(clock2)
    pay2.status = 404
    br2 = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock2)
    outs = []
    for _ in range(20):
        outs.append(await _attempt(br2, pay2))
        clock2.advance(1)
    errors = sum(1 for o in outs if o[0] == "error" and getattr(o[1], "status", None) == 404)
    r.expect(
        errors == 20 and len(pay2.calls) == 20 and br2.state == "closed",
        "20 calls answered 404 (with the default is_failure): each raised the 404, none tripped the breaker"
        if errors == 20 and len(pay2.calls) == 20
        else f"20 calls answered 404: {errors} raised the 404, payments called {len(pay2.calls)} times, state "
        f"{br2.state!r}; a 404 is the dependency answering, not failing: is_failure must not count it",
    )
    clock3 = VirtualClock(auto=False)
    pay3 = Payments(clock3)
    pay3.status = 404
    br3 = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock3, is_failure=lambda err: True)
    for _ in range(12):
        await _attempt(br3, pay3)
        clock3.advance(1)
    r.expect(
        br3.state == "open" and len(pay3.calls) <= 10,
        "with is_failure=lambda err: True the same 404s opened the breaker: the classifier is the one passed in"
        if br3.state == "open" and len(pay3.calls) <= 10
        else f"with is_failure=lambda err: True, 12 calls answered 404: state {br3.state!r}, payments called "
        f"{len(pay3.calls)} times; expected the breaker to open within 10 calls (use the is_failure passed in)",
    )

    # --- a non-failure is a success: 6 answers of 404, then 503s
    clock4 = VirtualClock(auto=False)
    pay4 = Payments(clock4)
    br4 = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock4)
    pay4.status = 404
    for _ in range(6):
        await _attempt(br4, pay4)
        clock4.advance(1)
    pay4.status = 503
    later = []
    for _ in range(6):
        later.append(await _attempt(br4, pay4))
        clock4.advance(1)
    reached = len(pay4.calls)
    what = "6 calls answered 404, then 6 calls that fail with 503"
    if reached == 10:
        r.fail(
            f"{what}: the breaker opened after the 4th 503 (10 calls in the window): the 404s counted as failures. "
            "A 404 is the dependency answering: it counts as a success"
        )
    if reached >= 12:
        r.fail(
            f"{what}: all 12 reached payments: the 5th 503 should have opened the breaker (window of the last 10: "
            "5 answers of 404 and 5 failures = 0.5). Were the 404s left out of the window? They count as successes"
        )
    r.expect(
        reached == 11 and later[-1][0] == "open",
        f"{what}: the 5th 503 made 5 failures in the last 10 calls and opened it; the 6th failed fast",
        f"{what}: payments called {reached} times, the last call {_seen(later[-1])}; expected 11 calls, then "
        "CircuitOpenError (404s count as successes in the window)",
    )

    # --- a call in flight when the breaker opens finishes, and does not close it
    clock5 = VirtualClock(auto=False)
    pay5 = Payments(clock5)
    br5 = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock5)
    gate = asyncio.Event()

    async def slow_but_fine() -> str:
        await gate.wait()
        return "paid late"

    slow = spawn(_attempt(br5, slow_but_fine))
    await _until_idle()
    pay5.status = 503
    for _ in range(10):
        await _attempt(br5, pay5)
        clock5.advance(0.5)
    opened = br5.state == "open"
    gate.set()
    await _until_idle()
    if slow.done() and slow.cancelled():
        finished = ("cancelled", None)
    else:
        finished = slow.result() if slow.done() else ("other", RuntimeError("still waiting"))
    calls = len(pay5.calls)
    after = await _attempt(br5, pay5)
    what = "a slow call started while closed; 10 failures opened the breaker; then the slow call succeeded"
    r.expect(
        opened and finished == ("ok", "paid late") and after[0] == "open" and len(pay5.calls) == calls,
        f"{what}: its caller got 'paid late', and the breaker stayed open (the next call failed fast)",
        f"{what}: opened={opened}, the slow call {_seen(finished)}, then a new call {_seen(after)} with "
        f"{len(pay5.calls) - calls} call(s) to payments; a call already in flight runs to the end and its result "
        "reaches its caller, but its outcome no longer counts once the state has changed",
    )

    # --- a call in flight since before the breaker opened ends during the probe: only the probe decides
    clock6 = VirtualClock(auto=False)
    pay6 = Payments(clock6)
    br6 = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock6)
    old_gate, probe_gate = asyncio.Event(), asyncio.Event()

    async def old_call() -> str:
        await old_gate.wait()
        return "paid late"

    async def probe_call():
        await probe_gate.wait()
        return await pay6()

    old = spawn(_attempt(br6, old_call))
    await _until_idle()
    pay6.status = 503
    for _ in range(10):
        await _attempt(br6, pay6)
        clock6.advance(0.5)
    clock6.advance(COOLDOWN)
    probe = spawn(_attempt(br6, probe_call))  # the probe, held in flight
    await _until_idle()
    probing = br6.state
    old_gate.set()  # the old call succeeds while the probe is out
    await _until_idle()
    during = br6.state
    probe_gate.set()  # the probe fails (503)
    await _until_idle()
    ended = probe.result() if probe.done() and not probe.cancelled() else ("other", RuntimeError("still waiting"))
    after = br6.state
    what = (
        "a slow call started while closed, 10 failures opened the breaker, the cooldown passed and a probe went out; "
        "the slow call then succeeded while the probe was in flight"
    )
    r.expect(
        probing == "half-open" and during == "half-open" and old.done() and after == "open",
        f"{what}: the breaker stayed half-open until the probe failed, then opened",
        f"{what}: the state was {probing!r} with the probe out, {during!r} after the slow call succeeded, "
        f"{after!r} after the probe {_seen(ended)}; expected 'half-open', 'half-open', 'open'. Only the probe's "
        "outcome decides half-open: a call already in flight when the state changed no longer counts (remember "
        "which call is the probe, or the state each call started in)",
    )

    # --- a call in flight since before the breaker opened ends after it has closed again: not in the fresh window
    clock7 = VirtualClock(auto=False)
    pay7 = Payments(clock7)
    br7 = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock7)
    clock7.advance(OUTAGE[1])  # after the outage: payments answers by its status alone
    stale_gate = asyncio.Event()

    async def stale_failure() -> str:
        await stale_gate.wait()
        raise DependencyError(503, "payments answered 503, late")

    stale = spawn(_attempt(br7, stale_failure))
    await _until_idle()
    pay7.status = 503
    for _ in range(10):
        await _attempt(br7, pay7)
        clock7.advance(0.5)
    clock7.advance(COOLDOWN)
    pay7.status = None
    probe_out = await _attempt(br7, pay7)  # the probe succeeds: closed, an empty window
    reclosed = br7.state
    stale_gate.set()  # the old call fails now, in the fresh closed period
    await _until_idle()
    stale_out = stale.result() if stale.done() and not stale.cancelled() else ("other", RuntimeError("still waiting"))
    pattern = [None, 503, None, 503, None, 503, None, None, 503]  # 4 failures in 9 calls, the last one failing
    for status in pattern:
        pay7.status = status
        await _attempt(br7, pay7)
        clock7.advance(0.5)
    pay7.status = None
    calls = len(pay7.calls)
    tenth = await _attempt(br7, pay7)
    what = (
        "a slow call started while closed, 10 failures opened the breaker, a probe closed it again, then the slow "
        "call failed with a 503; then 9 calls, 4 of them failing, and a 10th"
    )
    seen = (
        f"{what}: the probe {_seen(probe_out)} (state {reclosed!r}), the old call {_seen(stale_out)}, and the 10th "
        f"call {_seen(tenth)} with {len(pay7.calls) - calls} call(s) to payments, state {br7.state!r}"
    )
    if probe_out[0] != "ok" or reclosed != "closed" or stale_out[0] != "error":
        r.fail(f"{seen}; expected the probe to return 'paid' and close the breaker, and the old call's 503 to reach it")
    r.expect(
        tenth == ("ok", "paid") and len(pay7.calls) == calls + 1,
        f"{what}: the old call's 503 reached its caller, and the breaker stayed closed (4 failures in the 9 "
        "calls of the fresh window, 4 in 10 after the 10th)",
        f"{seen}; expected 'paid'. Likely the old call's failure counted in the fresh window (5 failures in 10 "
        "calls): a call in flight when the state changed no longer counts, even if the breaker is closed again "
        "when it ends. The state a call started in is not enough (it was closed then too): remember each change "
        "(a generation number that every open and close bumps) and count a call only if none happened while it ran",
    )

    # --- a probe whose caller is cancelled decides nothing: the next caller is the probe
    clock9 = VirtualClock(auto=False)
    pay9 = Payments(clock9)
    br9 = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock9)
    clock9.advance(OUTAGE[1])
    pay9.status = 503
    for _ in range(10):
        await _attempt(br9, pay9)
        clock9.advance(0.5)
    clock9.advance(COOLDOWN)
    pay9.status = None
    pay9.gate = asyncio.Event()
    hung = spawn(_attempt(br9, pay9))  # the probe, held in flight
    await _until_idle()
    hung.cancel()  # its client hung up
    await _until_idle()
    pay9.gate = None
    calls = len(pay9.calls)
    next_probe = await _attempt(br9, pay9)
    what = "10 failures opened the breaker; after the cooldown the probe's caller was cancelled while it waited"
    r.expect(
        next_probe == ("ok", "paid") and len(pay9.calls) == calls + 1 and br9.state == "closed",
        f"{what}: the next call went through as the probe, returned 'paid' and closed the breaker",
        f"{what}: the next call {_seen(next_probe)} with {len(pay9.calls) - calls} call(s) to payments, state "
        f"{br9.state!r}; a cancelled probe decides nothing, and the next caller must become the probe. Likely the "
        "probe flag was cleared only on Exception: cancellation is a BaseException (clear it in a finally:), or "
        "the breaker stays half-open, rejecting everyone, for good",
    )

    # --- a probe answered 404 is a success: it closes the breaker
    clock8 = VirtualClock(auto=False)
    pay8 = Payments(clock8)
    br8 = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock8)
    clock8.advance(OUTAGE[1])
    pay8.status = 503
    for _ in range(10):
        await _attempt(br8, pay8)
        clock8.advance(0.5)
    clock8.advance(COOLDOWN)
    pay8.status = 404
    probe404 = await _attempt(br8, pay8)
    state404 = br8.state
    pay8.status = None
    calls = len(pay8.calls)
    next_out = await _attempt(br8, pay8)
    what = "10 failures opened the breaker; after the cooldown the probe was answered 404"
    r.expect(
        probe404[0] == "error"
        and getattr(probe404[1], "status", None) == 404
        and state404 == "closed"
        and next_out == ("ok", "paid")
        and len(pay8.calls) == calls + 1,
        f"{what}: the 404 reached the caller and closed the breaker (an error is_failure does not count is a success)",
        f"{what}: the probe {_seen(probe404)}, the state then read {state404!r}, and the next call {_seen(next_out)} "
        f"with {len(pay8.calls) - calls} call(s) to payments; expected the 404 to reach the caller and the breaker "
        "to close: an error that is_failure does not count is a success, for a probe too (the dependency answered)",
    )


async def _check_window_rules(r: Report, CircuitBreaker) -> None:
    """The window: no trip before ``window_size`` calls; a failure *rate*, not a run of failures."""
    clock = VirtualClock(auto=False)
    pay = Payments(clock)
    br = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock)
    pay.status = 503
    first = await _attempt(br, pay)
    pay.status = None
    clock.advance(1)
    second = await _attempt(br, pay)
    r.expect(
        first[0] == "error" and second == ("ok", "paid") and len(pay.calls) == 2,
        "a new breaker whose first call failed (1 of 1) let the second through: it trips only on a full window",
        f"a new breaker: the first call failed, then the second {_seen(second)} with {len(pay.calls)} calls to "
        f"payments in all; a breaker may trip only once window_size (10) calls have been seen (1 failure of 1 call "
        "is not a rate over the window)",
    )
    clock = VirtualClock(auto=False)
    pay = Payments(clock)
    br = CircuitBreaker(threshold=0.5, window_size=10, cooldown=COOLDOWN, clock=clock)
    pattern = [None, 503, 503, None, 503, 503, None, 503, None, 503]  # 6 of 10 fail, never 3 in a row
    for status in pattern:
        pay.status = status
        await _attempt(br, pay)
        clock.advance(0.5)  # all before the outage at t=10 s
    pay.status = None
    after = await _attempt(br, pay)
    r.expect(
        after[0] == "open" and len(pay.calls) == 10,
        "10 calls of which 6 failed, never 3 in a row: the breaker opened and the 11th failed fast",
        f"10 calls of which 6 failed (0.6 >= 0.5), never 3 in a row: the 11th {_seen(after)} with {len(pay.calls)} "
        f"calls to payments, state {br.state!r}; threshold is a failure rate over the last window_size calls "
        "(a count of consecutive failures, or a window cleared by each success, never sees it)",
    )


# Imported after the circuit breaker's check, so the chapter's tasks are reported in the same order.
from autograder.checks.ch02 import bulkhead  # noqa: F401, E402
from autograder.checks.ch02.rules import REFERENCES, RULES  # noqa: E402 - the rule tables, kept beside the checks

__all__ = ["REFERENCES", "RULES"]
