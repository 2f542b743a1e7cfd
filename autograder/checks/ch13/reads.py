"""Hidden checks of ``top_and_rank``: the top N and a player's 1-based rank."""

from __future__ import annotations

from autograder.checks.ch13.rig import (
    BOARD,
    _leaves,
)
from autograder.harness import Report, task
from autograder.probes import hooked_redis
from course import leaderboard as lb
from course.kit import lab


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
