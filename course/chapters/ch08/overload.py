"""Chapter 08's demos of limits under stress.

- :func:`outages`: one Redis outage (``CLIENT PAUSE``) and the fallback's three modes side by
  side, each mode's replicas with their own breaker, drawn by :func:`plot_outage`;
- :func:`rate_is_not_concurrency`: a token bucket keeps the rate while a slowing dependency
  fills up with requests in flight; chapter 02's bulkhead beside it bounds them (on a
  :class:`~course.kit.faults.VirtualClock`: no real waiting);
- :func:`local_in_front`: a local bucket in front of the shared one, and the round trips to
  Redis it saves.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

from course import ratelimit as rl

MODES = ("bounded", "open", "closed")

# ----------------------------------------------------------------------------- Redis down


@dataclass
class OutageRun:
    """What one mode's replicas decided during one outage of Redis."""

    mode: str
    pause: tuple[float, float]
    rate: float
    cooldown: float
    timeout: float
    decisions: list[tuple[float, str, bool]] = field(
        default_factory=list
    )  # (s since start, source, admitted)
    worst_ms: float = 0.0

    def admitted(self, source: str | None = None, slot: float = 0.1) -> Counter:
        """Admitted requests per ``slot`` seconds (slot index -> count), of one source or all."""
        return Counter(int(t / slot) for t, s, ok in self.decisions if ok and source in (None, s))

    @property
    def total(self) -> int:
        return sum(ok for _, _, ok in self.decisions)

    @property
    def in_outage(self) -> int:
        return sum(ok for t, _, ok in self.decisions if self.pause[0] <= t < self.pause[1])

    @property
    def paths(self) -> Counter:
        """Who decided, over the whole run: ``redis`` or the fallback (``local``, ``open``, ``closed``)."""
        return Counter(s for _, s, _ in self.decisions)

    @property
    def back_at(self) -> float | None:
        """When Redis first decided again after the outage (None: not within the run)."""
        return next((t for t, s, _ in self.decisions if t >= self.pause[1] and s == "redis"), None)

    @property
    def all_back_at(self) -> float | None:
        """From when on Redis made every decision (each replica returns at its own breaker's probe)."""
        after = [(t, s) for t, s, _ in self.decisions if t >= self.pause[1]]
        last_fallback = max((i for i, (_, s) in enumerate(after) if s != "redis"), default=-1)
        return after[last_fallback + 1][0] if last_fallback + 1 < len(after) else None

    def lines(self) -> list[str]:
        """This run in three printed lines: what was admitted, who decided, how fast."""
        down = self.pause[1] - self.pause[0]
        back = "not within the run"
        if self.back_at is not None and self.all_back_at is not None:
            end = self.pause[1]
            back = f"{self.back_at - end:.2f} s later, on every replica {self.all_back_at - end:.2f} s later"
        return [
            f"{self.mode:8} admitted {self.total:3} in all, {self.in_outage:3} in the {down:.1f} s Redis was down "
            f"(the limit allows {self.rate * down:.0f} plus a burst)",
            f"{'':8} decided by {dict(self.paths)}; slowest decision {self.worst_ms:.0f} ms "
            f"(timeout {self.timeout * 1000:.0f} ms)",
            f"{'':8} Redis answered again at {self.pause[1]:.2f} s; decided on Redis again {back}",
        ]


async def outages(
    ns,
    modes: tuple[str, ...] = MODES,
    *,
    replicas: int = 3,
    seconds: float = 1.4,
    pause: tuple[float, float] = (0.3, 0.8),
    capacity: int = 30,
    rate: float = 30.0,
    interval: float = 0.02,
    timeout: float = 0.02,
    cooldown: float = 0.2,
) -> list[OutageRun]:
    """One outage of Redis, every mode at once.

    For each mode, ``replicas`` in-process replicas each send a request every ``interval`` s
    through a :class:`~course.ratelimit.FallbackLimiter` (``timeout`` on the Redis call, a
    breaker of its own that probes again after ``cooldown`` s); Redis stops answering during
    ``pause`` (each run's ``pause`` is then the window measured: a little late). Before the clock starts, every connection is opened and each mode's shared
    bucket is emptied, so the run starts at the limit's rate, not with its burst.
    """
    from course.kit.faults import pause_redis

    redis = ns.redis(fresh=True)
    control = ns.redis_sync()
    runs = {mode: OutageRun(mode, pause, rate, cooldown, timeout) for mode in modes}
    fleets = {}
    for mode in modes:
        shared = rl.TokenBucket(redis, capacity, rate, prefix="ch08")
        await redis.delete(shared.key(f"outage:{mode}"))
        await shared.hit(f"outage:{mode}", cost=capacity)  # empty it (and load the script)
        local = [rl.LocalTokenBucket(capacity / replicas, rate / replicas) for _ in range(replicas)]
        fleets[mode] = [
            rl.FallbackLimiter(shared, bucket, mode=mode, timeout=timeout, breaker=rl.redis_breaker(cooldown))
            for bucket in local
        ]
    await asyncio.gather(*(redis.ping() for _ in range(len(modes) * replicas)))  # every connection, now
    t0 = time.monotonic()

    async def replica(run: OutageRun, limiter: rl.FallbackLimiter) -> None:
        n = 0
        while (now := time.monotonic() - t0) < seconds:
            started = time.perf_counter()
            decision = await limiter.hit(f"outage:{run.mode}")
            run.worst_ms = max(run.worst_ms, (time.perf_counter() - started) * 1000)
            run.decisions.append((now, decision.source, decision.allowed))
            n += 1
            await asyncio.sleep(max(0.0, t0 + n * interval - time.monotonic()))

    def pause_now() -> float:
        started = time.monotonic() - t0
        pause_redis(control, pause[1] - pause[0])
        return started

    async def fault() -> None:
        await asyncio.sleep(max(0.0, t0 + pause[0] - time.monotonic()))
        started = await asyncio.to_thread(pause_now)  # a thread starts late on a busy machine: measured
        for run in runs.values():
            run.pause = (started, started + pause[1] - pause[0])

    try:
        await asyncio.gather(fault(), *(replica(runs[m], x) for m in modes for x in fleets[m]))
    finally:
        control.execute_command("CLIENT", "UNPAUSE")
        control.close()
        await redis.aclose()
    for run in runs.values():
        run.decisions.sort()
    return list(runs.values())


def outage_claims(runs: list[OutageRun], capacity: int) -> list[dict]:
    """What the chapter says each mode's fallback does while Redis is down, as the keyword arguments of
    :func:`course.kit.claims.check`. ``capacity`` is the limit's burst, which the local buckets share.

    Only the fallback's decisions count: a request sent at the edges of the outage may still be decided
    by Redis, and a loaded machine sends fewer requests than the demo asks for (then ``bounded`` has
    nothing to refuse), but whatever the fallback decided, it decided by its mode."""
    out = []
    claims = {
        "bounded": "bounded: while Redis is down, the local buckets admit at most their burst plus the limit's rate",
        "open": "open: while Redis is down, the fallback admits every request",
        "closed": "closed: while Redis is down, the fallback refuses every request: an outage of the API",
    }
    for run in runs:
        down = run.pause[1] - run.pause[0]
        window = [(s, ok) for t, s, ok in run.decisions if run.pause[0] <= t < run.pause[1]]
        fell_back = [ok for s, ok in window if s != "redis"]
        decided, admitted = len(fell_back), sum(fell_back)
        measured = (
            f"the fallback decided {decided} of the {len(window)} requests sent in the {down:.1f} s "
            f"and admitted {admitted}"
        )
        held = {
            "bounded": admitted <= capacity + run.rate * down + 1,
            "open": admitted == decided,
            "closed": admitted == 0,
        }[run.mode]
        if run.mode == "bounded":
            measured += f" (at most {capacity} + {run.rate * down:.0f})"
        out.append(
            dict(
                claim=claims[run.mode],
                measured=measured,
                held=decided > 0 and held,
                otherwise="Redis was paused too late, or the replicas sent nothing while it was",
            )
        )
    return out


def return_to_redis(runs: list[OutageRun]) -> str:
    """When the replicas decided on Redis again, in a sentence computed from the run.

    A breaker open at the end of the outage probes again one cooldown after its last probe failed,
    and that probe fell anywhere in the outage's last cooldown: so a replica comes back anywhere
    from right away to about one cooldown after Redis, not "one cooldown" as a rule. A probe sent
    as Redis wakes, while it works through the commands it held, or on a busy machine, can still
    time out and cost its replica another cooldown: measured here, up to three on a loaded 2-core
    laptop. So the sentence says which of the two this run saw, with its numbers.
    """
    cooldown = runs[0].cooldown
    first = [run.back_at - run.pause[1] for run in runs if run.back_at is not None]
    last = [run.all_back_at - run.pause[1] for run in runs if run.all_back_at is not None]
    if not first or len(last) < len(runs):
        return "some replicas were still on the fallback when the run ended: a longer run would show their return"
    import textwrap

    said = (
        f"back on Redis {min(first):.2f} s after it answered again, every replica {max(last):.2f} s after: "
    )
    if max(last) <= cooldown + runs[0].timeout:
        said += f"within one cooldown ({cooldown:.1f} s), each at its breaker's next probe"
    else:
        said += (
            f"more than one cooldown ({cooldown:.1f} s): a probe sent as Redis woke (busy with the commands "
            "it held) or delayed by this busy machine timed out, and its breaker waited another cooldown"
        )
    return textwrap.fill(said, 104, subsequent_indent="  ")


def plot_outage(runs: list[OutageRun], *, seconds: float | None = None):
    """One panel per mode: admitted per 100 ms, by who decided (Redis or the fallback)."""
    from course.kit import plotting

    fig, axes = plotting.figure(10, 2.8, ncols=len(runs), sharey=True)
    colors = {
        "redis": plotting.COLORS["fix"],
        "local": plotting.COLORS["warn"],
        "open": plotting.COLORS["bad"],
    }
    names = {
        "redis": "admitted, Redis decided",
        "local": "admitted by the local bucket",
        "open": "admitted by 'open'",
    }
    end = seconds or max((t for run in runs for t, _, _ in run.decisions), default=1.0)
    slots = range(int(end / 0.1) + 1)
    for ax, run in zip(axes, runs, strict=True):
        ax.axvspan(*run.pause, color=plotting.COLORS["neutral"], alpha=0.15, label="Redis not answering")
        bottom = [0] * len(slots)
        for source in ("redis", "local", "open"):
            counts = run.admitted(source)
            heights = [counts.get(s, 0) for s in slots]
            if any(heights):
                ax.bar([s / 10 for s in slots], heights, width=0.1, align="edge", bottom=bottom, label=names[source],
                       color=colors[source], edgecolor="white", linewidth=0.5)  # fmt: skip
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.axhline(run.rate / 10, color="k", lw=1, linestyle="--", label="the global limit per 100 ms")
        if run.all_back_at is not None:
            ax.axvline(
                run.all_back_at, color=plotting.COLORS["ok"], lw=2, label="every replica on Redis again"
            )
        ax.set_title(f"{run.mode}: {run.total} admitted", fontsize="medium")
        ax.set_xlabel("seconds")
    axes[0].set_ylabel("admitted per 100 ms")
    legend_right(axes)
    return fig


def legend_right(axes) -> None:
    """One legend for a row of panels, right of the last one: every label once, in order."""
    from course.kit import plotting

    handles: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    plotting.legend_outside(axes[-1], handles=list(handles.values()), labels=list(handles.keys()))


# ----------------------------------------------------------------------------- rate is not concurrency


@dataclass
class Flight:
    """One run of :func:`rate_is_not_concurrency`."""

    label: str
    slow_from: float
    samples: list[tuple[float, int]]  # (arrival time, requests in flight just before it)
    admitted: list[float]  # start times of the requests that ran
    refused: Counter  # by what: "rate", "concurrency"

    def most_in_flight(self, after: bool) -> int:
        return max((n for t, n in self.samples if (t >= self.slow_from) == after), default=0)

    def admitted_per_second(self, after: bool, end: float) -> float:
        span = (end - self.slow_from) if after else self.slow_from
        return sum((t >= self.slow_from) == after for t in self.admitted) / span

    def lines(self, end: float) -> list[str]:
        """The run in four printed lines: requests in flight and admitted, before and after; refused."""
        out = [self.label]
        for after, when in ((False, "before the slowdown"), (True, "after it")):
            out.append(
                f"   {when:19}: at most {self.most_in_flight(after):2} in flight, "
                f"{self.admitted_per_second(after, end):4.1f} admitted per second"
            )
        out.append("   refused: " + ", ".join(f"{n} by the {why}" for why, n in self.refused.items()))
        return out


async def rate_is_not_concurrency(
    *,
    rate: float = 20.0,
    burst: int = 2,
    arrivals: float = 40.0,
    seconds: float = 4.0,
    slow_from: float = 2.0,
    fast: float = 0.05,
    slow: float = 1.0,
    concurrency: int | None = None,
) -> Flight:
    """A client sends ``arrivals`` requests a second through a token bucket of ``rate`` per
    second (holding ``burst`` tokens); the dependency behind it answers in ``fast`` seconds, then from ``slow_from`` on in
    ``slow`` seconds. With ``concurrency``, chapter 02's :class:`~course.bulkhead.Bulkhead`
    also caps the requests in flight. Virtual time: the run takes milliseconds."""
    from course.bulkhead import Bulkhead, BulkheadFullError
    from course.kit.faults import VirtualClock

    clock = VirtualClock()
    bucket = rl.LocalTokenBucket(burst, rate, clock=clock)
    bulkhead = Bulkhead(concurrency) if concurrency else None
    label = "a rate limit only" if bulkhead is None else f"a rate limit and a bulkhead of {concurrency}"
    flight = Flight(label, slow_from, [], [], Counter())
    in_flight = 0
    tasks = []

    async def serve(latency: float) -> None:
        nonlocal in_flight
        in_flight += 1
        flight.admitted.append(clock())
        try:
            await clock.sleep(latency)
        finally:
            in_flight -= 1

    async def guarded(latency: float) -> None:
        try:
            await bulkhead.call(lambda: serve(latency))
        except BulkheadFullError:
            flight.refused["bulkhead"] += 1

    for _ in range(int(seconds * arrivals)):
        await clock.sleep(1 / arrivals)
        now = clock()
        flight.samples.append((now, in_flight))
        if not (await bucket.hit("client")).allowed:
            flight.refused["rate limit"] += 1
            continue
        latency = slow if now >= slow_from else fast
        job = serve(latency) if bulkhead is None else guarded(latency)
        tasks.append(asyncio.ensure_future(job))
        await asyncio.sleep(0)  # let it start (or be refused by the bulkhead) at this instant
    await asyncio.gather(*tasks)
    return flight


# ----------------------------------------------------------------------------- a local bucket in front


async def local_in_front(
    redis,
    *,
    replicas: int = 2,
    capacity: int = 10,
    rate: float = 10.0,
    requests: int = 200,
    seconds: float = 1.0,
) -> dict[str, dict[str, int]]:
    """``replicas`` share one Redis token bucket per client. A scraper sends ``requests`` in
    ``seconds`` (round robin over the replicas), a polite client one request per ``1 / rate``
    s. Twice: the shared bucket alone, then a local bucket holding the whole limit in front of
    it on every replica. Injected time. Per setup: admitted per client and Redis round trips."""
    origin = 1_800_000_000.0
    scraper = [("scraper", origin + i * seconds / requests) for i in range(requests)]
    polite = [("polite", origin + i / rate) for i in range(int(seconds * rate))]
    traffic = sorted(scraper + polite, key=lambda x: x[1])
    out = {}
    for setup in ("shared bucket only", "local bucket in front"):
        shared = rl.TokenBucket(redis, capacity, rate, prefix="ch08-front")
        await redis.delete(shared.key("scraper"), shared.key("polite"))
        if setup == "shared bucket only":
            fleet = [shared] * replicas
        else:
            fleet = [rl.LocalThenShared(rl.LocalTokenBucket(capacity, rate), shared) for _ in range(replicas)]
        got = Counter()
        for i, (client, now) in enumerate(traffic):
            decision = await fleet[i % replicas].hit(client, now=now)
            got[client] += decision.allowed
            got["round trips"] += decision.source == "redis"
        out[setup] = {"scraper": got["scraper"], "polite": got["polite"], "round trips": got["round trips"]}
    out["sent"] = {"scraper": len(scraper), "polite": len(polite), "round trips": 0}
    return out
