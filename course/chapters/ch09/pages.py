"""Chapter 09's pagination demos: the posts table, OFFSET pages and their cost, keyset pages.

``ch09_posts (id bigint PRIMARY KEY, created_at timestamptz, title text)`` belongs to
this chapter; rows come newest first, ``ORDER BY created_at DESC, id DESC``, and several
rows share each ``created_at`` (ties, as rows written in one batch have).
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

from course.pagination import CursorCodec, Keyset, fetch_page

SCHEMA = """
CREATE TABLE IF NOT EXISTS ch09_posts (
    id bigint PRIMARY KEY,
    created_at timestamptz NOT NULL,
    title text NOT NULL
);
CREATE INDEX IF NOT EXISTS ch09_posts_newest ON ch09_posts (created_at DESC, id DESC);
"""

#: The moment the demo data starts from: fixed, so every run prints the same rows.
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)

POSTS = Keyset("ch09_posts", ("id", "created_at", "title"), (("created_at", True), ("id", True)))
NEWEST_FIRST = "ORDER BY created_at DESC, id DESC"


async def setup_posts(pool) -> None:
    async with pool.connection() as conn:
        await conn.execute(SCHEMA)


async def fill_posts(pool, n: int, *, per_second: int = 3, id_step: int = 10) -> None:
    """``n`` posts, ``per_second`` sharing each created_at, ids ``id_step`` apart (room for more)."""
    async with pool.connection() as conn:
        await conn.execute("TRUNCATE ch09_posts")
        await conn.execute(
            "INSERT INTO ch09_posts SELECT g * %s, %s + ((g - 1) / %s) * interval '1 second', 'post ' || g "
            "FROM generate_series(1, %s) g",
            (id_step, EPOCH, per_second, n),
        )
        await conn.execute("ANALYZE ch09_posts")


async def offset_page(pool, page: int, limit: int) -> list[tuple]:
    """Page ``page`` (from 0) the way most code starts: ``OFFSET page * limit``."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            f"SELECT id, created_at, title FROM ch09_posts {NEWEST_FIRST} LIMIT %s OFFSET %s",
            (limit, page * limit),
        )
        return await cur.fetchall()


async def posts_page(pool, cursor: str | None, limit: int, secret: bytes) -> tuple[list[tuple], str | None]:
    """The course's keyset page over ``ch09_posts`` (the graded task's reference answer)."""
    page = await fetch_page(pool, POSTS, CursorCodec(secret), after=cursor, limit=limit)
    return page.rows, page.next


async def insert_post(pool, id_: int, created_at: datetime, title: str) -> None:
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO ch09_posts VALUES (%s, %s, %s)", (id_, created_at, title))


async def delete_posts(pool, ids) -> None:
    async with pool.connection() as conn:
        await conn.execute("DELETE FROM ch09_posts WHERE id = ANY(%s)", (list(ids),))


async def newest(pool) -> datetime:
    async with pool.connection() as conn:
        return (await (await conn.execute("SELECT max(created_at) FROM ch09_posts")).fetchone())[0]


async def walk_offset_with_writes(pool, limit: int, writes) -> list[list[int]]:
    """Read every page by OFFSET, running ``writes[i](pool)`` (if any) after page ``i``."""
    pages, i = [], 0
    while True:
        rows = await offset_page(pool, i, limit)
        if not rows:
            return pages
        pages.append([r[0] for r in rows])
        if i < len(writes) and writes[i] is not None:
            await writes[i](pool)
        i += 1


async def walk_keyset_with_writes(pool, limit: int, writes, secret: bytes = b"demo") -> list[list[int]]:
    pages, cursor, i = [], None, 0
    while True:
        rows, cursor = await posts_page(pool, cursor, limit, secret)
        pages.append([r[0] for r in rows])
        if cursor is None:
            return pages
        if i < len(writes) and writes[i] is not None:
            await writes[i](pool)
        i += 1


def repeats_and_skips(pages: list[list[int]], expected: set[int]) -> tuple[list[int], list[int]]:
    seen: list[int] = [x for p in pages for x in p]
    repeated = sorted({x for x in seen if seen.count(x) > 1})
    skipped = sorted(expected - set(seen))
    return repeated, skipped


async def explain(pool, query: str, params=()) -> dict:
    """Execution time and buffers of one query, from ``EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)``."""
    async with pool.connection() as conn:
        cur = await conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params)
        plan = (await cur.fetchone())[0]
    plan = plan[0] if isinstance(plan, list) else json.loads(plan)[0]
    top = plan["Plan"]
    return {
        "ms": plan["Execution Time"],
        "buffers": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
        "rows_read": _rows_read(top),
        "filtered": _removed(top),
    }


def _removed(node: dict) -> int:
    """Rows the plan read and threw away in a filter (what an unbounded seek condition wades through)."""
    own = int(node.get("Rows Removed by Filter", 0) * node.get("Actual Loops", 1))
    return own + sum(_removed(c) for c in node.get("Plans", []))


def _rows_read(node: dict) -> int:
    """Rows the scans at the bottom of the plan produced (what OFFSET reads and throws away)."""
    children = node.get("Plans", [])
    if not children:
        return int(node.get("Actual Rows", 0) * node.get("Actual Loops", 1))
    return sum(_rows_read(c) for c in children)


async def page_costs(pool, pages: list[int], limit: int = 20, repeat: int = 3) -> dict[str, list[dict]]:
    """For each page number: the OFFSET query and the keyset query that return the same rows.

    Each is run ``repeat`` times and the fastest kept (the first run may read from disk).
    """
    out: dict[str, list[dict]] = {"offset": [], "keyset": []}
    for page in pages:
        async with pool.connection() as conn:
            cur = await conn.execute(
                f"SELECT created_at, id FROM ch09_posts {NEWEST_FIRST} LIMIT 1 OFFSET %s",
                (max(page * limit - 1, 0),),
            )
            ts, id_ = await cur.fetchone()
        by_offset = (
            f"SELECT id, created_at, title FROM ch09_posts {NEWEST_FIRST} LIMIT {limit} OFFSET {page * limit}"
        )
        by_key = (
            "SELECT id, created_at, title FROM ch09_posts WHERE (created_at, id) < (%s, %s) "
            f"{NEWEST_FIRST} LIMIT {limit}"
        )
        runs_o = [await explain(pool, by_offset) for _ in range(repeat)]
        runs_k = [
            await explain(pool, by_key, (ts, id_) if page else (EPOCH + timedelta(days=3650), 0))
            for _ in range(repeat)
        ]
        out["offset"].append(min(runs_o, key=lambda r: r["ms"]))
        out["keyset"].append(min(runs_k, key=lambda r: r["ms"]))
    return out


# ----------------------------------------------------------------------------- mixed sort directions

#: A leaderboard sorted by score, highest first, and id, lowest first: the mixed directions a row
#: comparison cannot express. Scores repeat (ties), ids are unique.
SCORES = """
CREATE TABLE IF NOT EXISTS ch09_scores (
    id bigint PRIMARY KEY,
    score integer NOT NULL,
    name text NOT NULL
);
CREATE INDEX IF NOT EXISTS ch09_scores_board ON ch09_scores (score DESC, id ASC);
"""
SCORE_ORDER = (("score", True), ("id", False))


async def mixed_seek_costs(pool, rows: int, at: int, limit: int = 20) -> dict:
    """The page after row ``at`` of ``rows`` (``score DESC, id ASC``), by two seek conditions.

    ``"or only"``: ``score < x OR (score = x AND id > y)``, the textbook expansion;
    ``"bounded"``: the same with ``score <= x AND`` in front (:func:`course.pagination.seek_condition`).
    Each: time, buffers and rows filtered out, from ``EXPLAIN (ANALYZE, BUFFERS)``, fastest of three;
    ``"plan"`` holds the bounded query's plan as text, ``"same"`` whether both returned the same rows.
    """
    async with pool.connection() as conn:
        await conn.execute(SCORES)
        await conn.execute("TRUNCATE ch09_scores")
        await conn.execute(  # ten rows per score, in scattered id order
            "INSERT INTO ch09_scores SELECT g, (g * 7919) %% %s, 'player ' || g FROM generate_series(1, %s) g",
            (max(rows // 10, 1), rows),
        )
        await conn.execute("VACUUM ANALYZE ch09_scores")
        cur = await conn.execute(
            "SELECT score, id FROM ch09_scores ORDER BY score DESC, id ASC LIMIT 1 OFFSET %s", (at - 1,)
        )
        score, id_ = await cur.fetchone()
    head = "SELECT id, score, name FROM ch09_scores WHERE "
    tail = f" ORDER BY score DESC, id ASC LIMIT {limit}"
    queries = {
        "or only": (head + "(score < %s OR (score = %s AND id > %s))" + tail, (score, score, id_)),
        "bounded": (
            head + "score <= %s AND (score < %s OR (score = %s AND id > %s))" + tail,
            (score, score, score, id_),
        ),
    }
    out: dict = {"rows": rows, "at": at, "cursor": (score, id_)}
    got = {}
    async with pool.connection() as conn:
        for name, (query, params) in queries.items():
            out[name] = min([await explain(pool, query, params) for _ in range(3)], key=lambda r: r["ms"])
            got[name] = await (await conn.execute(query, params)).fetchall()
        cur = await conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF, SUMMARY OFF) " + queries["bounded"][0],
            queries["bounded"][1],
        )
        out["plan"] = [row[0] for row in await cur.fetchall()]
    out["same"] = got["or only"] == got["bounded"]
    return out


def plot_page_costs(pages: list[int], costs: dict[str, list[dict]], n_rows: int):
    from course.kit.plotting import COLORS, figure, legend_outside

    fig, axes = figure(12, 3.6, ncols=2)
    for name, color in (("offset", COLORS["bad"]), ("keyset", COLORS["ok"])):
        label = "OFFSET page * 20" if name == "offset" else "keyset (created_at, id) < cursor"
        axes[0].plot(pages, [c["ms"] for c in costs[name]], "o-", color=color, label=label)
        axes[1].plot(pages, [c["buffers"] for c in costs[name]], "o-", color=color, label=label)
    axes[0].set_ylabel("execution time (ms)")
    axes[1].set_ylabel("8 kB buffers touched")
    for ax in axes:
        ax.set_xlabel(f"page number (20 rows a page, {n_rows:,} rows)")
        ax.set_yscale("symlog", linthresh=1)
    legend_outside(axes[1])
    return fig


def timed(fn):
    """``(result, seconds)`` of a synchronous call."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
