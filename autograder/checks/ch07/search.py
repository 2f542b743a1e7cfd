"""Hidden checks of ``search_indexer``: an outbox-fed, idempotent search index."""

from __future__ import annotations

import asyncio

from autograder.checks.ch07.append import _attempt
from autograder.harness import Report, error_line, task
from course.chapters.ch07 import rig
from course.kit import lab

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

    # --- deletes (the delete event still carries the last title and body: a tombstone drops them) ------
    await index_event(
        pool, _event("doc-pg", 5, op="delete", title="Outbox relay", body="The relay publishes outbox rows.")
    )
    gone = await search_docs(pool, "outbox relay")
    r.expect(
        "doc-pg" not in gone,
        "v5 deletes it: search no longer finds it",
        f"after a delete (v5), search 'outbox relay' still returns {gone}",
    )
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT version, deleted, coalesce(length(tsv), -1) FROM search_documents WHERE doc_id = 'doc-pg'"
        )
        tomb = await cur.fetchone()
    r.expect(
        tomb == (5, True, 0),
        "the delete left a tombstone: version 5, deleted = true, no words in tsv",
        "after the delete (v5) the row of doc-pg holds "
        + ("nothing" if tomb is None else f"version {tomb[0]}, deleted = {tomb[1]}, {tomb[2]} word(s) in tsv")
        + "; expected a tombstone: the event's version (5), deleted = true and empty words (tsv = ''). "
        "Likely causes: a delete that keeps the old version (then a late update between the two versions "
        "comes back), or one that keeps the document's words",
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
    await index_event(
        pool, _event("doc-pg", 5, op="delete", title="Outbox relay", body="The relay publishes outbox rows.")
    )
    kept = await search_docs(pool, "outbox relay")
    row = await _indexed(pool, "doc-pg")
    r.expect(
        "doc-pg" in kept and row is not None and row[0] == 6 and not row[2],
        "the v5 delete delivered again after v6: ignored, the document stays",
        f"the v5 delete delivered again after v6: the row is now {row} and search 'outbox relay' returns {kept}; "
        "a delete is an event like any other: apply it only if its version is newer than the indexed one",
    )
    # a row marked deleted that still holds words (written here by the check): search must not return it
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO search_documents (doc_id, version, title, body, deleted, tsv) VALUES "
            "('doc-gone', 9, 'Checkpoint lag', 'Checkpoint lag of a projector.', true, "
            "to_tsvector('english', 'Checkpoint lag of a projector'))"
        )
    hidden = await search_docs(pool, "checkpoint lag")
    r.expect(
        "doc-gone" not in hidden,
        "a row with deleted = true is never returned by search_docs",
        f"search_docs(pool, 'checkpoint lag') returned {hidden}, including 'doc-gone', a row with deleted = true "
        "(the check wrote it with its words still in tsv): return only documents that are not deleted "
        "(WHERE NOT deleted)",
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

    found = await search_docs(pool, "snapshot -vacuum")
    r.expect(
        found == ["rank-title"],
        "search_docs('snapshot -vacuum'): web search syntax, '-' excludes a word",
        f"search_docs(pool, 'snapshot -vacuum') returned {found}; expected ['rank-title'] (the other snapshot "
        "document mentions vacuum). Parse the query with websearch_to_tsquery('english', query), which reads "
        "'-word', \"a phrase\" and 'or' (plainto_tsquery reads '-vacuum' as the word vacuum)",
    )
    found = await search_docs(pool, "snapshot isolation", limit=1)
    r.expect(
        found == ["rank-title"],
        "search_docs('snapshot isolation', limit=1) returns the best match only",
        f"search_docs(pool, 'snapshot isolation', limit=1) returned {found}; expected ['rank-title']: return at "
        "most `limit` doc_ids (LIMIT %s)",
    )
    for doc_id in ("tie-d", "tie-b", "tie-c", "tie-a"):  # equal rank, indexed out of doc_id order
        await index_event(pool, _event(doc_id, 1, title="Quorum reads", body="Read repair after a quorum read."))
    found = await search_docs(pool, "quorum")
    r.expect(
        found == ["tie-a", "tie-b", "tie-c", "tie-d"],
        "four documents of equal rank come back ordered by doc_id",
        f"four documents with the same words (equal ts_rank), indexed as tie-d, tie-b, tie-c, tie-a, came back "
        f"as {found}; expected ['tie-a', 'tie-b', 'tie-c', 'tie-d']: break ties by doc_id (ORDER BY ts_rank(...) "
        "DESC, doc_id)",
    )

    # --- a failed write reaches the caller (the relay delivers the event again) ------------------------
    failing = _event("rank-none", 2, title="Connection pools", body="A pool caps connections per process.")
    await rig.arm_crash(pool, "search_documents", 1)
    try:
        await index_event(pool, failing)
        raised = None
    except Exception as err:  # noqa: BLE001 - the injected failure, expected to reach the caller
        raised = err
    fired = await rig.disarm(pool, "search_documents")
    row = await _indexed(pool, "rank-none")
    if fired and raised is None and row is not None and row[0] == 2:
        r.ok("a write that failed was retried inside index_event and applied")
    elif fired and raised is None:
        r.fail(
            "the check made the database fail index_event's write (an injected error) and index_event returned "
            f"normally; the row is {row}. The relay marks an event published when index_event returns, so a "
            "swallowed error loses the update for good: let the error reach the caller"
        )
    elif fired:
        r.ok(f"a write that failed raised to the caller ({error_line(raised, 60)})")

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

    # --- a document's FIRST insert, raced both ways (issue 35: gated, not left to a shuffle) -----------
    for first, second in ((2, 3), (3, 2)):
        doc = f"doc-new-{first}{second}"
        events = {v: _event(doc, v, title=f"{doc} version {v}", body=f"word{v}") for v in (2, 3)}
        results, log = await rig.race(
            ns.database_url,
            ["search_documents"],
            [lambda v=first, e=events: a(pool, e[v]), lambda v=second, e=events: b(pool, e[v])],
            order=[first, second],
            stagger=True,
        )
        for x in results:
            if isinstance(x, BaseException):
                r.fail(f"{doc} (never indexed): a replica raised {error_line(x)} while indexing its first version")
        row = await _indexed(pool, doc)
        r.expect(
            row is not None and row[0] == 3,
            f"{doc}, never indexed: v{first} and v{second} on two replicas at once, v{first}'s write let through "
            "first: the index ends at v3",
            f"{doc}, never indexed: replica A got v{first}, replica B v{second}, both at once, and the check let "
            f"v{first}'s write land first; the index ends at "
            f"{'no row' if row is None else f'version {row[0]}'}, expected v3. Likely causes: a first insert that "
            "does nothing on a conflict (INSERT ... ON CONFLICT DO NOTHING after an UPDATE that found no row), so "
            "the newer version loses to an older one inserted a moment before it; or a read of the missing row, "
            "then a blind insert or overwrite. Make the first insert the same conditional upsert (ON CONFLICT "
            "(doc_id) DO UPDATE ... WHERE search_documents.version < EXCLUDED.version)",
        )

    # --- many documents, shuffled, across two replicas (adds failures only; same words every run) --------
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
    kinds = sorted({type(x).__name__ for x in errors})
    r.expect(
        at3 == total == 15 and not errors,
        f"{len(deliveries)} shuffled deliveries of 15 documents (v1-v3, some twice) on two replicas: all 15 at v3",
        f"{len(deliveries)} shuffled deliveries of 15 documents (v1-v3, some twice) on two replicas at once: "
        + ("not every document ended at v3" if at3 != 15 or total != 15 else "every document ended at v3")
        + (f", and some deliveries raised ({', '.join(kinds)})" if errors else "")
        + ". The gated races above passed, so this is a race they do not force; likely causes: a version check "
        "and a write that are two statements, or an error on a conflict that a redelivery would not repair",
    )
