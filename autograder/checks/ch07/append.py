"""Hidden checks of ``append_events``: optimistic concurrency on an event stream."""

from __future__ import annotations

import asyncio
from collections import Counter

from autograder.harness import Report, error_line, task
from course import eventstore as es
from course.chapters.ch07 import rig
from course.eventstore import ConcurrencyConflict
from course.kit import lab


async def _stream(pool, stream_id: str) -> list[tuple[int, str, dict]]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT version, type, data FROM es_events WHERE stream_id = %s ORDER BY version", (stream_id,)
        )
        return [tuple(row) for row in await cur.fetchall()]


def _versions_ok(rows) -> bool:
    return [row[0] for row in rows] == list(range(1, len(rows) + 1))


async def _attempt(call):
    try:
        return await call
    except Exception as err:  # noqa: BLE001 - learner code may raise anything; the check reports it
        return err


def _race_kinds(outcomes) -> str:
    """``"6 x ConcurrencyConflict, 1 x UniqueViolation, 1 x appended"``: by kind only, in a fixed order, so the
    line reads the same whichever writer happened to win."""
    counts = Counter(type(x).__name__ if isinstance(x, BaseException) else "appended" for x in outcomes)
    return ", ".join(f"{n} x {what}" for what, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _seen(outcomes) -> str:
    """``"ConcurrencyConflict, returned 2"``: the kinds of outcome, sorted, without how many of each."""
    return ", ".join(
        sorted({type(x).__name__ if isinstance(x, BaseException) else f"returned {x!r}" for x in outcomes})
    )


def _is_conflict(outcome) -> bool:
    return isinstance(outcome, ConcurrencyConflict)


# ============================================================================= append_events


@task("append_events", points=4, title="append with an expected version", timeout=60, seed=701)
async def check_append_events(r: Report, append_events) -> None:
    async with lab.scratch("ch07") as ns:
        pool = await ns.pool(max_size=16)
        await rig.install(pool)
        await _check_append(r, append_events, pool, ns)


async def _check_append(r: Report, append_events, pool, ns) -> None:
    opened = [{"type": "AccountOpened", "data": {"owner": "ada"}}, {"type": "Deposited", "data": {"amount_cents": 500}}]
    got = await append_events(pool, "acc-ada", 0, opened)
    rows = await _stream(pool, "acc-ada")
    r.expect(
        got == 2,
        "append_events(pool, 'acc-ada', 0, [AccountOpened, Deposited]) returned 2",
        f"append_events(pool, 'acc-ada', 0, [AccountOpened, Deposited]) returned {got!r}, expected 2 (the new version)",
    )
    want = [(1, "AccountOpened", {"owner": "ada"}), (2, "Deposited", {"amount_cents": 500})]
    r.expect(
        rows == want, f"es_events holds {rows} for acc-ada", f"es_events holds {rows} for acc-ada, expected {want}"
    )
    got = await append_events(pool, "acc-ada", 2, [{"type": "Withdrawn", "data": {"amount_cents": 200}}])
    r.expect(
        got == 3,
        "a third event with expected version 2: returned 3",
        f"a third event with expected 2 returned {got!r}, expected 3",
    )

    stale = await _attempt(append_events(pool, "acc-ada", 2, [{"type": "Withdrawn", "data": {"amount_cents": 300}}]))
    rows = await _stream(pool, "acc-ada")
    r.expect(
        _is_conflict(stale) and len(rows) == 3,
        "expected version 2 while the stream is at 3: ConcurrencyConflict, nothing written",
        f"expected version 2 while the stream is at 3: {_outcome(stale)}, stream has {len(rows)} events; "
        "expected ConcurrencyConflict and no new event (the writer decided on an old state)",
    )
    if r.public:
        return

    ahead = await _attempt(append_events(pool, "acc-ada", 7, [{"type": "Deposited", "data": {"amount_cents": 1}}]))
    rows = await _stream(pool, "acc-ada")
    r.expect(
        _is_conflict(ahead) and _versions_ok(rows) and len(rows) == 3,
        "expected version 7 while the stream is at 3: ConcurrencyConflict, no gap",
        f"expected version 7 while the stream is at 3: {_outcome(ahead)}, versions now {[x[0] for x in rows]}; "
        "expected ConcurrencyConflict: an expected version ahead of the stream is a conflict too, not a gap",
    )
    missing = await _attempt(append_events(pool, "acc-nobody", 1, [{"type": "Deposited", "data": {"amount_cents": 1}}]))
    rows = await _stream(pool, "acc-nobody")
    r.expect(
        _is_conflict(missing) and not rows,
        "expected version 1 on a stream that does not exist: ConcurrencyConflict",
        f"expected version 1 on a stream that does not exist: {_outcome(missing)}, {len(rows)} event(s) written; "
        "expected ConcurrencyConflict",
    )

    # --- concurrent writers with one expected version, two replicas -------------------------
    await es.append(
        pool,
        "acc-race",
        0,
        [("AccountOpened", {"owner": "bo"}), ("Deposited", {"amount_cents": 900})]
        + [("Deposited", {"amount_cents": 100})],
    )
    a, b = r.replicas("append_events", 2)
    sizes = [1 + i % 3 for i in range(8)]

    def writer(i: int):
        fn = a if i % 2 == 0 else b
        batch = [{"type": "Withdrawn", "data": {"writer": i, "n": k, "amount_cents": 100}} for k in range(sizes[i])]
        return lambda: fn(pool, "acc-race", 3, batch)

    r.note(
        "8 writers (4 on each of two replicas of your function) append 1 to 3 events each to acc-race with "
        "expected version 3; each reads before any writes (the check holds their writes in PostgreSQL)"
    )
    results, log = await rig.race(ns.database_url, ["es_events"], [writer(i) for i in range(8)])
    r.note(log.line())
    winners = [i for i, x in enumerate(results) if not isinstance(x, BaseException)]
    conflicts = [i for i, x in enumerate(results) if _is_conflict(x)]
    others = [x for x in results if isinstance(x, BaseException) and not _is_conflict(x)]
    rows = await _stream(pool, "acc-race")
    if others:
        unique = any("UniqueViolation" in type(x).__name__ or "unique" in str(x).lower() for x in others)
        r.fail(
            f"8 concurrent writers with expected version 3 ended with: {_race_kinds(results)}. "
            + (
                "The unique index on (stream_id, version) caught writers that all read version 3 and all tried "
                "to write version 4: that is a conflict, so raise ConcurrencyConflict (catch "
                "psycopg.errors.UniqueViolation), and the caller reloads and retries"
                if unique
                else "Losers must raise ConcurrencyConflict"
            )
            + (
                ". Some writers waited outside PostgreSQL (an asyncio.Lock?): a lock in one process does not "
                "cover two replicas"
                if log.stalled
                else ""
            )
        )
    r.expect(
        len(winners) == 1 and len(conflicts) == 7,
        f"exactly one writer appended; 7 got ConcurrencyConflict ({_race_kinds(results)})",
        f"8 concurrent writers with expected version 3: {len(winners)} appended, {len(conflicts)} got "
        f"ConcurrencyConflict; expected exactly 1 and 7. A writer whose expected version is stale must not write "
        "(read the version and insert in one transaction, and let the unique index decide)",
    )
    w = winners[0]
    new = rows[3:]
    from_winner = [row[2].get("writer") for row in new] == [w] * sizes[w] and [row[2].get("n") for row in new] == list(
        range(sizes[w])
    )
    r.expect(
        _versions_ok(rows) and from_winner and results[w] == 3 + sizes[w],
        # which writer wins (and so how many events it added) is up to PostgreSQL's lock queue: the line
        # names no number, so the same answer reads the same on every run
        "acc-race has no gap and no duplicate, its new versions are all the winner's events, and the winner "
        "returned the last of them",
        f"acc-race after the race: versions {[x[0] for x in rows]}, new events from writers "
        f"{[x[2].get('writer') for x in new]}, the winner (writer {w}, {sizes[w]} events) returned {results[w]!r}; "
        f"expected versions 4..{3 + sizes[w]} all from the winner and the return value {3 + sizes[w]}",
    )

    # --- distinct streams do not conflict --------------------------------------------------------
    results = await asyncio.gather(
        *(
            _attempt(
                (a if i % 2 else b)(
                    pool,
                    f"acc-many-{i}",
                    0,
                    [
                        {"type": "AccountOpened", "data": {"owner": f"u{i}"}},
                        {"type": "Deposited", "data": {"amount_cents": i}},
                    ],
                )
            )
            for i in range(10)
        )
    )
    r.expect(
        results == [2] * 10,
        "10 new streams appended at once: every append returned 2",
        # which kinds, not how many: how many of them a serializable transaction aborts depends on timing
        f"10 appends to 10 different new streams at once did not all return 2 (seen: {_seen(results)}); expected "
        "10 x returned 2 (the expected "
        "version is per stream: compare with max(version) of this stream_id only)",
    )

    # --- all or nothing ----------------------------------------------------------------------
    await rig.arm_crash(pool, "es_events", 2)
    batch = [
        {"type": t, "data": d}
        for t, d in (
            ("AccountOpened", {"owner": "cy"}),
            ("Deposited", {"amount_cents": 5}),
            ("Deposited", {"amount_cents": 7}),
        )
    ]
    crashed = await _attempt(append_events(pool, "acc-atomic", 0, batch))
    fired = await rig.disarm(pool, "es_events")
    rows = await _stream(pool, "acc-atomic")
    r.expect(
        fired,
        "a crash injected at the second event's insert of a 3-event append",
        f"a 3-event append to a new stream (expected version 0) {_outcome(crashed)} before its second insert, so the "
        "crash armed there never fired: insert every event into es_events, one row per event",
    )
    r.expect(
        isinstance(crashed, BaseException),
        f"the append raised ({error_line(crashed)})",
        f"the database failed the second insert but append_events returned {crashed!r}: let the error reach the caller",
    )
    r.expect(
        not rows,
        "and left the stream empty (all or nothing)",
        f"after the failed 3-event append, acc-atomic holds {len(rows)} event(s): a partial batch. Insert all "
        "events in one transaction (async with conn.transaction())",
    )
    again = await append_events(pool, "acc-atomic", 0, batch)
    r.expect(
        again == 3,
        "the same append again succeeded: returned 3",
        f"the same append again returned {again!r}, expected 3",
    )


def _outcome(x) -> str:
    return f"raised {error_line(x)}" if isinstance(x, BaseException) else f"returned {x!r}"
