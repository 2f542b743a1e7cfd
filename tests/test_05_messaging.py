"""Chapter 05's reference consumer (course/messaging.py) and demos (course/chapters/ch05.py) on live servers."""

from __future__ import annotations

import httpx
import psycopg
import pytest

from course import messaging as mq
from course.backoff import FullJitter
from course.chapters import ch05
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
