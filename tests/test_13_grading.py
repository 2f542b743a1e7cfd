"""Chapter 13 grading: the leaderboard answers learners write are rejected for the lesson's reason;
correct designs pass.

Each answer is the source a learner would type into the answer cell. The checks hold back and
reorder board writes, and record events during a rebuild, at moments they choose
(autograder/checks/ch13.py), so every verdict here is the same on every run.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_accepted, assert_rejected

HEADER = """
import heapq
from course.leaderboard import BOARD, TIE_SPAN, encode, decode
"""

# ============================================================================ record_score

RECORD_SOLUTION = (
    HEADER
    + """
async def record_score(pool, r, event):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
            (event["event_id"], event["player"], event["points"], event["at"]))
        if await cur.fetchone() is None:
            return False
        cur = await conn.execute(
            "INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (player) DO UPDATE SET points = s.points + EXCLUDED.points, "
            "reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at) RETURNING points, reached_at",
            (event["player"], event["points"], event["at"]))
        points, reached_at = await cur.fetchone()
    await r.zadd(BOARD, {event["player"]: encode(points, reached_at)}, gt=True)
    return True
"""
)

RECORD_UNDER_ROW_LOCK = (
    HEADER
    + """
async def record_score(pool, r, event):
    # plain ZADD, but sent while this transaction still holds the player's row lock:
    # the next event of the same player waits, so board writes keep PostgreSQL's order
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT DO NOTHING RETURNING 1",
            (event["event_id"], event["player"], event["points"], event["at"]))
        if not await cur.fetchone():
            return False
        cur = await conn.execute(
            "INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (player) DO UPDATE SET points = s.points + EXCLUDED.points, "
            "reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at) RETURNING points, reached_at",
            (event["player"], event["points"], event["at"]))
        total, at = await cur.fetchone()
        await r.zadd(BOARD, {event["player"]: encode(total, at)})
    return True
"""
)

RECORD_LUA_MAX = (
    HEADER
    + """
KEEP_MAX = '''
local current = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not current or tonumber(current) < tonumber(ARGV[1]) then
    redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
end
return 1
'''

async def record_score(pool, r, event):
    async with pool.connection() as conn:
        async with conn.transaction():
            cur = await conn.execute(
                "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
                (event["event_id"], event["player"], event["points"], event["at"]))
            if (await cur.fetchone()) is None:
                return False
            await conn.execute(
                "INSERT INTO leaderboard_scores (player, points, reached_at) VALUES (%s, %s, %s) "
                "ON CONFLICT (player) DO UPDATE SET points = leaderboard_scores.points + EXCLUDED.points, "
                "reached_at = GREATEST(leaderboard_scores.reached_at, EXCLUDED.reached_at)",
                (event["player"], event["points"], event["at"]))
        cur = await conn.execute("SELECT points, reached_at FROM leaderboard_scores WHERE player = %s",
                                 (event["player"],))
        points, reached_at = await cur.fetchone()
    await r.eval(KEEP_MAX, 1, BOARD, encode(points, reached_at), event["player"])
    return True
"""
)

RECORD_REFERENCE = """
from course.leaderboard import record

async def record_score(pool, r, event):
    return await record(pool, r, event)
"""


RECORD_DEDUP_TABLE_NOT_CONSULTED = (
    HEADER
    + """
async def record_score(pool, r, event):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (event_id) DO NOTHING",
            (event["event_id"], event["player"], event["points"], event["at"]))
        cur = await conn.execute(
            "INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (player) DO UPDATE SET points = s.points + EXCLUDED.points, "
            "reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at) RETURNING points, reached_at",
            (event["player"], event["points"], event["at"]))
        points, reached_at = await cur.fetchone()
    await r.zadd(BOARD, {event["player"]: encode(points, reached_at)}, gt=True)
    return True
"""
)

RECORD_ZINCRBY_RAW = (
    HEADER
    + """
async def record_score(pool, r, event):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
            (event["event_id"], event["player"], event["points"], event["at"]))
        fresh = await cur.fetchone() is not None
        if fresh:
            await conn.execute(
                "INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s) "
                "ON CONFLICT (player) DO UPDATE SET points = s.points + EXCLUDED.points, "
                "reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at)",
                (event["player"], event["points"], event["at"]))
    await r.zincrby(BOARD, event["points"], event["player"])
    return fresh
"""
)

RECORD_CHECK_THEN_INSERT = (
    HEADER
    + """
async def record_score(pool, r, event):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT 1 FROM leaderboard_events WHERE event_id = %s", (event["event_id"],))
        if await cur.fetchone() is not None:
            return False
        await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT DO NOTHING",
            (event["event_id"], event["player"], event["points"], event["at"]))
        cur = await conn.execute(
            "INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (player) DO UPDATE SET points = s.points + EXCLUDED.points, "
            "reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at) RETURNING points, reached_at",
            (event["player"], event["points"], event["at"]))
        points, reached_at = await cur.fetchone()
    await r.zadd(BOARD, {event["player"]: encode(points, reached_at)}, gt=True)
    return True
"""
)

# the same under a lock per event id: exact in one process, not between two replicas
RECORD_CHECK_THEN_INSERT_LOCKED = RECORD_CHECK_THEN_INSERT.replace(
    "async def record_score(pool, r, event):\n",
    "import asyncio\nfrom collections import defaultdict\n_locks = defaultdict(asyncio.Lock)\n\n"
    "async def record_score(pool, r, event):\n    async with _locks[event['event_id']]:\n        return await _record(pool, r, event)\n\n"
    "async def _record(pool, r, event):\n",
)

RECORD_IN_PROCESS_SEEN = (
    HEADER
    + """
seen = set()

async def record_score(pool, r, event):
    if event["event_id"] in seen:
        return False
    seen.add(event["event_id"])
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (event_id) DO NOTHING",
            (event["event_id"], event["player"], event["points"], event["at"]))
        cur = await conn.execute(
            "INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (player) DO UPDATE SET points = s.points + EXCLUDED.points, "
            "reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at) RETURNING points, reached_at",
            (event["player"], event["points"], event["at"]))
        points, reached_at = await cur.fetchone()
    await r.zadd(BOARD, {event["player"]: encode(points, reached_at)}, gt=True)
    return True
"""
)

RECORD_DEDUP_IN_REDIS = (
    HEADER
    + """
async def record_score(pool, r, event):
    if not await r.set(f"applied:{event['event_id']}", 1, nx=True):
        return False
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (event_id) DO NOTHING",
            (event["event_id"], event["player"], event["points"], event["at"]))
        cur = await conn.execute(
            "INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (player) DO UPDATE SET points = s.points + EXCLUDED.points, "
            "reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at) RETURNING points, reached_at",
            (event["player"], event["points"], event["at"]))
        points, reached_at = await cur.fetchone()
    await r.zadd(BOARD, {event["player"]: encode(points, reached_at)}, gt=True)
    return True
"""
)

RECORD_RAW_POINTS = RECORD_SOLUTION.replace(
    '{event["player"]: encode(points, reached_at)}', '{event["player"]: points}'
)

RECORD_LAST_DELIVERED_AT = RECORD_SOLUTION.replace(
    "reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at)", "reached_at = EXCLUDED.reached_at"
)

RECORD_STALE_OVERWRITE = RECORD_SOLUTION.replace(", gt=True)", ")")

RECORD_ZINCRBY_DELTA = (
    HEADER
    + """
async def record_score(pool, r, event):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
            (event["event_id"], event["player"], event["points"], event["at"]))
        if await cur.fetchone() is None:
            return False
        cur = await conn.execute("SELECT points, reached_at FROM leaderboard_scores WHERE player = %s FOR UPDATE",
                                 (event["player"],))
        old = await cur.fetchone()   # two first events of a player both find no row here
        cur = await conn.execute(
            "INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (player) DO UPDATE SET points = s.points + EXCLUDED.points, "
            "reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at) RETURNING points, reached_at",
            (event["player"], event["points"], event["at"]))
        new = await cur.fetchone()
    delta = encode(*new) - (encode(*old) if old else 0)
    await r.zincrby(BOARD, delta, event["player"])  # increments commute: order cannot matter
    return True
"""
)

RECORD_ZINCRBY_DELTA_LOCKED = (
    HEADER
    + """
async def record_score(pool, r, event):
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
            (event["event_id"], event["player"], event["points"], event["at"]))
        if await cur.fetchone() is None:
            return False
        await conn.execute("INSERT INTO leaderboard_scores (player, points, reached_at) VALUES (%s, 0, 0) "
                           "ON CONFLICT DO NOTHING", (event["player"],))
        cur = await conn.execute("SELECT points, reached_at FROM leaderboard_scores WHERE player = %s FOR UPDATE",
                                 (event["player"],))
        old = await cur.fetchone()
        cur = await conn.execute(
            "UPDATE leaderboard_scores SET points = points + %s, reached_at = GREATEST(reached_at, %s) "
            "WHERE player = %s RETURNING points, reached_at",
            (event["points"], event["at"], event["player"]))
        new = await cur.fetchone()
    before = encode(*old) if old[0] else 0   # a new player is not on the board yet
    await r.zincrby(BOARD, encode(*new) - before, event["player"])
    return True
"""
)


# ============================================================================ top_and_rank

TOP_SOLUTION = (
    HEADER
    + """
async def top_and_rank(r, n, player):
    pipe = r.pipeline(transaction=True)
    pipe.zrevrange(BOARD, 0, n - 1, withscores=True)
    pipe.zrevrank(BOARD, player)
    entries, rank = await pipe.execute()
    return [(p, decode(s)[0]) for p, s in entries], (None if rank is None else rank + 1)
"""
)

TOP_TWO_ROUND_TRIPS = (
    HEADER
    + """
async def top_and_rank(r, n, player):
    entries = await r.zrange(BOARD, 0, n - 1, desc=True, withscores=True)
    rank = await r.zrevrank(BOARD, player)
    top = [(p, int(s) // TIE_SPAN) for p, s in entries]
    return top, rank + 1 if rank is not None else None
"""
)


TOP_ZERO_BASED = TOP_SOLUTION.replace("(None if rank is None else rank + 1)", "rank")
TOP_ASCENDING = (
    HEADER
    + """
async def top_and_rank(r, n, player):
    entries = await r.zrange(BOARD, 0, n - 1, withscores=True)
    rank = await r.zrank(BOARD, player)
    return [(p, decode(s)[0]) for p, s in entries], (None if rank is None else rank + 1)
"""
)
TOP_ENCODED_POINTS = TOP_SOLUTION.replace("(p, decode(s)[0])", "(p, int(s))")
TOP_TIES_BY_NAME = (
    HEADER
    + """
async def top_and_rank(r, n, player):
    everyone = [(p, decode(s)[0]) for p, s in await r.zrevrange(BOARD, 0, -1, withscores=True)]
    everyone.sort(key=lambda e: (-e[1], e[0]))      # most points first, then alphabetical
    names = [p for p, _ in everyone]
    return everyone[:n], (names.index(player) + 1 if player in names else None)
"""
)
TOP_WHOLE_BOARD = (
    HEADER
    + """
async def top_and_rank(r, n, player):
    everyone = await r.zrevrange(BOARD, 0, -1, withscores=True)
    names = [p for p, _ in everyone]
    return [(p, decode(s)[0]) for p, s in everyone[:n]], (names.index(player) + 1 if player in names else None)
"""
)
TOP_SHARED_RANKS = (
    HEADER
    + """
async def top_and_rank(r, n, player):
    top = [(p, decode(s)[0]) for p, s in await r.zrevrange(BOARD, 0, n - 1, withscores=True)]
    score = await r.zscore(BOARD, player)
    if score is None:
        return top, None
    points = decode(score)[0]
    return top, 1 + await r.zcount(BOARD, (points + 1) * TIE_SPAN, "+inf")   # players with more points, plus one
"""
)


# ============================================================================ rebuild_board

REBUILD_SOLUTION = (
    HEADER
    + """
async def rebuild_board(pool, r):
    written, last = 0, ""
    while True:
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT player, points, reached_at FROM leaderboard_scores WHERE player > %s ORDER BY player LIMIT 1000",
                (last,))
            rows = await cur.fetchall()
        if not rows:
            return written
        await r.zadd(BOARD, {p: encode(pts, at) for p, pts, at in rows}, gt=True)
        written += len(rows)
        last = rows[-1][0]
"""
)

REBUILD_SERVER_CURSOR = (
    HEADER
    + """
async def rebuild_board(pool, r):
    written = 0
    async with pool.connection() as conn, conn.transaction():
        async with conn.cursor(name="rebuild") as cur:
            await cur.execute("SELECT player, points, reached_at FROM leaderboard_scores")
            while rows := await cur.fetchmany(2000):
                pipe = r.pipeline(transaction=False)
                for p, pts, at in rows:
                    pipe.zadd(BOARD, {p: encode(pts, at)}, gt=True)
                await pipe.execute()
                written += len(rows)
    return written
"""
)

REBUILD_ASIDE_THEN_MERGE = (
    HEADER
    + """
async def rebuild_board(pool, r):
    scratch = BOARD + ":rebuilding"
    await r.delete(scratch)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT player, points, reached_at FROM leaderboard_scores")
        rows = await cur.fetchall()
    for k in range(0, len(rows), 500):
        await r.zadd(scratch, {p: encode(pts, at) for p, pts, at in rows[k:k + 500]})
    # keep whatever arrived meanwhile: the larger score of each player wins
    await r.zunionstore(BOARD, {BOARD: 1, scratch: 1}, aggregate="MAX")
    await r.delete(scratch)
    return len(rows)
"""
)

REBUILD_REFERENCE = """
from course.leaderboard import rebuild

async def rebuild_board(pool, r):
    return await rebuild(pool, r)
"""


REBUILD_ASIDE_THEN_RENAME = (
    HEADER
    + """
async def rebuild_board(pool, r):
    scratch = BOARD + ":rebuilding"
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT player, points, reached_at FROM leaderboard_scores")
        rows = await cur.fetchall()
    await r.delete(scratch)
    for k in range(0, len(rows), 1000):
        await r.zadd(scratch, {p: encode(pts, at) for p, pts, at in rows[k:k + 1000]})
    await r.rename(scratch, BOARD)      # atomic swap: readers never see a half-built board
    return len(rows)
"""
)

REBUILD_DELETE_THEN_LOAD = (
    HEADER
    + """
async def rebuild_board(pool, r):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT player, points, reached_at FROM leaderboard_scores")
        rows = await cur.fetchall()
    await r.delete(BOARD)
    for k in range(0, len(rows), 1000):
        await r.zadd(BOARD, {p: encode(pts, at) for p, pts, at in rows[k:k + 1000]})
    return len(rows)
"""
)

# Issue 28: DEL first, then read PostgreSQL and reload: the final board is right, but readers see it
# empty while the rebuild runs (the text forbids DEL and reload).
REBUILD_DELETE_FIRST_THEN_READ = (
    HEADER
    + """
async def rebuild_board(pool, r):
    await r.delete(BOARD)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT player, points, reached_at FROM leaderboard_scores")
        rows = await cur.fetchall()
    for k in range(0, len(rows), 1000):
        await r.zadd(BOARD, {p: encode(pts, at) for p, pts, at in rows[k:k + 1000]}, gt=True)
    return len(rows)
"""
)

REBUILD_PLAIN_ZADD = REBUILD_SOLUTION.replace(", gt=True)", ")")

REBUILD_ONE_BY_ONE = (
    HEADER
    + """
async def rebuild_board(pool, r):
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT player, points, reached_at FROM leaderboard_scores")
        rows = await cur.fetchall()
    for p, pts, at in rows:
        await r.zadd(BOARD, {p: encode(pts, at)}, gt=True)
    return len(rows)
"""
)

REBUILD_FLUSHDB_FIRST = REBUILD_SOLUTION.replace(
    '    written, last = 0, ""\n', '    await r.flushdb()\n    written, last = 0, ""\n'
)

REBUILD_LOCKS_WRITERS_OUT = (
    HEADER
    + """
async def rebuild_board(pool, r):
    async with pool.connection() as conn, conn.transaction():
        await conn.execute("LOCK TABLE leaderboard_scores IN SHARE MODE")   # a consistent picture
        cur = await conn.execute("SELECT player, points, reached_at FROM leaderboard_scores")
        rows = await cur.fetchall()
        for k in range(0, len(rows), 1000):
            await r.zadd(BOARD, {p: encode(pts, at) for p, pts, at in rows[k:k + 1000]}, gt=True)
    return len(rows)
"""
)


# ============================================================================ merge_top

MERGE_SOLUTION = (
    HEADER
    + """
def merge_top(local_tops, n):
    merged = heapq.merge(*local_tops, key=lambda e: (e[1], e[0]), reverse=True)
    return [entry for entry, _ in zip(merged, range(n))]
"""
)
MERGE_SORTED = """
def merge_top(local_tops, n):
    everyone = [entry for top in local_tops for entry in top]
    everyone.sort(key=lambda e: (e[1], e[0]), reverse=True)
    return everyone[:n]
"""
# "a plain function, no I/O": written async, as if it fetched the tops itself
MERGE_ASYNC = MERGE_SORTED.replace("def merge_top", "async def merge_top")
MERGE_NLARGEST = """
import heapq, itertools

def merge_top(local_tops, n):
    return heapq.nlargest(n, itertools.chain(*local_tops), key=lambda e: (e[1], e[0]))
"""


MERGE_FIRST_OF_EACH = """
def merge_top(local_tops, n):
    firsts = [top[0] for top in local_tops if top]
    return sorted(firsts, key=lambda e: e[1], reverse=True)[:n]
"""
MERGE_BY_POINTS = (
    HEADER
    + """
def merge_top(local_tops, n):
    everyone = [entry for top in local_tops for entry in top]
    return sorted(everyone, key=lambda e: decode(e[1])[0], reverse=True)[:n]
"""
)
MERGE_TIES_BY_NAME = """
def merge_top(local_tops, n):
    everyone = [entry for top in local_tops for entry in top]
    return sorted(everyone, key=lambda e: (-e[1], e[0]))[:n]
"""
MERGE_ROUND_ROBIN = """
import itertools

def merge_top(local_tops, n):
    out = []
    for row in itertools.zip_longest(*local_tops):
        out.extend(e for e in row if e is not None)
    return out[:n]
"""


# Issue 28: empties the shards' lists while merging ("do not change the lists you are given").
MERGE_EMPTIES_THE_LISTS = """
def merge_top(local_tops, n):
    everyone = []
    for top in local_tops:
        while top:
            everyone.append(top.pop(0))
    everyone.sort(key=lambda e: (e[1], e[0]), reverse=True)
    return everyone[:n]
"""

# Issue 28: a duplicate delivery is reported as applied.
RECORD_ALWAYS_TRUE = RECORD_SOLUTION.replace("            return False", "            return True")


# Issue 28 audit: a player who is not on the board gets rank 0, not None.
TOP_MISSING_IS_ZERO = TOP_SOLUTION.replace("(None if rank is None else rank + 1)", "(0 if rank is None else rank + 1)")
# Issue 28 audit: the rebuild returns nothing.
REBUILD_RETURNS_NOTHING = REBUILD_SOLUTION.replace("            return written", "            return None")


# found by an outside audit ---------------------------------------------------------------------------
# NX adds a player once and never moves them: passes while every later write is an older total
RECORD_ZADD_NX = RECORD_SOLUTION.replace("gt=True", "nx=True")

# a callable object instead of a function (the replicas run the cell that defined its class)
RECORD_CALLABLE_OBJECT = (
    HEADER
    + """
class Recorder:
    EVENT = ("INSERT INTO leaderboard_events (event_id, player, points, at) "
             "VALUES (%(event_id)s, %(player)s, %(points)s, %(at)s) ON CONFLICT (event_id) DO NOTHING")
    TOTAL = ("INSERT INTO leaderboard_scores AS t (player, points, reached_at) VALUES (%(player)s, %(points)s, %(at)s) "
             "ON CONFLICT (player) DO UPDATE SET points = t.points + excluded.points, "
             "reached_at = greatest(t.reached_at, excluded.reached_at) RETURNING t.points, t.reached_at")

    async def __call__(self, pool, r, event) -> bool:
        async with pool.connection() as conn:
            async with conn.transaction():
                cur = await conn.execute(self.EVENT, event)
                if cur.rowcount != 1:
                    return False
                total, reached = await (await conn.execute(self.TOTAL, event)).fetchone()
        await r.zadd(BOARD, {event["player"]: encode(total, reached)}, gt=True)
        return True

record_score = Recorder()
"""
)

# NX leaves a player who is on the board behind PostgreSQL where they are
REBUILD_ZADD_NX = REBUILD_SOLUTION.replace("gt=True", "nx=True")

# the aside-then-merge design without its last step: the scratch key stays in Redis
REBUILD_SCRATCH_LEFT_BEHIND = REBUILD_ASIDE_THEN_MERGE.replace("    await r.delete(scratch)\n    return", "    return")

CORRECT: dict[str, dict[str, str]] = {
    "record_score": {
        "zadd-gt-after-commit": RECORD_SOLUTION,
        "zadd-under-row-lock": RECORD_UNDER_ROW_LOCK,
        "lua-keep-max": RECORD_LUA_MAX,
        "callable-object": RECORD_CALLABLE_OBJECT,
    },
    "top_and_rank": {
        "multi-pipeline": TOP_SOLUTION,
        "two-round-trips": TOP_TWO_ROUND_TRIPS,
    },
    "rebuild_board": {
        "keyset-pages-zadd-gt": REBUILD_SOLUTION,
        "server-cursor-pipelined": REBUILD_SERVER_CURSOR,
        "aside-then-zunionstore-max": REBUILD_ASIDE_THEN_MERGE,
    },
    "merge_top": {
        "heap-merge": MERGE_SOLUTION,
        "sort-all": MERGE_SORTED,
        "nlargest": MERGE_NLARGEST,
    },
}


# Answers that only call the course's own answer (REFERENCES in the chapter's check module). Once the
# grader's reference guard (issue 28, autograder/rules.py) is in, they earn nothing; until then they pass.
CALLS_THE_REFERENCE: dict[str, dict[str, str]] = {
    "record_score": {"reference": RECORD_REFERENCE},
    "rebuild_board": {"reference": REBUILD_REFERENCE},
}


WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "record_score": {
        "always-true": (RECORD_ALWAYS_TRUE, "only the return value is wrong"),
        "dedup-row-written-not-consulted": (RECORD_DEDUP_TABLE_NOT_CONSULTED, "applied once"),
        "zincrby-raw-points-every-delivery": (RECORD_ZINCRBY_RAW, "raw points"),
        "in-process-seen-set": (RECORD_IN_PROCESS_SEEN, "state kept in one process is not shared"),
        "check-then-insert": (RECORD_CHECK_THEN_INSERT, "check, then insert"),
        "check-then-insert-under-a-lock": (RECORD_CHECK_THEN_INSERT_LOCKED, "does not reach another"),
        "dedup-in-redis": (RECORD_DEDUP_IN_REDIS, "dedup record must live where the points live"),
        "raw-points-ties-by-name": (RECORD_RAW_POINTS, "raw points"),
        "reached-at-of-last-delivery": (RECORD_LAST_DELIVERED_AT, "latest of its events"),
        "stale-write-overwrites": (RECORD_STALE_OVERWRITE, "ZADD ... GT"),
        "zincrby-deltas-first-event-race": (RECORD_ZINCRBY_DELTA, "ZINCRBY"),
        "zincrby-deltas-do-not-heal": (RECORD_ZINCRBY_DELTA_LOCKED, "heals itself"),
        "zadd-nx": (RECORD_ZADD_NX, "GT is the flag"),
    },
    "top_and_rank": {
        "missing-is-zero": (TOP_MISSING_IS_ZERO, "expected None"),
        "zero-based-rank": (TOP_ZERO_BASED, "1-based"),
        "ascending": (TOP_ASCENDING, "ZREVRANGE, not ZRANGE"),
        "encoded-points": (TOP_ENCODED_POINTS, "decode(score)[0]"),
        "ties-by-name": (TOP_TIES_BY_NAME, "who reached them first"),
        "whole-board": (TOP_WHOLE_BOARD, "read only the top"),
        "shared-ranks": (TOP_SHARED_RANKS, "equal points one rank"),
    },
    "rebuild_board": {
        "returns-nothing": (REBUILD_RETURNS_NOTHING, "expected the number of players it wrote"),
        "aside-then-rename": (REBUILD_ASIDE_THEN_RENAME, "gone from the board"),
        "delete-then-load": (REBUILD_DELETE_THEN_LOAD, "players gone"),
        "delete-first-then-read": (REBUILD_DELETE_FIRST_THEN_READ, "a DEL (or UNLINK"),
        "plain-zadd": (REBUILD_PLAIN_ZADD, "older (smaller) score never wins"),
        "one-zadd-per-player": (REBUILD_ONE_BY_ONE, "many players per ZADD"),
        "flushdb": (REBUILD_FLUSHDB_FIRST, "(FLUSHDB)"),
        "locks-writers": (REBUILD_LOCKS_WRITERS_OUT, "must not stop the game"),
        "zadd-nx": (REBUILD_ZADD_NX, "stayed behind"),
        "scratch-key-left-behind": (REBUILD_SCRATCH_LEFT_BEHIND, "must be deleted"),
    },
    "merge_top": {
        "first-of-each-shard": (MERGE_FIRST_OF_EACH, "first entry"),
        "async-merge": (MERGE_ASYNC, "plain `def`"),
        "points-only": (MERGE_BY_POINTS, "points alone"),
        "ties-by-name-ascending": (MERGE_TIES_BY_NAME, "member order, descending"),
        "empties-the-lists": (MERGE_EMPTIES_THE_LISTS, "changed the lists it was given"),
        "round-robin": (MERGE_ROUND_ROBIN, "wrong order"),
    },
}


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in CORRECT.items() for n in d])
def test_13_correct_answers_pass(task, name):
    assert_accepted(task, CORRECT[task][name])


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in WRONG.items() for n in d])
def test_13_wrong_answers_are_rejected_for_the_reason(task, name):
    source, mentions = WRONG[task][name]
    assert_rejected(task, source, mentions=mentions)
