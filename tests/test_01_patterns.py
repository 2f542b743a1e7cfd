"""Chapter 01's patterns (backoff strategies, retry limits, budgets, deadlines, hedged reads)
and its demos (course.chapters.ch01: the herd simulation, the live runs). Virtual time
wherever the behaviour allows it."""

from __future__ import annotations

import asyncio
import heapq
import random

import httpx
import pytest

from course import backoff, budgets, hedging, retry
from course.chapters import ch01
from course.chapters.ch01 import herd
from course.kit.faults import DependencyError, FlakyDependency, FlakyService, Schedule, VirtualClock

# ----------------------------------------------------------------------------- backoff


def test_01_capped_exponential_doubles_then_stays_at_the_cap():
    assert backoff.Exponential(0.1, 1.0).delays(6) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_01_full_jitter_scales_the_window_by_rand():
    draws = iter([0.5, 0.25, 1.0])
    assert backoff.FullJitter(0.1, 0.3).delays(3, lambda: next(draws)) == pytest.approx([0.05, 0.05, 0.3])


def test_01_equal_jitter_keeps_half_the_window():
    assert backoff.EqualJitter(0.1, 2.0).delays(3, lambda: 0.0) == pytest.approx([0.05, 0.1, 0.2])
    assert backoff.EqualJitter(0.1, 2.0).delays(3, lambda: 1.0) == pytest.approx([0.1, 0.2, 0.4])


def test_01_decorrelated_jitter_grows_from_the_previous_wait_up_to_the_cap():
    assert backoff.DecorrelatedJitter(0.1, 1.0).delays(4, lambda: 1.0) == pytest.approx([0.3, 0.9, 1.0, 1.0])
    assert backoff.DecorrelatedJitter(0.1, 1.0).delays(3, lambda: 0.0) == pytest.approx([0.1, 0.1, 0.1])


def test_01_fixed_and_linear():
    assert backoff.Fixed(0.2, 1.0).delays(3) == [0.2, 0.2, 0.2]
    assert backoff.Linear(0.2, 0.5).delays(4) == pytest.approx([0.2, 0.4, 0.5, 0.5])


def test_01_huge_attempts_do_not_overflow():
    assert backoff.Exponential(0.1, 2.0).delay(10_000) == 2.0


# ----------------------------------------------------------------------------- herd


def _scalar_race(clients: int, strategy: str, trials: int, seed: int, base=5.0, cap=2000.0) -> tuple[float, float]:
    """The same model as course.chapters.ch01.herd, written as a plain one-trial-at-a-time event loop."""
    rng = random.Random(seed)

    def d() -> float:
        return abs(rng.gauss(10, 2))

    calls_total = time_total = 0.0
    for _ in range(trials):
        version, calls, finish = 0, 0, 0.0
        seen, fails, prev = [0] * clients, [0] * clients, [base] * clients
        queue = [(d(), i, "read") for i in range(clients)]
        heapq.heapify(queue)
        while queue:
            t, i, what = heapq.heappop(queue)
            if what == "read":
                seen[i] = version
                heapq.heappush(queue, (t + d() + d(), i, "write"))
                continue
            calls += 1
            if seen[i] == version:
                version += 1
                finish = max(finish, t + d())
                continue
            fails[i] += 1
            e = min(cap, base * 2 ** fails[i])
            u = rng.random()
            sleep = {
                "none": 0.0,
                "exponential": e,
                "equal jitter": e / 2 + u * e / 2,
                "full jitter": u * e,
                "decorrelated jitter": min(cap, base + u * (prev[i] * 3 - base)),
            }[strategy]
            prev[i] = sleep if strategy == "decorrelated jitter" else prev[i]
            heapq.heappush(queue, (t + d() + d() + sleep, i, "read"))
        calls_total += calls
        time_total += finish
    return calls_total / trials, time_total / trials


@pytest.mark.parametrize("strategy", herd.STRATEGIES)
def test_01_vectorised_herd_matches_a_plain_event_loop(strategy):
    res = herd.simulate(20, (strategy,), trials=200, seed=3)
    calls, completion = _scalar_race(20, strategy, trials=200, seed=4)
    assert res.mean_calls(strategy) == pytest.approx(calls, rel=0.08)
    assert res.mean_completion_ms(strategy) == pytest.approx(completion, rel=0.12)


def test_01_herd_every_client_wins_exactly_once():
    res = herd.simulate(15, trials=5, seed=1, record=True)
    for strategy in herd.STRATEGIES:
        assert (res.calls[strategy] >= 15).all()
        assert len(res.write_times_ms[strategy]) == res.calls[strategy][0]


def test_01_herd_reproduces_brookers_claims_at_100_clients():
    sweep = herd.sweep((10, 50, 100), trials=25, seed=9)
    table = herd.claims_table(sweep[100], sweep)
    assert len(table) == 5
    failed = [(claim, measured) for claim, measured, ok in table if not ok]
    assert not failed, failed


def test_01_herd_is_deterministic_for_a_seed():
    a, b = herd.simulate(10, trials=5, seed=42), herd.simulate(10, trials=5, seed=42)
    assert all((a.calls[s] == b.calls[s]).all() for s in herd.STRATEGIES)


async def test_01_live_storm_every_client_gets_through_and_every_request_is_counted():
    run = await herd.live_storm("full jitter", clients=20, outage=0.2, base=0.05, cap=0.2, max_attempts=12)
    assert sum(s == 200 for s in run.statuses) == 20
    assert all(s in (200, 503) for s in run.statuses)
    assert len(run.arrivals) == len(run.statuses) <= 20 * 12
    starts, counts = run.per_bucket(0.05)
    assert counts.sum() == len(run.arrivals)


# ----------------------------------------------------------------------------- retry limits


async def test_01_retry_call_stops_at_the_total_time_limit():
    clock = VirtualClock()
    dep = FlakyDependency(Schedule("fail", then="repeat"), clock=clock)
    state = retry.RetryState()
    policy = retry.RetryPolicy(max_attempts=100, max_elapsed=2.0, backoff=backoff.Exponential(0.1, 1.0))
    with pytest.raises(DependencyError):
        await retry.retry_call(dep, policy, clock=clock, sleep=clock.sleep, state=state)
    assert clock() <= 2.0
    assert "limit" in state.gave_up
    assert state.delays == pytest.approx([0.1, 0.2, 0.4, 0.8])  # the next 1.0 would end at 2.5 s


async def test_01_retry_call_records_metadata_before_each_wait():
    clock = VirtualClock()
    dep = FlakyDependency(Schedule("fail fail ok"), clock=clock)
    rows = []
    policy = retry.RetryPolicy(backoff=backoff.Fixed(0.5, 1.0))
    result = await retry.retry_call(
        dep, policy, clock=clock, sleep=clock.sleep, on_retry=lambda s: rows.append(s.as_row())
    )
    assert result == "ok"
    assert [(r["attempt"], r["first_failure_at"], r["last_failure_at"], r["next_retry_at"]) for r in rows] == [
        (1, 0.0, 0.0, 0.5),
        (2, 0.0, 0.5, 1.0),
    ]
    assert "503" in rows[-1]["last_error"]


async def test_01_retry_call_does_not_retry_a_404():
    dep = FlakyDependency(Schedule("404 ok"))
    with pytest.raises(DependencyError):
        await retry.retry_call(dep, sleep=VirtualClock().sleep)
    assert dep.count == 1


@pytest.mark.parametrize(("layers", "attempts", "calls"), [(1, 3, 3), (3, 3, 27), (5, 3, 243), (2, 5, 25)])
async def test_01_retries_multiply_across_layers(layers, attempts, calls):
    assert await ch01.layered_calls(layers, attempts) == calls


async def test_01_live_errors_are_real_httpx_errors():
    found = dict(await ch01.live_errors(("200", "404", "503", "505", "reset"), timeout=0.5))
    assert found["200"] is None
    assert isinstance(found["404"], httpx.HTTPStatusError) and not retry.is_retryable(found["404"])
    assert isinstance(found["503"], httpx.HTTPStatusError) and retry.is_retryable(found["503"])
    assert isinstance(found["505"], httpx.HTTPStatusError) and not retry.is_retryable(found["505"])
    assert isinstance(found["reset"], httpx.TransportError) and retry.is_retryable(found["reset"])
    assert isinstance(found["refused"], httpx.ConnectError) and retry.safe_to_retry(found["refused"], idempotent=False)
    assert isinstance(found["pool full"], httpx.PoolTimeout) and not retry.is_retryable(found["pool full"])
    assert isinstance(found["bad scheme"], httpx.UnsupportedProtocol) and not retry.is_retryable(found["bad scheme"])
    assert isinstance(found["bad header"], httpx.LocalProtocolError) and not retry.is_retryable(found["bad header"])


# ----------------------------------------------------------------------------- the retry table


@pytest.mark.parametrize("row", retry.RETRY_TABLE, ids=lambda row: row.failure[:40])
def test_01_the_retry_table_and_the_code_agree(row):
    """Every example error of a row gets the verdicts the row prints, from is_retryable
    (the idempotent column) and safe_to_retry (the other one)."""
    for make in row.examples:
        err = make()
        assert retry.is_retryable(err) is row.idempotent.startswith("yes"), (row.failure, err)
        assert retry.safe_to_retry(err, idempotent=False) is row.not_idempotent.startswith("yes"), (row.failure, err)


def test_01_only_connect_failures_and_408_429_are_known_not_to_have_run():
    assert not retry.outcome_unknown(httpx.ConnectError("refused"))
    assert not retry.outcome_unknown(DependencyError(429))
    for err in (httpx.ReadTimeout("t"), httpx.RemoteProtocolError("gone"), DependencyError(502), TimeoutError()):
        assert retry.outcome_unknown(err) and retry.is_retryable(err)


def test_01_the_retry_table_renders_as_markdown():
    table = retry.retry_table().splitlines()
    assert len(table) == len(retry.RETRY_TABLE) + 2 and all(line.count("|") >= 5 for line in table)


# ----------------------------------------------------------------------------- Retry-After


def _answer(status: int, **headers) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://svc.local/x")
    response = httpx.Response(status, headers=headers, request=request)
    return httpx.HTTPStatusError(str(status), request=request, response=response)


def test_01_retry_after_reads_seconds_dates_and_errors():
    assert retry.parse_retry_after("120") == 120.0
    assert retry.parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470) == 10.0
    assert retry.parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490) == 0.0
    assert retry.parse_retry_after("soon") is None and retry.parse_retry_after(None) is None
    assert retry.parse_retry_after("-3") is None and retry.parse_retry_after("1.5") is None  # not delay-seconds
    assert retry.retry_after(_answer(503, **{"Retry-After": "7"})) == 7.0
    assert retry.retry_after(_answer(503)) is None
    assert retry.retry_after({"retry-after": "7"}) == 7.0


def test_01_retry_after_reads_a_date_against_the_servers_own_clock():
    err = _answer(429, **{"Retry-After": "Wed, 21 Oct 2015 07:28:30 GMT", "Date": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert retry.retry_after(err) == 30.0  # whatever our clock says


def test_01_retry_after_is_capped_at_what_the_caller_has_left():
    assert retry.retry_after("120", cap=5.0) == 5.0
    assert retry.retry_after("2", cap=5.0) == 2.0
    from course.breaker import CircuitOpenError

    assert retry.retry_after(CircuitOpenError("payments", 12.5), cap=3.0) == 3.0


async def test_01_retry_call_waits_at_least_what_retry_after_asks():
    clock = VirtualClock()
    answers = iter([_answer(503, **{"Retry-After": "2"}), _answer(429, **{"Retry-After": "1"})])

    async def call():
        err = next(answers, None)
        if err is not None:
            raise err
        return "ok"

    state = retry.RetryState()
    policy = retry.RetryPolicy(max_elapsed=10.0, backoff=backoff.FullJitter(0.01, 0.05))
    assert await retry.retry_call(call, policy, clock=clock, sleep=clock.sleep, rand=lambda: 0.5, state=state) == "ok"
    assert state.delays == pytest.approx([2.0 * 1.1, 1.0 * 1.1])  # the ask, plus half of the 20% spread


async def test_01_retry_call_gives_up_when_retry_after_passes_the_time_limit():
    clock = VirtualClock()

    async def call():
        raise _answer(503, **{"Retry-After": "60"})

    state = retry.RetryState()
    with pytest.raises(httpx.HTTPStatusError):
        await retry.retry_call(call, retry.RetryPolicy(max_elapsed=5.0), clock=clock, sleep=clock.sleep, state=state)
    assert state.attempt == 1 and clock.sleeps == [] and "Retry-After asks for 60 s" in state.gave_up


async def test_01_a_client_honouring_retry_after_waits_what_the_server_asked():
    ignores, honours = await ch01.retry_after_race(busy=1.0, retry_after=1)
    assert ignores.calls[-1][1] == honours.calls[-1][1] == 200
    assert honours.rejected == len(honours.waits) and all(1.0 <= w <= 1.2 for w in honours.waits)
    assert all(w < 1.0 for w in ignores.waits[:3])  # backoff from 50 ms, deaf to the header


def test_01_a_deadline_crosses_hosts_as_the_time_left():
    clock = VirtualClock(100.0, auto=False)
    sent = budgets.Deadline.after(0.75, clock).to_header()
    assert sent == "750"
    elsewhere = VirtualClock(5_000.0, auto=False)  # another host, another clock
    assert budgets.Deadline.from_header(sent, elsewhere).remaining() == pytest.approx(0.75)
    assert budgets.Deadline.from_header(None, elsewhere, default=2.0).remaining() == pytest.approx(2.0)
    with pytest.raises(ValueError):
        budgets.Deadline.from_header("soon", elsewhere)


def test_01_clock_skew_breaks_absolute_deadlines_not_durations():
    ahead, same, behind = ch01.deadline_across_hosts(skews=(2.0, 0.0, -2.0), budget=1.0, transit=0.005)
    assert ahead["absolute"] == 0.0 and behind["absolute"] == pytest.approx(2.995)
    assert ahead["remaining"] == same["remaining"] == behind["remaining"] == pytest.approx(1.0)


async def test_01_call_next_hop_never_starts_a_try_without_time_left():
    clock = VirtualClock()
    calls = []

    async def callee(deadline):
        calls.append(deadline.remaining())
        await clock.sleep(10)

    def virtual_wait(task, seconds):
        return ch01.wait_for_virtual(asyncio.ensure_future(task), seconds, clock)

    deadline = budgets.Deadline.after(1.0, clock)
    with pytest.raises(budgets.DeadlineExceeded):
        await budgets.call_next_hop(callee, deadline, own_timeout=0.6, attempts=3, reserve=0.05, wait_for=virtual_wait)
    assert calls == pytest.approx([0.95, 0.35])  # two tries fit, the third would start with nothing left


async def test_01_healthy_chain_answers_either_way():
    chain = [ch01.Hop("gateway", 0.02, 5.0), ch01.Hop("db", 0.1, 2.0)]
    for propagate in (False, True):
        assert (await ch01.call_chain(chain, 1.0, propagate=propagate)).outcome == "200"


# ----------------------------------------------------------------------------- hedging


async def test_01_hedge_wins_when_the_first_replica_is_slow_and_the_loser_is_cancelled():
    clock = VirtualClock()
    cancelled = []

    async def read(replica):
        try:
            await clock.sleep({"a": 1.0, "b": 0.01}[replica])
            return replica
        except asyncio.CancelledError:
            cancelled.append(replica)
            raise

    stats = hedging.HedgeStats()
    assert await hedging.hedged(read, ["a", "b"], hedge_after=0.05, sleep=clock.sleep, stats=stats) == "b"
    assert clock() == pytest.approx(0.06)
    assert cancelled == ["a"] and stats.hedges == 1 and stats.hedge_wins == 1


async def test_01_no_hedge_when_the_first_answer_is_fast():
    clock = VirtualClock()

    async def read(replica):
        await clock.sleep(0.01)
        return replica

    stats = hedging.HedgeStats()
    assert await hedging.hedged(read, ["a", "b"], hedge_after=0.05, sleep=clock.sleep, stats=stats) == "a"
    assert stats.hedges == 0


async def test_01_a_fast_failure_hedges_at_once_and_all_failing_raises_the_first_error():
    clock = VirtualClock()

    async def read(replica):
        raise DependencyError(503, f"{replica} down")

    with pytest.raises(DependencyError, match="a down"):
        await hedging.hedged(read, ["a", "b"], hedge_after=10.0, sleep=clock.sleep)
    assert clock() == 0.0


async def test_01_live_hedged_reads_answer_every_read():
    plain, hedged_run, hedge_after = await ch01.hedging_demo(n=60, slow_share=0.1, slow=0.1)
    assert len(plain.latencies_ms) == len(hedged_run.latencies_ms) == 60
    assert hedge_after > 0
    assert hedged_run.stats.requests == 60
    assert hedged_run.stats.hedge_wins <= hedged_run.stats.hedges <= 60


def test_01_a_percentile_needs_about_ten_samples_beyond_it():
    rows = {row["n"]: row for row in ch01.percentile_spread(99.9, sizes=(400, 10_000), trials=60)}
    narrow, wide = rows[10_000], rows[400]
    assert (narrow["high"] - narrow["low"]) < (wide["high"] - wide["low"]) / 2
    assert narrow["low"] < narrow["truth"] < narrow["high"]


def test_01_postgres_timeouts_fire_on_the_server(ns):
    import psycopg

    from course.chapters.ch01 import postgres as pgt

    with ns.connect(options="-c statement_timeout=100") as conn, pytest.raises(psycopg.errors.QueryCanceled):
        conn.execute("SELECT pg_sleep(2)")
    with ns.connect() as holder, ns.connect() as waiter:
        pgt.setup_accounts(holder)
        pgt.setup_accounts(holder)  # twice: a notebook runs twice
        holder.execute("BEGIN")
        holder.execute("SELECT * FROM ch01_accounts WHERE id = 1 FOR UPDATE")
        waiter.execute("SET lock_timeout = '50ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            waiter.execute("UPDATE ch01_accounts SET balance = 0 WHERE id = 1")
        holder.execute("ROLLBACK")


async def test_01_a_caller_that_gives_up_leaves_the_query_running(ans):
    from course.chapters.ch01 import postgres as pgt

    rows = await pgt.abandoned_query(ans, seconds=2.0, patience=0.2)
    assert [state for _, state, _ in rows] == ["active"]  # the caller gave up, the server did not
    assert all(state != "active" for _, state, _ in pgt.activity(ans, "abandoned report"))  # pg_cancel_backend did


def test_01_fanout_tail_is_63_percent_at_100_shards():
    assert ch01.fanout_slow_share(100, 0.01) == pytest.approx(1 - 0.99**100, abs=0.02)


async def test_01_pool_exhaustion_without_and_with_a_timeout():
    stuck = await ch01.pool_exhaustion(None, hanging=2, healthy=4, max_connections=2, observe=0.5)
    freed = await ch01.pool_exhaustion(httpx.Timeout(0.1, pool=1.0), hanging=2, healthy=4, max_connections=2)
    assert len(stuck.healthy_done()) == 0
    assert len(freed.healthy_done()) == 4
    assert {c.outcome for c in freed.calls if c.kind == "hanging"} == {"ReadTimeout"}


async def test_01_live_flaky_service_counts_every_storm_request():
    async with FlakyService(Schedule("503 ok")) as svc, httpx.AsyncClient() as client:
        assert (await client.get(svc.url)).status_code == 503
        assert (await client.get(svc.url)).status_code == 200
        assert svc.count == 2
