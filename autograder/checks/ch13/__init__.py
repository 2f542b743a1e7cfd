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

#: The course's own reference implementation of each task (issue 26): while a task is graded,
#: a learner's answer that is, wraps or calls one of these earns nothing for it. The checks
#: themselves may still use them as rigs.
REFERENCES: dict[str, list[str]] = {
    "record_score": ["course.leaderboard:record"],
    "top_and_rank": ["course.leaderboard:top_and_rank"],
    "rebuild_board": ["course.leaderboard:rebuild"],
    "merge_top": ["course.leaderboard:merge_top"],
}
