"""Chapter 07's patterns and rig: the event store, projections, the search indexer, the gate and crashes."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from course import eventstore as es
from course import projections, search
from course.chapters.ch07 import indexing, rig, shredding, streams


@pytest.fixture
async def pool(ans):
    p = await ans.pool(max_size=12)
    await rig.install(p)
    return p


async def test_07_append_returns_the_new_version_and_refuses_a_stale_one(pool):
    assert await es.append(pool, "s", 0, [("AccountOpened", {"owner": "a"}), ("Deposited", {"amount_cents": 5})]) == 2
    with pytest.raises(es.ConcurrencyConflict) as err:
        await es.append(pool, "s", 1, [("Deposited", {"amount_cents": 1})])
    assert err.value.actual == 2
    assert [e.version for e in await es.read_stream(pool, "s")] == [1, 2]


async def test_07_concurrent_appends_through_the_gate_let_exactly_one_through(pool, ans):
    await es.append(pool, "race", 0, [("AccountOpened", {"owner": "a"})])
    calls = [lambda: es.append(pool, "race", 1, [("Deposited", {"amount_cents": 1})]) for _ in range(5)]
    results, log = await rig.race(ans.database_url, ["es_events"], calls)
    assert log.held == 5 and not log.stalled
    assert sorted(type(r).__name__ for r in results) == ["ConcurrencyConflict"] * 4 + ["int"]


async def test_07_execute_reloads_after_a_conflict_and_the_rule_refuses_the_overdraft(pool, ans):
    out = await streams.overdraft_race(pool, ans.database_url, "acc", n=4, checked=True)
    assert out["balance_cents"] == 0 and len(out["conflicts"]) == 3
    assert sum(isinstance(r, es.Refused) for r in out["results"]) == 3


async def test_07_appending_without_an_expected_version_overdraws(pool, ans):
    out = await streams.overdraft_race(pool, ans.database_url, "acc", n=3, checked=False)
    assert out["balance_cents"] == -20_000


async def test_07_a_double_clicked_deposit_lands_twice_unless_it_carries_an_idempotency_key(pool, ans):
    plain = await streams.double_click(pool, ans.database_url, "plain", keyed=False)
    keyed = await streams.double_click(pool, ans.database_url, "keyed", keyed=True)
    assert plain["conflicts"] == keyed["conflicts"] == 1  # both retried after the version check said no
    assert (plain["deposits"], plain["balance_cents"]) == (2, 10_000)
    assert (keyed["deposits"], keyed["balance_cents"]) == (1, 5_000)


def test_07_a_forgotten_key_leaves_the_sealed_fields_unreadable():
    vault = shredding.KeyStore()
    sealed = shredding.seal(vault.key_for("s"), {"name": "Ada"})
    data = {"subject": "s", "pii": sealed}
    assert shredding.reveal(vault, data) == {"name": "Ada"} and "Ada" not in sealed
    with pytest.raises(ValueError):
        shredding.unseal(shredding.KeyStore().key_for("s"), sealed)  # another key
    assert vault.forget("s") and shredding.reveal(vault, data) is None


async def test_07_a_snapshot_gives_the_same_state_as_the_full_fold(pool):
    await streams.fill_stream(pool, "long", 250)
    full, version = await es.load(pool, "long", es.account_evolve, snapshots=False)
    state = es.fold((await es.read_stream(pool, "long"))[:200], es.account_evolve)
    assert await es.save_snapshot(pool, "long", 200, state)
    assert not await es.save_snapshot(pool, "long", 100, state)  # an older snapshot never replaces a newer one
    assert await es.load(pool, "long", es.account_evolve) == (full, version) == (full, 250)


async def test_07_old_deposits_are_upcast_on_read(pool):
    await es.append(pool, "old", 0, [("AccountOpened", {"owner": "o"}), ("Deposited", {"amount": 12.5})])
    state, _ = await es.load(pool, "old", es.account_evolve)
    assert state["balance_cents"] == 1250


async def test_07_a_crash_at_the_checkpoint_rolls_the_rows_back_and_fires_once(pool):
    out = await streams.crash_and_redeliver(pool, projections.apply_events, "acc-x")
    assert out["balance_cents"] == out["truth_cents"] == 3000 and out["log"][0].startswith("RaiseException")
    naive = await streams.crash_and_redeliver(pool, streams.apply_then_checkpoint, "acc-y")
    assert naive["balance_cents"] == 2 * naive["truth_cents"]


async def test_07_rebuild_gives_the_incremental_rows(pool):
    for i in range(3):
        await es.execute(pool, f"a{i}", es.open_account(f"o{i}"), es.account_evolve)
        await es.execute(pool, f"a{i}", es.deposit(100 * (i + 1)), es.account_evolve)
    await projections.balances.catch_up(pool)
    before = await projections.read_balances(pool)
    assert await projections.rebuild_balances(pool) == 6
    assert await projections.read_balances(pool) == before
    assert await projections.balances.lag(pool) == 0


async def test_07_wait_for_returns_the_row_once_it_reflects_the_version(pool):
    version = await es.execute(pool, "w", es.open_account("w"), es.account_evolve)
    assert await projections.wait_for(pool, "w", version, timeout=0) is None  # not projected yet
    await projections.balances.catch_up(pool)
    assert await projections.wait_for(pool, "w", version, timeout=0) == ("w", 0, 1)


async def test_07_a_tailing_reader_skips_a_late_commit_unless_appends_take_the_lock(pool, ans):
    assert (await streams.late_commit(ans.database_url, pool, locked=False))["skipped"]
    assert not (await streams.late_commit(ans.database_url, pool, locked=True))["skipped"]
    assert (await streams.late_commit(ans.database_url, pool, locked=False))["skipped"]  # again, as a re-run does


async def test_07_a_race_stream_started_again_is_projected_again(pool, ans):
    """The notebook's second run: the race's account starts clean, the projector catches up without a duplicate."""
    for _ in range(2):
        await streams.fill_stream(pool, "acc-again", 0)
        await streams.overdraft_race(pool, ans.database_url, "acc-again", n=2, checked=False)
        await projections.balances.catch_up(pool)
    assert (await projections.read_balances(pool))["acc-again"][1] == -10_000


async def test_07_the_indexer_ignores_older_versions_and_keeps_tombstones(pool):
    doc = indexing.payload
    assert await search.index_event(pool, doc("d", 2, "upsert", "Outbox relay", "publishes rows"))
    assert not await search.index_event(pool, doc("d", 1, "upsert", "Old draft", "stale"))
    assert await search.search(pool, "relay") == ["d"] and await search.search(pool, "draft") == []
    assert await search.index_event(pool, doc("d", 3, "delete"))
    assert not await search.index_event(pool, doc("d", 2, "upsert", "Outbox relay", "publishes rows"))
    assert await search.search(pool, "relay") == []


async def test_07_the_outbox_keeps_the_index_in_sync_despite_failing_deliveries(pool):
    out = await indexing.outbox_run(pool, docs=10, waves=2, crash_rate=0.2, run=3)
    assert out["stale"] == out["missing"] == 0 and out["failed_deliveries"] > 0
    assert await search.unpublished(pool) == 0


async def test_07_the_keyed_gate_lets_the_newer_version_land_first(pool, ans):
    await search.index_event(pool, indexing.payload("r", 1, "upsert", "one", "one"))
    landed = []

    async def write(version):
        async with pool.connection() as conn:
            await conn.execute("UPDATE search_documents SET version = %s WHERE doc_id = 'r'", (version,))
        landed.append(version)

    _, log = await rig.race(
        ans.database_url, ["search_documents"], [lambda: write(3), lambda: write(2)], order=[3, 2], stagger=True
    )
    assert landed == [3, 2] and not log.stalled


async def test_07_an_armed_crash_fires_exactly_once(pool):
    await rig.arm_crash(pool, "es_events", 1)
    with pytest.raises(psycopg.errors.RaiseException):
        await es.append(pool, "c", 0, [("AccountOpened", {"owner": "c"})])
    assert await es.append(pool, "c", 0, [("AccountOpened", {"owner": "c"})]) == 1
    assert await rig.disarm(pool, "es_events")


async def test_07_a_snapshot_holds_only_the_events_its_own_append_wrote(pool, monkeypatch):
    """A writer that appends between execute()'s append and its snapshot must not be counted twice."""
    await es.execute(pool, "snap", es.open_account("ana"), es.account_evolve)
    real_append = es.append

    async def append_then_someone_else_appends(pool_, stream_id, expected, events):
        after = await real_append(pool_, stream_id, expected, events)
        await real_append(pool_, stream_id, after, [("Deposited", {"amount_cents": 7})])  # the concurrent writer
        return after

    monkeypatch.setattr(es, "append", append_then_someone_else_appends)
    await es.execute(pool, "snap", es.deposit(100), es.account_evolve, snapshot_every=1)
    monkeypatch.setattr(es, "append", real_append)
    with_snapshot, _ = await es.load(pool, "snap", es.account_evolve)
    without, _ = await es.load(pool, "snap", es.account_evolve, snapshots=False)
    assert with_snapshot == without and without["balance_cents"] == 107, (with_snapshot, without)


async def test_07_an_event_the_index_can_never_take_is_dead_lettered_not_retried_forever(pool):
    """A body past tsvector's 1 MB limit rolled its whole batch back on every round: the rows
    behind it were never indexed. Now it is retried, then set aside, and the rest goes on."""
    import random as _random

    rng = _random.Random(7)
    huge = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(10)) for _ in range(120_000))
    async with pool.connection() as conn, conn.transaction():
        await search.enqueue(conn, "too-big", 1, "upsert", "huge", huge)
        for i in range(3):
            await search.enqueue(conn, f"doc-{i}", 1, "upsert", f"title {i}", "small body")
    assert await search.relay_once(pool) == 3  # the rows behind the bad one are indexed at once
    for _ in range(search.MAX_ATTEMPTS):
        await search.relay_once(pool)
    dead = await search.dead_letters(pool)
    assert [(d[1], d[3]) for d in dead] == [("too-big", search.MAX_ATTEMPTS)], dead
    assert "too long" in dead[0][4]
    assert await search.relay_once(pool) == 0
    assert sorted(await search.search(pool, "small body")) == ["doc-0", "doc-1", "doc-2"]


async def test_07_a_projector_loop_survives_a_failing_batch(pool):
    from course.backoff import LoopErrors
    from course.kit.faults import VirtualClock

    stop, seen, errors = asyncio.Event(), [], LoopErrors()
    projector = projections.Projector("loop-test", lambda conn, e: None, [])

    async def catch_up(pool_, batch=200):
        seen.append(1)
        if len(seen) == 1:
            raise psycopg.OperationalError("connection lost")
        stop.set()
        return 0

    projector.catch_up = catch_up
    await projector.run(pool, stop, sleep=VirtualClock().sleep, errors=errors)
    assert len(seen) == 2 and errors.count == 1
