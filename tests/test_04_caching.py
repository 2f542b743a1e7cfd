"""Chapter 04's reference code (course.caching) and its demos (course.chapters.ch04) against the live
servers: one behaviour per test."""

from __future__ import annotations

import asyncio
import json

import pytest

from course import caching
from course.chapters import ch04
from course.chapters.ch04 import outages, processes
from course.kit.faults import VirtualClock


async def _catalog(ns, max_size: int = 10):
    pool = await ns.pool(max_size=max_size)
    await ch04.setup_catalog(pool, products=10)
    return pool, ns.redis()


# ---------------------------------------------------------------------------- tables that count their queries


async def test_the_users_view_counts_every_query_on_the_database_side(ans):
    pool = await ans.pool()
    await ch04.setup_users(pool, n=5)
    await ch04.setup_users(pool, n=5)  # idempotent
    before = await ch04.user_queries(pool)
    assert await ch04.fetch_user(pool, 3) == {"id": 3, "name": "user 3", "email": "user3@example.com"}
    assert await ch04.fetch_user(pool, 99) is None
    assert await ch04.user_queries(pool) == before + 2


def test_setup_users_sync_makes_the_same_table(ns):
    with ns.connect() as conn:
        ch04.setup_users_sync(conn, n=3)
        assert conn.execute("SELECT count(*) FROM users").fetchone()[0] == 3


async def test_slow_product_logs_each_query_and_its_overlap(ans):
    pool, _ = await _catalog(ans)
    await asyncio.gather(*(ch04.load_product(pool, 1, 0.05) for _ in range(3)))
    assert await ch04.db_queries(pool, "product:1") == 3
    assert await ch04.max_concurrent_queries(pool) == 3


# ---------------------------------------------------------------------------- TTLs and single-flight


def test_jittered_ttls_stay_between_ttl_and_ttl_plus_jitter():
    assert caching.jittered_ms(60, 0.2, lambda: 0.0) == 60_000
    assert caching.jittered_ms(60, 0.2, lambda: 0.999999) == 71_999


async def test_single_flight_shares_one_load_and_forgets_it_afterwards():
    flight = caching.SingleFlight()
    gate = asyncio.Event()
    calls = 0

    async def load():
        nonlocal calls
        calls += 1
        await gate.wait()
        return calls

    waiters = [asyncio.ensure_future(flight.do("k", load)) for _ in range(20)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*waiters) == [1] * 20
    assert flight.in_flight() == 0
    assert await flight.do("k", load) == 2


async def test_single_flight_gives_every_waiter_the_error_and_does_not_keep_it():
    flight = caching.SingleFlight()

    async def boom():
        await asyncio.sleep(0)
        raise ConnectionError("db down")

    results = await asyncio.gather(*(flight.do("k", boom) for _ in range(5)), return_exceptions=True)
    assert all(isinstance(x, ConnectionError) for x in results)
    assert flight.in_flight() == 0


async def test_a_cancelled_caller_does_not_cancel_the_shared_load():
    flight = caching.SingleFlight()
    gate = asyncio.Event()

    async def load():
        await gate.wait()
        return "v"

    first = asyncio.ensure_future(flight.do("k", load))
    second = asyncio.ensure_future(flight.do("k", load))
    await asyncio.sleep(0)
    first.cancel()
    gate.set()
    assert await second == "v"


# ---------------------------------------------------------------------------- the stampede


async def test_a_stampede_without_protection_makes_a_query_per_request(ans):
    pool, redis = await _catalog(ans)
    run = await ch04.stampede(pool, redis, "none", n=8, load_seconds=0.05)
    assert run.queries == 8


async def test_single_flight_makes_one_query_for_the_burst(ans):
    pool, redis = await _catalog(ans)
    run = await ch04.stampede(pool, redis, "single-flight", n=30, load_seconds=0.05)
    assert run.queries == 1


async def test_serve_stale_answers_from_the_old_value_and_refreshes_once(ans):
    pool, redis = await _catalog(ans)
    run = await ch04.stampede(pool, redis, "serve-stale", n=30, load_seconds=0.05)
    assert run.queries == 1


async def test_stale_hits_return_while_the_refresh_is_still_running(ans):
    redis = ans.redis()
    cache = caching.ServeStale(redis, fresh=60)
    gate = asyncio.Event()
    loads = 0

    async def load():
        nonlocal loads
        loads += 1
        if loads > 1:
            await gate.wait()  # the refresh hangs until we let it go
        return loads

    assert await cache.get("k", load) == 1
    await cache.mark_stale("k")
    assert await asyncio.gather(*(cache.get("k", load) for _ in range(30))) == [1] * 30
    assert loads == 2 and cache.stale_hits == 30
    gate.set()
    await cache.drain()
    assert await cache.get("k", load) == 2


async def test_cache_aside_caches_misses_only_with_a_miss_ttl(ans):
    pool, redis = await _catalog(ans)
    plain = caching.CacheAside(redis, ttl=60)
    negative = caching.CacheAside(redis, ttl=60, miss_ttl=5)
    for _ in range(3):
        assert await plain.get("product:404", ch04.product_loader(pool, 404)) is None
    assert await ch04.db_queries(pool, "product:404") == 3
    for _ in range(3):
        assert await negative.get("product:404", ch04.product_loader(pool, 404)) is None
    assert await ch04.db_queries(pool, "product:404") == 4
    assert 0 < await redis.pttl("product:404") <= 6000


async def test_across_processes_single_flight_loads_once_per_process_and_the_lock_once(ans):
    await _catalog(ans)
    per_process, locked = await processes.stampede_across_processes(
        ans, workers=2, per_worker=5, rounds=2, load_seconds=0.05
    )
    assert per_process.queries == 4 and per_process.per_expiry == 2
    assert locked.queries == 2 and locked.per_expiry == 1
    assert len(locked.latencies_ms) == 20


async def test_early_expiration_refreshes_certainly_at_expiry_and_rarely_long_before():
    assert caching.early_refresh_probability(0, delta=1) == 1.0
    assert caching.early_refresh_probability(5, delta=1) == pytest.approx(0.0067, abs=1e-4)


async def test_early_expiration_recomputes_before_the_key_expires(ans):
    pool, redis = await _catalog(ans)
    clock = VirtualClock(1000)
    cache = caching.EarlyExpiry(redis, ttl=60, clock=clock, rand=lambda: 0.5)
    loader = ch04.product_loader(pool, 1)
    await cache.get("product:1", loader)
    clock.advance(59.99)  # 10 ms before expiry; the load took no virtual time, so delta is its 1 ms floor
    await cache.get("product:1", loader)  # gap = 1 ms * -ln(0.5) = 0.7 ms: not yet
    assert await ch04.db_queries(pool, "product:1") == 1
    cache.rand = lambda: 1e-12  # gap = 1 ms * 27.6 = 27.6 ms, past the expiry: refresh now
    await cache.get("product:1", loader)
    assert await ch04.db_queries(pool, "product:1") == 2
    assert cache.early == 1


async def test_readers_that_draw_an_early_refresh_while_one_runs_get_the_cached_value(ans):
    redis = ans.redis()
    clock = VirtualClock(1000)
    cache = caching.EarlyExpiry(redis, ttl=60, clock=clock, rand=lambda: 1e-12)
    gate = asyncio.Event()
    loads = 0

    async def load():
        nonlocal loads
        loads += 1
        if loads > 1:
            await gate.wait()
        return loads

    assert await cache.get("k", load) == 1
    clock.advance(59.99)
    refresher = asyncio.ensure_future(cache.get("k", load))
    while loads < 2:  # until the refresher is inside its load (a Redis GET away)
        await asyncio.sleep(0.001)
    assert await asyncio.gather(*(cache.get("k", load) for _ in range(10))) == [1] * 10
    gate.set()
    assert await refresher == 2 and loads == 2


# ---------------------------------------------------------------------------- locks


async def test_fencing_tokens_grow_with_every_acquisition_and_only_on_success(ans):
    redis = ans.redis()
    first = caching.RedisLock(redis, "lock:f", ttl=5, fencing=True)
    second = caching.RedisLock(redis, "lock:f", ttl=5, fencing=True)
    assert await first.acquire() and first.fence == 1
    assert not await second.acquire() and second.fence is None
    await first.release()
    assert await second.acquire() and second.fence == 2


async def test_the_storage_refuses_a_paused_holders_write_only_with_fencing(ans):
    pool, redis = await _catalog(ans)
    plain = await outages.fencing_demo(redis, pool, fenced=False, lock_ttl=0.05)
    fenced = await outages.fencing_demo(redis, pool, fenced=True, lock_ttl=0.05)
    assert plain.written_by == "client 1" and fenced.written_by == "client 2"
    assert "REFUSED" in fenced.steps[-1]


async def test_stale_if_error_answers_with_the_old_value_while_the_database_is_down(ans):
    pool, redis = await _catalog(ans)
    plain, stale = await outages.stale_if_error_demo(pool, redis, ans.database_url, requests=60)
    assert plain.errors == 60 and plain.answered == 0
    assert stale.answered == 60 and stale.stale_answers == 60 and stale.errors == 0
    assert stale.breaker == "open" and stale.attempts <= 4  # the breaker stops the attempts


async def test_a_cold_restart_sends_each_hot_key_to_the_database_and_a_prewarm_takes_them_first(ans):
    pool, redis = await _catalog(ans)
    cold = await outages.cold_restart(pool, redis, range(1, 9), warm=False, waves=2, load_seconds=0)
    warm = await outages.cold_restart(pool, redis, range(1, 9), warm=True, waves=2, load_seconds=0, concurrency=3)
    assert cold.traffic_queries == 8 and warm.traffic_queries == 0
    assert warm.prewarm_queries == 8 and warm.prewarm_peak <= 3


async def test_only_the_holder_can_release_a_redis_lock(ans):
    redis = ans.redis()
    mine = caching.RedisLock(redis, "lock:x", ttl=5)
    theirs = caching.RedisLock(redis, "lock:x", ttl=5)
    assert await mine.acquire()
    assert not await theirs.acquire()
    theirs.token = "guess"
    assert not await theirs.release()
    assert await redis.exists("lock:x")
    assert await mine.release()
    assert not await redis.exists("lock:x")


async def test_a_redis_lock_expires_so_a_dead_holder_cannot_block_forever(ans):
    redis = ans.redis()
    assert await caching.RedisLock(redis, "lock:y", ttl=0.05).acquire()
    for _ in range(200):
        if not await redis.exists("lock:y"):
            break
        await asyncio.sleep(0.01)
    assert await caching.RedisLock(redis, "lock:y", ttl=5).acquire()


async def test_a_crashed_redis_py_lock_holder_leaves_a_lock_without_expiry(ans):
    processes.crash_holding_lock(ans.redis_url, "report", redis_py=True)
    processes.crash_holding_lock(ans.redis_url, "report-ttl", redis_py=False, ttl=30)
    redis = ans.redis()
    assert await redis.pttl("report") == -1
    assert 0 < await redis.pttl("report-ttl") <= 30_000


# ---------------------------------------------------------------------------- strategies and crashes


async def test_write_through_reads_its_own_write_from_the_cache(ans):
    pool, redis = await _catalog(ans)
    cache = caching.WriteThrough(redis, lambda pid, price: ch04.update_product(pool, pid, price), prefix="product")
    stored = await cache.put(2, 999)
    assert await cache.get(2) == stored and stored["price_cents"] == 999


async def test_write_behind_loses_acknowledged_writes_when_the_process_dies(ans):
    await _catalog(ans)
    seen = await processes.write_behind_crash(ans, orders=7, batch=5)
    assert seen == {"acknowledged": 7, "in Redis": 7, "in PostgreSQL": 5}


async def test_read_through_hides_the_loader(ans):
    pool, redis = await _catalog(ans)
    products = caching.ReadThrough(redis, lambda pid: ch04.load_product(pool, pid), prefix="p", ttl=60)
    assert (await products.get(3))["id"] == 3
    assert (await products.get(3))["id"] == 3
    assert await ch04.db_queries(pool, "product:3") == 1


# ---------------------------------------------------------------------------- avalanche


async def test_keys_written_together_with_one_ttl_expire_in_the_same_second(ans):
    redis = ans.redis()
    await ch04.write_many(redis, "same", 200, ttl=60)
    await ch04.write_many(redis, "jit", 200, ttl=60, jitter=0.2)
    same = ch04.expiries_per_second(await ch04.seconds_to_expiry(redis, "same", 200))
    spread = ch04.expiries_per_second(await ch04.seconds_to_expiry(redis, "jit", 200))
    assert max(same.values()) >= 190
    assert max(spread.values()) < 60 and len(spread) >= 10


async def test_prewarm_fills_every_key_with_a_ttl(ans):
    pool, redis = await _catalog(ans)
    keys = {f"product:{i}": ch04.product_loader(pool, i) for i in range(1, 6)}
    assert await ch04.prewarm(redis, keys, ttl=60) == 5
    assert all([0 < await redis.pttl(k) for k in keys])


# ---------------------------------------------------------------------------- the read-then-set race


async def test_delete_on_write_leaves_the_old_row_cached_for_the_ttl(ans):
    pool, redis = await _catalog(ans)
    res = await ch04.read_then_set_race(redis, pool, 5, fix="none")
    assert res.stale and res.ttl_left > 200


async def test_versioned_writes_refuse_the_late_older_fill(ans):
    pool, redis = await _catalog(ans)
    res = await ch04.read_then_set_race(redis, pool, 5, fix="versioned")
    assert not res.stale and res.cached == res.database
    assert any("refused" in s for s in res.steps)


async def test_delayed_double_delete_removes_the_stale_fill(ans):
    pool, redis = await _catalog(ans)
    res = await ch04.read_then_set_race(redis, pool, 5, fix="double-delete", second_delete_after=0.02)
    assert res.cached is caching.MISSING


async def test_delayed_double_delete_misses_a_reader_slower_than_the_delay(ans):
    pool, redis = await _catalog(ans)
    res = await ch04.read_then_set_race(redis, pool, 5, fix="double-delete, slow reader", second_delete_after=0.02)
    assert res.stale


async def test_versioned_writes_reopen_the_race_once_the_newer_entry_is_gone(ans):
    pool, redis = await _catalog(ans)
    res = await ch04.read_then_set_race(redis, pool, 5, fix="versioned, evicted")
    assert res.stale and any("stored" in s for s in res.steps)


async def test_versioned_set_keeps_the_newest_version(ans):
    redis = ans.redis()
    assert await caching.versioned_set(redis, "v", 2, {"p": 2})
    assert not await caching.versioned_set(redis, "v", 1, {"p": 1})
    assert not await caching.versioned_set(redis, "v", 2, {"p": "again"})
    assert await caching.versioned_get(redis, "v") == {"p": 2}


# ---------------------------------------------------------------------------- in-process caches


def test_the_local_lru_evicts_the_least_recently_used_and_expires_entries():
    clock = VirtualClock()
    lru = caching.LocalLRU(maxsize=2, ttl=10, clock=clock)
    lru.set("a", 1)
    lru.set("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.set("c", 3)
    assert "b" not in lru and lru.evictions == 1
    clock.advance(10)
    assert lru.get("a") is caching.MISSING


async def test_pub_sub_invalidates_other_pods_but_a_reconnecting_pod_misses_it(ans):
    pool, redis = await _catalog(ans)
    clock = VirtualClock()
    channel = ans.key_prefix + "invalidate"
    a = await caching.NearCache(redis, channel, caching.LocalLRU(ttl=10, clock=clock), name="a").start()
    b = await caching.NearCache(ans.redis(), channel, caching.LocalLRU(ttl=10, clock=clock), name="b").start()
    loader = ch04.product_loader(pool, 1)
    try:
        await a.get("product:1", loader)
        await b.get("product:1", loader)
        assert await a.invalidate("product:1") == 2
        assert await b.wait_for("product:1")
        assert "product:1" not in b.local

        await b.get("product:1", loader)
        await b.stop()  # cut off
        assert await a.invalidate("product:1") == 1
        assert "product:1" in b.local  # missed it: stale while it does not know
        clock.advance(10)
        assert "product:1" not in b.local  # ... until the local TTL
    finally:
        await a.stop()
        await b.stop()


@pytest.mark.parametrize("flush", [True, False])
async def test_a_near_cache_that_subscribes_again_flushes_what_it_held(ans, flush):
    pool, redis = await _catalog(ans)
    clock = VirtualClock()
    channel = ans.key_prefix + "invalidate-flush"
    a = await caching.NearCache(redis, channel, caching.LocalLRU(ttl=10, clock=clock), name="a").start()
    b = caching.NearCache(redis, channel, caching.LocalLRU(ttl=10, clock=clock), name="b", flush_on_subscribe=flush)
    await b.start()
    loader = ch04.product_loader(pool, 2)
    try:
        await b.get("product:2", loader)
        await b.stop()
        await ch04.update_product(pool, 2, 4242)
        assert await a.invalidate("product:2") == 1  # b is not listening
        await b.start()
        price = (await b.get("product:2", loader))["price_cents"]
        assert price == (4242 if flush else 200)  # without the rule: stale until the local TTL
    finally:
        await a.stop()
        await b.stop()


async def test_a_near_cache_flushes_when_redis_drops_its_subscription_and_it_reconnects(ans):
    redis = ans.redis()
    b = await caching.NearCache(redis, ans.key_prefix + "dropped", caching.LocalLRU(ttl=10), name="b").start()
    try:
        b.local.set("k", 1)
        for client in await redis.client_list(_type="pubsub"):
            await redis.client_kill_filter(_id=client["id"])
        for _ in range(200):
            if b.subscribes > 1:
                break
            await asyncio.sleep(0.01)
        assert b.subscribes == 2 and "k" not in b.local
        assert await redis.publish(ans.key_prefix + "dropped", "x") == 1  # subscribed again
    finally:
        await b.stop()


async def test_hot_key_replicas_land_in_different_cluster_slots(ans):
    redis = ans.redis()
    assert len(set(caching.replica_slots("product:1", 8))) == 8
    await caching.set_replicated(redis, "product:1", {"id": 1}, replicas=8)
    key, value = await caching.get_replicated(redis, "product:1", replicas=8, rand=lambda: 0.99)
    assert key == "product:1#7" and value == {"id": 1}


def test_the_worker_entry_point_refuses_unknown_commands():
    with pytest.raises(SystemExit):
        processes.main(["dance", json.dumps({})])
