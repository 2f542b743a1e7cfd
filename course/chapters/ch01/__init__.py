"""Chapter 01 (timeouts, retries, backoff and jitter): what the notebook measures and plots.

- :func:`pool_exhaustion` and :func:`plot_pool_runs`: calls to a hanging endpoint take every
  connection of a small httpx pool, without a timeout and with one
  (:func:`course.timeouts.call_with_timeout` is the fix);
- :func:`plot_strategies`: the waits of every :mod:`course.backoff` strategy;
- :func:`layered_calls`: what retrying at every layer does to the bottom one;
- :func:`live_errors`: the real httpx errors of a flaky HTTP service (and of a closed port, a
  full pool and two caller bugs), classified by :func:`course.retry.is_retryable` (the
  ``is_retryable`` check uses them too);
- :func:`retry_after_race`: two live clients against a service that answers 429 with
  ``Retry-After``, one honouring it;
- :func:`outage_load` and :func:`call_chain`: a :class:`course.budgets.RetryBudget` and a
  :class:`course.budgets.Deadline`, measured on a virtual clock; :func:`deadline_across_hosts`:
  why a deadline crosses hosts as the time remaining;
- :func:`percentile_spread`: how many samples a percentile needs;
- :func:`measure_reads`, :func:`hedging_demo` and :func:`plot_fanout`: hedged reads
  (:func:`course.hedging.hedged`) against live replicas, and the fan-out tail.

Brooker's thundering-herd simulation, the live retry storm and the optimistic-concurrency
race on PostgreSQL are in :mod:`course.chapters.ch01.herd`; PostgreSQL's own timeouts, live,
in :mod:`course.chapters.ch01.postgres`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from course.backoff import FullJitter, make, sample
from course.budgets import Deadline, DeadlineExceeded, RetryBudget, call_next_hop
from course.hedging import HedgeStats, hedged
from course.kit.faults import HTTP_STEPS, FlakyDependency, FlakyService, Schedule, VirtualClock, http_errors
from course.kit.stats import percentile
from course.retry import RetryPolicy, retry_call, with_retry

# ----------------------------------------------------------------------------- timeouts


@dataclass
class CallRecord:
    kind: str  # "hanging" or "healthy"
    started: float  # seconds since the run started
    ended: float | None = None  # None: still waiting when the observation window closed
    outcome: str = "waiting"


@dataclass
class PoolRun:
    label: str
    max_connections: int
    observe: float
    calls: list[CallRecord] = field(default_factory=list)

    def healthy(self) -> list[CallRecord]:
        return [c for c in self.calls if c.kind == "healthy"]

    def healthy_done(self) -> list[CallRecord]:
        return [c for c in self.healthy() if c.outcome == "200"]

    def summary(self) -> str:
        done = self.healthy_done()
        lat = sorted((c.ended - c.started) * 1000 for c in done)
        worst = f"slowest {lat[-1]:.0f} ms" if lat else "none finished"
        hung = [c for c in self.calls if c.kind == "hanging"]
        hung_outcomes = sorted({c.outcome for c in hung})
        return (
            f"{self.label}: {len(done)}/{len(self.healthy())} healthy calls answered within {self.observe:g} s "
            f"({worst})\n    the {len(hung)} calls to the hanging endpoint ended as {', '.join(hung_outcomes)}"
        )


async def pool_exhaustion(
    timeout: httpx.Timeout | float | None,
    *,
    label: str = "",
    hanging: int = 5,
    healthy: int = 20,
    max_connections: int = 5,
    observe: float = 1.5,
) -> PoolRun:
    """``hanging`` calls to an endpoint that never answers, then ``healthy`` calls, all through
    one httpx client with ``max_connections`` connections. Watch for ``observe`` seconds.

    ``timeout=None`` is httpx's "no timeout at all" (note: httpx's default is 5 s, the
    ``requests`` library's default is none). Calls still waiting when the window closes are
    cancelled and reported as ``waiting``.
    """
    run = PoolRun(label or f"timeout={timeout!r}", max_connections, observe)
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    async with FlakyService(Schedule(["hang"] * hanging, then="ok"), name="reports") as svc:
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            t0 = time.perf_counter()

            async def one(kind: str, path: str) -> None:
                rec = CallRecord(kind, time.perf_counter() - t0)
                run.calls.append(rec)
                try:
                    resp = await client.get(svc.url + path)
                    rec.outcome = str(resp.status_code)
                except httpx.HTTPError as err:
                    rec.outcome = type(err).__name__
                except asyncio.CancelledError:
                    rec.outcome = "waiting"
                    raise
                rec.ended = time.perf_counter() - t0

            tasks = [asyncio.create_task(one("hanging", "/report")) for _ in range(hanging)]
            while svc.count < hanging:  # the slow calls hold their connections first
                await asyncio.sleep(0.005)
            tasks += [asyncio.create_task(one("healthy", "/price")) for _ in range(healthy)]
            _, pending = await asyncio.wait(tasks, timeout=observe - (time.perf_counter() - t0))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return run


def plot_pool_runs(*runs: PoolRun):
    """One timeline per run: a bar per call from start to end (or to the window's edge)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), sharey=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    colors = {"200": "#27ae60", "waiting": "#c0392b"}
    for ax, run in zip(axes, runs, strict=True):
        for y, call in enumerate(run.calls):
            end = call.ended if call.ended is not None else run.observe
            color = colors.get(call.outcome, "#e67e22")
            ax.barh(y, end - call.started, left=call.started, color=color, height=0.7)
        ax.axvline(run.observe, color="grey", ls=":", lw=1)
        ax.set_xlim(0, run.observe * 1.05)
        ax.set_xlabel("seconds")
        ax.set_title(
            f"{run.label}\n{len(run.healthy_done())}/{len(run.healthy())} healthy calls answered", fontsize=10
        )
    axes[0].set_ylabel("call (first the hanging ones, then the healthy ones)")
    axes[0].invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#27ae60", "#e67e22", "#c0392b")]
    fig.legend(
        handles, ["answered 200", "timed out (fails fast)", "still waiting"], loc="lower center", ncol=3
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# ----------------------------------------------------------------------------- backoff strategies


def plot_strategies(base: float = 0.1, cap: float = 2.0, *, attempts: int = 10, clients: int = 200, ax=None):
    """Delay against attempt for every strategy: a line for the deterministic ones, a cloud
    of ``clients`` sampled clients plus their mean for the jittered ones."""
    import matplotlib.pyplot as plt

    from course.kit.plotting import legend_outside

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.2), layout="constrained")
    xs = list(range(1, attempts + 1))
    colors = {
        "fixed": "#7f8c8d",
        "linear": "#16a085",
        "exponential": "#c0392b",
        "full jitter": "#2e86c1",
        "equal jitter": "#8e44ad",
        "decorrelated jitter": "#d68910",
    }
    offsets = {"full jitter": -0.2, "equal jitter": 0.0, "decorrelated jitter": 0.2}
    for name, color in colors.items():
        strategy = make(name, base, cap)
        if not strategy.jittered:
            ax.plot(xs, strategy.delays(attempts), "-o", color=color, label=name, lw=2, ms=4)
            continue
        runs = sample(strategy, attempts, clients, seed=1)
        for k in range(attempts):
            ys = [run[k] for run in runs]
            ax.scatter([xs[k] + offsets[name]] * len(ys), ys, s=4, alpha=0.15, color=color)
        means = [sum(run[k] for run in runs) / len(runs) for k in range(attempts)]
        ax.plot([x + offsets[name] for x in xs], means, "--", color=color, lw=1.5, label=f"{name} (mean)")
    ax.axhline(cap, color="grey", lw=0.8, ls=":")
    ax.text(xs[0], cap, " cap", va="bottom", color="grey")
    ax.set_xlabel("retry number (wait after failure k = retry k)")
    ax.set_ylabel("delay (s)")
    ax.set_title(
        f"Backoff strategies, base {base:g} s, cap {cap:g} s ({clients} sampled clients per jitter)",
        fontsize=10,
    )
    ax.set_ylim(0, cap * 1.12)
    legend_outside(ax)
    return ax


# ----------------------------------------------------------------------------- retry at one layer


async def layered_calls(layers: int, attempts_per_layer: int) -> int:
    """Calls that reach a dead dependency when each of ``layers`` services retries it.

    Every layer wraps the one below in :func:`with_retry` with ``attempts_per_layer`` tries
    (a virtual clock, so it is instant). Returns how many calls the bottom saw.
    """
    from course.kit.faults import FlakyDependency, Schedule, VirtualClock

    clock = VirtualClock()
    bottom = FlakyDependency(Schedule("fail", then="repeat"), clock=clock, name="database")

    def wrap(inner):
        async def layer():
            return await with_retry(inner, retries=attempts_per_layer - 1, base_delay=0.01, sleep=clock.sleep)

        return layer

    call = bottom
    for _ in range(layers):
        call = wrap(call)
    with contextlib.suppress(Exception):
        await call()
    return bottom.count


# ----------------------------------------------------------------------------- real errors


#: FlakyService steps and the error each one makes for an httpx client (see :func:`live_errors`).
LIVE_STEPS = HTTP_STEPS

#: Errors that need no flaky service: a closed port, a full pool, two caller bugs.
EXTRA_ERRORS = ("refused", "pool full", "bad scheme", "bad header")


async def live_errors(
    steps=LIVE_STEPS, *, timeout: float = 0.2, extras: bool = True
) -> list[tuple[str, BaseException | None]]:
    """The toolkit's :func:`~course.kit.faults.http_errors` (one call per FlakyService step),
    and with ``extras`` the errors of :data:`EXTRA_ERRORS`: a port nobody listens on
    (``ConnectError``), a request that waits for a pool whose only connection hangs
    (``PoolTimeout``), an ``ftp://`` URL (``UnsupportedProtocol``) and a header with a
    newline in it (``LocalProtocolError``).
    """
    from course.kit.serve import free_port

    out = await http_errors(steps, timeout=timeout)
    if not extras:
        return out

    async def keep(step: str, call) -> None:
        try:
            (await call()).raise_for_status()
            out.append((step, None))
        except Exception as err:  # noqa: BLE001 - collecting what each step raises
            out.append((step, err))

    async with FlakyService(Schedule("ok hang", then="repeat"), name="errors") as svc:
        async with httpx.AsyncClient(timeout=timeout) as client:
            port = free_port()  # nothing listens there
            await keep("refused", lambda: client.get(f"http://127.0.0.1:{port}/item"))
            await keep("bad scheme", lambda: client.get(f"ftp://127.0.0.1:{port}/item"))
            await keep("bad header", lambda: client.get(svc.url + "/item", headers={"x-note": "two\nlines"}))
        svc.set_schedule(Schedule("hang", then="repeat"))
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, pool=timeout / 4), limits=limits
        ) as client:
            holder = asyncio.ensure_future(client.get(svc.url + "/slow"))  # takes the only connection
            seen = svc.count
            while svc.count < seen + 1:
                await asyncio.sleep(0.005)
            await keep("pool full", lambda: client.get(svc.url + "/item"))
            with contextlib.suppress(Exception):
                await holder
    return out


# ----------------------------------------------------------------------------- Retry-After, live


@dataclass
class PoliteRun:
    label: str
    calls: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, status)
    waits: list[float] = field(default_factory=list)

    @property
    def rejected(self) -> int:
        return sum(1 for _, status in self.calls if status == 429)

    @property
    def done_at(self) -> float:
        return self.calls[-1][0] if self.calls else float("nan")


async def retry_after_race(*, busy: float = 1.0, retry_after: int = 1, seed: int = 3) -> list[PoliteRun]:
    """Two live clients of two identical services that answer 429 with ``Retry-After`` for
    their first ``busy`` seconds. Both retry with :func:`course.retry.retry_call` and full
    jitter (base 50 ms); one ignores ``Retry-After``, the other honours it. Real time."""
    runs = []

    async def client(label: str, spread: float | None) -> PoliteRun:
        run = PoliteRun(label)
        async with FlakyService(
            Schedule.outage(0.0, busy, during=429), retry_after=retry_after, name=label
        ) as svc:
            async with httpx.AsyncClient(timeout=2.0) as http:
                svc.reset_clock()
                t0 = time.perf_counter()

                async def get() -> httpx.Response:
                    resp = await http.get(svc.url + "/quote")
                    run.calls.append((time.perf_counter() - t0, resp.status_code))
                    return resp.raise_for_status()

                policy = RetryPolicy(
                    max_attempts=12, max_elapsed=5.0, backoff=FullJitter(0.05, 2.0), retry_after_spread=spread
                )
                await retry_call(
                    get,
                    policy,
                    rand=random.Random(seed).random,
                    on_retry=lambda s: run.waits.append(s.delays[-1]),
                )
        return run

    runs = await asyncio.gather(client("ignores Retry-After", None), client("honours Retry-After", 0.2))
    return list(runs)


# ----------------------------------------------------------------------------- retry budgets


async def outage_load(requests: int = 1000, *, retries: int = 4, budget: RetryBudget | None = None) -> dict:
    """``requests`` requests, one every 10 ms, against a dependency that is down throughout.

    Returns how many calls reached the dependency, with ``retries`` retries per request,
    with or without a :class:`RetryBudget`. Virtual time: instant and repeatable.
    """
    from course.retry import is_retryable, with_retry

    clock = VirtualClock()
    dep = FlakyDependency(Schedule("fail", then="repeat"), clock=clock, name="inventory")
    retryable = budget.retryable(is_retryable) if budget else is_retryable

    async def one(i: int) -> None:
        await clock.sleep(i * 0.01)
        if budget:
            budget.record_request()
        with contextlib.suppress(Exception):
            await with_retry(dep, retries=retries, base_delay=0.05, sleep=clock.sleep, retryable=retryable)

    await asyncio.gather(*(one(i) for i in range(requests)))
    return {"requests": requests, "calls": dep.count, "amplification": dep.count / requests}


# ----------------------------------------------------------------------------- deadlines


@dataclass
class Hop:
    """One service in a chain: ``work`` seconds of its own, then a call to the next hop."""

    name: str
    work: float
    timeout: float  # its own fixed timeout for the call below
    attempts: int = 1


@dataclass
class ChainRun:
    label: str
    answered_at: float  # when the user got an answer (or gave up)
    outcome: str
    busy: dict = field(default_factory=dict)  # hop -> seconds of work it did
    wasted: float = 0.0  # seconds of work done after the user was answered
    calls: dict = field(default_factory=dict)  # hop -> calls it received


async def wait_for_virtual(task: asyncio.Future, seconds: float, clock: VirtualClock):
    """``asyncio.wait_for`` on a virtual clock; the task is left running (not cancelled) when
    time runs out, as a remote server would keep working after its caller gave up."""
    timer = asyncio.ensure_future(clock.sleep(seconds))
    try:
        await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
    if task.done():
        return task.result()
    raise TimeoutError(f"no answer within {seconds:.3g} s")


async def call_chain(hops: list[Hop], user_timeout: float, *, propagate: bool) -> ChainRun:
    """A request enters at ``hops[0]``; the user (or the load balancer) waits ``user_timeout``.

    Each hop does ``work`` seconds of its own, then calls the next hop through
    :func:`course.budgets.call_next_hop` with its fixed ``timeout`` and up to ``attempts``
    tries. ``propagate=True`` passes the user's deadline down (each try gets the smaller of
    its timeout and the time left; work whose deadline passed is dropped);
    ``propagate=False`` passes a deadline that never comes, so only the fixed timeouts
    apply. Each hop runs as its own task, as a remote server would: a caller that gives up
    does not stop the callee. Virtual time throughout.
    """
    clock = VirtualClock()
    run = ChainRun("deadline propagated" if propagate else "fixed timeouts per hop", 0.0, "")
    tasks: list[asyncio.Task] = []
    user_answered = False

    def virtual_wait(task, seconds: float):
        return wait_for_virtual(task, seconds, clock)

    async def serve(i: int, deadline: Deadline) -> str:
        hop = hops[i]
        run.calls[hop.name] = run.calls.get(hop.name, 0) + 1
        done = 0.0
        while done < hop.work - 1e-12:  # this hop's own work, in 10 ms slices
            if deadline.expired:
                raise DeadlineExceeded(f"{hop.name}: the deadline passed, work abandoned")
            dt = min(0.01, hop.work - done)
            await clock.sleep(dt)
            done += dt
            run.busy[hop.name] = run.busy.get(hop.name, 0.0) + dt
            if user_answered:
                run.wasted += dt
        if i + 1 == len(hops):
            return "rows"

        def call(inner: Deadline) -> asyncio.Task:  # the next hop, on its own "server"
            callee = asyncio.ensure_future(serve(i + 1, inner))
            tasks.append(callee)
            return callee

        try:
            return await call_next_hop(
                call,
                deadline,
                own_timeout=hop.timeout,
                attempts=hop.attempts,
                reserve=0.02 if propagate else 0.0,  # time kept back for answering
                wait_for=virtual_wait,
            )
        except Exception as err:  # noqa: BLE001 - the caller sees a failed call either way
            raise TimeoutError(f"{hop.name}: the call to {hops[i + 1].name} failed ({err})") from err

    deadline = Deadline.after(user_timeout, clock) if propagate else Deadline(math.inf, clock)
    entry = asyncio.ensure_future(serve(0, deadline))
    tasks.append(entry)
    try:
        await wait_for_virtual(entry, user_timeout, clock)
        run.outcome = "200"
    except Exception:  # noqa: BLE001 - the user sees a 504 either way
        run.outcome = "504"
    run.answered_at = clock()
    user_answered = True
    while any(not t.done() for t in tasks):  # let the servers behind finish what they started
        await asyncio.gather(*tasks, return_exceptions=True)
    return run


def deadline_across_hosts(
    skews=(-2.0, 0.0, 2.0), *, budget: float = 1.0, transit: float = 0.005
) -> list[dict]:
    """Host A calls host B with ``budget`` seconds left; B's clock runs ``skew`` s ahead of A's.

    What B believes it has left when A sends the deadline as an absolute time (A's clock
    reading plus the budget) and when A sends the time remaining
    (:meth:`course.budgets.Deadline.to_header`). ``transit`` is the one-way network delay.
    """
    rows = []
    for skew in skews:
        clock_a = VirtualClock(1_000.0, auto=False)

        def clock_b(a: VirtualClock = clock_a, ahead: float = skew) -> float:
            return a() + ahead

        deadline = Deadline.after(budget, clock_a)
        header = deadline.to_header()
        sent_at = deadline.at
        clock_a.advance(transit)  # the request crosses the network
        rows.append(
            {
                "skew": skew,
                "absolute": Deadline(sent_at, clock_b).remaining(),
                "remaining": Deadline.from_header(header, clock_b).remaining(),
                "header": header,
            }
        )
    return rows


# ----------------------------------------------------------------------------- percentiles


def percentile_spread(
    q: float, sizes=(150, 400, 1_000, 10_000, 100_000), *, trials: int = 300, seed: int = 9
) -> list[dict]:
    """How well ``n`` samples pin down the ``q``-th percentile of a latency distribution.

    The model: 98% of calls take about 2 ms, 2% take the slow path, about 60 ms with a long
    tail (log-normal, sigma 0.8). For each sample size, ``trials``
    independent samples; the spread of their ``q``-th percentile (5th to 95th of the
    estimates), and how many samples an average run has beyond the true percentile.
    """
    rng = np.random.default_rng(seed)

    def draw(shape) -> np.ndarray:
        slow = rng.random(shape) < 0.02
        return np.where(slow, rng.lognormal(np.log(60.0), 0.8, shape), rng.lognormal(np.log(2.0), 0.3, shape))

    truth = float(np.percentile(draw(2_000_000), q))
    rows = []
    for n in sizes:
        reps = max(20, min(trials, 3_000_000 // n))
        estimates = np.percentile(draw((reps, n)), q, axis=1)
        rows.append(
            {
                "n": n,
                "beyond": n * (100 - q) / 100,
                "low": float(np.percentile(estimates, 5)),
                "high": float(np.percentile(estimates, 95)),
                "truth": truth,
            }
        )
    return rows


# ----------------------------------------------------------------------------- hedged reads, live


def replica_schedule(n: int, *, slow_share: float, fast: float, slow: float, seed: int) -> Schedule:
    """A replica that answers in ``fast`` s, but in ``slow`` s for a random ``slow_share`` of calls."""
    rng = random.Random(seed)
    steps = [f"slow:{slow if rng.random() < slow_share else fast}" for _ in range(n)]
    return Schedule(steps, then="repeat")


@dataclass
class ReadRun:
    label: str
    latencies_ms: list[float] = field(default_factory=list)
    stats: HedgeStats = field(default_factory=HedgeStats)

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


async def measure_reads(
    urls: Sequence[str],
    *,
    n: int,
    hedge_after: float | None,
    concurrency: int = 8,
    label: str = "",
    client: httpx.AsyncClient | None = None,
    into: ReadRun | None = None,
) -> ReadRun:
    """``n`` reads against the replicas at ``urls``, ``concurrency`` at a time; hedged after
    ``hedge_after`` s, or plain reads of ``urls[0]`` when it is None. Results are added to
    ``into`` (a new :class:`ReadRun` by default)."""
    run = into or ReadRun(
        label or ("plain" if hedge_after is None else f"hedged after {hedge_after * 1000:.0f} ms")
    )
    gate = asyncio.Semaphore(concurrency)
    own = client is None
    http = client or httpx.AsyncClient(timeout=5.0, limits=httpx.Limits(max_connections=4 * concurrency))
    try:

        async def get(url: str) -> int:
            resp = await http.get(url + "/profile")
            resp.raise_for_status()
            return resp.status_code

        async def one() -> None:
            async with gate:
                t0 = time.perf_counter()
                if hedge_after is None:
                    run.stats.requests += 1
                    await get(urls[0])
                else:
                    await hedged(get, urls, hedge_after=hedge_after, stats=run.stats)
                run.latencies_ms.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(one() for _ in range(n)))
    finally:
        if own:
            await http.aclose()
    return run


async def hedging_demo(
    n: int = 400,
    *,
    slow_share: float = 0.03,
    fast: float = 0.005,
    slow: float = 1.0,
    seed: int = 11,
    concurrency: int = 4,
) -> tuple[ReadRun, ReadRun, float]:
    """Live replicas (FlakyService), each slow (``slow`` s) for ``slow_share`` of reads.

    Plain reads go to replica ``p``; hedged reads go to replica ``a`` and hedge to ``b``.
    ``p`` and ``a`` follow the same schedule, so both streams meet the same slow reads in
    the same order, however the machine interleaves them. A warm-up of plain reads (half
    to ``p``, half to ``a``, at once) gives the p95 that becomes the hedge delay; then ``n``
    plain and ``n`` hedged reads run side by side over one client, so both see the same
    machine at the same moment. Returns (plain, hedged, hedge_after_seconds)."""

    def schedule(length: int, offset: int) -> Schedule:
        return replica_schedule(length, slow_share=slow_share, fast=fast, slow=slow, seed=seed + offset)

    p = FlakyService(schedule(997, 0), name="replica-p")
    a = FlakyService(schedule(997, 0), name="replica-a")
    b = FlakyService(schedule(991, 1), name="replica-b")
    limits = httpx.Limits(max_connections=6 * concurrency, max_keepalive_connections=6 * concurrency)
    async with p, a, b, httpx.AsyncClient(timeout=5.0, limits=limits) as client:
        # the p95 under the same load as the measurement below: two streams at once
        warmup = ReadRun("warm-up")
        half = max(60, n // 6)
        await asyncio.gather(
            *(
                measure_reads(
                    [url], n=half, hedge_after=None, client=client, into=warmup, concurrency=concurrency
                )
                for url in (p.url, a.url)
            )
        )
        hedge_after = warmup.p(95) / 1000
        plain = ReadRun("plain")
        hedged_run = ReadRun(f"hedged after {hedge_after * 1000:.0f} ms")
        await asyncio.gather(
            measure_reads([p.url], n=n, hedge_after=None, client=client, into=plain, concurrency=concurrency),
            measure_reads(
                [a.url, b.url],
                n=n,
                hedge_after=hedge_after,
                client=client,
                into=hedged_run,
                concurrency=concurrency,
            ),
        )
    return plain, hedged_run, hedge_after


# ----------------------------------------------------------------------------- fan-out


def fanout_slow_share(shards: int, p_slow: float = 0.01, *, trials: int = 20_000, seed: int = 100) -> float:
    """Measured share of fan-out requests that wait on at least one slow shard."""
    rng = np.random.default_rng(seed)
    slow = rng.random((trials, shards)) < p_slow
    return float(slow.any(axis=1).mean())


def plot_fanout(
    p_slow: float = 0.01, *, max_shards: int = 200, p_slow_hedged: float | None = None, trials=20_000
):
    """Share of slow requests against fan-out width: formula, simulation, and with hedging."""
    import matplotlib.pyplot as plt

    from course.kit.plotting import legend_outside

    widths = np.unique(np.linspace(1, max_shards, 25).astype(int))
    fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
    ax.plot(widths, 1 - (1 - p_slow) ** widths, color="#c0392b", label=f"1 - (1 - {p_slow:g})^N")
    measured = [fanout_slow_share(w, p_slow, trials=trials, seed=int(w)) for w in widths]
    ax.plot(widths, measured, "o", ms=3, color="#c0392b", label="simulated")
    if p_slow_hedged is not None:
        ax.plot(
            widths,
            1 - (1 - p_slow_hedged) ** widths,
            color="#2e86c1",
            label=f"hedged (p = {p_slow_hedged:.2g})",
        )
    ax.axvline(100, color="grey", ls=":", lw=1)
    ax.set(xlabel="shards a request waits on (N)", ylabel="share of slow requests", ylim=(0, 1.02))
    ax.set_title(f"The fan-out tail: each shard slow {p_slow:.0%} of the time")
    legend_outside(ax)
    return fig
