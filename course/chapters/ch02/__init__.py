"""Chapter 02 (circuit breakers, bulkheads and backpressure): what the notebook runs and plots.

- :class:`SketchBreaker`: a literal port of a widely copied TypeScript sketch, kept to show
  its flaws (every success wipes the counts, every concurrent caller goes through in
  half-open); :class:`course.breaker.CircuitBreaker` is the fix;
- :func:`per_process`: one breaker per process, as every library keeps it: N pods trip N
  times slower and send N probes;
- :func:`returning_callers`: callers turned away in one burst with the same
  ``Retry-After``, coming back with and without jitter;
- :func:`simulate_outage`: the outage timeline on a :class:`~course.kit.faults.VirtualClock`
  that the chapter's widget re-runs, drawn by :func:`plot_timeline`;
- :func:`one_for_all`, :func:`library_breakers` and :func:`half_open_stampede`: one breaker
  for every dependency, and what the breakers on PyPI do in half-open;
- :func:`pool_flood`: slow searches flood PostgreSQL's connections while payments measures
  its latency (table ``ch02_payments``), with and without :class:`course.bulkhead.Bulkhead`;
- :func:`simulate_replicas`, :func:`simulate_serial` and :func:`plot_downtime`: a Monte Carlo
  check of :mod:`course.availability`'s formulas, and the calculator widget's chart.

The live checkout endpoint is in :mod:`course.chapters.ch02.checkout`, the bounded and
unbounded buffers in :mod:`course.chapters.ch02.backpressure`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from course.availability import downtime
from course.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, CircuitOpenError
from course.bulkhead import Bulkhead, BulkheadFullError

T = TypeVar("T")

# ----------------------------------------------------------------------------- a breaker to learn from


class SketchBreaker:
    """A TypeScript breaker sketch of the kind many blog posts show, ported line by line,
    flaws included (do not use).

    Every success wipes the counts, so a dependency failing 9 calls in 10 never trips it;
    every error counts (404s too); and in half-open *every* caller goes through, because
    the state flips to half-open and nothing stops the next caller.
    """

    def __init__(
        self, threshold: float = 0.5, window_size: int = 10, cooldown: float = 30.0, *, clock=time.monotonic
    ):
        self.threshold, self.window_size, self.cooldown, self.clock = threshold, window_size, cooldown, clock
        self.state, self.failures, self.total, self.opened_at = CLOSED, 0, 0, 0.0
        self.transitions: list[tuple[float, str]] = [(clock(), CLOSED)]

    def _set(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.transitions.append((self.clock(), state))

    async def call(self, fn):
        if self.state == OPEN:
            if self.clock() - self.opened_at < self.cooldown:
                raise CircuitOpenError("sketch", self.opened_at + self.cooldown - self.clock())
            self._set(HALF_OPEN)
        try:
            result = await fn()
        except Exception:
            self.failures += 1
            self.total += 1
            if self.state == HALF_OPEN or self.total >= self.window_size:
                if self.failures / max(self.total, 1) >= self.threshold:
                    self.opened_at = self.clock()
                    self._set(OPEN)
            raise
        self.failures = self.total = 0
        self._set(CLOSED)
        return result


# ----------------------------------------------------------------------------- the outage timeline


@dataclass
class Timeline:
    """One simulated run: every request and every state change, on virtual time."""

    requests: list[tuple[float, float, str]] = field(default_factory=list)  # (start, seconds, outcome)
    transitions: list[tuple[float, str]] = field(default_factory=list)
    outage: tuple[float, float] = (0.0, 0.0)
    duration: float = 0.0
    dependency_calls: int = 0
    calls_while_down: int = 0
    max_in_flight: int = 0

    def count(self, outcome: str) -> int:
        return sum(1 for _, _, o in self.requests if o == outcome)

    @property
    def recovered_at(self) -> float | None:
        """When the first request after the outage succeeded (None if none did)."""
        after = [s + d for s, d, o in self.requests if o == "ok" and s >= self.outage[1]]
        return min(after) if after else None

    def summary(self) -> str:
        """Two short lines: what the requests got, and what the dependency and the server saw."""
        rec = self.recovered_at
        lag = f"{rec - self.outage[1]:.1f} s after it ended" if rec is not None else "never"
        return (
            f"{len(self.requests)} requests: {self.count('ok')} ok, {self.count('failed')} failed after waiting, "
            f"{self.count('rejected')} rejected fast\n"
            f"calls to the dead dependency: {self.calls_while_down} | recovered {lag} | "
            f"at most {self.max_in_flight} in flight"
        )


async def simulate_outage(
    make_breaker: Callable[[Callable[[], float]], object] | None,
    *,
    duration: float = 90.0,
    outage: tuple[float, float] = (20.0, 50.0),
    interval: float = 0.25,
    timeout: float = 2.0,
    latency: float = 0.05,
    workers: int | None = 6,
    clock=None,
) -> Timeline:
    """Requests every ``interval`` s against a dependency that is down during ``outage``.

    While down, a call hangs until the caller's ``timeout`` fires (a ``TimeoutError``);
    otherwise it answers in ``latency`` s. The server has ``workers`` workers (``None``: no
    limit); a request waits for a free one, and that wait is part of its latency. ``make_breaker(clock)`` builds the breaker (any
    object with ``async call(fn)`` and ``transitions``), or pass ``None`` for no breaker.
    Runs on a :class:`~course.kit.faults.VirtualClock`: 90 simulated seconds take a blink.
    """
    from course.kit.faults import VirtualClock

    clock = clock or VirtualClock()
    t0 = clock()
    breaker = make_breaker(clock) if make_breaker else None
    tl = Timeline(outage=outage, duration=duration)
    in_flight = 0
    pool = asyncio.Semaphore(workers) if workers else None

    async def dependency() -> str:
        now = clock() - t0
        tl.dependency_calls += 1
        if outage[0] <= now < outage[1]:
            tl.calls_while_down += 1
            await clock.sleep(timeout)
            raise TimeoutError(f"no answer within {timeout:g} s")
        await clock.sleep(latency)
        return "ok"

    async def request(start: float) -> None:
        nonlocal in_flight
        in_flight += 1
        tl.max_in_flight = max(tl.max_in_flight, in_flight)
        try:
            if pool is not None:
                await pool.acquire()
            try:
                await (breaker.call(dependency) if breaker else dependency())
            finally:
                if pool is not None:
                    pool.release()
            outcome = "ok"
        except CircuitOpenError:
            outcome = "rejected"
        except Exception:  # noqa: BLE001 - a timeout or an error: the request failed after waiting
            outcome = "failed"
        finally:
            in_flight -= 1
        tl.requests.append((start, clock() - t0 - start, outcome))

    tasks = []
    n = int(duration / interval)
    for i in range(n):
        start = i * interval
        await clock.sleep(max(0.0, t0 + start - clock()))
        tasks.append(asyncio.ensure_future(request(start)))
    await asyncio.gather(*tasks)
    tl.requests.sort()
    if breaker is not None:
        tl.transitions = [(t - t0, s) for t, s in getattr(breaker, "transitions", [])]
    return tl


def run_in_thread(coro_fn: Callable[[], Awaitable[T]]) -> T:
    """Run ``coro_fn()`` to completion on a fresh event loop in a worker thread.

    Widget callbacks are plain functions called while the notebook's own loop is running,
    so they cannot ``asyncio.run``; a thread with its own loop can.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(coro_fn())).result()


STATE_COLORS = {CLOSED: "#27ae60", HALF_OPEN: "#f39c12", OPEN: "#c0392b"}
OUTCOME_COLORS = {"ok": "#27ae60", "failed": "#c0392b", "rejected": "#f39c12"}


def plot_timeline(tl: Timeline, ax_latency, ax_state=None, *, title: str = "", unit: str = "s") -> None:
    """Latency of every request (coloured by outcome) and, below, the breaker's state."""
    for outcome, color in OUTCOME_COLORS.items():
        pts = [(s, d) for s, d, o in tl.requests if o == outcome]
        if pts:
            xs, ys = zip(*pts, strict=True)
            label = {"ok": "answered", "failed": "failed after waiting", "rejected": "rejected fast (503)"}[
                outcome
            ]
            ax_latency.scatter(xs, ys, s=10, color=color, label=f"{label} ({len(pts)})")
    ax_latency.axvspan(*tl.outage, color="#c0392b", alpha=0.08, label="dependency down")
    from course.kit.plotting import legend_outside

    ax_latency.set_ylabel(f"latency ({unit})")
    legend_outside(ax_latency)
    if title:
        ax_latency.set_title(title, fontsize=10)
    if ax_state is not None:
        plot_states(tl.transitions, tl.duration, ax_state)


def plot_states(transitions: list[tuple[float, str]], end: float, ax) -> None:
    """A band per state: green closed, red open, orange half-open."""
    levels = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}
    points = transitions or [(0.0, CLOSED)]
    for (t, state), (t_next, _) in zip(points, [*points[1:], (end, None)], strict=True):
        ax.barh(levels[state], max(t_next - t, end / 400), left=t, height=0.8, color=STATE_COLORS[state])
    ax.set_yticks(list(levels.values()), list(levels))
    ax.set_xlim(0, end)


# ----------------------------------------------------------------------------- demos beside the timeline


async def one_for_all(
    shared: bool, *, seconds: float = 60.0, interval: float = 0.5
) -> dict[str, dict[str, int]]:
    """Typical mistake 2: search is down, payments is healthy. Outcomes per dependency.

    With ``shared=True`` one breaker guards both, so search's timeouts open it for
    payments too; with ``shared=False`` each dependency has its own.
    """
    from course.kit.faults import VirtualClock

    clock = VirtualClock()
    if shared:
        one = CircuitBreaker(0.5, 10, 10, clock=clock, name="everything")
        breakers = {"search": one, "payments": one}
    else:
        breakers = {dep: CircuitBreaker(0.5, 10, 10, clock=clock, name=dep) for dep in ("search", "payments")}
    outcomes = {dep: {"ok": 0, "failed": 0, "rejected": 0} for dep in breakers}

    async def search() -> str:
        await clock.sleep(1.0)
        raise TimeoutError("search did not answer within 1 s")

    async def payments() -> str:
        await clock.sleep(0.05)
        return "paid"

    async def request(dep: str, fn) -> None:
        try:
            await breakers[dep].call(fn)
            outcomes[dep]["ok"] += 1
        except CircuitOpenError:
            outcomes[dep]["rejected"] += 1
        except Exception:  # noqa: BLE001 - the dependency's own failure
            outcomes[dep]["failed"] += 1

    tasks = []
    for _ in range(int(seconds / interval)):
        tasks += [
            asyncio.ensure_future(request("search", search)),
            asyncio.ensure_future(request("payments", payments)),
        ]
        await clock.sleep(interval)
    await asyncio.gather(*tasks)
    return outcomes


def library_breakers(cooldown: float) -> dict[str, Callable[[], Callable]]:
    """Factories of ``guarded(fn)`` callables: this chapter's breaker, the blog sketch and the
    asyncio breakers on PyPI that are installed (purgatory, aiobreaker), each tripping after
    a handful of failures and waiting ``cooldown`` seconds of real time."""

    def ours():
        return CircuitBreaker(0.5, 10, cooldown, name="payments").call

    def sketch():
        return SketchBreaker(0.5, 10, cooldown).call

    factories: dict[str, Callable[[], Callable]] = {"course.breaker": ours, "blog sketch": sketch}
    try:
        from purgatory import AsyncCircuitBreakerFactory

        def purgatory_breaker():
            factory = AsyncCircuitBreakerFactory(default_threshold=5, default_ttl=cooldown)

            async def guarded(fn):
                async with await factory.get_breaker("payments"):
                    return await fn()

            return guarded

        factories["purgatory"] = purgatory_breaker
    except ImportError:
        pass
    try:
        from datetime import timedelta

        from aiobreaker import CircuitBreaker as AioBreaker

        def aiobreaker_breaker():
            br = AioBreaker(fail_max=5, timeout_duration=timedelta(seconds=cooldown))
            return lambda fn: br.call_async(fn)

        factories["aiobreaker"] = aiobreaker_breaker
    except ImportError:
        pass
    return factories


async def half_open_stampede(
    guarded: Callable, service, *, callers: int = 20, cooldown: float = 0.2, timeout: float = 0.3
) -> int:
    """How many of ``callers`` concurrent requests a breaker lets through to a still-down service
    in half-open.

    Trips ``guarded`` with quick 503s from ``service`` (a :class:`~course.kit.faults.FlakyService`),
    waits out the ``cooldown``, makes the service hang and sends ``callers`` requests at once.
    A breaker with a single probe lets 1 through; one that admits everyone lets them all. The
    count is of the calls the breaker let start, not of the requests the service saw: on a busy
    machine some requests time out in the client before they reach the service.
    """
    import httpx

    from course.kit.faults import Schedule

    let_through = 0
    stampede = False

    async with httpx.AsyncClient(timeout=timeout) as client:

        async def pay():
            nonlocal let_through
            if stampede:
                let_through += 1
            response = await client.post(f"{service.url}/charge")
            response.raise_for_status()
            return response.json()

        service.set_schedule(Schedule("fail", then="repeat"))
        for _ in range(12):
            try:
                await guarded(pay)
            except Exception:  # noqa: BLE001 - tripping it on purpose
                pass
        await asyncio.sleep(cooldown * 1.25)
        service.set_schedule(Schedule("hang", then="repeat"))
        stampede = True
        await asyncio.gather(*(guarded(pay) for _ in range(callers)), return_exceptions=True)
        return let_through


# ----------------------------------------------------------------------------- breakers per process


async def per_process(
    pods: int,
    *,
    rate: float = 20.0,
    outage: tuple[float, float] = (5.0, 35.0),
    duration: float = 40.0,
    cooldown: float = 5.0,
    window: int = 10,
) -> dict:
    """``pods`` replicas of a service, each with its own breaker for one dependency, as every
    breaker library keeps it (in the process). Requests arrive at ``rate`` a second,
    round-robin; the dependency answers 503 at once during ``outage``. Virtual time.

    Returns how many calls reached the dependency before every breaker had opened, when
    that was, and how many probes it got during the rest of the outage.
    """
    from course.kit.faults import DependencyError, VirtualClock

    clock = VirtualClock(auto=False)
    breakers = [CircuitBreaker(0.5, window, cooldown, clock=clock, name=f"pod {i}") for i in range(pods)]
    seen = {"before_open": 0, "probes": 0, "all_open_at": None}

    async def dependency() -> str:
        if outage[0] <= clock() < outage[1]:
            if seen["all_open_at"] is None:
                seen["before_open"] += 1
            else:
                seen["probes"] += 1
            raise DependencyError(503, "dependency down")
        return "ok"

    for i in range(int(duration * rate)):
        clock.advance(max(0.0, i / rate - clock()))
        try:
            await breakers[i % pods].call(dependency)
        except Exception:  # noqa: BLE001 - a fast 503 or the dependency's own: counted above
            pass
        if seen["all_open_at"] is None and all(b.state == OPEN for b in breakers):
            seen["all_open_at"] = clock() - outage[0]
    return {"pods": pods, **seen}


def returning_callers(
    rejected: int = 150,
    *,
    burst: float = 0.05,
    retry_after: float = 1.0,
    spread: float | None = None,
    seed: int = 1,
) -> list[float]:
    """When do ``rejected`` callers, turned away within one ``burst`` (seconds) with the same
    ``Retry-After``, come back? Each waits exactly that long (``spread=None``) or that long
    plus a random share up to ``spread`` (:func:`course.retry.jitter_retry_after`)."""
    from course.retry import jitter_retry_after

    rng = random.Random(seed)
    back = []
    for _ in range(rejected):
        turned_away = rng.random() * burst
        wait = retry_after if spread is None else jitter_retry_after(retry_after, spread, rng.random)
        back.append(turned_away + wait)
    return back


def peak(times: list[float], bucket: float = 0.05) -> int:
    """The most arrivals in any ``bucket`` seconds."""
    counts: dict[int, int] = {}
    for t in times:
        counts[int(t // bucket)] = counts.get(int(t // bucket), 0) + 1
    return max(counts.values(), default=0)


# ----------------------------------------------------------------------------- bulkheads: a flood on a live pool


@dataclass
class FloodRun:
    """Payments latencies (ms) and search counts from one :func:`pool_flood` run."""

    mode: str
    payments_ms: list[float] = field(default_factory=list)
    payments_failed: int = 0
    search_done: int = 0
    search_rejected: int = 0
    search_failed: int = 0
    seconds: float = 0.0


PAYMENTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS ch02_payments (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    amount integer NOT NULL,
    at     timestamptz NOT NULL DEFAULT now()
)
"""

MODES = ("shared pool", "pool per dependency", "shared pool + bulkheads")


async def pool_flood(
    ns,
    mode: str,
    *,
    connections: int = 8,
    payments_share: int = 3,
    searchers: int = 24,
    search_seconds: float = 0.25,
    payments: int = 40,
    interval: float = 0.04,
    wait_timeout: float = 1.0,
) -> FloodRun:
    """Flood the database with slow searches while a payments caller measures its latency.

    ``connections`` is the budget in every mode. ``shared pool``: one pool of that size for
    both dependencies. ``pool per dependency``: ``payments_share`` connections for payments,
    the rest for search. ``shared pool + bulkheads``: one pool, with a :class:`Bulkhead` per
    dependency of the same sizes in front (search may queue as many calls again, then is
    rejected). Payments waits at most ``wait_timeout`` s for a connection.
    """
    if mode not in MODES:
        raise ValueError(f"mode is one of {MODES}")
    search_size = connections - payments_share
    # pools of its own (fresh=True), closed at the end: a re-run holds no extra connections
    if mode == "pool per dependency":
        pay_pool = await ns.pool(min_size=payments_share, max_size=payments_share, fresh=True)
        search_pool = await ns.pool(min_size=search_size, max_size=search_size, fresh=True)
    else:
        pay_pool = search_pool = await ns.pool(min_size=connections, max_size=connections, fresh=True)
    guard_search = guard_pay = None
    if mode == "shared pool + bulkheads":
        guard_search = Bulkhead(search_size, max_queue=search_size, name="search")
        guard_pay = Bulkhead(payments_share, max_queue=payments_share * 4, name="payments")
    async with pay_pool.connection() as conn:
        await conn.execute(PAYMENTS_SCHEMA)

    run = FloodRun(mode)
    stop = asyncio.Event()

    async def one_search() -> None:
        async with search_pool.connection(timeout=30) as conn:
            await conn.execute("SELECT pg_sleep(%s)", (search_seconds,))

    async def searcher() -> None:
        while not stop.is_set():
            try:
                await (guard_search.call(one_search) if guard_search else one_search())
                run.search_done += 1
            except BulkheadFullError:
                run.search_rejected += 1
                await asyncio.sleep(search_seconds / 5)  # the caller got a fast 503 and comes back later
            except Exception:  # noqa: BLE001 - counted, the flood goes on
                run.search_failed += 1

    async def one_payment() -> None:
        async with pay_pool.connection(timeout=wait_timeout) as conn:
            await conn.execute("INSERT INTO ch02_payments (amount) VALUES (%s)", (100,))

    async def payment() -> None:
        t0 = time.perf_counter()
        try:
            await (guard_pay.call(one_payment) if guard_pay else one_payment())
        except Exception:  # noqa: BLE001 - a pool timeout or a full bulkhead: the payment failed
            run.payments_failed += 1
        run.payments_ms.append((time.perf_counter() - t0) * 1000)

    started = time.perf_counter()
    flood = [asyncio.create_task(searcher()) for _ in range(searchers)]
    await asyncio.sleep(search_seconds / 2)  # let the flood take the connections first
    paying = []
    for _ in range(payments):  # open loop: payments arrive on schedule, however slow the last one was
        paying.append(asyncio.create_task(payment()))
        await asyncio.sleep(interval)
    await asyncio.gather(*paying)
    stop.set()
    await asyncio.gather(*flood, return_exceptions=True)
    run.seconds = time.perf_counter() - started
    for pool in {id(pay_pool): pay_pool, id(search_pool): search_pool}.values():
        await pool.close()
    return run


# ----------------------------------------------------------------------------- availability, simulated


def simulate_replicas(
    replica: float = 0.99, n: int = 2, *, shared: float = 1.0, minutes: int = 5_000_000, seed: int = 7
) -> float:
    """Fraction of minutes in which at least one replica is up (and the shared part is up).

    Replica outages are drawn independently; the shared part's outages take all replicas
    down at once, which is what a common zone or a common bad config rollout does.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    replica_up = rng.random((n, minutes)) < replica
    shared_up = rng.random(minutes) < shared
    return float((replica_up.any(axis=0) & shared_up).mean())


def simulate_serial(*availabilities: float, minutes: int = 2_000_000, seed: int = 7) -> float:
    """Fraction of minutes in which every one of the (independent) parts is up."""
    import numpy as np

    rng = np.random.default_rng(seed)
    up = np.ones(minutes, dtype=bool)
    for a in availabilities:
        up &= rng.random(minutes) < a
    return float(up.mean())


def plot_downtime(ax, parts: dict[str, float], total: float) -> None:
    """Minutes of downtime a month for each part and for the whole path (log scale)."""
    names = [*parts, "whole path"]
    minutes = [downtime(v) * 60 for v in parts.values()] + [downtime(total) * 60]
    colors = ["#7f8c8d"] * len(parts) + ["#c0392b"]
    ax.barh(names, [max(m, 0.01) for m in minutes], color=colors)
    ax.set_xscale("log")
    ax.set_xlim(0.01, 50_000)
    ax.invert_yaxis()
    ax.set_xlabel("minutes of downtime a month (log scale)")
    for i, (m, name) in enumerate(zip(minutes, names, strict=True)):
        a = total if name == "whole path" else parts[name]
        ax.text(max(m, 0.01), i, f"  {100 * a:.3f}%", va="center", fontsize=8)
