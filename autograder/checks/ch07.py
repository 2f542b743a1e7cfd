"""Hidden checks of chapter 07: ``append_events``, ``account_projection`` and ``search_indexer``.

Races are real (several connections, two replicas of the learner's code) and the verdicts
are still the same every run: the chapter's rig (:mod:`course.chapters.ch07.rig`) holds
every write to a table inside PostgreSQL until all writers have read, then lets them
through (or lets one version through before another). Crashes are one-shot triggers
that fail the N-th write to a table, exactly once, as if the process died there.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from autograder.harness import Report, error_line, task
from autograder.probes import tally
from course import eventstore as es
from course import projections
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


def _kinds(outcomes) -> str:
    """``"8 x ConcurrencyConflict, 2 x returned 2"``: outcomes by kind, without their messages."""
    counts = Counter(type(x).__name__ if isinstance(x, BaseException) else f"returned {x!r}" for x in outcomes)
    return ", ".join(f"{n} x {what}" for what, n in counts.most_common())


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
            f"8 concurrent writers with expected version 3 ended with: {tally(results, ok='appended')}. "
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
        f"exactly one writer appended; 7 got ConcurrencyConflict ({tally(results, ok='appended')})",
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
        f"acc-race holds versions 1..{len(rows)}, no gap and no duplicate, the new ones all from the winner, "
        f"which returned {results[w]}",
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
        f"10 appends to 10 different new streams at once: {_kinds(results)}; expected 10 x returned 2 (the expected "
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


# ============================================================================= account_projection


def _expected(events: list[dict]) -> dict[str, tuple]:
    """The balances read model after ``events``, by folding them (the check's own answer)."""
    states: dict[str, tuple] = {}
    for e in events:
        event = projections.as_event(e)
        state = states.get(event.stream_id)
        folded = es.account_evolve(
            None if state is None else {"owner": state[0], "balance_cents": state[1], "events": 0}, event
        )
        states[event.stream_id] = (folded["owner"], folded["balance_cents"], event.version)
    return states


async def _checkpoint(pool) -> int | None:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT position FROM projection_checkpoints WHERE name = 'account_balances'")
        row = await cur.fetchone()
    return row[0] if row else None


def _diff(got: dict, want: dict) -> str:
    lines = []
    for account in sorted(set(got) | set(want)):
        if got.get(account) != want.get(account):
            g, w = got.get(account), want.get(account)
            lines.append(
                f"{account}: {g[1] if g else 'no row'} (v{g[2] if g else '-'}) instead of {w[1] if w else 'no row'} (v{w[2] if w else '-'})"
            )
    return "; ".join(lines[:3])


async def _events_for_projection(pool, rng) -> list[dict]:
    for i in range(1, 5):
        await es.append(pool, f"acc-{i}", 0, [("AccountOpened", {"owner": f"owner-{i}"})])
    balances = {f"acc-{i}": 0 for i in range(1, 5)}
    for _ in range(32):
        account = f"acc-{rng.randint(1, 4)}"
        if balances[account] >= 500 and rng.random() < 0.35:
            kind, amount = "Withdrawn", rng.randint(1, balances[account] // 100) * 100
            balances[account] -= amount
        else:
            kind, amount = "Deposited", rng.randint(1, 20) * 100
            balances[account] += amount
        _, version = await es.load(pool, account, es.account_evolve, snapshots=False)
        await es.append(pool, account, version, [(kind, {"amount_cents": amount})])
    return [e.as_dict() for e in await es.read_all(pool, 0, 1000)]


@task(
    "account_projection",
    points=4,
    title="an idempotent, rebuildable balance projection",
    needs=("apply_events", "rebuild_balances"),
    timeout=60,
    seed=702,
)
async def check_account_projection(r: Report, apply_events, rebuild_balances) -> None:
    async with lab.scratch("ch07") as ns:
        pool = await ns.pool(max_size=12)
        await rig.install(pool)
        events = await _events_for_projection(pool, r.random)
        await _check_projection(r, apply_events, rebuild_balances, pool, ns, events)


async def _deliver(r: Report, apply_events, pool, batch: list[dict], what: str, attempts: int = 3):
    """At-least-once: deliver ``batch`` until ``apply_events`` returns; (returned, log)."""
    log = []
    for _ in range(attempts):
        try:
            got = await apply_events(pool, batch)
        except Exception as err:  # noqa: BLE001 - a failed delivery is redelivered, as a broker would
            log.append(error_line(err, 90))
            continue
        return got, log
    r.fail(f"{what}: apply_events kept failing on redelivery: {log}")
    return None, log


async def _check_projection(r: Report, apply_events, rebuild_balances, pool, ns, events: list[dict]) -> None:
    first = events[:5]
    got = await apply_events(pool, first)
    rows = await projections.read_balances(pool)
    want = _expected(first)
    r.expect(
        rows == want,
        f"events 1-5 applied: account_balances = {rows}",
        f"after events 1-5 account_balances holds {rows}, expected {want}",
    )
    r.expect(
        got == 5,
        "apply_events returned 5 (events applied)",
        f"apply_events returned {got!r} for 5 new events, expected 5",
    )
    checkpoint = await _checkpoint(pool)
    r.expect(
        checkpoint == first[-1]["position"],
        f"the checkpoint is at position {checkpoint}",
        f"projection_checkpoints('account_balances') is at {checkpoint!r} after events 1-5, expected "
        f"{first[-1]['position']} (the position of the last event applied)",
    )
    again = await apply_events(pool, first)
    rows = await projections.read_balances(pool)
    r.expect(
        rows == want and again == 0,
        "the same 5 events delivered again: nothing changed, returned 0",
        f"the same 5 events delivered again: returned {again!r}, account_balances {_diff(rows, want) or 'unchanged'}; "
        "expected 0 and no change (skip events at or before the checkpoint)",
    )
    if r.public:
        return

    # --- an overlapping batch ------------------------------------------------------------------
    got = await apply_events(pool, events[3:12])
    rows, want = await projections.read_balances(pool), _expected(events[:12])
    r.expect(
        rows == want and got == 7,
        "events 4-12 (2 old, 7 new): the 7 new ones applied once",
        f"events 4-12 delivered (4 and 5 for the second time): returned {got!r}, {_diff(rows, want) or 'rows right'}; "
        "expected 7 applied and each event once",
    )

    # --- crashes between apply and checkpoint, and before it -------------------------------------
    for table, nth, upto, words in (
        ("projection_checkpoints", 1, 18, "at the checkpoint write (after the balance writes)"),
        ("account_balances", 2, 24, "at the second balance write (before the checkpoint)"),
    ):
        batch = events[upto - 6 : upto]
        await rig.arm_crash(pool, table, nth)
        try:
            first_try = await apply_events(pool, batch)
            raised = None
        except Exception as err:  # noqa: BLE001
            first_try, raised = None, err
        fired = await rig.disarm(pool, table)
        r.expect(
            fired,
            f"events {upto - 5}-{upto}: a crash injected {words}",
            f"the check armed a crash at {table} but apply_events never wrote {table}: "
            + (
                "keep the checkpoint in projection_checkpoints (name 'account_balances')"
                if table == "projection_checkpoints"
                else "write the balances to account_balances"
            ),
        )
        if raised is None:
            rows, want = await projections.read_balances(pool), _expected(events[:upto])
            r.fail(
                f"the crash {words} was swallowed: apply_events returned {first_try!r}, so the broker would not "
                f"redeliver, and account_balances is {'right' if rows == want else 'wrong: ' + _diff(rows, want)}. "
                "Let the error reach the caller"
            )
        got, log = await _deliver(r, apply_events, pool, batch, f"after the crash {words}")
        rows, want = await projections.read_balances(pool), _expected(events[:upto])
        if rows == want:
            r.ok(f"redelivered after the crash: each event applied once ({error_line(raised, 70)}, then {got})")
            continue
        if table == "projection_checkpoints":
            reason = (
                "The balances were committed without the checkpoint, so the redelivery applied them again: "
                "write the rows and the checkpoint in one transaction"
            )
        else:
            reason = (
                "The checkpoint was committed without the balances (or the other way round), so the redelivery "
                "skipped or repeated them: write both in one transaction, so a crash leaves neither"
            )
        r.fail(f"after a crash {words}, then a redelivery: {_diff(rows, want)}. {reason}")

    # --- two replicas, one batch -------------------------------------------------------------------
    a, b = r.replicas("apply_events", 2)
    batch = events[24:30]
    r.note(
        "events 25-30 delivered to two replicas of apply_events at once (each reads the checkpoint before "
        "either writes a balance: the check holds the writes in PostgreSQL)"
    )
    results, log = await rig.race(
        ns.database_url, ["account_balances"], [lambda: a(pool, batch), lambda: b(pool, batch)]
    )
    r.note(log.line() + f"; returned {tally(results, ok=None)}")
    for i, outcome in enumerate(results):
        if isinstance(outcome, BaseException):
            await _deliver(r, (a, b)[i], pool, batch, "a redelivery to the replica that failed")
    rows, want = await projections.read_balances(pool), _expected(events[:30])
    r.expect(
        rows == want,
        "two replicas with one batch: each event applied once",
        f"two replicas handed the same batch at once: {_diff(rows, want)}; both read the old checkpoint and both "
        "applied the batch. Lock the checkpoint row (SELECT ... FOR UPDATE) in the transaction before deciding "
        "which events are new; state kept in one process is not shared"
        + (" (some replica waited outside PostgreSQL)" if log.stalled else ""),
    )

    # --- the rest, then a rebuild -------------------------------------------------------------------
    for start in range(30, len(events), 4):
        await _deliver(r, apply_events, pool, events[start : start + 4], f"events {start + 1}-{start + 4}")
    incremental = await projections.read_balances(pool)
    want = _expected(events)
    r.expect(
        incremental == want,
        f"all {len(events)} events applied: {len(want)} accounts match the fold of their streams",
        f"after all {len(events)} events: {_diff(incremental, want)}",
    )
    rebuilt = await rebuild_balances(pool)
    rows = await projections.read_balances(pool)
    checkpoint = await _checkpoint(pool)
    r.expect(
        rows == incremental,
        "rebuild_balances() from zero gave the same rows",
        f"rebuild_balances() left account_balances with {_diff(rows, incremental)} (compared with the incremental run). "
        + (
            "Nothing was replayed: reset the checkpoint to 0 together with emptying account_balances"
            if not rows
            else "Empty account_balances and reset the checkpoint in one transaction, then replay every event"
        ),
    )
    r.expect(
        rebuilt == len(events) and checkpoint == events[-1]["position"],
        f"it returned {rebuilt} and left the checkpoint at {checkpoint}",
        f"rebuild_balances() returned {rebuilt!r} and left the checkpoint at {checkpoint!r}; expected "
        f"{len(events)} (events replayed) and {events[-1]['position']}",
    )
    _, version = await es.load(pool, "acc-1", es.account_evolve, snapshots=False)
    await es.append(pool, "acc-1", version, [("Deposited", {"amount_cents": 4200})])
    more = [e.as_dict() for e in await es.read_all(pool, events[-1]["position"])]
    await _deliver(r, apply_events, pool, more, "an event after the rebuild")
    rows, want = await projections.read_balances(pool), _expected(events + more)
    r.expect(
        rows == want,
        "and a new event after the rebuild applied on top",
        f"a new event after the rebuild: {_diff(rows, want)}",
    )


# ============================================================================= search_indexer


def _event(doc_id: str, version: int, op: str = "upsert", title: str = "", body: str = "") -> dict:
    return {"outbox_id": version, "doc_id": doc_id, "version": version, "op": op, "title": title, "body": body}


async def _indexed(pool, doc_id: str):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT version, title, deleted FROM search_documents WHERE doc_id = %s", (doc_id,))
        return await cur.fetchone()


async def _tsv_matches(pool, query: str) -> list[str]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT doc_id FROM search_documents WHERE tsv @@ websearch_to_tsquery('english', %s) ORDER BY doc_id",
            (query,),
        )
        return [row[0] for row in await cur.fetchall()]


@task(
    "search_indexer",
    points=4,
    title="an outbox-fed, idempotent search indexer",
    needs=("index_event", "search_docs"),
    timeout=60,
    seed=703,
)
async def check_search_indexer(r: Report, index_event, search_docs) -> None:
    async with lab.scratch("ch07") as ns:
        pool = await ns.pool(max_size=12)
        await rig.install(pool)
        await _check_search(r, index_event, search_docs, pool, ns)


async def _check_search(r: Report, index_event, search_docs, pool, ns) -> None:
    v1 = _event(
        "doc-pg", 1, title="PostgreSQL replication slots", body="Stalled replication slots keep WAL segments on disk."
    )
    await index_event(pool, v1)
    found = await search_docs(pool, "replication")
    r.expect(
        "doc-pg" in found,
        f"v1 indexed: search_docs('replication') -> {found}",
        f"after indexing {v1}, search_docs(pool, 'replication') returned {found}; expected it to include 'doc-pg'",
    )
    found = await search_docs(pool, "slot")
    r.expect(
        "doc-pg" in found,
        "search_docs('slot') finds it too (English stemming: slots -> slot)",
        f"search_docs(pool, 'slot') returned {found}: use the 'english' configuration (to_tsvector('english', ...) "
        "and websearch_to_tsquery('english', ...)) so 'slots' matches 'slot'",
    )
    v2 = _event("doc-pg", 2, title="Logical decoding", body="Decoding turns the write-ahead log into change events.")
    await index_event(pool, v2)
    old, new = await search_docs(pool, "replication"), await search_docs(pool, "decoding")
    r.expect(
        "doc-pg" not in old and "doc-pg" in new,
        "v2 indexed: the old words no longer match, the new ones do",
        f"after v2: search 'replication' -> {old}, 'decoding' -> {new}; expected the document only under its new words",
    )
    row = await _indexed(pool, "doc-pg")
    r.expect(
        row is not None and row[0] == 2,
        f"search_documents has doc-pg at version {row[0] if row else None}",
        f"search_documents row for doc-pg is {row}, expected version 2",
    )
    if r.public:
        return

    tsv = await _tsv_matches(pool, "decoding")
    r.expect(
        tsv == ["doc-pg"],
        "the tsv column holds the words (what the GIN index serves)",
        f"rows whose tsv matches 'decoding': {tsv}. Store the document's tsvector in search_documents.tsv "
        "(setweight(to_tsvector('english', title), 'A') || setweight(to_tsvector('english', body), 'B')): a "
        "to_tsvector computed at query time cannot use the GIN index",
    )

    # --- redelivery and reordering --------------------------------------------------------------
    await index_event(pool, v2)
    row = await _indexed(pool, "doc-pg")
    r.expect(row[0] == 2, "v2 delivered again: no change", f"v2 delivered again left version {row[0]}")
    await index_event(pool, _event("doc-pg", 4, title="Outbox relay", body="The relay publishes outbox rows."))
    await index_event(pool, _event("doc-pg", 3, title="Stale draft", body="An older version arriving late."))
    row = await _indexed(pool, "doc-pg")
    stale_hits = await search_docs(pool, "stale draft")
    r.expect(
        row[0] == 4 and "doc-pg" not in stale_hits,
        "v4, then a late v3: the index stays at v4",
        f"v4 then a late v3: the index holds version {row[0]} ({row[1]!r}); expected v4. The last write won: "
        "compare versions and ignore an event older than what is indexed (ON CONFLICT ... DO UPDATE ... WHERE "
        "search_documents.version < EXCLUDED.version)",
    )

    # --- deletes -------------------------------------------------------------------------------------
    await index_event(pool, _event("doc-pg", 5, op="delete"))
    gone = await search_docs(pool, "outbox relay")
    r.expect(
        "doc-pg" not in gone,
        "v5 deletes it: search no longer finds it",
        f"after a delete (v5), search 'outbox relay' still returns {gone}",
    )
    await index_event(pool, _event("doc-pg", 4, title="Outbox relay", body="The relay publishes outbox rows."))
    back = await search_docs(pool, "outbox relay")
    r.expect(
        "doc-pg" not in back,
        "a late v4 after the delete: still gone (a tombstone kept version 5)",
        f"a late v4 after the delete (v5) brought the document back: search returns {back}. A delete must keep the "
        "row's version (a tombstone: deleted = true), or the index cannot tell the late update is older",
    )
    await index_event(pool, _event("doc-pg", 6, title="Outbox relay, revised", body="Relays publish outbox rows."))
    again = await search_docs(pool, "outbox relay")
    r.expect(
        "doc-pg" in again,
        "a newer v6 after the delete brings it back",
        f"v6 after the delete (v5): search 'outbox relay' returns {again}; a newer upsert replaces the tombstone",
    )

    # --- ranking -------------------------------------------------------------------------------------
    corpus = [
        _event("rank-title", 1, title="Snapshot isolation", body="Readers see one consistent state of the database."),
        _event(
            "rank-body",
            1,
            title="Vacuum and dead tuples",
            body="Long transactions under snapshot isolation hold back vacuum.",
        ),
        _event("rank-none", 1, title="Connection pools", body="A pool keeps connections open between requests."),
    ]
    for e in corpus:
        await index_event(pool, e)
    found = await search_docs(pool, "snapshot isolation")
    r.expect(
        found[:2] == ["rank-title", "rank-body"] and "rank-none" not in found,
        "search_docs('snapshot isolation'): the title match ranks first, the body match second",
        f"search_docs(pool, 'snapshot isolation') returned {found}; expected ['rank-title', 'rank-body'] first "
        "(title weighted A above body B, ordered by ts_rank descending) and no 'rank-none'",
    )

    # --- two replicas, two versions, the newer one written first --------------------------------------
    a, b = r.replicas("index_event", 2)
    await index_event(pool, _event("doc-race", 1, title="First draft", body="draft"))
    newer = _event("doc-race", 3, title="Final text", body="final")
    older = _event("doc-race", 2, title="Second draft", body="draft")
    r.note(
        "doc-race at v1; replica A gets v3, then replica B gets v2 while A's write is held; both read the "
        "index before either writes, and the check lets v3's write land first"
    )
    results, log = await rig.race(
        ns.database_url,
        ["search_documents"],
        [lambda: a(pool, newer), lambda: b(pool, older)],
        order=[3, 2],
        stagger=True,
    )
    r.note(log.line())
    for x in results:
        if isinstance(x, BaseException):
            r.fail(f"a replica raised {error_line(x)} while indexing doc-race")
    row = await _indexed(pool, "doc-race")
    r.expect(
        row[0] == 3,
        "the index ends at v3",
        f"the index ends at version {row[0]} ({row[1]!r}): the older event read version 1, decided to write, and "
        "overwrote v3 after it landed. Make the version comparison part of the write itself (one conditional "
        "upsert) or lock the row (SELECT ... FOR UPDATE) before comparing",
    )

    # --- many documents, shuffled, across two replicas ---------------------------------------------------
    deliveries = []
    for i in range(15):
        for v in (1, 2, 3):
            deliveries.append(_event(f"bulk-{i:02d}", v, title=f"bulk {i} version {v}", body=f"word{v}"))
    deliveries += deliveries[::4]
    r.random.shuffle(deliveries)
    results = await asyncio.gather(*(_attempt((a if k % 2 else b)(pool, e)) for k, e in enumerate(deliveries)))
    errors = [x for x in results if isinstance(x, BaseException)]
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE version = 3), count(*) FROM search_documents WHERE doc_id LIKE 'bulk-%%'"
        )
        at3, total = await cur.fetchone()
    r.expect(
        at3 == total == 15 and not errors,
        f"{len(deliveries)} shuffled deliveries of 15 documents (v1-v3, some twice) on two replicas: all 15 at v3",
        f"{len(deliveries)} shuffled deliveries of 15 documents: {at3} of {total} at v3"
        + (f", errors: {tally(errors)}" if errors else ""),
    )


#: The course's own reference implementation of each task (issue 26): while a task is graded,
#: a learner's answer that is, wraps or calls one of these earns nothing for it. The checks
#: themselves may still use them as rigs.
REFERENCES: dict[str, list[str]] = {
    "append_events": ["course.eventstore:append"],
    "account_projection": ["course.projections:apply_events", "course.projections:rebuild_balances"],
    "search_indexer": ["course.search:index_event", "course.search:search"],
}
