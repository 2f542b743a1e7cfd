"""Hidden checks of ``transfer``: a ledger transfer that keeps every invariant under contention.

The rig is :mod:`rig`, the replicas and the shared helpers :mod:`common`; the package's docstring
tells how the opposite-direction transfers are forced into a deadlock.
"""

from __future__ import annotations

from decimal import Decimal

import psycopg

from autograder.checks.ch10.common import REPLICAS, SETTLE_LIMIT, _kinds, _one
from autograder.checks.ch10.rig import Contest, install_turnstile
from autograder.harness import Report, error_line, task
from course import ledger
from course.chapters.ch10 import Race
from course.idempotency import IdempotencyKeyReused
from course.kit import lab
from course.ledger import (
    transfer as fund,
)  # bound now: in the kernel the references raise while a check runs (autograder/references.py)

SURVIVOR_DEADLOCK_TIMEOUT = "5s"  # the second transfer of a round never finds the deadlock: the first does

BANK, ALICE, BOB, CAROL, DAVE = 100, 1, 2, 3, 4


async def _balances(pool) -> dict[int, int]:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, balance FROM ledger_accounts ORDER BY id")
        return {k: int(v) for k, v in await cur.fetchall()}


async def _postings(pool, transfer_id) -> dict[int, int]:
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT account_id, sum(amount) FROM ledger_postings WHERE transfer_id = %s GROUP BY account_id",
            (transfer_id,),
        )
        return {k: int(v) for k, v in await cur.fetchall()}


async def _counts(pool) -> tuple[int, int]:
    row = await _one(pool, "SELECT (SELECT count(*) FROM ledger_transfers), (SELECT count(*) FROM ledger_postings)")
    return int(row[0]), int(row[1])


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


async def _call_transfer(transfer, pool, a, b, amount, key):
    try:
        return await transfer(pool, a, b, amount, key)
    except Exception as err:  # noqa: BLE001 - reported by the check
        return err


def _books(rec: dict) -> str:
    parts = []
    if rec["unbalanced"]:
        parts.append(f"transfer(s) whose postings do not sum to zero (id, sum): {rec['unbalanced'][:3]}")
    if rec["drifted"]:
        parts.append(
            "cached balance(s) that differ from the sum of their postings (account, cached, postings): "
            f"{rec['drifted'][:3]}"
        )
    return "; ".join(parts)


@task("transfer", points=6, title="a ledger transfer that keeps every invariant", timeout=90, seed=1002)
async def check_transfer(r: Report, transfer) -> None:
    async with lab.scratch("ch10") as ns:
        with psycopg.connect(ns.servers.database_url, autocommit=True) as admin:
            admin.execute(f"ALTER DATABASE \"{ns.name}\" SET deadlock_timeout = '20ms'")
        pool = await ns.pool(max_size=20)
        await ledger.setup_schema(pool)
        async with pool.connection() as conn:
            await install_turnstile(conn, "ledger_accounts")
        await ledger.open_account(pool, BANK, "bank", allow_negative=True)
        for acc, name, funds in ((ALICE, "alice", 1000), (BOB, "bob", 1000), (CAROL, "carol", 100), (DAVE, "dave", 0)):
            await ledger.open_account(pool, acc, name)
            if funds:
                await fund(pool, BANK, acc, funds, f"fund-{name}")
        await _check_transfer(r, transfer, pool, ns)


async def _check_transfer(r: Report, transfer, pool, ns) -> None:
    before = await _balances(pool)
    tid = await _call_transfer(transfer, pool, ALICE, BOB, 250, "pub-1")
    if isinstance(tid, NotImplementedError):
        raise tid  # an unfinished answer: the harness says "not done yet"
    if isinstance(tid, BaseException):
        r.fail(
            f"transfer(pool, 1, 2, 250, 'pub-1') raised {error_line(tid)}; account 1 holds {before[ALICE]} (cents) "
            "and may not go negative, so 250 fits"
            + (
                ": amounts are already minor units (250 is 2.50); convert nothing (no * 100, no / 100)"
                if isinstance(tid, ledger.InsufficientFunds)
                else ""
            )
        )
    after = await _balances(pool)
    postings = await _postings(pool, tid) if _is_int(tid) else {}
    r.expect(
        _is_int(tid) and postings == {ALICE: -250, BOB: 250},
        f"transfer(pool, 1, 2, 250, 'pub-1') returned transfer {tid} with postings {{1: -250, 2: +250}}",
        f"transfer(pool, 1, 2, 250, 'pub-1') returned {tid!r} with postings {postings}; expected the new "
        "ledger_transfers id, and two postings on it: -250 on account 1 and +250 on account 2",
    )
    r.expect(
        after[ALICE] == before[ALICE] - 250 and after[BOB] == before[BOB] + 250,
        "cached balances moved by 250: alice 750, bob 1250",
        f"cached balances went from {before[ALICE]}/{before[BOB]} to {after[ALICE]}/{after[BOB]}; expected "
        f"{before[ALICE] - 250}/{before[BOB] + 250} (update ledger_accounts.balance in the same transaction)",
    )
    again = await transfer(pool, ALICE, BOB, 250, "pub-1")
    n = await _counts(pool)
    r.expect(
        again == tid and (await _balances(pool)) == after,
        "the same call again (key 'pub-1') returned the same transfer id and moved nothing",
        f"the same call again (key 'pub-1') returned {again!r} and left balances {await _balances(pool)}; expected "
        f"{tid} and no change: claim the key with INSERT INTO ledger_transfers ... ON CONFLICT (key) DO NOTHING "
        "RETURNING id, and when no row comes back, read the stored transfer and return its id",
    )
    for bad in (12.5, Decimal("12.50")):
        try:
            got = await transfer(pool, ALICE, BOB, bad, f"pub-{type(bad).__name__}")
            outcome, refused = f"returned {got!r}", False
        except (TypeError, ValueError) as err:
            outcome, refused = f"raised {error_line(err)}", True
        except Exception as err:  # noqa: BLE001
            outcome, refused = f"raised {error_line(err)}", False
        moved = (await _counts(pool)) != n or (await _balances(pool)) != after
        r.expect(
            refused and not moved,
            f"an amount of {bad!r} was refused: {outcome}",
            f"an amount of {bad!r} {outcome}{' and changed the ledger' if moved else ''}; expected TypeError "
            "(or ValueError) before anything is written: money is an int of minor units (cents), never a float "
            "or a Decimal",
        )
    if r.public:
        return

    # --- the same key, another transfer; no money; negative amounts -----------------------------
    try:
        got = await transfer(pool, ALICE, BOB, 999, "pub-1")
        outcome, ok = f"returned {got!r}", False
    except Exception as err:  # noqa: BLE001
        ok = isinstance(err, IdempotencyKeyReused) or getattr(err, "status", None) == 422
        outcome = f"raised {error_line(err)}"
    r.expect(
        ok and (await _balances(pool)) == after,
        f"key 'pub-1' again for 999 instead of 250: {outcome}, nothing moved",
        f"key 'pub-1' again for 999 instead of 250: {outcome}; expected IdempotencyKeyReused and no change "
        "(store request_hash({'from': ..., 'to': ..., 'amount': ...}) with the key and compare)",
    )
    for a, b, amount, key, want in (
        (CAROL, DAVE, 101, "over-1", "InsufficientFunds"),
        (DAVE, CAROL, -50, "neg-1", "ValueError"),
        (DAVE, CAROL, 0, "zero-1", "ValueError"),
    ):
        n = await _counts(pool)
        got = await _call_transfer(transfer, pool, a, b, amount, key)
        moved = (await _counts(pool)) != n or (await _balances(pool)) != after
        right = (
            isinstance(got, ledger.InsufficientFunds) if want == "InsufficientFunds" else isinstance(got, ValueError)
        )
        what = f"raised {error_line(got)}" if isinstance(got, BaseException) else f"returned {got!r}"
        r.expect(
            right and not moved,
            f"transfer({a}, {b}, {amount}) {what}, nothing written",
            f"transfer({a}, {b}, {amount}) {what}{' and changed the ledger' if moved else ''}; expected {want} and "
            "no row written"
            + (
                " (account 3 holds 100 and may not go negative)"
                if want == "InsufficientFunds"
                else ": a negative amount would move money the other way past the overdraft check"
            ),
        )

    await _check_bool_amount(r, transfer, pool, after)
    await _check_refused_posting(r, transfer, pool)

    replicas = r.replicas("transfer", REPLICAS)
    await _check_same_key(r, replicas, pool, ns)
    await _check_opposite(r, replicas, pool, ns)
    await _check_overdraft_race(r, replicas, pool, ns)
    rec = await ledger.reconcile(pool)
    r.expect(
        not rec["unbalanced"] and not rec["drifted"] and rec["total"] == 0,
        "at the end: every transfer sums to zero, every cached balance equals its postings, the books sum to 0",
        f"at the end the books do not reconcile: {_books(rec)}; all postings sum to {rec['total']}",
    )


async def _check_bool_amount(r: Report, transfer, pool, after: dict[int, int]) -> None:
    # --- a bool is an int to isinstance, and not an amount ------------------------------------
    n = await _counts(pool)
    got = await _call_transfer(transfer, pool, ALICE, BOB, True, "bool-1")
    moved = (await _counts(pool)) != n or (await _balances(pool)) != after
    what = f"raised {error_line(got)}" if isinstance(got, BaseException) else f"returned {got!r}"
    r.expect(
        isinstance(got, (TypeError, ValueError)) and not moved,
        f"an amount of True was refused: {what}",
        f"an amount of True {what}{' and changed the ledger' if moved else ''}; expected TypeError before anything "
        "is written: bool is a subclass of int, so isinstance(amount, int) lets True through as 1 cent; refuse a "
        "bool first (isinstance(amount, bool) or not isinstance(amount, int))",
    )


#: The trigger that makes the database refuse the postings of one transfer (the check's key ``refused-1``).
REFUSE_POSTINGS = """
CREATE OR REPLACE FUNCTION ch10_refuse_postings() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM ledger_transfers t WHERE t.id = NEW.transfer_id AND t.key = 'refused-1') THEN
        RAISE EXCEPTION 'the database refused this posting (injected by the check)';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS ch10_refuse_postings ON ledger_postings;
CREATE TRIGGER ch10_refuse_postings BEFORE INSERT ON ledger_postings
    FOR EACH ROW EXECUTE FUNCTION ch10_refuse_postings();
"""


async def _check_refused_posting(r: Report, transfer, pool) -> None:
    # --- one transaction: a refused posting leaves nothing behind ------------------------------
    async with pool.connection() as conn:
        await conn.execute(REFUSE_POSTINGS)
    r.note("transfer(1, 2, 7, 'refused-1'): the database refuses its postings (the INSERT into ledger_postings raises)")
    n, before = await _counts(pool), await _balances(pool)
    try:
        got = await _call_transfer(transfer, pool, ALICE, BOB, 7, "refused-1")
    finally:
        async with pool.connection() as conn:
            await conn.execute("DROP TRIGGER IF EXISTS ch10_refuse_postings ON ledger_postings")
    now, balances = await _counts(pool), await _balances(pool)
    what = f"raised {error_line(got)}" if isinstance(got, BaseException) else f"returned {got!r}"
    left = []
    if now[0] != n[0]:
        left.append(f"{now[0] - n[0]} ledger_transfers row(s)")
    if balances != before:
        moved = {k: balances[k] - before[k] for k in balances if balances[k] != before.get(k)}
        left.append(f"balances moved by {moved}")
    r.expect(
        not left and now == n,
        f"a transfer whose postings the database refused {what} and left nothing written",
        f"a transfer whose postings the database refused {what} and left {' and '.join(left)} without its "
        "postings, so the cached balances no longer equal the sum of their postings. The transfer row, both "
        "balance updates and both postings go in one transaction (async with conn.transaction()), so a failure "
        "at any step rolls all of it back",
    )


async def _check_same_key(r: Report, replicas, pool, ns) -> None:
    # --- repeats of one transfer at the same moment: the key must be claimed, not looked up ----------
    n, key = 6, "same-1"
    before = await _balances(pool)
    r.note(
        f"{n} calls of transfer(1, 2, 10, '{key}') at once, alternating replicas; the check holds account 1 until "
        "every call waits on a lock, so each one has looked for the key before the first commits"
    )
    async with Race(ns, "ledger_accounts", "id = %s", (ALICE,), limit=SETTLE_LIMIT) as race:
        race.start(_call_transfer(replicas[i % REPLICAS], pool, ALICE, BOB, 10, key) for i in range(n))
        results = await race.results()
    stored = await _one(pool, "SELECT id FROM ledger_transfers WHERE key = %s", (key,))
    after = await _balances(pool)
    moved = before[ALICE] - after[ALICE]
    unique = [x for x in results if isinstance(x, psycopg.errors.UniqueViolation)]
    if unique:
        r.fail(
            f"{n} concurrent calls with key '{key}' ended with {_kinds(results)}: each repeat looked the key up, "
            "found nothing (the first transfer had not committed yet) and inserted it again, and the UNIQUE key "
            "refused it. A lookup before a plain INSERT races; claim the key with INSERT ... ON CONFLICT (key) DO "
            "NOTHING RETURNING id, which waits for the first transfer, and when no row comes back, read the stored "
            "transfer and return its id"
        )
    got_ids = {x for x in results if _is_int(x)}
    r.expect(
        stored is not None and got_ids == {stored[0]} and moved == 10,
        f"all {n} returned the first transfer's id; account 1 moved 10 once",
        f"{n} concurrent calls with key '{key}' ended with {_kinds(results)}"
        + (
            f": {error_line(next(x for x in results if isinstance(x, BaseException)))}"
            if any(isinstance(x, BaseException) for x in results)
            else ""
        )
        + f"; account 1 moved {moved}; expected every call to return the one transfer's id and 10 moved once",
    )


async def _check_opposite(r: Report, replicas, pool, ns) -> None:
    # One transfer each way per round. The first one closes the lock cycle, and only its session has
    # the database's 20 ms deadlock_timeout (the other's is SURVIVOR_DEADLOCK_TIMEOUT), so PostgreSQL
    # aborts the same transfer on every run. Its retry then runs while the other transfer waits at the
    # turnstile (its COMMIT is held until the retry waits on a lock too), so a balance read before the
    # other committed is written back on every run, and never by luck.
    survivor = await ns.pool(
        max_size=4, kwargs={"autocommit": True, "options": f"-c deadlock_timeout={SURVIVOR_DEADLOCK_TIMEOUT}"}
    )
    for n, (held, first, second) in enumerate(((BOB, (BOB, ALICE), (ALICE, BOB)), (ALICE, (ALICE, BOB), (BOB, ALICE)))):
        amounts = [r.random.randint(1, 200) for _ in range(2)]
        before = await _balances(pool)
        r.note(
            f"round {n + 1}: {first[0]} -> {first[1]} and {second[0]} -> {second[1]} at once, on the two replicas; the "
            f"check holds account {held} until the {first[0]} -> {first[1]} transfer waits on it, then starts the other "
            f"and releases account {held} once that one waits too; each transfer commits only once the other waits "
            f"on a lock (a deadlock, if one comes, aborts the {first[0]} -> {first[1]} transfer)"
        )
        async with Contest(ns, "ledger_accounts", "id = %s", (held,), limit=SETTLE_LIMIT) as race:
            race.start([_call_transfer(replicas[0], pool, *first, amounts[0], f"opp-{n}-a")])

            async def second_wave(race=race, second=second, amount=amounts[1], n=n) -> None:
                race.start([_call_transfer(replicas[1], survivor, *second, amount, f"opp-{n}-b")])

            results = await race.run(second_wave)
        errors = [x for x in results if isinstance(x, BaseException)]
        if any(isinstance(x, psycopg.errors.DeadlockDetected) for x in errors):
            r.fail(
                f"a DeadlockDetected (40P01) reached the caller: the {second[0]} -> {second[1]} transfer held account "
                f"{second[0]} and waited for {held} while the {first[0]} -> {first[1]} transfer held {held} and waited "
                f"for {second[0]}. Lock both accounts in id order (SELECT ... WHERE id = ANY(...) ORDER BY id FOR "
                "UPDATE), or retry the whole transaction on psycopg.errors.DeadlockDetected by name: in psycopg it is "
                "not a subclass of TransactionRollback, so an except TransactionRollback never catches it"
            )
        r.expect(
            not errors,
            "both transfers returned an id",
            f"two opposite transfers ended with {_kinds(results)}: {error_line(errors[0]) if errors else ''}",
        )
        after = await _balances(pool)
        moved = (amounts[0] if first[0] == ALICE else -amounts[0]) + (amounts[1] if second[0] == ALICE else -amounts[1])
        want = {ALICE: before[ALICE] - moved, BOB: before[BOB] + moved}
        rec = await ledger.reconcile(pool)
        right = after[ALICE] == want[ALICE] and after[BOB] == want[BOB]
        r.expect(
            right and not rec["drifted"] and not rec["unbalanced"],
            f"balances {after[ALICE]}/{after[BOB]} as expected, and each equals the sum of its postings",
            f"after two opposite transfers the cached balances of accounts 1 and 2 are {after[ALICE]}/{after[BOB]}, "
            f"expected {want[ALICE]}/{want[BOB]}"
            + (", and they differ from the sums of their postings" if rec["drifted"] else "")
            + ": an update was lost. Change the balance in SQL (balance = balance - %s), not by writing back a "
            "value read earlier",
        )


async def _check_overdraft_race(r: Report, replicas, pool, ns) -> None:
    carol = (await _balances(pool))[CAROL]
    r.note(
        f"3 transfers of 60 at once from account 3 (holding {carol}, no overdraft) to account 4, alternating "
        "replicas; the check holds account 3 until all three wait"
    )
    async with Race(ns, "ledger_accounts", "id = %s", (CAROL,), limit=SETTLE_LIMIT) as race:
        race.start(_call_transfer(replicas[i % REPLICAS], pool, CAROL, DAVE, 60, f"od-{i}") for i in range(3))
        results = await race.results()
    left = (await _balances(pool))[CAROL]
    ok = [x for x in results if _is_int(x)]
    refused = [x for x in results if isinstance(x, ledger.InsufficientFunds)]
    backstop = [x for x in results if isinstance(x, psycopg.errors.CheckViolation)]
    if backstop:
        r.fail(
            f"3 transfers of 60 from {carol}: {_kinds(results)}. Your code let {len(backstop)} overdraft(s) through "
            "and only the table's CHECK (allow_negative OR balance >= 0) stopped them: each transfer read the "
            "balance, saw enough, and subtracted. Put the check in the update's WHERE (... SET balance = balance - "
            "%s WHERE id = %s AND (allow_negative OR balance >= %s)) or lock the row before reading it, and raise "
            "InsufficientFunds"
        )
    r.expect(
        len(ok) == 1 and len(refused) == 2 and left == carol - 60,
        f"one went through, two raised InsufficientFunds; account 3 holds {left}",
        f"3 transfers of 60 from {carol}: {_kinds(results)}; account 3 holds {left}; expected one transfer and "
        "two InsufficientFunds",
    )
