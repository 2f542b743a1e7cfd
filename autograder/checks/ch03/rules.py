"""Chapter 03's rule tables: every requirement of each task's text, the check that enforces it
and the kept wrong solution (``WRONG`` in ``tests/test_03_grading.py``) rejected for it."""

from __future__ import annotations

from autograder.rules import Rule

RULES: dict[str, list[Rule]] = {
    "create_order": [
        Rule(
            "Charge at most once per key",
            "_check_create_order: 10 concurrent calls with one key, the first charge held until the others settle",
            wrong="check then insert",
        ),
        Rule(
            "insert one row into orders (customer, amount_cents, charge_id)",
            "_check_create_order: one order per key, its charge_id the one charge returned",
            wrong="order without the charge id",
        ),
        Rule(
            "return a JSON-able dict that names the order id",
            "_check_create_order: json.dumps of the response, and the order id somewhere in it",
            wrong="response without the order id",
        ),
        Rule(
            "Store that response in idempotency_keys.response with status = 'done'",
            "_check_create_order: reads the key's row after the race: status done, the response stored",
            wrong="claim without a stored response",
        ),
        Rule(
            "in the same transaction as the order row (a crash between the two must leave neither)",
            "_check_store_crash: a trigger kills the order's INSERT, then the response's UPDATE; neither may be "
            "left committed without the other, and the reaper must not make a second order",
            wrong="order and response in two commits",
        ),
        Rule(
            "and return the stored one to every repeat",
            "_check_create_order: the same call again must return a response equal to the first",
            wrong="repeat rebuilds the response",
        ),
        Rule(
            "When you claim the key, store the body in idempotency_keys.request",
            "_check_uncertain: reads the request column of a pending key before running the reaper",
            wrong="no request stored",
        ),
        Rule(
            "The same key with a different body raises IdempotencyKeyReused",
            "_check_create_order: the same key with another amount, then another customer",
            wrong="no request hash",
        ),
        Rule(
            "compare request_hash(body) with the stored request_hash",
            "_check_create_order: another customer with the same amount must be refused too (a hash of every field)",
            wrong="hash of the amount only",
        ),
        Rule(
            "While the first call with the key is running, other calls raise RequestInProgress",
            "_check_create_order: the 9 callers held behind the first charge must raise it, block or get the response",
            wrong="pending returns None",
        ),
        Rule(
            "When charge raises, let the error reach the caller",
            "_check_create_order: a declined charge must raise ChargeDeclined to the caller",
            wrong="failure swallowed",
        ),
        Rule(
            "release the key (delete the pending row), so the next call with the key charges again",
            "_check_create_order: after a declined charge the same key must charge again",
            wrong="no release on a decline",
        ),
        Rule(
            "the money may have moved): keep the key pending.",
            "_check_uncertain: a timeout, then the same key: no new charge before the reaper",
            wrong="release on any failure",
        ),
        Rule(
            "The next call with the key raises RequestInProgress and charges nothing, until the reaper has finished",
            "_check_uncertain: a 500 from the provider, then the same key: RequestInProgress and no charge",
            wrong="release on a provider error",
        ),
        Rule(
            "The checks hold the first charge until every other caller has charged",
            "_check_create_order: a Crowd holds the first charge until every other caller is settled",
            wrong="check then insert in a transaction",
        ),
        Rule(
            "A lock, dict or set in your process guards one replica only: it fails.",
            "_check_create_order: the 10 callers alternate between two replicas of the answer cell",
            wrong="in-process lock per key",
        ),
    ],
    "consume_payment_event": [
        Rule(
            "credit accounts.balance_cents by amount_cents exactly once per event_id",
            "_check_consume: the same event delivered again must leave the balance as it was",
            wrong="no dedup",
        ),
        Rule(
            "however many times, however concurrently",
            "_check_consume: one event delivered 5 times at once, held until all have checked",
            wrong="check then insert",
        ),
        Rule(
            "and to however many replicas of the consumer the event is delivered",
            "_check_consume: the 5 deliveries alternate between two replicas of the answer cell",
            wrong="in-memory set",
        ),
        Rule(
            "Record the event id in processed_events (event_id text PRIMARY KEY).",
            "_check_consume: a crash at the dedup insert, then a redelivery, must credit once",
            wrong="dedup insert outside the transaction",
        ),
        Rule(
            "If something fails, raise: the broker redelivers a delivery that raised.",
            "_check_consume: a crash injected at the credit must reach the caller, so it is redelivered",
            wrong="swallows errors",
        ),
        Rule(
            "crash the consumer once at the credit and once at the dedup insert (then redeliver)",
            "_check_consume: crash points armed in PostgreSQL at the credit and at the dedup insert",
            wrong="credit, then dedup, separate commits",
        ),
        Rule(
            "deliver a batch of distinct events, some twice, to both replicas at once",
            "_check_consume: per-account balances after the batch; a read-modify-write credit loses updates",
            wrong="read, modify, write",
        ),
        Rule(
            "Event ids remembered in the process (a set, a lock per event) fail",
            "_check_consume: two replicas, and a consumer made again after a crash, share only the database",
            wrong="in-memory dedup with a lock",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {
    "create_order": ["course.idempotency:create_order"],
    "consume_payment_event": ["course.idempotency:consume_payment_event"],
}
