"""Chapter 13's demos: the failures shown live, the measurements and their plots.

Nothing here is a pattern to reuse (that is :mod:`course.leaderboard`): these are the wrong
designs the chapter breaks on purpose, the loads it generates and the numbers it measures.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import shutil
import socket
import statistics
import subprocess
import time
from urllib.parse import parse_qs, urlsplit

from course import leaderboard as lb
from course.kit.stats import percentile

BOARD = lb.BOARD
REGIONS = ("eu", "us", "asia")


# ============================================================================ wrong designs, on purpose


async def record_naive(pool, r, event: dict) -> None:
    """Add the points everywhere, every time: no event id, raw points on the board (ZINCRBY)."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (player) DO UPDATE SET points = s.points + EXCLUDED.points",
            (event["player"], event["points"], event["at"]),
        )
    await r.zincrby(BOARD, event["points"], event["player"])


async def record_then_write(pool, r, event: dict, *, pause: float = 0.0, gt: bool = False) -> None:
    """Claim and add in PostgreSQL, commit, wait ``pause`` seconds (a GC pause, a slow network), then ZADD."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
            (event["event_id"], event["player"], event["points"], event["at"]),
        )
        if await cur.fetchone() is None:
            return
        cur = await conn.execute(lb.ADD_POINTS, (event["player"], event["points"], event["at"]))
        total = await cur.fetchone()
    await asyncio.sleep(pause)
    await r.zadd(BOARD, {event["player"]: lb.encode(*total)}, gt=gt)


async def rebuild_aside(pool, r, *, page: int = 5000) -> int:
    """Build the board under another key, then RENAME it over the live one (atomic, and wrong)."""
    scratch = f"{BOARD}:rebuilding"
    await r.unlink(scratch)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT player, points, reached_at FROM leaderboard_scores")
        rows = await cur.fetchall()
    for k in range(0, len(rows), page):
        await r.zadd(scratch, {p: lb.encode(pts, at) for p, pts, at in rows[k : k + page]})
    if rows:
        await r.rename(scratch, BOARD)
    return len(rows)


def first_of_each(local_tops, n: int) -> list[tuple[str, float]]:
    """The tempting merge: every shard's winner, best first."""
    return sorted((top[0] for top in local_tops if top), key=lambda e: (e[1], e[0]), reverse=True)[:n]


# ============================================================================ data


async def add_players(pool, upto: int, *, start: int = 0, seed: float = 0.13) -> None:
    """Players ``start`` to ``upto - 1`` straight into ``leaderboard_scores`` (a long-tailed spread of points)."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("SELECT setseed(%s)", (seed + start / 1e9,))
        await conn.execute(
            "INSERT INTO leaderboard_scores (player, points, reached_at) "
            "SELECT 'p' || lpad(g::text, 7, '0'), floor(100000 * power(random(), 3))::bigint, "
            "floor(random() * 30000000)::bigint FROM generate_series(%s::bigint, %s::bigint) g",
            (start, upto - 1),
        )


async def postgres_board(pool) -> dict[str, int]:
    """What the board should hold: every player's encoded total, from PostgreSQL."""
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT player, points, reached_at FROM leaderboard_scores")
        return {p: lb.encode(pts, at) for p, pts, at in await cur.fetchall()}


async def board(r, key: str = BOARD) -> dict[str, int]:
    return {m: int(s) for m, s in await r.zrange(key, 0, -1, withscores=True)}


def behind(on_board: dict[str, int], truth: dict[str, int]) -> int:
    """Players whose board score is missing or lower than PostgreSQL's."""
    return sum(on_board.get(p, -1) < s for p, s in truth.items())


def random_events(n: int, *, players: int, prefix: str, seed: int, at: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"event_id": f"{prefix}-{i}", "player": f"p{rng.randrange(players):07d}", "points": rng.randint(1, 50),
         "at": at + i // 100}
        for i in range(n)
    ]  # fmt: skip


# ============================================================================ rebuilding


class _GameBetweenWrites:
    """``r`` as a rebuild sees it, with the game going on: before each of the rebuild's board
    writes (``ZADD``, ``RENAME``), the game records one more batch of events into the live
    board. Every rebuild meets events that arrive while it runs, on every run, however fast
    the machine: no timing decides what the demo shows."""

    def __init__(self, r, step) -> None:
        self._r, self._step = r, step

    def __getattr__(self, name: str):
        attr = getattr(self._r, name)
        if name not in ("zadd", "rename"):
            return attr

        async def after_a_batch(*args, **kwargs):
            await self._step()
            return await attr(*args, **kwargs)

        return after_a_batch


async def rebuild_during_play(pool, r, rebuild, *, seconds_cap: float = 10.0, batch: int = 200) -> dict:
    """Wipe the board, then run ``rebuild`` while the game records a batch of events before
    each of its board writes (the events go through ``lb.record_batch`` into the live board)."""
    await r.unlink(BOARD)
    events = iter(
        random_events(4_000, players=30_000, prefix=f"play{time.monotonic_ns()}", seed=7, at=40_000_000)
    )
    recorded = 0

    async def step() -> None:
        nonlocal recorded
        chunk = [e for _, e in zip(range(batch), events, strict=False)]
        recorded += await lb.record_batch(pool, r, chunk)

    started = time.perf_counter()
    await asyncio.wait_for(rebuild(pool, _GameBetweenWrites(r, step)), seconds_cap)
    seconds = time.perf_counter() - started
    truth = await postgres_board(pool)
    return {
        "seconds": seconds,
        "events": recorded,
        "behind": behind(await board(r), truth),
        "players": len(truth),
    }


async def time_rebuilds(pool, r, sizes: list[int], *, budget: float = 15.0, repeat: int = 2) -> list[dict]:
    """Rebuild time and Redis memory per player for growing boards (players added between runs).

    Each board is rebuilt ``repeat`` times and the fastest kept: one rebuild of a small board
    lasts a fraction of a second, and a burst of load elsewhere on a busy machine would otherwise
    decide how the cost per player seems to grow. A size whose predicted time (linear in the
    players, from the runs so far) would take the total past ``budget`` seconds is skipped and
    reported with ``"skipped": predicted seconds`` (the time of one rebuild).
    """
    await lb.reset(pool, r, BOARD)
    results, have, spent = [], 0, 0.0
    seed_rate = rebuild_rate = 0.0  # seconds per player, from the runs so far
    for size in sizes:
        if results:
            predicted = seed_rate * (size - have) + repeat * rebuild_rate * size
            if spent + predicted > budget:
                results.append({"players": size, "skipped": rebuild_rate * size})
                continue
        started = time.perf_counter()
        await add_players(pool, size, start=have)
        seed_rate = (time.perf_counter() - started) / (size - have)
        have = size
        seconds = math.inf
        for _ in range(repeat):
            await r.unlink(BOARD)
            began = time.perf_counter()
            written = await lb.rebuild(pool, r)
            seconds = min(seconds, time.perf_counter() - began)
        rebuild_rate = seconds / max(written, 1)
        memory = await r.memory_usage(BOARD) or 0
        spent += time.perf_counter() - started
        results.append({"players": written, "seconds": seconds, "bytes_per_player": memory / max(written, 1)})
    return results


# ============================================================================ reads


async def read_latencies(pool, r, samples: int = 200) -> dict[str, list[float]]:
    """Milliseconds per read: top 100 and one rank, from Redis and from PostgreSQL."""
    rng = random.Random(3)
    players = await r.zrandmember(BOARD, 500)
    out: dict[str, list[float]] = {
        "Redis top 100": [],
        "Redis rank": [],
        "PostgreSQL top 100": [],
        "PostgreSQL rank": [],
    }

    async def timed(name, coro):
        started = time.perf_counter()
        await coro
        out[name].append((time.perf_counter() - started) * 1000)

    for i in range(samples):
        player = rng.choice(players)
        await timed("Redis top 100", r.zrevrange(BOARD, 0, 99, withscores=True))
        await timed("Redis rank", r.zrevrank(BOARD, player))
        if i % 5 == 0:  # PostgreSQL's rank scans; fewer samples keep the demo quick
            await timed("PostgreSQL top 100", lb.top_from_postgres(pool, 100))
            await timed("PostgreSQL rank", _postgres_rank(pool, player))
    return out


def top_reads(latencies: dict[str, list[float]], server_us: float) -> str:
    """Which served the top 100 sooner from Python on this run, Redis or PostgreSQL, in a sentence.

    Redis's own work on the read is microseconds; what the caller waits for is mostly the round
    trip and the client: redis-py (without hiredis) parses the 200-item reply in Python, while
    psycopg decodes rows in C. So at this size PostgreSQL's index can come back sooner from Python,
    and a page that said "Redis is faster" would read the opposite of some runs' numbers.
    """
    import textwrap

    from course.kit.stats import percentile

    redis_ms = percentile(latencies["Redis top 100"], 50)
    pg_ms = percentile(latencies["PostgreSQL top 100"], 50)
    own = f"Redis's own work was {server_us / 1000:.2f} ms of it"
    if redis_ms <= pg_ms:
        said = (
            f"from Python, Redis's top 100 came back sooner at the median: {redis_ms:.2f} ms against "
            f"PostgreSQL's {pg_ms:.2f} ms; {own}, the rest is the round trip and the client"
        )
    else:
        said = (
            f"from Python, PostgreSQL's top 100 came back sooner at the median on this run: {pg_ms:.2f} ms "
            f"against Redis's {redis_ms:.2f} ms, though {own}: the rest is the round trip and redis-py "
            "parsing the 200-item reply in Python (psycopg decodes its rows in C)"
        )
    return textwrap.fill(said, 104, subsequent_indent="  ")


async def _postgres_rank(pool, player: str) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT 1 + count(*) FROM leaderboard_scores s, "
            "(SELECT points, reached_at, player FROM leaderboard_scores WHERE player = %s) me "
            "WHERE s.points > me.points OR (s.points = me.points AND s.reached_at < me.reached_at) "
            "OR (s.points = me.points AND s.reached_at = me.reached_at AND s.player > me.player)",
            (player,),
        )
        return (await cur.fetchone())[0]


# ============================================================================ throughput


async def updates_per_second(
    pool, r, *, events: int, workers: int = 16, batch: int = 500
) -> dict[str, float]:
    """Score updates per second through the course's code: one event per transaction, and batched."""
    stamp = time.monotonic_ns()
    one = random_events(events, players=10_000, prefix=f"one{stamp}", seed=1)
    queue = iter(one)

    async def worker() -> None:
        for event in queue:
            await lb.record(pool, r, event)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    single = events / (time.perf_counter() - started)

    many = random_events(events * 10, players=10_000, prefix=f"many{stamp}", seed=2)
    started = time.perf_counter()
    for k in range(0, len(many), batch):
        await lb.record_batch(pool, r, many[k : k + batch])
    batched = len(many) / (time.perf_counter() - started)
    return {f"record, {workers} at once": single, f"record_batch of {batch}": batched}


async def zadd_per_second(r, *, n: int, depth: int = 1000) -> dict[str, float]:
    """ZADDs per second from redis-py: one round trip each, then pipelined ``depth`` at a time."""
    key = f"{BOARD}:bench"
    await r.unlink(key)
    started = time.perf_counter()
    for i in range(n // 10):
        await r.zadd(key, {f"m{i}": i})
    one_by_one = (n // 10) / (time.perf_counter() - started)
    started = time.perf_counter()
    for k in range(0, n, depth):
        pipe = r.pipeline(transaction=False)
        for i in range(k, min(k + depth, n)):
            pipe.zadd(key, {f"m{i}": i})
        await pipe.execute()
    pipelined = n / (time.perf_counter() - started)
    await r.unlink(key)
    return {"ZADD, one round trip each": one_by_one, f"ZADD, pipelined {depth} deep": pipelined}


def _connect(url: str) -> tuple[socket.socket, int, str | None]:
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme == "unix":
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(parts.path)
        db = int(query.get("db", ["0"])[0])
    else:
        sock = socket.create_connection((parts.hostname or "localhost", parts.port or 6379))
        db = int((parts.path or "/0").strip("/") or 0)
    return sock, db, parts.password


def _command(*args) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def raw_zadd_loop(url: str, *, n: int = 400_000, depth: int = 128, members: int = 100_000) -> float:
    """The server's own speed: ZADDs per second from a bare socket, ``depth`` commands per write.

    What ``redis-benchmark -t zadd -P depth`` does: no client library, the commands prebuilt,
    the replies only counted. Sync and blocking: run it in a thread.
    """
    sock, db, password = _connect(url)
    try:
        setup = (_command("AUTH", password) if password else b"") + _command("SELECT", db)
        sock.sendall(setup)
        _read_replies(sock, 2 if password else 1)
        key = f"{BOARD}:raw"
        chunks = [
            b"".join(
                _command("ZADD", key, (j * 7919) % 1_000_003, f"m{j % members}") for j in range(k, k + depth)
            )
            for k in range(0, members, depth)
        ]
        sent = 0
        started = time.perf_counter()
        while sent < n:
            sock.sendall(chunks[(sent // depth) % len(chunks)])
            _read_replies(sock, depth)
            sent += depth
        seconds = time.perf_counter() - started
        sock.sendall(_command("UNLINK", key))
        _read_replies(sock, 1)
        return sent / seconds
    finally:
        sock.close()


def _read_replies(sock: socket.socket, count: int) -> None:
    """Read ``count`` one-line replies (``:1``, ``+OK``); an error reply raises."""
    seen, tail = 0, b""
    while seen < count:
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("Redis closed the connection")
        if b"-" in data and re.search(rb"(^|\r\n)-", tail + data):
            raise RuntimeError(f"Redis answered an error: {(tail + data)[:200]!r}")
        seen += data.count(b"\r\n")
        tail = data[-2:]


def redis_benchmark(url: str, *, n: int = 400_000, depth: int = 128) -> float | None:
    """ZADDs per second from ``redis-benchmark`` (Debian's redis-tools), if it is installed."""
    tool = shutil.which("redis-benchmark")
    if tool is None:
        return None
    parts = urlsplit(url)
    if parts.scheme == "unix":
        where = ["-s", parts.path]
        db = parse_qs(parts.query).get("db", ["0"])[0]
    else:
        where = ["-h", parts.hostname or "localhost", "-p", str(parts.port or 6379)]
        db = (parts.path or "/0").strip("/") or "0"
    if parts.password:
        where += ["-a", parts.password]
    proc = subprocess.run(
        [tool, *where, "--dbnum", str(db), "-t", "zadd", "-n", str(n), "-P", str(depth), "-r", "100000", "-q"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r"ZADD: ([\d.]+) requests per second", proc.stdout)
    return float(found.group(1)) if found else None


async def command_stats(r, command: str) -> tuple[int, int]:
    """``(calls, microseconds)`` the server has spent on ``command`` so far (``INFO commandstats``)."""
    stats = (await r.info("commandstats")).get(f"cmdstat_{command.lower()}", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


# ============================================================================ shards and the long tail


async def fill_shards(r, per_shard: int, *, seed: int = 5) -> list[str]:
    """One board per region, ``per_shard`` players each (points drawn from one long-tailed spread)."""
    rng = random.Random(seed)
    keys = []
    for region in REGIONS:
        key = f"{BOARD}:{region}"
        await r.unlink(key)
        entries = [
            (f"{region}-{i:06d}", lb.encode(int(100_000 * rng.random() ** 3), rng.randrange(30_000_000)))
            for i in range(per_shard)
        ]
        for k in range(0, per_shard, 10_000):
            await r.zadd(key, dict(entries[k : k + 10_000]))
        keys.append(key)
    return keys


async def union_top(r, keys: list[str], n: int) -> list[tuple[str, float]]:
    """The global top n the expensive way: every shard copied into one board (ZUNIONSTORE)."""
    scratch = f"{BOARD}:union"
    await r.zunionstore(scratch, keys, aggregate="MAX")
    try:
        return await r.zrevrange(scratch, 0, n - 1, withscores=True)
    finally:
        await r.unlink(scratch)


async def rank_estimates(pool, r, width: int, sample: int = 400) -> list[tuple[int, int]]:
    """``(exact rank, estimated rank)`` for players from the top to the bottom of the board.

    Positions are spread evenly on a log scale (the top is where estimates are hardest); the
    exact rank is the position, the estimate comes from a histogram of ``width``-point bands.
    """
    histogram = await lb.score_histogram(pool, width)
    total = await r.zcard(BOARD)
    positions = sorted({min(total - 1, int(total ** (k / (sample - 1))) - 1) for k in range(sample)})
    pipe = r.pipeline(transaction=False)
    for i in positions:
        pipe.zrevrange(BOARD, i, i, withscores=True)
    replies = await pipe.execute()
    return [
        (i + 1, lb.approximate_rank(histogram, width, lb.decode(reply[0][1])[0]))
        for i, reply in zip(positions, replies, strict=True)
        if reply
    ]


# ============================================================================ plots


def rebuild_growth(results: list[dict]) -> tuple[str, str, bool]:
    """The claim that a rebuild's cost per player grows far slower than the board (a ZADD costs
    O(log N), not O(N)), what this run measured (the cost per player at the smallest and the
    largest board rebuilt), and whether it held: ``(claim, measured, held)`` for
    :func:`course.kit.claims.check`.

    The bar is half the board's growth: log N predicts a few tens of percent, but the largest
    boards outgrow the CPU's caches and a busy machine slows one rebuild more than another (a
    loaded test run measured 2.04x from 5,000 to 40,000 players), while a cost per write that grew
    with N would grow as fast as the board.
    """
    claim = "the cost per player grows far slower than the board (O(log N) per ZADD, not O(N)): under half as fast"
    measured = [x for x in results if "seconds" in x]
    if len(measured) < 2:
        return claim, "one size rebuilt: nothing to compare", False
    first, last = (x["seconds"] / x["players"] * 1e6 for x in (measured[0], measured[-1]))
    board = measured[-1]["players"] / measured[0]["players"]
    sizes = f"{measured[0]['players']:,} -> {measured[-1]['players']:,} players, {board:g}x"
    return (
        claim,
        f"{first:.1f} -> {last:.1f} µs per player ({last / first:.2f}x; the board {sizes})",
        last / first < board / 2,
    )


def plot_rebuilds(results: list[dict], extrapolate_to: int = 100_000_000):
    """Rebuild seconds by board size, and the line at the largest board's cost per player (the
    extrapolation: a floor when the cost per player still grows). Returns (fig, seconds at
    ``extrapolate_to`` players at that rate)."""
    from course.kit import plotting

    results = [x for x in results if "seconds" in x]
    sizes = [x["players"] for x in results]
    seconds = [x["seconds"] for x in results]
    per_player = seconds[-1] / sizes[-1]
    fig, ax = plotting.figure(7.5, 3.2)
    ax.plot(sizes, seconds, "o-", color=plotting.COLORS["fix"], label="measured here")
    ax.plot([0, *sizes], [0, *(s * per_player for s in sizes)], ":", color=plotting.COLORS["neutral"],
            label=f"the largest board's rate: {per_player * 1e6:.1f} µs per player")  # fmt: skip
    ax.set(
        xlabel="players on the board", ylabel="rebuild seconds", title="Rebuilding the board from PostgreSQL"
    )
    ax.ticklabel_format(axis="x", style="plain")
    ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1e6:g} M" if x >= 1e6 else f"{x / 1e3:g} k")
    plotting.legend_outside(ax)
    return fig, per_player * extrapolate_to


def plot_reads(latencies: dict[str, list[float]], budget_ms: float = 10.0):
    from course.kit import plotting

    names = list(latencies)
    p50 = [percentile(latencies[k], 50) for k in names]
    p99 = [percentile(latencies[k], 99) for k in names]
    fig, ax = plotting.figure(7.5, 2.8)
    y = range(len(names))
    ax.barh([i - 0.2 for i in y], p50, height=0.4, color=plotting.COLORS["fix"], label="p50")
    ax.barh([i + 0.2 for i in y], p99, height=0.4, color=plotting.COLORS["warn"], label="p99")
    ax.axvline(budget_ms, color=plotting.COLORS["bad"], linestyle="--", label=f"budget: {budget_ms:g} ms")
    ax.set_yticks(list(y), names)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set(xlabel="milliseconds (log scale)", title="Reading the board")
    plotting.legend_outside(ax)
    return fig


def plot_throughput(rates: dict[str, float], target: float = 10_000):
    from matplotlib.patches import Patch

    from course.kit import plotting

    names = [f"{name}: {v:,.0f}/s" for name, v in rates.items()]  # the values beside the names, off the bars
    fig, ax = plotting.figure(9, 0.45 * len(names) + 1.2)
    colors = [plotting.COLORS["ok"] if v >= target else plotting.COLORS["bad"] for v in rates.values()]
    ax.barh(names, list(rates.values()), color=colors)
    ax.axvline(
        target, color=plotting.COLORS["neutral"], linestyle="--", label=f"peak to carry: {target:,.0f}/s"
    )
    ax.set_xscale("log")
    ax.set_xlim(right=max(rates.values()) * 2)
    ax.invert_yaxis()
    handles = [
        ax.get_legend_handles_labels()[0][0],
        Patch(color=plotting.COLORS["ok"], label="carries the peak"),
        Patch(color=plotting.COLORS["bad"], label="does not"),
    ]
    plotting.legend_outside(ax, handles=handles)
    ax.set(
        xlabel="score updates per second (log scale)",
        title="Throughput: the course's code and the raw server",
    )
    return fig


def rank_errors(pairs: list[tuple[int, int]]) -> dict[str, tuple[float, float, int]]:
    """``{part of the board: (median error %, worst error %, players)}`` for the top 100, the
    ranks from 100 to half the board, and the bottom half."""
    total = max(exact for exact, _ in pairs)
    parts = {
        "the top 100": lambda a: a <= 100,
        f"ranks 100 to {total // 2:,}": lambda a: 100 < a <= total // 2,
        "the bottom half": lambda a: a > total // 2,
    }
    out = {}
    for name, inside in parts.items():
        errors = [abs(e - a) / a * 100 for a, e in pairs if inside(a)]
        if errors:
            out[name] = (statistics.median(errors), max(errors), len(errors))
    return out


def plot_rank_estimates(pairs: list[tuple[int, int]], width: int):
    """Each estimate's error against the exact rank, both on log scales; an exact estimate
    (error 0) is drawn on the bottom line, in its own colour."""
    from course.kit import plotting

    floor = 0.01  # percent: where an exact estimate is drawn on the log scale
    errors = [abs(e - a) / a * 100 for a, e in pairs]
    off = [(a, err) for (a, _), err in zip(pairs, errors, strict=True) if err > 0]
    exact = [a for (a, _), err in zip(pairs, errors, strict=True) if err == 0]
    median = statistics.median(errors)
    fig, ax = plotting.figure(7.5, 3.0)
    ax.scatter(
        *zip(*off, strict=True), s=8, color=plotting.COLORS["fix"], label=f"{width}-point bands: off by"
    )
    if exact:
        ax.scatter(exact, [floor] * len(exact), s=8, color=plotting.COLORS["ok"],
                   label=f"exact ({len(exact)}), drawn at {floor}%")  # fmt: skip
    ax.axhline(max(median, floor), color=plotting.COLORS["warn"], linestyle="--", linewidth=1.5,
               label=f"median error: {median:.2f}%")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, max(errors) * 2)
    ax.yaxis.set_major_formatter(lambda y, _: f"{y:g}%")
    ax.set(
        xlabel="exact rank (log scale)",
        ylabel="estimate off by (log scale)",
        title="Approximate rank for the long tail",
    )
    plotting.legend_outside(ax)
    return fig


# ============================================================================ the live page


async def play(pool, r, *, seconds: float, key: str = BOARD, per_tick: int = 6, tick: float = 0.1) -> int:
    """Score events for a handful of players, ``per_tick`` every ``tick`` seconds, into the
    board ``key`` through ``record_batch``: the board moves. Returns the events recorded."""
    from course.chapters.ch13.live import game_events

    recorded = 0
    ticks = game_events(per_tick)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        recorded += await lb.record_batch(pool, r, next(ticks), key=key)
        await asyncio.sleep(tick)
    return recorded


async def read_stream(url: str, frames: int, *, path: str = "/events", timeout: float = 10.0) -> list[str]:
    """The raw lines a browser receives from the stream, until ``frames`` events have arrived."""
    import httpx

    lines: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http, http.stream("GET", path) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            lines.append(line)
            if sum(x.startswith("data:") for x in lines) >= frames:
                break
    return lines
