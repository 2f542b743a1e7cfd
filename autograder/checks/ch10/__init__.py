"""Hidden checks of chapter 10 (contention and money): ``buy`` and ``transfer``.

Every race is forced, not hoped for. The check holds the contended row itself (:class:`rig.Contest`:
a connection of its own takes ``SELECT ... FOR NO KEY UPDATE`` and keeps its transaction open),
starts the concurrent callers, and lets the row go only once every caller that has not finished
is waiting on a PostgreSQL lock (``pg_locks``, with no cycle among the waits). So a
read-then-write lets every buyer read the same stock, on every run.

After that, a turnstile at COMMIT (a deferred trigger on the contended table that waits on an
advisory lock the check holds, :func:`rig.install_turnstile`) lets one transaction that wrote the
table commit at a time, and only once every other caller waits on a lock again. So a buyer who
lost a round under SERIALIZABLE has made its next attempt before the next winner commits: every
retry round has exactly one winner, and a retry bounded to N attempts gives up after N rounds on
every run (8 buyers of 6 units catch any bound below 6).

For the opposite-direction transfers the callers start in two waves: the first wave's transfer
waits on the held account, then the second wave's takes the other account and waits too, and
only then is the held account released: code that locks the source account first meets a
deadlock every time. The first transfer closes the lock cycle, and only its session has a short
``deadlock_timeout`` (20 ms, the check's database; the second's pool has
:data:`SURVIVOR_DEADLOCK_TIMEOUT`), so PostgreSQL aborts the same one on every run. Its retry
then reads and queues while the other transfer waits at the turnstile: a balance read before the
other committed and written back is a lost update on every run. One transfer goes each way per
round: after the forced deadlock the survivor holds both accounts and the retry queues behind it.
(Should the retry reach the freed row before the woken survivor's backend does, it meets one more
cycle, which the same session's 20 ms timeout breaks the same way: a bound of one retry on
deadlock is the only kind of answer whose verdict that could change.)

Callers alternate between two replicas of the answer (two copies of the answer cell that
share no module state), so a lock or a set kept in one process fails. Every invariant is
read from PostgreSQL itself at the end.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from decimal import Decimal

import psycopg

from autograder.checks.ch10.rig import Contest, install_turnstile
from autograder.harness import Report, error_line, task
from course import inventory, ledger
from course.chapters.ch10 import Race
from course.idempotency import IdempotencyKeyReused, SimulatedCrash
from course.kit import lab

REPLICAS = 2
FLASHES = ((1, 8), (6, 8))  # (units, buyers): with 6 units, a retry given up after fewer than 6 attempts sells fewer
SURVIVOR_DEADLOCK_TIMEOUT = "5s"  # the second transfer of a round never finds the deadlock: the first does
SETTLE_LIMIT = 2.0  # real seconds a wave may take to be held before the check moves on anyway (as chapter 03)
IN_PROCESS = "state kept in one process is not shared"


def _kind(x) -> str:
    if isinstance(x, BaseException):
        return type(x).__name__
    if isinstance(x, dict):
        return repr(x.get("status"))
    if isinstance(x, int) and not isinstance(x, bool):
        return "a transfer id"  # which caller got which id depends on who won: not part of the line
    return repr(x)


def _kinds(outcomes) -> str:
    counts = Counter(_kind(x) for x in outcomes)
    return ", ".join(f"{n} x {what}" for what, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


async def _one(pool, sql: str, params: tuple = ()):
    async with pool.connection() as conn:
        cur = await conn.execute(sql, params)
        return await cur.fetchone()


# ============================================================================= buy


class Payments:
    """The ``pay`` the check passes in: records calls; can fail, crash, or let the deadline pass first."""

    def __init__(self, pool=None, probe_db: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.pool = pool
        self.probe_db = probe_db
        self.plan: list[str] = []  # per call: "ok", "timeout", "crash", "expire-ok", "expire-timeout"
        self.seen_open: list[str] = []

    async def __call__(self, buyer: str, sku: str, reservation_id) -> str:
        self.calls.append((buyer, sku, reservation_id))
        if self.probe_db:
            await self._probe(sku)
        step = self.plan.pop(0) if self.plan else "ok"
        await asyncio.sleep(0)
        if step.startswith("expire"):  # the payment took longer than the hold: the reaper ran meanwhile
            far = await _one(self.pool, "SELECT now() + make_interval(secs => %s)", (inventory.HOLD_SECONDS + 60,))
            await inventory.release_expired(self.pool, as_of=far[0])
        if step.endswith("timeout"):
            raise TimeoutError("the payment provider did not answer within 5 s")
        if step == "crash":
            raise SimulatedCrash("the process died while waiting for the payment")
        return f"pay_{len(self.calls):03d}"

    async def _probe(self, sku: str) -> None:
        async with await psycopg.AsyncConnection.connect(self.probe_db, autocommit=True) as probe:
            cur = await probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND state LIKE 'idle in transaction%%' AND pid <> pg_backend_pid()"
            )
            (open_tx,) = await cur.fetchone()
            try:
                await probe.execute("BEGIN")
                await probe.execute("SELECT 1 FROM inventory_items WHERE sku = %s FOR NO KEY UPDATE NOWAIT", (sku,))
                locked = False
            except psycopg.errors.LockNotAvailable:
                locked = True
            finally:
                await probe.execute("ROLLBACK")
        if locked:
            self.seen_open.append("the stock row was locked by your transaction")
        elif open_tx:
            self.seen_open.append("your transaction was open (idle in transaction)")


async def _stock(pool, sku: str) -> int:
    return (await _one(pool, "SELECT stock FROM inventory_items WHERE sku = %s", (sku,)))[0]


async def _reservations(pool, sku: str) -> dict[str, int]:
    return await inventory.sold(pool, sku)


def _status(got) -> str | None:
    return got.get("status") if isinstance(got, dict) else None


@task("buy", points=6, title="a flash sale that never oversells", timeout=90, seed=1001)
async def check_buy(r: Report, buy) -> None:
    async with lab.scratch("ch10") as ns:
        pool = await ns.pool(max_size=20)
        await inventory.setup_schema(pool)
        async with pool.connection() as conn:
            await install_turnstile(conn, "inventory_items")
        await _check_buy(r, buy, pool, ns)


async def _call_buy(buy, pool, sku, buyer, key, pay):
    try:
        return await buy(pool, sku, buyer, key, pay)
    except BaseException as err:  # noqa: BLE001 - the check reports whatever the answer raised
        if isinstance(err, asyncio.CancelledError):
            raise
        return err


async def _check_buy(r: Report, buy, pool, ns) -> None:
    # --- one buyer, one unit, then a second buyer and a repeat -----------------------------
    await inventory.stock_item(pool, "mug", 1)
    pay = Payments(pool, probe_db=ns.database_url)
    got = await buy(pool, "mug", "ada", "ada-1", pay)
    r.expect(
        _status(got) == "paid" and len(pay.calls) == 1,
        f"buy(pool, 'mug', 'ada', 'ada-1', pay) with 1 in stock returned {got!r}",
        f"buy(pool, 'mug', 'ada', 'ada-1', pay) with 1 in stock returned {got!r} after {len(pay.calls)} payment(s); "
        "expected {'status': 'paid', ...} after one payment",
    )
    r.expect(
        not pay.seen_open,
        "while pay ran, no transaction of yours was open and the stock row was free",
        f"while pay ran, {pay.seen_open[0] if pay.seen_open else ''}: a payment takes seconds, and every other buyer "
        "waits for that lock meanwhile. Commit the reservation first, then call pay with no transaction open",
    )
    stock, res = await _stock(pool, "mug"), await _reservations(pool, "mug")
    r.expect(
        stock == 0 and res == {"paid": 1},
        "stock 0, one reservation 'paid' in inventory_reservations",
        f"after one purchase: stock {stock}, reservations {res}; expected stock 0 and {{'paid': 1}}",
    )
    got = await buy(pool, "mug", "bob", "bob-1", pay)
    r.expect(
        _status(got) == "sold_out" and len(pay.calls) == 1,
        "a second buyer with another key got {'status': 'sold_out'} and paid nothing",
        f"a second buyer with 0 in stock got {got!r} after {len(pay.calls) - 1} payment(s); expected "
        "{'status': 'sold_out'} and no payment",
    )
    got = await buy(pool, "mug", "ada", "ada-1", pay)
    res = await _reservations(pool, "mug")
    r.expect(
        _status(got) == "paid" and len(pay.calls) == 1 and res == {"paid": 1},
        "the first buyer's retry with key 'ada-1' returned the paid reservation, with no new payment",
        f"the first buyer's retry with key 'ada-1' returned {got!r}, {len(pay.calls) - 1} new payment(s), "
        f"reservations {res}; expected her paid reservation again and no payment",
    )
    if r.public:
        return

    replicas = r.replicas("buy", REPLICAS)
    for stock0, n in FLASHES:
        await _check_flash(r, replicas, pool, ns, stock0, n)
    await _check_payment_failures(r, buy, pool)
    await _check_same_key(r, replicas, pool, ns)


async def _check_flash(r: Report, replicas, pool, ns, stock0: int, n: int) -> None:
    sku = f"flash-{stock0}"
    await inventory.stock_item(pool, sku, stock0)
    pay = Payments()
    r.note(
        f"{n} buyers of {stock0} unit(s) of '{sku}' at once, alternating between two replicas of buy; the check holds "
        "the stock row until every buyer waits on a lock, then lets it go, and lets each purchase commit only once "
        "every other buyer waits again"
    )
    async with Contest(ns, "inventory_items", "sku = %s", (sku,), limit=SETTLE_LIMIT) as race:
        race.start(_call_buy(replicas[i % REPLICAS], pool, sku, f"buyer-{i}", f"{sku}-key-{i}", pay) for i in range(n))
        results = await race.run()
    stock, res = await _stock(pool, sku), await _reservations(pool, sku)
    paid = res.get("paid", 0)
    held = res.get("held", 0)
    errors = [x for x in results if isinstance(x, BaseException)]
    if race.stalls:
        r.note(
            f"the buyers did not all reach a PostgreSQL lock within {SETTLE_LIMIT:g} s: some waited elsewhere "
            "(an asyncio.Lock, an Event); the row was released anyway"
        )
    if paid + held > stock0:
        r.fail(
            f"{n} concurrent buyers of {stock0} unit(s): {paid + held} reservations taken, stock now {stock}: "
            f"OVERSOLD by {paid + held - stock0}. Each buyer read the stock before the others wrote it and decided "
            "in Python"
            + (f" ({IN_PROCESS}: each replica let its own buyer through)" if race.stalls else "")
            + ". Let the database decide: UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 "
            "RETURNING stock (or lock the row with SELECT ... FOR UPDATE first)"
        )
    r.expect(
        not errors,
        f"no buyer raised ({_kinds(results)})",
        f"{n} concurrent buyers ended with {_kinds(results)}: {error_line(errors[0]) if errors else ''}. "
        "A buyer who finds no stock gets {'status': 'sold_out'}; a serialization failure (40001) is retried",
    )
    r.expect(
        paid == stock0 and stock == 0,
        f"exactly {stock0} unit(s) sold and paid, stock 0, {n - stock0} buyers told 'sold_out'",
        f"{n} concurrent buyers of {stock0} unit(s): {paid} paid, stock left {stock}; expected every unit sold "
        f"({stock0} paid, stock 0): a buyer who could not get the row at once must wait for it, not give up (a "
        "serialization failure is retried until the buyer gets a unit or sees stock 0, not a fixed number of times)",
    )
    statuses = Counter(_status(x) for x in results)
    told = ", ".join(f"{k!r}: {v}" for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0])))
    r.expect(
        statuses == Counter({"paid": stock0, "sold_out": n - stock0}),
        f"the buyers were told {{{told}}}",
        f"the buyers were told {{{told}}}; expected {stock0} x 'paid' and {n - stock0} x 'sold_out'",
    )


async def _check_payment_failures(r: Report, buy, pool) -> None:
    # --- the payment times out: the unit goes back at once ------------------------------------
    await inventory.stock_item(pool, "lamp", 1)
    pay = Payments(pool)
    pay.plan = ["timeout"]
    got = await _call_buy(buy, pool, "lamp", "cy", "cy-1", pay)
    stock, res = await _stock(pool, "lamp"), await _reservations(pool, "lamp")
    r.expect(
        _status(got) == "payment_failed" and stock == 1 and res == {"released": 1},
        "pay raised TimeoutError: buy returned 'payment_failed', the reservation is 'released', stock back to 1",
        f"pay raised TimeoutError: buy {'raised ' + error_line(got) if isinstance(got, BaseException) else f'returned {got!r}'}"
        f", reservations {res}, stock {stock}; expected {{'status': 'payment_failed', ...}}, the reservation "
        "'released' and the unit back in stock (1) for the next buyer",
    )
    got = await _call_buy(buy, pool, "lamp", "dee", "dee-1", pay)
    r.expect(
        _status(got) == "paid",
        "the next buyer then bought it ('paid')",
        f"the next buyer then got {got!r}; expected 'paid' (the unit should be back on sale)",
    )

    # --- the process dies during the payment: the reaper returns the unit after the deadline ----
    await inventory.stock_item(pool, "kite", 1)
    pay.plan = ["crash"]
    got = await _call_buy(buy, pool, "kite", "eve", "eve-1", pay)
    stock, res = await _stock(pool, "kite"), await _reservations(pool, "kite")
    r.expect(
        stock == 0 and res == {"held": 1},
        "the buyer's process died inside pay: the reservation stays 'held' and the unit stays taken",
        f"the buyer's process died inside pay (a BaseException): reservations {res}, stock {stock}; expected one "
        "'held' reservation and stock 0 (nothing else runs in a dead process)",
    )
    (soon, late) = await _one(
        pool,
        "SELECT now() + make_interval(secs => %s), now() + make_interval(secs => %s)",
        (inventory.HOLD_SECONDS - 60, inventory.HOLD_SECONDS + 60),
    )
    early = await inventory.release_expired(pool, as_of=soon)
    on_time = await inventory.release_expired(pool, as_of=late)
    stock = await _stock(pool, "kite")
    r.expect(
        not early and len(on_time) == 1 and stock == 1,
        f"the reaper left it alone a minute before the deadline and returned it a minute after "
        f"(HOLD_SECONDS = {inventory.HOLD_SECONDS:g})",
        f"the reaper (course.inventory.release_expired) released {len(early)} reservation(s) a minute before the "
        f"deadline and {len(on_time)} a minute after it (stock now {stock}); expected 0, then 1: set "
        "expires_at = now() + HOLD_SECONDS when you reserve",
    )

    # --- the deadline passes while the buyer waits for the payment -------------------------------
    await inventory.stock_item(pool, "drum", 1)
    pay.plan = ["expire-timeout"]
    await _call_buy(buy, pool, "drum", "fay", "fay-1", pay)
    stock, res = await _stock(pool, "drum"), await _reservations(pool, "drum")
    r.expect(
        stock == 1 and res == {"released": 1},
        "the reaper released the reservation while pay ran, then pay timed out: the unit came back once (stock 1)",
        f"the reaper released the reservation while pay ran, then pay timed out: stock {stock}, reservations {res}; "
        "expected stock 1. The unit was given back twice: release only a reservation that is still held "
        "(UPDATE ... SET status = 'released' WHERE id = %s AND status = 'held' RETURNING, then stock + 1 if a row "
        "came back)",
    )
    await inventory.stock_item(pool, "harp", 1)
    pay.plan = ["expire-ok"]
    got = await _call_buy(buy, pool, "harp", "gus", "gus-1", pay)
    stock, res = await _stock(pool, "harp"), await _reservations(pool, "harp")
    r.expect(
        res == {"released": 1} and stock == 1 and _status(got) == "expired",
        "the reaper released the reservation while pay ran, then pay succeeded: buy returned 'expired' (refund it), "
        "the unit stays on sale",
        f"the reaper released the reservation while pay ran, then pay succeeded: buy returned {got!r}, reservations "
        f"{res}, stock {stock}; expected {{'status': 'expired', ...}}, the reservation still 'released' and stock 1. "
        "Confirm only a reservation that is still held (... WHERE id = %s AND status = 'held'): otherwise the unit "
        "is both paid for and back on sale",
    )


async def _check_same_key(r: Report, replicas, pool, ns) -> None:
    sku, n = "retry", 6
    await inventory.stock_item(pool, sku, 5)
    pay = Payments()
    r.note(f"{n} retries of one purchase (key 'zed-1') at once, alternating replicas; 5 units in stock")
    async with Race(ns, "inventory_items", "sku = %s", (sku,), limit=SETTLE_LIMIT) as race:
        race.start(_call_buy(replicas[i % REPLICAS], pool, sku, "zed", "zed-1", pay) for i in range(n))
        results = await race.results()
    errors = [x for x in results if isinstance(x, BaseException)]
    stock, res = await _stock(pool, sku), await _reservations(pool, sku)
    r.expect(
        len(pay.calls) == 1 and sum(res.values()) == 1 and stock == 4,
        "one reservation, one payment, stock 4",
        f"{n} concurrent calls with key 'zed-1': {len(pay.calls)} payment(s), reservations {res}, stock {stock}; "
        "expected one purchase. Claim the key atomically with the reservation (INSERT ... ON CONFLICT (key) "
        "DO NOTHING RETURNING id) and answer repeats from the stored reservation",
    )
    r.expect(
        not errors,
        "no retry raised",
        f"{n} concurrent calls with one key ended with {_kinds(results)}: {error_line(errors[0]) if errors else ''}. "
        "A repeat returns the first call's reservation; use ON CONFLICT (key) DO NOTHING rather than an INSERT "
        "that fails",
    )


# ============================================================================= transfer

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
                await ledger.transfer(pool, BANK, acc, funds, f"fund-{name}")
        await _check_transfer(r, transfer, pool, ns)


async def _check_transfer(r: Report, transfer, pool, ns) -> None:
    before = await _balances(pool)
    tid = await transfer(pool, ALICE, BOB, 250, "pub-1")
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
        f"{tid} and no change: look the key up in ledger_transfers (it is UNIQUE) and return the first transfer",
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

    replicas = r.replicas("transfer", REPLICAS)
    await _check_opposite(r, replicas, pool, ns)
    await _check_overdraft_race(r, replicas, pool, ns)
    rec = await ledger.reconcile(pool)
    r.expect(
        not rec["unbalanced"] and not rec["drifted"] and rec["total"] == 0,
        "at the end: every transfer sums to zero, every cached balance equals its postings, the books sum to 0",
        f"at the end the books do not reconcile: {_books(rec)}; all postings sum to {rec['total']}",
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
                "UPDATE), or retry the whole transaction on psycopg.errors.DeadlockDetected"
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


from autograder.checks.ch10.rules import REFERENCES, RULES  # noqa: E402,F401 - the rule tables, beside the checks
