"""Search indexing fed by an outbox, with an idempotent, versioned indexer (chapter 07).

Writing a document to the database and then to the search index ("dual write") drifts:
a crash between the two writes leaves the index behind, and two concurrent updates can
reach the index in the other order. The fix in three parts:

1. **outbox**: the change and an event ``(doc_id, version, op, title, body)`` are written
   in one transaction (``search_outbox``), so an event exists if and only if the change
   committed;
2. **relay**: claims unpublished events (``FOR UPDATE SKIP LOCKED``), hands each to the
   indexer, marks it published; a crash means a redelivery (at least once), and several
   relays may deliver two versions of one document out of order;
3. **idempotent indexer**: applies an event only when its version is newer than the one
   in the index (one conditional upsert), and keeps a **tombstone** for deletes, so a
   late, older update cannot bring a deleted document back.

The index here is PostgreSQL full-text search: ``search_documents.tsv`` (a ``tsvector``,
title weighted A, body B) under a GIN index, queried with ``websearch_to_tsquery`` and
ranked with ``ts_rank``. If your index really is a table in the same database, update it
in the same transaction and skip the outbox; the outbox is for an index somewhere else
(Elasticsearch, Meilisearch, an embedded engine), and the indexer has the same shape.

This module owns ``search_documents`` and ``search_outbox`` (chapter 06's general outbox,
when there is one, can feed the same indexer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import psycopg
import psycopg.errors
from psycopg.types.json import Jsonb

from course.kit.lab import connection

SCHEMA = """
CREATE TABLE IF NOT EXISTS search_documents (
    doc_id     text        PRIMARY KEY,
    version    integer     NOT NULL,
    title      text        NOT NULL DEFAULT '',
    body       text        NOT NULL DEFAULT '',
    deleted    boolean     NOT NULL DEFAULT false,
    tsv        tsvector    NOT NULL DEFAULT ''::tsvector,
    indexed_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS search_documents_tsv ON search_documents USING gin (tsv);

CREATE TABLE IF NOT EXISTS search_outbox (
    id           bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    doc_id       text        NOT NULL,
    version      integer     NOT NULL,
    op           text        NOT NULL CHECK (op IN ('upsert', 'delete')),
    payload      jsonb       NOT NULL DEFAULT '{}',
    created_at   timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz
);
CREATE INDEX IF NOT EXISTS search_outbox_unpublished ON search_outbox (id) WHERE published_at IS NULL;
-- A row the indexer keeps refusing is retried, then set aside: it must not hold up the rows behind it.
ALTER TABLE search_outbox ADD COLUMN IF NOT EXISTS attempts   integer NOT NULL DEFAULT 0;
ALTER TABLE search_outbox ADD COLUMN IF NOT EXISTS last_error text;
ALTER TABLE search_outbox ADD COLUMN IF NOT EXISTS dead_at    timestamptz;
"""

#: Deliveries of one outbox row that fail on the row itself before it is dead-lettered.
MAX_ATTEMPTS = 5

#: The text search configuration: English stemming ("indexing" and "indexes" both match "index").
CONFIG = "english"

#: The document's tsvector: title words weigh more (A) than body words (B) in ts_rank.
TSV = "setweight(to_tsvector('english', %(title)s), 'A') || setweight(to_tsvector('english', %(body)s), 'B')"

# One statement decides: insert a new document, replace an older version, ignore the rest.
_TSV_SHOWN = TSV.replace(
    " || ", "\n                  || "
)  # the same SQL, on lines a notebook shows unwrapped
UPSERT = f"""
INSERT INTO search_documents AS d (doc_id, version, title, body, deleted, tsv, indexed_at)
VALUES (%(doc_id)s, %(version)s, %(title)s, %(body)s, %(deleted)s,
        CASE WHEN %(deleted)s THEN ''::tsvector
             ELSE {_TSV_SHOWN} END,
        now())
ON CONFLICT (doc_id) DO UPDATE
   SET version = EXCLUDED.version, title = EXCLUDED.title, body = EXCLUDED.body,
       deleted = EXCLUDED.deleted, tsv = EXCLUDED.tsv, indexed_at = now()
 WHERE d.version < EXCLUDED.version
RETURNING version
"""


async def setup_schema(pool_or_conn) -> None:
    """Create ``search_documents`` (with its GIN index) and ``search_outbox`` (idempotent)."""
    async with connection(pool_or_conn) as conn:
        await conn.execute(SCHEMA)


# ----------------------------------------------------------------------------- the indexer


async def index_event(pool, event: dict) -> bool:
    """Apply one outbox event to the index; True if it changed the index, False if stale or repeated.

    ``event`` is ``{"doc_id", "version", "op": "upsert" | "delete", "title", "body"}``.
    A delete is stored as a tombstone (``deleted = true`` with its version, no words), so
    an older upsert that arrives after it is recognised as older and ignored.
    """
    deleted = event["op"] == "delete"
    params = {
        "doc_id": event["doc_id"],
        "version": event["version"],
        "title": "" if deleted else event.get("title") or "",
        "body": "" if deleted else event.get("body") or "",
        "deleted": deleted,
    }
    async with pool.connection() as conn:
        cur = await conn.execute(UPSERT, params)
        return await cur.fetchone() is not None


async def search(pool, query: str, limit: int = 10) -> list[str]:
    """Doc ids matching ``query`` (web-search syntax: words, "quoted phrases", -not, or), best first."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT doc_id FROM search_documents, websearch_to_tsquery('english', %s) q "
            "WHERE NOT deleted AND tsv @@ q ORDER BY ts_rank(tsv, q) DESC, doc_id LIMIT %s",
            (query, limit),
        )
        return [row[0] for row in await cur.fetchall()]


async def search_ranked(pool, query: str, limit: int = 10) -> list[tuple[str, str, float]]:
    """``(doc_id, title, rank)`` rows, best first (notebooks print these)."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT doc_id, title, ts_rank(tsv, q) AS rank FROM search_documents, websearch_to_tsquery('english', %s) q "
            "WHERE NOT deleted AND tsv @@ q ORDER BY rank DESC, doc_id LIMIT %s",
            (query, limit),
        )
        return [(d, t, float(r)) for d, t, r in await cur.fetchall()]


# ----------------------------------------------------------------------------- the outbox and its relay


async def enqueue(conn, doc_id: str, version: int, op: str, title: str = "", body: str = "") -> None:
    """Add an index event to the outbox, on ``conn`` **inside the transaction that made the change**."""
    await conn.execute(
        "INSERT INTO search_outbox (doc_id, version, op, payload) VALUES (%s, %s, %s, %s)",
        (doc_id, version, op, Jsonb({"title": title, "body": body})),
    )


def outbox_event(row) -> dict:
    """The event an indexer receives, from a ``search_outbox`` row ``(id, doc_id, version, op, payload)``."""
    outbox_id, doc_id, version, op, payload = row
    return {"outbox_id": outbox_id, "doc_id": doc_id, "version": version, "op": op, **payload}


Indexer = Callable[[object, dict], Awaitable[object]]


def transient(err: BaseException) -> bool:
    """An error of the index as a whole (down, slow, unreachable), not of one event."""
    if isinstance(err, psycopg.errors.ProgramLimitExceeded):
        return False  # "string is too long for tsvector": this event will never fit
    return isinstance(err, (OSError, TimeoutError, psycopg.OperationalError))


async def relay_once(
    pool,
    indexer: Indexer = index_event,
    *,
    batch: int = 50,
    index_pool=None,
    max_attempts: int = MAX_ATTEMPTS,
) -> int:
    """Deliver up to ``batch`` unpublished outbox events to ``indexer``; how many were published.

    The claimed rows stay locked (``FOR UPDATE SKIP LOCKED``) until they are marked
    published in the same transaction, so a second relay skips them. When the index itself
    fails (:func:`transient`) the whole batch rolls back and stays for the next round:
    at-least-once delivery. When one event fails on its own (a body too long to index, a
    malformed payload), that row counts an attempt and the rest of the batch goes on; after
    ``max_attempts`` it is dead-lettered (``dead_at``), so one bad row never blocks the rows
    behind it forever (chapter 05's head-of-line lesson). Per-document versions make
    skipping safe: a newer version of the same document still wins.
    """
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT id, doc_id, version, op, payload FROM search_outbox "
            "WHERE published_at IS NULL AND dead_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED",
            (batch,),
        )
        rows = await cur.fetchall()
        done = []
        for row in rows:
            try:
                await indexer(index_pool or pool, outbox_event(row))
            except Exception as err:  # noqa: BLE001 - sorted below: the index's fault or this row's
                if transient(err):
                    raise
                await conn.execute(
                    "UPDATE search_outbox SET attempts = attempts + 1, last_error = %s, "
                    "dead_at = CASE WHEN attempts + 1 >= %s THEN now() END WHERE id = %s",
                    (f"{type(err).__name__}: {err}"[:500], max_attempts, row[0]),
                )
                continue
            done.append(row[0])
        if done:
            await conn.execute("UPDATE search_outbox SET published_at = now() WHERE id = ANY(%s)", (done,))
    return len(done)


async def dead_letters(pool) -> list[tuple[int, str, int, int, str]]:
    """``(outbox id, doc_id, version, attempts, last error)`` of the rows set aside, oldest first."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT id, doc_id, version, attempts, last_error FROM search_outbox WHERE dead_at IS NOT NULL ORDER BY id"
        )
        return [tuple(row) for row in await cur.fetchall()]


async def redrive(pool, ids: list[int]) -> int:
    """Put dead-lettered rows back in line (after the fix is deployed); how many."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE search_outbox SET dead_at = NULL, attempts = 0 WHERE id = ANY(%s) AND dead_at IS NOT NULL",
            (ids,),
        )
        return cur.rowcount


async def relay_all(pool, indexer: Indexer = index_event, *, batch: int = 50) -> int:
    """Relay until no deliverable event is left; the number of events published."""
    total = 0
    while n := await relay_once(pool, indexer, batch=batch):
        total += n
    return total


async def unpublished(pool) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM search_outbox WHERE published_at IS NULL")
        return (await cur.fetchone())[0]
