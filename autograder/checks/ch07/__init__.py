"""Hidden checks of chapter 07: ``append_events``, ``account_projection`` and ``search_indexer``.

Races are real (several connections, two replicas of the learner's code) and the verdicts
are still the same every run: the chapter's rig (:mod:`course.chapters.ch07.rig`) holds
every write to a table inside PostgreSQL until all writers have read, then lets them
through (or lets one version through before another). Crashes are one-shot triggers
that fail the N-th write to a table, exactly once, as if the process died there.
"""

# Imported in the order the chapter's tasks are reported in.
from autograder.checks.ch07 import append, projection, search  # noqa: F401, E402
from autograder.rules import Rule

# ============================================================================= rule tables (issue 28)

RULES: dict[str, list[Rule]] = {
    "append_events": [
        Rule(
            "If the stream is at exactly that version",
            "_check_append: appends to two streams; the version compared must be the stream's own",
            "global-max",
        ),
        Rule(
            "insert the events as versions `expected_version + 1`",
            "_check_append: appends and reads back every stream; versions must be 1..n with no gap",
            "global-max",
        ),
        Rule(
            "Otherwise raise `ConcurrencyConflict(stream_id, expected_version, actual)`",
            "_check_append: a stale or future expected version must raise ConcurrencyConflict and write nothing",
            "ignores-expected-version",
        ),
        Rule(
            "and return the new version",
            "_check_append: the value returned by each append is compared with the stream's last version",
            "returns-expected-version",
        ),
        Rule(
            "This includes an expected version **behind** the stream",
            "_check_append: a stale expected version must raise ConcurrencyConflict and write nothing",
            "ignores-expected-version",
        ),
        Rule(
            "the stream, **ahead** of it",
            "_check_append: a future expected version (a gap) must raise ConcurrencyConflict and write nothing",
            "trusts-expected-version",
        ),
        Rule(
            "and a writer that loses a race",
            "_check_append: 8 writers with one expected version on two replicas, every insert held in PostgreSQL "
            "until all have read (gated); one wins, seven raise ConcurrencyConflict",
            "read-then-insert",
        ),
        Rule(
            "if any insert fails, no event of the call may stay",
            "_check_append: the database fails the second insert of a 3-event append; nothing may stay",
            "not-atomic",
        ),
        Rule(
            "on two replicas of your function",
            "_check_append: the 8 writers are split over two replicas, so a lock in one process does not hold",
            "process-lock",
        ),
    ],
    "account_projection": [
        Rule(
            "skip events at or below it",
            "_check_projection: the same batch again, and an overlapping one, must apply each event once",
            "no-skip",
        ),
        Rule(
            "set it to the position of the last event applied, **in the same transaction** as the balance changes",
            "_check_projection: a crash at the checkpoint write, and one at a balance write, then a redelivery",
            "checkpoint-outside-transaction",
        ),
        Rule(
            "**in the same transaction** as the balance changes",
            "_check_projection: the crash at the second balance write, after a checkpoint committed first",
            "checkpoint-committed-first",
        ),
        Rule(
            "lock the checkpoint row",
            "_check_projection: one batch to two replicas, both held in PostgreSQL until both have read (gated)",
            "no-checkpoint-lock",
        ),
        Rule(
            "or go to **two replicas** of your function",
            "_check_projection: the two replicas share no module state",
            "seen-set-in-memory",
        ),
        Rule(
            "If something fails, raise",
            "_check_projection: an injected crash must reach the caller (the broker then redelivers)",
            "swallows-errors",
        ),
        Rule(
            "empties `account_balances` and resets the checkpoint to 0",
            "_check_projection: the rebuild must give the same rows as the incremental run",
            "rebuild-without-reset",
        ),
        Rule(
            "resets the checkpoint to 0 (one transaction)",
            "_check_projection: a rebuild crashed at its first write to account_balances, and one crashed at its "
            "checkpoint reset, must leave rows that match the checkpoint",
            "rebuild-in-two-statements",
        ),
        Rule(
            "or retry the whole rebuild until it finishes",
            "_check_projection: a rebuild crashed at its emptying, and one at its reset, must raise (or finish the "
            "rebuild by retrying); returning early without raising is a swallowed crash",
            "rebuild-swallows-errors",
        ),
        Rule(
            "in position order through `apply_events`",
            "_check_projection: the check rewrites every AccountOpened in place first, so a scan without ORDER BY "
            "returns it after the deposits; the rebuild must still match the incremental run",
            "rebuild-no-order",
        ),
        Rule(
            "and returns how many it applied",
            "_check_projection: rebuild_balances() must return the number of events and leave the checkpoint at "
            "the last position",
            "rebuild-returns-none",
        ),
        Rule(
            "applies a batch of events to the read model",
            "_check_projection: the rows of account_balances are compared with the fold of every stream",
            "no-skip",
        ),
        Rule(
            "version is the version of the last event applied to that account",
            "_check_projection: each row's balance and version are compared with the fold of its stream",
            "no-skip",
        ),
        Rule(
            "The hidden checks deliver overlapping batches",
            "_check_projection: runs the scenarios this sentence lists, each against its kept wrong answer",
            "checkpoint-outside-transaction",
        ),
    ],
    "search_indexer": [
        Rule(
            "Apply it only if its `version` is **newer** than the indexed one",
            "_check_search: v4, then a late v3; the index must stay at v4",
            "last-write-wins",
        ),
        Rule(
            "events arrive again and out of order, from two replicas at once",
            "_check_search: v3 and v2 of an indexed document on two replicas, both read before either writes, v3 "
            "let through first (gated)",
            "read-then-write",
        ),
        Rule(
            "Make the comparison part of the write",
            "_check_search: the FIRST insert of a document raced both ways on two replicas behind the version "
            "gate (v2 first, then v3; and the reverse); issue 35",
            "update-then-insert-nothing",
        ),
        Rule(
            "store title, body, `deleted = false` and `tsv`",
            "_check_search: the rows whose tsv matches 'decoding' are read from search_documents",
            "tsv-at-query-time",
        ),
        Rule(
            "late, older upsert is recognised as older",
            "_check_search: the v5 delete delivered again after v6 must be ignored",
            "tombstone-keeps-old-version",
        ),
        Rule(
            "keep the row as a **tombstone**",
            "_check_search: a delete (v5), then a late v4 must not bring the document back",
            "delete-the-row",
        ),
        Rule(
            "the event's version, empty words",
            "_check_search: after a delete (v5) the row must hold version 5, deleted = true and an empty tsv",
            "tombstone-keeps-old-version",
        ),
        Rule(
            "the event's version, empty words: `tsv` = `''`",
            "_check_search: after a delete (v5) the row's tsv must be empty",
            "tombstone-keeps-words",
        ),
        Rule(
            "If the write fails, raise",
            "_check_search: the database fails one write of index_event (injected); the error must reach the "
            "caller, or index_event must retry until the event is applied",
            "swallows-errors",
        ),
        Rule(
            "returns the `doc_id`s of documents that are\nnot deleted",
            "_check_search: a row the check writes with deleted = true and words in tsv must not be returned",
            "search-shows-deleted",
        ),
        Rule(
            "not deleted and whose `tsv` matches `websearch_to_tsquery('english', query)`",
            "_check_search: 'snapshot -vacuum' must exclude the document that mentions vacuum",
            "plainto-tsquery",
        ),
        Rule(
            "whose `tsv` matches `websearch_to_tsquery('english', query)`",
            "_check_search: 'slot' must find a document about 'slots' (English stemming)",
            "simple-config",
        ),
        Rule(
            "best first by `ts_rank(tsv, query)`",
            "_check_search: a title match must rank above a body match (weights A and B)",
            "unweighted",
        ),
        Rule(
            "`ts_rank(tsv, query)` (ties by `doc_id`)",
            "_check_search: four documents of equal rank, indexed out of order, must come back by doc_id",
            "search-no-tiebreak",
        ),
        Rule(
            "`async def search_docs(pool, query, limit=10) -> list[str]` returns the `doc_id`s",
            "_check_search: search_docs(..., limit=1) must return one doc_id",
            "search-ignores-limit",
        ),
        Rule(
            "The hidden checks index, update, redeliver",
            "_check_search: runs the scenarios this sentence lists, each against its kept wrong answer",
            "last-write-wins",
        ),
    ],
}

#: The course's own answers: a learner who only calls one of these earns nothing for the task.
REFERENCES: dict[str, list[str]] = {
    "append_events": ["course.eventstore:append"],
    "account_projection": ["course.projections:apply_events", "course.projections:rebuild_balances"],
    "search_indexer": ["course.search:index_event", "course.search:search"],
}

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 2
