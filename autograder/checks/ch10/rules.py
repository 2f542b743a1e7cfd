"""Chapter 10's rule tables: every requirement of each task's text, the check that enforces it, the kept wrong answer it rejects."""

from __future__ import annotations

from autograder.rules import Rule

RULES: dict[str, list[Rule]] = {
    "buy": [
        Rule(
            "Never sell more units than the stock",
            "_check_flash: 8 buyers of 1 and of 6 units held on the stock row until all wait, across two replicas; "
            "counts reservations and stock in PostgreSQL",
            wrong="read_then_write",
        ),
        Rule(
            "every unit is sold when more buyers than units come",
            "_check_flash: 8 buyers of 6 units; expects 6 paid and stock 0",
            wrong="skip_locked_gives_up",
        ),
        Rule(
            "A buyer who finds the stock row busy waits for it",
            "_check_flash: 8 buyers of 6 units, each purchase let through the COMMIT turnstile (rig.Contest) only "
            "once every other buyer waits again, so each retry round of a SERIALIZABLE answer has one winner and a "
            "retry bounded to fewer than 6 attempts gives up while units are left",
            wrong="serializable_retry_3_attempts",
        ),
        Rule(
            "call `pay` with no transaction open",
            "_check_buy: pay probes pg_stat_activity and the stock row (FOR NO KEY UPDATE NOWAIT) while it runs",
            wrong="lock_across_pay",
        ),
        Rule(
            "gives the unit back to stock at once",
            "_check_payment_failures: pay raises ChargeDeclined; expects 'payment_failed', 'released', stock 1",
            wrong="no_release_on_failure",
        ),
        Rule(
            "Never release on an unknown outcome",
            "_check_payment_failures: pay raises TimeoutError (after the provider charged), ProviderError(503) and "
            "ConnectionResetError; expects 'payment_unknown', the reservation 'held', stock 0; then the reaper asks "
            "the provider and settles each",
            wrong="release_on_timeout",
        ),
        Rule(
            "When pay raises any other Exception",
            "_check_payment_failures: pay raises TimeoutError, ProviderError(503), ConnectionResetError; expects "
            "'payment_unknown' and the reservation still 'held'",
            wrong="release_on_timeout",
        ),
        Rule(
            "settles held reservations past expires_at",
            "_check_payment_failures: after a crash inside pay and after unknown outcomes, the reaper runs a minute "
            "before and after the deadline and asks the check's provider",
            wrong="no_deadline",
        ),
        Rule(
            "Keep the reservation 'held' with its unit",
            "_check_payment_failures: pay raises TimeoutError, ProviderError(503), ConnectionResetError; expects the "
            "reservation 'held' and stock 0",
            wrong="release_on_timeout",
        ),
        Rule(
            "when the reaper found the payment",
            "_check_payment_failures: the charge goes through, the reaper finds it and marks the reservation 'paid' "
            "before pay returns; expects 'paid', stock 0",
            wrong="expired_when_reaper_paid",
        ),
        Rule(
            "Set `expires_at = now() + HOLD_SECONDS`",
            "_check_payment_failures: the buyer crashes in pay; the reaper runs a minute before and after the deadline",
            wrong="no_deadline",
        ),
        Rule(
            "only while it is still `held`",
            "_check_payment_failures: the reaper releases during pay, then the card is declined or the charge "
            "succeeds; stock 1, 'expired'",
            wrong="release_unguarded",
        ),
        Rule(
            "repeat of a key returns that reservation",
            "_check_same_key: 6 concurrent calls with one key across replicas; one payment, one reservation, no error",
            wrong="select_then_insert_key",
        ),
        Rule(
            "insert the reservation for key and take one unit of sku's stock",
            "_check_flash: 8 buyers of 1 and of 6 units held on the stock row; counts reservations and stock in PostgreSQL",
            wrong="read_then_write",
        ),
        Rule(
            "When no unit is left, write nothing and return",
            "_check_flash: 8 buyers of 1 unit; the 7 who come too late must get sold_out and leave no reservation",
            wrong="in_process_lock",
        ),
        Rule(
            "set the reservation 'paid' with its payment_id",
            "_check_payment_failures: the reaper releases during pay, then pay succeeds; the reservation must not be paid",
            wrong="confirm_unguarded",
        ),
        Rule(
            "when the reaper got there first, change nothing",
            "_check_payment_failures: the reaper releases during pay, then the card is declined or the charge "
            "succeeds; stock 1, 'expired'",
            wrong="release_unguarded",
        ),
        Rule(
            "Claim the key with INSERT",
            "_check_same_key: 6 concurrent calls with one key across replicas; one payment, one reservation, no error",
            wrong="select_then_insert_key",
        ),
        Rule(
            "returns that reservation as it stands",
            "_check_answers: repeats of a paid, a released and a held key must return that status and the "
            "reservation's id, without paying",
            wrong="repeat_without_reservation_id",
        ),
        Rule(
            "with its payment_id and return",
            "_check_answers: a purchase that pays must return its status, reservation id and payment_id; one whose "
            "card is declined or whose payment times out its status and reservation id",
            wrong="paid_without_payment_id",
        ),
        Rule(
            "in one transaction: insert the reservation",
            "_check_refused_reserve: the database refuses the stock update of one sku and the reservation INSERT "
            "of another (triggers); expects stock unchanged, no reservation and no payment",
            wrong="two_transactions",
        ),
        Rule(
            "The hidden checks run your answer as two replicas",
            "_check_flash: two replicas of the answer cell buy at once, held on the stock row until all wait",
            wrong="in_process_lock",
        ),
    ],
    "transfer": [
        Rule(
            "amounts are `int` minor units",
            "_check_transfer: 12.5 and Decimal('12.50') must raise TypeError/ValueError with nothing written",
            wrong="float_money",
        ),
        Rule(
            "postings that sum to zero",
            "_check_transfer: reads the postings of the returned id (the schema's deferred trigger also refuses "
            "an unbalanced transfer at commit); ledger.reconcile at the end",
            wrong="one_posting",
        ),
        Rule(
            "never update or delete a posting",
            "_check_transfer: the schema's trigger refuses UPDATE/DELETE on ledger_postings; the first call raises",
            wrong="update_posting",
        ),
        Rule(
            "may not go below zero",
            "_check_overdraft_race: 3 transfers of 60 from 100, held on the account row until all wait; a "
            "CheckViolation from the table's backstop CHECK means the code let an overdraft through",
            wrong="python_balance_check",
        ),
        Rule(
            "no deadlock may reach the caller",
            "_check_opposite: two rounds of one transfer each way, forced into a lock cycle for source-first locking",
            wrong="source_first_no_retry",
        ),
        Rule(
            "equals the sum of its postings",
            "_check_opposite: opposite transfers held on one account; compares balances with the expected ones and "
            "with the postings",
            wrong="python_computed_balance",
        ),
        Rule(
            "a retry with the same key",
            "_check_transfer: the same call twice returns the same id; the key with another amount raises "
            "IdempotencyKeyReused",
            wrong="no_idempotency",
        ),
        Rule(
            "change both cached balances in SQL",
            "_check_opposite: the deadlock's loser (always the first transfer of the round: only its session has "
            "the 20 ms deadlock_timeout) retries while the other waits at the COMMIT turnstile (rig.Contest), so a "
            "balance read before the other committed is written back on every run",
            wrong="dest_writeback_retry",
        ),
        Rule(
            "move amount from account from_id to account to_id",
            "_check_opposite: opposite transfers held on one account; compares balances with the expected ones",
            wrong="python_computed_balance",
        ),
        Rule(
            "amount bigint NOT NULL, never 0",
            "_check_transfer: reads the postings of the returned id; ledger.reconcile at the end",
            wrong="one_posting",
        ),
        Rule(
            "(or a bool) raises TypeError",
            "_check_bool_amount: an amount of True must raise TypeError/ValueError with nothing written",
            wrong="bool_amount",
        ),
        Rule(
            "all in one transaction, so that each cached balance equals the sum",
            "_check_refused_posting: the database refuses the postings of one transfer (a trigger); expects no "
            "ledger_transfers row and no balance moved",
            wrong="postings_second_transaction",
        ),
        Rule(
            "A float or a Decimal (or a bool) raises TypeError",
            "_check_transfer: 12.5 and Decimal('12.50') must raise TypeError/ValueError with nothing written",
            wrong="float_money",
        ),
        Rule(
            "Raise InsufficientFunds (imported below) and write nothing",
            "_check_overdraft_race: 3 transfers of 60 from 100; two must raise InsufficientFunds",
            wrong="python_balance_check",
        ),
        Rule(
            "or after locking the row, never on a value read before",
            "_check_overdraft_race: 3 transfers of 60 from 100, held on the account row until all wait",
            wrong="python_balance_check",
        ),
        Rule(
            "these two are not subclasses of TransactionRollback",
            "_check_opposite: two rounds of one transfer each way, forced into a lock cycle for source-first locking",
            wrong="retry_on_transaction_rollback",
        ),
        Rule(
            "also when the repeats arrive at the same moment",
            "_check_same_key: 6 calls with one key at once across replicas, held on account 1 until each waits on a "
            "lock; every call must return the one transfer's id, and 10 move once",
            wrong="lookup_then_insert",
        ),
        Rule(
            "Claim the key with INSERT",
            "_check_same_key: 6 concurrent calls with one key; a UniqueViolation from a lookup-then-INSERT is named",
            wrong="lookup_then_insert",
        ),
        Rule(
            "a lookup before a plain INSERT races",
            "_check_same_key: 6 concurrent calls with one key, held until all wait; a UniqueViolation fails the check",
            wrong="lookup_then_insert",
        ),
        Rule(
            "raise IdempotencyKeyReused when the same key comes with a different transfer",
            "_check_transfer: the same key with another amount must raise IdempotencyKeyReused",
            wrong="no_idempotency",
        ),
        Rule(
            "so that locking the source account first deadlocks on every run",
            "_check_opposite: two rounds of opposite transfers started while the check holds one account",
            wrong="source_first_no_retry",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {
    "buy": ["course.inventory:buy"],
    "transfer": ["course.ledger:transfer", "course.ledger:transfer_once"],
}
