"""Chapter 04's demos of what happens around an outage: a lock holder that pauses, a database
that is down, a cache that comes back empty.

- :func:`fencing_demo`: a lock holder pauses past its lock's expiry and then writes; without
  fencing its stale write wins, with a fencing token the storage refuses it (table
  ``ch04_reports``, created by :func:`setup_reports`);
- :func:`stale_if_error_demo`: the database is down (its port refuses connections) and a
  circuit breaker opens; plain cache-aside answers with errors, serve-stale with
  stale-if-error answers with the last good value;
- :func:`cold_restart`: the cache restarts empty under traffic, with and without a pre-warm:
  the queries and the concurrency the database sees, the number capacity planning needs.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from course.breaker import CircuitBreaker
from course.caching import CacheAside, RedisLock, ServeStale
from course.chapters.ch04 import db_queries, max_concurrent_queries, prewarm, product_loader, reset_query_log

# ============================================================================ fencing tokens

REPORTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS ch04_reports (
    name       text   PRIMARY KEY,
    written_by text   NOT NULL,
    fence      bigint NOT NULL DEFAULT 0  -- the newest fencing token this row has accepted
);
"""


async def setup_reports(pool) -> None:
    async with pool.connection() as conn:
        await conn.execute(REPORTS_SCHEMA)


@dataclass
class FencingRun:
    fenced: bool
    steps: list[str] = field(default_factory=list)
    written_by: str = ""

    def __str__(self) -> str:
        head = "with a fencing token checked by the storage" if self.fenced else "lock only, no fencing"
        lines = [head, *(f"  {i + 1}. {s}" for i, s in enumerate(self.steps))]
        lines.append(f"  the report now says it was written by: {self.written_by}")
        return "\n".join(lines)


async def fencing_demo(redis, pool, *, fenced: bool, lock_ttl: float = 0.2) -> FencingRun:
    """Client 1 takes the lock, then pauses (a GC pause) until client 2 has taken the expired lock and
    written; then client 1 writes. The storage refuses a token older than one it has seen, if ``fenced``."""
    await setup_reports(pool)
    name = "lock:nightly-report"
    await redis.delete(name, f"{name}:fence")  # the demo starts the tokens and the row from zero together
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO ch04_reports (name, written_by, fence) VALUES ('nightly', 'nobody', 0) "
            "ON CONFLICT (name) DO UPDATE SET written_by = 'nobody', fence = 0"
        )
    run = FencingRun(fenced)
    t0 = time.perf_counter()
    second_wrote = asyncio.Event()

    def note(msg: str) -> None:
        run.steps.append(f"[{(time.perf_counter() - t0) * 1000:5.0f} ms] {msg}")

    async def write(who: str, token: int) -> bool:
        async with pool.connection() as conn:
            if fenced:  # the storage keeps the newest token and refuses older ones
                cur = await conn.execute(
                    "UPDATE ch04_reports SET written_by = %s, fence = %s WHERE name = 'nightly' AND fence < %s",
                    (who, token, token),
                )
            else:
                cur = await conn.execute(
                    "UPDATE ch04_reports SET written_by = %s WHERE name = 'nightly'", (who,)
                )
        return cur.rowcount == 1

    async def client_1() -> None:
        lock = RedisLock(redis, name, ttl=lock_ttl, fencing=True)
        await lock.acquire()
        note(
            f"client 1 takes the lock (token {lock.fence}, expires in {lock_ttl * 1000:.0f} ms), then pauses"
        )
        await second_wrote.wait()  # the pause outlives the lock
        ok = await write("client 1", lock.fence)
        verdict = "accepted" if ok else "REFUSED (token too old)"
        note(f"client 1 wakes, still believes it holds the lock, writes with token {lock.fence}: {verdict}")

    async def client_2() -> None:
        while await redis.exists(name):  # wait for client 1's lock to expire
            await asyncio.sleep(0.01)
        lock = RedisLock(redis, name, ttl=5, fencing=True)
        await lock.acquire()
        ok = await write("client 2", lock.fence)
        note(
            f"client 1's lock expired; client 2 takes it (token {lock.fence}), writes: {'accepted' if ok else 'refused'}"
        )
        await lock.release()
        second_wrote.set()

    await asyncio.gather(client_1(), client_2())
    async with pool.connection() as conn:
        row = await (
            await conn.execute("SELECT written_by FROM ch04_reports WHERE name = 'nightly'")
        ).fetchone()
    run.written_by = row[0]
    return run


# ============================================================================ stale-if-error


@dataclass
class OutageRun:
    name: str
    answered: int = 0
    errors: int = 0
    stale_answers: int = 0
    attempts: int = 0  # loads that reached the (dead) database
    breaker: str = ""

    def __str__(self) -> str:
        return (
            f"{self.name:30}{self.answered:>3} answered ({self.stale_answers} with the old value), "
            f"{self.errors:>2} errors; database tried {self.attempts}x, breaker {self.breaker}"
        )


def _db_down(err: BaseException) -> bool:
    return isinstance(err, (psycopg.OperationalError, OSError))


def _dead_database_url(url: str) -> str:
    """The same database, on a port where nothing listens: connecting is refused, like a server that is down."""
    return psycopg.conninfo.make_conninfo(url, host="127.0.0.1", port="1", connect_timeout="2")


async def stale_if_error_demo(pool, redis, database_url: str, *, requests: int = 50) -> list[OutageRun]:
    """The hot product's value is older than its stale window when the database goes down.

    Plain cache-aside (the key has expired) and serve-stale with stale-if-error each get
    ``requests`` requests, in waves of ten, through a circuit breaker of their own (chapter 02).
    """
    dead = _dead_database_url(database_url)
    plain = await _outage(redis, "cache-aside, key expired", CacheAside(redis, ttl=60), dead, requests)
    stale = ServeStale(redis, fresh=60, stale=600, stale_if_error=3600)
    key = "outage:stale:product:6"
    await redis.delete(key)
    await stale.get(key, product_loader(pool, 6))  # warmed while the database was up ...
    await stale.mark_stale(key, past_stale=True)  # ... and now older than fresh + stale
    return [plain, await _outage(redis, "serve stale + stale-if-error", stale, dead, requests, key=key)]


async def _outage(redis, name: str, cache, dead: str, requests: int, *, key: str | None = None) -> OutageRun:
    run = OutageRun(name)
    if key is None:
        key = "outage:aside:product:6"
        await redis.delete(key)
    breaker = CircuitBreaker(threshold=0.5, window_size=4, cooldown=30, name="postgres", is_failure=_db_down)

    async def down() -> Any:
        run.attempts += 1
        async with await psycopg.AsyncConnection.connect(dead) as conn:  # refused: the database is down
            return (await (await conn.execute("SELECT slow_product(6, 0)")).fetchone())[0]

    async def guarded() -> Any:
        return await breaker.call(down)

    for _wave in range(requests // 10):
        got = await asyncio.gather(*(cache.get(key, guarded) for _ in range(10)), return_exceptions=True)
        run.errors += sum(isinstance(x, BaseException) for x in got)
        run.answered += sum(not isinstance(x, BaseException) for x in got)
    run.stale_answers = getattr(cache, "served_on_error", 0)
    run.breaker = breaker.state
    return run


# ============================================================================ the cache comes back cold


@dataclass
class Restart:
    warm: bool
    keys: int
    requests: int
    prewarm_queries: int = 0
    prewarm_peak: int = 0
    traffic_queries: int = 0
    traffic_peak: int = 0
    traffic_ms: float = 0.0

    def __str__(self) -> str:
        if self.warm:
            return (
                f"pre-warmed: the pre-warm ran {self.prewarm_queries} queries before any traffic, at most "
                f"{self.prewarm_peak} at once;\n            then {self.requests} requests made "
                f"{self.traffic_queries} queries in {self.traffic_ms:.0f} ms"
            )
        return (
            f"cold:       {self.requests} requests made {self.traffic_queries} queries in {self.traffic_ms:.0f} ms, "
            f"up to {self.traffic_peak} at once"
        )


async def cold_restart(
    pool, redis, product_ids, *, warm: bool, waves: int = 4, load_seconds: float = 0.05, concurrency: int = 8
) -> Restart:
    """The cache comes back empty; ``waves`` waves of requests for every hot product arrive.

    With ``warm`` the hot keys are filled first, ``concurrency`` loads at a time. Queries are
    counted by PostgreSQL, separately for the pre-warm and for the traffic.
    """
    ids = list(product_ids)
    keys = {f"product:{i}": product_loader(pool, i, load_seconds) for i in ids}
    await redis.delete(*keys)  # the cache restarted empty
    run = Restart(warm, len(ids), waves * len(ids))
    if warm:
        await reset_query_log(pool)
        await prewarm(redis, keys, concurrency=concurrency)
        run.prewarm_queries = await db_queries(pool)
        run.prewarm_peak = await max_concurrent_queries(pool)
    await reset_query_log(pool)
    cache = CacheAside(redis, ttl=300)
    t0 = time.perf_counter()
    for _wave in range(waves):
        await asyncio.gather(*(cache.get(k, load) for k, load in keys.items()))
    run.traffic_ms = (time.perf_counter() - t0) * 1000
    run.traffic_queries = await db_queries(pool)
    run.traffic_peak = await max_concurrent_queries(pool)
    return run
