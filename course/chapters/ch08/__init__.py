"""Chapter 08's demos: the boundary burst, what each limiter costs, processes sharing one
limit, skewed clocks, the HTTP edge, and ``limits`` on the same server. Redis going away, a
rate limit beside a concurrency limit and a local bucket in front of the shared one are in
:mod:`course.chapters.ch08.overload` (imported here).

Only chapter 08's notebook, checks and tests import this package. The limiters themselves
are in :mod:`course.ratelimit`; the broken ones shown here (a read-then-write bucket, a
bucket on the client's clock) exist only to be shown failing.

``python -m course.chapters.ch08 worker SPEC`` is the worker process of
:func:`processes_sharing_a_limit`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from course import ratelimit as rl
from course.chapters.ch08.overload import (  # noqa: F401 - the notebook reaches them as ch08.<name>
    OutageRun,
    legend_right,
    local_in_front,
    outage_claims,
    outages,
    plot_outage,
    rate_is_not_concurrency,
    return_to_redis,
)

MINUTE = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC: a whole minute, so windows start on it

# ----------------------------------------------------------------------------- the boundary burst


def edge_traffic(limit: int = 100, window: float = 60.0, start: float = MINUTE) -> list[float]:
    """``limit`` requests in the last second of a window, ``limit`` in the first second of the next."""
    step = 1.0 / limit
    first = [start + window - 1 + i * step for i in range(limit)]
    second = [start + window + i * step for i in range(limit)]
    return first + second


@dataclass
class Verdicts:
    name: str
    times: list[float]
    allowed: list[bool]

    @property
    def admitted(self) -> int:
        return sum(self.allowed)

    def most_in(self, span: float) -> int:
        """The most requests admitted in any ``span`` seconds."""
        ts = [t for t, ok in zip(self.times, self.allowed, strict=True) if ok]
        best, lo = 0, 0
        for hi in range(len(ts)):
            while ts[hi] - ts[lo] >= span:
                lo += 1
            best = max(best, hi - lo + 1)
        return best


async def replay(limiter: rl.RedisLimiter, times: list[float], client: str = "edge") -> Verdicts:
    """Send one request at each (injected) time, in order; what the limiter said to each.

    The calls go in one pipeline: the same script calls as :meth:`~course.ratelimit.RedisLimiter.hit`,
    run by Redis one after another in this order, for one round trip instead of one per request.
    """
    key = limiter.key(client)
    await limiter.redis.delete(key)
    async with limiter.redis.pipeline(transaction=False) as pipe:
        for t in times:
            await limiter._script(keys=[key], args=[repr(float(t)), *limiter._args(1)], client=pipe)
        replies = await pipe.execute()
    return Verdicts(type(limiter).__name__, times, [bool(reply[0]) for reply in replies])


def make_limiters(redis, limit: int = 100, window: float = 60.0) -> list[rl.RedisLimiter]:
    """The four limiters at the same nominal limit (the bucket refills ``limit`` per ``window``)."""
    return [
        rl.FixedWindow(redis, limit, window, prefix="ch08"),
        rl.SlidingLog(redis, limit, window, prefix="ch08"),
        rl.SlidingCounter(redis, limit, window, prefix="ch08"),
        rl.TokenBucket(redis, limit, limit / window, prefix="ch08"),
    ]


def plot_edge(results: list[Verdicts], ax=None, *, origin: float = MINUTE):
    """Admitted requests over time, one row per limiter, the window boundary marked."""
    from course.kit import plotting

    if ax is None:
        _, ax = plotting.figure(9, 2.8)
    for row, v in enumerate(results):
        xs_ok = [t - origin for t, ok in zip(v.times, v.allowed, strict=True) if ok]
        xs_no = [t - origin for t, ok in zip(v.times, v.allowed, strict=True) if not ok]
        ax.scatter(xs_no, [row] * len(xs_no), s=6, color=plotting.COLORS["neutral"], alpha=0.35, marker="|")
        ax.scatter(xs_ok, [row] * len(xs_ok), s=10, color=plotting.COLORS["ok"], marker="|")
    ax.axvline(60, color=plotting.COLORS["bad"], linestyle=":", label="the minute turns (12:01:00)")
    ax.scatter([], [], color=plotting.COLORS["ok"], marker="|", label="admitted")
    ax.scatter([], [], color=plotting.COLORS["neutral"], marker="|", label="refused")
    ax.set_yticks(range(len(results)), [f"{v.name} ({v.admitted})" for v in results])
    ax.set_xlabel("seconds after 12:00:00")
    ax.set_xlim(58.8, 61.2)
    plotting.legend_outside(ax)
    return ax


# ----------------------------------------------------------------------------- what each costs


class CountingRedis:
    """Wraps a ``redis.asyncio.Redis``: counts the round trips its limiters make."""

    def __init__(self, redis) -> None:
        self.inner = redis
        self.round_trips = 0

    def register_script(self, lua: str):
        script = self.inner.register_script(lua)
        outer = self

        class Counted:
            async def __call__(self, keys=None, args=None):
                outer.round_trips += 1
                return await script(keys=keys, args=args)

        return Counted()

    async def delete(self, *names):
        return await self.inner.delete(*names)


async def _server_calls(redis) -> int:
    stats = await redis.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if not k.endswith("_info") and "config" not in k)


@dataclass
class Cost:
    name: str
    limit: int
    memory_bytes: int
    round_trips: float
    server_commands: float
    micros: float


async def measure_cost(redis, make: Callable, limit: int, *, sample: int = 300) -> Cost:
    """One client at its limit: bytes its key holds, round trips and server commands per request.

    The first ``sample`` requests are sent one by one and counted; the rest (to reach the
    limit) go through the same script in pipelined batches, only to fill the key.
    """
    counting = CountingRedis(redis)
    limiter = make(counting, limit)
    client = f"cost-{limit}"
    key = limiter.key(client)
    await redis.delete(key)
    n = min(sample, limit)
    step = 30.0 / limit
    await redis.config_resetstat()
    t0 = time.perf_counter()
    for i in range(n):
        await limiter.hit(client, now=MINUTE + i * step)
    micros = (time.perf_counter() - t0) / n * 1e6
    commands = await _server_calls(redis) - 1  # less the INFO itself
    filler = make(redis, limit)
    for lo in range(n, limit, 1000):
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(lo, min(limit, lo + 1000)):
                await filler._script(
                    keys=[key], args=[repr(MINUTE + i * step), *filler._args(1)], client=pipe
                )
            await pipe.execute()
    memory = await redis.memory_usage(key, samples=0) or 0
    return Cost(type(limiter).__name__, limit, memory, counting.round_trips / n, commands / n, micros)


COST_MAKERS = {
    "FixedWindow": lambda r, limit: rl.FixedWindow(r, limit, 3600, prefix="cost"),
    "SlidingLog": lambda r, limit: rl.SlidingLog(r, limit, 3600, prefix="cost"),
    "SlidingCounter": lambda r, limit: rl.SlidingCounter(r, limit, 3600, prefix="cost"),
    "TokenBucket": lambda r, limit: rl.TokenBucket(r, limit, limit / 3600, prefix="cost"),
    "LeakyMeter": lambda r, limit: rl.LeakyMeter(r, limit, limit / 3600, prefix="cost"),
    "GCRA": lambda r, limit: rl.GCRA(r, limit, limit / 3600, prefix="cost"),
}


# ----------------------------------------------------------------------------- processes sharing one limit


#: The broken bucket: read the state, decide in Python, write it back. Two round trips and a race.
async def read_then_write_bucket(redis, key: str, capacity: int, rate: float, now: float) -> bool:
    state = await redis.hgetall(key)
    tokens = float(state.get("tokens", capacity))
    last = float(state.get("ts", now))
    tokens = min(capacity, tokens + max(0.0, now - last) * rate)
    allowed = tokens >= 1
    if allowed:
        tokens -= 1
    await redis.hset(key, mapping={"tokens": tokens, "ts": now})
    await redis.expire(key, 60)
    return allowed


async def _hammer(redis, spec: dict, start: float) -> list[float]:
    """Call the limiter as fast as ``concurrency`` loops can until ``seconds`` have passed."""
    kind, skew = spec["kind"], spec.get("skew", 0.0)
    capacity, rate, key = spec["capacity"], spec["rate"], spec["key"]
    bucket = rl.TokenBucket(redis, capacity, rate, prefix="procs")
    admitted: list[float] = []
    end = start + spec["seconds"]

    async def loop() -> None:
        while time.time() < end:
            if kind == "read-then-write":
                ok = await read_then_write_bucket(redis, key, capacity, rate, time.time())
            elif kind == "client clock":  # one Lua script, but the time comes from this process's clock
                ok = (await bucket.hit(key, now=time.time() + skew)).allowed
            else:  # "server clock": the script reads TIME
                ok = (await bucket.hit(key)).allowed
            if ok:
                admitted.append(time.time() - start)

    await asyncio.gather(*(loop() for _ in range(spec["concurrency"])))
    return admitted


async def _worker(spec: dict) -> None:
    import redis.asyncio as aioredis

    redis = aioredis.Redis.from_url(
        spec["redis_url"], decode_responses=True, socket_timeout=None
    )  # BLPOP waits
    me, tag = spec["index"], spec["tag"]
    await redis.rpush(f"{tag}:ready", me)
    while True:
        _, raw = await redis.blpop([f"{tag}:go:{me}"])
        run = json.loads(raw)
        if run.get("stop"):
            break
        await asyncio.sleep(max(0.0, run["start"] - time.time()))  # every process starts together
        admitted = await _hammer(redis, run, run["start"])
        await redis.rpush(f"{tag}:done", json.dumps({"index": me, "admitted": admitted}))
    await redis.aclose()


@dataclass
class SharedRun:
    kind: str
    processes: int
    seconds: float
    capacity: int
    rate: float
    per_process: list[int]
    times: list[float] = field(default_factory=list)
    skews: list[float] = field(default_factory=list)

    @property
    def admitted(self) -> int:
        return sum(self.per_process)

    @property
    def bound(self) -> float:
        return self.capacity + self.rate * self.seconds

    @property
    def allowed(self) -> float:
        """The most any correct limiter could have admitted: ``capacity`` plus the refill until the
        last admitted reply (a request still in flight at ``seconds`` is decided a little later)."""
        return self.capacity + self.rate * max(self.seconds, max(self.times, default=0.0))

    @property
    def expected_over(self) -> bool:
        """What the chapter says of this kind of run: over the limit (a race, or clocks that disagree)."""
        return self.kind == "read-then-write" or (self.kind == "client clock" and any(self.skews))

    def line(self) -> str:
        clocks = f", clocks off by {self.skews} s" if any(self.skews) else ""
        return (
            f"{self.kind:16} {self.processes} processes{clocks}\n"
            f"{'':16} admitted {self.admitted:4}, the limit allows {self.bound:.0f} "
            f"({self.admitted / self.bound:.1f} x; per process {self.per_process})"
        )

    def claim(self) -> dict:
        """The keyword arguments of :func:`course.kit.claims.check` for what the chapter says of this run."""
        clocks = ", clocks 30 s apart" if any(self.skews) else ""
        how = {
            "read-then-write": "read, decide in Python, write back",
            "client clock": "one Lua script fed each process's own clock",
            "server clock": "one Lua script on Redis's own clock (TIME)",
        }[self.kind]
        span = max(self.seconds, max(self.times, default=0.0))
        measured = (
            f"{self.admitted} admitted; any correct limiter admits at most {self.allowed:.1f} "
            f"({self.capacity} + {self.rate:g}/s over {span:.2f} s)"
        )
        if self.expected_over:
            return dict(
                claim=f"{how}, {self.processes} processes{clocks}: more than the limit allows",
                measured=measured,
                held=self.admitted > self.allowed,
                otherwise="too few requests got through a loaded machine for the processes to overlap",
            )
        return dict(
            claim=f"{how}, {self.processes} processes{clocks}: within the limit",
            measured=measured,
            held=self.admitted <= self.allowed,
            source="Redis docs, Scripting with Lua" if any(self.skews) else "",
        )


async def processes_sharing_a_limit(
    ns, runs: list[dict], *, processes: int = 4, seconds: float = 1.0, capacity: int = 20, rate: float = 20.0
) -> list[SharedRun]:
    """Start ``processes`` worker processes once; for each run they hammer one token bucket together.

    Each run is ``{"kind": "read-then-write" | "client clock" | "server clock", "skews": [...]}``;
    ``skews[i]`` is how far process ``i``'s clock is off (used by the client-clock bucket only).
    """
    import secrets

    redis = ns.redis()
    tag = f"ch08:procs:{secrets.token_hex(3)}"
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "course.chapters.ch08",
            "worker",
            json.dumps({"redis_url": ns.redis_url, "tag": tag, "index": i}),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        for i in range(processes)
    ]
    results = []
    try:
        for _ in range(processes):
            if await redis.blpop([f"{tag}:ready"], timeout=60) is None:
                raise RuntimeError("a worker process did not start within 60 s")
        for n, run in enumerate(runs):
            key = f"{tag}:bucket:{n}"
            start = time.time() + 0.1  # time for every worker to read its order
            skews = list(run.get("skews", [0.0] * processes))
            for i in range(processes):
                spec = {
                    "kind": run["kind"],
                    "key": key,
                    "capacity": capacity,
                    "rate": rate,
                    "seconds": seconds,
                }
                spec.update(start=start, concurrency=4, skew=skews[i])
                await redis.rpush(f"{tag}:go:{i}", json.dumps(spec))
            per, times = [0] * processes, []
            for _ in range(processes):
                got = await redis.blpop([f"{tag}:done"], timeout=60)
                if got is None:
                    raise RuntimeError("a worker process did not report within 60 s")
                msg = json.loads(got[1])
                per[msg["index"]] = len(msg["admitted"])
                times += msg["admitted"]
            results.append(
                SharedRun(run["kind"], processes, seconds, capacity, rate, per, sorted(times), skews)
            )
    finally:
        for i in range(processes):
            await redis.rpush(f"{tag}:go:{i}", json.dumps({"stop": True}))
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    return results


def plot_shared(runs: list[SharedRun]):
    """One panel per run: admitted requests over time, all processes together, against the bound.
    Each panel has its own scale (a log scale shared by all drew several times slower)."""
    from course.kit import plotting

    fig, axes = plotting.figure(10, 3.0, ncols=len(runs))
    for ax, run in zip(axes, runs, strict=True):
        xs = [0, run.seconds]
        ax.plot(
            xs,
            [run.capacity + run.rate * x for x in xs],
            "k--",
            lw=1,
            zorder=3,
            label="the bound: capacity + rate x t",
        )
        over = run.admitted > run.bound
        ax.step(run.times, range(1, len(run.times) + 1), where="post", lw=2,
                color=plotting.COLORS["bad" if over else "ok"],
                label="admitted, over the bound" if over else "admitted, within the bound")  # fmt: skip
        clocks = "clocks 30 s apart" if any(run.skews) else "clocks agree"
        ax.set_title(f"{run.kind}\n{clocks}\n{run.admitted} admitted", fontsize="small")
        ax.set_xlabel("seconds")
        ax.set_ylim(0, None)
    axes[0].set_ylabel("admitted, all processes")
    legend_right(axes)
    return fig


# ----------------------------------------------------------------------------- leaky bucket as a queue


async def leaky_queue_run(redis, *, requests: int = 20, rate: float = 20.0, max_queue: int = 10) -> dict:
    """``requests`` arrive at once; each takes a slot and waits for it. When did each one go out?"""
    queue = rl.LeakyQueue(redis, rate, max_queue, prefix="ch08")
    await redis.delete(queue.key("provider"))
    t0 = time.perf_counter()
    out: list[float] = []
    rejected = 0

    async def one() -> None:
        nonlocal rejected
        decision = await queue.acquire("provider")
        if decision.allowed:
            out.append(time.perf_counter() - t0)
        else:
            rejected += 1

    await asyncio.gather(*(one() for _ in range(requests)))
    out.sort()
    gaps = [b - a for a, b in zip(out, out[1:], strict=False)]
    return {"sent": sorted(out), "rejected": rejected, "gaps_ms": [round(g * 1000) for g in gaps]}


# ----------------------------------------------------------------------------- the HTTP edge


def make_app(redis_url: str, capacity: int, rate: float) -> object:
    """A tiny API behind :class:`~course.ratelimit.RateLimitMiddleware` with a token bucket.

    The service runs on its own event loop (in its own thread), so it gets a Redis client of
    its own: an asyncio client belongs to the loop it first connected on.
    """
    import contextlib

    import redis.asyncio as aioredis
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from course.kit import serve

    client = aioredis.Redis.from_url(redis_url, decode_responses=True)

    async def hello(request):
        return JSONResponse({"hello": "world"})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    limiter = rl.TokenBucket(client, capacity, rate, prefix="api")
    return rl.RateLimitMiddleware(serve.app([Route("/hello", hello)], lifespan=lifespan), limiter)


# ----------------------------------------------------------------------------- the limits library


def limits_uri(redis_url: str) -> str:
    """The URI ``limits`` wants for the same Redis (``redis+unix://`` for a socket)."""
    return (
        "redis+unix://" + redis_url.removeprefix("unix://") if redis_url.startswith("unix://") else redis_url
    )


class _Skewed:
    """Stands in for the ``time`` module inside ``limits.storage.redis``: a client clock ``by`` seconds off."""

    def __init__(self, by: float) -> None:
        self.by = by

    def time(self) -> float:
        return time.time() + self.by

    def __getattr__(self, name):
        return getattr(time, name)


def limits_skew(storage, limit: str = "5/10 seconds", turns: int = 6, by: float = -30.0) -> dict[str, int]:
    """A pod whose clock is ``by`` seconds off sends ``turns`` requests on one key, then a pod with the
    right time sends ``turns`` more, all within a blink; admitted per strategy (the limit allows 5)."""
    from unittest import mock

    import limits
    import limits.storage.redis as limits_redis

    item = limits.parse(limit)
    out = {}
    for strategy in (limits.strategies.FixedWindowRateLimiter, limits.strategies.MovingWindowRateLimiter):
        limiter = strategy(storage)
        who = f"skew-{strategy.__name__}"
        limiter.clear(item, who)
        admitted = 0
        for skew in (by, 0.0):
            with mock.patch.object(limits_redis, "time", _Skewed(skew)):
                admitted += sum(limiter.hit(item, who) for _ in range(turns))
        out[strategy.__name__] = admitted
    return out


async def limits_boundary(
    storage, strategies, *, limit: str = "5/second", mid: float = 0.7
) -> dict[str, Verdicts]:
    """One request, four more ``mid`` s later, then five more just after the first one's window has
    passed (1.05 s after the first call returned): what each ``limits`` strategy admitted, and when
    (s after the first request). ``limits`` is synchronous: each call blocks for one round trip."""
    import limits

    item = limits.parse(limit)
    window = item.get_expiry()
    runs = {s.__name__: (s(storage), Verdicts(s.__name__, [], [])) for s in strategies}
    for name, (limiter, _) in runs.items():
        limiter.clear(item, name)
    t0 = time.monotonic()

    def hits(n: int) -> None:
        for name, (limiter, seen) in runs.items():
            for _ in range(n):
                seen.times.append(time.monotonic() - t0)
                seen.allowed.append(limiter.hit(item, name))

    hits(1)
    first_done = time.monotonic()  # the fixed window's EXPIRE was set before this
    await asyncio.sleep(max(0.0, t0 + mid - time.monotonic()))
    hits(4)
    await asyncio.sleep(max(0.0, first_done + window + 0.05 - time.monotonic()))
    hits(5)
    return {name: seen for name, (_, seen) in runs.items()}


def limits_cost(storage, control, strategy, limit: int) -> Cost:
    """The same measurement as :func:`measure_cost`, for a ``limits`` strategy at ``limit`` per hour.

    ``control`` is a sync ``redis.Redis`` on the same database (for INFO and MEMORY USAGE).
    """
    import limits

    item = limits.parse(f"{limit}/hour")
    limiter = strategy(storage)
    who = f"cost-{strategy.__name__}-{limit}"
    limiter.clear(item, who)
    client = storage.storage
    trips = 0
    real = client.execute_command

    def counted(*args, **kwargs):
        nonlocal trips
        trips += 1
        return real(*args, **kwargs)

    client.execute_command = counted
    control.config_resetstat()
    t0 = time.perf_counter()
    try:
        for _ in range(limit):
            limiter.hit(item, who)
    finally:
        del client.execute_command
    micros = (time.perf_counter() - t0) / limit * 1e6
    stats = control.info("commandstats")
    commands = sum(v["calls"] for k, v in stats.items() if "config" not in k) - 1
    memory = sum(control.memory_usage(k, samples=0) or 0 for k in control.keys(f"*{who}*"))
    return Cost(strategy.__name__, limit, memory, trips / limit, commands / limit, micros)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        asyncio.run(_worker(json.loads(argv[1])))
    else:
        raise SystemExit("usage: python -m course.chapters.ch08 worker SPEC")
