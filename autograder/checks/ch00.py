"""Hidden checks of chapter 00 (setup and tour): the warm-up task that touches both servers."""

from __future__ import annotations

import asyncio
from collections import Counter

from autograder.harness import Report, task
from course.chapters.ch00 import setup_visits
from course.kit import lab


@task("count_visit", points=2, title="count a visit in Redis and PostgreSQL", timeout=30)
async def check_count_visit(r: Report, count_visit) -> None:
    async with lab.scratch("ch00") as ns:
        pool = await ns.pool(max_size=10)
        redis = ns.redis()
        await setup_visits(pool)

        first = await count_visit(redis, pool, "home")
        r.expect(first == 1, f"first visit of 'home' returned {first!r}, expected 1")
        if r.public:
            return

        pages = ["home"] * 19 + ["about"] * 5
        got = await asyncio.gather(*(count_visit(redis, pool, p) for p in pages))
        home = sorted(v for p, v in zip(pages, got, strict=True) if p == "home")
        r.note("then 24 visits at once: 19 more of 'home', 5 of 'about'")
        repeated = [v for v, n in Counter(home).items() if n > 1]
        r.expect(
            home == list(range(2, 21)),
            "the 19 concurrent 'home' visits returned 2..20, each once"
            if home == list(range(2, 21))
            else f"the 19 concurrent 'home' visits returned {home}; repeated counts {repeated} mean lost updates "
            "(read, add one, write back is not atomic: use INCR)",
        )
        keys = sorted(await redis.keys("*"))
        values = {k: await redis.get(k) for k in keys}
        expected = {"visits:about": "5", "visits:home": "20"}
        r.expect(values == expected, f"Redis holds {values}", f"Redis holds {values}, expected {expected}")
        async with pool.connection() as conn:
            rows = await (
                await conn.execute("SELECT page, count(*) FROM visits GROUP BY page ORDER BY page")
            ).fetchall()
        r.expect(
            dict(rows) == {"about": 5, "home": 20},
            f"PostgreSQL has {dict(rows)} visits rows per page",
            f"PostgreSQL has {dict(rows)} visits rows per page, expected {{'about': 5, 'home': 20}}",
        )


#: The course's own reference implementation of each task (issue 26): while a task is graded,
#: a learner's answer that is, wraps or calls one of these earns nothing for it. The checks
#: themselves may still use them as rigs.
REFERENCES: dict[str, list[str]] = {
    "count_visit": [],
}
