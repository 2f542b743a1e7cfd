"""Chapter 12's shortener: codes, links, the redirect path, clicks, the service and its demos."""

from __future__ import annotations

import asyncio
import contextlib
import random

import httpx
import psycopg
import pytest
import redis as redis_sync

from course import shortener, shortener_app
from course.chapters import ch12
from course.idempotency import IdempotencyKeyReused
from course.kit.faults import VirtualClock
from course.kit.serve import Service

# ============================================================================ codes


def test_base62_pads_to_seven_characters_and_reads_back():
    assert shortener.base62(0) == "0000000"
    assert shortener.base62(61) == "000000z"
    assert shortener.base62(shortener.ID_SPACE - 1) == "zzzzzzz"
    for n in (0, 1, 62, 62**6, shortener.ID_SPACE - 1):
        assert shortener.unbase62(shortener.base62(n)) == n


def test_codes_round_trip_on_the_edges_and_at_random():
    rnd = random.Random(12)
    ids = [0, 1, 2, shortener.ID_SPACE - 2, shortener.ID_SPACE - 1] + [
        rnd.randrange(shortener.ID_SPACE) for _ in range(500)
    ]
    codes = [shortener.encode_code(n) for n in ids]
    assert all(len(c) == 7 and set(c) <= set(shortener.ALPHABET) for c in codes)
    assert [shortener.decode_code(c) for c in codes] == ids
    assert len(set(codes)) == len(set(ids))


def test_every_code_decodes_to_an_id_that_encodes_back():
    rnd = random.Random(13)
    for _ in range(500):
        code = "".join(rnd.choice(shortener.ALPHABET) for _ in range(7))
        n = shortener.decode_code(code)
        assert 0 <= n < shortener.ID_SPACE and shortener.encode_code(n) == code


def test_the_shuffle_depends_on_the_key():
    assert shortener.encode_code(1) != shortener.encode_code(1, key=b"another key")
    assert shortener.decode_code(shortener.encode_code(77, key=b"k2"), key=b"k2") == 77


@pytest.mark.parametrize("bad", [-1, shortener.ID_SPACE])
def test_ids_outside_the_space_are_refused(bad):
    with pytest.raises(ValueError):
        shortener.encode_code(bad)


@pytest.mark.parametrize("bad", ["abc", "abc!def", "abcdefgh", 1234567])
def test_malformed_codes_are_refused(bad):
    with pytest.raises(ValueError):
        shortener.decode_code(bad)


def test_consecutive_codes_look_unrelated_and_counting_up_does_not():
    shuffled = ch12.consecutive_stats([shortener.encode_code(n) for n in range(1, 3001)])
    counting = ch12.consecutive_stats([shortener.base62(n) for n in range(1, 3001)])
    stepped = ch12.consecutive_stats([ch12.multiplicative(n) for n in range(1, 3001)])
    assert shuffled[0] < 0.3 and shuffled[1] < 0.2
    assert counting[0] > 5 and counting[1] == 1.0
    assert stepped[1] == 1.0


def test_the_attacks_find_neighbours_of_sequential_codes_only():
    plain = ch12.attack("plain", shortener.base62, links=500, trials=50)
    keyed = ch12.attack("keyed", shortener.encode_code, links=500, trials=50)
    assert plain.neighbours_found > 19 and plain.next_guessed == 1  # all but past the ends of the range
    assert keyed.neighbours_found == 0 and keyed.next_guessed == 0


@pytest.mark.parametrize("alias", ["spring-sale", "abc", "x_y_z_2026"])
def test_usable_aliases(alias):
    assert shortener.validate_alias(alias) == alias


@pytest.mark.parametrize("alias", ["ab", "has space", "promo26", "a" * 33])
def test_aliases_refused_including_the_shape_of_a_generated_code(alias):
    with pytest.raises(shortener.InvalidLink):
        shortener.validate_alias(alias)


def test_estimates_see_that_a_million_a_second_does_not_follow():
    e = ch12.estimates()
    assert round(e["writes_per_s"], 1) == 38.6
    assert round(e["reads_per_s"]) == 386
    assert e["peak_over_average"] > 2000
    assert round(e["years_of_codes"]) == 2935


# ============================================================================ links


@pytest.fixture
async def pool(ans):
    p = await ans.pool(max_size=8)
    await shortener.setup_schema(p)
    return p


async def test_create_link_with_a_key_is_idempotent_and_refuses_another_body(pool):
    first = await shortener.create_link(pool, "https://example.com/a", idempotency_key="k")
    assert await shortener.create_link(pool, "https://example.com/a", idempotency_key="k") == first
    with pytest.raises(IdempotencyKeyReused):
        await shortener.create_link(pool, "https://example.com/b", idempotency_key="k")
    assert await shortener.find_link(pool, first["code"]) == "https://example.com/a"


async def test_concurrent_creates_with_one_key_make_one_link(pool):
    got = await asyncio.gather(
        *(shortener.create_link(pool, "https://example.com/c", idempotency_key="c") for _ in range(8))
    )
    assert len({g["code"] for g in got}) == 1
    async with pool.connection() as conn:
        (n,) = await (await conn.execute("SELECT count(*) FROM links WHERE url = 'https://example.com/c'")).fetchone()
    assert n == 1


async def test_an_alias_is_taken_once(pool):
    assert (await shortener.create_link(pool, "https://example.com/x", alias="spring-sale"))["code"] == "spring-sale"
    with pytest.raises(shortener.AliasTaken):
        await shortener.create_link(pool, "https://example.com/y", alias="spring-sale")


async def test_alias_race_with_the_gate_shows_the_lookup_first_bug(ans, pool):
    watcher = await psycopg.AsyncConnection.connect(ans.database_url, autocommit=True)
    try:
        await ch12.insert_gate(watcher)
        naive = await ch12.alias_race(pool, watcher, ch12.check_then_insert_alias, "launch", n=5)
        fixed = await ch12.alias_race(
            pool, watcher, lambda p, url, alias: shortener.create_link(p, url, alias=alias), "sale", n=5
        )
        await ch12.remove_gate(watcher)
    finally:
        await watcher.close()
    assert sum(isinstance(x, psycopg.errors.UniqueViolation) for x in naive) == 4
    assert sum(isinstance(x, shortener.AliasTaken) for x in fixed) == 4
    assert sum(isinstance(x, dict) for x in fixed) == 1


async def test_invalid_urls_are_refused(pool):
    with pytest.raises(shortener.InvalidLink):
        await shortener.create_link(pool, "ftp://example.com/file")


# ============================================================================ the redirect path


async def test_resolve_caches_links_and_misses(ans, pool):
    link = await shortener.create_link(pool, "https://example.com/r")
    redis = ans.redis()
    br = shortener.cache_breaker(clock=VirtualClock())
    assert await shortener.resolve(link["code"], redis, pool, br) == "https://example.com/r"
    assert shortener.SERVED_FROM.get() == "database"
    assert await shortener.resolve(link["code"], redis, pool, br) == "https://example.com/r"
    assert shortener.SERVED_FROM.get() == "cache"
    assert await shortener.resolve("nothere", redis, pool, br) is None
    assert await redis.get(shortener.cache_key("nothere")) == shortener.MISS
    assert 0 < await redis.pttl(shortener.cache_key("nothere")) <= shortener.MISS_TTL * 1000


async def test_resolve_without_redis_reads_postgres_and_opens_the_breaker(pool):
    link = await shortener.create_link(pool, "https://example.com/d")
    dead = shortener_app.redis_client("unix:///tmp/ch12-no-such-redis.sock")
    br = shortener.cache_breaker(clock=VirtualClock())
    try:
        got = [await shortener.resolve(link["code"], dead, pool, br) for _ in range(15)]
    finally:
        await dead.aclose()
    assert got == ["https://example.com/d"] * 15
    assert br.state == "open"


def test_redis_errors_count_as_failures_and_others_do_not():
    import redis.exceptions

    assert shortener.redis_failure(redis.exceptions.ConnectionError("refused"))
    assert shortener.redis_failure(redis.exceptions.TimeoutError("slow"))
    assert not shortener.redis_failure(redis.exceptions.ResponseError("WRONGTYPE"))
    assert not shortener.redis_failure(KeyError("bug"))


# ============================================================================ clicks


def test_the_recorder_samples_with_weights_above_its_high_water_mark():
    out = ch12.sampling_demo(20_000, high_water=1_000, sample_every=10)
    assert 2_500 < out["events_kept"] < 3_300
    assert abs(out["estimate"] / out["clicks"] - 1) < 0.1


async def test_clicks_reach_postgres_once_even_when_the_ack_is_lost(ans, pool):
    redis = ans.redis()
    stream = ans.key_prefix + "clicks"
    rec = shortener.ClickRecorder(redis, stream, clock=lambda: 1_700_000_000.0)
    for code in ["a"] * 30 + ["b"] * 12:
        rec.record(code)
    assert await rec.flush() == 42
    first = shortener.ClickAggregator(redis, pool, stream)
    await first.poll()

    async def lost(*args):  # the process dies between the commit and the XACK
        raise ConnectionError("gone")

    first.redis = type("NoAck", (), {"xack": staticmethod(lost)})()
    with pytest.raises(ConnectionError):
        await first.flush()
    second = shortener.ClickAggregator(redis, pool, stream)
    assert await second.drain() == 0  # redelivered, recognised as counted
    async with pool.connection() as conn:
        rows = dict(await (await conn.execute("SELECT code, clicks FROM link_clicks")).fetchall())
    assert rows == {"a": 30, "b": 12}
    assert (await redis.xpending(stream, "aggregator"))["pending"] == 0


# ============================================================================ the service


async def test_the_service_creates_redirects_counts_and_flushes_on_stop(ans, pool):
    app = shortener_app.make_app(ans.database_url, ans.redis_url, key_prefix=ans.key_prefix)
    svc = await asyncio.to_thread(Service(app, name="test-12-service").start)
    try:
        async with httpx.AsyncClient(base_url=svc.url) as http:
            made = await http.post(
                "/api/links", json={"url": "https://example.com/s"}, headers={"Idempotency-Key": "s"}
            )
            assert made.status_code == 201
            code = made.json()["code"]
            again = await http.post(
                "/api/links", json={"url": "https://example.com/s"}, headers={"Idempotency-Key": "s"}
            )
            assert again.json() == made.json()
            assert (await http.post("/api/links", json={"url": "nope"})).status_code == 400
            hops = [await http.get(f"/{code}") for _ in range(25)]
            assert {h.status_code for h in hops} == {302}
            assert [h.headers["x-cache"] for h in hops[:2]] == ["miss", "hit"]
            assert (await http.get("/nothere")).status_code == 404
            assert (await http.get("/api/links/nothere/stats")).status_code == 404
    finally:
        await asyncio.to_thread(svc.stop)
    assert await ch12.clicks_in_database(pool, [code]) == 25
    assert app.state.shutdown == {"unshipped": 0, "flushed": 25}


async def test_a_database_error_is_a_503_and_an_unfinished_answer_a_501(ans, pool):
    async def down(code, redis, pool, breaker):
        raise psycopg.OperationalError("connection refused")

    async def stub(code, redis, pool, breaker):
        raise NotImplementedError("not done yet")

    for resolve, status in ((down, 503), (stub, 501)):
        app = shortener_app.make_app(ans.database_url, ans.redis_url, key_prefix=ans.key_prefix, resolve=resolve)
        svc = await asyncio.to_thread(Service(app, name="test-12-errors").start)
        try:
            async with httpx.AsyncClient(base_url=svc.url) as http:
                got = await http.get("/abcdefg")
        finally:
            await asyncio.to_thread(svc.stop)
        assert got.status_code == status, got.text
        if status == 503:
            assert got.headers["retry-after"] == "1"


async def test_the_load_generator_alternates_paths_in_one_run(ans, pool):
    links = await ch12.make_links(pool, 50)
    await ch12.warm(ans.redis(), links)
    app = shortener_app.make_app(ans.database_url, ans.redis_url, key_prefix=ans.key_prefix, honor_no_cache=True)
    svc = await asyncio.to_thread(Service(app, name="test-12-load").start)
    try:
        run = await ch12.run_load(
            svc.port, [f"/{c}" for c in links], ch12.alternating(ch12.PATHS, 0.6, every=0.2, warm_up=0.1), connections=4
        )
    finally:
        await asyncio.to_thread(svc.stop)
    stats = run.by_label()
    assert set(stats) == {"cache", "database"}
    assert set(stats["cache"]["x_cache"]) == {"hit"} and set(stats["database"]["x_cache"]) == {"bypass"}
    assert stats["cache"]["errors"] == stats["database"]["errors"] == 0
    assert all(r[2] == 302 for r in run.records)


def test_the_demo_redis_dies_and_comes_back_empty_on_the_same_socket():
    with ch12.DemoRedis() as demo:
        client = redis_sync.Redis.from_url(demo.url)
        client.set("k", "v")
        demo.kill()
        with pytest.raises(redis_sync.exceptions.ConnectionError):
            client.ping()
        demo.restart()
        assert client.ping() and client.get("k") is None
        client.close()
    assert not demo.run.exists()


def test_12_the_outage_plot_draws_the_breaker_band():
    """The Redis-killed plot from a made-up run: every request kind, the outage, the breaker's states."""
    import matplotlib.pyplot as plt

    from course.breaker import CLOSED, HALF_OPEN, OPEN

    records = [[t / 10, 2.0, 200, "x", "hit"] for t in range(10)] + [[1.0, 40.0, 503, "x", None]]
    load = ch12.LoadRun(start=0.0, seconds=2.0, connections=1, records=records)
    run = ch12.OutageRun("breaker", load, (0.5, 1.5), [(0.0, CLOSED), (0.6, OPEN), (1.2, HALF_OPEN)], {})
    fig = ch12.plot_outages([run, run])
    assert len(fig.axes) >= 2
    plt.close(fig)


async def test_the_click_aggregator_survives_a_database_error_and_counts_it(ans, pool):
    """It died on its first PostgreSQL error (only Redis errors were caught): clicks then piled
    up unacknowledged while the service looked healthy."""
    redis = ans.redis()
    stream = ans.key_prefix + "clicks-outage"
    rec = shortener.ClickRecorder(redis, stream, clock=lambda: 1_700_000_000.0)
    for _ in range(5):
        rec.record("a")
    await rec.flush()
    agg = shortener.ClickAggregator(redis, pool, stream)
    real_flush, failures = agg.flush, []

    async def flush_fails_twice():
        if len(failures) < 2:
            failures.append(1)
            raise psycopg.OperationalError("the database is restarting")
        return await real_flush()

    agg.flush = flush_fails_twice
    agg.errors.rand = lambda: 0.0  # no backoff: the test waits for the rounds, not for the jitter
    task = asyncio.ensure_future(agg.run(every=0.01))
    try:
        deadline = asyncio.get_running_loop().time() + 60  # generous: a loaded machine slows the rounds
        while asyncio.get_running_loop().time() < deadline:
            if agg.flushed == 5 and agg.errors.streak == 0:  # a whole round went through
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)  # a loop that swallows its cancel fails here instead of hanging
    assert agg.flushed == 5 and agg.errors.count == 2 and "OperationalError" in agg.errors.last, agg.errors


async def test_concurrent_misses_of_a_hot_link_read_postgres_once_with_single_flight(ans, pool, monkeypatch):
    """After Redis restarts empty, every request for a hot link went to PostgreSQL at once."""
    from course.caching import SingleFlight

    made = await shortener.create_link(pool, "https://example.com/hot")
    reads, real = [], shortener.find_link

    async def counted(pool_, code):
        reads.append(code)
        await asyncio.sleep(0.01)  # the query takes a moment: everyone arrives while it runs
        return await real(pool_, code)

    monkeypatch.setattr(shortener, "find_link", counted)
    breaker, redis, flight = shortener.cache_breaker(), ans.redis(), SingleFlight()
    got = await asyncio.gather(
        *(shortener.resolve(made["code"], redis, pool, breaker, flight=flight) for _ in range(50))
    )
    assert set(got) == {"https://example.com/hot"} and len(reads) == 1, len(reads)


# ============================================================================ what changes at scale


async def test_12_a_time_partitioned_table_refuses_unique_code_and_an_id_range_routes_by_decode(pool):
    parts = await ch12.scale.partition_demo(pool)
    assert "must include all partitioning columns" in parts["refused"]
    assert shortener.decode_code(parts["code"]) == parts["id"]
    assert "ch12_links_by_id_1" in parts["plan"][0] and "ch12_links_by_id_0" not in "".join(parts["plan"])
    async with pool.connection() as conn:  # the demo rolled everything back
        assert (await (await conn.execute("SELECT to_regclass('ch12_links_by_id')")).fetchone())[0] is None


def test_12_truncated_hashes_collide_near_the_birthday_bound():
    found = ch12.scale.first_collisions(3, trials=100)
    assert 0.8 < found["mean"] / found["predicted"] < 1.25, found
    assert ch12.scale.expected_pairs(1e8, shortener.ID_SPACE) > 1_000  # a month of hashed 7-character codes


def test_12_an_append_only_redis_keeps_every_acknowledged_entry_it_wrote_through_sigkill():
    aof = ch12.scale.aof_after_kill(500)
    assert aof["policy"] == "everysec" and aof["acknowledged"] == 500
    if aof["held"] == 0:  # every acknowledged entry was with the operating system: a process kill loses none
        assert aof["after_kill"] == 500, aof
    else:  # a loaded disk: Redis held its write back behind a slow fsync (make test met it: 125 of 500 back)
        assert aof["after_kill"] <= 500, aof
