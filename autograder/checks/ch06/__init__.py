"""Hidden checks of chapter 06: ``order_saga`` and ``outbox_relay``.

Crashes are deterministic: a trigger counts the writes the learner's code makes to the
saga's tables (or the outbox) and, armed at ``k``, fails the k-th write and every later
one, so the process "dies" just before that write (:mod:`course.chapters.ch06.crashes`).
The check visits every ``k`` of a run (one order per ``k``, several orders at once, each
crashing at its own write), then starts a fresh replica of the answer (a new process: no
memory of the old one) and runs the recovery. Transient failures are SQLSTATE
40001 on a refund or a stock return. Races are made to happen every time: a relay is
held at its first publish until the second relay has finished or is blocked in
PostgreSQL; two recoverers are held at the stock row until both are blocked or done.
The verdicts read the servers: the services' tables, ``saga_log``, the outbox, the stream.
"""

# Imported in the order the chapter's tasks are reported in.
from autograder.checks.ch06 import outbox, saga  # noqa: F401, E402
from autograder.rules import Rule

# ----------------------------------------------------------------------------- rule tables (issue 28)

RULES: dict[str, list[Rule]] = {
    "order_saga": [
        Rule(
            "Each undoes its step",
            "_check_saga: a declined and an unshippable order must end compensated, stock and money given back",
            "blind-refund",
        ),
        Rule(
            "in **one local transaction** on its own",
            "_check_saga: the refund's give-back fails transiently after its status moved; in two transactions "
            "the retry finds the row moved and the wallet stays short",
            "split-refund",
        ),
        Rule(
            "A second call changes nothing",
            "_check_saga: each compensation called twice on a completed order gives back once",
            "non-idempotent-release",
        ),
        Rule(
            "a call for a step that never ran changes nothing",
            "_check_saga: each compensation on an order whose steps never ran moves no stock and no money",
            "blind-refund",
        ),
        Rule(
            "two processes calling it at once give back once",
            "_two_recoverers: two recover_sagas held at the stock row until both are blocked or done",
            "check-then-release",
        ),
        Rule(
            "`(saga_id, 'saga', 'begin', Jsonb(order))` before anything else",
            "_check_saga: a crash before each write, then recover_sagas() in a new process; without the begin row "
            "the order is left half-done",
            "no-log",
        ),
        Rule(
            "compensate **every step that was started, the failed one included, in reverse order**",
            "_check_saga: the unshippable order's services must see the refund before the stock release",
            "wrong-order",
        ),
        Rule(
            "A compensation that raises is retried",
            "_check_saga: the refund fails with 40001; a saga that lets it end the run is rejected",
            "no-retry",
        ),
        Rule(
            "until it succeeds, never skipped",
            "_check_saga: the refund fails REFUND_FAILURES (6) times in a row; giving up after a fixed number of "
            "tries, or skipping it, leaves the order half-done",
            "gives-up-after-three",
        ),
        Rule(
            "Then log `('saga', 'compensated')` and return `'compensated'`",
            "_expect_end: run_order_saga's return value, the services and the last saga_log row must agree",
            "skips-failed-compensation",
        ),
        Rule(
            "log `('saga', 'completed')` and return `'completed'`",
            "_expect_end: an accepted order returns 'completed' and its log ends with (saga, completed)",
            "no-log",
        ),
        Rule(
            "Find every saga whose log has a `('saga', 'begin')` row and no final row",
            "_check_saga: recover_sagas() in a fresh replica (module state gone) must finish every crashed saga",
            "in-memory-log",
        ),
        Rule(
            "go on compensating (every started step not yet compensated, in reverse order)",
            "_check_saga: crashes inside the compensation (the in-flight step committed, not yet logged done) "
            "must still be undone",
            "backward-skips-in-flight",
        ),
        Rule(
            "Return the saga ids it finished",
            "_check_saga: after each kind's crashes recover_sagas() must return the ids of the unfinished sagas; "
            "run again it returns []",
            "recover-returns-nothing",
        ),
        Rule(
            "a second run changes nothing",
            "_check_saga: recover_sagas() run again over every order changes no service row",
            "non-idempotent-release",
        ),
        Rule(
            "use it, never `asyncio.sleep` itself",
            "_check_saga: the refund fails six times; the retries must await the injected sleep (counted on the "
            "check's virtual clock)",
            "real-sleep",
        ),
        Rule(
            "moves from `'reserved'` to `'released'`, and only if it moved",
            "_check_saga: release_stock called twice on a completed order gives the stock back once",
            "non-idempotent-release",
        ),
        Rule(
            "moves from `'charged'` to `'refunded'`, and only if it moved",
            "_check_saga: refund_payment on an order whose payment never happened moves no money",
            "blind-refund",
        ),
        Rule(
            "each in its own statement (autocommit), so each is durable before the next action",
            "_check_saga: a crash before each write, then recover_sagas() in a fresh replica (module state gone) "
            "must find the saga in saga_log",
            "in-memory-log",
        ),
        Rule(
            "then `await step_function(pool, order)`, then `(step, 'done')`",
            "_check_saga: a crash before each write, then recover_sagas(); without the step rows recovery cannot "
            "finish the order",
            "no-log",
        ),
        Rule(
            "the failed one included",
            "_expect_all_compensated: the declined and the unshippable order's saga_log must show a compensated "
            "row for every started step",
            "failed-step-not-compensated",
        ),
        Rule(
            "ch06_stock.available of its sku goes up by its qty",
            "_check_give_back_adds: release_stock held at the stock row (a lock the check holds) while another "
            "order takes 3 of the sku; the stock must end before - 3 + qty",
            "release-writes-back-what-it-read",
        ),
        Rule(
            "Any other exception from a step propagates",
            "_check_step_blip: charge_payment raises 40001 once (a trigger of the check); the saga must end "
            "completed (or rolled back by recovery after it raised), never compensated by run_order_saga",
            "compensates-any-step-error",
        ),
        Rule(
            "if its log has a `failed` row or a step's `compensated` row, go on compensating",
            "_check_saga: before recovery the crashed declined orders whose log says failed get money in their "
            "wallet; a recovery that runs them forward completes them",
            "recovery-ignores-failed",
        ),
        Rule(
            "Rolling every unfinished saga back instead",
            "_check_saga: after recovery an order may end completed or compensated, but every started step, the "
            "in-flight one included, must be undone",
            "backward-skips-in-flight",
        ),
    ],
    "outbox_relay": [
        Rule(
            "its event into `outbox (aggregate_type, aggregate_id, event_type, payload)`",
            "_check_outbox: place_order's order must have its OrderPlaced outbox row, and publish nothing itself",
            "dual-write",
        ),
        Rule(
            "`('order', order_id, 'OrderPlaced', Jsonb(order))`, **in one transaction**",
            "_check_outbox: a crash before each of place_order's two writes; neither may survive alone",
            "two-commits",
        ),
        Rule(
            "publish up to `limit` unpublished outbox rows",
            "_check_outbox: two relays with limit=4; every call must publish at most 4",
            "ignores-limit",
        ),
        Rule(
            "one entry per event with the fields `event_id` (the outbox `id`, as a string)",
            "_check_outbox: the first stream entry is read field by field",
            "fresh-event-id",
        ),
        Rule(
            "Return how many it published",
            "_check_outbox: the first call must return 1 for one event, a second call 0",
            "returns-limit",
        ),
        Rule(
            "mark a row published only after its XADD succeeded",
            "_check_outbox: Redis fails at the second XADD of a call; that event must still reach the stream",
            "mark-first",
        ),
        Rule(
            "A crash in between publishes it again on the next call",
            "_check_outbox: a relay that crashes at its first write to outbox after publishing; the next call "
            "publishes the same event_id again",
            "swallows-publish-error",
        ),
        Rule(
            "one order's events reach the stream in `id` order, **even with several relays running at once**",
            "_check_outbox: two replicas, the first held at its first publish until the second has returned or "
            "waits in PostgreSQL (gated), then each order's stream order is read",
            "skip-locked",
        ),
        Rule(
            "In order per order",
            "_check_outbox: the same gated race; a relay that claims rows by marking them published first, with no "
            "lock, lets the second relay take the order's next events",
            "mark-first-unlocked",
        ),
        Rule(
            "In order per order: one order's events reach the stream",
            "_check_outbox: the outbox is CLUSTERed newest first and its partial index dropped before the gated "
            "race, so a relay without ORDER BY id reads an order's later events first",
            "no-order-by",
        ),
        Rule(
            "publish up to `limit` unpublished outbox rows",
            "_check_outbox: an event whose transaction commits after a later id was published must still reach "
            "the stream (a WHERE id > last_seen cursor skips it)",
            "cursor-poller",
        ),
        Rule(
            "the fields `event_id` (the outbox `id`, as a string), `aggregate_id`, `event_type`",
            "_check_outbox: after the two relays every stream entry's aggregate_id, event_type and payload are "
            "compared with its outbox row",
            "event-type-hardcoded",
        ),
        Rule(
            "even with several relays running at once",
            "_check_outbox: the two relays are two replicas of the answer cell, so a lock in one process is not "
            "seen by the other",
            "in-process-lock",
        ),
    ],
}

#: The course's own answers: a learner who only calls one of these earns nothing for the task.
REFERENCES: dict[str, list[str]] = {
    "order_saga": [],
    "outbox_relay": ["course.outbox:relay_batch", "course.chapters.ch06.events:place_order_outbox"],
}

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 3
