"""Chapter 13: what changes a board besides a new score (a removal, a time window).

- :func:`removal_race`: a cheater is removed (their total deleted in PostgreSQL, ``ZREM``
  on the board) while one of their events has committed and not yet written the board.
  With ``ZADD GT`` the late write puts them back. With **versioned writes** (a number from
  a PostgreSQL sequence taken under the player's row lock, and a Lua script that applies a
  write only if its version is newer than the last one applied) the late write is refused,
  and a correction that lowers a score is just a newer write.
- :func:`period_boards`: one board per day, the week's board as ``ZUNIONSTORE ... SUM`` of
  seven days, and why encoded scores (points and a time in one number) cannot be summed.
"""

from __future__ import annotations

import asyncio
import random

from course import leaderboard as lb

BOARD = lb.BOARD

# ============================================================================ removals and corrections

#: Versions of board writes, in commit order per player (taken under the player's row lock).
VERSIONS_SQL = "CREATE SEQUENCE IF NOT EXISTS ch13_board_versions"

#: KEYS: the board, a hash player -> version of the last write applied.
#: ARGV: player, version, score (or "" to remove). Applies the write only if it is newer.
VERSIONED_WRITE = """
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if tonumber(ARGV[2]) <= last then
    return 0  -- an older write than the last one applied: refused
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if ARGV[3] == '' then
    redis.call('ZREM', KEYS[1], ARGV[1])
else
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])  -- no GT: a correction may lower the score
end
return 1
"""


async def versioned_write(r, player: str, version: int, score: int | None, *, key: str = BOARD) -> bool:
    """Write ``score`` (None: remove) for ``player`` if ``version`` is newer than the last one applied."""
    keys = [key, f"{key}:versions"]
    return bool(await r.eval(VERSIONED_WRITE, 2, *keys, player, version, "" if score is None else score))


async def _record_stalled(
    pool, r, event: dict, committed: asyncio.Event, go: asyncio.Event, versioned: bool
) -> None:
    """Claim and add in PostgreSQL, commit, then wait for ``go`` (a GC pause, a slow network) before the board."""
    async with pool.connection() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO leaderboard_events (event_id, player, points, at) VALUES (%s, %s, %s, %s)",
            (event["event_id"], event["player"], event["points"], event["at"]),
        )
        cur = await conn.execute(lb.ADD_POINTS.replace("RETURNING points, reached_at",
                                                       "RETURNING points, reached_at, nextval('ch13_board_versions')"),
                                 (event["player"], event["points"], event["at"]))  # fmt: skip
        points, reached_at, version = await cur.fetchone()
    committed.set()
    await go.wait()
    if versioned:
        await versioned_write(r, event["player"], version, lb.encode(points, reached_at))
    else:
        await r.zadd(BOARD, {event["player"]: lb.encode(points, reached_at)}, gt=True)


async def remove_player(pool, r, player: str, *, versioned: bool) -> None:
    """Delete ``player``'s total (under their row lock) and take them off the board."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "DELETE FROM leaderboard_scores WHERE player = %s RETURNING nextval('ch13_board_versions')",
            (player,),
        )
        row = await cur.fetchone()
    if versioned and row is not None:
        await versioned_write(r, player, row[0], None)
    elif not versioned:
        await r.zrem(BOARD, player)


async def removal_race(pool, r, *, versioned: bool, cheater: str = "mallory") -> dict:
    """The cheater's big event commits and stalls; the cheater is removed; the stalled write lands.

    No sleeps: the event waits on an :class:`asyncio.Event` the demo sets after the removal.
    Returns what PostgreSQL and the board say about the cheater afterwards.
    """
    async with pool.connection() as conn:
        await conn.execute(VERSIONS_SQL)
    await lb.reset(pool, r, BOARD, f"{BOARD}:versions")
    rivals = [{"event_id": f"rm-{i}", "player": p, "points": pts, "at": 10 + i}
              for i, (p, pts) in enumerate([("amy", 900), ("bo", 700), ("cy", 500)])]  # fmt: skip
    for event in rivals:
        if versioned:  # the same path as the cheater's, without the stall
            done, go = asyncio.Event(), asyncio.Event()
            go.set()
            await _record_stalled(pool, r, event, done, go, versioned=True)
        else:
            await lb.record(pool, r, event)
    committed, go = asyncio.Event(), asyncio.Event()
    cheat = {"event_id": "rm-cheat", "player": cheater, "points": 90_000, "at": 20}
    writer = asyncio.create_task(_record_stalled(pool, r, cheat, committed, go, versioned))
    await committed.wait()  # the event is in PostgreSQL; its board write has not happened yet
    await remove_player(pool, r, cheater, versioned=versioned)
    removed_rank = await lb.rank(r, cheater)
    go.set()  # the stalled write lands now
    await writer
    async with pool.connection() as conn:
        row = await (
            await conn.execute("SELECT points FROM leaderboard_scores WHERE player = %s", (cheater,))
        ).fetchone()
    score = await r.zscore(BOARD, cheater)
    return {
        "versioned": versioned,
        "in_postgres": row is not None,
        "rank_after_removal": removed_rank,
        "rank_at_the_end": await lb.rank(r, cheater),
        "points_on_board": None if score is None else lb.decode(score)[0],
    }


# ============================================================================ daily and weekly boards


async def period_boards(r, *, players: int = 2_000, days: int = 7, seed: int = 9) -> dict:
    """``days`` daily boards of raw points (each expiring after 8 days), the week as their
    ``ZUNIONSTORE ... AGGREGATE SUM``, checked against the sums computed here."""
    rng = random.Random(seed)
    day_keys = [f"{BOARD}:day:{d + 1}" for d in range(days)]
    week_key = f"{BOARD}:week"
    truth: dict[str, int] = {}
    pipe = r.pipeline(transaction=False)
    pipe.unlink(*day_keys, week_key)
    for key in day_keys:
        played = {f"p{i:05d}": rng.randint(1, 500) for i in range(players) if rng.random() < 0.6}
        for player, points in played.items():
            truth[player] = truth.get(player, 0) + points
        pipe.zadd(key, played)
        pipe.expire(key, 8 * 86_400)  # a day's board outlives the week it counts in, then goes
    await pipe.execute()
    members = await r.zunionstore(week_key, day_keys, aggregate="SUM")
    await r.expire(week_key, 8 * 86_400)
    top = [(p, int(s)) for p, s in await r.zrevrange(week_key, 0, 4, withscores=True)]
    best = sorted(truth.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:5]
    # the encoded scores of two days, summed: the time digits overflow into the points
    one_day = lb.encode(100, 40_000)
    summed = lb.decode(one_day + lb.encode(100, 50_000))
    return {
        "days": days,
        "members": members,
        "top": top,
        "equal": top == best,
        "summed": summed,
        "keys": day_keys,
    }
