"""Caching, stampedes and invalidation (chapter 04).

The strategies (cache-aside, read-through, write-through, write-behind), the stampede
guards (single-flight, a Redis lock with a token, serve-stale, probabilistic early
expiration), the invalidation fixes (versioned writes in Lua, delayed double delete) and
a bounded in-process cache invalidated through pub/sub, all against live Redis and
PostgreSQL. Chapter 12 (URL shortener) reuses :class:`CacheAside` for its redirect path.

The chapter's tables count their own queries on the database side, so a demo or a check
never has to trust the code it measures:

- ``products`` is read through ``slow_product(id, seconds)``, which logs every call in
  ``query_log`` (with start and end times) and can sleep inside PostgreSQL;
- ``users`` (the graded task's table) is a view whose every query adds a row to
  ``user_reads``; the rows themselves live in ``user_rows``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import secrets
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Loader = Callable[[], Awaitable[Any]]

# ============================================================================ the chapter's tables

CATALOG_SCHEMA = """
CREATE TABLE IF NOT EXISTS products (
    id          bigint PRIMARY KEY,
    name        text   NOT NULL,
    price_cents int    NOT NULL,
    version     int    NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS query_log (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    what        text        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at timestamptz
);
CREATE TABLE IF NOT EXISTS orders (
    id           text PRIMARY KEY,
    amount_cents int  NOT NULL
);
CREATE OR REPLACE FUNCTION slow_product(p_id bigint, p_seconds double precision) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    log_id bigint;
    result jsonb;
BEGIN
    INSERT INTO query_log (what) VALUES ('product:' || p_id) RETURNING id INTO log_id;
    IF p_seconds > 0 THEN
        PERFORM pg_sleep(p_seconds);
    END IF;
    SELECT to_jsonb(p) INTO result
      FROM (SELECT id, name, price_cents, version FROM products WHERE id = p_id) AS p;
    UPDATE query_log SET finished_at = clock_timestamp() WHERE id = log_id;
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
    """Create ``products`` (ids 1..products), ``query_log``, ``orders`` and ``slow_product`` (async: await it)."""
    async with pool.connection() as conn:
        await conn.execute(CATALOG_SCHEMA)
        await conn.execute(
            "INSERT INTO products (id, name, price_cents) "
            "SELECT g, 'product ' || g, 100 * g FROM generate_series(1, %s) AS g ON CONFLICT DO NOTHING",
            (products,),
        )


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
        await conn.execute("INSERT INTO user_rows (id, name, email) VALUES (%s, %s, %s)", (user_id, name, email))


async def fetch_user(pool, user_id: int) -> dict | None:
    """One user as ``{"id", "name", "email"}`` or None: one query on the ``users`` view."""
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    return None if row is None else {"id": row[0], "name": row[1], "email": row[2]}


async def db_queries(pool, what: str | None = None) -> int:
    """How many ``slow_product`` queries PostgreSQL has run (all, or for one ``product:<id>``)."""
    if what is None:
        return int(await _scalar(pool, "SELECT count(*) FROM query_log"))
    return int(await _scalar(pool, "SELECT count(*) FROM query_log WHERE what = %s", (what,)))


async def reset_query_log(pool) -> None:
    async with pool.connection() as conn:
        await conn.execute("TRUNCATE query_log")


async def max_concurrent_queries(pool) -> int:
    """The most ``slow_product`` queries that were running at the same moment, from their logged intervals."""
    async with pool.connection() as conn:
        rows = await (
            await conn.execute("SELECT started_at, coalesce(finished_at, clock_timestamp()) FROM query_log")
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
                "UPDATE products SET price_cents = %s, version = version + 1 WHERE id = %s "
                "RETURNING id, name, price_cents, version",
                (price_cents, product_id),
            )
        ).fetchone()
    return {"id": row[0], "name": row[1], "price_cents": row[2], "version": row[3]}


# ============================================================================ TTLs


def jittered_ms(ttl: float, jitter: float = 0.2, rand: Callable[[], float] = random.random) -> int:
    """A TTL in milliseconds drawn uniformly from ``[ttl, ttl * (1 + jitter))`` seconds."""
    return max(1, int(ttl * 1000 * (1 + jitter * rand())))


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


# ============================================================================ single-flight


class SingleFlight:
    """One load per key at a time in this process; every caller of that key shares its result or error.

    The load runs as a task of its own, so a caller that is cancelled does not cancel the
    load for the others; the entry is removed when the load ends, success or failure, so
    one error never poisons the key.
    """

    def __init__(self) -> None:
        self._calls: dict[str, asyncio.Task] = {}
        self.loads = 0

    def in_flight(self) -> int:
        return len(self._calls)

    def running(self, key: str) -> bool:
        return key in self._calls

    async def do(self, key: str, fn: Loader) -> Any:
        call = self._calls.get(key)
        if call is None:
            self.loads += 1
            call = asyncio.get_running_loop().create_task(fn())
            self._calls[key] = call
            call.add_done_callback(lambda done, key=key: self._forget(key, done))
        return await asyncio.shield(call)

    def _forget(self, key: str, done: asyncio.Task) -> None:
        if self._calls.get(key) is done:
            del self._calls[key]
        if not done.cancelled():
            done.exception()  # mark retrieved: the callers got it


# ============================================================================ the four strategies

MISSING = object()


class CacheAside:
    """Cache-aside with JSON values: read Redis, on a miss load and fill; the writer deletes after commit.

    - every key gets a TTL, jittered into ``[ttl, ttl * (1 + jitter))``;
    - ``miss_ttl``: cache a missing row (``None``) for that many seconds (negative caching);
      ``None`` leaves misses uncached;
    - ``single_flight``: concurrent misses of one key in this process share one load.
    """

    def __init__(
        self,
        redis,
        *,
        ttl: float = 300.0,
        jitter: float = 0.2,
        miss_ttl: float | None = None,
        single_flight: bool = True,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.redis = redis
        self.ttl = ttl
        self.jitter = jitter
        self.miss_ttl = miss_ttl
        self.flight = SingleFlight() if single_flight else None
        self.rand = rand
        self.hits = 0
        self.misses = 0

    async def _cached(self, key: str) -> Any:
        raw = await self.redis.get(key)
        return MISSING if raw is None else json.loads(raw)

    async def get(self, key: str, loader: Loader) -> Any:
        value = await self._cached(key)
        if value is not MISSING:
            self.hits += 1
            return value
        self.misses += 1
        if self.flight is None:
            return await self._fill(key, loader)
        return await self.flight.do(key, lambda: self._fill(key, loader, recheck=True))

    async def _fill(self, key: str, loader: Loader, *, recheck: bool = False) -> Any:
        if recheck:  # a load that finished between our GET and joining the flight already filled it
            value = await self._cached(key)
            if value is not MISSING:
                return value
        value = await loader()
        if value is None and self.miss_ttl is None:
            return None
        ttl = self.miss_ttl if value is None else self.ttl
        await self.redis.set(key, _dump(value), px=jittered_ms(ttl, self.jitter, self.rand))
        return value

    async def invalidate(self, key: str) -> None:
        """Call after the database commit, never before: a reader could refill from the old row."""
        await self.redis.delete(key)


class ReadThrough:
    """Read-through: the loader lives inside the cache; callers only ever ask the cache for an id."""

    def __init__(self, redis, load: Callable[[Any], Awaitable[Any]], *, prefix: str, **options) -> None:
        self.cache = CacheAside(redis, **options)
        self.load = load
        self.prefix = prefix

    async def get(self, item_id: Any) -> Any:
        return await self.cache.get(f"{self.prefix}:{item_id}", lambda: self.load(item_id))


class WriteThrough:
    """Write-through: every write goes to the database and then to the cache, on the writer's path.

    The next read is a hit, but every write now waits for Redis too (and fails with it).
    """

    def __init__(self, redis, write: Callable[[Any, Any], Awaitable[Any]], *, prefix: str, ttl: float = 300.0) -> None:
        self.redis = redis
        self.write = write
        self.prefix = prefix
        self.ttl = ttl

    async def put(self, item_id: Any, value: Any) -> Any:
        stored = await self.write(item_id, value)  # commit first: the cache never shows an uncommitted row
        await self.redis.set(f"{self.prefix}:{item_id}", _dump(stored), px=jittered_ms(self.ttl))
        return stored

    async def get(self, item_id: Any) -> Any:
        raw = await self.redis.get(f"{self.prefix}:{item_id}")
        return None if raw is None else json.loads(raw)


class WriteBehind:
    """Write-behind (write-back): acknowledge once Redis has it, write the database later in batches.

    Fast writes, but a crash between the acknowledgement and the flush loses writes the
    client was told succeeded. Fine for view counters; never for orders or money.
    """

    def __init__(
        self, redis, flush: Callable[[dict], Awaitable[None]], *, prefix: str, batch: int = 10, ttl: float = 300.0
    ) -> None:
        self.redis = redis
        self._flush = flush
        self.prefix = prefix
        self.batch = batch
        self.ttl = ttl
        self.pending: dict[str, Any] = {}
        self.flushed = 0

    async def put(self, item_id: str, value: Any) -> None:
        await self.redis.set(f"{self.prefix}:{item_id}", _dump(value), px=jittered_ms(self.ttl))
        self.pending[item_id] = value
        if len(self.pending) >= self.batch:
            await self.flush()

    async def flush(self) -> None:
        batch, self.pending = self.pending, {}
        if batch:
            await self._flush(batch)
            self.flushed += len(batch)


async def insert_orders(pool, batch: dict) -> None:
    """The write-behind demo's flush: one INSERT per order, in one transaction."""
    async with pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
        await cur.executemany(
            "INSERT INTO orders (id, amount_cents) VALUES (%s, %s) ON CONFLICT DO NOTHING",
            [(k, v["amount_cents"]) for k, v in batch.items()],
        )


# ============================================================================ a lock in Redis

RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisLock:
    """A lock across processes: ``SET name token NX PX ttl``, released only by its holder.

    The expiry means a holder that dies cannot block everyone forever; the random token
    and the compare-and-delete script mean a holder whose lock already expired (and was
    taken by someone else) cannot delete the new holder's lock.
    """

    def __init__(self, redis, name: str, ttl: float = 5.0) -> None:
        self.redis = redis
        self.name = name
        self.ttl = ttl
        self.token: str | None = None
        self._release = redis.register_script(RELEASE_LUA)

    async def acquire(self) -> bool:
        token = secrets.token_hex(16)
        if await self.redis.set(self.name, token, nx=True, px=max(1, int(self.ttl * 1000))):
            self.token = token
            return True
        return False

    async def release(self) -> bool:
        if self.token is None:
            return False
        token, self.token = self.token, None
        return bool(await self._release(keys=[self.name], args=[token]))


async def get_with_lock(
    redis,
    key: str,
    ttl: float,
    loader: Loader,
    *,
    lock_ttl: float = 5.0,
    poll: float = 0.02,
    max_wait: float | None = None,
    jitter: float = 0.2,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Any:
    """Cache-aside where one process in the whole fleet loads a missing key; the others poll the cache.

    A loser waits ``poll`` seconds between looks. If the holder died, its lock expires after
    ``lock_ttl`` and the next caller takes over. Past ``max_wait`` (default: twice the lock
    TTL) a caller gives up waiting and loads by itself rather than fail the request.
    """
    limit = clock() + (2 * lock_ttl if max_wait is None else max_wait)
    lock = RedisLock(redis, f"lock:{key}", lock_ttl)
    while True:
        raw = await redis.get(key)
        if raw is not None:
            return json.loads(raw)
        if await lock.acquire():
            try:
                raw = await redis.get(key)  # filled while we raced for the lock
                if raw is not None:
                    return json.loads(raw)
                value = await loader()
                await redis.set(key, _dump(value), px=jittered_ms(ttl, jitter))
                return value
            finally:
                await lock.release()
        if clock() >= limit:
            return await loader()
        await sleep(poll)


# ============================================================================ serve stale, early expiration


class ServeStale:
    """Stale-while-revalidate: past its fresh time a value is still served while one refresh runs behind.

    Redis holds ``{"v": value, "fresh_until": t}`` for ``fresh + stale`` seconds. A stale hit
    answers at once and starts a background refresh, single-flighted in this process and
    guarded by a Redis lock across processes. Only a cold key (or one past ``fresh + stale``)
    makes a caller wait for the database.
    """

    def __init__(
        self,
        redis,
        *,
        fresh: float = 60.0,
        stale: float = 600.0,
        lock_ttl: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.fresh = fresh
        self.stale = stale
        self.lock_ttl = lock_ttl
        self.clock = clock
        self.flight = SingleFlight()
        self._refreshing: dict[str, asyncio.Task] = {}
        self.stale_hits = 0
        self.refresh_errors: list[BaseException] = []

    async def get(self, key: str, loader: Loader) -> Any:
        raw = await self.redis.get(key)
        if raw is not None:
            entry = json.loads(raw)
            if self.clock() >= entry["fresh_until"]:
                self.stale_hits += 1
                self._refresh_later(key, loader)
            return entry["v"]
        return await self.flight.do(key, lambda: self._fill(key, loader))

    async def _fill(self, key: str, loader: Loader) -> Any:
        value = await loader()
        entry = {"v": value, "fresh_until": self.clock() + self.fresh}
        await self.redis.set(key, _dump(entry), px=jittered_ms(self.fresh + self.stale))
        return value

    def _refresh_later(self, key: str, loader: Loader) -> None:
        if key in self._refreshing:
            return
        task = asyncio.get_running_loop().create_task(self._refresh(key, loader))
        self._refreshing[key] = task
        task.add_done_callback(lambda _t, key=key: self._refreshing.pop(key, None))

    async def _refresh(self, key: str, loader: Loader) -> None:
        lock = RedisLock(self.redis, f"refresh:{key}", self.lock_ttl)
        if not await lock.acquire():
            return  # another process is refreshing it
        try:
            await self._fill(key, loader)
        except Exception as err:  # noqa: BLE001 - keep serving the stale value; the next stale hit retries
            self.refresh_errors.append(err)
        finally:
            await lock.release()

    async def drain(self) -> None:
        """Wait for the background refreshes started so far (tests and demos)."""
        while self._refreshing:
            await asyncio.gather(*list(self._refreshing.values()), return_exceptions=True)

    async def mark_stale(self, key: str) -> None:
        """Demo helper: make a cached value stale now, as if ``fresh`` seconds had passed."""
        raw = await self.redis.get(key)
        if raw is not None:
            entry = json.loads(raw)
            entry["fresh_until"] = self.clock() - 1
            await self.redis.set(key, _dump(entry), keepttl=True)


def early_refresh_probability(time_left: float, delta: float, beta: float = 1.0) -> float:
    """The chance that one read refreshes a value ``time_left`` seconds before it expires (XFetch).

    A read refreshes when ``now - delta * beta * ln(U) >= expiry`` with U uniform on (0, 1],
    which happens with probability ``exp(-time_left / (delta * beta))``.
    """
    if time_left <= 0:
        return 1.0
    return math.exp(-time_left / (delta * beta))


class EarlyExpiry:
    """Probabilistic early expiration (XFetch, Vattani et al., VLDB 2015).

    Redis holds ``{"v": value, "delta": seconds the last load took, "expiry": t}``. Each read
    may decide to recompute before the expiry, more likely the closer the expiry and the
    slower the load, so one reader refreshes a hot key ahead of time and nobody meets a miss.
    While that refresh runs, other readers of the process keep getting the cached value.
    """

    def __init__(
        self,
        redis,
        *,
        ttl: float = 60.0,
        beta: float = 1.0,
        clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.redis = redis
        self.ttl = ttl
        self.beta = beta
        self.clock = clock
        self.rand = rand
        self.flight = SingleFlight()
        self.early = 0  # reads that refreshed before the expiry
        self.waited = 0  # reads that waited for a load

    async def get(self, key: str, loader: Loader) -> Any:
        raw = await self.redis.get(key)
        if raw is not None:
            entry = json.loads(raw)
            gap = -entry["delta"] * self.beta * math.log(max(self.rand(), 1e-12))
            if self.clock() + gap < entry["expiry"] or self.flight.running(key):
                return entry["v"]  # not yet, or another reader of this process is already refreshing it
            self.early += 1
        self.waited += 1
        return await self.flight.do(key, lambda: self._recompute(key, loader))

    async def _recompute(self, key: str, loader: Loader) -> Any:
        started = self.clock()
        value = await loader()
        now = self.clock()
        entry = {"v": value, "delta": max(now - started, 1e-3), "expiry": now + self.ttl}
        await self.redis.set(key, _dump(entry), px=max(1, int(self.ttl * 1000)))
        return value


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
    blocked: int | None = None  # requests the cache itself saw wait for a load (overrides the latency estimate)

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
        return (
            f"{self.name:<34} {self.queries:>3} quer{'y  ' if self.queries == 1 else 'ies'}, latency p50 {self.p50:7.1f} ms, "
            f"max {self.worst:7.1f} ms, {len(self.latencies_ms)} requests{'  (' + self.note + ')' if self.note else ''}"
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


async def stampede(pool, redis, strategy: str, *, n: int = 50, load_seconds: float = 0.2, product_id: int = 1) -> Run:
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
    before = await db_queries(pool)
    _, latencies, seconds = await timed_burst(n, lambda: cache.get(key, loader))
    if isinstance(cache, ServeStale):
        await cache.drain()
    names = {"none": "no protection", "single-flight": "single-flight", "serve-stale": "serve stale, refresh behind"}
    return Run(names[strategy], await db_queries(pool) - before, latencies, seconds, load_ms=load_seconds * 1000)


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


# ---------------------------------------------------------------------------- several worker processes


async def stampede_across_processes(
    ns,
    *,
    workers: int = 4,
    per_worker: int = 25,
    rounds: int = 2,
    locks: tuple[bool, ...] = (False, True),
    load_seconds: float = 0.2,
) -> list[Run]:
    """The hot key expires ``rounds`` times; each time ``workers`` processes send ``per_worker`` requests at once.

    Every worker single-flights in process. One run per entry of ``locks``: with ``True`` the
    workers also take a Redis lock, so the fleet makes one query per expiry; with ``False``,
    one per process per expiry. The worker processes start once and serve every run.
    """
    redis = ns.redis()
    pool = await ns.pool(max_size=2)
    tag = secrets.token_hex(3)
    key = "product:3"
    spec = {
        "redis_url": ns.redis_url,
        "database_url": ns.database_url,
        "key": key,
        "tag": tag,
        "per_worker": per_worker,
        "load_seconds": load_seconds,
    }
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "course.caching",
            "stampede-worker",
            json.dumps({**spec, "worker": w}),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        for w in range(workers)
    ]
    runs = []
    try:
        for _ in range(workers):
            if await redis.blpop([f"{tag}:ready"], timeout=60) is None:
                raise RuntimeError("a stampede worker did not start within 60 s")
        for lock in locks:
            latencies: list[float] = []
            before = await db_queries(pool)
            t0 = time.perf_counter()
            for _ in range(rounds):
                await redis.delete(key)  # the hot key expires
                for w in range(workers):
                    await redis.rpush(f"{tag}:go:{w}", json.dumps({"lock": lock}))
                for _ in range(workers):
                    got = await redis.blpop([f"{tag}:done"], timeout=60)
                    if got is None:
                        raise RuntimeError("a stampede worker did not report within 60 s")
                    latencies += json.loads(got[1])["latencies"]
            seconds = time.perf_counter() - t0
            name = f"Redis lock, {workers} processes" if lock else f"single-flight only, {workers} processes"
            queries = await db_queries(pool) - before
            runs.append(Run(name, queries, latencies, seconds, f"{rounds} expiries", rounds, load_seconds * 1000))
    finally:
        for w in range(workers):
            await redis.rpush(f"{tag}:go:{w}", json.dumps({"stop": True}))
        errors = []
        for p in procs:
            try:
                _, err = await asyncio.wait_for(p.communicate(), 30)
            except asyncio.TimeoutError:
                p.kill()
                _, err = await p.communicate()
            if p.returncode:
                errors.append(err.decode(errors="replace")[-500:])
        await redis.delete(key)
    if errors:
        raise RuntimeError("stampede worker failed:\n" + errors[0])
    return runs


async def _stampede_worker(spec: dict) -> None:
    import redis.asyncio as aioredis
    from psycopg_pool import AsyncConnectionPool

    redis = aioredis.Redis.from_url(spec["redis_url"], decode_responses=True)
    pool = AsyncConnectionPool(spec["database_url"], min_size=1, max_size=2, open=False, kwargs={"autocommit": True})
    await pool.open(wait=True)
    key, tag, w = spec["key"], spec["tag"], spec["worker"]
    loader = product_loader(pool, int(key.split(":")[1]), spec["load_seconds"])
    flight = SingleFlight()
    plain = CacheAside(redis, ttl=60)

    async def get_locked() -> Any:
        raw = await redis.get(key)
        if raw is not None:
            return json.loads(raw)
        return await flight.do(key, lambda: get_with_lock(redis, key, 60, loader, lock_ttl=5, poll=0.01))

    try:
        await redis.rpush(f"{tag}:ready", w)
        while True:
            got = await redis.blpop([f"{tag}:go:{w}"], timeout=120)
            order = {"stop": True} if got is None else json.loads(got[1])
            if order.get("stop"):
                return
            get = get_locked if order["lock"] else lambda: plain.get(key, loader)
            _, latencies, _ = await timed_burst(spec["per_worker"], get)
            await redis.rpush(f"{tag}:done", json.dumps({"worker": w, "latencies": latencies}))
    finally:
        await pool.close()
        await redis.aclose()


# ---------------------------------------------------------------------------- crashes


async def write_behind_crash(ns, *, orders: int = 25, batch: int = 10) -> dict:
    """A worker process acknowledges ``orders`` write-behind writes, then is killed before its next flush.

    Returns what the client was told, what Redis holds and what reached PostgreSQL.
    """
    redis = ns.redis()
    pool = await ns.pool(max_size=2)
    async with pool.connection() as conn:
        await conn.execute("TRUNCATE orders")
    spec = {"redis_url": ns.redis_url, "database_url": ns.database_url, "orders": orders, "batch": batch}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "course.caching",
        "write-behind-worker",
        json.dumps(spec),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    acked = []
    assert proc.stdout is not None
    while len(acked) < orders:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            break
        if line.startswith(b"ack "):
            acked.append(line.split()[1].decode())
    proc.kill()  # the crash: SIGKILL, no chance to flush
    await proc.wait()
    in_redis = len(await redis.keys("order:*"))
    async with pool.connection() as conn:
        in_db = (await (await conn.execute("SELECT count(*) FROM orders")).fetchone())[0]
    return {"acknowledged": len(acked), "in Redis": in_redis, "in PostgreSQL": int(in_db)}


async def _write_behind_worker(spec: dict) -> None:
    import redis.asyncio as aioredis
    from psycopg_pool import AsyncConnectionPool

    redis = aioredis.Redis.from_url(spec["redis_url"], decode_responses=True)
    pool = AsyncConnectionPool(spec["database_url"], min_size=1, max_size=1, open=False, kwargs={"autocommit": True})
    await pool.open(wait=True)
    cache = WriteBehind(redis, lambda b: insert_orders(pool, b), prefix="order", batch=spec["batch"])
    for i in range(spec["orders"]):
        order_id = f"o{i:03d}"
        await cache.put(order_id, {"amount_cents": 1000 + i})
        print(f"ack {order_id}", flush=True)  # the client hears "your order is placed"
    await asyncio.sleep(3600)  # the next flush would come on a timer; the process dies first


def crash_holding_lock(redis_url: str, name: str, *, redis_py: bool, ttl: float | None = None) -> None:
    """Start a process that takes a lock and dies without releasing it (``os._exit``).

    ``redis_py=True`` uses ``redis.Redis.lock(name, timeout=ttl)``: with ``ttl=None`` (redis-py's
    default) the lock never expires. Otherwise the chapter's ``SET NX PX`` with ``ttl`` (default 2 s).
    """
    import subprocess

    if redis_py:
        take = f"r.lock({name!r}, timeout={ttl!r}).acquire()"
    else:
        take = f"r.set({name!r}, 'token', nx=True, px={int((ttl or 2.0) * 1000)})"
    code = f"import os, redis; r = redis.Redis.from_url({redis_url!r}); {take}; os._exit(1)"
    subprocess.run([sys.executable, "-c", code], check=False, timeout=60)


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
            await redis.set(key, _dump(value), px=jittered_ms(ttl, jitter))

    await asyncio.gather(*(warm(k, f) for k, f in keys.items()))
    return len(keys)


# ============================================================================ the read-then-set race

VERSIONED_SET_LUA = """
local current = redis.call('HGET', KEYS[1], 'version')
if current and tonumber(current) >= tonumber(ARGV[1]) then
    return 0
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'value', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


async def versioned_set(redis, key: str, version: int, value: Any, ttl: float = 300.0) -> bool:
    """Store ``value`` only if ``version`` is newer than the cached one (atomically, in Lua)."""
    script = redis.register_script(VERSIONED_SET_LUA)
    return bool(await script(keys=[key], args=[version, _dump(value), jittered_ms(ttl)]))


async def versioned_get(redis, key: str) -> Any:
    raw = await redis.hget(key, "value")
    return MISSING if raw is None else json.loads(raw)


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
    redis, pool, product_id: int = 5, *, fix: str = "none", ttl: float = 300.0, second_delete_after: float = 0.2
) -> RaceResult:
    """Reproduce the read-then-set race step by step (the order is forced with events).

    A reader misses and loads the row; before it fills the cache, a writer commits a new
    price and invalidates; then the reader fills with what it loaded. ``fix``:

    - ``"none"``: the writer deletes; the reader's late SET puts the old row back for the whole TTL;
    - ``"versioned"``: both sides write through :data:`VERSIONED_SET_LUA`; the older version is refused;
    - ``"double-delete"``: the writer deletes, and again ``second_delete_after`` seconds later;
    - ``"double-delete, slow reader"``: the reader fills after the second delete too: stale again.
    """
    key = f"race:product:{product_id}"
    versioned = fix == "versioned"
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
            note(f"reader: versioned fill with version {row['version']}: {'stored' if ok else 'refused, older'}")
        else:
            await redis.set(key, _dump(row), px=jittered_ms(ttl))
            note(f"reader: SET price {row['price_cents']} with a {ttl:g} s TTL")

    async def writer() -> None:
        await loaded.wait()
        row = await load_product(pool, product_id)
        new = await update_product(pool, product_id, row["price_cents"] + 100)
        note(f"writer: committed price {new['price_cents']} (version {new['version']})")
        if versioned:
            await versioned_set(redis, key, new["version"], new, ttl)
            note(f"writer: versioned write of version {new['version']}")
        else:
            await redis.delete(key)
            note("writer: DEL after commit")
        invalidated.set()
        if fix.startswith("double-delete"):
            await asyncio.sleep(second_delete_after)
            if fix == "double-delete":
                stale = await redis.get(key)
                note(f"... for {second_delete_after * 1000:.0f} ms the cache served {json.loads(stale)['price_cents']}")
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


# ============================================================================ in-process caches


class LocalLRU:
    """A bounded in-process cache: least recently used entries go first, each entry lives ``ttl`` seconds."""

    def __init__(self, maxsize: int = 1024, ttl: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.maxsize = maxsize
        self.ttl = ttl
        self.clock = clock
        self._data: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str, default: Any = MISSING) -> Any:
        item = self._data.get(key)
        if item is None or item[0] <= self.clock():
            if item is not None:
                del self._data[key]
            self.misses += 1
            return default
        self._data.move_to_end(key)
        self.hits += 1
        return item[1]

    def set(self, key: str, value: Any) -> None:
        self._data[key] = (self.clock() + self.ttl, value)
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)
            self.evictions += 1

    def pop(self, key: str) -> None:
        self._data.pop(key, None)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not MISSING


class NearCache:
    """A pod's two-level cache: a :class:`LocalLRU` in front of Redis, emptied by pub/sub invalidations.

    Pub/sub is fire-and-forget: a pod that is reconnecting when an invalidation is
    published never gets it. The local TTL is what bounds how long that pod stays wrong.
    """

    def __init__(self, redis, channel: str, local: LocalLRU, *, name: str = "pod", ttl: float = 300.0) -> None:
        self.redis = redis
        self.channel = channel
        self.local = local
        self.name = name
        self.shared = CacheAside(redis, ttl=ttl)
        self.flight = SingleFlight()
        self.received: list[str] = []
        self._pubsub = None
        self._listener: asyncio.Task | None = None
        self._seen: dict[str, asyncio.Event] = {}

    async def start(self) -> NearCache:
        self._pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await self._pubsub.subscribe(self.channel)
        self._listener = asyncio.get_running_loop().create_task(self._listen(self._pubsub))
        return self

    async def _listen(self, pubsub) -> None:
        async for message in pubsub.listen():
            if message.get("type") != "message":
                continue
            key = message["data"]
            self.local.pop(key)
            self.received.append(key)
            self._seen.setdefault(key, asyncio.Event()).set()

    async def stop(self) -> None:
        """Stop listening (a pod restarting or reconnecting): invalidations published now are lost."""
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        if self._pubsub is not None:
            await self._pubsub.unsubscribe(self.channel)
            await self._pubsub.aclose()
            self._pubsub = None

    async def get(self, key: str, loader: Loader) -> Any:
        value = self.local.get(key)
        if value is not MISSING:
            return value
        value = await self.flight.do(f"local:{key}", lambda: self.shared.get(key, loader))
        self.local.set(key, value)
        return value

    async def invalidate(self, key: str) -> int:
        """After a commit: delete the shared copy and tell every pod; returns how many pods heard it."""
        self.local.pop(key)
        await self.redis.delete(key)
        return int(await self.redis.publish(self.channel, key))

    async def wait_for(self, key: str, timeout: float = 2.0) -> bool:
        """Wait until this pod has processed an invalidation of ``key`` (demos)."""
        event = self._seen.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        event.clear()
        return True


# ---------------------------------------------------------------------------- hot keys


def replica_keys(key: str, replicas: int = 8) -> list[str]:
    return [f"{key}#{i}" for i in range(replicas)]


def replica_slots(key: str, replicas: int = 8) -> list[int]:
    """The Redis Cluster hash slot of each replica key: different slots land on different shards."""
    from redis.crc import key_slot

    return [key_slot(k.encode()) for k in replica_keys(key, replicas)]


async def set_replicated(redis, key: str, value: Any, *, replicas: int = 8, ttl: float = 60.0) -> None:
    """Write a hot key as ``replicas`` copies (each with its own jittered TTL)."""
    async with redis.pipeline(transaction=False) as pipe:
        for k in replica_keys(key, replicas):
            pipe.set(k, _dump(value), px=jittered_ms(ttl))
        await pipe.execute()


async def get_replicated(
    redis, key: str, *, replicas: int = 8, rand: Callable[[], float] = random.random
) -> tuple[str, Any]:
    """Read one copy chosen at random; returns ``(copy's key, value)``."""
    k = replica_keys(key, replicas)[int(rand() * replicas) % replicas]
    raw = await redis.get(k)
    return k, None if raw is None else json.loads(raw)


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


# ============================================================================ worker entry point


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("stampede-worker", "write-behind-worker"):
        raise SystemExit("usage: python -m course.caching stampede-worker|write-behind-worker SPEC_JSON")
    spec = json.loads(args[1])
    worker = _stampede_worker if args[0] == "stampede-worker" else _write_behind_worker
    asyncio.run(worker(spec))


if __name__ == "__main__":
    main()
