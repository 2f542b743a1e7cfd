"""Replaying dead letters, and the metrics that say when to (chapter 05; :mod:`course.messaging`).

:func:`replay_key` re-drives one blocked key in batches, unblocking last; :func:`replay_blocked`
paces it over every blocked key of a stream; :func:`metrics` reads what to alert on.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from course.messaging.consumer import ORDER_BY_ENTRY, Handler, entry_order


async def replay_key(
    pool, redis, handle: Handler, *, stream: str, key: str, dlq: str, batch: int = 100
) -> int:
    """Re-drive a blocked key after its cause is fixed; the number of messages applied.

    The dead-lettered message first, then the parked ones in stream order, each skipped if its id
    was applied before, at most ``batch`` per transaction. Each transaction holds the key's block
    row (so the consumer cannot park more meanwhile), deletes the parked rows it applied (the
    progress: a replay killed half-way resumes where it stopped) and, once none are left, deletes
    the block: **unblock last**. Then the dead-letter entry is deleted. A handler error rolls back
    only its batch (the key stays blocked). A key that is not blocked: 0.
    """
    applied = 0
    while True:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT entry_id, dlq_id, fields FROM mq_blocked_keys WHERE stream = %s AND key = %s "
                "FOR UPDATE",
                (stream, key),
            )
            row = await cur.fetchone()
            if row is None:
                return applied
            dead_entry, dlq_id, dead_fields = row
            todo = 1 if await _apply_new(conn, handle, stream, dead_entry, dead_fields) else 0
            cur = await conn.execute(
                "SELECT entry_id, fields FROM mq_parked WHERE stream = %s AND key = %s "
                f"ORDER BY {ORDER_BY_ENTRY} "
                "LIMIT %s",
                (stream, key, batch - todo),
            )
            rows = await cur.fetchall()
            for entry_id, fields in rows:
                todo += await _apply_new(conn, handle, stream, entry_id, fields)
            done = [entry_id for entry_id, _ in rows]
            await conn.execute(
                "DELETE FROM mq_parked WHERE stream = %s AND entry_id = ANY(%s)", (stream, done)
            )
            cur = await conn.execute(
                "SELECT 1 FROM mq_parked WHERE stream = %s AND key = %s LIMIT 1", (stream, key)
            )
            last = await cur.fetchone() is None
            if last:  # nothing parked is left: unblock, in the transaction of the last batch
                await conn.execute(
                    "DELETE FROM mq_blocked_keys WHERE stream = %s AND key = %s", (stream, key)
                )
        applied += todo
        if last:
            await redis.xdel(dlq, dlq_id)
            return applied


async def _apply_new(conn, handle: Handler, stream: str, entry_id: str, fields: dict) -> bool:
    """Record the id and apply the message, unless its id was applied before. Applied?"""
    cur = await conn.execute(
        "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
        "ON CONFLICT (message_id) DO NOTHING RETURNING message_id",
        (fields["id"], stream, entry_id),
    )
    if await cur.fetchone() is None:
        return False
    await handle(conn, fields)
    return True


async def replay_blocked(
    pool,
    redis,
    handle: Handler,
    *,
    stream: str,
    dlq: str,
    per_second: float = 10.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> list[tuple[str, int | str]]:
    """Replay every blocked key of ``stream``, oldest block first, at most ``per_second`` keys
    a second, so a fixed bug does not become a thundering herd. ``(key, applied or error)``."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT key FROM mq_blocked_keys WHERE stream = %s ORDER BY blocked_at, key", (stream,)
        )
        keys = [k for (k,) in await cur.fetchall()]
    done: list[tuple[str, int | str]] = []
    for i, key in enumerate(keys):
        if i:
            await sleep(1.0 / per_second)
        try:
            done.append((key, await replay_key(pool, redis, handle, stream=stream, key=key, dlq=dlq)))
        except Exception as err:  # noqa: BLE001 - still broken: the key stays blocked, go on
            done.append((key, f"{type(err).__name__}: {err}"))
    return done


# ----------------------------------------------------------------------------- metrics


async def metrics(pool, redis, *, stream: str, group: str, dlq: str, sample: int = 1000) -> dict:
    """What to alert on, read from the servers: backlog, pending (and the oldest one's idle
    time), dead letters (``XLEN``, the oldest one's age, and by reason and error type over the
    newest ``sample`` of them), blocked keys (and the longest block), parked messages, and the
    stream's owner with its fencing token.

    Cheap at any size: a metrics scrape must not read a million dead letters every 15 s."""
    out: dict = {}
    info = await redis.xinfo_groups(stream)
    mine = next((g for g in info if g["name"] == group), {})
    out["lag"] = mine.get("lag")  # Redis 7 only; None on 6.2
    summary = await redis.xpending(stream, group)
    out["pending"] = summary["pending"]
    oldest = await redis.xpending_range(stream, group, "-", "+", 1) if summary["pending"] else []
    out["oldest_pending_idle_s"] = oldest[0]["time_since_delivered"] / 1000 if oldest else 0.0
    out["dlq"] = await redis.xlen(dlq)
    newest = await redis.xrevrange(dlq, count=sample)
    out["dlq_sampled"] = len(newest)
    out["dlq_by_reason"] = dict(Counter(f.get("reason", "?") for _, f in newest))
    out["dlq_by_error_type"] = dict(Counter(f.get("error_type", "?") for _, f in newest))
    oldest_dead = await redis.xrange(dlq, count=1)
    now_ms = int(time.time() * 1000)
    out["oldest_dlq_age_s"] = (now_ms - entry_order(oldest_dead[0][0])[0]) / 1000 if oldest_dead else 0.0
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT count(*), coalesce(extract(epoch FROM now() - min(blocked_at)), 0) FROM mq_blocked_keys "
            "WHERE stream = %s",
            (stream,),
        )
        out["blocked_keys"], longest = await cur.fetchone()
        out["longest_block_s"] = float(longest)
        cur = await conn.execute("SELECT count(*) FROM mq_parked WHERE stream = %s", (stream,))
        (out["parked"],) = await cur.fetchone()
        cur = await conn.execute("SELECT owner, token FROM mq_fence WHERE stream = %s", (stream,))
        out["owner"], out["fencing_token"] = await cur.fetchone() or (None, None)
    return out
