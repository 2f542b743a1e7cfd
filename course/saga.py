"""Orchestrated sagas with a saga log in PostgreSQL (chapter 06).

A saga replaces one distributed transaction by a sequence of **local** transactions, each
paired with a **compensation** that semantically undoes it (Garcia-Molina and Salem,
"Sagas", SIGMOD 1987). Nothing is locked across services; the price is that other
readers can see the saga half-way (an order that is reserved but not yet paid).

The orchestrator here is the reference design of the chapter:

1. Every decision goes to an append-only **saga log** (``saga_log``) *before* the next
   action, so a new process can tell where a saga stood when its orchestrator died:

   ====================  ============================================================
   ``(saga, begin)``     the saga exists; ``data`` holds its input (the order)
   ``(step, started)``   the step is about to run: it may or may not have committed
   ``(step, done)``      the step's local transaction committed
   ``(step, failed)``    the step said no (:class:`StepFailed`): turn around
   ``(step, compensated)``  the step's compensation committed
   ``(saga, completed)`` / ``(saga, compensated)``  the final row: nothing left to do
   ====================  ============================================================

2. Steps run in order. A step that raises :class:`StepFailed` (a business "no": out of
   stock, card declined) turns the saga around: every step that was *started* is
   compensated, **in reverse order**, the failed one included (its compensation finds
   nothing to undo). Any other exception is a fault, not an answer: it propagates, and
   :meth:`Orchestrator.recover` finishes the saga later.
3. A compensation is retried with backoff until it succeeds (it has no business reason
   to fail; only transient ones). So steps and compensations must be **idempotent**:
   recovery may run a step, or a compensation, that already committed.
4. :meth:`Orchestrator.recover` reads the log and finishes every saga without a final
   row: forward from the first step not ``done`` when nothing failed yet (it re-runs the
   step that was ``started``), otherwise on with the compensation. Two recoverers never
   drive one saga at once (a session advisory lock per saga).

This is Chris Richardson's orchestration-based saga (microservices.io, "Pattern: Saga")
with Caitie McCaffrey's saga log ("Distributed Sagas: A Protocol for Coordinating
Microservices", 2017). Durable-execution engines such as Temporal keep the same log for
you (its event history) and replay it after a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import psycopg
import psycopg.errors
from psycopg.types.json import Jsonb

from course.backoff import Backoff, FullJitter

SCHEMA = """
CREATE TABLE IF NOT EXISTS saga_log (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    saga_id text NOT NULL,
    step    text NOT NULL,
    event   text NOT NULL CHECK (event IN ('begin', 'started', 'done', 'failed', 'compensated', 'completed')),
    data    jsonb,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS saga_log_by_saga ON saga_log (saga_id, id);
"""

#: The ``step`` of the rows about the saga as a whole (begin, completed, compensated).
SAGA = "saga"
FINAL = ("completed", "compensated")


async def setup_schema(pool) -> None:
    """Create ``saga_log`` (idempotent). Async: pass a pool or an ``AsyncConnection``."""
    if hasattr(pool, "connection") and not hasattr(pool, "execute"):
        async with pool.connection() as conn:
            await conn.execute(SCHEMA)
        return
    await pool.execute(SCHEMA)


class StepFailed(Exception):
    """A step said no (out of stock, card declined): a business outcome, so the saga compensates."""


class SagaBusy(Exception):
    """Another orchestrator (a live instance, or a recoverer) is driving this saga right now."""


#: Errors a step's action is retried on (a bounded number of times): the network, a timeout,
#: a lost database connection.
TRANSIENT: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    ConnectionError,
    psycopg.OperationalError,
)

#: Errors that are bugs, not weather: a compensation that raises one is not retried forever
#: (that only hides the bug); the saga stops where it is, logged and unfinished, and recover()
#: finishes it once the fix is deployed. Every other error of a compensation is retried.
BUGS: tuple[type[BaseException], ...] = (
    TypeError,
    NameError,
    AttributeError,
    KeyError,
    IndexError,
    AssertionError,
    NotImplementedError,
    psycopg.errors.SyntaxErrorOrAccessRuleViolation,  # SQLSTATE class 42: bad SQL, a missing table or column
)


@asynccontextmanager
async def claimed(pool, saga_id: str):
    """Hold the saga's advisory lock on a connection of its own while the body runs; yields
    False (and holds nothing) when another orchestrator holds it.

    run() and recover() take the same lock, so a restarting instance's recovery never drives
    a saga that a live instance is still running (and two recoverers never drive one saga).
    A crashed holder's session ends and PostgreSQL releases its lock with it.
    """
    async with pool.connection() as claim:
        cur = await claim.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 6))", (saga_id,))
        mine = bool((await cur.fetchone())[0])
        try:
            yield mine
        finally:
            if mine:
                with contextlib.suppress(Exception):  # a broken session has released it already
                    await claim.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 6))", (saga_id,))


Action = Callable[[object, dict], Awaitable[None]]


@dataclass(frozen=True)
class Step:
    """One local transaction of a saga and the compensation that undoes it.

    Both are ``async def f(pool, data) -> None`` and both must be idempotent: the
    orchestrator may run either twice after a crash. A compensation must also be safe
    when its step never happened (it then changes nothing).
    """

    name: str
    action: Action
    compensation: Action


# ----------------------------------------------------------------------------- the log


async def log(pool, saga_id: str, step: str, event: str, data: dict | None = None) -> None:
    """Append one row to the saga log (its own transaction: a decision is durable once logged)."""
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO saga_log (saga_id, step, event, data) VALUES (%s, %s, %s, %s)",
            (saga_id, step, event, Jsonb(data) if data is not None else None),
        )


async def history(pool, saga_id: str) -> list[tuple[str, str, dict | None]]:
    """The saga's log rows in order: ``[(step, event, data), ...]``."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT step, event, data FROM saga_log WHERE saga_id = %s ORDER BY id", (saga_id,)
        )
        return [tuple(row) for row in await cur.fetchall()]


async def unfinished(pool) -> list[str]:
    """Ids of sagas that began and have no final row, oldest first."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            """
            SELECT saga_id FROM saga_log
            GROUP BY saga_id
            HAVING bool_or(step = %(saga)s AND event = 'begin')
               AND NOT bool_or(step = %(saga)s AND event IN ('completed', 'compensated'))
            ORDER BY min(id)
            """,
            {"saga": SAGA},
        )
        return [row[0] for row in await cur.fetchall()]


@dataclass
class SagaState:
    """What a saga's log says: its input, which steps started, finished, failed, were undone."""

    data: dict | None = None
    started: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)
    failed: bool = False
    compensated: set[str] = field(default_factory=set)
    final: str | None = None

    @property
    def compensating(self) -> bool:
        return self.failed or bool(self.compensated)


def read_state(rows: Sequence[tuple[str, str, dict | None]]) -> SagaState:
    """Fold the log rows of one saga into a :class:`SagaState`."""
    state = SagaState()
    for step, event, data in rows:
        if step == SAGA:
            if event == "begin":
                state.data = data
            elif event in FINAL:
                state.final = event
        elif event == "started":
            if step not in state.started:
                state.started.append(step)
        elif event == "done":
            state.done.add(step)
        elif event == "failed":
            state.failed = True
        elif event == "compensated":
            state.compensated.add(step)
    return state


def user_status(state: SagaState) -> str:
    """What the customer's order page shows: pending until a final row, then the outcome."""
    if state.final == "completed":
        return "confirmed"
    if state.final == "compensated":
        return "cancelled"
    if state.compensating:
        return "cancelling"
    return "pending" if state.data is not None else "not found"


# ----------------------------------------------------------------------------- the orchestrator


@dataclass
class Orchestrator:
    """Runs a saga's steps with a log in PostgreSQL; compensates on :class:`StepFailed`.

    ``sleep`` and ``rand`` are injected (a VirtualClock in checks); ``backoff`` spaces the
    retries of a failing compensation, which is retried until it succeeds.
    """

    steps: Sequence[Step]
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    backoff: Backoff = field(default_factory=lambda: FullJitter(0.05, 2.0))
    rand: Callable[[], float] = random.random
    retries: list[tuple[str, str]] = field(default_factory=list)  # (step, error) of each failed compensation

    def __post_init__(self) -> None:
        self._by_name = {step.name: step for step in self.steps}

    #: Attempts of a step that fails on a :data:`TRANSIENT` error before the saga stops,
    #: unfinished, for recover() to finish later (a step is idempotent: retrying it is safe).
    step_attempts: int = 5

    async def run(self, pool, saga_id: str, data: dict) -> str:
        """Run a new saga to its end: ``"completed"`` or ``"compensated"``.

        Raises :class:`SagaBusy` when another orchestrator holds the saga's lock.
        """
        async with claimed(pool, saga_id) as mine:
            if not mine:
                raise SagaBusy(saga_id)
            await log(pool, saga_id, SAGA, "begin", data)
            return await self._forward(pool, saga_id, data, SagaState(data=data))

    async def _act(self, step: Step, pool, data: dict) -> None:
        """A step's action, retried a bounded number of times on a transient error."""
        for attempt in range(self.step_attempts):
            try:
                await step.action(pool, data)
                return
            except TRANSIENT:
                if attempt + 1 == self.step_attempts:
                    raise  # the saga stays unfinished; recover() picks it up
                await self.sleep(self.backoff.delay(attempt, rand=self.rand))

    async def _forward(self, pool, saga_id: str, data: dict, state: SagaState) -> str:
        for step in self.steps:
            if step.name in state.done:
                continue
            await log(pool, saga_id, step.name, "started")
            if step.name not in state.started:
                state.started.append(step.name)
            try:
                await self._act(step, pool, data)
            except StepFailed as err:
                await log(pool, saga_id, step.name, "failed", {"error": str(err)})
                state.failed = True
                return await self._backward(pool, saga_id, data, state)
            await log(pool, saga_id, step.name, "done")
            state.done.add(step.name)
        await log(pool, saga_id, SAGA, "completed")
        return "completed"

    async def _backward(self, pool, saga_id: str, data: dict, state: SagaState) -> str:
        started = [step for step in self.steps if step.name in state.started]
        for step in reversed(started):  # undo the latest first
            if step.name in state.compensated:
                continue
            await self._until_done(step, pool, data)
            await log(pool, saga_id, step.name, "compensated")
            state.compensated.add(step.name)
        await log(pool, saga_id, SAGA, "compensated")
        return "compensated"

    async def _until_done(self, step: Step, pool, data: dict) -> None:
        """Retry a compensation until it succeeds: skipping one leaves the saga half-undone.

        Any error is retried with backoff for as long as it takes, except a bug (:data:`BUGS`):
        it is recorded and raised, and the saga stays "cancelling" in the log until the fix is
        deployed and recover() finishes it.
        """
        attempt = 0
        while True:
            try:
                await step.compensation(pool, data)
                return
            except BUGS as err:
                self.retries.append(
                    (step.name, f"{type(err).__name__}: {err}".splitlines()[0] + " (a bug: not retried)")
                )
                raise
            except Exception as err:  # noqa: BLE001 - anything else is retried until it succeeds
                self.retries.append((step.name, f"{type(err).__name__}: {err}".splitlines()[0]))
                await self.sleep(self.backoff.delay(attempt, rand=self.rand))
                attempt += 1

    async def resume(self, pool, saga_id: str) -> str | None:
        """Finish one saga from its log (a no-op for a finished one); its final state."""
        state = read_state(await history(pool, saga_id))
        if state.final is not None or state.data is None:
            return state.final
        if state.compensating:
            return await self._backward(pool, saga_id, state.data, state)
        return await self._forward(pool, saga_id, state.data, state)

    async def recover(self, pool) -> list[str]:
        """Finish every unfinished saga (run it after a restart); the ids it finished.

        Each saga is claimed with a session advisory lock on a connection of its own, so a
        second recoverer running at the same time skips it instead of driving it too.
        """
        finished = []
        for saga_id in await unfinished(pool):
            async with claimed(pool, saga_id) as mine:
                if mine and await self.resume(pool, saga_id) is not None:
                    finished.append(saga_id)
        return finished

    async def sweep_forever(self, pool, *, every: float = 30.0, on_error=None) -> None:
        """Run :meth:`recover` every ``every`` seconds: a saga whose instance died is finished
        by whichever instance sweeps next, not only after a restart. An error (the database
        away, a bug in one saga) is reported to ``on_error`` and the sweep goes on."""
        while True:
            try:
                await self.recover(pool)
            except Exception as err:  # noqa: BLE001 - a sweeper that dies on its first error sweeps nothing
                if on_error is not None:
                    on_error(err)
            await self.sleep(every)
