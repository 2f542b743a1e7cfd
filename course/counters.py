"""Counting views without one write per view: the batched counter (taught in chapter 11).

``UPDATE items SET views = views + 1`` once per view queues every view of a popular item
on one row lock, with a WAL record and a dead tuple each. A :class:`BatchedCounter` adds
views up in the process and writes the deltas every ``max_views`` views (and whenever its
owner's ticker calls :meth:`BatchedCounter.flush`), in **one** statement: an additive
upsert, so two replicas flushing the same item both count. The statement takes the items'
row locks in item order (``ORDER BY item_id``), so two replicas flushing {a, b} and {b, a}
queue instead of deadlocking. A flush that fails puts its deltas back, so the next flush
writes them; :meth:`BatchedCounter.close` (graceful shutdown: SIGTERM, the event loop's end)
flushes what is left. A crash (SIGKILL) loses at most the unflushed buffer.

"Fails" includes one case the counter cannot tell apart: the commit succeeded and its reply
was lost (a dropped connection). Putting that batch back counts it twice. :class:`DedupedCounter`
closes the gap: each batch gets a flush id, recorded in ``view_count_flushes`` in the same
transaction as its deltas, and a batch that failed is retried as it was, under the same id;
the retry of a batch that had committed finds its id and adds nothing.

Also here: totals merged with ``GREATEST`` (safe to repeat, never moves a total back) and a
hot counter split into shard rows that a read adds up.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections import Counter

SCHEMA = """
-- one total per item; the batched counter adds deltas to it
CREATE TABLE IF NOT EXISTS view_counts (
    item_id text PRIMARY KEY,
    views   bigint NOT NULL DEFAULT 0
);
-- the flushes already applied, by id: a retried batch whose first commit got through adds nothing
CREATE TABLE IF NOT EXISTS view_count_flushes (
    flush_id   text PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);
-- a hot item's count split over several rows: writers pick one, a read adds them up
CREATE TABLE IF NOT EXISTS view_count_shards (
    item_id text NOT NULL,
    shard   int NOT NULL,
    views   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (item_id, shard)
);
"""

#: One statement for the whole batch: the deltas arrive as two arrays. ``ORDER BY`` takes the
#: rows' locks in item order, whatever order the views arrived in: two flushes of the same items
#: then wait for each other in one direction, never in a cycle.
ADD_DELTAS = """
INSERT INTO view_counts AS c (item_id, views)
SELECT d.item_id, d.views FROM unnest(%s::text[], %s::bigint[]) AS d (item_id, views) ORDER BY d.item_id
ON CONFLICT (item_id) DO UPDATE SET views = c.views + EXCLUDED.views
"""

#: Totals (not deltas) from an aggregator that already added everything up: a repeat is harmless
#: and a total that arrives late (smaller) never moves the stored one back.
MERGE_TOTALS = """
INSERT INTO view_counts AS c (item_id, views)
SELECT * FROM unnest(%s::text[], %s::bigint[])
ON CONFLICT (item_id) DO UPDATE SET views = GREATEST(c.views, EXCLUDED.views)
"""


async def setup_schema(pool) -> None:
    """Create ``view_counts`` and ``view_count_shards`` (idempotent)."""
    async with pool.connection() as conn:
        await conn.execute(SCHEMA)


async def count_view_per_row(pool, item_id: str) -> None:
    """The design that does not scale: one write (one transaction, one row lock) per view."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO view_counts AS c (item_id, views) VALUES (%s, 1) "
            "ON CONFLICT (item_id) DO UPDATE SET views = c.views + 1",
            (item_id,),
        )


class BatchedCounter:
    """Views added up in this process, written as deltas in one statement per flush.

    ``await view(item)`` counts one view and flushes when ``max_views`` are buffered;
    the owner's ticker calls ``await flush()`` every N ms; ``await close()`` flushes on
    shutdown. Views that arrive while a flush is writing go into a new buffer, and a
    failed flush merges its deltas back, so nothing is lost. Nothing is counted twice either,
    except when a flush's commit succeeded and its reply was lost: that batch goes back too,
    and is added again (:class:`DedupedCounter` is the fix).
    """

    def __init__(self, pool, *, max_views: int = 100) -> None:
        self.pool = pool
        self.max_views = max_views
        self.buffer: Counter[str] = Counter()
        self.pending = 0  # views in the buffer
        self.flushes = 0  # statements written

    async def view(self, item_id: str, n: int = 1) -> None:
        self.buffer[item_id] += n
        self.pending += n
        if self.pending >= self.max_views:
            await self.flush()

    async def flush(self) -> None:
        if not self.buffer:
            return
        batch, self.buffer = self.buffer, Counter()  # new views go to a fresh buffer meanwhile
        self.pending -= sum(batch.values())
        try:
            async with self.pool.connection() as conn:
                await conn.execute(ADD_DELTAS, _arrays(batch))
        except BaseException:
            self.buffer.update(batch)  # one statement: all of it failed, so all of it goes back
            self.pending += sum(batch.values())
            raise
        self.flushes += 1

    async def close(self) -> None:
        await self.flush()


def _arrays(batch: Counter) -> tuple[list[str], list[int]]:
    items = sorted(batch)  # item order here too: the statement's ORDER BY makes it the lock order
    return items, [batch[i] for i in items]


class DedupedCounter(BatchedCounter):
    """A :class:`BatchedCounter` whose retried flush never counts a batch twice.

    Each batch is sealed with an id (``source``, unique per process, and a sequence number) and
    written in one transaction with a row in ``view_count_flushes``. A flush that raised keeps
    its batch sealed, and the next flush sends that same batch, under the same id, before the
    new views: when the first attempt had committed (its reply was lost), the id is found and
    nothing is added. Old ids can be deleted once no retry can come (a day, say).
    """

    def __init__(self, pool, *, source: str, max_views: int = 100) -> None:
        super().__init__(pool, max_views=max_views)
        self.source = source
        self.sequence = 0
        self.sealed: tuple[str, Counter[str]] | None = None  # a batch that failed, to send again as it was

    async def flush(self) -> None:
        for _ in range(2):  # the batch left over from a failed flush first, then the buffer
            if self.sealed is None:
                if not self.buffer:
                    return
                self.sequence += 1
                batch, self.buffer = self.buffer, Counter()
                self.pending -= sum(batch.values())
                self.sealed = (f"{self.source}:{self.sequence}", batch)
            flush_id, batch = self.sealed
            async with self.pool.connection() as conn, conn.transaction():
                cur = await conn.execute(
                    "INSERT INTO view_count_flushes (flush_id) VALUES (%s) ON CONFLICT DO NOTHING RETURNING 1",
                    (flush_id,),
                )
                if await cur.fetchone() is not None:  # not applied before: add the deltas
                    await conn.execute(ADD_DELTAS, _arrays(batch))
            self.sealed = None  # applied now, or found applied already
            self.flushes += 1

    async def close(self) -> None:
        await self.flush()


async def run_ticker(counter: BatchedCounter, interval: float, stop: asyncio.Event) -> None:
    """Flush every ``interval`` seconds until ``stop`` is set, then flush once more.

    A failed flush is retried at the next tick (its views stayed in the buffer).
    """
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass
        try:
            await counter.flush()
        except Exception:  # noqa: BLE001 - the views are back in the buffer; the next tick retries
            if stop.is_set():
                raise


def flush_on_sigterm(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """SIGTERM (a deploy, ``kubectl delete pod``) sets ``stop``: the ticker flushes and ends."""
    loop.add_signal_handler(signal.SIGTERM, stop.set)


async def merge_totals(pool, totals: dict[str, int]) -> None:
    """Write totals (not deltas) with ``GREATEST``: safe to run twice, never moves a count back."""
    async with pool.connection() as conn:
        await conn.execute(MERGE_TOTALS, (list(totals), list(totals.values())))


async def read_counts(pool, item_ids=None) -> dict[str, int]:
    async with pool.connection() as conn:
        if item_ids is None:
            cur = await conn.execute("SELECT item_id, views FROM view_counts ORDER BY item_id")
        else:
            cur = await conn.execute(
                "SELECT item_id, views FROM view_counts WHERE item_id = ANY(%s) ORDER BY item_id",
                (list(item_ids),),
            )
        return dict(await cur.fetchall())


async def add_to_shard(
    pool, item_id: str, shards: int, n: int = 1, *, rand: random.Random | None = None
) -> None:
    """A hot counter split into ``shards`` rows: each write picks one, so writers rarely queue."""
    shard = (rand or random).randrange(shards)
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO view_count_shards AS s (item_id, shard, views) VALUES (%s, %s, %s) "
            "ON CONFLICT (item_id, shard) DO UPDATE SET views = s.views + EXCLUDED.views",
            (item_id, shard, n),
        )


async def read_sharded(pool, item_id: str) -> int:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT coalesce(sum(views), 0) FROM view_count_shards WHERE item_id = %s", (item_id,)
        )
        return int((await cur.fetchone())[0])
