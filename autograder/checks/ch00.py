"""Hidden checks of chapter 00 (setup and tour): the warm-up task that touches both servers.

The concurrent burst holds every plain ``GET`` of a ``visits:`` key until all callers have
read (or none has arrived for :data:`IDLE` seconds), so a read-add-write answer loses the
same updates on every run instead of whichever ones the scheduler happened to interleave.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from autograder.harness import Report, task
from autograder.rules import Rule
from course.chapters.ch00 import setup_visits
from course.kit import lab

#: real seconds a held GET waits for more readers before it goes on alone (code that reads
#: one caller at a time, behind a lock, pays this once per read and still passes)
IDLE = 2.0


class HeldReads:
    """A ``redis.asyncio.Redis`` whose ``get`` of a ``visits:`` key waits until ``expected``
    reads are waiting (or none arrived for :data:`IDLE` s), then lets them all through."""

    def __init__(self, redis, expected: int) -> None:
        self._redis = redis
        self._expected = expected
        self._waiting = 0
        self._arrived = asyncio.Event()
        self._open = asyncio.Event()
        self.held = 0

    def __getattr__(self, name):
        return getattr(self._redis, name)

    async def get(self, name, *args, **kwargs):
        if str(name).startswith("visits:") and not self._open.is_set():
            self._waiting += 1
            self.held += 1
            self._arrived.set()
            if self._waiting >= self._expected:
                self._open.set()
            while not self._open.is_set():
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), IDLE)
                except TimeoutError:
                    break
            self._waiting -= 1
        return await self._redis.get(name, *args, **kwargs)


@task("count_visit", points=2, title="count a visit in Redis and PostgreSQL", timeout=60)
async def check_count_visit(r: Report, count_visit) -> None:
    async with lab.scratch("ch00") as ns:
        pool = await ns.pool(max_size=10)
        redis = ns.redis()
        await setup_visits(pool)

        first = await count_visit(redis, pool, "home")
        r.expect(
            first == 1 and type(first) is int,
            f"first visit of 'home' returned {first!r}, expected 1",
            f"first visit of 'home' returned {first!r}, expected the int 1"
            + (" (a str: the count read back with GET instead of the int INCR returns?)" if first == "1" else ""),
        )
        if r.public:
            return

        after_one = {k: await redis.get(k) for k in sorted(await redis.keys("*"))}
        r.expect(
            after_one == {"visits:home": "1"},
            "after that visit Redis holds {'visits:home': '1'}",
            f"after that visit Redis holds {after_one}, expected {{'visits:home': '1'}}: one counter per page "
            "at key visits:<page>",
        )
        await redis.set("visits:contact", 41)
        contact = await count_visit(redis, pool, "contact")
        r.expect(
            contact == 42,
            "a page whose Redis counter already stood at 41 (no rows in visits) returned 42",
            f"a page whose Redis counter already stood at 41 (no rows in visits) returned {contact!r}, expected 42: "
            "the count to return is the one INCR of visits:contact gives back (counted from the visits "
            "table? a counter of your own?)",
        )

        pages = ["home"] * 19 + ["about"] * 5
        held = HeldReads(redis, len(pages))
        got = await asyncio.gather(*(count_visit(held, pool, p) for p in pages))
        home = sorted(v for p, v in zip(pages, got, strict=True) if p == "home")
        r.note(
            "then 24 visits at once, 19 more of 'home' and 5 of 'about' (a GET of a visits: key waits for the others)"
        )
        repeated = sorted(v for v, n in Counter(home).items() if n > 1)
        r.expect(
            home == list(range(2, 21)),
            "the 19 concurrent 'home' visits returned 2..20, each once",
            # which counts repeat depends on how the held reads were let go: the line names only the fact
            "the 19 concurrent 'home' visits returned the same count more than once: lost updates. Reading the "
            "counter (GET), adding one and writing it back is not atomic (use INCR)"
            if repeated
            else f"the 19 concurrent 'home' visits returned {home}, expected 2..20, each once",
        )
        keys = sorted(await redis.keys("*"))
        values = {k: await redis.get(k) for k in keys}
        expected = {"visits:about": "5", "visits:contact": "42", "visits:home": "20"}
        r.expect(
            values == expected,
            f"Redis holds {values}",
            f"Redis holds {values}, expected {expected}: one counter per page at key visits:<page>",
        )
        async with pool.connection() as conn:
            rows = await (
                await conn.execute("SELECT page, count(*) FROM visits GROUP BY page ORDER BY page")
            ).fetchall()
        want = {"about": 5, "contact": 1, "home": 20}
        r.expect(
            dict(rows) == want,
            f"PostgreSQL has {dict(rows)} visits rows per page",
            f"PostgreSQL has {dict(rows)} visits rows per page, expected {want}: one INSERT per visit",
        )


RULES: dict[str, list[Rule]] = {
    "count_visit": [
        Rule(
            "It records one visit of page in both servers",
            "check_count_visit: counts the visits rows per page in PostgreSQL after 25 visits",
            wrong="redis only",
        ),
        Rule(
            "in Redis, add one to the counter at key visits:<page>",
            "check_count_visit: reads every key Redis holds after the visits",
            wrong="wrong key",
        ),
        Rule(
            "in PostgreSQL, insert one row (page) into the visits table",
            "check_count_visit: counts the visits rows per page in PostgreSQL",
            wrong="redis only",
        ),
        Rule(
            "return the new count from Redis, as an int",
            "check_count_visit: the first visit must return the int 1; a page whose counter stands at 41 must return 42",
            wrong="count read back with GET",
        ),
        Rule(
            "two visits must never get the same count",
            "check_count_visit: 24 visits at once, every GET of a visits: key held until all have read",
            wrong="get then set",
        ),
        Rule(
            "Reading the counter, adding one and writing it back loses updates under concurrency",
            "check_count_visit: the held GETs make a read-add-write answer repeat counts on every run",
            wrong="get then set",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {"count_visit": []}
