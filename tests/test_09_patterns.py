"""Chapter 09's patterns: the cursor codec, the seek condition, placement schemes, Snowflake ids."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from course import ids, pagination, sharding
from course.chapters import ch09
from course.kit import lab

SECRET = b"test secret"
WHEN = datetime(2026, 1, 1, tzinfo=UTC)


def test_09_cursor_round_trips_its_values():
    codec = pagination.CursorCodec(SECRET)
    assert codec.decode(codec.encode([WHEN, 42], binding="q"), binding="q") == [WHEN, 42]


def test_09_cursor_refuses_another_secret_version_or_query():
    token = pagination.CursorCodec(SECRET).encode([WHEN, 42], binding="q")
    for codec, binding in (
        (pagination.CursorCodec(b"other"), "q"),
        (pagination.CursorCodec(SECRET, version=2, accepts=(2,)), "q"),
        (pagination.CursorCodec(SECRET), "another filter"),
    ):
        with pytest.raises(pagination.InvalidCursor):
            codec.decode(token, binding=binding)


def test_09_cursor_refuses_garbage():
    for junk in ("", "abc", "a.b.c", "!!!.???"):
        with pytest.raises(pagination.InvalidCursor):
            pagination.CursorCodec(SECRET).decode(junk)


def test_09_seek_condition_expands_mixed_directions_and_bounds_the_first_column():
    same = pagination.seek_condition(["a", "b"], [True, True]).as_string(None)
    mixed = pagination.seek_condition(["a", "b"], [True, False]).as_string(None)
    assert same == '("a", "b") < (%s, %s)'
    assert mixed == '"a" <= %s AND (("a" < %s) OR ("a" = %s AND "b" > %s))'
    assert pagination.seek_params([1, 2], [True, False]) == [1, 1, 1, 2]


def test_09_a_bounded_mixed_seek_starts_at_the_cursor_and_an_or_alone_filters_every_row_before_it():
    async def run():
        async with lab.scratch("ch09-mixed") as ns:
            pool = await ns.pool(max_size=2)
            return await ch09.mixed_seek_costs(pool, 6_000, 4_500)

    got = asyncio.run(run())
    assert got["same"]
    assert got["or only"]["filtered"] >= 4_500 - 20 and got["bounded"]["filtered"] <= 20
    assert any("Index Cond: (score <=" in line for line in got["plan"])


def test_09_fetch_page_walks_forward_and_back_without_repeats():
    async def run():
        async with lab.scratch("ch09-unit") as ns:
            pool = await ns.pool(max_size=2)
            await ch09.setup_posts(pool)
            await ch09.fill_posts(pool, 17)
            codec = pagination.CursorCodec(SECRET)
            pages, after = [], None
            while True:
                page = await pagination.fetch_page(pool, ch09.POSTS, codec, after=after, limit=5)
                pages.append(page)
                if page.next is None:
                    break
                after = page.next
            back = await pagination.fetch_page(pool, ch09.POSTS, codec, before=pages[1].prev, limit=5)
            return pages, back

    pages, back = asyncio.run(run())
    flat = [r[0] for p in pages for r in p.rows]
    assert flat == sorted(flat, reverse=True) and len(flat) == len(set(flat)) == 17
    assert [len(p.rows) for p in pages] == [5, 5, 5, 2]
    assert back.rows == pages[0].rows


def test_09_ring_moves_about_one_in_n_plus_one_and_modulo_almost_all():
    keys = [f"k{i}" for i in range(5000)]
    ten, eleven = [f"n{i}" for i in range(10)], [f"n{i}" for i in range(11)]
    ring = sharding.moved_fraction(sharding.HashRing(ten).node_for, sharding.HashRing(eleven).node_for, keys)
    mod = sharding.moved_fraction(
        lambda k: sharding.modulo_node(k, ten), lambda k: sharding.modulo_node(k, eleven), keys
    )
    assert 0.05 < ring < 0.15 and mod > 0.8


def test_09_ring_ignores_insertion_order_and_removal_moves_only_that_node():
    nodes = [f"n{i}" for i in range(6)]
    a, b = sharding.HashRing(nodes), sharding.HashRing(nodes[::-1])
    keys = [f"k{i}" for i in range(2000)]
    before = [a.node_for(k) for k in keys]
    assert before == [b.node_for(k) for k in keys]
    a.remove_node("n2")
    assert all(x == a.node_for(k) for k, x in zip(keys, before, strict=True) if x != "n2")


def test_09_jump_hash_is_stable_and_moves_only_to_the_new_bucket():
    for key in range(2000):
        old, new = sharding.jump_hash(key, 10), sharding.jump_hash(key, 11)
        assert 0 <= old < 10 and new in (old, 10)


def test_09_rendezvous_picks_a_node_and_is_deterministic():
    nodes = ["a", "b", "c"]
    assert sharding.rendezvous_node("x", nodes) == sharding.rendezvous_node("x", nodes[::-1]) in nodes


def test_09_snowflake_never_goes_back_and_refuses_a_big_step():
    now = [1_767_225_600.0]

    def sleep(s):
        now[0] += s

    gen = ids.Snowflake(3, clock=lambda: now[0], sleep=sleep, max_wait_ms=50)
    made = [gen.next_id() for _ in range(5)]
    now[0] -= 0.01
    made.append(gen.next_id())
    assert made == sorted(made) and len(set(made)) == len(made)
    assert ids.snowflake_parts(made[0])["worker"] == 3
    now[0] -= 10
    with pytest.raises(ids.ClockWentBackwards):
        gen.next_id()


def test_09_snowflake_shared_by_threads_never_issues_one_id_twice():
    from concurrent.futures import ThreadPoolExecutor

    gen = ids.Snowflake(5)
    with ThreadPoolExecutor(8) as pool:
        batches = list(pool.map(lambda _: [gen.next_id() for _ in range(3_000)], range(8)))
    made = [i for batch in batches for i in batch]
    assert len(set(made)) == len(made) == 24_000


def test_09_uuid7_time_reads_the_timestamp():
    import uuid6

    value = uuid6.uuid7()
    assert abs((ids.uuid7_time(value) - datetime.now(UTC)).total_seconds()) < 60


def test_09_replica_demo_says_what_it_needs_for_a_tcp_server():
    reason = ch09.replica.why_not("postgresql://u@db.example:5432/x")
    assert reason is not None and "local socket" in reason
