"""The thundering herd, replayed: Brooker's optimistic-concurrency simulation (chapter 01).

Model (after Marc Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015):
N clients start at once and each wants to update one database row exactly once, under
optimistic concurrency. A client reads the row's version, then sends a conditional write
("set ... where version = v"). The write wins only if nobody else wrote since the read;
otherwise the client backs off and starts over with a new read. Every message crosses a
network whose delay is ``|N(10 ms, 2 ms)|``. Backoff base 5 ms, cap 2 s. As in the post's
simulator, the wait after the n-th failed write uses ``min(cap, base * 2**n)`` with n from 1.

Measured per run: **calls** (conditional writes the server handled, the "work") and
**completion time** (when the last client got its success reply).

The simulation is a discrete-event one, vectorised with numpy across trials and
strategies: every (trial, strategy) pair is a row, every client a column, and each step
processes the earliest pending event of every row at once. Rows are independent, so this
is exactly a per-trial event loop, only many of them in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

STRATEGIES = ("none", "exponential", "equal jitter", "full jitter", "decorrelated jitter")
BASE_MS = 5.0
CAP_MS = 2000.0
NET_MEAN_MS = 10.0
NET_SD_MS = 2.0

#: What the 2015 post reports for its simulation (text and figures), to set beside ours.
BROOKER_CLAIMS = {
    "fewer calls": "at 100 clients, full jitter needs less than half the calls of plain exponential backoff",
    "exponential slowest": "plain exponential backoff (no jitter) takes by far the longest of the backoff strategies",
    "equal jitter": "equal jitter does slightly more work than full jitter and takes longer",
    "decorrelated": "full jitter does less work than decorrelated jitter, at a slightly longer completion time",
    "no backoff": "without backoff the total work grows with N squared",
}

_READ, _WRITE = 0, 1


@dataclass
class HerdResult:
    """Per-strategy outcomes of ``trials`` runs with ``clients`` clients."""

    clients: int
    trials: int
    seed: int
    calls: dict[str, np.ndarray]  # strategy -> calls per trial
    completion_ms: dict[str, np.ndarray]  # strategy -> completion time per trial
    write_times_ms: dict[str, np.ndarray] = field(default_factory=dict)  # trial 0's write arrival times

    def mean_calls(self, strategy: str) -> float:
        return float(self.calls[strategy].mean())

    def mean_completion_ms(self, strategy: str) -> float:
        return float(self.completion_ms[strategy].mean())

    def table(self) -> list[tuple[str, float, float]]:
        return [(s, self.mean_calls(s), self.mean_completion_ms(s)) for s in self.calls]


def simulate(
    clients: int,
    strategies: tuple[str, ...] = STRATEGIES,
    *,
    trials: int = 100,
    seed: int = 2015,
    base: float = BASE_MS,
    cap: float = CAP_MS,
    net_mean: float = NET_MEAN_MS,
    net_sd: float = NET_SD_MS,
    record: bool = False,
) -> HerdResult:
    """Run ``trials`` independent races of ``clients`` clients for every strategy at once."""
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        raise KeyError(f"unknown strategies {sorted(unknown)}; known: {', '.join(STRATEGIES)}")
    rng = np.random.default_rng(seed)
    n_rows = trials * len(strategies)
    sid = np.repeat(np.arange(len(strategies)), trials)  # strategy index of each row
    kind_of = np.array([STRATEGIES.index(s) for s in strategies])[sid]  # index into STRATEGIES

    def net(size) -> np.ndarray:
        return np.abs(rng.normal(net_mean, net_sd, size))

    # per row and client: time of its next event at the server, what it is, what it saw
    t_next = net((n_rows, clients))  # first reads arrive after one network hop
    kind = np.full((n_rows, clients), _READ, dtype=np.int8)
    seen = np.zeros((n_rows, clients), dtype=np.int64)
    failures = np.zeros((n_rows, clients), dtype=np.int64)
    prev_sleep = np.full((n_rows, clients), base)
    version = np.zeros(n_rows, dtype=np.int64)
    calls = np.zeros(n_rows, dtype=np.int64)
    finish = np.zeros(n_rows)
    row_ids = np.arange(n_rows)  # original row of each live row (rows are dropped when done)
    writes_t: list[np.ndarray] = []
    writes_row: list[np.ndarray] = []

    live = np.arange(n_rows)
    while live.size:
        idx = np.arange(live.size)
        col = np.argmin(t_next, axis=1)
        t = t_next[idx, col]
        done = ~np.isfinite(t)
        if done.any():  # every client of these rows has won: drop the rows, so argmin scans only live ones
            keep = ~done
            live, t_next, kind = live[keep], t_next[keep], kind[keep]
            seen, failures, prev_sleep = seen[keep], failures[keep], prev_sleep[keep]
            continue
        k = kind[idx, col]
        hop = net((live.size, 2))

        reads = k == _READ
        if reads.any():
            r, c = idx[reads], col[reads]
            seen[r, c] = version[live[r]]
            kind[r, c] = _WRITE
            t_next[r, c] = t[reads] + hop[reads, 0] + hop[reads, 1]  # reply to client, then the write

        writes = ~reads
        if writes.any():
            r, c, tw = idx[writes], col[writes], t[writes]
            rows = live[r]
            calls[rows] += 1
            if record:
                writes_t.append(tw)
                writes_row.append(rows)
            won = seen[r, c] == version[rows]
            # winners: the row's version moves on; the client is done when its reply lands
            wr, wc, wrows = r[won], c[won], rows[won]
            version[wrows] += 1
            finish[wrows] = np.maximum(finish[wrows], tw[won] + hop[writes][won, 0])
            t_next[wr, wc] = np.inf
            # losers: reply, back off, read again
            lr, lc, lrows = r[~won], c[~won], rows[~won]
            if lr.size:
                failures[lr, lc] += 1
                n = failures[lr, lc]
                expo = np.minimum(cap, base * np.exp2(np.minimum(n, 60)))
                u = rng.random(lr.size)
                strat = kind_of[lrows]
                sleep = np.zeros(lr.size)
                sleep = np.where(strat == 1, expo, sleep)
                sleep = np.where(strat == 2, expo / 2 + u * expo / 2, sleep)
                sleep = np.where(strat == 3, u * expo, sleep)
                decorr = np.minimum(cap, base + u * (np.maximum(base, prev_sleep[lr, lc] * 3) - base))
                sleep = np.where(strat == 4, decorr, sleep)
                prev_sleep[lr, lc] = np.where(strat == 4, decorr, prev_sleep[lr, lc])
                hop_l = hop[writes][~won]
                kind[lr, lc] = _READ
                t_next[lr, lc] = tw[~won] + hop_l[:, 0] + hop_l[:, 1] + sleep

    result = HerdResult(clients, trials, seed, {}, {})
    for i, name in enumerate(strategies):
        rows = row_ids[sid == i]
        result.calls[name] = calls[rows]
        result.completion_ms[name] = finish[rows]
        if record:
            first = i * trials  # trial 0 of this strategy
            all_t = np.concatenate(writes_t) if writes_t else np.zeros(0)
            all_r = np.concatenate(writes_row) if writes_row else np.zeros(0, dtype=np.int64)
            result.write_times_ms[name] = np.sort(all_t[all_r == first])
    return result


def sweep(
    client_counts, strategies: tuple[str, ...] = STRATEGIES, *, trials: int = 100, seed: int = 2015
) -> dict[int, HerdResult]:
    """``simulate`` for each client count (each with its own seed, derived from ``seed``)."""
    return {n: simulate(n, strategies, trials=trials, seed=seed + n) for n in client_counts}


def growth_exponent(sweep_results: dict[int, HerdResult], strategy: str) -> float:
    """The slope of log(calls) against log(clients): 1 is linear growth, 2 quadratic."""
    xs = np.log(np.array(sorted(sweep_results), dtype=float))
    ys = np.log([sweep_results[n].mean_calls(strategy) for n in sorted(sweep_results)])
    return float(np.polyfit(xs, ys, 1)[0])


def claims_table(
    res: HerdResult, sweep_results: dict[int, HerdResult] | None = None
) -> list[tuple[str, str, bool]]:
    """Brooker's claims beside what this run measured: (claim, measured, reproduced?)."""
    calls = {s: res.mean_calls(s) for s in res.calls}
    time_ms = {s: res.mean_completion_ms(s) for s in res.completion_ms}
    rows = []
    if {"full jitter", "exponential"} <= calls.keys():
        ratio = calls["full jitter"] / calls["exponential"]
        rows.append(
            (
                BROOKER_CLAIMS["fewer calls"],
                f"{res.clients} clients: full jitter {calls['full jitter']:.0f} calls, exponential "
                f"{calls['exponential']:.0f} ({ratio:.0%} of it)",
                ratio < 0.5,
            )
        )
        backoffs = [s for s in time_ms if s not in ("none", "exponential")]
        if backoffs:
            runner_up = max(backoffs, key=time_ms.get)
            rows.append(
                (
                    BROOKER_CLAIMS["exponential slowest"],
                    f"exponential {time_ms['exponential']:.0f} ms; slowest jittered ({runner_up}) "
                    f"{time_ms[runner_up]:.0f} ms ({time_ms['exponential'] / time_ms[runner_up]:.1f}x)",
                    time_ms["exponential"] > 1.5 * time_ms[runner_up],
                )
            )
    if {"full jitter", "equal jitter"} <= calls.keys():
        rows.append(
            (
                BROOKER_CLAIMS["equal jitter"],
                f"equal {calls['equal jitter']:.0f} calls / {time_ms['equal jitter']:.0f} ms, full "
                f"{calls['full jitter']:.0f} calls / {time_ms['full jitter']:.0f} ms",
                calls["equal jitter"] > calls["full jitter"]
                and time_ms["equal jitter"] > time_ms["full jitter"],
            )
        )
    if {"full jitter", "decorrelated jitter"} <= calls.keys():
        rows.append(
            (
                BROOKER_CLAIMS["decorrelated"],
                f"decorrelated {calls['decorrelated jitter']:.0f} calls / {time_ms['decorrelated jitter']:.0f} ms,"
                f" full {calls['full jitter']:.0f} calls / {time_ms['full jitter']:.0f} ms",
                calls["full jitter"] < calls["decorrelated jitter"]
                and time_ms["full jitter"] > time_ms["decorrelated jitter"],
            )
        )
    if sweep_results and "none" in calls:
        exponent = growth_exponent(sweep_results, "none")
        lo, hi = min(sweep_results), max(sweep_results)
        rows.append(
            (
                BROOKER_CLAIMS["no backoff"],
                f"no backoff: {sweep_results[lo].mean_calls('none'):.0f} calls at {lo} clients, "
                f"{sweep_results[hi].mean_calls('none'):.0f} at {hi}: work ~ N^{exponent:.2f}",
                exponent > 1.5,
            )
        )
    return rows


COLORS = {
    "none": "#7f8c8d",
    "exponential": "#c0392b",
    "equal jitter": "#8e44ad",
    "full jitter": "#2e86c1",
    "decorrelated jitter": "#d68910",
}


def plot_sweep(sweep_results: dict[int, HerdResult]):
    """Calls and completion time against client count, one line per strategy."""
    import matplotlib.pyplot as plt

    from course.kit.plotting import legend_outside

    fig, (ax_calls, ax_time) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained")
    ns = sorted(sweep_results)
    strategies = list(sweep_results[ns[0]].calls)
    for s in strategies:
        ax_calls.plot(ns, [sweep_results[n].mean_calls(s) for n in ns], "-o", ms=3, color=COLORS[s], label=s)
        ax_time.plot(
            ns,
            [sweep_results[n].mean_completion_ms(s) / 1000 for n in ns],
            "-o",
            ms=3,
            color=COLORS[s],
            label=s,
        )
    trials = sweep_results[ns[0]].trials
    ax_calls.set(
        xlabel="contending clients",
        ylabel="calls (conditional writes)",
        title=f"Work (mean of {trials} runs)",
    )
    ax_time.set(xlabel="contending clients", ylabel="seconds until the last client is done", yscale="log")
    ax_time.set_title(f"Completion time (mean of {trials} runs, log scale)")
    legend_outside(ax_time)
    return fig


def plot_race(clients: int, *, trials: int = 20, seed: int = 7, window_ms: float = 1500.0):
    """One contention level up close: when the writes arrive (trial 0), and the averages."""
    import matplotlib.pyplot as plt

    from course.kit.plotting import legend_outside

    res = simulate(clients, trials=trials, seed=seed, record=True)
    fig, (ax_t, ax_bar) = plt.subplots(
        1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [1.7, 1]}, layout="constrained"
    )
    bins = np.arange(0, window_ms + 10, 10)
    for s in ("exponential", "full jitter"):
        ax_t.hist(res.write_times_ms[s], bins=bins, histtype="step", lw=1.6, color=COLORS[s], label=s)
    ax_t.set(
        xlabel="time (ms)", ylabel="writes per 10 ms", title=f"{clients} clients: writes arriving at the row"
    )
    legend_outside(ax_t, "below", ncols=2)
    names = list(res.calls)
    calls = [res.mean_calls(s) for s in names]
    ax_bar.barh(names, calls, color=[COLORS[s] for s in names])
    for y, (s, c) in enumerate(zip(names, calls, strict=True)):
        ax_bar.text(
            c, y, f" {c:.0f} calls, {res.mean_completion_ms(s) / 1000:.1f} s", va="center", fontsize=8
        )
    ax_bar.set_xlim(0, max(calls) * 1.9)
    ax_bar.set(xlabel=f"mean calls ({trials} runs)", title="work and completion time")
    ax_bar.invert_yaxis()
    return res


# ----------------------------------------------------------------------------- the herd, live


@dataclass
class StormRun:
    """Request arrival times (s since the clients started) at a live service, and outcomes."""

    strategy: str
    clients: int
    outage: float
    arrivals: list[float]
    statuses: list[int]
    finished_at: list[float]  # per client: when it got its 200 (nan if it gave up)

    def per_bucket(self, bucket: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
        end = max(self.arrivals, default=0.0) + bucket
        edges = np.arange(0.0, end + bucket, bucket)
        counts, _ = np.histogram(self.arrivals, bins=edges)
        return edges[:-1], counts

    def peak(self, bucket: float = 0.05, *, after: float = 0.0) -> int:
        starts, counts = self.per_bucket(bucket)
        later = counts[starts >= after]
        return int(later.max()) if later.size else 0


async def live_storm(
    strategy: str,
    *,
    clients: int = 100,
    outage: float = 1.0,
    base: float = 0.05,
    cap: float = 1.0,
    max_attempts: int = 12,
    seed: int = 3,
) -> StormRun:
    """``clients`` real httpx clients hit a live :class:`~course.kit.faults.FlakyService` at the same
    moment, while it answers 503 for its first ``outage`` seconds, and retry with the
    ``strategy`` from :mod:`course.backoff` (real sleeps: this one runs in real time)."""
    import asyncio
    import random
    import ssl
    import time

    import httpx

    from course.backoff import make
    from course.kit.faults import FlakyService, Schedule

    backoff = make(strategy, base, cap)
    rng = random.Random(seed)
    finished = [float("nan")] * clients
    # one httpx client per simulated client, as separate instances would have (one shared
    # client's pool gets slow with a hundred idle connections); they share an SSL context
    tls = ssl.create_default_context()
    https = [httpx.AsyncClient(timeout=5.0, verify=tls) for _ in range(clients)]
    try:
        async with FlakyService(Schedule.outage(0.0, outage), name="storm") as svc:
            # open the connections first, so the storm measures retries, not TCP handshakes
            await asyncio.gather(*(http.get(svc.url + "/warmup") for http in https))
            svc.set_schedule(Schedule.outage(0.0, outage))
            svc.reset_clock()
            t0 = time.perf_counter()

            async def client(i: int) -> None:
                previous = None
                for attempt in range(max_attempts):
                    resp = await https[i].get(svc.url + "/checkout")
                    if resp.status_code < 500:
                        finished[i] = time.perf_counter() - t0
                        return
                    if attempt + 1 < max_attempts:
                        previous = backoff.delay(attempt, previous, rng.random)
                        await asyncio.sleep(previous)

            await asyncio.gather(*(client(i) for i in range(clients)))
    finally:
        await asyncio.gather(*(http.aclose() for http in https))
    return StormRun(
        strategy,
        clients,
        outage,
        [r.at for r in svc.requests],
        [r.step.status for r in svc.requests],
        finished,
    )


async def virtual_storm(
    strategy: str,
    *,
    clients: int = 100,
    outage: float = 1.0,
    base: float = 0.05,
    cap: float = 1.0,
    max_attempts: int = 12,
    seed: int = 3,
) -> StormRun:
    """The storm of :func:`live_storm` on a :class:`~course.kit.faults.VirtualClock`: the same
    clients, outage and backoff, against a :class:`~course.kit.faults.FlakyDependency`, with
    no network and no scheduler in between. A client retries exactly when its backoff says,
    so this shows what the strategy itself does; the live run adds what a machine adds (a busy
    one blurs the waves of the clients that retry without jitter). Instant and repeatable."""
    import asyncio
    import random

    from course.backoff import make
    from course.kit.faults import DependencyError, FlakyDependency, Schedule, VirtualClock

    clock = VirtualClock()
    service = FlakyDependency(Schedule.outage(0.0, outage, during=503), clock=clock, name="storm")
    backoff = make(strategy, base, cap)
    rng = random.Random(seed)
    finished = [float("nan")] * clients

    async def client(i: int) -> None:
        previous = None
        for attempt in range(max_attempts):
            try:
                await service()
            except DependencyError:
                if attempt + 1 < max_attempts:
                    previous = backoff.delay(attempt, previous, rng.random)
                    await clock.sleep(previous)
                continue
            finished[i] = clock()
            return

    await asyncio.gather(*(client(i) for i in range(clients)))
    statuses = [int(call.outcome) if call.outcome.isdigit() else 200 for call in service.calls]
    return StormRun(strategy, clients, outage, [call.at for call in service.calls], statuses, finished)


def plot_storm(*runs: StormRun, bucket: float = 0.05):
    """Requests per time bucket at the live service, one panel per run, outage shaded."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.3 * len(runs)), sharex=True, sharey=True)
    axes = [axes] if len(runs) == 1 else list(axes)
    for ax, run in zip(axes, runs, strict=True):
        starts, counts = run.per_bucket(bucket)
        color = COLORS.get(run.strategy, "#555")
        ax.bar(starts, counts, width=bucket, align="edge", color=color)
        ax.axvspan(0, run.outage, color="#f5b7b1", alpha=0.4, lw=0)
        done = np.nanmax(run.finished_at) if not np.all(np.isnan(run.finished_at)) else float("nan")
        ax.set_title(
            f"{run.strategy}: {len(run.arrivals)} requests from {run.clients} clients; busiest "
            f"{bucket * 1000:.0f} ms once the service is back: {run.peak(bucket, after=run.outage)}; "
            f"all served by {done:.2f} s",
            fontsize=10,
        )
        ax.set_ylabel("requests")
    axes[-1].set_xlabel("seconds since the clients started (shaded: the service answers 503)")
    fig.tight_layout()
    return fig


@dataclass
class RaceRun:
    strategy: str
    clients: int
    calls: int  # conditional UPDATEs sent
    seconds: float  # until the last client's UPDATE went through


HERD_TABLE = "CREATE TABLE IF NOT EXISTS herd_row (id int PRIMARY KEY, version bigint NOT NULL)"


async def live_occ_race(
    pool, strategy: str, *, clients: int = 30, base: float = 0.002, cap: float = 0.1, seed: int = 1
) -> RaceRun:
    """Brooker's race on the live PostgreSQL: ``clients`` connections each read the row's
    version and send ``UPDATE ... WHERE version = <read>``; a client whose UPDATE matched no
    row backs off with ``strategy`` and tries again. ``pool`` needs ``clients`` connections."""
    import asyncio
    import random
    import time

    from course.backoff import make

    if getattr(pool, "max_size", clients) < clients:
        raise ValueError(
            f"the pool has {pool.max_size} connections; the race needs one per client ({clients})"
        )
    async with pool.connection() as conn:
        await conn.execute(HERD_TABLE)
        await conn.execute("INSERT INTO herd_row VALUES (1, 0) ON CONFLICT (id) DO UPDATE SET version = 0")
    backoff = make(strategy, base, cap)
    rng = random.Random(seed)
    calls = 0
    finished: list[float] = []
    go = asyncio.Event()
    ready = 0
    t0 = 0.0

    async def client() -> None:
        nonlocal calls, ready
        async with pool.connection() as conn:
            await conn.set_autocommit(True)
            ready += 1
            await go.wait()
            previous, failures = None, 0
            while True:
                row = await (await conn.execute("SELECT version FROM herd_row WHERE id = 1")).fetchone()
                cur = await conn.execute(
                    "UPDATE herd_row SET version = version + 1 WHERE id = 1 AND version = %s", (row[0],)
                )
                calls += 1
                if cur.rowcount == 1:
                    finished.append(time.perf_counter() - t0)
                    return
                previous = backoff.delay(failures, previous, rng.random)
                failures += 1
                await asyncio.sleep(previous)

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    while ready < clients:  # every client holds its connection before the start signal
        await asyncio.sleep(0.005)
    t0 = time.perf_counter()
    go.set()
    await asyncio.gather(*tasks)
    return RaceRun(strategy, clients, calls, max(finished))
