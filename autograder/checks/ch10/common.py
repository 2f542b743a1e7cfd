"""What both of chapter 10's checks use: the replicas, the settle limit, how outcomes are tallied, one-row reads."""

from __future__ import annotations

from collections import Counter

REPLICAS = 2
SETTLE_LIMIT = 2.0  # real seconds a wave may take to be held before the check moves on anyway (as chapter 03)


def _kind(x) -> str:
    if isinstance(x, BaseException):
        return type(x).__name__
    if isinstance(x, dict):
        return repr(x.get("status"))
    if isinstance(x, int) and not isinstance(x, bool):
        return "a transfer id"  # which caller got which id depends on who won: not part of the line
    return repr(x)


def _kinds(outcomes) -> str:
    counts = Counter(_kind(x) for x in outcomes)
    return ", ".join(f"{n} x {what}" for what, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


async def _one(pool, sql: str, params: tuple = ()):
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params)
        return await cur.fetchone()
