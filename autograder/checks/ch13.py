"""Hidden checks of chapter 13 (the live leaderboard): ``record_score``, ``top_and_rank``,
``rebuild_board`` and ``merge_top``.

Everything runs on live servers in a scratch namespace. The learner's code gets a Redis
client whose every round trip passes through the check (``probes.hooked_redis``), which is
how the verdicts stay deterministic while the concurrency is real:

- ``record_score``: concurrent events of one player, delivered through two replicas of the
  answer, have their board writes *held* until every caller is parked (held at the board, or
  blocked on a PostgreSQL lock, seen in ``pg_stat_activity``); then the held writes go out
  one at a time, the highest score first. A write computed before another event landed
  therefore always arrives after it, as it can in production; a board that took it at face
  value goes backwards, every time.
- ``rebuild_board``: events arrive *during* the rebuild at the worst moments the check can
  see: a new player just before the rebuild's first write, and an existing player just
  before the write that carries that player's (older) total.
- ``top_and_rank`` counts what it read from Redis: the whole board for a top 10 is a fail.
- ``merge_top`` is a pure function, checked on seeded random shards with ties.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable

import psycopg

from autograder.harness import Report, task
from autograder.probes import hooked_redis, tally
from course import leaderboard as lb
from course.kit import lab

BOARD = lb.BOARD
SETTLE_LIMIT = 2.0  # real seconds a crowd may take to park before the check moves it on anyway
LOCK_WAITERS = (
    "SELECT count(*) FROM pg_stat_activity "
    "WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
)
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

    def __init__(self, n: int, watcher) -> None:
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
                continue
            self.held.sort(key=lambda h: (h[0], h[1]))
            _, _, _, go, sent = self.held.pop()
            self.released += 1
            go.set()
            await sent.wait()
        return await asyncio.gather(*tasks, return_exceptions=True)


def _event(event_id: str, player: str, points: int, at: int) -> dict:
    return {"event_id": event_id, "player": player, "points": points, "at": at}


@task("record_score", points=4, title="idempotent score events with the tie rule", timeout=60, seed=1313)
async def check_record_score(r: Report, record_score) -> None:
    async with lab.scratch("ch13") as ns:
        pool = await ns.pool(max_size=14)
        await lb.setup_schema(pool)
        plain = ns.redis()
        learner = hooked_redis(ns.redis_url, lambda commands, send: send())
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            await _check_record_score(r, record_score, ns, pool, plain, learner, watcher)
        finally:
            await watcher.close()
            await learner.aclose()


async def _check_record_score(r: Report, record_score, ns, pool, plain, learner, watcher) -> None:
    # --- one event, then the same event again ----------------------------------------------
    first = _event("e-ada-1", "ada", 30, 100)
    got = await record_score(pool, learner, first)
    r.expect(
        got is True, f"record_score(pool, r, {first}) returned {got!r}" + ("" if got is True else ", expected True")
    )
    totals, board = await _totals(pool), await _board(plain)
    r.expect(
        totals.get("ada") == (30, 100),
        "leaderboard_scores has ada with 30 points reached at 100",
        f"leaderboard_scores has {totals.get('ada')!r} for ada, expected (points, reached_at) = (30, 100)",
    )
    want = lb.encode(30, 100)
    if board.get("ada") == 30:
        r.fail(
            f"the board holds ada's raw points (30); expected encode(30, 100) = {want}. With raw points Redis orders "
            "equal scores by member name, not by who got there first"
        )
    r.expect(
        board.get("ada") == want,
        f"the board '{BOARD}' has ada at encode(30, 100) = {want}",
        f"the board '{BOARD}' has ada at {_show(board.get('ada'))}, expected encode(30, 100) = {want}",
    )
    again = await record_score(pool, learner, first)
    totals, board, n_events = await _totals(pool), await _board(plain), await _events(pool)
    r.expect(
        again is False and totals.get("ada") == (30, 100) and board.get("ada") == want and n_events == 1,
        "the same event again returned False and changed nothing",
        f"the same event delivered again returned {again!r} and left ada at {totals.get('ada')} in PostgreSQL, "
        f"{_show(board.get('ada'))} on the board, {n_events} row(s) in leaderboard_events; expected False, "
        "(30, 100), the same board score, 1 row: an event id is applied once",
    )
    zoe = _event("e-zoe-1", "zoe", 30, 200)
    await record_score(pool, learner, zoe)
    order = [m for m, _ in await plain.zrevrange(BOARD, 0, 1, withscores=True)]
    r.expect(
        order == ["ada", "zoe"],
        "zoe reached 30 at 200, after ada (at 100): the board ranks ada first",
        f"zoe reached 30 at 200, after ada (at 100), but the board ranks {order}; the earlier achiever goes first",
    )
    if r.public:
        return

    a, b = r.replicas("record_score", 2)
    r.note("two replicas of record_score (your answer cell run twice, as two processes of a service) share the work")

    # --- one event delivered six times at once, through both replicas ------------------------
    dup = _event("e-bo-1", "bo", 20, 300)
    results = await asyncio.gather(*(((a, b)[i % 2])(pool, learner, dup) for i in range(6)), return_exceptions=True)
    applied = sum(1 for x in results if x is True)
    errors = [x for x in results if isinstance(x, BaseException)]
    totals, board = await _totals(pool), await _board(plain)
    async with pool.connection() as conn:
        rows = (
            await (await conn.execute("SELECT count(*) FROM leaderboard_events WHERE event_id = 'e-bo-1'")).fetchone()
        )[0]
    ok = applied == 1 and not errors and totals.get("bo") == (20, 300) and board.get("bo") == lb.encode(20, 300)
    if not ok and applied == 2 and totals.get("bo") == (40, 300):
        r.fail(
            "one event delivered 6 times at once through two replicas was applied twice (bo has 40 points, expected 20): "
            "one per replica. State kept in one process is not shared; claim the event id in PostgreSQL "
            "(INSERT ... ON CONFLICT DO NOTHING RETURNING) in the transaction that adds the points"
        )
    r.expect(
        ok,
        "one event delivered 6 times at once through two replicas: applied once (one True), bo has 20 points, "
        "one leaderboard_events row",
        f"one event delivered 6 times at once through two replicas: returned {tally(results)}; bo has "
        f"{totals.get('bo')} in PostgreSQL and {_show(board.get('bo'))} on the board, {rows} event row(s); expected "
        f"one True, (20, 300), {lb.encode(20, 300)}, 1 row"
        + (
            ". The board counted the redeliveries: a ZINCRBY that runs on every delivery is not idempotent"
            if board.get("bo", 0) > lb.encode(20, 300) and totals.get("bo") == (20, 300)
            else ""
        ),
    )

    # --- events of one player out of time order ----------------------------------------------
    await record_score(pool, learner, _event("e-cy-1", "cy", 10, 500))
    await record_score(pool, learner, _event("e-cy-2", "cy", 5, 400))  # delivered late
    await record_score(pool, learner, _event("e-dee-1", "dee", 15, 450))
    totals = await _totals(pool)
    order = [m for m, _ in await plain.zrevrange(BOARD, 0, -1, withscores=True) if m in ("cy", "dee")]
    r.expect(
        totals.get("cy") == (15, 500) and order == ["dee", "cy"],
        "cy got +10 at 500 then a late +5 at 400: reached 15 at 500 (the latest event), so dee (15 at 450) ranks above",
        f"cy got +10 at 500 then a late +5 at 400, and has {totals.get('cy')} with the board ranking {order}; "
        "expected (15, 500) and dee (15 at 450) above cy: a total is reached at the latest of its events "
        "(GREATEST(reached_at, at)), whatever order they arrive in",
    )

    # --- concurrent events of one player: writes that race to the board ---------------------
    points = [7, 11, 13, 17, 19]
    events = [_event(f"e-ivy-{k}", "ivy", p, 600 + k) for k, p in enumerate(points)]
    gate = BoardGate(len(events), watcher)
    learner_gated = hooked_redis(ns.redis_url, gate.hook)
    try:
        results = await gate.run(lambda i: ((a, b)[i % 2])(pool, learner_gated, events[i]))
    finally:
        await learner_gated.aclose()
    want_total = (sum(points), 600 + len(points) - 1)
    totals, board = await _totals(pool), await _board(plain)
    errors = [x for x in results if isinstance(x, BaseException)]
    r.note(
        f"{len(events)} events of ivy at once (+{', +'.join(map(str, points))}); the check held each board write "
        f"until the others were parked and sent the newest first ({gate.released} writes released)"
        + (f"; the callers did not park within {SETTLE_LIMIT:g} s {gate.stalls} time(s)" if gate.stalls else "")
    )
    r.expect(not errors, f"all {len(events)} calls returned", f"calls raised: {tally(errors)}")
    r.expect(
        totals.get("ivy") == want_total,
        f"PostgreSQL has ivy at {want_total}",
        f"PostgreSQL has ivy at {totals.get('ivy')}, expected {want_total}: concurrent events of one player lost "
        "an update. Add in one statement (points = points + EXCLUDED.points) in the transaction that claims the event",
    )
    want = lb.encode(*want_total)
    got = board.get("ivy")
    if got is not None and got > want:
        r.fail(
            f"the board has ivy at {_show(got)} while PostgreSQL says {want_total}: more than the events add up to. "
            "Increments (ZINCRBY) computed from the same starting point were each added; write the total "
            "PostgreSQL returns (ZADD ... GT) instead"
        )
    r.expect(
        got == want,
        f"the board has ivy at {want} (= encode{want_total})",
        f"the board has ivy at {_show(got)} while PostgreSQL says {want_total}: a board write computed before "
        "another event landed arrived after it and moved ivy back. Write with ZADD ... GT (scores only grow), or "
        "write the board while you hold the player's row lock",
    )

    # --- Redis loses everything ---------------------------------------------------------------
    await plain.flushdb()
    again = await b(pool, learner, first)
    totals = await _totals(pool)
    r.expect(
        again is False and totals.get("ada") == (30, 100),
        "after Redis lost everything (FLUSHDB), a redelivered old event returned False and ada kept 30 points",
        f"after Redis lost everything (FLUSHDB), the old event e-ada-1 delivered again returned {again!r} and ada "
        f"has {totals.get('ada')} in PostgreSQL, expected False and (30, 100): the dedup record must live where the "
        "points live (PostgreSQL), not in Redis",
    )
    await a(pool, learner, _event("e-ada-2", "ada", 15, 700))
    totals, board = await _totals(pool), await _board(plain)
    want = lb.encode(45, 700)
    r.expect(
        totals.get("ada") == (45, 700) and board.get("ada") == want,
        f"then a new event for ada (+15 at 700) put her full total on the empty board: {want}",
        f"then a new event for ada (+15 at 700): PostgreSQL has {totals.get('ada')}, the board "
        f"{_show(board.get('ada'))}; expected (45, 700) and {want}. Write the total PostgreSQL returns (ZADD), not "
        "an increment (ZINCRBY), so the board heals itself",
    )


# ============================================================================ top_and_rank


def _reference_order(entries: dict[str, int]) -> list[tuple[str, int]]:
    return sorted(entries.items(), key=lambda e: (e[1], e[0]), reverse=True)


class Reads:
    """Counts round trips and the values their replies carried."""

    def __init__(self) -> None:
        self.trips = 0
        self.values = 0

    async def hook(self, commands, send):
        self.trips += 1
        reply = await send()
        self.values += _leaves(reply)
        return reply


async def _ask(r: Report, top_and_rank, client, n: int, player: str):
    got = await top_and_rank(client, n, player)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        r.fail(f"top_and_rank(r, {n}, {player!r}) returned {got!r}; expected a pair (top, rank)")
    top, rank = got
    try:
        top = [tuple(x) for x in top]
    except TypeError:
        r.fail(f"top_and_rank(r, {n}, {player!r}) returned top = {top!r}; expected a list of (player, points)")
    return top, rank


def _rank_hint(scores: dict[str, int], player: str, got) -> str:
    """Which plausible mistake gives ``got`` as ``player``'s rank on this board."""
    order = [p for p, _ in _reference_order(scores)]
    points = {p: lb.decode(s)[0] for p, s in scores.items()}
    true = order.index(player) + 1
    by_name = sorted(order, key=lambda p: (-points[p], p))
    reasons = [
        (true - 1, "ranks are 1-based (ZREVRANK counts from 0: add 1)"),
        (len(order) - true, "that counts from the bottom, from 0 (ZRANK); the best player is rank 1 (ZREVRANK + 1)"),
        (len(order) - true + 1, "that counts from the bottom (ZRANK); the best player is rank 1 (ZREVRANK + 1)"),
        (
            1 + sum(points[p] > points[player] for p in order),
            "that gives players with equal points one rank; the tie rule separates them (who got there first), "
            "and the board's order already says it",
        ),
        (by_name.index(player) + 1, "equal points put in name order; the board's order (who got there first) decides"),
    ]
    found = [why for value, why in reasons if value == got and value != true]
    return f": {' or '.join(found)}" if found else ""


def _explain_top(got: list, n: int, scores: dict[str, int]) -> str:
    """Which plausible mistake gives ``got`` as the top ``n`` of this board."""
    order = _reference_order(scores)
    decoded = [(p, lb.decode(s)[0]) for p, s in order]
    mistakes = [
        ([(p, int(s)) for p, s in order][:n], "the points are the encoded scores; return decode(score)[0]"),
        (list(reversed(decoded))[:n], "lowest first; the best player comes first (ZREVRANGE, not ZRANGE)"),
        (
            sorted(decoded, key=lambda e: (-e[1], e[0]))[:n],
            "equal points put in name order; they go to who reached them first, as the board's score "
            "already says: keep the board's order",
        ),
    ]
    return next((f": {why}" for wrong, why in mistakes if got == wrong), "")


@task("top_and_rank", points=3, title="top N and a player's 1-based rank", timeout=30, seed=2424)
async def check_top_and_rank(r: Report, top_and_rank) -> None:
    async with lab.scratch("ch13") as ns:
        plain = ns.redis()
        reads = Reads()
        learner = hooked_redis(ns.redis_url, reads.hook)
        try:
            await _check_top_and_rank(r, top_and_rank, plain, learner, reads)
        finally:
            await learner.aclose()


async def _check_top_and_rank(r: Report, top_and_rank, plain, learner, reads: Reads) -> None:
    small = {
        "kim": (90, 28), "ike": (80, 13), "hal": (80, 38), "eve": (70, 20), "bob": (50, 19), "ada": (50, 32),
        "jo": (50, 33), "gus": (50, 47), "fay": (50, 58), "cy": (30, 56), "zed": (20, 46), "dee": (10, 43),
    }  # fmt: skip
    scores = {p: lb.encode(*v) for p, v in small.items()}
    await plain.zadd(BOARD, scores)
    r.note(
        "board (points at time): " + ", ".join(f"{p} {small[p][0]}@{small[p][1]}" for p, _ in _reference_order(scores))
    )
    want = [(p, small[p][0]) for p, _ in _reference_order(scores)]
    top, rank = await _ask(r, top_and_rank, learner, 3, "fay")
    r.expect(
        top == want[:3],
        f"top_and_rank(r, 3, 'fay') top = {top}",
        f"top_and_rank(r, 3, 'fay') gave top = {top}, expected {want[:3]}" + _explain_top(top, 3, scores),
    )
    r.expect(
        rank == 9,
        "fay's rank is 9 (five players have 50 points; fay reached 50 last)",
        f"fay's rank came back as {rank!r}, expected 9" + _rank_hint(scores, "fay", rank),
    )
    _, missing = await _ask(r, top_and_rank, learner, 3, "nobody")
    r.expect(
        missing is None,
        "a player not on the board has rank None",
        f"a player not on the board got rank {missing!r}, expected None",
    )
    if r.public:
        return

    # --- a board of 2,000 with many ties ------------------------------------------------------
    await plain.delete(BOARD)
    rng = r.random
    entries: dict[str, int] = {}
    for i in range(2000):
        entries[f"p{i:04d}"] = lb.encode(rng.randint(0, 60) * 5, rng.randint(0, 5000))
    entries["tie-a"] = entries["tie-b"] = lb.encode(999, 7)  # an exact tie: the board orders it by name
    await plain.zadd(BOARD, entries)
    order = _reference_order(entries)
    ranks = {p: i + 1 for i, (p, _) in enumerate(order)}
    want = [(p, lb.decode(s)[0]) for p, s in order]
    r.note(f"a board of {len(entries)} players drawn at random (seed {r.task.seed}), many with equal points")
    picks = [order[0][0], order[1][0], order[57][0], order[58][0], order[1500][0], order[-1][0]]
    for n, player in [(100, picks[0]), (10, picks[2]), (25, picks[3]), (1, picks[4]), (100, picks[5]), (5, picks[1])]:
        reads.trips = reads.values = 0
        top, rank = await _ask(r, top_and_rank, learner, n, player)
        if top != want[:n]:
            at = next((k for k, (x, y) in enumerate(zip(top, want, strict=False)) if x != y), min(len(top), n))
            r.fail(
                f"top_and_rank(r, {n}, {player!r}) top differs from the board at position {at + 1}: got "
                f"{top[at : at + 3]}, expected {want[at : at + 3]}" + _explain_top(top, n, entries)
            )
        if rank != ranks[player]:
            r.fail(
                f"top_and_rank(r, {n}, {player!r}) rank = {rank!r}, expected {ranks[player]}"
                + _rank_hint(entries, player, rank)
            )
        if reads.values > 2 * n + 40 or reads.trips > 4:
            r.fail(
                f"top_and_rank(r, {n}, {player!r}) made {reads.trips} round trip(s) that brought back {reads.values} "
                f"values from a board of {len(entries)}: read only the top {n} (ZREVRANGE key 0 {n - 1} WITHSCORES) "
                "and the rank (ZREVRANK); both are O(log N), whatever the board's size"
            )
    r.ok(
        "top N for N in 1, 5, 10, 25, 100 and ranks at positions 1, 2, 58, 59, 1501 and last match the board, "
        "reading only what they return"
    )
    top, _ = await _ask(r, top_and_rank, learner, 2, "tie-a")
    r.expect(
        all(isinstance(p, int) and not isinstance(p, bool) for _, p in top),
        "points come back as int",
        f"points came back as {[type(p).__name__ for _, p in top]}: return them as int",
    )
    await plain.delete(BOARD)
    await plain.zadd(BOARD, {"solo": lb.encode(3, 3), "duo": lb.encode(2, 2)})
    top, rank = await _ask(r, top_and_rank, learner, 10, "duo")
    r.expect(
        top == [("solo", 3), ("duo", 2)] and rank == 2,
        "a board of 2 asked for its top 10 gives both, and duo's rank 2",
        f"a board of 2 asked for its top 10 gave {top} and rank {rank!r}; expected [('solo', 3), ('duo', 2)] and 2",
    )


# ============================================================================ rebuild_board


class RebuildWatch:
    """Counts the rebuild's round trips and records events at the worst moments it can see."""

    def __init__(self, inject_new: Callable[[], Awaitable], inject_for: Callable[[], Awaitable], target: str) -> None:
        self.inject_new, self.inject_for, self.target = inject_new, inject_for, target
        self.writes = 0
        self.trips = 0
        self.new_done = self.target_done = False
        self.log: list[str] = []
        self.deleted_other: list[str] = []

    async def hook(self, commands, send):
        self.trips += 1
        if _writes(commands):
            self.writes += 1
            if not self.new_done:
                self.new_done = True
                self.log.append(await self.inject_new())
            if not self.target_done and _mentions(commands, self.target):
                self.target_done = True
                self.log.append(await self.inject_for())
        return await send()


@task("rebuild_board", points=4, title="rebuild the board from PostgreSQL while events arrive", timeout=60, seed=3535)
async def check_rebuild_board(r: Report, rebuild_board) -> None:
    async with lab.scratch("ch13") as ns:
        pool = await ns.pool(max_size=12)
        await lb.setup_schema(pool)
        plain = ns.redis()
        # the check's own writer gives up after 2 s on a lock, so a rebuild that locks writers out fails clearly
        writer = await ns.pool(max_size=2, fresh=True, kwargs={"autocommit": True, "options": "-c lock_timeout=2000"})
        try:
            await _check_rebuild_board(r, rebuild_board, ns, pool, writer, plain)
        finally:
            await writer.close()


async def _expected(pool) -> dict[str, int]:
    return {p: lb.encode(pts, at) for p, (pts, at) in (await _totals(pool)).items()}


def _diff(board: dict[str, int], want: dict[str, int], limit: int = 3) -> str:
    missing = [p for p in want if p not in board]
    wrong = [p for p in want if p in board and board[p] != want[p]]
    extra = [p for p in board if p not in want]
    parts = []
    if missing:
        parts.append(f"{len(missing)} player(s) missing ({', '.join(missing[:limit])})")
    if wrong:
        lower = sum(board[p] < want[p] for p in wrong)
        parts.append(
            f"{len(wrong)} with another score ({lower} lower), e.g. "
            + ", ".join(f"{p}: {_show(board[p])} instead of {_show(want[p])}" for p in wrong[:limit])
        )
    if extra:
        parts.append(f"{len(extra)} not in PostgreSQL ({', '.join(extra[:limit])})")
    return "; ".join(parts) or "identical"


async def _rebuild(r: Report, rebuild_board, pool, client):
    got = await rebuild_board(pool, client)
    if not isinstance(got, int) or isinstance(got, bool):
        r.fail(f"rebuild_board(pool, r) returned {got!r}; expected the number of players it wrote (an int)")
    return got


async def _check_rebuild_board(r: Report, rebuild_board, ns, pool, writer, plain) -> None:
    # --- a small board, lost, rebuilt ---------------------------------------------------------
    events = [_event(f"s-{i}", f"player{i % 40:02d}", 5 + (i * 7) % 50, 10 + i) for i in range(120)]
    await lb.record_batch(pool, plain, events)
    before = await _board(plain)
    await plain.flushdb()
    quiet = hooked_redis(ns.redis_url, lambda commands, send: send())
    try:
        n = await _rebuild(r, rebuild_board, pool, quiet)
    finally:
        await quiet.aclose()
    after = await _board(plain)
    r.expect(
        after == before,
        f"40 players, Redis wiped (FLUSHDB), rebuild_board: the board is the one before the loss ({n} returned)",
        f"40 players, Redis wiped (FLUSHDB), rebuild_board: the board differs from the one before the loss: "
        f"{_diff(after, before)}",
    )
    r.expect(n == 40, "it returned 40, the players written", f"it returned {n}, expected 40 (the players written)")
    if r.public:
        return

    # --- 3,000 players, lost, rebuilt while events arrive ---------------------------------------
    await lb.reset(pool, plain, BOARD)
    rng = r.random
    players = [f"p{i:05d}" for i in range(3000)]
    events = [_event(f"b-{i}", p, rng.randint(1, 400), rng.randint(0, 9000)) for i, p in enumerate(players)]
    for k in range(0, len(events), 1000):
        await lb.record_batch(pool, plain, events[k : k + 1000])
    await plain.flushdb()
    await plain.set("config:season", "spring")  # other data in the same Redis database
    await plain.zadd("leaderboard:eu", {"someone": lb.encode(1, 1)})  # another board
    seq = iter(range(10_000))

    async def inject(player: str, points: int) -> str:
        event = _event(f"live-{next(seq)}", player, points, 9500)
        try:
            await lb.record(writer, plain, event)
        except psycopg.errors.LockNotAvailable:
            r.fail(
                f"an event for {player} could not be recorded while rebuild_board ran: it waited 2 s for a lock the "
                "rebuild holds. A rebuild must not stop the game: read without locking writers out"
            )
        return f"{player} +{points}"

    await inject("early-bird", 77)  # arrived after the loss, before the rebuild
    await inject(players[10], 50)
    target = players[2345]
    watch = RebuildWatch(lambda: inject("mid-rebuild", 123), lambda: inject(target, 500), target)
    client = hooked_redis(ns.redis_url, watch.hook)
    try:
        n = await _rebuild(r, rebuild_board, pool, client)
    finally:
        await client.aclose()
    r.note(
        f"3,000 players, Redis wiped; 2 events recorded after the loss, then during the rebuild: "
        f"{', '.join(watch.log) or 'none (no write was seen)'} (a new player before the rebuild's first write; "
        f"{target} just before the write that carries its older total)"
    )
    want = await _expected(pool)
    board = await _board(plain)
    if board != want:
        reason = ""
        if "mid-rebuild" not in board or "early-bird" not in board:
            reason = (
                ". Events recorded while the rebuild ran are gone: building aside and replacing the live board "
                "(RENAME, or DEL then ZADD) throws them away; write into the live board with ZADD ... GT "
                "(or merge with ZUNIONSTORE ... AGGREGATE MAX)"
            )
        elif board.get(target, 0) < want[target]:
            reason = (
                f". {target}'s total from before its new event overwrote the newer one: the rebuild's snapshot is "
                "older than what record wrote meanwhile; use ZADD ... GT so an older (smaller) score never wins"
            )
        r.fail(f"after the rebuild the board differs from PostgreSQL: {_diff(board, want)}{reason}")
    r.ok(f"the board equals PostgreSQL: {len(want)} players, including every event that arrived meanwhile")
    r.expect(
        watch.target_done and watch.new_done,
        "(both mid-rebuild events were injected)",
        "the check never saw a write that carries a player: does rebuild_board write with the r it was given?",
    )
    r.expect(
        isinstance(n, int) and 3000 <= n <= len(want),
        f"it returned {n}",
        f"it returned {n}; expected the number of players written (between 3000 and {len(want)})",
    )
    survivors = {
        "config:season": await plain.get("config:season"),
        "leaderboard:eu": await plain.zcard("leaderboard:eu"),
    }
    r.expect(
        survivors == {"config:season": "spring", "leaderboard:eu": 1},
        "other keys in the database (config:season, the board leaderboard:eu) are untouched",
        f"other keys in the database were touched: {survivors}; rebuild only '{BOARD}' (no FLUSHDB, no KEYS+DEL)",
    )
    limit = len(players) // 50 + 20
    r.expect(
        watch.writes <= limit,
        f"{watch.writes} write round trip(s) to Redis for {len(want)} players (batched)",
        f"{watch.writes} write round trips to Redis for {len(want)} players: one per player makes a million-player "
        f"rebuild take minutes. Send many players per ZADD (it takes many score-member pairs) or pipeline them "
        f"(at most {limit} here)",
    )

    # --- again, on a board that is whole --------------------------------------------------------
    quiet = hooked_redis(ns.redis_url, lambda commands, send: send())
    try:
        await _rebuild(r, rebuild_board, pool, quiet)
    finally:
        await quiet.aclose()
    board = await _board(plain)
    r.expect(
        board == want,
        "a second rebuild on a whole board changes nothing",
        f"a second rebuild on a whole board changed it: {_diff(board, want)}",
    )


# ============================================================================ merge_top


def _shards(rng, n: int) -> list[list[tuple[str, float]]]:
    k = rng.randint(1, 5)
    shards: list[list[tuple[str, float]]] = []
    used = set()
    for s in range(k):
        size = rng.choice([0, 1, n // 2, n, n, n])
        entries = []
        for _ in range(size):
            name = f"{'abcde'[s]}{rng.randint(0, 999):03d}"
            if name in used:
                continue
            used.add(name)
            points = rng.randint(20, 26)  # few distinct points: ties across shards are common
            at = rng.choice([5, 6, 7, rng.randint(0, 100)])  # some exact ties of the whole score
            entries.append((name, float(lb.encode(points, at))))
        entries.sort(key=lambda e: (e[1], e[0]), reverse=True)
        shards.append(entries)
    return shards


def _reference_merge(shards, n):
    every = [e for s in shards for e in s]
    return sorted(every, key=lambda e: (e[1], e[0]), reverse=True)[:n]


def _fmt_entries(entries) -> str:
    try:
        return "[" + ", ".join(f"({p!r}, {lb.decode(s)[0]}@{lb.decode(s)[1]})" for p, s in entries) + "]"
    except (TypeError, ValueError):
        return repr(entries)


def _merge_hint(got, want, shards) -> str:
    try:
        return _why_merge_differs([tuple(x) for x in got], want, shards)
    except (TypeError, ValueError):
        return ""


def _why_merge_differs(got, want, shards) -> str:
    firsts = [s[0] for s in shards if s]
    if len(got) < len(want) and all(e in firsts for e in got):
        return ": that is each shard's first entry; the second of one shard can beat the first of another"
    if len(got) != len(want):
        return f": {len(got)} entries, expected {len(want)}"
    if [s for _, s in got] == [s for _, s in want]:
        return ": equal scores go in member order, descending, as ZREVRANGE orders one board"
    if sorted(got) != sorted(want):
        return ": not the n highest scores of all shards"
    points = [lb.decode(s)[0] for _, s in got]
    if points == sorted(points, reverse=True):
        return ": sorted by points alone. The score's low digits hold the tie-breaker (who got there first): compare whole scores"
    return ": the right entries in the wrong order (highest score first)"


@task("merge_top", points=3, title="global top N from the shards' local top N", timeout=20, seed=4646)
async def check_merge_top(r: Report, merge_top) -> None:
    eu = [("ana", float(lb.encode(90, 10))), ("bo", float(lb.encode(80, 5))), ("cy", float(lb.encode(70, 1)))]
    us = [("dan", float(lb.encode(95, 3))), ("eve", float(lb.encode(80, 2))), ("fay", float(lb.encode(10, 0)))]
    asia = [("gus", float(lb.encode(85, 8)))]
    shards = [eu, us, asia]
    want = _reference_merge(shards, 5)
    got = merge_top([list(s) for s in shards], 5)
    r.expect(
        _same(got, want),
        f"3 shards (eu, us, asia), n = 5: {_fmt_entries(got)} (points@time)",
        f"3 shards (eu, us, asia), n = 5 gave {got!r}, expected {_fmt_entries(want)} (points@time)"
        + _merge_hint(got, want, shards),
    )
    if r.public:
        return
    rng = r.random
    cases = 0
    for _ in range(60):
        n = rng.randint(1, 12)
        shards = _shards(rng, n)
        copies = [list(s) for s in shards]
        want = _reference_merge(shards, n)
        got = merge_top(copies, n)
        if not _same(got, want):
            r.fail(
                f"{len(shards)} shard(s) of sizes {[len(s) for s in shards]}, n = {n}: got {_fmt_entries(got)}, "
                f"expected {_fmt_entries(want)} (points@time)" + _merge_hint(got, want, shards)
            )
        if copies != shards:
            r.fail("merge_top changed the lists it was given; leave the shards' lists as they are")
        cases += 1
    r.ok(
        f"{cases} random cases (seed {r.task.seed}): shards of 0 to n entries, ties across shards, n larger than "
        "all entries: every result is the global top n"
    )
    long = [[(f"s{s}-{i:05d}", float(lb.encode(100_000 - i * 3 - s, 0))) for i in range(5000)] for s in range(3)]
    got = merge_top(long, 5000)
    r.expect(_same(got, _reference_merge(long, 5000)), "3 shards of 5,000, n = 5,000: right")


def _same(got, want) -> bool:
    try:
        return [(str(p), float(s)) for p, s in got] == [(p, float(s)) for p, s in want] and isinstance(got, list)
    except (TypeError, ValueError):
        return False
