"""Hidden checks of chapter 05 (messaging under failure): ``ordered_consumer`` and ``replay_key``.

Every verdict is read from the servers: the rows the check's handler committed (the applied
order), the dead-letter stream, ``XPENDING``, the consumer's tables. Failures are injected
per message (a transient error for the first attempts, a permanent one, a kill), and time
is the check's own: the injected ``sleep`` records every backoff and returns at once (or
waits, in the head-of-line scenario, until the check has seen the other keys finish), the
injected ``clock`` moves only by those sleeps, and ``rand`` is seeded.

A kill is a process death made deterministic: :class:`ConsumerKilled` is raised at a named
point (inside the handler before or after its change, at the consumer's next Redis command
after the commit, right after the XACK), and from then on that replica's Redis client and
handler refuse to work, its leftover tasks are cancelled and its pool is closed, so its open
transaction rolls back. A second replica (the learner's answer cell run again) takes over.

``RULES`` (issue 28): every requirement of each task's text, where it is checked, and the kept
wrong answer (``WRONG`` in ``tests/test_05_grading.py``) rejected for it.
"""

# The consumer's task registers first, then the replay's: the order selfcheck reports them in.
from autograder.checks.ch05 import consumer, replay  # noqa: F401, E402
from autograder.rules import Rule

RULES: dict[str, list[Rule]] = {
    "ordered_consumer": [
        Rule(
            'until the cursor is `"0-0"`',
            "_crash: not graded: fewer than 100 entries are ever pending, which one XAUTOCLAIM call claims; the "
            "text says so",
            not_graded=True,
        ),
        Rule(
            "Run `XAUTOCLAIM stream group consumer claim_idle_ms <cursor>`",
            "_crash: a killed replica's pending entries must be claimed by the second replica and applied once, "
            "in order",
            "no-takeover",
        ),
        Rule(
            "until a read returns nothing and every entry you took is finished",
            "expect_clean_run: the consumer must return, with every entry applied and acknowledged (XPENDING empty)",
            "new-before-claimed",
        ),
        Rule(
            "insert the entry into `mq_parked` and do nothing else",
            "_dead_letters: P-2, X-2, P-3 must be in mq_parked with their fields, not applied, not in mq_processed",
            "park-also-processed",
        ),
        Rule(
            "call `handle(conn, fields)` only if the insert returned a row",
            "_basic: A-1 and B-2 delivered twice must be applied once each; _crash: a second replica applies once",
            "in-memory-dedup",
        ),
        Rule(
            "Steps 2 and 3 run in one transaction",
            "_crash: (after change) a kill between the change and the commit rolls back both, so the takeover "
            "applies the message once",
            "dedup-in-its-own-commit",
        ),
        Rule(
            "at most `policy.max_attempts` attempts in all",
            "_dead_letters: X-1 always times out; it must be attempted exactly max_attempts times",
            "unbounded-attempts",
        ),
        Rule(
            "`await sleep(rand() * min(cap, base * 2**k))`",
            "expect_jitter: the sleeps are compared with the seeded rand() draws times min(cap, base * 2**k)",
            "no-jitter",
        ),
        Rule(
            "when the error is not retryable",
            "_dead_letters: P-1 raises MalformedMessage (permanent); it must be attempted once and dead-lettered",
            "retries-permanent-errors",
        ),
        Rule(
            "`XADD` to `dlq` the dict",
            "_expect_dead_letters: each dead letter is read field by field (original fields, source, attempts, "
            "first/last failure times, error, error_type, reason)",
            "dlq-without-metadata",
        ),
        Rule(
            "**Block the key** after its dead letter",
            "_dead_letters: P's and X's later messages must be parked, not applied; the block row is read field "
            "by field",
            "key-not-blocked",
        ),
        Rule(
            "`fields` (as `Jsonb(fields)`) and `reason`",
            "_expect_dead_letters: the block row's fields must equal the entry's fields as read",
            "block-without-fields",
        ),
        Rule(
            "only after the entry's commit",
            "expect_ack_after_commit: every XACK (applied, duplicate, parked, dead-lettered) must come after the "
            "entry's commit; _crash (before ack / after ack) kills around it",
            "ack-inside-transaction",
        ),
        Rule(
            "one key's entries one at a time, in stream order",
            "expect_order: each key's applied order; with expect_no_overlap: no two entries of a key at once",
            "all-entries-at-once",
        ),
        Rule(
            "different keys run concurrently",
            "_retries: R-1's first backoff is held until S and T are seen to finish (gated, not timed); "
            "this scenario is 40% of the points",
            "whole-stream-serial",
        ),
        Rule(
            "including entries read by a later `XREADGROUP`",
            "_retries: the other keys' entries come in later reads while R-1 waits",
            "batch-waits-for-batch",
        ),
        Rule(
            "one key's retry never holds another key's message",
            "_retries: R-2 and R-3 must not be applied while R-1 waits for its retry",
            "retry-queue-reorders",
        ),
        Rule(
            "never catch it (nor `BaseException`)",
            "_crash: a ConsumerKilled swallowed keeps a dead replica working; its XACK or change then lands after "
            "the takeover and the applied order shows it",
            "catches-kill",
        ),
        Rule(
            "never catch it (nor `BaseException`)",
            "expect_clean_run: the task a kill was raised in must send no Redis command after it (the dead "
            "replica's client records who asks)",
            "catches-base-exception",
        ),
        Rule(
            "lookup of step 2 runs inside it is not graded",
            "_crash: not graded: one consumer parks a key's entries after its own block, so nothing the checks "
            "read differs; the text says so",
            not_graded=True,
        ),
        Rule(
            "of the (existing) group `group`, then returns",
            "expect_clean_run: the consumer must return, with every entry (the killed replica's pending ones "
            "included) applied and acknowledged",
            "no-takeover",
        ),
        Rule(
            "applies one message on your connection, inside your transaction, and raises when it fails",
            "_crash: (after change) a kill inside handle after its change must roll back with the dedup row, so the "
            "takeover applies the message once",
            "dedup-in-its-own-commit",
        ),
        Rule(
            "Use `sleep` only for these waits",
            "expect_jitter: the sleeps are compared with the seeded rand() draws; _expect_dead_letters reads the "
            "failure times from clock()",
            "no-jitter",
        ),
        Rule(
            "What the hidden checks do (partial credit, one share per scenario",
            "weight: each scenario's share of the points; the retries scenario (other keys never wait) weighs 40%",
            "whole-stream-serial",
        ),
        Rule(
            "a malformed message and one that always times out, among healthy ones",
            "_dead_letters: P-1 malformed, X-1 always timing out: attempts, dead letters, blocks and parked rows",
            "dlq-without-metadata",
        ),
        Rule(
            "four kills (7.5% each)",
            "_crash: a kill inside handle before and after its change, after the commit, and after the XACK",
            "no-takeover",
        ),
        Rule(
            "a second replica (this cell run again into fresh globals) takes over",
            "_crash: the second replica must claim the dead one's pending entries and apply them once, in order",
            "no-takeover",
        ),
        Rule(
            "the checks make the killed replica's pending entries look idle for an hour",
            "_crash: before replica b starts, the dead replica's pending entries are XCLAIMed with IDLE 3600000, so "
            "claim_idle_ms never keeps them from the takeover; the text says the owner lease is not graded",
            not_graded=True,
        ),
        Rule(
            "check that every XACK came after its commit",
            "expect_ack_after_commit: every XACK must come after its entry's commit",
            "ack-before-work",
        ),
    ],
    "replay_key": [
        Rule(
            "do nothing and return 0",
            "_replay_twice: a second replay from another replica must call handle for nothing and return 0",
            "not-blocked-returns-none",
        ),
        Rule(
            "the dead-lettered message (its `fields` are in the block row), then",
            "_expect_replayed: P-1 must be applied before P-2..P-12",
            "parked-first",
        ),
        Rule(
            "order by them as two numbers",
            "_expect_replayed: P-10, P-11, P-12 must come after P-9 (text order puts 1-10 before 1-9)",
            "text-order",
        ),
        Rule(
            "call `await handle(conn, fields)` only when the insert returned a row",
            "_expect_replayed: P-3 is parked twice and must be applied once",
            "without-dedup",
        ),
        Rule(
            "Then delete the key's parked rows and its block row.",
            "_expect_replayed: mq_parked and mq_blocked_keys must hold nothing of P afterwards",
            "leaves-parked",
        ),
        Rule(
            "Unblock only after (or in the same transaction as) the last parked message",
            "_replay_basic: while each message is applied, the ReplayHandler's watcher reads whether P's block row is still committed",
            "unblock-first",
        ),
        Rule(
            "delete the dead letter from `dlq`",
            "_expect_replayed: the dead-letter stream must no longer hold P-1",
            "keeps-dead-letter",
        ),
        Rule(
            "After that is committed, delete the dead letter",
            "_replay_basic: at each XDEL the replay's Redis client asks another connection whether P's block row is "
            "still committed",
            "xdel-before-commit",
        ),
        Rule(
            "every `mq_parked` row of `(stream, key)` **in stream order**",
            "_blocked_world: the parked rows are written back out of stream order (parked_at follows that order), "
            "and key P is parked in another stream too",
            "parked-at-order",
        ),
        Rule(
            "let the error through and leave the key as it was",
            "_replay_not_fixed: P-1 still fails: nothing of P applied, P still blocked, its parked messages and its "
            "dead letter kept",
            "skips-failures",
        ),
        Rule(
            "returns how many messages it applied",
            "_replay_basic: the replay of P-1..P-12 (P-3 parked twice) must return 12",
            "counts-rows-read",
        ),
        Rule(
            "The hidden checks block a key with a dead letter",
            "_replay_basic: the first replay, in order and once, is 40% of the points; _replay_twice, "
            "_replay_not_fixed and _replay_crash 20% each",
            "parked-first",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {
    "ordered_consumer": ["course.messaging:ordered_consumer"],
    "replay_key": ["course.messaging:replay_key"],
}

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 2
