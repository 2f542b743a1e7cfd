"""course.breaker (chapter 02): the reference circuit breaker, its windows, and the demos built on it (course.chapters.ch02)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from course.breaker import CircuitBreaker, CircuitOpenError, counts_as_failure
from course.chapters import ch02
from course.chapters.ch02 import (
    SketchBreaker,
    half_open_stampede,
    library_breakers,
    one_for_all,
    run_in_thread,
    simulate_outage,
)
from course.chapters.ch02.checkout import Checkout
from course.kit.faults import DependencyError, FlakyService, Schedule, VirtualClock
from course.retry import is_retryable


async def fail():
    raise DependencyError(503)


async def ok():
    return "ok"


def run(coro):
    return asyncio.run(coro)


async def calls(breaker, fn, n):
    out = []
    for _ in range(n):
        try:
            out.append(await breaker.call(fn))
        except CircuitOpenError:
            out.append("open")
        except DependencyError as err:
            out.append(err.status)
    return out


def test_timeouts_connection_errors_and_5xx_count_but_4xx_and_429_do_not():
    assert counts_as_failure(TimeoutError())
    assert counts_as_failure(httpx.ConnectError("refused"))
    assert counts_as_failure(DependencyError(500)) and counts_as_failure(DependencyError(408))
    assert not counts_as_failure(DependencyError(404))
    assert not counts_as_failure(DependencyError(429))
    assert not counts_as_failure(KeyError("bug"))


def test_an_open_circuit_is_not_retryable():
    assert not counts_as_failure(CircuitOpenError("x", 1))
    assert not is_retryable(CircuitOpenError("x", 1))


def test_it_does_not_trip_before_min_calls():
    br = CircuitBreaker(0.5, 10, 30, clock=VirtualClock())
    assert run(calls(br, fail, 9)) == [503] * 9
    assert br.state == "closed"
    assert run(calls(br, fail, 2)) == [503, "open"]


def test_open_rejects_with_the_time_left_as_retry_after():
    clock = VirtualClock(auto=False)
    br = CircuitBreaker(0.5, 2, 30, clock=clock)
    run(calls(br, fail, 2))
    clock.advance(10)
    with pytest.raises(CircuitOpenError) as info:
        run(br.call(ok))
    assert info.value.retry_after == pytest.approx(20)
    assert info.value.retry_after_header == "20"


def test_a_successful_probe_closes_with_an_empty_window():
    clock = VirtualClock(auto=False)
    br = CircuitBreaker(0.5, 4, 5, clock=clock)
    run(calls(br, fail, 4))
    clock.advance(5)
    assert run(br.call(ok)) == "ok"
    assert br.state == "closed"
    assert br.window.stats(clock()) == (0, 0)
    assert [s for _, s in br.transitions] == ["closed", "open", "half-open", "closed"]


def test_a_cancelled_probe_frees_the_probe_slot():
    async def scenario():
        clock = VirtualClock(auto=False)
        br = CircuitBreaker(0.5, 2, 5, clock=clock)
        await calls(br, fail, 2)
        clock.advance(5)
        probe = asyncio.ensure_future(br.call(asyncio.Event().wait))
        await asyncio.sleep(0)
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
        return await br.call(ok)

    assert run(scenario()) == "ok"


def test_a_time_window_forgets_old_failures():
    clock = VirtualClock(auto=False)
    br = CircuitBreaker(0.5, 10, 30, clock=clock, window="time", min_calls=3)
    run(calls(br, fail, 2))
    clock.advance(11)
    assert run(calls(br, fail, 2)) == [503, 503]
    assert br.state == "closed"
    assert run(calls(br, fail, 1)) == [503] and br.state == "open"


def test_sketch_breaker_never_trips_when_successes_are_sprinkled_in():
    br = SketchBreaker(0.5, 10, 30, clock=VirtualClock())

    async def mostly_failing():
        out = []
        for i in range(50):
            out += await calls(br, ok if i % 5 == 4 else fail, 1)
        return out

    assert "open" not in run(mostly_failing())


def test_the_outage_simulation_counts_calls_to_the_dead_dependency():
    without = run(simulate_outage(None))
    with_breaker = run(simulate_outage(lambda clock: CircuitBreaker(0.5, 10, 10, clock=clock)))
    assert without.calls_while_down > 5 * with_breaker.calls_while_down
    assert with_breaker.count("rejected") > 0 and without.count("rejected") == 0
    assert [s for _, s in with_breaker.transitions][:2] == ["closed", "open"]
    assert with_breaker.transitions[-1][1] == "closed"


def test_the_simulation_is_deterministic_and_runs_from_a_thread():
    def once():
        return run_in_thread(lambda: simulate_outage(lambda clock: CircuitBreaker(0.3, 5, 4, clock=clock))).summary()

    assert once() == once()


def test_one_breaker_for_all_rejects_healthy_payments():
    shared, separate = run(one_for_all(True)), run(one_for_all(False))
    assert shared["payments"]["rejected"] > 0
    assert separate["payments"] == {"ok": 120, "failed": 0, "rejected": 0}


def test_only_the_course_breaker_sends_a_single_probe():
    async def scenario():
        async with FlakyService(name="payments") as svc:
            return {
                name: await half_open_stampede(make(), svc, callers=8, cooldown=0.05, timeout=0.1)
                for name, make in library_breakers(0.05).items()
            }

    reached = run(scenario())
    assert reached["course.breaker"] == 1
    assert reached["blog sketch"] == 8


def test_checkout_answers_503_with_retry_after_when_the_breaker_is_open():
    async def scenario():
        async with FlakyService("fail", name="payments") as svc:
            svc.set_schedule(Schedule("fail", then="repeat"))
            async with httpx.AsyncClient(timeout=0.5) as client:
                app = Checkout(svc.url, client, breaker=CircuitBreaker(0.5, 2, 30), workers=2)
                responses = [await app.handle({"order": i, "amount": 100}) for i in range(5)]  # one at a time
                return [(r.status, r.headers.get("Retry-After")) for r in responses], svc.count

    statuses, reached = run(scenario())
    assert statuses[:2] == [(502, None), (502, None)]
    assert set(statuses[2:]) == {(503, "30")}
    assert reached == 2


def test_an_unfinished_class_reads_as_its_class_and_method(capsys):
    """The learner's kernel names the stub behind the error: the class, not a bare __init__."""
    from course.kit.notebook import try_it

    class CircuitBreaker:
        def __init__(self, threshold=0.5):
            raise NotImplementedError("not done yet")

    with try_it():
        CircuitBreaker()
    out = capsys.readouterr().out
    assert out.startswith("not done yet: ") and "CircuitBreaker.__init__" in out


def test_breakers_per_process_trip_n_times_slower_and_send_n_probes():
    one = asyncio.run(ch02.per_process(1))
    five = asyncio.run(ch02.per_process(5))
    assert five["before_open"] == 5 * one["before_open"]
    assert five["probes"] == 5 * one["probes"] > 0


def test_callers_told_the_same_retry_after_come_back_together_unless_they_jitter():
    exact = ch02.returning_callers(150, burst=0.05, retry_after=1.0)
    spread = ch02.returning_callers(150, burst=0.05, retry_after=1.0, spread=1.0)
    assert ch02.peak(exact) == 150
    assert ch02.peak(spread) < 40
    assert min(spread) >= 1.0  # never earlier than the server asked
