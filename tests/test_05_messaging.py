"""Chapter 05's reference consumer (course/messaging/) and demos (course/chapters/ch05/) on live servers."""

from __future__ import annotations

import asyncio
import inspect

import httpx
import psycopg
import pytest
from psycopg.types.json import Jsonb

from course import messaging as mq
from course.backoff import FullJitter
from course.chapters import ch05
from course.chapters.ch05 import failover
from course.kit.faults import DependencyError, VirtualClock
from course.retry import RetryPolicy


def _http(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://127.0.0.1/x")
    return httpx.HTTPStatusError("x", request=request, response=httpx.Response(status, request=request))


@pytest.mark.parametrize(
    ("err", "kind"),
    [
        (_http(429), "transient"),
        (_http(503), "transient"),
        (DependencyError(503), "transient"),
        (psycopg.errors.SerializationFailure("40001"), "transient"),
        (psycopg.errors.DeadlockDetected("40P01"), "transient"),
        (_http(502), "uncertain"),
        (_http(504), "uncertain"),
        (TimeoutError(), "uncertain"),
        (ConnectionResetError(), "uncertain"),
        (psycopg.OperationalError("server closed the connection"), "uncertain"),
        (_http(400), "permanent"),
        (_http(404), "permanent"),
        (KeyError("amount"), "permanent"),
        (ValueError("not JSON"), "permanent"),
        (mq.UnsupportedSchema("9"), "permanent"),
        (mq.BusinessRuleViolation("unpaid"), "permanent"),
    ],
)
def test_05_classify_sorts_transient_uncertain_and_permanent(err, kind):
    assert mq.classify(err) == kind
    assert mq.is_transient(err) == (kind != "permanent")


async def test_05_the_live_errors_of_the_first_demo_are_real_and_sorted_as_the_table_says(ans):
    """The notebook's first cell after setup: each error raised live, by httpx and PostgreSQL."""
    await mq.setup_schema(await ans.pool())
    kinds = {what: mq.classify(err) for what, err in await ch05.live_errors(ans.database_url)}
    assert kinds["HTTP dependency: 429"] == kinds["HTTP dependency: 503"] == "transient"
    assert kinds["HTTP dependency: 504"] == kinds["HTTP dependency: reset"] == "uncertain"
    assert kinds["HTTP dependency: 404"] == kinds["HTTP dependency: 422"] == "permanent"
    assert kinds["PostgreSQL: concurrent update (REPEATABLE READ)"] == "transient"
    assert kinds["PostgreSQL: a required column missing"] == "permanent"


def test_05_entry_ids_sort_as_two_numbers_not_text():
    ids = ["5-10", "5-9", "4-100", "5-0"]
    assert sorted(ids, key=mq.entry_order) == ["4-100", "5-0", "5-9", "5-10"]


def test_05_dead_letter_entry_keeps_the_message_and_adds_its_failure():
    fields = mq.make_message("m-1", "k", "paid", 2, {"amount": 1}, schema=3, correlation_id="c-9")
    entry = mq.dlq_entry(
        fields, stream="s", entry_id="1-2", attempts=4, first_failed_at=10.0, last_failed_at=12.5,
        error=TimeoutError("slow"), reason="exhausted",
    )  # fmt: skip
    assert {k: entry[k] for k in mq.FIELDS} == fields
    assert set(mq.DLQ_FIELDS) <= set(entry) and all(isinstance(v, str) for v in entry.values())
    assert (entry["attempts"], entry["error_type"], entry["reason"], float(entry["last_failed_at"])) == (
        "4",
        "TimeoutError",
        "exhausted",
        12.5,
    )


async def _world(ans, name: str):
    pool = await ans.pool(max_size=8)
    redis = ans.redis()
    await ch05.setup_schema(pool)
    stream, dlq = await ch05.fresh_stream(pool, redis, f"{ans.key_prefix}{name}")
    return pool, redis, stream, dlq


async def test_05_consumer_retries_dead_letters_parks_and_replay_restores_order(ans):
    pool, redis, stream, dlq = await _world(ans, "flow")
    await ch05.publish(redis, stream, [("A", 1), ("P", 1), ("A", 2), ("P", 2), ("A", 2), ("P", 3), ("A", 3)])
    clock = VirtualClock(100.0)
    policy = RetryPolicy(4, None, FullJitter(0.1, 1.0), mq.is_transient)
    counts = await mq.ordered_consumer(
        pool, redis, ch05.recorder(stream, fail={"A-2": 2}, poison={"P-1"}),
        stream=stream, group="workers", consumer="c", dlq=dlq, policy=policy, sleep=clock.sleep, clock=clock,
    )  # fmt: skip
    assert counts["applied"] == 3 and counts["duplicate"] == 1 and counts["parked"] == 2 and counts["dead"] == 1
    assert await ch05.applied(pool, stream) == ["A-1", "A-2", "A-3"]
    assert len(clock.sleeps) == 2  # A-2's two backoffs; P-1 (permanent) was not retried
    (dlq_id, dead), *_ = await redis.xrange(dlq)
    assert (dead["id"], dead["reason"], dead["attempts"], dead["source_stream"]) == ("P-1", "permanent", "1", stream)
    assert (await redis.xpending(stream, "workers"))["pending"] == 0
    assert await mq.replay_key(pool, redis, ch05.recorder(stream), stream=stream, key="P", dlq=dlq) == 3
    assert await mq.replay_key(pool, redis, ch05.recorder(stream), stream=stream, key="P", dlq=dlq) == 0
    assert [m for m in await ch05.applied(pool, stream) if m[0] == "P"] == ["P-1", "P-2", "P-3"]
    assert await redis.xlen(dlq) == 0


async def test_05_consumer_takes_over_a_dead_consumers_pending_entries_first(ans):
    pool, redis, stream, dlq = await _world(ans, "takeover")
    await ch05.publish(redis, stream, [("K", 1), ("K", 2)])
    got = await redis.xreadgroup("workers", "dead", {stream: ">"}, count=10)  # delivered, never acked
    await redis.xclaim(stream, "workers", "dead", 0, [e for e, _ in got[0][1]], idle=3_600_000, justid=True)
    await ch05.publish(redis, stream, [("K", 3)])
    counts = await mq.ordered_consumer(
        pool, redis, ch05.recorder(stream), stream=stream, group="workers", consumer="live", dlq=dlq
    )
    assert counts["taken over"] == 2
    assert await ch05.applied(pool, stream) == ["K-1", "K-2", "K-3"]
    assert (await redis.xpending(stream, "workers"))["pending"] == 0


async def test_05_one_global_lane_parks_every_key_behind_a_dead_letter(ans):
    pool, redis, stream, dlq = await _world(ans, "global")
    await ch05.publish(redis, stream, [("A", 1), ("B", 1), ("C", 1)])
    counts = await mq.ordered_consumer(
        pool, redis, ch05.recorder(stream, poison={"A-1"}), stream=stream, group="workers", consumer="c",
        dlq=dlq, lane_of=mq.one_lane,
    )  # fmt: skip
    assert counts["dead"] == 1 and counts["parked"] == 2 and await ch05.applied(pool, stream) == []


async def test_05_replay_blocked_paces_keys_and_metrics_see_the_backlog(ans):
    pool, redis, stream, dlq = await _world(ans, "paced")
    await ch05.publish(redis, stream, [(f"R{k}", s) for s in (1, 2) for k in range(3)])
    poison = {f"R{k}-1" for k in range(3)}
    await mq.ordered_consumer(
        pool, redis, ch05.recorder(stream, poison=poison), stream=stream, group="workers", consumer="c", dlq=dlq
    )
    seen = await mq.metrics(pool, redis, stream=stream, group="workers", dlq=dlq)
    assert (seen["dlq"], seen["blocked_keys"], seen["parked"], seen["pending"]) == (3, 3, 3, 0)
    assert seen["dlq_by_error_type"] == {"MalformedMessage": 3}
    clock = VirtualClock()
    done = await mq.replay_blocked(
        pool, redis, ch05.recorder(stream), stream=stream, dlq=dlq, per_second=4, sleep=clock.sleep
    )
    assert sorted(done) == [("R0", 2), ("R1", 2), ("R2", 2)] and clock.sleeps == [0.25, 0.25]


async def test_05_a_retry_queue_commits_later_messages_first(ans):
    pool, redis, _, _ = await _world(ans, "unused")
    order = await ch05.reorder_demo(pool, redis, f"{ans.key_prefix}reorder")
    assert order == {"retry queue": ["A-2", "A-3", "A-1"], "per-key lanes": ["A-1", "A-2", "A-3"]}


async def test_05_a_consumer_that_acks_first_loses_the_message_it_was_killed_on(ans):
    pool, redis, _, _ = await _world(ans, "unused")
    run = await ch05.kill_mid_message(
        ans, pool, redis, ack="first", hang_at="before commit", stream=f"{ans.key_prefix}k"
    )
    assert run.pending_after_kill == [] and run.applied_after_takeover == ["M-1", "M-3", "M-4"]


def test_05_dramatiq_retries_and_dead_letters_but_reorders_a_key(ns):
    seen = ch05.dramatiq_demo(ns.redis_url, f"{ns.key_prefix}dramatiq")
    assert seen["committed"].index("A-1") > seen["committed"].index("A-3")
    assert seen["attempts"]["A-1"] == 3 and seen["attempts"]["V-1"] == 1
    assert seen["dead"] == [("P-1", 3), ("V-1", 0)]


async def test_05_metrics_count_dead_letters_without_reading_them_all(ans):
    from course import messaging as mq

    pool, r = await ans.pool(), ans.redis()
    await mq.setup_schema(pool)
    stream, dlq = ans.key_prefix + "m", ans.key_prefix + "m-dlq"
    await r.xgroup_create(stream, "g", id="0", mkstream=True)
    for i in range(30):
        await r.xadd(dlq, {"reason": "poison" if i % 3 else "attempts", "error_type": "ValueError"})
    out = await mq.metrics(pool, r, stream=stream, group="g", dlq=dlq, sample=10)
    assert out["dlq"] == 30 and out["dlq_sampled"] == 10 and sum(out["dlq_by_reason"].values()) == 10


# ----------------------------------------------------------------------------- the review of the reference consumer
# Each test below failed on the consumer before its fix; concurrency is real, time is injected.

GROUP = "workers"


async def _until_killed(run) -> bool:
    """Await a consumer run; True if it died with ConsumerKilled (its TaskGroup wraps it in a group)."""
    killed = False
    try:
        await run
    except* mq.ConsumerKilled:
        killed = True
    return killed


def _gated(record, stuck: str, inside: asyncio.Event, release: asyncio.Event):
    """``record``, except that ``stuck`` waits inside its handler (its transaction open) until ``release``."""

    async def handle(conn, fields) -> None:
        if fields["id"] == stuck:
            inside.set()
            await release.wait()
        await record(conn, fields)

    return handle


async def test_05_a_replacement_started_while_the_owner_holds_an_older_entry_does_not_overtake_it(ans):
    pool, redis, stream, dlq = await _world(ans, "early")
    await ch05.publish(redis, stream, [("K", 1)])
    inside, release = asyncio.Event(), asyncio.Event()
    record = ch05.recorder(stream)
    owner = asyncio.create_task(
        mq.ordered_consumer(
            pool, redis, _gated(record, "K-1", inside, release), stream=stream, group=GROUP, consumer="a", dlq=dlq
        )
    )
    await asyncio.wait_for(inside.wait(), 10)  # a holds K-1 (pending, idle a few ms) and is slow
    await ch05.publish(redis, stream, [("K", 2), ("K", 3)])
    replacement = await mq.ordered_consumer(pool, redis, record, stream=stream, group=GROUP, consumer="b", dlq=dlq)
    release.set()
    await owner
    assert await ch05.applied(pool, stream) == ["K-1", "K-2", "K-3"]
    assert replacement["not owner"] == 1


async def test_05_after_the_owner_dies_the_next_owner_takes_its_whole_pending_list_before_new_entries(ans):
    pool, redis, stream, dlq = await _world(ans, "dies")
    await ch05.publish(redis, stream, [("K", 1)])
    record = ch05.recorder(stream)

    async def dies_on_k1(conn, fields) -> None:
        if fields["id"] == "K-1":
            raise mq.ConsumerKilled("kill -9 inside K-1")
        await record(conn, fields)

    assert await _until_killed(
        mq.ordered_consumer(pool, redis, dies_on_k1, stream=stream, group=GROUP, consumer="a", dlq=dlq)
    )
    await ch05.publish(redis, stream, [("K", 2)])
    # a replacement starts at once: K-1 has been pending for milliseconds, far below claim_idle_ms
    await mq.ordered_consumer(pool, redis, record, stream=stream, group=GROUP, consumer="b", dlq=dlq)
    assert await ch05.applied(pool, stream) == []  # not the owner while the dead one's lease lasts
    await redis.delete(mq.lease_key(stream, GROUP))  # the lease ran out (Redis expires it after lease_ms)
    counts = await mq.ordered_consumer(pool, redis, record, stream=stream, group=GROUP, consumer="b", dlq=dlq)
    assert await ch05.applied(pool, stream) == ["K-1", "K-2"]
    assert counts["taken over"] == 1 and (await redis.xpending(stream, GROUP))["pending"] == 0


async def test_05_an_owner_paused_past_its_lease_cannot_write_once_a_new_owner_took_over(ans):
    """The old owner froze in a backoff (a GC pause, a stopped VM) and its lease ran out; a new owner took
    the stream. When the old one wakes, its next attempt is refused by the fencing token: it cannot
    dead-letter K-1 and block key K (which would park K-1 and K-2 until an operator replays them)."""
    pool, redis, stream, dlq = await _world(ans, "zombie")
    await ch05.publish(redis, stream, [("K", 1), ("K", 2)])
    paused, resume = asyncio.Event(), asyncio.Event()

    async def frozen(delay: float) -> None:
        paused.set()
        await resume.wait()

    policy = RetryPolicy(2, None, FullJitter(0.01, 0.02), mq.is_transient)
    unreachable = ch05.recorder(stream, fail={"K-1": 99})  # the old owner cannot reach the dependency
    old = asyncio.create_task(
        mq.ordered_consumer(
            pool, redis, unreachable, stream=stream, group=GROUP, consumer="a", dlq=dlq, policy=policy, sleep=frozen
        )
    )
    await asyncio.wait_for(paused.wait(), 10)  # K-1 failed once on a; a waits in its backoff ...
    await redis.delete(mq.lease_key(stream, GROUP))  # ... longer than its lease
    lease = await mq.take_ownership(pool, redis, stream=stream, group=GROUP, consumer="b")  # b owns the stream
    resume.set()
    stale = await old  # a's second attempt, its last: refused, not dead-lettered
    await lease.release()  # b's run below takes the stream again, with a newer token
    await mq.ordered_consumer(pool, redis, ch05.recorder(stream), stream=stream, group=GROUP, consumer="b", dlq=dlq)
    assert await ch05.applied(pool, stream) == ["K-1", "K-2"]
    seen = await mq.metrics(pool, redis, stream=stream, group=GROUP, dlq=dlq)
    assert (seen["dlq"], seen["blocked_keys"], seen["parked"], seen["pending"]) == (0, 0, 0, 0)
    assert stale["lease lost"] == 1 and stale["dead"] == 0


async def test_05_a_fencing_counter_lost_by_redis_never_hands_out_an_older_token(ans):
    pool, redis, stream, _ = await _world(ans, "counter")
    first = await mq.take_ownership(pool, redis, stream=stream, group=GROUP, consumer="a")
    await first.release()
    await redis.delete(f"{mq.lease_key(stream, GROUP)}:fence")  # Redis restarted without its data
    second = await mq.take_ownership(pool, redis, stream=stream, group=GROUP, consumer="b")
    assert second.fence > first.fence


async def test_05_read_ahead_stops_at_max_in_flight_while_a_lane_is_stuck(ans):
    pool, redis, stream, dlq = await _world(ans, "readahead")
    total = 450
    await ch05.publish(redis, stream, [("S", s) for s in range(1, total + 1)])
    seen = {"delivered": 0, "at capacity": 0}
    enough, measured = asyncio.Event(), asyncio.Event()

    def log(event: dict) -> None:
        if event["event"] in seen:
            seen[event["event"]] += 1
        if seen["at capacity"] or seen["delivered"] == total:  # it stopped reading, or read everything
            enough.set()

    async def stuck_on_s1(conn, fields) -> None:
        if fields["id"] == "S-1":
            await enough.wait()
            held.update(pending=(await redis.xpending(stream, GROUP))["pending"], delivered=seen["delivered"])
            measured.set()
            await asyncio.Event().wait()  # stuck for good: the test stops the consumer

    held: dict = {}
    run = asyncio.create_task(
        mq.ordered_consumer(pool, redis, stuck_on_s1, stream=stream, group=GROUP, consumer="c", dlq=dlq, log=log)
    )
    await asyncio.wait_for(measured.wait(), 30)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    assert held["delivered"] < total  # not the whole backlog while S-1 was stuck
    cap = inspect.signature(mq.ordered_consumer).parameters["max_in_flight"].default
    assert held["delivered"] <= cap and held["pending"] <= cap


def test_05_the_default_claim_idle_time_is_well_above_an_entrys_retry_budget():
    """Queue time counts as idle time: an entry waiting in its lane behind retries must not look dead."""
    default = inspect.signature(mq.ordered_consumer).parameters["claim_idle_ms"].default
    assert default >= 5 * 60_000 and default >= 5 * mq.DEFAULT_POLICY.max_elapsed * 1000


async def test_05_a_message_that_kills_the_consumer_every_time_is_dead_lettered_after_max_deliveries(ans):
    """The chapter's run (P-1 crashes its consumer on every delivery; a supervisor restarts it), at the default limit."""
    pool, redis, stream, _ = await _world(ans, "killer")
    limit = inspect.signature(mq.ordered_consumer).parameters["max_deliveries"].default
    seen = await failover.killer_restarts(pool, redis, stream, max_deliveries=limit)
    assert seen["kills"] == limit < 8, seen  # it stopped being delivered
    assert seen["dead"] == [("P-1", "deliveries", str(limit))], seen
    assert seen["applied"] == ["G-1"], seen
    assert (seen["pending"], seen["blocked_keys"], seen["parked"]) == (0, 1, 1), seen


async def test_05_an_outage_of_the_dependency_pauses_the_consumer_instead_of_dead_lettering_every_key(ans):
    pool, redis, stream, dlq = await _world(ans, "outage")
    keys = 12
    await ch05.publish(redis, stream, [(f"K{k}", s) for s in (1, 2) for k in range(keys)] + [("Z", 1)])
    clock = VirtualClock(0.0)
    record = ch05.recorder(stream, poison={"Z-1"})

    async def during_outage(conn, fields) -> None:
        if clock() < 120.0 and fields["id"] != "Z-1":  # the inventory service is down for two minutes
            raise DependencyError(503)
        await record(conn, fields)

    counts = await mq.ordered_consumer(
        pool, redis, during_outage, stream=stream, group=GROUP, consumer="c", dlq=dlq, sleep=clock.sleep, clock=clock
    )
    assert [f["id"] for _, f in await redis.xrange(dlq)] == ["Z-1"]  # the bad message, and only it
    assert sorted(await ch05.applied(pool, stream)) == sorted(f"K{k}-{s}" for s in (1, 2) for k in range(keys))
    assert counts["paused"] >= keys and clock() >= 120.0


async def test_05_replay_commits_in_batches_and_a_replay_killed_half_way_resumes(ans):
    pool, redis, stream, dlq = await _world(ans, "batches")
    parked = 150  # R-1 dead-lettered, R-2 .. R-151 parked behind it (written as the consumer leaves them)
    dead = mq.make_message("R-1", "R", "event", 1)
    dlq_id = await redis.xadd(dlq, dead)
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO mq_blocked_keys (stream, key, entry_id, message_id, dlq_id, fields, reason) "
            "VALUES (%s, 'R', '1-1', 'R-1', %s, %s, 'permanent')",
            (stream, dlq_id, Jsonb(dead)),
        )
        async with conn.cursor() as cur:
            await cur.executemany(
                "INSERT INTO mq_parked (stream, entry_id, key, fields) VALUES (%s, %s, 'R', %s)",
                [(stream, f"1-{s}", Jsonb(mq.make_message(f"R-{s}", "R", "event", s))) for s in range(2, parked + 2)],
            )
    record = ch05.recorder(stream)
    calls = 0

    async def killed_at_120(conn, fields) -> None:
        nonlocal calls
        calls += 1
        if calls == 120:
            raise mq.ConsumerKilled("the replaying process died")
        await record(conn, fields)

    assert await _until_killed(mq.replay_key(pool, redis, killed_at_120, stream=stream, key="R", dlq=dlq))
    assert len(await ch05.applied(pool, stream)) == 100  # the first batch (R-1 and 99 parked) stayed committed
    seen = await mq.metrics(pool, redis, stream=stream, group=GROUP, dlq=dlq)
    assert (seen["blocked_keys"], seen["parked"], seen["dlq"]) == (1, parked - 99, 1)  # still blocked: unblock last
    assert await mq.replay_key(pool, redis, record, stream=stream, key="R", dlq=dlq) == parked + 1 - 100
    assert await ch05.applied(pool, stream) == [f"R-{s}" for s in range(1, parked + 2)]
    seen = await mq.metrics(pool, redis, stream=stream, group=GROUP, dlq=dlq)
    assert (seen["blocked_keys"], seen["parked"], seen["dlq"]) == (0, 0, 0)
