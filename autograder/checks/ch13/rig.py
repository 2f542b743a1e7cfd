"""The check's tools for chapter 13: the board gate, what it reads back, how it names what it saw."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable

from course import leaderboard as lb
from course.kit.lab import LOCK_WAITERS

BOARD = lb.BOARD
SETTLE_LIMIT = 2.0  # real seconds a crowd may take to park before the check moves it on anyway
#: commands that only read; anything else counts as a write
READS = {
    "GET", "MGET", "EXISTS", "TYPE", "TTL", "PTTL", "KEYS", "SCAN", "DBSIZE", "INFO", "PING", "ECHO",
    "ZCARD", "ZCOUNT", "ZLEXCOUNT", "ZSCORE", "ZMSCORE", "ZRANK", "ZREVRANK", "ZRANGE", "ZREVRANGE",
    "ZRANGEBYSCORE", "ZREVRANGEBYSCORE", "ZRANGEBYLEX", "ZREVRANGEBYLEX", "ZSCAN", "ZRANDMEMBER",
    "HGET", "HGETALL", "HMGET", "HLEN", "SMEMBERS", "SISMEMBER", "SCARD", "LRANGE", "LLEN", "STRLEN",
    "XRANGE", "XREVRANGE", "XREAD", "XLEN", "XINFO", "WATCH", "UNWATCH", "SCRIPT", "CLIENT", "HELLO",
    "COMMAND", "TIME", "EVAL_RO", "EVALSHA_RO", "OBJECT", "MEMORY",
}  # fmt: skip
SCRIPTS = {"EVAL", "EVALSHA", "FCALL"}


def _name(args: tuple) -> str:
    return str(args[0]).upper().split()[0] if args else ""


def _writes(commands: list[tuple]) -> bool:
    return any(_name(a) not in READS for a in commands)


def _mentions(commands: list[tuple], word: str) -> bool:
    return any(str(x) == word for a in commands for x in a[1:])


def _touches_board(commands: list[tuple]) -> bool:
    for a in commands:
        name = _name(a)
        if name in SCRIPTS:
            return True  # a script may write any key
        if name not in READS and BOARD in (str(x) for x in a[1:]):
            return True
    return False


def _zadd_score(commands: list[tuple]) -> float | None:
    """The largest score a round trip ZADDs (None when it writes some other way)."""
    best = None
    for a in commands:
        if _name(a) != "ZADD":
            continue
        rest = [str(x) for x in a[2:]]
        while rest and rest[0].upper() in {"NX", "XX", "GT", "LT", "CH", "INCR"}:
            rest.pop(0)
        for score in rest[0::2]:
            try:
                value = float(score)
            except ValueError:
                continue
            best = value if best is None else max(best, value)
    return best


def _leaves(reply) -> int:
    """How many values a reply carried (a ZREVRANGE of 10 with scores: 20)."""
    if isinstance(reply, (list, tuple, set)):
        return sum(_leaves(x) for x in reply)
    if isinstance(reply, dict):
        return sum(1 + _leaves(v) for v in reply.values())
    return 1


async def _board(plain, key: str = BOARD) -> dict[str, int]:
    return {m: int(s) for m, s in await plain.zrange(key, 0, -1, withscores=True)}


async def _totals(pool) -> dict[str, tuple[int, int]]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT player, points, reached_at FROM leaderboard_scores")
        return {p: (pts, at) for p, pts, at in await cur.fetchall()}


async def _events(pool) -> int:
    async with pool.connection() as conn:
        return (await (await conn.execute("SELECT count(*) FROM leaderboard_events")).fetchone())[0]


def _show(score: int | None) -> str:
    if score is None:
        return "nothing"
    points, at = lb.decode(score)
    return f"{score} (= encode({points}, {at}))" if score >= lb.TIE_SPAN else f"{score}"


# ============================================================================ record_score


class BoardGate:
    """Holds the board writes of ``n`` concurrent callers and lets them out highest first.

    A caller is "running", "held" (its board write waits here) or "done". The crowd is
    parked when every running caller is blocked on a PostgreSQL lock; then the held write
    with the highest ZADD score (else the latest to arrive) is sent, and the check waits
    for it to complete before it looks again.
    """

    def __init__(self, n: int, watcher, opens: Callable[[], Awaitable] | None = None) -> None:
        self.opens = opens  # called once, the first time the crowd is parked with no board write held
        self.n = n
        self.watcher = watcher
        self.state = ["running"] * n
        self.held: list[tuple[float, int, int, asyncio.Event, asyncio.Event]] = []
        self.arrivals = 0
        self.stalls = 0
        self.released = 0
        self._who: contextvars.ContextVar[int | None] = contextvars.ContextVar("caller", default=None)

    async def hook(self, commands: list[tuple], send: Callable[[], Awaitable]):
        i = self._who.get()
        if i is None or not _touches_board(commands):
            return await send()
        go, sent = asyncio.Event(), asyncio.Event()
        score = _zadd_score(commands)
        self.arrivals += 1
        self.held.append((score if score is not None else float("-inf"), self.arrivals, i, go, sent))
        self.state[i] = "held"
        try:
            await go.wait()
            self.state[i] = "running"
            return await send()
        finally:
            self.state[i] = "running" if self.state[i] == "held" else self.state[i]
            sent.set()

    async def _parked(self) -> bool:
        deadline = time.monotonic() + SETTLE_LIMIT
        while True:
            await asyncio.sleep(0.002)
            running = self.state.count("running")
            if running == 0:
                return True
            cur = await self.watcher.execute(LOCK_WAITERS)
            if (await cur.fetchone())[0] >= running:
                return True
            if time.monotonic() > deadline:
                return False

    async def run(self, make_call: Callable[[int], Awaitable]) -> list:
        async def one(i: int):
            self._who.set(i)
            try:
                return await make_call(i)
            finally:
                self.state[i] = "done"

        tasks = [asyncio.create_task(one(i)) for i in range(self.n)]
        while not all(t.done() for t in tasks):
            parked = await self._parked()
            if all(t.done() for t in tasks):
                break
            self.stalls += not parked
            if not self.held:
                if self.opens is not None:
                    opens, self.opens = self.opens, None
                    await opens()
                continue
            self.held.sort(key=lambda h: (h[0], h[1]))
            _, _, _, go, sent = self.held.pop()
            self.released += 1
            go.set()
            await sent.wait()
        return await asyncio.gather(*tasks, return_exceptions=True)


def _event(event_id: str, player: str, points: int, at: int) -> dict:
    return {"event_id": event_id, "player": player, "points": points, "at": at}


# ----------------------------------------------------------------------------- gates in PostgreSQL
# A closed gate makes every INSERT or UPDATE of its table wait inside PostgreSQL (a trigger takes
# a shared advisory lock the check holds exclusively), so concurrent callers all get as far as
# that write, and the check sees them parked on a lock, before any of them commits.
SCORE_GATE_LOCK = 13_013
EVENTS_GATE_LOCK = 13_014
SCORE_GATE = f"""
CREATE TABLE IF NOT EXISTS ch13_score_gate (closed boolean PRIMARY KEY);
CREATE OR REPLACE FUNCTION ch13_score_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM ch13_score_gate) THEN
        PERFORM pg_advisory_xact_lock_shared({SCORE_GATE_LOCK});
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS ch13_score_gate ON leaderboard_scores;
CREATE TRIGGER ch13_score_gate BEFORE INSERT OR UPDATE ON leaderboard_scores
    FOR EACH ROW EXECUTE FUNCTION ch13_score_gate();
"""
EVENTS_GATE = f"""
CREATE TABLE IF NOT EXISTS ch13_events_gate (closed boolean PRIMARY KEY);
CREATE OR REPLACE FUNCTION ch13_events_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM ch13_events_gate) THEN
        PERFORM pg_advisory_xact_lock_shared({EVENTS_GATE_LOCK});
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS ch13_events_gate ON leaderboard_events;
CREATE TRIGGER ch13_events_gate BEFORE INSERT OR UPDATE ON leaderboard_events
    FOR EACH ROW EXECUTE FUNCTION ch13_events_gate();
"""


async def install_score_gate(conn) -> None:
    """Writes to ``leaderboard_scores`` wait inside PostgreSQL while the gate is closed."""
    await conn.execute(SCORE_GATE)


async def close_score_gate(conn) -> None:
    await conn.execute("SELECT pg_advisory_lock(%s)", (SCORE_GATE_LOCK,))
    await conn.execute("INSERT INTO ch13_score_gate VALUES (true) ON CONFLICT DO NOTHING")


async def open_score_gate(conn) -> None:
    await conn.execute("DELETE FROM ch13_score_gate")
    await conn.execute("SELECT pg_advisory_unlock_all()")


async def close_events_gate(conn) -> None:
    """Inserts into ``leaderboard_events`` wait inside PostgreSQL until :func:`open_events_gate`."""
    await conn.execute(EVENTS_GATE)
    await conn.execute("SELECT pg_advisory_lock(%s)", (EVENTS_GATE_LOCK,))
    await conn.execute("INSERT INTO ch13_events_gate VALUES (true) ON CONFLICT DO NOTHING")


async def open_events_gate(conn) -> None:
    await conn.execute("DELETE FROM ch13_events_gate")
    await conn.execute("SELECT pg_advisory_unlock(%s)", (EVENTS_GATE_LOCK,))
