"""Chapter 12's demos: the estimates, codes under attack, the load test and Redis killed mid-load.

The shortener itself is :mod:`course.shortener` and :mod:`course.shortener_app`; the load
generator that runs in its own process is :mod:`course.chapters.ch12.load`. Here:

- :func:`estimates` works the walk-through's numbers and checks them against each other;
- :func:`attack` measures how guessable a code scheme is (neighbours, constant steps,
  shared characters), and :func:`consecutive_stats` is the part the checks reuse;
- :func:`insert_gate`: a trigger that holds every insert into ``links`` until the holder
  lets go, so a race between concurrent creates happens every time (demo and checks);
- :func:`measure_paths`: redirects per second and latency from the cache and from
  PostgreSQL, alternating every half second in one run of the load generator;
- :class:`DemoRedis` and :func:`outage_run`: a Redis of the demo's own, killed and
  restarted while the load generator runs against a service that uses it;
- :mod:`.scale`: partitions, the append-only file after a kill, the birthday bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from course import shortener
from course.chapters.ch12 import scale  # noqa: F401 - the notebook calls ch12.scale.<demo>
from course.chapters.ch12.tables import si  # noqa: F401 - the notebook calls ch12.si
from course.kit import backends
from course.kit.stats import percentile

# ============================================================================ the estimates

MONTH = 30 * 86_400


def estimates(
    *,
    links_per_month: float = 100e6,
    reads_per_write: float = 10,
    peak_redirects: float = 1e6,
    peak_factor: float = 10,
    row_bytes: float = 500,
    hot_share: float = 0.2,
    cache_bytes_per_link: float = 250,
) -> dict:
    """The interview numbers, worked out. Every input is a parameter, so a cell can vary it."""
    writes = links_per_month / MONTH
    reads = writes * reads_per_write
    links_per_year = links_per_month * 12
    return {
        "writes_per_s": writes,
        "writes_peak": writes * peak_factor,
        "reads_per_s": reads,
        "reads_peak": reads * peak_factor,
        "peak_over_average": peak_redirects / reads,
        "reads_per_write_at_peak": peak_redirects / (writes * peak_factor),
        "links_per_year": links_per_year,
        "storage_per_year": links_per_year * row_bytes,
        "hot_links": links_per_month * hot_share,
        "cache_bytes": links_per_month * hot_share * cache_bytes_per_link,
        "codes": shortener.ID_SPACE,
        "years_of_codes": shortener.ID_SPACE / links_per_year,
        "years_of_6_chars": 62**6 / links_per_year,
    }


# ============================================================================ codes under attack


def multiplicative(n: int) -> str:
    """A tempting shuffle: the id times a large odd number (not a multiple of 31), modulo 62**7."""
    return shortener.base62(n * 1_580_030_173 % shortener.ID_SPACE)


def code_schemes() -> dict[str, Callable[[int], str]]:
    """The code schemes the chapter compares, by name."""
    from sqids import Sqids

    sqids = Sqids(min_length=shortener.CODE_LENGTH)
    return {
        "base62 of the id": shortener.base62,
        "id x 1580030173 mod 62^7": multiplicative,
        "Feistel shuffle (course.shortener)": shortener.encode_code,
        "sqids, min_length=7": lambda n: sqids.encode([n]),
    }


def consecutive_stats(codes: list[str]) -> tuple[float, float]:
    """For the codes of consecutive ids: (characters shared with the next code, of 7, on average;
    how often the first or last character of the next code is the one its predecessor's
    first or last character most often leads to, the more predictable end). A keyed shuffle
    gives about (0.11, 0.1); counting up gives (6, 1.0)."""
    pairs = list(zip(codes, codes[1:], strict=False))
    if not pairs:
        return 0.0, 0.0
    shared = sum(sum(a == b for a, b in zip(x, y, strict=False)) for x, y in pairs) / len(pairs)
    best = 0.0
    for pos in (0, -1):
        moves: dict[str, Counter] = {}
        for x, y in pairs:
            moves.setdefault(x[pos], Counter())[y[pos]] += 1
        best = max(best, sum(c.most_common(1)[0][1] for c in moves.values()) / len(pairs))
    return shared, best


@dataclass
class Attack:
    scheme: str
    neighbours_found: float  # of the 20 codes next to one's own, how many are someone's link
    next_guessed: float  # share of codes predicted from the two before (a constant step)
    shared_chars: float
    end_predictable: float

    def row(self) -> str:
        return (
            f"{self.scheme:36} {self.neighbours_found:7.1f} of 20   {self.next_guessed:8.0%}   "
            f"{self.shared_chars:6.2f} of 7   {self.end_predictable:8.0%}"
        )


ATTACK_HEADER = f"{'scheme':36} {'neighbours':>13}   {'next code':>8}   {'shared':>11}   {'end char':>8}"


def attack(
    name: str, encode: Callable[[int], str], *, links: int = 5_000, trials: int = 200, seed: int = 12
) -> Attack:
    """How guessable is a scheme, with ``links`` links made (ids 1..links)?

    - neighbours: an attacker holds the code of one link and tries the 20 codes next to it
      in base62 order (10 below, 10 above): how many are someone else's link?
    - next code: from the codes of ids n and n+1, guess id n+2's as ``2*c(n+1) - c(n)``;
    - shared / end char: :func:`consecutive_stats` of the codes of ids 1..links.
    """
    rnd = random.Random(seed)
    codes = [encode(i) for i in range(1, links + 1)]
    real = set(codes)
    top = shortener.ID_SPACE

    def value(code: str) -> int | None:
        try:
            return shortener.unbase62(code) if len(code) == shortener.CODE_LENGTH else None
        except ValueError:
            return None

    found = 0
    for _ in range(trials):
        mine = value(codes[rnd.randrange(links)])
        if mine is None:
            continue
        near = [shortener.base62((mine + d) % top) for d in range(-10, 11) if d]
        found += sum(c in real for c in near)
    guessed = 0
    for _ in range(trials):
        n = rnd.randrange(links - 2)
        a, b = value(codes[n]), value(codes[n + 1])
        if a is not None and b is not None and shortener.base62((2 * b - a) % top) == codes[n + 2]:
            guessed += 1
    shared, end = consecutive_stats(codes)
    return Attack(name, found / trials, guessed / trials, shared, end)


async def enumeration_demo(pool, encode: Callable[[int], str], *, others: int = 25, probes: int = 10) -> dict:
    """People shorten links (some to private documents); one of them walks the codes next to
    their own and asks the database about each. Returns what the walker found."""
    made = []
    for i in range(others):
        url = (
            f"https://docs.example.com/private/{random.randrange(10**9):09d}"
            if i % 3 == 0
            else f"https://example.com/p/{i}"
        )
        made.append(await shortener.create_link(pool, url, encode=encode))
    mine = await shortener.create_link(pool, "https://example.com/mine", encode=encode)
    value = shortener.unbase62(mine["code"])
    tried = [shortener.base62((value - d) % shortener.ID_SPACE) for d in range(1, probes + 1)]
    hits = [(code, url) for code in tried if (url := await shortener.find_link(pool, code))]
    return {"mine": mine["code"], "tried": tried, "found": hits}


# ============================================================================ a gate on inserts

GATE_KEY = 1_212_012  # the advisory lock the gate waits on

INSERT_GATE = f"""
CREATE OR REPLACE FUNCTION ch12_insert_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({GATE_KEY});  -- waits while someone holds the gate
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS ch12_insert_gate ON links;
CREATE TRIGGER ch12_insert_gate BEFORE INSERT ON links FOR EACH ROW EXECUTE FUNCTION ch12_insert_gate();
"""


async def insert_gate(conn) -> None:
    """Install the gate on ``links`` (an async connection). Inserts pass freely until someone
    runs :func:`close_gate` on a connection of their own; then every insert waits, inside its
    transaction, until :func:`open_gate`."""
    await conn.execute(INSERT_GATE)


async def close_gate(conn) -> None:
    await conn.execute(f"SELECT pg_advisory_lock({GATE_KEY})")


async def open_gate(conn) -> None:
    await conn.execute(f"SELECT pg_advisory_unlock({GATE_KEY})")


async def remove_gate(conn) -> None:
    await conn.execute("DROP TRIGGER IF EXISTS ch12_insert_gate ON links")


async def waiting_on_locks(conn) -> int:
    """Sessions of this database waiting on a lock (the gate, or another insert's transaction)."""
    from course.kit.lab import LOCK_WAITERS

    cur = await conn.execute(LOCK_WAITERS)
    return (await cur.fetchone())[0]


async def alias_race(pool, watcher, create, alias: str, n: int = 10) -> list:
    """``n`` concurrent creates of one alias with the gate closed until all of them wait in
    PostgreSQL (or have finished): the race every time, not once in a while."""
    await close_gate(watcher)
    try:
        tasks = [
            asyncio.ensure_future(create(pool, f"https://example.com/{alias}/{i}", alias)) for i in range(n)
        ]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            running = sum(not t.done() for t in tasks)
            if running == 0 or await waiting_on_locks(watcher) >= running:
                break
            await asyncio.sleep(0.005)
    finally:
        await open_gate(watcher)
    return await asyncio.gather(*tasks, return_exceptions=True)


async def check_then_insert_alias(pool, url: str, alias: str) -> dict:
    """THE BUG (do not copy): look the alias up, and insert it if nobody has it."""
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT 1 FROM links WHERE code = %s", (alias,))).fetchone()
        if row is not None:
            raise shortener.AliasTaken(alias)
        await conn.execute("INSERT INTO links (code, url, custom) VALUES (%s, %s, true)", (alias, url))
    return {"code": alias, "url": url}


# ============================================================================ data for the load test


async def make_links(pool, n: int) -> dict[str, str]:
    """``n`` fresh links (ids from the sequence, codes from the shuffle) with COPY: {code: url}."""
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT nextval('link_ids') FROM generate_series(1, %s)", (n,))
        ids = [row[0] for row in await cur.fetchall()]
        rows = [(i, shortener.encode_code(i), f"https://example.com/article/{i}") for i in ids]
        async with conn.cursor() as copy_cur, copy_cur.copy("COPY links (id, code, url) FROM STDIN") as copy:
            for row in rows:
                await copy.write_row(row)
    return {code: url for _, code, url in rows}


async def warm(redis, links: dict[str, str]) -> None:
    """Fill the cache as cache-aside would after first reads (one pipeline)."""
    async with redis.pipeline(transaction=False) as pipe:
        for code, url in links.items():
            pipe.set(shortener.cache_key(code), url, px=shortener.jittered_ms(shortener.CACHE_TTL))
        await pipe.execute()


async def lookup_costs(pool, redis, code: str, n: int = 300) -> dict[str, float]:
    """Median microseconds of one lookup, one at a time: a Redis GET and the PostgreSQL SELECT.

    The two alternate, one of each per round, so a burst of load elsewhere on the machine lands on
    both alike and the ratio of the medians stays meaningful on a busy laptop."""
    calls = {
        "redis": lambda: redis.get(shortener.cache_key(code)),
        "postgres": lambda: shortener.find_link(pool, code),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            t0 = time.perf_counter()
            await call()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return {name: percentile(ms, 50) for name, ms in times.items()}


async def bytes_per_link(pool, redis, codes: list[str]) -> dict[str, float]:
    """What one link costs: PostgreSQL bytes (table and indexes, over its rows) and Redis bytes
    per cached key (``MEMORY USAGE``, averaged over ``codes``)."""
    async with pool.connection() as conn:
        row = await (
            await conn.execute(
                "SELECT pg_total_relation_size('links'), pg_relation_size('links'), count(*), "
                "avg(pg_column_size(l.*)) FROM links l"
            )
        ).fetchone()
    total, heap, count, tuple_bytes = row
    usage = [await redis.memory_usage(shortener.cache_key(c)) or 0 for c in codes]
    return {
        "rows": count,
        "postgres": total / max(count, 1),
        "heap": heap / max(count, 1),
        "tuple": float(tuple_bytes or 0),
        "redis": sum(usage) / max(len(usage), 1),
    }


# ============================================================================ the load generator


@dataclass
class LoadRun:
    """One run of :mod:`course.chapters.ch12.load`: every request, and the slices' schedule."""

    start: float
    seconds: float
    connections: int
    records: list[list]  # [start, ms, status, label, x_cache]
    slices: list[dict] = field(default_factory=list)

    def by_label(self) -> dict[str, dict]:
        labelled: dict[str, float] = Counter()
        for sl in self.slices:
            if sl["label"] != WARM_UP:
                labelled[sl["label"]] += sl["seconds"]
        out = {}
        for label, secs in labelled.items():
            mine = [r for r in self.records if r[3] == label]
            ok = [r[1] for r in mine if 200 <= r[2] < 400]
            out[label] = {
                "requests": len(mine),
                "per_s": len(ok) / secs if secs else math.nan,
                "p50": percentile(ok, 50),
                "p99": percentile(ok, 99),
                "errors": sum(not (200 <= r[2] < 500) for r in mine),
                "x_cache": Counter(r[4] or "-" for r in mine),
            }
        return out


async def _reaped(proc, seconds: float = 10.0) -> None:
    """Wait for the generator to end, never for ever: if asyncio's child watcher misses its exit
    (seen once under a loaded test run), reap it directly."""
    import os

    try:
        await asyncio.wait_for(proc.wait(), seconds)
    except TimeoutError:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(proc.pid, os.WNOHANG)


async def run_load(
    port: int,
    paths: list[str],
    slices: list[dict],
    *,
    connections: int = 16,
    seed: int = 12,
    on_ready: Callable[[float], object] | None = None,
) -> LoadRun:
    """Run the load generator in a process of its own; ``on_ready(start)`` is awaited (if it
    returns an awaitable) once its connections are open and the first slice has begun."""
    from course.chapters.ch12 import load

    spec = {"port": port, "paths": paths, "slices": slices, "connections": connections, "seed": seed}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",  # the generator needs the standard library only: no site packages, no course
        "-S",  # package to import, so it starts in a fraction of the time
        load.__file__,
        json.dumps(spec),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        limit=2**26,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not line.startswith(b"READY"):
            err = await proc.stderr.read()
            raise RuntimeError(f"the load generator did not start: {line!r} {err.decode()[-500:]}")
        if on_ready is not None:
            pending = on_ready(float(line.split()[1]))
            if asyncio.iscoroutine(pending):
                await pending
        body = await asyncio.wait_for(proc.stdout.read(), sum(s["seconds"] for s in slices) + 30)
        await _reaped(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await _reaped(proc)
    result = json.loads(body)
    return LoadRun(result["start"], result["seconds"], result["connections"], result["records"], slices)


WARM_UP = "warm-up"


def alternating(
    labels: dict[str, dict], seconds: float, every: float = 0.5, warm_up: float = 0.3
) -> list[dict]:
    """Slices of ``every`` seconds cycling through ``labels`` ({label: headers}) for ``seconds``,
    after a ``warm_up`` slice (new connections, first requests) that the statistics leave out."""
    names = list(labels)
    count = max(len(names), round(seconds / every))
    first = [{"label": WARM_UP, "seconds": warm_up, "headers": labels[names[0]]}] if warm_up else []
    return first + [
        {"label": names[i % len(names)], "seconds": every, "headers": labels[names[i % len(names)]]}
        for i in range(count)
    ]


PATHS = {"cache": {}, "database": {"Cache-Control": "no-cache"}}


async def measure_paths(
    port: int, codes: list[str], *, connections=(1, 32), seconds: float = 4.0
) -> dict[int, LoadRun]:
    """Redirects from the cache against from PostgreSQL, alternating every half second, at each
    number of connections. The service must run with ``honor_no_cache=True``."""
    paths = [f"/{c}" for c in codes]
    return {
        n: await run_load(port, paths, alternating(PATHS, seconds), connections=n, seed=n)
        for n in connections
    }


def plot_paths(runs: dict[int, LoadRun]):
    """Left: redirects per 100 ms through the run with the most connections, by slice.
    Right: throughput and p50/p99 of each path at each number of connections."""
    from course.kit import plotting

    colors = {"cache": plotting.COLORS["ok"], "database": plotting.COLORS["fix"]}
    fig, (ax, bx, cx) = plotting.figure(13, 3.2, ncols=3, width_ratios=[2.2, 1, 1.3])
    busiest = runs[max(runs)]
    buckets: dict[tuple[int, str], int] = Counter()
    for start, _ms, status, label, _x in busiest.records:
        if 200 <= status < 400 and label != WARM_UP:
            buckets[(int((start - busiest.start) * 10), label)] += 1
    for label, color in colors.items():
        xs = sorted(b for b, lab in buckets if lab == label)
        ax.bar(
            [x / 10 for x in xs], [buckets[(x, label)] * 10 for x in xs], width=0.1, color=color, label=label
        )
    ax.set(
        xlabel="seconds into the run",
        ylabel="redirects / s",
        title=f"{max(runs)} connections, paths alternating",
    )
    plotting.legend_outside(ax, "below")
    names = list(colors)
    conns = sorted(runs)
    width = 0.8 / len(names)
    for i, label in enumerate(names):
        stats = [runs[n].by_label()[label] for n in conns]
        xs = [j + i * width for j in range(len(conns))]
        bx.bar(xs, [s["per_s"] for s in stats], width=width, color=colors[label], label=label)
        cx.bar(xs, [s["p50"] for s in stats], width=width, color=colors[label], label=f"{label} p50")
        cx.scatter(
            xs,
            [s["p99"] for s in stats],
            color="black",
            marker="_",
            s=200,
            zorder=3,
            label="p99" if i else None,
        )
    for axis, title in ((bx, "redirects / s"), (cx, "latency (ms)")):
        axis.set_xticks(
            [j + width * (len(names) - 1) / 2 for j in range(len(conns))], [f"{n} conn." for n in conns]
        )
        axis.set_title(title)
    cx.set_yscale("log")
    plotting.legend_outside(cx)
    return fig


# ============================================================================ Redis killed mid-load


class DemoRedis:
    """A redis-server of the demo's own (not the course's shared one), in a watched folder:
    :meth:`kill` sends SIGKILL, :meth:`restart` starts an empty one on the same socket."""

    def __init__(self) -> None:
        self.run = backends.new_run_dir("ch12-")
        self.proc, self.url = backends.start_redis(self.run / "redis", databases=1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        self.proc, url = backends.start_redis(self.run / "redis", databases=1)
        assert url == self.url, (url, self.url)

    def stop(self) -> None:
        backends.stop_embedded(self.run, redis_proc=self.proc)

    def __enter__(self) -> DemoRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class OutageRun:
    label: str
    load: LoadRun
    down: tuple[float, float]  # seconds into the run
    transitions: list[tuple[float, str]]  # the breaker's, seconds into the run
    clicks: dict

    def summary(self) -> str:
        recs = self.load.records
        lo, hi = self.down
        during = [r for r in recs if lo <= r[0] - self.load.start < hi]
        ok = sum(200 <= r[2] < 400 for r in during)
        where = Counter(r[4] or "-" for r in during if 200 <= r[2] < 400)
        fails = Counter(r[2] for r in during if not 200 <= r[2] < 400)
        return (
            f"{self.label}: {len(recs)} redirects; while Redis was dead:\n"
            f"  {ok} answered ({', '.join(f'{n} {k}' for k, n in where.most_common()) or 'none'}), "
            f"{sum(fails.values())} failed ({', '.join(f'{n} x {k}' for k, n in fails.most_common()) or 'none'})"
        )


async def outage_run(
    database_url: str,
    links: dict[str, str],
    *,
    label: str,
    resolve=shortener.resolve,
    seconds: float = 6.0,
    down: tuple[float, float] = (2.0, 4.0),
    connections: int = 8,
    key_prefix: str = "",
    breaker_band: bool = True,
) -> OutageRun:
    """The service on a Redis of its own; the load generator runs for ``seconds``; the Redis is
    killed (SIGKILL) at ``down[0]`` and an empty one started at ``down[1]``. ``breaker_band``:
    keep the breaker's transitions for the plot (a ``resolve`` that does not use it: False)."""
    import httpx

    from course import shortener_app
    from course.kit.serve import Service

    with DemoRedis() as demo:
        warm_client = shortener_app.redis_client(demo.url, timeout=2.0)
        try:
            await warm(warm_client, links)
        finally:
            await warm_client.aclose()
        app = shortener_app.make_app(
            database_url, demo.url, key_prefix=key_prefix, resolve=resolve, breaker_cooldown=0.5
        )
        svc = Service(app, name=f"shortener-outage-{label}").start()
        try:

            async def faults(start: float) -> None:
                async def at(offset: float, action) -> None:
                    await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
                    await asyncio.to_thread(action)

                asyncio.ensure_future(at(down[0], demo.kill))
                asyncio.ensure_future(at(down[1], demo.restart))

            load = await run_load(
                svc.port,
                [f"/{c}" for c in links],
                [{"label": label, "seconds": seconds}],
                connections=connections,
                on_ready=faults,
            )
            async with httpx.AsyncClient(base_url=svc.url) as http:
                health = (await http.get("/api/health")).json()
        finally:
            await asyncio.to_thread(svc.stop)
    transitions = [(t - load.start, s) for t, s in health["transitions"]] if breaker_band else []
    clicks = {**health["clicks"], **getattr(app.state, "shutdown", {})}
    return OutageRun(label, load, down, transitions, clicks)


def plot_outages(runs: list[OutageRun]):
    """One panel per run: every request's latency over time, by where it was served from, and a
    band on top with the Redis breaker's state (a half-open probe lasts milliseconds: it is
    drawn at least 1.5% of the axis wide so it can be seen)."""
    from matplotlib.patches import Patch
    from matplotlib.ticker import LogFormatter

    from course.breaker import CLOSED, HALF_OPEN, OPEN
    from course.kit import plotting

    band = {
        CLOSED: ("breaker closed", plotting.COLORS["ok"]),
        OPEN: ("breaker open", plotting.COLORS["bad"]),
        HALF_OPEN: ("breaker half-open (a probe)", plotting.COLORS["warn"]),
    }
    fig, axes = plotting.figure(13, 2.8 * len(runs), nrows=len(runs), sharex=True)
    axes = list(axes) if len(runs) > 1 else [axes]
    kinds = {
        "hit": ("from Redis", plotting.COLORS["ok"]),
        "miss": ("from PostgreSQL", plotting.COLORS["fix"]),
        "error": ("failed (5xx)", plotting.COLORS["bad"]),
    }
    for ax, run in zip(axes, runs, strict=True):
        for kind, (name, color) in kinds.items():
            pts = [
                (r[0] - run.load.start, max(r[1], 0.05))
                for r in run.load.records
                if (kind == "error" and not 200 <= r[2] < 400) or (200 <= r[2] < 400 and r[4] == kind)
            ]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.scatter(xs, ys, s=4, color=color, label=f"{name} ({len(pts)})", rasterized=True)
        ax.axvspan(*run.down, color=plotting.COLORS["bad"], alpha=0.08, label="Redis dead")
        ends = [t for t, _ in run.transitions[1:]] + [run.load.seconds]
        least = 0.015 * run.load.seconds
        spans = list(zip(run.transitions, ends[: len(run.transitions)], strict=True))
        for (t, state), t_next in sorted(spans, key=lambda span: span[0][1] == HALF_OPEN):  # probes on top
            start = max(t, 0)
            width = max(t_next - start, least if state == HALF_OPEN else 0)
            ax.axvspan(start, start + width, ymin=0.93, ymax=1.0, color=band[state][1], zorder=3)
        seen = {state for _, state in run.transitions}
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * 1.6)  # room above the points for the band
        ax.yaxis.set_major_formatter(LogFormatter())  # 20, 50, 100: no 4x10^2 on a short axis
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.set_ylabel("latency (ms)")
        ax.set_title(run.summary(), fontsize=9, loc="left")
        handles, labels = ax.get_legend_handles_labels()
        handles += [
            Patch(color=band[s][1], label=f"top band: {band[s][0]}")
            for s in (CLOSED, OPEN, HALF_OPEN)
            if s in seen
        ]
        plotting.legend_outside(ax, handles=handles, markerscale=3)
    axes[-1].set_xlabel("seconds into the run")
    return fig


async def naive_resolve(code: str, redis, pool, breaker) -> str | None:
    """Cache-aside without a breaker or a fallback (do not copy): Redis down, redirect down."""
    cached = await redis.get(shortener.cache_key(code))
    if cached is not None:
        shortener.SERVED_FROM.set("cache")
        return cached or None
    url = await shortener.find_link(pool, code)
    shortener.SERVED_FROM.set("database")
    await redis.set(shortener.cache_key(code), url or shortener.MISS, px=int(shortener.MISS_TTL * 1000))
    return url


async def clicks_in_database(pool, codes: list[str]) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT coalesce(sum(clicks), 0) FROM link_clicks WHERE code = ANY(%s)", (codes,)
        )
        return int((await cur.fetchone())[0])


# The printed tables, in a module of their own (this one is about the runs)
from course.chapters.ch12 import overload as _overload  # noqa: E402
from course.chapters.ch12 import tables as _tables  # noqa: E402 - after si and LoadRun, which it uses

sampling_demo = _overload.sampling_demo
estimate_lines = _tables.estimate_lines
path_lines = _tables.path_lines
