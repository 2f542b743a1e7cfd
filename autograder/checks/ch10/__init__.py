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
:data:`transfer.SURVIVOR_DEADLOCK_TIMEOUT`), so PostgreSQL aborts the same one on every run. Its retry
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

import psycopg

from autograder.checks.ch10.common import REPLICAS, SETTLE_LIMIT, _kinds, _one
from autograder.checks.ch10.rig import Contest, install_turnstile
from autograder.harness import Report, error_line, task
from course import inventory
from course.chapters.ch10 import Race
from course.idempotency import ChargeDeclined, ProviderError, SimulatedCrash
from course.kit import lab

FLASHES = ((1, 8), (6, 8))  # (units, buyers): with 6 units, a retry given up after fewer than 6 attempts sells fewer
IN_PROCESS = "state kept in one process is not shared"


# ============================================================================= buy


class Payments:
    """The ``pay`` the check passes in, and the provider behind it.

    The reservation id is the payment's key at the provider; :meth:`ask` is what the reaper
    (``course.inventory.release_expired``) asks it: the payment id charged under that key, or None.
    Each call follows the next step of ``plan`` (default ``"ok"``):

    - ``ok``: charged, the payment id returned; ``decline``: ``ChargeDeclined``, nothing charged;
    - ``timeout`` / ``reset``: charged, then the answer is lost (``TimeoutError`` / ``ConnectionResetError``);
      ``503``: ``ProviderError(503)``, nothing charged;
    - ``crash``: the process dies before the charge (``SimulatedCrash``, a BaseException);
    - ``reap-ok`` / ``reap-decline``: the payment takes longer than the hold, and the reaper asks the
      provider before the charge went through (it releases the unit); then the charge succeeds, or
      is declined;
    - ``charge-reap-ok``: the charge goes through, the reaper runs before the answer comes back and
      finds it (the reservation becomes ``paid``); then the payment id is returned.
    """

    def __init__(self, pool=None, probe_db: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.pool = pool
        self.probe_db = probe_db
        self.plan: list[str] = []
        self.charged: dict = {}  # reservation id -> payment id: the provider's own record
        self.seen_open: list[str] = []

    async def ask(self, reservation_id) -> str | None:
        return self.charged.get(reservation_id)

    async def reap(self) -> None:
        far = await _one(self.pool, "SELECT now() + make_interval(secs => %s)", (inventory.HOLD_SECONDS + 60,))
        await inventory.release_expired(self.pool, self.ask, as_of=far[0])

    async def __call__(self, buyer: str, sku: str, reservation_id) -> str:
        self.calls.append((buyer, sku, reservation_id))
        if self.probe_db:
            await self._probe(sku)
        step = self.plan.pop(0) if self.plan else "ok"
        await asyncio.sleep(0)
        payment_id = f"pay_{len(self.calls):03d}"
        if step.startswith("reap"):  # the reaper asked before the charge went through: it released the unit
            await self.reap()
        if step.endswith("decline"):
            raise ChargeDeclined(402, "the card was declined (402): nothing was charged")
        if step == "503":
            raise ProviderError(503, "the payment provider answered 503")
        if step == "crash":
            raise SimulatedCrash("the process died while waiting for the payment")
        self.charged[reservation_id] = payment_id
        if step == "charge-reap-ok":  # the answer is slow: the reaper finds the charge first
            await self.reap()
        if step == "timeout":
            raise TimeoutError("the payment provider did not answer within 5 s")
        if step == "reset":
            raise ConnectionResetError("the connection to the payment provider was reset")
        return payment_id

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
    await _check_answers(r, buy, pool)
    await _check_same_key(r, replicas, pool, ns)
    await _check_refused_reserve(r, buy, pool)


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


def _masked(got) -> str:
    """``got`` as a learner reads it, its reservation id shown as ``<its id>`` (the sequence decides it)."""
    if isinstance(got, dict) and "reservation_id" in got:
        return (
            "{" + ", ".join(f"{k!r}: {'<its id>' if k == 'reservation_id' else repr(v)}" for k, v in got.items()) + "}"
        )
    return repr(got)


def _said(got) -> str:
    return f"raised {error_line(got)}" if isinstance(got, BaseException) else f"returned {_masked(got)}"


#: The unknown outcomes buy meets: (plan step, what pay raised, whether the provider had charged).
UNKNOWN = (
    ("timeout", "TimeoutError", True),
    ("503", "ProviderError(503)", False),
    ("reset", "ConnectionResetError", True),
)


async def _check_payment_failures(r: Report, buy, pool) -> None:
    # --- a definite decline: the unit goes back at once ------------------------------------------
    await inventory.stock_item(pool, "lamp", 1)
    pay = Payments(pool)
    pay.plan = ["decline"]
    got = await _call_buy(buy, pool, "lamp", "cy", "cy-1", pay)
    stock, res = await _stock(pool, "lamp"), await _reservations(pool, "lamp")
    r.expect(
        _status(got) == "payment_failed" and stock == 1 and res == {"released": 1},
        "pay raised ChargeDeclined: buy returned 'payment_failed', the reservation is 'released', stock back to 1",
        f"pay raised ChargeDeclined (the provider answered that it did not charge): buy {_said(got)}, reservations "
        f"{res}, stock {stock}; expected {{'status': 'payment_failed', ...}}, the reservation 'released' and the "
        "unit back in stock (1) for the next buyer",
    )
    got = await _call_buy(buy, pool, "lamp", "dee", "dee-1", pay)
    r.expect(
        _status(got) == "paid",
        "the next buyer then bought it ('paid')",
        f"the next buyer then got {_masked(got)}; expected 'paid' (the unit should be back on sale)",
    )

    # --- an unknown outcome: the unit stays held, and the reaper settles it with the provider ------
    for step, raised, charged in UNKNOWN:
        sku = f"bell-{step}"
        await inventory.stock_item(pool, sku, 1)
        pay.plan = [step]
        got = await _call_buy(buy, pool, sku, "eli", f"eli-{step}", pay)
        stock, res = await _stock(pool, sku), await _reservations(pool, sku)
        if res.get("released") or stock:
            r.fail(
                f"pay raised {raised}: buy {_said(got)} and gave the unit back (reservations {res}, stock {stock}). "
                "That is an unknown outcome, not a decline: the provider may have charged the card"
                f"{' (it did, here)' if charged else ''}, and the unit would then be sold to the next buyer as "
                "well. Release only on ChargeDeclined; keep the reservation 'held' and return "
                "{'status': 'payment_unknown', ...}: the reaper asks the provider under the same key"
            )
        r.expect(
            _status(got) == "payment_unknown" and res == {"held": 1},
            f"pay raised {raised}: buy returned 'payment_unknown' and kept the reservation 'held' (stock 0)",
            f"pay raised {raised}: buy {_said(got)}, reservations {res}, stock {stock}; expected "
            "{'status': 'payment_unknown', 'reservation_id': ...} and the reservation still 'held' with its unit",
        )
    far = await _one(pool, "SELECT now() + make_interval(secs => %s)", (inventory.HOLD_SECONDS + 60,))
    reaped = await inventory.release_expired(pool, pay.ask, as_of=far[0])
    settled = {step: await _reservations(pool, f"bell-{step}") for step, _, _ in UNKNOWN}
    want = {step: ({"paid": 1} if charged else {"released": 1}) for step, _, charged in UNKNOWN}
    r.expect(
        settled == want,
        "after the deadline the reaper asked the provider: the two charged reservations became 'paid', the "
        "uncharged one 'released'",
        f"after the deadline the reaper asked the provider (charged under the timed-out and the reset keys, not "
        f"under the 503's) and left {settled} (it settled {len(reaped.paid)} paid, {len(reaped.released)} "
        f"released); expected {want}"
        + (
            ": the reaper found none of them past its deadline a minute after HOLD_SECONDS; set "
            "expires_at = now() + HOLD_SECONDS when you reserve"
            if all(v == {"held": 1} for v in settled.values())
            else ""
        ),
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
    early = await inventory.release_expired(pool, pay.ask, as_of=soon)
    on_time = await inventory.release_expired(pool, pay.ask, as_of=late)
    stock = await _stock(pool, "kite")
    r.expect(
        not early.released and len(on_time.released) == 1 and stock == 1,
        f"the reaper left it alone a minute before the deadline and returned it a minute after "
        f"(HOLD_SECONDS = {inventory.HOLD_SECONDS:g})",
        f"the reaper (course.inventory.release_expired) released {len(early.released)} reservation(s) a minute "
        f"before the deadline and {len(on_time.released)} a minute after it (stock now {stock}); expected 0, then "
        "1: set expires_at = now() + HOLD_SECONDS when you reserve",
    )

    # --- the deadline passes while the buyer waits for the payment -------------------------------
    await inventory.stock_item(pool, "drum", 1)
    pay.plan = ["reap-decline"]
    got = await _call_buy(buy, pool, "drum", "fay", "fay-1", pay)
    stock, res = await _stock(pool, "drum"), await _reservations(pool, "drum")
    r.expect(
        stock == 1 and res == {"released": 1},
        "the reaper released the reservation while pay ran, then the card was declined: the unit came back once "
        "(stock 1)",
        f"the reaper released the reservation while pay ran, then the card was declined: buy {_said(got)}, stock "
        f"{stock}, reservations {res}; expected stock 1. The unit was given back twice: release only a reservation "
        "that is still held (UPDATE ... SET status = 'released' WHERE id = %s AND status = 'held' RETURNING, then "
        "stock + 1 if a row came back)",
    )
    await inventory.stock_item(pool, "harp", 1)
    pay.plan = ["reap-ok"]
    got = await _call_buy(buy, pool, "harp", "gus", "gus-1", pay)
    stock, res = await _stock(pool, "harp"), await _reservations(pool, "harp")
    r.expect(
        res == {"released": 1} and stock == 1 and _status(got) == "expired",
        "the reaper released the reservation before the charge went through, then pay succeeded: buy returned "
        "'expired' (refund it), the unit stays on sale",
        f"the reaper released the reservation before the charge went through, then pay succeeded: buy "
        f"{_said(got)}, reservations {res}, stock {stock}; expected {{'status': 'expired', ...}}, the reservation still "
        "'released' and stock 1. Confirm only a reservation that is still held (... WHERE id = %s AND status = "
        "'held'): otherwise the unit is both paid for and back on sale",
    )
    await inventory.stock_item(pool, "oboe", 1)
    pay.plan = ["charge-reap-ok"]
    got = await _call_buy(buy, pool, "oboe", "hew", "hew-1", pay)
    stock, res = await _stock(pool, "oboe"), await _reservations(pool, "oboe")
    r.expect(
        res == {"paid": 1} and stock == 0 and _status(got) == "paid",
        "the charge went through and the reaper found it before pay returned: buy returned 'paid', the unit stays sold",
        f"the charge went through, and the reaper asked the provider before pay returned, found the charge and "
        f"marked the reservation 'paid'; then buy {_said(got)} (reservations {res}, stock {stock}). Expected "
        "{'status': 'paid', ...}: the purchase is paid and its unit sold, and 'expired' would make the caller "
        "refund it. When the confirm finds the reservation no longer held, answer from the row: 'paid' if it is "
        "paid, 'expired' if it was released",
    )


async def _stored(pool, key: str) -> tuple | None:
    return await _one(pool, "SELECT id, status, payment_id FROM inventory_reservations WHERE key = %s", (key,))


def _answers(got, want: dict) -> list[str]:
    """What of ``want`` (key -> value) the dict ``got`` lacks or gets wrong; extra keys are fine."""
    if not isinstance(got, dict):
        return [f"it is not a dict: {got!r}"]
    return [
        f"{k!r} is {got[k]!r}, expected {v!r}" if k in got else f"no {k!r}" for k, v in want.items() if got.get(k) != v
    ]


def _shape(want: dict) -> str:
    """``want`` with the reservation's id as ``<its id>``: ids come from a sequence, not from the answer's logic."""
    return "{" + ", ".join(f"{k!r}: {'<its id>' if k == 'reservation_id' else repr(v)}" for k, v in want.items()) + "}"


async def _check_answers(r: Report, buy, pool) -> None:
    # --- what buy returns, key by key, and what a repeat of each kind of key returns ---------------
    sku = "shape"
    await inventory.stock_item(pool, sku, 4)
    pay = Payments()
    r.note(
        "one purchase that pays, one whose card is declined, one whose payment times out, one whose process dies in "
        "pay; then a repeat of each key"
    )
    pay.plan = ["ok", "decline", "timeout", "crash"]
    buyers = ("hal", "ian", "kim", "jo")
    first = {}
    for buyer in buyers:
        first[buyer] = await _call_buy(buy, pool, sku, buyer, f"{buyer}-1", pay)
    rows = {buyer: await _stored(pool, f"{buyer}-1") for buyer in buyers}
    if not all(rows.values()):
        r.fail(f"after four purchases of '{sku}' the reservations are {rows}; expected one per key")
    (hal_id, _, hal_pay), (ian_id, _, _), (kim_id, _, _), (jo_id, _, _) = (rows[b] for b in buyers)
    for buyer, want in (
        ("hal", {"status": "paid", "reservation_id": hal_id, "payment_id": hal_pay}),
        ("ian", {"status": "payment_failed", "reservation_id": ian_id}),
        ("kim", {"status": "payment_unknown", "reservation_id": kim_id}),
    ):
        wrong = _answers(first[buyer], want)
        r.expect(
            not wrong,
            f"{buyer}'s purchase returned {_shape(want)}",
            f"{buyer}'s purchase returned {first[buyer]!r}: {'; '.join(wrong)}. The task's text gives the dict for "
            "each outcome, with the reservation's id (inventory_reservations.id) and the payment_id pay returned",
        )
    calls = len(pay.calls)
    for buyer, want in (
        ("hal", {"status": "paid", "reservation_id": hal_id}),
        ("ian", {"status": "released", "reservation_id": ian_id}),
        ("kim", {"status": "held", "reservation_id": kim_id}),
        ("jo", {"status": "held", "reservation_id": jo_id}),
    ):
        got = await _call_buy(buy, pool, sku, buyer, f"{buyer}-1", pay)
        wrong = _answers(got, want)
        if len(pay.calls) != calls:
            wrong.append(f"pay was called again ({len(pay.calls) - calls} time(s))")
            calls = len(pay.calls)
        r.expect(
            not wrong,
            f"a repeat of {buyer}-1 returned {_shape(want)}, without paying",
            f"a repeat of key {buyer}-1, whose reservation is '{want['status']}', returned {got!r}: {'; '.join(wrong)}. "
            "A repeat returns its reservation as it stands, {'status': <its status>, 'reservation_id': <its id>}, "
            "without paying again",
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


#: Triggers that make the database refuse one write of the reservation step, for one sku each.
REFUSE_RESERVE = """
CREATE OR REPLACE FUNCTION ch10_refuse_stock() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.sku = 'refused-stock' AND NEW.stock < OLD.stock THEN
        RAISE EXCEPTION 'the database refused this stock update (injected by the check)';
    END IF;
    RETURN NEW;
END $$;
CREATE OR REPLACE FUNCTION ch10_refuse_reservation() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.sku = 'refused-insert' THEN
        RAISE EXCEPTION 'the database refused this reservation (injected by the check)';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS ch10_refuse_reserve ON inventory_items;
CREATE TRIGGER ch10_refuse_reserve BEFORE UPDATE ON inventory_items
    FOR EACH ROW EXECUTE FUNCTION ch10_refuse_stock();
DROP TRIGGER IF EXISTS ch10_refuse_reserve ON inventory_reservations;
CREATE TRIGGER ch10_refuse_reserve BEFORE INSERT ON inventory_reservations
    FOR EACH ROW EXECUTE FUNCTION ch10_refuse_reservation();
"""


async def _check_refused_reserve(r: Report, buy, pool) -> None:
    # --- one transaction: when either write of the reservation step fails, nothing stays written ------
    refusals = (("refused-stock", "the stock update"), ("refused-insert", "the reservation's INSERT"))
    for sku, _ in refusals:
        await inventory.stock_item(pool, sku, 2)
    async with pool.connection() as conn:
        await conn.execute(REFUSE_RESERVE)
    try:
        for sku, what in refusals:
            pay = Payments()
            r.note(f"buy(pool, '{sku}', 'eve', 'eve-{sku}', pay) with 2 in stock: the database refuses {what}")
            got = await _call_buy(buy, pool, sku, "eve", f"eve-{sku}", pay)
            stock, res = await _stock(pool, sku), await _reservations(pool, sku)
            shown = f"raised {error_line(got)}" if isinstance(got, BaseException) else f"returned {got!r}"
            r.expect(
                stock == 2 and not res and not pay.calls,
                f"when the database refused {what}, buy {shown} and left nothing written (stock 2, no reservation)",
                f"when the database refused {what}, buy {shown} and left stock {stock}, reservations {res}"
                f"{f', after {len(pay.calls)} payment(s)' if pay.calls else ''}; expected stock 2 and no reservation. "
                "The reservation and the stock update were committed separately, so one stayed when the other "
                "failed: insert the reservation and take the unit in one transaction (async with conn.transaction())",
            )
    finally:
        async with pool.connection() as conn:
            await conn.execute("DROP TRIGGER IF EXISTS ch10_refuse_reserve ON inventory_items")
            await conn.execute("DROP TRIGGER IF EXISTS ch10_refuse_reserve ON inventory_reservations")


from autograder.checks.ch10 import transfer  # noqa: E402,F401 - registers the transfer task, after buy
from autograder.checks.ch10.rules import REFERENCES, RULES  # noqa: E402,F401 - the rule tables, beside the checks

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 2
