"""Hidden checks of ``rebuild_board``: the board rebuilt from PostgreSQL while events arrive."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import psycopg

from autograder.checks.ch13.rig import (
    BOARD,
    _board,
    _event,
    _mentions,
    _name,
    _show,
    _totals,
    _writes,
)
from autograder.harness import Report, task
from autograder.probes import hooked_redis
from course import leaderboard as lb
from course.kit import lab
from course.leaderboard import (
    record as course_record,
)  # bound now: in the kernel the references raise while a check runs (autograder/references.py)

WATCHED = 40  # players a reader looks up after each write round trip, besides the board's size
BEHIND = 5  # players a second rebuild finds behind PostgreSQL on the board (a replica that had not caught up)


class RebuildWatch:
    """Counts the rebuild's round trips, records events at the worst moments it can see, and reads
    the board after every write round trip, as a reader of the live board would, DURING the rebuild."""

    def __init__(
        self,
        plain,
        inject_new: Callable[[], Awaitable] | None = None,
        inject_for: Callable[[], Awaitable] | None = None,
        target: str = "",
    ) -> None:
        self.plain = plain
        self.inject_new, self.inject_for, self.target = inject_new, inject_for, target
        self.writes = 0
        self.trips = 0
        self.new_done = self.target_done = inject_new is None
        self.log: list[str] = []
        self.seen: dict[str, float] = {}  # what a reader has seen on the board so far
        self.shrank: str | None = None  # the first time a reader saw a player vanish or drop

    async def start(self) -> None:
        board = await self.plain.zrange(BOARD, 0, -1, withscores=True)
        step = max(1, len(board) // WATCHED)  # a spread sample keeps a one-ZADD-per-player rebuild cheap to watch
        self.seen = dict(board[::step])
        self.card = len(board)
        if self.target:
            self.seen.setdefault(self.target, 0.0)

    async def hook(self, commands, send):
        self.trips += 1
        writes = _writes(commands)
        if writes:
            self.writes += 1
            if not self.new_done:
                self.new_done = True
                self.log.append(await self.inject_new())
                self.seen.setdefault("mid-rebuild", 0.0)
            if not self.target_done and _mentions(commands, self.target):
                self.target_done = True
                self.log.append(await self.inject_for())
        result = await send()
        if writes and self.shrank is None:
            await self.look(commands)
        return result

    async def look(self, commands) -> None:
        members = list(self.seen)
        pipe = self.plain.pipeline(transaction=True)
        pipe.zcard(BOARD)
        pipe.zmscore(BOARD, members)
        card, scores = await pipe.execute()
        now = {m: s for m, s in zip(members, scores, strict=True) if s is not None}
        gone = [m for m in members if m not in now and self.seen[m] > 0]
        lower = [m for m in members if m in now and now[m] < self.seen[m]]
        shrunk = card < self.card
        if gone or lower or shrunk:
            seen = []
            if shrunk:
                seen.append(f"the board shrink from {self.card} to {card} player(s)")
            elif gone:
                seen.append(f"{len(gone)} player(s) it had shown gone from the board")
            if lower:
                seen.append(f"{len(lower)} player(s) with a lower score than before")
            causes = []
            if shrunk or gone:
                causes.append(
                    "players gone: a DEL (or UNLINK, or FLUSHDB) of the board before reloading it, or a RENAME of "
                    "a board built aside over it; write into the live board instead"
                )
            if lower:
                causes.append(
                    "a lower score: a ZADD without GT wrote an older total over a newer one; use ZADD ... GT so an "
                    "older (smaller) score never wins"
                )
            names = " ".join(sorted({_name(a) for a in commands}))
            self.shrank = (
                f"after your write round trip {self.writes} ({names}) a reader saw {' and '.join(seen)}. Readers "
                "of the live board must never see it lose a player or a score while it is rebuilt. Likely cause of "
                + "; of ".join(causes)
            )
        for m, score in now.items():
            self.seen[m] = max(score, self.seen[m])
        self.card = max(self.card, card)


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
            await course_record(writer, plain, event)
        except psycopg.errors.LockNotAvailable:
            r.fail(
                f"an event for {player} could not be recorded while rebuild_board ran: it waited 2 s for a lock the "
                "rebuild holds. A rebuild must not stop the game: read without locking writers out"
            )
        return f"{player} +{points}"

    await inject("early-bird", 77)  # arrived after the loss, before the rebuild
    await inject(players[10], 50)
    target = players[2345]
    keys_before = set(await plain.keys("*"))
    watch = RebuildWatch(plain, lambda: inject("mid-rebuild", 123), lambda: inject(target, 500), target)
    await watch.start()
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
    if watch.shrank:
        r.fail(f"3,000 players rebuilt while events arrive: {watch.shrank}")
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
    left = sorted(set(await plain.keys("*")) - keys_before - {BOARD})
    r.expect(
        not left,
        "it left no key behind",
        f"after the rebuild Redis holds {len(left)} key(s) it did not hold before: {', '.join(map(repr, left[:3]))}. "
        "A scratch key of your own (a board built aside to merge from) must be deleted before rebuild_board "
        "returns; better, write into the live board with ZADD ... GT and need none",
    )
    limit = len(players) // 50 + 20
    r.expect(
        watch.writes <= limit,
        f"{watch.writes} write round trip(s) to Redis for {len(want)} players (batched)",
        f"{watch.writes} write round trips to Redis for {len(want)} players: one per player makes a million-player "
        f"rebuild take minutes. Send many players per ZADD (it takes many score-member pairs) or pipeline them "
        f"(at most {limit} here)",
    )

    # --- again, on a board that is whole but a few players behind (a replica that had not caught up
    # took over), with a reader watching after every write ----------------------------------------
    behind = sorted(p for p in players if lb.decode(want[p])[0] >= 2)[: BEHIND * 97 : 97][:BEHIND]
    stale = {p: lb.encode(lb.decode(want[p])[0] - 1, lb.decode(want[p])[1]) for p in behind}
    await plain.zadd(BOARD, stale, xx=True)
    watch = RebuildWatch(plain)
    await watch.start()
    quiet = hooked_redis(ns.redis_url, watch.hook)
    try:
        await _rebuild(r, rebuild_board, pool, quiet)
    finally:
        await quiet.aclose()
    r.note(
        f"a second rebuild, on a board that is whole but has {len(stale)} players one point behind PostgreSQL "
        f"({', '.join(behind)}: a replica that had not caught up took over)"
    )
    r.expect(
        watch.shrank is None,
        f"a second rebuild: a reader after each of its {watch.writes} write round trip(s) "
        "never saw a player vanish or a score drop",
        f"a second rebuild: {watch.shrank}",
    )
    board = await _board(plain)
    still = [p for p in behind if board.get(p, 0) < want[p]]
    r.expect(
        board == want,
        f"a second rebuild brings the {len(stale)} players that were behind up to PostgreSQL and changes nothing else",
        f"after a second rebuild the board differs from PostgreSQL: {_diff(board, want)}"
        + (
            f". {len(still)} of the {len(stale)} players that were behind PostgreSQL stayed behind: ZADD ... NX "
            "only adds players that are not on the board; GT also raises a lower score"
            if still
            else ""
        ),
    )
