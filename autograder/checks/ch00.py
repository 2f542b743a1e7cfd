"""Hidden checks of chapter 00 (setup and tour): the warm-up task that touches both servers.

The concurrent burst runs in lockstep (:mod:`autograder.lockstep`): each Redis command waits
until every visit still running has sent its own, so a read-add-write answer loses the same
updates on every run instead of whichever ones the scheduler happened to interleave. The
visits alternate between two replicas of the answer cell, so a lock kept in one process (each
replica has its own) does not hide the race either.
"""

from __future__ import annotations

from collections import Counter

import psycopg

from autograder.harness import Report, task
from autograder.probes import gated_redis, postgres_busy, tally
from autograder.rules import Rule
from course.chapters.ch00 import setup_visits
from course.kit import lab


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
        replicas = r.replicas("count_visit", 2)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        gated = gated_redis(ns.redis_url, len(pages), busy=postgres_busy(watcher))
        try:
            got = await gated.gate.run([lambda i=i, p=p: replicas[i % 2](gated, pool, p) for i, p in enumerate(pages)])
        finally:
            await gated.aclose()
            await watcher.close()
        r.note(
            "then 24 visits at once, 19 more of 'home' and 5 of 'about', through two replicas of your cell (as two "
            "processes of a service); each Redis command waits until every visit still running has sent its own"
        )
        errors = [x for x in got if isinstance(x, BaseException)]
        r.expect(not errors, "all 24 visits returned", f"of the 24 concurrent visits, some raised: {tally(errors)}")
        home = sorted(v for p, v in zip(pages, got, strict=True) if p == "home")
        repeated = sorted(v for v, n in Counter(home).items() if n > 1)
        queued = (
            " In each replica the visits queued on something in-process (a lock?), and the two replicas read the "
            "same counter at the same time: a lock in one process does not reach another."
            if gated.gate.stalled
            else ""
        )
        keys = sorted(await redis.keys("*"))
        values = {k: await redis.get(k) for k in keys}
        if values.get("visits:home") == "20":  # every INCR landed: the repeats came from reading the count back
            why = (
                f"the 19 concurrent 'home' visits returned the same count more than once ({repeated}), though "
                "the counter reached 20: the count was read back with a second command (INCR, then GET) while "
                "other visits added theirs in between. Return the value INCR itself gives back"
            )
        else:
            why = (
                "the 19 concurrent 'home' visits returned the same count more than once: lost updates." + queued + " "
                "Reading the counter (GET), adding one and writing it back is not atomic (use INCR)"
            )
        r.expect(
            home == list(range(2, 21)),
            "the 19 concurrent 'home' visits returned 2..20, each once",
            why if repeated else f"the 19 concurrent 'home' visits returned {home}, expected 2..20, each once",
        )
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
            "check_count_visit: 24 visits at once in lockstep, each Redis command held until every visit has sent "
            "its own",
            wrong="get then set",
        ),
        Rule(
            "through two replicas of your answer cell",
            "check_count_visit: the visits alternate between two replicas, so each replica's own lock lets one "
            "through per round and the two read the same counter",
            wrong="get then set under a lock",
        ),
        Rule(
            "Reading the counter, adding one and writing it back loses updates under concurrency",
            "check_count_visit: the lockstep makes a read-add-write answer repeat counts on every run",
            wrong="get then set",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {"count_visit": []}

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 2
