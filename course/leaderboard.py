"""A live leaderboard: Redis sorted sets in front, PostgreSQL as the source of truth (chapter 13).

The design the chapter builds and measures:

- **One sorted set per board** (``ZADD``, ``ZREVRANGE``, ``ZREVRANK``: O(log N) each).
  Its score is not the raw points but :func:`encode` ``(points, reached_at)``, so players
  with equal points are ordered by who got there first, not by their names.
- **Score events are applied once** (:func:`record`): an event id is inserted into
  ``leaderboard_events`` with ``ON CONFLICT DO NOTHING`` in the same transaction that adds
  the points to ``leaderboard_scores``; only then is the total written to the board, with
  ``ZADD ... GT`` so that a late, stale write can never move a player down. A redelivered
  event changes nothing (it re-asserts the stored total, which repairs a board that lost it).
- **PostgreSQL is the truth, Redis a derived view**: :func:`rebuild` re-creates the board
  from ``leaderboard_scores`` page by page (keyset pagination, no long transaction), into
  the live key with ``ZADD GT``, so events that arrive while it runs are never undone.
- **Shards** (one board per region): :func:`merge_top` gives the exact global top N from
  each shard's local top N; :func:`global_rank` counts across shards; for the long tail,
  :func:`approximate_rank` estimates a rank from a score histogram.

Every function takes the pool (``psycopg_pool.AsyncConnectionPool``, autocommit) and the
client (``redis.asyncio.Redis`` with ``decode_responses=True``) it works on.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

#: The board's key (a sorted set) in the namespace's Redis logical database.
BOARD = "leaderboard"
#: Room for the tie-breaker: ``at`` (seconds since the season began) must be below this.
TIE_SPAN = 10**9
#: A sorted-set score is an IEEE 754 double: integers are exact up to 2**53, hence this cap.
MAX_POINTS = 2**53 // TIE_SPAN - 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS leaderboard_events (
    event_id   text PRIMARY KEY,
    player     text   NOT NULL,
    points     bigint NOT NULL CHECK (points > 0),
    at         bigint NOT NULL CHECK (at >= 0 AND at < 1000000000),
    seq        bigint GENERATED ALWAYS AS IDENTITY,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS leaderboard_scores (
    player     text PRIMARY KEY,
    points     bigint NOT NULL,
    reached_at bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- the degraded read path (Redis down): top N straight from PostgreSQL, in the board's order
CREATE INDEX IF NOT EXISTS leaderboard_scores_order
    ON leaderboard_scores (points DESC, reached_at ASC, player DESC);
"""


async def setup_schema(pool) -> None:
    """Create the leaderboard's tables (idempotent)."""
    async with pool.connection() as conn:
        await conn.execute(SCHEMA)


async def reset(pool, r, *keys: str) -> None:
    """Empty the tables and delete the given board keys (a demo's or a check's fresh start)."""
    async with pool.connection() as conn:
        await conn.execute("TRUNCATE leaderboard_events, leaderboard_scores")
    if keys:
        await r.unlink(*keys)


# ----------------------------------------------------------------------------- the tie rule


def encode(points: int, at: int) -> int:
    """The board score for ``points`` reached at ``at``: more points first, then the earlier one.

    ``points * TIE_SPAN + (TIE_SPAN - 1 - at)``: the high digits hold the points, the low
    nine digits the time *reversed*, so reaching a total earlier gives a larger score.
    """
    if not 0 <= at < TIE_SPAN:
        raise ValueError(f"at={at} is outside [0, {TIE_SPAN}): seconds since the season began")
    if not 0 <= points <= MAX_POINTS:
        raise ValueError(f"points={points} is outside [0, {MAX_POINTS}]: a double holds integers up to 2**53")
    return points * TIE_SPAN + (TIE_SPAN - 1 - at)


def decode(score: float | int) -> tuple[int, int]:
    """``(points, at)`` back from a board score (Redis returns it as a float, exact below 2**53)."""
    points, rest = divmod(int(score), TIE_SPAN)
    return points, TIE_SPAN - 1 - rest


# ----------------------------------------------------------------------------- writing

#: Add an event's points to its player's total (the row lock orders concurrent events of one player).
ADD_POINTS = """
INSERT INTO leaderboard_scores AS s (player, points, reached_at) VALUES (%s, %s, %s)
ON CONFLICT (player) DO UPDATE
    SET points = s.points + EXCLUDED.points,
        reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at),
        updated_at = clock_timestamp()
RETURNING points, reached_at
"""


async def record(pool, r, event: dict, *, key: str = BOARD, stream: str | None = None) -> bool:
    """Apply one score event ``{"event_id", "player", "points", "at"}`` exactly once.

    Returns True when the event was applied, False for a duplicate. One transaction in
    PostgreSQL claims the event id and adds the points (the row lock orders concurrent
    events of one player); the board gets the new total afterwards with ``ZADD GT``, so of
    two racing writes the larger (newer) total wins whatever order they arrive in. With
    ``stream``, the change is also appended to that Redis stream (the change feed).
    """
    player, points, at = event["player"], int(event["points"]), int(event["at"])
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
            (event["event_id"], player, points, at),
        )
        applied = await cur.fetchone() is not None
        if applied:
            cur = await conn.execute(ADD_POINTS, (player, points, at))
        else:  # a redelivery: re-assert the stored total (repairs a board that lost it)
            cur = await conn.execute(
                "SELECT points, reached_at FROM leaderboard_scores WHERE player = %s", (player,)
            )
        row = await cur.fetchone()
    if row is not None:
        pipe = r.pipeline(transaction=False)
        pipe.zadd(key, {player: encode(*row)}, gt=True)
        if stream and applied:
            fields = {"event_id": event["event_id"], "player": player, "points": points, "total": row[0]}
            pipe.xadd(stream, fields, maxlen=10_000, approximate=True)
        await pipe.execute()
    return applied


_APPLY_BATCH = """
WITH new AS (
    INSERT INTO leaderboard_events (event_id, player, points, at)
    SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[], %s::bigint[])
    ON CONFLICT (event_id) DO NOTHING
    RETURNING player, points, at
), per_player AS (
    SELECT player, sum(points)::bigint AS points, max(at) AS at FROM new GROUP BY player ORDER BY player
), applied AS (
    INSERT INTO leaderboard_scores AS s (player, points, reached_at)
    SELECT player, points, at FROM per_player
    ON CONFLICT (player) DO UPDATE
        SET points = s.points + EXCLUDED.points,
            reached_at = GREATEST(s.reached_at, EXCLUDED.reached_at),
            updated_at = clock_timestamp()
    RETURNING player, points, reached_at
)
SELECT player, points, reached_at, (SELECT count(*) FROM new) FROM applied
"""


async def record_batch(pool, r, events: Sequence[dict], *, key: str = BOARD) -> int:
    """Apply many events in one transaction and one ``ZADD GT``; returns how many were new.

    The same guarantees as :func:`record` (each event id once; players locked in name order,
    so two concurrent batches cannot deadlock), at a fraction of the round trips.
    """
    if not events:
        return 0
    columns = (
        [e["event_id"] for e in events],
        [e["player"] for e in events],
        [int(e["points"]) for e in events],
        [int(e["at"]) for e in events],
    )
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(_APPLY_BATCH, columns)
        rows = await cur.fetchall()
    if rows:
        await r.zadd(key, {player: encode(points, at) for player, points, at, _ in rows}, gt=True)
    return rows[0][3] if rows else 0


# ----------------------------------------------------------------------------- reading


def _decoded(entries: Iterable[tuple[str, float]]) -> list[tuple[str, int]]:
    return [(player, decode(score)[0]) for player, score in entries]


async def top(r, n: int, *, key: str = BOARD) -> list[tuple[str, int]]:
    """The best ``n`` as ``[(player, points)]``, best first: ``ZREVRANGE key 0 n-1 WITHSCORES``."""
    return _decoded(await r.zrevrange(key, 0, n - 1, withscores=True)) if n > 0 else []


async def rank(r, player: str, *, key: str = BOARD) -> int | None:
    """1-based rank of ``player`` (``ZREVRANK`` + 1), None when the player is not on the board."""
    found = await r.zrevrank(key, player)
    return None if found is None else found + 1


async def top_and_rank(
    r, n: int, player: str, *, key: str = BOARD
) -> tuple[list[tuple[str, int]], int | None]:
    """Top ``n`` and ``player``'s rank in one round trip (``MULTI``): both describe the same moment."""
    pipe = r.pipeline(transaction=True)
    if n > 0:  # ZREVRANGE key 0 -1 would read the whole board
        pipe.zrevrange(key, 0, n - 1, withscores=True)
    pipe.zrevrank(key, player)
    replies = await pipe.execute()
    found = replies[-1]
    return (_decoded(replies[0]) if n > 0 else []), (None if found is None else found + 1)


async def top_from_postgres(pool, n: int) -> list[tuple[str, int]]:
    """The degraded read path: the same top ``n`` from ``leaderboard_scores`` (an index scan)."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT player, points FROM leaderboard_scores ORDER BY points DESC, reached_at ASC, player DESC "
            "LIMIT %s",
            (n,),
        )
        return [(player, points) for player, points in await cur.fetchall()]


# ----------------------------------------------------------------------------- rebuilding


async def rebuild(pool, r, *, key: str = BOARD, page: int = 5000) -> int:
    """Re-create the board from ``leaderboard_scores``; returns the number of players written.

    Safe while events keep arriving through :func:`record`: nothing is deleted, and every
    write is ``ZADD GT``, so a page read before an event can never lower what that event
    wrote (scores only grow). Keyset pages (``WHERE player > last ORDER BY player``) keep
    each query short: no transaction stays open for the whole rebuild.
    """
    written, last = 0, ""
    while True:
        async with pool.connection() as conn:
            cur = await conn.execute(
                "SELECT player, points, reached_at FROM leaderboard_scores WHERE player > %s ORDER BY player "
                "LIMIT %s",
                (last, page),
            )
            rows = await cur.fetchall()
        if not rows:
            return written
        await r.zadd(key, {player: encode(points, at) for player, points, at in rows}, gt=True)
        written += len(rows)
        last = rows[-1][0]


# ----------------------------------------------------------------------------- shards


def merge_top(local_tops: Iterable[Sequence[tuple[str, float]]], n: int) -> list[tuple[str, float]]:
    """The global top ``n`` from each shard's local top ``n`` (lists as ``ZREVRANGE ... WITHSCORES`` gives).

    Exact: a player in the global top ``n`` is in the top ``n`` of their own shard, so no
    list misses one. Each list is already sorted by (score, member) descending, as one big
    board would order them, so a lazy k-way merge keeps that order.
    """
    merged = heapq.merge(*local_tops, key=lambda entry: (entry[1], entry[0]), reverse=True)
    return list(itertools.islice(merged, max(n, 0)))


async def global_rank(r, keys: Sequence[str], score: float) -> int:
    """Exact 1-based rank of ``score`` across shard boards: 1 + the entries above it in each."""
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.zcount(key, f"({int(score)}", "+inf")  # "(" = strictly above
    return 1 + sum(await pipe.execute())


async def score_histogram(pool, width: int) -> dict[int, int]:
    """Players per band of ``width`` points (``{band: count}``), from PostgreSQL."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT points / %s AS band, count(*) FROM leaderboard_scores GROUP BY band", (width,)
        )
        return {band: count for band, count in await cur.fetchall()}


def approximate_rank(histogram: dict[int, int], width: int, points: int) -> int:
    """A rank estimated from a histogram: everyone in higher bands, plus a share of one's own band.

    Players are assumed spread evenly inside a band, so the error is at most the band's
    population; a few hundred bands cost a few kilobytes whatever the number of players.
    """
    band = points // width
    above = sum(count for b, count in histogram.items() if b > band)
    inside = histogram.get(band, 0)
    share = ((band + 1) * width - 1 - points) / width  # the part of the band above these points
    return 1 + above + round(inside * share)
