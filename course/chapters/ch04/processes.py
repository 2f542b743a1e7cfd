"""Chapter 04's demos that need other processes: a fleet of workers, and crashes.

- :func:`stampede_across_processes`: the hot key expires while several worker processes
  serve it, each with single-flight in process, with and without a Redis lock across them;
- :func:`write_behind_crash`: a worker acknowledges write-behind writes and is killed before
  its next flush (the acknowledged orders that never reach ``ch04_orders``);
- :func:`crash_holding_lock`: a process takes a lock and dies without releasing it.

The workers run this module: ``python -m course.chapters.ch04.processes stampede-worker|write-behind-worker SPEC_JSON``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from typing import Any

from course.caching import CacheAside, SingleFlight, WriteBehind, get_with_lock
from course.chapters.ch04 import Run, db_queries, insert_orders, product_loader, timed_burst

# ---------------------------------------------------------------------------- several worker processes


async def _blpop(redis, key: str, seconds: float) -> tuple[str, str] | None:
    """``BLPOP key`` for up to ``seconds``, asked one second at a time.

    redis-py (8.x) gives every connection a 5 s socket timeout by default, so one
    ``BLPOP`` longer than that raises ``TimeoutError`` although the server would still
    answer in time: worker processes starting on a busy machine can take longer than 5 s.
    """
    deadline = time.monotonic() + seconds
    while True:
        got = await redis.blpop([key], timeout=1)
        if got is not None or time.monotonic() >= deadline:
            return got


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
            "course.chapters.ch04.processes",
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
            if await _blpop(redis, f"{tag}:ready", 60) is None:
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
                    got = await _blpop(redis, f"{tag}:done", 60)
                    if got is None:
                        raise RuntimeError("a stampede worker did not report within 60 s")
                    latencies += json.loads(got[1])["latencies"]
            seconds = time.perf_counter() - t0
            name = f"Redis lock, {workers} processes" if lock else f"single-flight only, {workers} processes"
            queries = await db_queries(pool) - before
            runs.append(
                Run(name, queries, latencies, seconds, f"{rounds} expiries", rounds, load_seconds * 1000)
            )
    finally:
        for w in range(workers):
            await redis.rpush(f"{tag}:go:{w}", json.dumps({"stop": True}))
        errors = []
        for p in procs:
            try:
                _, err = await asyncio.wait_for(p.communicate(), 30)
            except TimeoutError:
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
    pool = AsyncConnectionPool(
        spec["database_url"], min_size=1, max_size=2, open=False, kwargs={"autocommit": True}
    )
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
            got = await _blpop(redis, f"{tag}:go:{w}", 120)
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
        await conn.execute("TRUNCATE ch04_orders")
    spec = {"redis_url": ns.redis_url, "database_url": ns.database_url, "orders": orders, "batch": batch}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "course.chapters.ch04.processes",
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
        in_db = (await (await conn.execute("SELECT count(*) FROM ch04_orders")).fetchone())[0]
    return {"acknowledged": len(acked), "in Redis": in_redis, "in PostgreSQL": int(in_db)}


async def _write_behind_worker(spec: dict) -> None:
    import redis.asyncio as aioredis
    from psycopg_pool import AsyncConnectionPool

    redis = aioredis.Redis.from_url(spec["redis_url"], decode_responses=True)
    pool = AsyncConnectionPool(
        spec["database_url"], min_size=1, max_size=1, open=False, kwargs={"autocommit": True}
    )
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


# ---------------------------------------------------------------------------- worker entry point


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("stampede-worker", "write-behind-worker"):
        raise SystemExit(
            "usage: python -m course.chapters.ch04.processes stampede-worker|write-behind-worker SPEC_JSON"
        )
    spec = json.loads(args[1])
    worker = _stampede_worker if args[0] == "stampede-worker" else _write_behind_worker
    asyncio.run(worker(spec))


if __name__ == "__main__":
    main()
