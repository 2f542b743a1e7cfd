"""Chapter 10 (contention and money): the races, measurements and plots the notebook shows.

The patterns are :mod:`course.inventory` (conditional update, reservations, the Redis gate,
stock buckets) and :mod:`course.ledger` (double-entry transfers, reconciliation). This
module holds what exists to show them:

- :class:`Race`: concurrent callers held on a row this module has locked, released once
  every one of them waits on a PostgreSQL lock (the chapter's checks use it too), so a
  read-then-write loses every time, not by luck;
- the buyers compared in the oversell table (:data:`BUYERS`): read-then-write, conditional
  update, ``SELECT ... FOR UPDATE``, REPEATABLE READ and SERIALIZABLE with bounded retries, and
  :func:`oversell`;
- :func:`serializable_load`: N workers buying at once under SERIALIZABLE, aborts counted;
- :func:`deadlock_demo`: two transfers that lock two accounts in opposite order, step by step;
- :func:`hot_row_load`: purchases per second on one stock row against stock in buckets;
- :func:`gate_demo`: the Redis ``DECR`` gate in front of PostgreSQL, a crash between the two,
  and the reconciliation;
- :class:`CardProvider`: a stand-in payment provider (a decline, a charge whose answer is lost,
  a buyer who dies) that the reaper can ask what it charged;
- :func:`bookings_demo`: time slots guarded by an exclusion constraint;
- the plots of all of these.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import psycopg

from course import inventory
from course.backoff import FullJitter
from course.idempotency import ChargeDeclined, SimulatedCrash
from course.kit.lab import LOCK_WAITERS
from course.kit.plotting import COLORS, figure, legend_outside

# ----------------------------------------------------------------------------- a race that happens every time


#: The wait between two attempts of a transaction PostgreSQL aborted: 1 ms doubling to 50 ms, full jitter.
RETRY_BACKOFF = FullJitter(base=0.001, cap=0.05)


class Race:
    """Hold the rows ``SELECT 1 FROM table WHERE where`` selects; start callers; release once all wait.

        async with Race(ns, "inventory_items", "sku = %s", ("mug",)) as race:
            race.start(buy(...) for _ in range(10))
            results = await race.results()   # waits until all 10 are blocked, then lets the row go

    ``held()`` returns once every unfinished caller waits on a PostgreSQL lock (or after
    ``limit`` real seconds, counted in ``stalls``: a caller waiting on something else, such as
    an ``asyncio.Lock``). Start a second wave after ``held()`` to order two waves.
    """

    def __init__(self, ns, table: str, where: str, params: tuple, *, limit: float = 3.0) -> None:
        self.ns, self.table, self.where, self.params, self.limit = ns, table, where, params, limit
        self.tasks: list[asyncio.Task] = []
        self.stalls = 0
        self.released = False

    async def __aenter__(self) -> Race:
        self.watcher = await psycopg.AsyncConnection.connect(self.ns.database_url, autocommit=True)
        self.locker = await psycopg.AsyncConnection.connect(self.ns.database_url, autocommit=True)
        await self.locker.execute("BEGIN")
        await self.locker.execute(
            f"SELECT 1 FROM {self.table} WHERE {self.where} FOR NO KEY UPDATE", self.params
        )
        return self

    async def __aexit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            await self.release()
        for t in self.tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.locker.close()
        await self.watcher.close()

    def start(self, calls) -> None:
        self.tasks += [asyncio.ensure_future(c) for c in calls]

    async def waiting(self) -> int:
        cur = await self.watcher.execute(LOCK_WAITERS)
        return (await cur.fetchone())[0]

    async def held(self) -> None:
        deadline = time.monotonic() + self.limit
        while True:
            await asyncio.sleep(0.005)
            running = sum(not t.done() for t in self.tasks)
            if await self.waiting() >= running:
                return
            if time.monotonic() > deadline:
                self.stalls += 1
                return

    async def release(self) -> None:
        if not self.released:
            self.released = True
            await self.locker.execute("COMMIT")

    async def results(self) -> list:
        await self.held()
        await self.release()
        return await asyncio.gather(*self.tasks, return_exceptions=True)


# ----------------------------------------------------------------------------- four buyers of one unit


async def buy_read_then_write(pool, sku: str) -> bool:
    """The bug: read the stock, decide in Python, write the new value back."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s", (sku,))
        (stock,) = await cur.fetchone()
        if stock <= 0:
            return False
        await conn.execute("UPDATE inventory_items SET stock = %s WHERE sku = %s", (stock - 1, sku))
        return True


async def buy_conditional(pool, sku: str) -> bool:
    """The fix in one statement: the WHERE is evaluated again once the row's lock is ours."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "UPDATE inventory_items SET stock = stock - 1 WHERE sku = %s AND stock > 0 RETURNING stock",
            (sku,),
        )
        return await cur.fetchone() is not None


async def buy_for_update(pool, sku: str) -> bool:
    """Read-then-write made safe: lock the row first, so the read is the latest value."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s FOR UPDATE", (sku,))
        (stock,) = await cur.fetchone()
        if stock <= 0:
            return False
        await conn.execute("UPDATE inventory_items SET stock = %s WHERE sku = %s", (stock - 1, sku))
        return True


@dataclass
class Tries:
    attempts: int = 0
    aborts: int = 0


async def buy_serializable(
    pool, sku: str, tries: Tries | None = None, *, level: str = "SERIALIZABLE", attempts: int = 30
) -> bool:
    """Read-then-write under SERIALIZABLE: PostgreSQL aborts the losers with 40001; retry them.

    ``level="REPEATABLE READ"`` aborts them too: an UPDATE of a row that another transaction
    changed after this one's snapshot fails with 40001 ("could not serialize access due to
    concurrent update"), so the lost update cannot happen there either. The retry is bounded
    (``attempts``) and waits a full-jitter backoff between attempts (chapter 01), so a crowd of
    losers does not come back at the same instant, and a row that stays contended ends in an
    error instead of a loop that never gives up.
    """
    tries = tries if tries is not None else Tries()
    async with pool.connection() as conn:
        for attempt in range(attempts):
            tries.attempts += 1
            try:
                async with conn.transaction():
                    await conn.execute(f"SET TRANSACTION ISOLATION LEVEL {ISOLATION[level]}")
                    cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s", (sku,))
                    (stock,) = await cur.fetchone()
                    if stock <= 0:
                        return False
                    await conn.execute(
                        "UPDATE inventory_items SET stock = %s WHERE sku = %s", (stock - 1, sku)
                    )
                    return True
            except psycopg.errors.SerializationFailure:
                tries.aborts += 1
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(RETRY_BACKOFF.delay(attempt))
    raise AssertionError("unreachable")


ISOLATION = {"SERIALIZABLE": "SERIALIZABLE", "REPEATABLE READ": "REPEATABLE READ"}


async def buy_repeatable_read(pool, sku: str, tries: Tries | None = None) -> bool:
    """The same read-then-write under REPEATABLE READ, which also aborts the lost update with 40001."""
    return await buy_serializable(pool, sku, tries, level="REPEATABLE READ")


BUYERS: dict[str, Callable[..., Awaitable[bool]]] = {
    "read, then write": buy_read_then_write,
    "conditional UPDATE": buy_conditional,
    "SELECT ... FOR UPDATE": buy_for_update,
    "REPEATABLE READ + retry": buy_repeatable_read,
    "SERIALIZABLE + retry": buy_serializable,
}


@dataclass
class Sale:
    strategy: str
    buyers: int
    stock: int
    sold: int
    left: int
    aborts: int = 0

    @property
    def oversold(self) -> int:
        return max(0, self.sold - self.stock)


async def oversell(ns, pool, strategy: str, *, stock: int = 1, buyers: int = 10) -> Sale:
    """``buyers`` concurrent buyers of ``stock`` units with one strategy, the row held until all wait."""
    sku = "demo-" + "".join(c if c.isalnum() else "-" for c in strategy.lower())
    await inventory.stock_item(pool, sku, stock)
    tries = Tries()
    fn = BUYERS[strategy]
    async with Race(ns, "inventory_items", "sku = %s", (sku,)) as race:
        if fn in (buy_serializable, buy_repeatable_read):
            race.start(fn(pool, sku, tries) for _ in range(buyers))
        else:
            race.start(fn(pool, sku) for _ in range(buyers))
        results = await race.results()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT stock FROM inventory_items WHERE sku = %s", (sku,))
        (left,) = await cur.fetchone()
    return Sale(strategy, buyers, stock, sum(r is True for r in results), left, tries.aborts)


def plot_oversell(sales: list[Sale]):
    fig, ax = figure(8, 2.6)
    names = [s.strategy for s in sales][::-1]
    sold = [s.sold for s in sales][::-1]
    colors = [COLORS["bad"] if s.oversold else COLORS["ok"] for s in sales][::-1]
    bars = ax.barh(names, sold, color=colors)
    ax.bar_label(bars, labels=[f"{n} sold" for n in sold], padding=3)
    ax.axvline(sales[0].stock, color=COLORS["neutral"], linestyle=":", label=f"stock: {sales[0].stock} unit")
    ax.set_xlabel(f"units sold to {sales[0].buyers} concurrent buyers (the row held until all of them wait)")
    ax.set_xlim(0, max(sold) * 1.25 + 1)
    legend_outside(ax)
    return fig


# ----------------------------------------------------------------------------- SERIALIZABLE under load


@dataclass
class Load:
    label: str
    workers: int
    done: int
    attempts: int
    aborts: int
    seconds: float

    @property
    def abort_rate(self) -> float:
        return self.aborts / self.attempts if self.attempts else 0.0

    @property
    def per_second(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0


async def serializable_load(pool, workers: int, buys_each: int, *, serializable: bool = True) -> Load:
    """``workers`` concurrent buyers, each buying ``buys_each`` units of a deep stock, one after another."""
    sku = f"load-{workers}"
    await inventory.stock_item(pool, sku, workers * buys_each + 10)
    tries = Tries()

    async def worker() -> int:
        n = 0
        for _ in range(buys_each):
            if serializable:
                n += await buy_serializable(pool, sku, tries)
            else:
                tries.attempts += 1
                n += await buy_conditional(pool, sku)
        return n

    t0 = time.perf_counter()
    done = sum(await asyncio.gather(*(worker() for _ in range(workers))))
    label = "SERIALIZABLE + retry" if serializable else "conditional UPDATE"
    return Load(label, workers, done, tries.attempts, tries.aborts, time.perf_counter() - t0)


def plot_aborts(loads: list[Load]):
    fig, ax = figure(8, 2.8)
    for label, color, marker in (
        ("SERIALIZABLE + retry", COLORS["bad"], "o"),
        ("conditional UPDATE", COLORS["ok"], "s"),
    ):
        rows = [x for x in loads if x.label == label]
        ax.plot(
            [x.workers for x in rows],
            [100 * x.abort_rate for x in rows],
            marker=marker,
            color=color,
            label=label,
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        sorted({x.workers for x in loads}), labels=[str(w) for w in sorted({x.workers for x in loads})]
    )
    ax.set_xlabel("concurrent buyers of one stock row")
    ax.set_ylabel("attempts aborted (%)")
    ax.set_ylim(-5, 100)
    legend_outside(ax)
    return fig


# ----------------------------------------------------------------------------- the ledger's demo accounts


async def fresh_ledger(pool, accounts: dict[int, tuple[str, int]]) -> None:
    """Start the ledger over (every run of the notebook reads the same): drop its tables, create
    them again, open ``accounts`` ({id: (name, opening balance)}) funded from a bank account (id 0)."""
    from course import ledger

    async with pool.connection() as conn:
        await conn.execute("DROP TABLE IF EXISTS ledger_postings, ledger_transfers, ledger_accounts")
    await ledger.setup_schema(pool)
    await ledger.open_account(pool, 0, "bank", allow_negative=True)
    for account_id, (name, opening) in accounts.items():
        await ledger.open_account(pool, account_id, name)
        if opening:
            await ledger.transfer(pool, 0, account_id, opening, f"open-{account_id}")


# ----------------------------------------------------------------------------- a deadlock, step by step


async def deadlock_demo(ns, *, ordered: bool) -> list[str]:
    """Transfer 1 -> 2 in session A and 2 -> 1 in session B, step by step; what each step did.

    Unordered, each locks its source account first: A holds 1 and waits for 2 while B holds 2
    and asks for 1. Ordered, both lock the smaller id first, so B queues behind A instead.
    B's ``deadlock_timeout`` is short and A's long, so it is B that finds the cycle.
    """
    log: list[str] = []
    a = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    b = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    watch = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    debit = "UPDATE ledger_accounts SET balance = balance - 10 WHERE id = %s"
    credit = "UPDATE ledger_accounts SET balance = balance + 10 WHERE id = %s"

    async def until_waiting(n: int) -> None:
        for _ in range(600):
            if (await (await watch.execute(LOCK_WAITERS)).fetchone())[0] >= n:
                return
            await asyncio.sleep(0.005)

    try:
        await a.execute("SET deadlock_timeout = '5s'")
        await b.execute("SET deadlock_timeout = '100ms'")
        await a.execute("BEGIN")
        await b.execute("BEGIN")
        await a.execute(debit, (1,))
        log.append("A (1 -> 2): locks account 1")
        if ordered:
            b_first = asyncio.ensure_future(b.execute(credit, (1,)))
            await until_waiting(1)
            log.append("B (2 -> 1): asks for account 1 first (smaller id): waits for A")
            await a.execute(credit, (2,))
            await a.execute("COMMIT")
            log.append("A: locks account 2, commits")
            await b_first
            await b.execute(debit, (2,))
            await b.execute("COMMIT")
            log.append("B: gets account 1, locks account 2, commits. No cycle, no deadlock")
            return log
        await b.execute(debit, (2,))
        log.append("B (2 -> 1): locks account 2")
        a_second = asyncio.ensure_future(a.execute(credit, (2,)))
        await until_waiting(1)
        log.append("A: asks for account 2: waits for B")
        t0 = time.perf_counter()
        try:
            await b.execute(credit, (1,))
            log.append("B: got account 1 (unexpected)")
            await b.execute("COMMIT")
        except psycopg.errors.DeadlockDetected as err:
            ms = (time.perf_counter() - t0) * 1000
            log.append("B: asks for account 1: waits for A, which waits for B. A cycle")
            log.append(f"after {ms:.0f} ms PostgreSQL aborts B: {err.sqlstate} {str(err).splitlines()[0]}")
            await b.execute("ROLLBACK")
        await a_second
        await a.execute("COMMIT")
        log.append("A: gets account 2 and commits. B's transfer must run again")
        return log
    finally:
        for conn in (a, b, watch):
            with contextlib.suppress(Exception):
                await conn.close()


# ----------------------------------------------------------------------------- one hot row against buckets


async def hot_row_load(
    pool,
    *,
    buckets: int,
    workers: int,
    seconds: float,
    hold_ms: float = 2.0,
    rand: random.Random | None = None,
) -> float:
    """Purchases per second: ``workers`` buyers on one stock row (``buckets=1``) or spread over buckets.

    Each purchase is a transaction that takes a unit and then holds its row lock ``hold_ms``
    (``pg_sleep`` stands in for the rest of the purchase: the order insert, the commit's fsync
    and round trip). Stock is deep, so nobody runs out.
    """
    rand = rand or random.Random(10)
    sku = f"hot-{buckets}"
    await inventory.stock_buckets(pool, sku, 10**6, buckets)
    stop = time.perf_counter() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        async with pool.connection() as conn:
            while time.perf_counter() < stop:
                async with conn.transaction():
                    cur = await conn.execute(
                        "UPDATE inventory_buckets SET stock = stock - 1 WHERE sku = %s AND bucket = %s AND stock > 0 "
                        "RETURNING 1",
                        (sku, rand.randrange(buckets)),
                    )
                    if await cur.fetchone() is not None:
                        await conn.execute("SELECT pg_sleep(%s)", (hold_ms / 1000,))
                        done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return done / (time.perf_counter() - t0)


def plot_hot_row(rates: dict[int, float], workers: int, hold_ms: float):
    fig, ax = figure(8, 2.6)
    labels = [("one row" if b == 1 else f"{b} buckets") for b in rates]
    bars = ax.barh(
        labels[::-1], list(rates.values())[::-1], color=[COLORS["fix"]] * (len(rates) - 1) + [COLORS["bad"]]
    )
    ax.bar_label(bars, labels=[f"{v:.0f}/s" for v in list(rates.values())[::-1]], padding=3)
    ax.set_xlabel(
        f"purchases per second, {workers} concurrent buyers, each holding its row lock {hold_ms:g} ms or more"
    )
    ax.set_xlim(0, max(rates.values()) * 1.3)
    return fig


# ----------------------------------------------------------------------------- a payment provider for the demo


class CardProvider:
    """A stand-in payment provider for the reservation demo: what it does per buyer, and what it remembers.

    ``pay(buyer, sku, reservation_id)`` is the payment call of :func:`course.inventory.buy` (the
    reservation id is its idempotency key); ``ask(reservation_id)`` is what the reaper asks: the
    payment id charged under that key, or None. Per buyer: ``"ok"``; ``"decline"``
    (``ChargeDeclined``: nothing charged); ``"lost"`` (charged, then the answer is lost on the way
    back: ``TimeoutError``); ``"dies"`` (the buyer's process dies before the charge).
    """

    def __init__(self, plan: dict[str, str]) -> None:
        self.plan = plan
        self.charged: dict[int, str] = {}

    async def pay(self, buyer: str, sku: str, reservation_id: int) -> str:
        what = self.plan.get(buyer, "ok")
        if what == "decline":
            raise ChargeDeclined(402, "the card was declined (402): nothing was charged")
        if what == "dies":
            raise SimulatedCrash("the buyer's process was killed while paying")
        self.charged[reservation_id] = f"pay-{reservation_id}"
        if what == "lost":
            raise TimeoutError("the provider charged the card, but its answer never came back within 5 s")
        return self.charged[reservation_id]

    async def ask(self, reservation_id: int) -> str | None:
        return self.charged.get(reservation_id)


# ----------------------------------------------------------------------------- time slots: an exclusion constraint

#: A room may not be booked twice for overlapping times, enforced by a GiST index. ``room WITH =``
#: on a plain integer needs the ``btree_gist`` extension, which this embedded server does not ship;
#: the room as a one-point range (``int4range(room, room, '[]')``) uses the built-in range opclass.
BOOKINGS = """
CREATE TABLE IF NOT EXISTS ch10_bookings (
    id     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    room   integer NOT NULL,
    guest  text NOT NULL,
    during tstzrange NOT NULL,
    CONSTRAINT ch10_no_double_booking EXCLUDE USING gist (int4range(room, room, '[]') WITH =, during WITH &&)
);
"""


async def bookings_demo(pool, guests: int = 6) -> dict:
    """``guests`` book room 7 at once for overlapping hours; then a back-to-back slot and another room.

    The exclusion constraint lets one overlapping booking commit and refuses the rest with
    ``23P01 exclusion_violation``, however the inserts interleave: a waiting insert checks the
    winner's row once the winner commits. Two inserts that each wrote their row before checking
    wait for each other, and PostgreSQL breaks that with ``40P01`` (counted in ``"deadlocks"``);
    the retry then meets the winner's committed row and gets ``23P01``.
    """
    async with pool.connection() as conn:
        await conn.execute(BOOKINGS)
        await conn.execute("TRUNCATE ch10_bookings")
    deadlocks = 0

    async def book(room: int, guest: str, start: int, end: int) -> str:
        nonlocal deadlocks
        for _ in range(5):
            try:
                async with pool.connection() as conn:
                    await conn.execute(
                        "INSERT INTO ch10_bookings (room, guest, during) VALUES "
                        "(%s, %s, tstzrange('2026-03-01'::timestamptz + make_interval(hours => %s), "
                        "'2026-03-01'::timestamptz + make_interval(hours => %s)))",
                        (room, guest, start, end),
                    )
                return "booked"
            except psycopg.errors.ExclusionViolation:
                return "refused (23P01)"
            except psycopg.errors.DeadlockDetected:  # both checked each other's row: one is aborted, retry it
                deadlocks += 1
                await asyncio.sleep(RETRY_BACKOFF.delay(0))
        return "gave up (40P01 five times)"

    crowd = await asyncio.gather(*(book(7, f"guest-{i}", 10 + i % 2, 12 + i % 2) for i in range(guests)))
    after = await book(7, "late", 13, 14)  # starts when the 11-13 or 10-12 slot ends or later: no overlap
    other = await book(8, "elsewhere", 10, 12)
    return {"crowd": crowd, "back_to_back": after, "other_room": other, "deadlocks": deadlocks}


# ----------------------------------------------------------------------------- the Redis gate


@dataclass
class GateRun:
    buyers: int
    stock: int
    let_through: int = 0
    sold: int = 0
    turned_away: int = 0
    db_calls: int = 0
    log: list[str] = field(default_factory=list)


async def gate_demo(pool, redis, *, stock: int, buyers: int) -> GateRun:
    """``buyers`` at once through the DECR gate; only those it lets through reach PostgreSQL."""
    sku = "gated"
    await inventory.stock_item(pool, sku, stock)
    await inventory.gate_open(redis, sku, stock)
    run = GateRun(buyers, stock)

    async def one() -> None:
        if not await inventory.gate_take(redis, sku):
            run.turned_away += 1
            return
        run.let_through += 1
        run.db_calls += 1
        if await buy_conditional(pool, sku):  # the database still decides
            run.sold += 1

    await asyncio.gather(*(one() for _ in range(buyers)))
    return run
