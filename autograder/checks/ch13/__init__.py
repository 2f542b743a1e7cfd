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

# Imported in the order the chapter's tasks are reported in.
from autograder.checks.ch13 import merge, reads, rebuild, record  # noqa: F401, E402
from autograder.rules import Rule  # noqa: E402

RULES: dict[str, list[Rule]] = {
    "record_score": [
        Rule(
            "applies one score event",
            "_check_record_score: one event delivered six times at once through two replicas: applied once",
            "dedup-row-written-not-consulted",
        ),
        Rule(
            "however many times and however concurrently it is delivered",
            "_check_record_score: the six deliveries are split over two replicas (module state is not shared)",
            "in-process-seen-set",
        ),
        Rule(
            "deliver one event six times at once through two replicas of your answer",
            "_check_record_score: one event delivered six times at once, split over two replicas of the cell",
            "in-process-seen-set",
        ),
        Rule(
            "holding every insert into `leaderboard_events` in PostgreSQL until all six deliveries got that far",
            "_check_record_score: the six deliveries wait in PostgreSQL at their insert (a trigger on a closed "
            "gate) until all are parked, so a look-up before the insert finds the event absent every run",
            "check-then-insert",
        ),
        Rule(
            "state kept in module variables is not shared",
            "_check_record_score: the six deliveries alternate between two replicas, each with its own module "
            "state; a per-process lock lets one through in each, and both find the event new",
            "check-then-insert-under-a-lock",
        ),
        Rule(
            "Record each applied event in `leaderboard_events`",
            "_check_record_score: after Redis is wiped (FLUSHDB) an old event delivered again must not count "
            "again: the dedup record lives in PostgreSQL with the points",
            "dedup-in-redis",
        ),
        Rule(
            "is the **latest** `at` among the player's events",
            "_check_record_score: a player's events delivered out of time order",
            "reached-at-of-last-delivery",
        ),
        Rule(
            "with the score `encode(points, reached_at)` of the total in PostgreSQL",
            "_check_record_score: ada's board score is compared with encode(30, 100); ties go to who reached first",
            "raw-points-ties-by-name",
        ),
        Rule(
            "with the score `encode(points, reached_at)` of the total in PostgreSQL",
            "_check_record_score: cy's board score after its second (sequential) event must be encode(15, 500)",
            "zadd-nx",
        ),
        Rule(
            "The board must never go backwards",
            "_check_record_score: five events of one player at once, their board writes held and released in "
            "reverse (highest score first; gated)",
            "stale-write-overwrites",
        ),
        Rule(
            "even when two events of one player are written at the same time",
            "_check_record_score: the same held writes; a ZINCRBY of deltas races on the player's first event",
            "zincrby-deltas-first-event-race",
        ),
        Rule(
            "of the total in PostgreSQL",
            "_check_record_score: after FLUSHDB, a new event must put the player's whole total on the board",
            "zincrby-deltas-do-not-heal",
        ),
        Rule(
            "Return True when the event was applied, False when it was a duplicate",
            "_check_record_score: the first delivery must return True, the same event again False",
            "always-true",
        ),
    ],
    "top_and_rank": [
        Rule(
            "that reads the board `BOARD` and returns",
            "_check_top_and_rank: the top and the ranks are compared with ZREVRANGE and ZREVRANK of BOARD",
            "ascending",
        ),
        Rule(
            "the best `n` players (`n >= 1`), best first",
            "_check_top_and_rank: the top is compared with ZREVRANGE of the board",
            "ascending",
        ),
        Rule(
            "`points` the **int** `decode(score)[0]` (not the encoded score)",
            "_check_top_and_rank: the points returned must be ints equal to decode(score)[0]",
            "encoded-points",
        ),
        Rule(
            "`player`'s **1-based** rank (the best player is 1)",
            "_check_top_and_rank: ranks of the best player and others on a board of 2,000",
            "zero-based-rank",
        ),
        Rule(
            "or None when the player is not on the board",
            "_check_top_and_rank: a player who is not on the board must get None",
            "missing-is-zero",
        ),
        Rule(
            "Both follow the board's order, which already encodes the tie rule",
            "_check_top_and_rank: players with equal points: the earlier achiever first, and distinct ranks",
            "ties-by-name",
        ),
        Rule(
            "which already encodes the tie rule",
            "_check_top_and_rank: equal points get distinct ranks, in the board's order",
            "shared-ranks",
        ),
        Rule(
            "Read only what you return",
            "_check_top_and_rank: the values every round trip brings back from Redis are counted",
            "whole-board",
        ),
    ],
    "rebuild_board": [
        Rule(
            "The game does not stop while you rebuild",
            "_check_rebuild_board: the check records events through course.leaderboard.record during the rebuild",
            "locks-writers",
        ),
        Rule(
            "the checks record events during your rebuild, with a 2-second lock timeout",
            "_check_rebuild_board: the check's writer runs with a 2-second lock timeout while the rebuild runs",
            "locks-writers",
        ),
        Rule(
            "it must never lose a player or lower a score",
            "look: RebuildWatch.look reads the board's size and a spread sample after each write round trip",
            "delete-first-then-read",
        ),
        Rule(
            "the board must equal PostgreSQL, **including** the events that arrived during it",
            "_check_rebuild_board: events recorded just before the first write and just before the write of a "
            "player's older total",
            "delete-then-load",
        ),
        Rule(
            "do not replace the board (no `RENAME` over it, no `DEL` and reload)",
            "look: RebuildWatch.look, a reader reads the board's size and a spread sample after each write round trip",
            "delete-first-then-read",
        ),
        Rule(
            "no `RENAME` over it",
            "look: RebuildWatch.look, the RENAME's round trip drops the players that arrived meanwhile",
            "aside-then-rename",
        ),
        Rule(
            "never lower a score that is there",
            "look: RebuildWatch.look and the final board: a ZADD without GT writes the older total of a player",
            "plain-zadd",
        ),
        Rule(
            "do not lock the writers out",
            "_check_rebuild_board: the check's own writer has a 2-second lock timeout during the rebuild",
            "locks-writers",
        ),
        Rule(
            "a scratch key of your own is fine if you delete it before you return",
            "_check_rebuild_board: the keys in Redis after the rebuild, besides the board, must be the ones before it",
            "scratch-key-left-behind",
        ),
        Rule(
            "all of it, or only its latest writes",
            "_check_rebuild_board: the second rebuild finds 5 players one point behind PostgreSQL and must raise them",
            "zadd-nx",
        ),
        Rule(
            "touch no other key",
            "_check_rebuild_board: config:season and leaderboard:eu are read after the rebuild; FLUSHDB is seen "
            "by the reader",
            "flushdb",
        ),
        Rule(
            "The checks allow one write round trip per 50 players",
            "hook: RebuildWatch.hook, write round trips are counted",
            "one-zadd-per-player",
        ),
        Rule(
            "returns how many players it wrote",
            "_rebuild: the return value must be an int between 3,000 and the players in PostgreSQL",
            "returns-nothing",
        ),
    ],
    "merge_top": [
        Rule(
            "Write `def merge_top(local_tops, n) -> list[tuple[str, float]]`",
            "check_merge_top: called directly (no server) on 60 seeded random cases; must return the list of the "
            "global top n pairs",
            "first-of-each-shard",
        ),
        Rule(
            "(a plain function, no I/O)",
            "check_merge_top: called directly with no server and no await; an awaitable result is refused",
            "async-merge",
        ),
        Rule(
            "Return the global top `n` in the same shape and order",
            "check_merge_top: 60 seeded random cases compared with ZREVRANGE of one board",
            "first-of-each-shard",
        ),
        Rule(
            "exactly what `ZREVRANGE` would return from one board holding every player",
            "check_merge_top: equal scores across shards must come in descending member order",
            "ties-by-name-ascending",
        ),
        Rule(
            "`(member, score)` pairs, highest score first",
            "check_merge_top: many equal points; the encoded score, not the points alone, decides",
            "points-only",
        ),
        Rule(
            "in the same shape and order",
            "check_merge_top: shards of different sizes; taking one from each in turn is not a merge",
            "round-robin",
        ),
        Rule(
            "Do not change the lists you are given",
            "check_merge_top: the shards' lists are compared with copies after each call",
            "empties-the-lists",
        ),
    ],
}

#: The course's own answers: a learner who only calls one of these earns nothing for the task.
REFERENCES: dict[str, list[str]] = {
    "record_score": ["course.leaderboard:record", "course.leaderboard:record_batch"],
    "top_and_rank": ["course.leaderboard:top_and_rank", "course.leaderboard:top", "course.leaderboard:rank"],
    "rebuild_board": ["course.leaderboard:rebuild"],
    "merge_top": ["course.leaderboard:merge_top"],
}

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 2
