"""Circuit breakers (chapter 02): stop calling a dependency that is down, and find out when it is back.

- :class:`CircuitBreaker`: closed, open and half-open; a count-based or time-based window of
  outcomes; a minimum number of calls before it may trip; exactly one probe in half-open
  while everybody else still fails fast; the reference answer to the ``circuit_breaker`` task.
- :class:`CircuitOpenError`: what a rejected call raises, with ``retry_after`` for a
  ``503`` + ``Retry-After`` at the edge.
- :func:`counts_as_failure`: only timeouts, connection errors, 408 and 5xx say the
  dependency is sick; other 4xx (and 429) are answers, not illness.
- :class:`SketchBreaker`: a literal port of the seed's TypeScript sketch, kept to show its
  flaws (every success wipes the counts, every concurrent caller goes through in half-open).
- :func:`simulate_outage`: the outage timeline on a :class:`~course.kit.faults.VirtualClock`
  that the chapter's widget re-runs.

Error classification is chapter 01's (:func:`course.retry.is_retryable`, :func:`course.retry.status_of`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from course.retry import is_retryable, status_of

T = TypeVar("T")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class CircuitOpenError(Exception):
    """Raised instead of calling the dependency while the breaker is open (or a probe is in flight)."""

    def __init__(self, name: str = "breaker", retry_after: float = 0.0, reason: str = "open") -> None:
        self.name = name
        self.retry_after = max(0.0, float(retry_after))
        self.reason = reason
        super().__init__(f"circuit {name!r} is {reason}; retry in {self.retry_after:.3g} s")

    @property
    def retry_after_header(self) -> str:
        """The ``Retry-After`` header value: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after)))


def counts_as_failure(err: BaseException) -> bool:
    """Does this error say the dependency is sick? Timeouts, connection errors, 408 and 5xx do.

    A 404 or a 422 is the dependency answering correctly about a bad request, and 429 is it
    protecting itself as designed: neither should open the circuit (429 is handled with
    ``Retry-After`` and backoff instead). Bugs in our own code (a ``KeyError``) are not the
    dependency's fault either.
    """
    if isinstance(err, CircuitOpenError):
        return False
    status = status_of(err)
    if status is not None:
        return status == 408 or 500 <= status <= 599
    return is_retryable(err)


# ----------------------------------------------------------------------------- windows


class CountWindow:
    """The outcomes of the last ``size`` calls."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("window size must be at least 1")
        self.size = size
        self._outcomes: deque[bool] = deque(maxlen=size)  # True = failed

    def record(self, failed: bool, now: float) -> None:
        self._outcomes.append(failed)

    def stats(self, now: float) -> tuple[int, int]:
        """(calls, failures) in the window."""
        return len(self._outcomes), sum(self._outcomes)

    def clear(self) -> None:
        self._outcomes.clear()


class TimeWindow:
    """The outcomes of the calls that finished in the last ``seconds``."""

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError("window length must be positive")
        self.seconds = float(seconds)
        self._outcomes: deque[tuple[float, bool]] = deque()
        self._failures = 0

    def _evict(self, now: float) -> None:
        while self._outcomes and self._outcomes[0][0] <= now - self.seconds:
            _, failed = self._outcomes.popleft()
            self._failures -= failed

    def record(self, failed: bool, now: float) -> None:
        self._evict(now)
        self._outcomes.append((now, failed))
        self._failures += failed

    def stats(self, now: float) -> tuple[int, int]:
        self._evict(now)
        return len(self._outcomes), self._failures

    def clear(self) -> None:
        self._outcomes.clear()
        self._failures = 0


# ----------------------------------------------------------------------------- the breaker


class CircuitBreaker:
    """A circuit breaker for one dependency.

    Closed: calls go through and their outcomes fill the window. Once the window holds at
    least ``min_calls`` outcomes and the failure rate reaches ``threshold``, it opens.
    Open: calls raise :class:`CircuitOpenError` at once, without calling ``fn``, until
    ``cooldown`` seconds have passed on ``clock``. Half-open: the first caller becomes the
    probe; every other caller is rejected while it runs. A probe that succeeds closes the
    breaker with an empty window; one that fails opens it again for a fresh ``cooldown``.

    ``window="count"`` keeps the last ``window_size`` calls; ``window="time"`` keeps the
    calls of the last ``window_size`` seconds (then ``min_calls`` defaults to 10).
    """

    def __init__(
        self,
        threshold: float = 0.5,
        window_size: float = 10,
        cooldown: float = 30.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        is_failure: Callable[[BaseException], bool] = counts_as_failure,
        min_calls: int | None = None,
        window: str = "count",
        name: str = "breaker",
    ) -> None:
        if not 0 < threshold <= 1:
            raise ValueError("threshold is a failure rate in (0, 1]")
        if window == "count":
            self.window: CountWindow | TimeWindow = CountWindow(int(window_size))
            default_min = int(window_size)
        elif window == "time":
            self.window = TimeWindow(window_size)
            default_min = 10
        else:
            raise ValueError("window is 'count' or 'time'")
        self.threshold = threshold
        self.cooldown = float(cooldown)
        self.clock = clock
        self.is_failure = is_failure
        self.min_calls = default_min if min_calls is None else min_calls
        self.name = name
        self.state = CLOSED
        self.opened_at = -math.inf
        self.transitions: list[tuple[float, str]] = [(clock(), CLOSED)]
        self.rejected = 0
        self._probing = False
        self._generation = 0  # bumped on every transition: late results of an old state are ignored

    def __repr__(self) -> str:
        calls, failures = self.window.stats(self.clock())
        return f"CircuitBreaker({self.name!r}, state={self.state}, window {failures}/{calls} failed)"

    def _set(self, state: str) -> None:
        self.state = state
        self._generation += 1
        self.transitions.append((self.clock(), state))

    def _admit(self) -> bool:
        """Let a call through (True if it is the half-open probe) or raise CircuitOpenError."""
        now = self.clock()
        if self.state == OPEN:
            if now - self.opened_at < self.cooldown:
                self.rejected += 1
                raise CircuitOpenError(self.name, self.opened_at + self.cooldown - now)
            self._set(HALF_OPEN)
        if self.state == HALF_OPEN:
            if self._probing:
                self.rejected += 1
                raise CircuitOpenError(self.name, min(self.cooldown, 1.0), reason="half-open, a probe is in flight")
            self._probing = True
            return True
        return False

    def _trip(self) -> None:
        self.opened_at = self.clock()
        self._set(OPEN)

    def _record(self, failed: bool, probe: bool, generation: int) -> None:
        if probe:
            self._probing = False
            if failed:
                self._trip()
            else:
                self.window.clear()
                self._set(CLOSED)
            return
        if self.state != CLOSED or generation != self._generation:
            return  # a call that started before the last transition: its outcome is stale
        now = self.clock()
        self.window.record(failed, now)
        calls, failures = self.window.stats(now)
        if failed and calls >= self.min_calls and failures / calls >= self.threshold:
            self.window.clear()
            self._trip()

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Await ``fn()`` through the breaker; raise :class:`CircuitOpenError` instead when open."""
        probe = self._admit()
        generation = self._generation
        try:
            result = await fn()
        except Exception as err:
            self._record(self.is_failure(err), probe, generation)
            raise
        except BaseException:  # cancelled: no verdict on the dependency, free the probe slot
            if probe:
                self._probing = False
            raise
        self._record(False, probe, generation)
        return result


class SketchBreaker:
    """The seed's TypeScript sketch ported line by line, flaws included (do not use).

    Every success wipes the counts, so a dependency failing 9 calls in 10 never trips it;
    every error counts (404s too); and in half-open *every* caller goes through, because
    the state flips to half-open and nothing stops the next caller.
    """

    def __init__(self, threshold: float = 0.5, window_size: int = 10, cooldown: float = 30.0, *, clock=time.monotonic):
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
        rec = self.recovered_at
        lag = f"{rec - self.outage[1]:.1f} s after it ended" if rec is not None else "never"
        return (
            f"{len(self.requests)} requests: {self.count('ok')} ok, {self.count('failed')} failed after waiting, "
            f"{self.count('rejected')} rejected fast | calls that reached the dead dependency: "
            f"{self.calls_while_down} | recovered {lag} | most requests in flight at once: {self.max_in_flight}"
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
            label = {"ok": "answered", "failed": "failed after waiting", "rejected": "rejected fast (503)"}[outcome]
            ax_latency.scatter(xs, ys, s=10, color=color, label=f"{label} ({len(pts)})")
    ax_latency.axvspan(*tl.outage, color="#c0392b", alpha=0.08, label="dependency down")
    ax_latency.set_ylabel(f"latency ({unit})")
    ax_latency.legend(loc="upper right", fontsize=8)
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


async def one_for_all(shared: bool, *, seconds: float = 60.0, interval: float = 0.5) -> dict[str, dict[str, int]]:
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
    """Factories of ``guarded(fn)`` callables: this chapter's breaker, the seed's sketch and the
    asyncio breakers on PyPI that are installed (purgatory, aiobreaker), each tripping after
    a handful of failures and waiting ``cooldown`` seconds of real time."""

    def ours():
        return CircuitBreaker(0.5, 10, cooldown, name="payments").call

    def sketch():
        return SketchBreaker(0.5, 10, cooldown).call

    factories: dict[str, Callable[[], Callable]] = {"course.breaker": ours, "seed sketch": sketch}
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
    """How many of ``callers`` concurrent requests reach a still-down service in half-open.

    Trips ``guarded`` with quick 503s from ``service`` (a :class:`~course.kit.faults.FlakyService`),
    waits out the ``cooldown``, makes the service hang and sends ``callers`` requests at once.
    A breaker with a single probe lets 1 through; one that admits everyone lets them all.
    """
    import httpx

    from course.kit.faults import Schedule

    async with httpx.AsyncClient(timeout=timeout) as client:

        async def pay():
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
        before = service.count
        await asyncio.gather(*(guarded(pay) for _ in range(callers)), return_exceptions=True)
        return service.count - before
