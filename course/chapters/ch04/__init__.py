"""Chapter 04 (caching, stampedes and invalidation): the chapter's tables and what the notebook measures.

The caches themselves (cache-aside, read-through, write-through, write-behind,
single-flight, the Redis lock, serve-stale, early expiration, versioned writes, the
near cache, replicated hot keys) are :mod:`course.caching`; this package holds what
exists to show them.

The chapter's tables count their own queries on the database side, so a demo or a check
never has to trust the code it measures:

- ``ch04_products`` is read through ``slow_product(id, seconds)``, which logs every call in
  ``ch04_query_log`` (with start and end times) and can sleep inside PostgreSQL;
- ``users`` (the graded task's table) is a view whose every query adds a row to
  ``user_reads``; the rows themselves live in ``user_rows``;
- ``ch04_orders`` is where the write-behind demo's flushes land.

Then the experiments: :func:`stampede` and :func:`steady_traffic` (one process; a
:class:`Run` each, drawn by :func:`plot_runs`), :func:`penetration`, the avalanche
helpers, :func:`prewarm` and :func:`read_then_set_race`. The ones that need other
processes (a fleet of workers, a crash) are in :mod:`course.chapters.ch04.processes`; the
ones around an outage (fencing tokens, stale-if-error, a cold restart) in
:mod:`course.chapters.ch04.outages`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from course.caching import (
    MISSING,
    CacheAside,
    EarlyExpiry,
    Loader,
    ServeStale,
    jittered_ms,
    to_json,
    versioned_get,
    versioned_set,
)

# ============================================================================ the chapter's tables

CATALOG_SCHEMA = """
CREATE TABLE IF NOT EXISTS ch04_products (
    id          bigint PRIMARY KEY,
    name        text   NOT NULL,
    price_cents int    NOT NULL,
    version     int    NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS ch04_query_log (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    what        text        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at timestamptz
);
CREATE TABLE IF NOT EXISTS ch04_orders (
    id           text PRIMARY KEY,
    amount_cents int  NOT NULL
);
CREATE OR REPLACE FUNCTION slow_product(p_id bigint, p_seconds double precision) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    log_id bigint;
    result jsonb;
BEGIN
    INSERT INTO ch04_query_log (what) VALUES ('product:' || p_id) RETURNING id INTO log_id;
    IF p_seconds > 0 THEN
        PERFORM pg_sleep(p_seconds);
    END IF;
    SELECT to_jsonb(p) INTO result
      FROM (SELECT id, name, price_cents, version FROM ch04_products WHERE id = p_id) AS p;
    UPDATE ch04_query_log SET finished_at = clock_timestamp() WHERE id = log_id;
    RETURN result;
END $$;
"""

USERS_SCHEMA = """
CREATE TABLE IF NOT EXISTS user_rows (
    id    bigint PRIMARY KEY,
    name  text   NOT NULL,
    email text   NOT NULL
);
CREATE TABLE IF NOT EXISTS user_reads (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION read_users() RETURNS SETOF user_rows LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO user_reads DEFAULT VALUES;  -- one row per query that reads users
    RETURN QUERY SELECT * FROM user_rows;
END $$;
CREATE OR REPLACE VIEW users AS SELECT * FROM read_users();
"""


async def setup_catalog(pool, products: int = 100) -> None:
    """Create ``ch04_products`` (ids 1..products), ``ch04_query_log``, ``ch04_orders`` and ``slow_product`` (async: await it)."""
    async with pool.connection() as conn:
        await conn.execute(CATALOG_SCHEMA)
        await conn.execute(
            "INSERT INTO ch04_products (id, name, price_cents) "
            "SELECT g, 'product ' || g, 100 * g FROM generate_series(1, %s) AS g ON CONFLICT DO NOTHING",
            (products,),
        )


async def reset_catalog(pool) -> None:
    """Prices and versions back to where :func:`setup_catalog` left them, the query log empty:
    a notebook run shows the same numbers however often it runs in one kernel."""
    async with pool.connection() as conn:
        await conn.execute("UPDATE ch04_products SET price_cents = 100 * id, version = 1")
        await conn.execute("TRUNCATE ch04_query_log")


def _user_row(i: int) -> tuple[int, str, str]:
    return i, f"user {i}", f"user{i}@example.com"


async def setup_users(pool, n: int = 200) -> None:
    """Create the graded task's ``users`` view with users 1..n. A coroutine: ``await setup_users(pool)``.

    ``pool`` is a ``psycopg_pool.AsyncConnectionPool`` (``await ns.pool()``). From sync code
    (a script, a worker process) call :func:`setup_users_sync` with a plain connection instead.
    Safe to call twice.
    """
    async with pool.connection() as conn:
        await conn.execute(USERS_SCHEMA)
        async with conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO user_rows (id, name, email) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                [_user_row(i) for i in range(1, n + 1)],
            )


def setup_users_sync(conn, n: int = 200) -> None:
    """The same as :func:`setup_users` for a plain (sync) psycopg connection, e.g. ``ns.connect()``."""
    conn.execute(USERS_SCHEMA)
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO user_rows (id, name, email) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
            [_user_row(i) for i in range(1, n + 1)],
        )
    if not conn.autocommit:
        conn.commit()


async def _scalar(pool, query: str, params: tuple = ()) -> Any:
    async with pool.connection() as conn:
        row = await (await conn.execute(query, params)).fetchone()
    return row[0] if row else None


async def user_queries(pool) -> int:
    """How many queries have read the ``users`` view so far (counted by PostgreSQL itself)."""
    return int(await _scalar(pool, "SELECT count(*) FROM user_reads"))


async def add_user(pool, user_id: int, name: str, email: str) -> None:
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO user_rows (id, name, email) VALUES (%s, %s, %s)", (user_id, name, email)
        )


async def fetch_user(pool, user_id: int) -> dict | None:
    """One user as ``{"id", "name", "email"}`` or None: one query on the ``users`` view."""
    async with pool.connection() as conn:
        row = await (
            await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))
        ).fetchone()
    return None if row is None else {"id": row[0], "name": row[1], "email": row[2]}


async def db_queries(pool, what: str | None = None) -> int:
    """How many ``slow_product`` queries PostgreSQL has run (all, or for one ``product:<id>``)."""
    if what is None:
        return int(await _scalar(pool, "SELECT count(*) FROM ch04_query_log"))
    return int(await _scalar(pool, "SELECT count(*) FROM ch04_query_log WHERE what = %s", (what,)))


async def reset_query_log(pool) -> None:
    async with pool.connection() as conn:
        await conn.execute("TRUNCATE ch04_query_log")


async def max_concurrent_queries(pool) -> int:
    """The most ``slow_product`` queries that were running at the same moment, from their logged intervals."""
    async with pool.connection() as conn:
        rows = await (
            await conn.execute(
                "SELECT started_at, coalesce(finished_at, clock_timestamp()) FROM ch04_query_log"
            )
        ).fetchall()
    events = sorted([(s, 1) for s, _ in rows] + [(f, -1) for _, f in rows], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


async def load_product(pool, product_id: int, seconds: float = 0.0) -> dict | None:
    """Read one product through ``slow_product`` (logged; ``seconds`` of ``pg_sleep`` first)."""
    return await _scalar(pool, "SELECT slow_product(%s, %s)", (product_id, seconds))


def product_loader(pool, product_id: int, seconds: float = 0.0) -> Loader:
    """A loader (a coroutine function with no arguments) for one product: the cache's view of the database."""

    async def load() -> dict | None:
        return await load_product(pool, product_id, seconds)

    return load


async def update_product(pool, product_id: int, price_cents: int) -> dict:
    """Change a price and bump the row's version; returns the committed row."""
    async with pool.connection() as conn:
        row = await (
            await conn.execute(
                "UPDATE ch04_products SET price_cents = %s, version = version + 1 WHERE id = %s "
                "RETURNING id, name, price_cents, version",
                (price_cents, product_id),
            )
        ).fetchone()
    return {"id": row[0], "name": row[1], "price_cents": row[2], "version": row[3]}


async def insert_orders(pool, batch: dict) -> None:
    """The write-behind demo's flush into ``ch04_orders``: one INSERT per order, in one transaction."""
    async with pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
        await cur.executemany(
            "INSERT INTO ch04_orders (id, amount_cents) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            [(k, v["amount_cents"]) for k, v in batch.items()],
        )


# ============================================================================ the stampede, measured


@dataclass
class Run:
    """One stampede experiment: database queries made and each request's latency."""

    name: str
    queries: int
    latencies_ms: list[float]
    seconds: float
    note: str = ""
    expiries: float = 1.0  # how many times the value expired (or TTL periods passed) during the run
    load_ms: float = 0.0  # how long one load takes: a request slower than half of it waited for the database
    blocked: int | None = (
        None  # requests the cache itself saw wait for a load (overrides the latency estimate)
    )

    @property
    def per_expiry(self) -> float:
        return self.queries / self.expiries if self.expiries else math.nan

    @property
    def waited(self) -> int:
        """Requests that waited for the database (as counted by the cache, else: slower than half a load)."""
        if self.blocked is not None:
            return self.blocked
        return sum(ms > self.load_ms / 2 for ms in self.latencies_ms)

    @property
    def p50(self) -> float:
        xs = sorted(self.latencies_ms)
        return xs[len(xs) // 2] if xs else math.nan

    @property
    def worst(self) -> float:
        return max(self.latencies_ms) if self.latencies_ms else math.nan

    def __str__(self) -> str:
        queries = f"{self.queries:>3} quer{'y  ' if self.queries == 1 else 'ies'}"
        note = f"  ({self.note})" if self.note else ""
        return (
            f"{self.name:<32}{queries}  p50 {self.p50:6.1f} ms  max {self.worst:6.1f} ms  "
            f"{len(self.latencies_ms)} requests{note}"
        )


async def timed_burst(n: int, call: Callable[[], Awaitable[Any]]) -> tuple[list[Any], list[float], float]:
    """Fire ``n`` calls at once; their results, each one's latency (ms) and the burst's seconds."""

    async def one() -> tuple[Any, float]:
        t0 = time.perf_counter()
        value = await call()
        return value, (time.perf_counter() - t0) * 1000

    t0 = time.perf_counter()
    pairs = await asyncio.gather(*(one() for _ in range(n)))
    return [v for v, _ in pairs], [ms for _, ms in pairs], time.perf_counter() - t0


async def stampede(
    pool, redis, strategy: str, *, n: int = 50, load_seconds: float = 0.2, product_id: int = 1
) -> Run:
    """``n`` concurrent requests for a hot key that just expired, under one strategy.

    ``strategy``: ``"none"`` (plain cache-aside), ``"single-flight"``, ``"serve-stale"``
    (the value is stale but still in Redis). Queries are counted by PostgreSQL.
    """
    key = f"product:{product_id}"
    loader = product_loader(pool, product_id, load_seconds)
    await redis.delete(key)
    if strategy == "serve-stale":
        cache: Any = ServeStale(redis, fresh=60)
        await cache.get(key, loader)  # warm it, then let it go stale
        await cache.mark_stale(key)
    elif strategy in ("none", "single-flight"):
        cache = CacheAside(redis, ttl=60, single_flight=strategy == "single-flight")
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    # a running service's client has its connections open already: open them now (n at once), so the
    # burst measures the cache and not a machine busy with handshakes that let late requests find a hit
    await asyncio.gather(*(redis.ping() for _ in range(n)))
    before = await db_queries(pool)
    _, latencies, seconds = await timed_burst(n, lambda: cache.get(key, loader))
    if isinstance(cache, ServeStale):
        await cache.drain()
    names = {
        "none": "no protection",
        "single-flight": "single-flight",
        "serve-stale": "serve stale, refresh behind",
    }
    return Run(
        names[strategy], await db_queries(pool) - before, latencies, seconds, load_ms=load_seconds * 1000
    )


async def steady_traffic(
    pool,
    redis,
    *,
    early: bool,
    ttl: float = 0.6,
    duration: float = 1.5,
    every: float = 0.05,
    per_wave: int = 10,
    load_seconds: float = 0.15,
    seed: int = 4,
) -> tuple[Run, list[tuple[float, float]]]:
    """Waves of requests for one key across several expiries: plain TTL or XFetch early expiration.

    Both use single-flight. Returns the run and ``(seconds since start, latency ms)`` per request.
    """
    key = "product:2"
    loader = product_loader(pool, 2, load_seconds)
    await redis.delete(key)
    rng = random.Random(seed)
    if early:
        cache: Any = EarlyExpiry(redis, ttl=ttl, beta=1.0, rand=rng.random)
    else:
        cache = CacheAside(redis, ttl=ttl, jitter=0.0)
    await cache.get(key, loader)  # warm
    warm_waits = cache.waited if early else cache.misses
    before = await db_queries(pool)
    start = time.perf_counter()
    points: list[tuple[float, float]] = []

    async def one() -> None:
        t0 = time.perf_counter()
        await cache.get(key, loader)
        points.append((t0 - start, (time.perf_counter() - t0) * 1000))

    tasks = []
    wave = 0
    while (wave * every) < duration:
        delay = start + wave * every - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks += [asyncio.ensure_future(one()) for _ in range(per_wave)]
        wave += 1
    await asyncio.gather(*tasks)
    name = "early expiration (XFetch)" if early else "plain TTL + single-flight"
    elapsed = time.perf_counter() - start
    run = Run(name, await db_queries(pool) - before, [ms for _, ms in points], elapsed, note="steady traffic")
    run.expiries, run.load_ms = elapsed / ttl, load_seconds * 1000
    run.blocked = (cache.waited if early else cache.misses) - warm_waits
    return run, sorted(points)


async def cancel_a_waiter(
    pool, *, shielded: bool, waiters: int = 10, load_seconds: float = 0.1
) -> tuple[Counter, int]:
    """``waiters`` callers share one load of a product; the first is cancelled halfway through it.

    The callers await the shared task directly, or through ``asyncio.shield``. Returns what the
    other callers got (a Counter of outcomes) and how many loads ran to the end.
    """
    finished = 0
    shared: asyncio.Task | None = None

    async def load() -> dict | None:
        nonlocal finished
        row = await load_product(pool, 4, load_seconds)
        finished += 1
        return row

    async def get() -> Any:
        nonlocal shared
        if shared is None:
            shared = asyncio.ensure_future(load())
        return await (asyncio.shield(shared) if shielded else shared)

    callers = [asyncio.ensure_future(get()) for _ in range(waiters)]
    await asyncio.sleep(load_seconds / 2)
    callers[0].cancel()  # its client hung up
    got = await asyncio.gather(*callers, return_exceptions=True)
    if shared is not None:
        await asyncio.gather(shared, return_exceptions=True)
    outcomes = Counter(type(x).__name__ if isinstance(x, BaseException) else "the product" for x in got[1:])
    return outcomes, finished


# ============================================================================ penetration


async def penetration(pool, redis, ids: Iterable[int], *, miss_ttl: float | None = None, bloom=None) -> int:
    """Look up ``ids`` one by one through cache-aside on ``users``; returns the queries PostgreSQL saw.

    ``miss_ttl`` turns on negative caching; ``bloom`` (a :class:`course.bloom.BloomFilter` of
    every user id) answers "no such user" before the cache and the database are asked.
    """
    cache = CacheAside(redis, ttl=300, miss_ttl=miss_ttl)
    before = await user_queries(pool)
    for user_id in ids:
        if bloom is not None and not await bloom.might_contain(user_id):
            continue  # definitely not a user
        await cache.get(f"user:{user_id}", lambda user_id=user_id: fetch_user(pool, user_id))
    return await user_queries(pool) - before


# ============================================================================ avalanche


async def write_many(
    redis, prefix: str, n: int, ttl: float, *, jitter: float = 0.0, rand: Callable[[], float] = random.random
) -> None:
    """Write ``n`` keys at once (one pipeline), as a cache warmed by a batch job or a restart would."""
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.set(f"{prefix}:{i}", "1", px=jittered_ms(ttl, jitter, rand))
        await pipe.execute()


async def seconds_to_expiry(redis, prefix: str, n: int) -> list[float]:
    """Read back every key's remaining TTL (PTTL) in seconds."""
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.pttl(f"{prefix}:{i}")
        return [ms / 1000 for ms in await pipe.execute() if ms >= 0]


def avalanche_sync(redis_sync, n: int, ttl: float, jitter: float, *, prefix: str = "aval") -> list[float]:
    """Sync version for widgets: write ``n`` keys with a jittered TTL, read back seconds to expiry."""
    rand = random.Random(n).random
    pipe = redis_sync.pipeline(transaction=False)
    for i in range(n):
        pipe.set(f"{prefix}:{i}", "1", px=jittered_ms(ttl, jitter, rand))
    pipe.execute()
    for i in range(n):
        pipe.pttl(f"{prefix}:{i}")
    return [ms / 1000 for ms in pipe.execute() if ms >= 0]


def expiries_per_second(seconds: Iterable[float]) -> Counter:
    """How many keys expire in each whole second from now: the misses the database will see."""
    return Counter(int(s) for s in seconds)


async def prewarm(
    redis, keys: dict[str, Loader], *, ttl: float = 300.0, jitter: float = 0.2, concurrency: int = 8
) -> int:
    """Fill the hottest keys before traffic arrives (after a restart), a few loads at a time, jittered TTLs."""
    gate = asyncio.Semaphore(concurrency)

    async def warm(key: str, loader: Loader) -> None:
        async with gate:
            value = await loader()
            await redis.set(key, to_json(value), px=jittered_ms(ttl, jitter))

    await asyncio.gather(*(warm(k, f) for k, f in keys.items()))
    return len(keys)


# ============================================================================ the read-then-set race


@dataclass
class RaceResult:
    fix: str
    steps: list[str] = field(default_factory=list)
    cached: Any = None
    database: Any = None
    ttl_left: float = 0.0

    @property
    def stale(self) -> bool:
        return self.cached is not MISSING and self.cached != self.database

    def __str__(self) -> str:
        cached = "nothing (next read loads the new row)" if self.cached is MISSING else self.cached
        lines = [f"fix: {self.fix}", *(f"  {i + 1}. {s}" for i, s in enumerate(self.steps))]
        lines.append(f"  cache holds: {cached}")
        lines.append(f"  database:    {self.database}")
        if self.stale:
            lines.append(f"  STALE, and it stays for the TTL: {self.ttl_left:.0f} s left")
        return "\n".join(lines)


async def read_then_set_race(
    redis,
    pool,
    product_id: int = 5,
    *,
    fix: str = "none",
    ttl: float = 300.0,
    second_delete_after: float = 0.2,
) -> RaceResult:
    """Reproduce the read-then-set race step by step (the order is forced with events).

    A reader misses and loads the row; before it fills the cache, a writer commits a new
    price and invalidates; then the reader fills with what it loaded. ``fix``:

    - ``"none"``: the writer deletes; the reader's late SET puts the old row back for the whole TTL;
    - ``"versioned"``: both sides write through :data:`VERSIONED_SET_LUA`; the older version is refused;
    - ``"versioned, evicted"``: the same, but the newer entry is evicted (or expires) before the late
      fill: nothing is left to compare with, so the older version is stored;
    - ``"double-delete"``: the writer deletes, and again ``second_delete_after`` seconds later;
    - ``"double-delete, slow reader"``: the reader fills after the second delete too: stale again.
    """
    key = f"race:product:{product_id}"
    versioned = fix.startswith("versioned")
    await redis.delete(key)
    res = RaceResult(fix)
    loaded, invalidated, second_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    t0 = time.perf_counter()

    def note(msg: str) -> None:
        res.steps.append(f"[{(time.perf_counter() - t0) * 1000:6.1f} ms] {msg}")

    async def reader() -> None:
        cached = await (versioned_get(redis, key) if versioned else redis.get(key))
        note(f"reader: cache miss ({'nothing' if cached in (None, MISSING) else cached})")
        row = await load_product(pool, product_id)
        note(f"reader: loaded price {row['price_cents']} (version {row['version']}) ... and stalls")
        loaded.set()
        await invalidated.wait()
        if fix == "double-delete, slow reader":
            await second_done.wait()
        if versioned:
            ok = await versioned_set(redis, key, row["version"], row, ttl)
            note(
                f"reader: versioned fill with version {row['version']}: {'stored' if ok else 'refused, older'}"
            )
        else:
            await redis.set(key, to_json(row), px=jittered_ms(ttl))
            note(f"reader: SET price {row['price_cents']} with a {ttl:g} s TTL")

    async def writer() -> None:
        await loaded.wait()
        row = await load_product(pool, product_id)
        new = await update_product(pool, product_id, row["price_cents"] + 100)
        note(f"writer: committed price {new['price_cents']} (version {new['version']})")
        if versioned:
            await versioned_set(redis, key, new["version"], new, ttl)
            note(f"writer: versioned write of version {new['version']}")
            if fix == "versioned, evicted":
                await redis.delete(key)
                note(f"the entry of version {new['version']} is evicted (memory pressure) or expires")
        else:
            await redis.delete(key)
            note("writer: DEL after commit")
        invalidated.set()
        if fix.startswith("double-delete"):
            await asyncio.sleep(second_delete_after)
            if fix == "double-delete":
                stale = await redis.get(key)
                note(
                    f"... for {second_delete_after * 1000:.0f} ms the cache served {json.loads(stale)['price_cents']}"
                )
            await redis.delete(key)
            note(f"writer: second DEL, {second_delete_after * 1000:.0f} ms later")
            second_done.set()

    await asyncio.gather(reader(), writer())
    res.cached = await (versioned_get(redis, key) if versioned else redis.get(key))
    if isinstance(res.cached, str):
        res.cached = json.loads(res.cached)
    elif res.cached is None:
        res.cached = MISSING
    res.database = await load_product(pool, product_id)
    res.ttl_left = max(0.0, await redis.pttl(key) / 1000)
    return res


# ============================================================================ the chapter's figure


def plot_runs(runs: list[Run], title: str = ""):
    """Bar chart: queries per expiry, share of requests that waited for the database, slowest request."""
    import matplotlib.pyplot as plt

    names = [f"{r.name}{' *' if r.note == 'steady traffic' else ''}" for r in runs]
    panels = (
        ([r.per_expiry for r in runs], "database queries per expiry (* per TTL period)", "{:.3g}"),
        (
            [100 * r.waited / max(1, len(r.latencies_ms)) for r in runs],
            "% of requests that waited for the database",
            "{:.0f}%",
        ),
        ([r.worst for r in runs], "slowest request (ms)", "{:.0f}"),
    )
    colors = ["#c0392b" if r.per_expiry > 2 else "#2e86c1" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.45 * len(runs) + 1.6), sharey=True)
    for ax, (values, label, fmt) in zip(axes, panels, strict=True):
        ax.barh(names, values, color=colors)
        ax.set_title(label, fontsize=10)
        for y, v in enumerate(values):
            ax.text(v, y, " " + fmt.format(v), va="center", fontsize=8)
        ax.margins(x=0.25)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
