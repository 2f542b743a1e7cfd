"""Chapter 11's patterns (course.counters, course.chat) and demos, on the live servers."""

from __future__ import annotations

import asyncio

import pytest

from course import chat, counters
from course import idempotency as idem
from course.chapters.ch11 import chatting, counting, feeds, flushes, notify, rig


async def _setup(ans):
    pool = await ans.pool(max_size=8)
    await rig.install(pool)
    return pool


async def test_11_batched_counter_writes_nothing_until_max_views_then_one_statement(ans):
    pool = await _setup(ans)
    c = counters.BatchedCounter(pool, max_views=5)
    before = await rig.view_writes(pool)
    for item in "aabc":
        await c.view(item)
    assert await counters.read_counts(pool) == {}
    await c.view("a")
    assert await counters.read_counts(pool) == {"a": 3, "b": 1, "c": 1}
    assert c.flushes == 1 and await rig.view_writes(pool) - before == 3  # one row per item, one statement


async def test_11_batched_counter_keeps_a_failed_flush_and_writes_it_once(ans):
    pool = await _setup(ans)
    c = counters.BatchedCounter(pool, max_views=100)
    for item in "xxyyyz":
        await c.view(item)
    await rig.fail_view_write(pool, 2)
    with pytest.raises(Exception, match="refused"):
        await c.flush()
    assert await counters.read_counts(pool) == {} and c.pending == 6
    await c.close()
    assert await counters.read_counts(pool) == {"x": 2, "y": 3, "z": 1}


async def test_11_views_during_a_flush_go_to_the_next_one(ans):
    pool = await _setup(ans)
    c = counters.BatchedCounter(pool, max_views=100)
    await c.view("k")
    flush = asyncio.create_task(c.flush())
    await asyncio.sleep(0)  # the flush has swapped its batch out and is writing
    await c.view("k")
    await flush
    await c.close()
    assert await counters.read_counts(pool) == {"k": 2}


async def test_11_flushes_of_the_same_items_in_two_orders_deadlock_only_in_arrival_order(ans):
    pool = await _setup(ans)
    crossed = await flushes.crossed_flushes(ans, sorted_=False)
    ordered = await flushes.crossed_flushes(ans, sorted_=True)
    assert sum("40P01" in line for line in crossed) == 1
    assert all(line.endswith("committed") for line in ordered)
    assert await counters.read_counts(pool, ["dl-a", "dl-b"]) == {"dl-a": 2, "dl-b": 2}


async def test_11_a_lost_commit_reply_doubles_a_batch_unless_its_flush_id_is_recorded(ans):
    pool = await _setup(ans)
    plain = await flushes.lost_reply(pool, lambda p: counters.BatchedCounter(p, max_views=1000), "lr-1")
    deduped = await flushes.lost_reply(
        pool, lambda p: counters.DedupedCounter(p, source="pod-t", max_views=1000), "lr-2"
    )
    assert plain["stored"] == 200 and deduped["stored"] == 100


async def test_11_a_deduped_counter_retries_a_refused_batch_once_under_its_id(ans):
    pool = await _setup(ans)
    c = counters.DedupedCounter(pool, source="pod-r", max_views=100)
    for item in "ppq":
        await c.view(item)
    await rig.fail_view_write(pool, 1)
    with pytest.raises(Exception, match="refused"):
        await c.flush()
    await c.view("q")  # a new view waits behind the sealed batch
    await c.close()
    assert await counters.read_counts(pool, ["p", "q"]) == {"p": 2, "q": 2} and c.sealed is None


async def test_11_greatest_totals_are_safe_to_repeat_and_never_go_back(ans):
    pool = await _setup(ans)
    await counters.merge_totals(pool, {"v": 10})
    await counters.merge_totals(pool, {"v": 10})
    await counters.merge_totals(pool, {"v": 7})
    assert await counters.read_counts(pool) == {"v": 10}


async def test_11_a_sharded_counter_reads_the_sum_of_its_rows(ans):
    pool = await _setup(ans)
    await asyncio.gather(*(counters.add_to_shard(pool, "hot", 4) for _ in range(20)))
    assert await counters.read_sharded(pool, "hot") == 20


async def test_11_chat_numbers_are_per_conversation_and_unique_under_concurrency(ans):
    pool = await _setup(ans)
    got = await asyncio.gather(*(chat.send_message(pool, "a", "u", f"m{i}") for i in range(8)))
    assert sorted(got) == list(range(1, 9))
    assert await chat.send_message(pool, "b", "u", "first") == 1


async def test_11_a_retried_send_with_its_client_msg_id_gets_the_first_number_and_uses_none(ans):
    pool = await _setup(ans)
    first = await chat.send_message(pool, "cm", "u", "hello", client_msg_id="phone-1")
    again = await asyncio.gather(
        *(chat.send_message(pool, "cm", "u", "hello", client_msg_id="phone-1") for _ in range(3))
    )
    nxt = await chat.send_message(pool, "cm", "u", "next", client_msg_id="phone-2")
    assert (first, again, nxt) == (1, [1, 1, 1], 2)


async def test_11_max_plus_one_collides_and_the_client_fills_gaps(ans):
    pool = await _setup(ans)
    naive = await chatting.race(pool, chatting.racing_max_plus_one(4), "n", senders=4)
    assert "3 x UniqueViolation" in chatting.outcomes(naive)
    for i in range(4):
        await chat.send_message(pool, "g", "u", f"m{i}")
    shown, fetches = await chatting.gap_fill(pool, "g", [1, 3, 2, 4])
    assert shown == [1, 2, 3, 4] and fetches == 1


async def test_11_feed_strategies_return_the_same_feeds_at_different_costs(ans):
    g = feeds.make_graph(120, follows=10, celebrities=2, celebrity_share=0.6)
    runs = await feeds.compare(ans.redis(), "t", g, posts=20, reads=20, celebrity_threshold=30)
    write, read, hybrid = runs
    assert read.mean_writes == 1 and write.mean_writes > hybrid.mean_writes > 1
    assert set(read.read_commands) != {1} and set(write.read_commands) == {1}


async def test_11_a_feed_page_merges_own_posts_drops_deleted_ids_and_continues_from_its_cursor(ans):
    redis = ans.redis()
    g = feeds.make_graph(60, follows=8, celebrities=2, celebrity_share=0.6)
    user = 10
    authors = [user, *g.following[user][:6], user, *g.following[user][6:8]]  # ids 1..n; the user posts 1 and 8
    await feeds.publish_all(redis, "fp", g, authors, threshold=20)
    await feeds.delete_post(redis, "fp", 3)
    first, cursor = await feeds.feed_page(redis, "fp", g, user, threshold=20, limit=4)
    rest, end = await feeds.feed_page(redis, "fp", g, user, threshold=20, before=cursor, limit=20)
    everything = first + rest
    assert everything == sorted(everything, reverse=True) and len(set(everything)) == len(everything)
    assert 1 in everything and 8 in everything and 3 not in everything and end is None


async def test_11_notifications_dedup_throttle_retry_and_dead_letter(ans):
    pool = await ans.pool(max_size=4)
    await idem.setup_schema(pool)
    reqs = [
        notify.Request("n1", "ann", "otp", 0.0),
        notify.Request("n1", "ann", "otp", 0.1),  # the caller's retry
        notify.Request("n2", "bob", "comment", 0.0),  # push is down: retried, then dead-lettered
        notify.Request("n3", "cid", "marketing", 0.0, local_hour=23),  # held until morning
    ]
    providers = {
        "sms": notify.Provider("sms"),
        "push": notify.Provider("push", outage=(0, 100)),
        "email": notify.Provider("email"),
    }
    run = await notify.run_pipeline(
        pool,
        ans.redis(),
        ans.key_prefix,
        reqs,
        providers,
        rates={"sms": (1, 1.0), "push": (1, 1.0), "email": (1, 1.0)},
        max_attempts=3,
    )
    assert run.count("duplicate") == 1 and run.count("held for quiet hours") == 1
    assert run.count("sent", "otp") == 1 and run.count("failed, will retry") == 2
    assert [d["reason"] for d in run.dead] == ["exhausted"] and run.dead[0]["attempts"] == "3"
    providers["push"] = notify.Provider("push")  # back up: the dead letter's claim was released, so it goes
    replay = await notify.run_pipeline(
        pool, ans.redis(), ans.key_prefix, notify.replayable(run, at=run.end + 1), providers,
        rates={"sms": (1, 1.0), "push": (1, 1.0), "email": (1, 1.0)},
    )  # fmt: skip
    late = await notify.run_pipeline(
        pool, ans.redis(), ans.key_prefix, [notify.Request("n1", "ann", "otp", run.end + 2)], providers,
        rates={"sms": (1, 1.0), "push": (1, 1.0), "email": (1, 1.0)},
    )  # fmt: skip
    assert replay.count("sent", "comment") == 1 and late.count("duplicate") == 1


async def test_11_a_sigterm_flushes_the_batcher_and_loses_nothing(ans):
    pool = await _setup(ans)
    run = await counting.kill_batcher(ans, pool, sig="SIGTERM", run_for=0.2)
    assert run.exit_code == 0 and run.accepted > 0 and run.lost == 0
