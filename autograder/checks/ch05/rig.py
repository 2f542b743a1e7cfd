"""The check's world for chapter 05: clocks, sleeps, replicas that can be killed, what to read back."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import time
from collections import Counter
from collections.abc import Callable

import psycopg
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from autograder.callers import caller, ended
from autograder.harness import Report, error_line
from autograder.probes import settled
from course import messaging as mq
from course.backoff import FullJitter
from course.kit.faults import DependencyError
from course.retry import RetryPolicy

CLOCK_START = 1_800_000_000.0  # the injected clock starts here (2027), far from time.time()
IDLE_LIMIT = 2.0  # real seconds without any progress before the check calls a consumer stuck
OVERLAP_PROBE = 0.2  # real seconds the first message of a key waits for a second one to start beside it
RUN_LIMIT = 8.0  # real seconds a consumer run may take at most
GROUP = "workers"


#: ``BaseExceptionGroup`` (Python 3.11+: what a TaskGroup raises when its tasks fail).
Group = builtins.BaseExceptionGroup


class Stopped(BaseException):
    """Raised by the check's handler to stop a consumer that retries without end."""


# ----------------------------------------------------------------------------- injected time


class Clock:
    """The injected ``clock``: seconds, moved only by the check's sleeps."""

    def __init__(self, start: float = CLOCK_START) -> None:
        self.start = start
        self.now = start

    def __call__(self) -> float:
        return self.now


class Sleeps:
    """The injected ``sleep``: records every delay and moves the clock to the sleep's end.

    While ``held``, a sleep waits until :meth:`release` (the head-of-line scenario holds
    the first backoff until every other key has been seen to finish).
    """

    def __init__(self, clock: Clock, held: bool = False) -> None:
        self.clock = clock
        self.delays: list[float] = []
        self.waiting = 0
        self._open = asyncio.Event()
        if not held:
            self._open.set()

    def release(self) -> None:
        self._open.set()

    async def __call__(self, seconds) -> None:
        start = self.clock.now
        self.delays.append(seconds)
        if not self._open.is_set():
            self.waiting += 1
            try:
                await self._open.wait()
            finally:
                self.waiting -= 1
        if isinstance(seconds, (int, float)) and seconds > 0:
            self.clock.now = max(self.clock.now, start + float(seconds))
        await asyncio.sleep(0)


class Draws:
    """The injected ``rand``: seeded uniform numbers, each one remembered."""

    def __init__(self, rng) -> None:
        self.rng = rng
        self.values: list[float] = []

    def __call__(self) -> float:
        value = self.rng.random()
        self.values.append(value)
        return value


# ----------------------------------------------------------------------------- the world of one scenario


def timeout_error(mid: str) -> TimeoutError:
    return TimeoutError(f"{mid}: the payment service timed out")


def unavailable(mid: str) -> DependencyError:
    return DependencyError(503, f"{mid}: inventory service answered 503")


def serialization_failure(mid: str) -> psycopg.errors.SerializationFailure:
    return psycopg.errors.SerializationFailure(f"{mid}: could not serialize access due to concurrent update")


def malformed(mid: str) -> mq.MalformedMessage:
    return mq.MalformedMessage(f"{mid}: body is not valid JSON")


class World:
    """One scenario's stream, dead-letter stream, messages and what each attempt does.

    ``plan[message_id]`` lists what attempts 1, 2, ... of that message do: ``"ok"``, an
    error factory, ``"kill before change"`` or ``"kill after change"``; after the list,
    ``then`` (``"ok"`` unless given).
    """

    def __init__(self, ns, name: str) -> None:
        self.stream = f"{ns.key_prefix}ch05:{name}"
        self.dlq = f"{self.stream}:dlq"
        self.name = name
        self.entries: list[tuple[str, dict]] = []  # (entry id, fields) as published
        self.by_entry: dict[str, str] = {}  # entry id -> message id
        self.plan: dict[str, list] = {}
        self.then: dict[str, object] = {}
        self.attempts: Counter = Counter()
        self._next = 1

    def message(self, key: str, seq: int, *, mid: str | None = None) -> dict:
        mid = mid or f"{key}-{seq}"
        return mq.make_message(mid, key, "order-event", seq, {"key": key, "seq": seq}, correlation_id=f"c-{mid}")

    async def publish(self, redis, specs: list[tuple[str, int]]) -> list[str]:
        """XADD ``(key, seq)`` messages with explicit ids ``1-1``, ``1-2``, ...; a repeated
        ``(key, seq)`` is a duplicate: a new entry with the same message id."""
        ids = []
        for key, seq in specs:
            fields = self.message(key, seq)
            entry_id = await redis.xadd(self.stream, fields, id=f"1-{self._next}")
            self._next += 1
            self.entries.append((entry_id, fields))
            self.by_entry[entry_id] = fields["id"]
            ids.append(entry_id)
        return ids

    def entry_of(self, mid: str) -> str:
        return next(e for e, f in self.entries if f["id"] == mid)

    def fields_of(self, mid: str) -> dict:
        return next(f for _, f in self.entries if f["id"] == mid)

    def step(self, mid: str):
        self.attempts[mid] += 1
        steps = self.plan.get(mid, [])
        n = self.attempts[mid]
        return steps[n - 1] if n <= len(steps) else self.then.get(mid, "ok")


class Replica:
    """One consumer process: its own pool, Redis client and handler, all dead after a kill."""

    def __init__(self, name: str, world: World, pool, redis, watcher, *, overlap_probe: bool = False) -> None:
        self.name = name
        self.world = world
        self.pool = pool
        self.redis = redis
        self.watcher = watcher
        self.dead = False
        self.killed_at: str | None = None
        self.killed_task = None  # the task the kill was raised in (see autograder.callers.caller)
        self.after_kill: list[str] = []  # Redis commands that task still sent: it caught the kill
        self.kill_ending = None  # how that task ended (autograder.callers.ended): not by the kill, it caught it
        self.overlap_probe = overlap_probe
        self.in_flight: Counter = Counter()
        self.overlaps: list[str] = []
        self.misuse: list[str] = []
        self.kill_after_ack: str | None = None  # entry id
        self.kill_next_command_of: str | None = None  # message id: its task's next Redis command
        self._armed_task = None
        self._armed_entry: str | None = None
        self.acks: list[tuple[str, bool]] = []  # (entry id, its effect was committed before the XACK)
        self.acked: set[str] = set()  # entry ids whose XACK has reached Redis
        self.started: set[str] = set()  # message ids handle was called for
        self.commands = 0
        redis.replica = self

    async def settle(self, victim: str) -> None:
        """Before a kill: let every entry of the other keys, and every other entry whose handle already
        started, be acknowledged first, so what the kill leaves behind is the same on every run (issue 35).
        A consumer that cannot go on while ``victim`` is held gets IDLE_LIMIT of no progress, then dies."""
        victim_key = self.world.fields_of(victim)["key"]

        async def outstanding() -> bool:
            waited = [
                (entry_id, fields["id"])
                for entry_id, fields in self.world.entries
                if fields["id"] != victim and (fields["key"] != victim_key or fields["id"] in self.started)
            ]
            if any(entry_id not in self.acked for entry_id, _ in waited):
                return True
            cur = await self.watcher.execute(  # acknowledged, and its change committed (an early XACK is not enough)
                "SELECT count(DISTINCT message_id) FROM ch05_applied WHERE stream = %s AND message_id = ANY(%s)",
                (self.world.stream, [mid for _, mid in waited]),
            )
            return (await cur.fetchone())[0] < len({mid for _, mid in waited})

        last, since = None, time.monotonic()
        while await outstanding():
            progress = (self.commands, len(self.acked), len(self.started))
            if progress != last:
                last, since = progress, time.monotonic()
            elif time.monotonic() - since > IDLE_LIMIT:
                return
            await asyncio.sleep(0.005)

    def kill(self, where: str) -> ConsumerKilled:
        self.dead = True
        self.killed_at = where
        self.killed_task = caller()
        return mq.ConsumerKilled(f"the check killed consumer {self.name} {where}")

    # --- the handler --------------------------------------------------------------------
    async def handle(self, conn, fields) -> None:
        if self.dead:
            raise mq.ConsumerKilled(f"consumer {self.name} is dead")
        if not isinstance(fields, dict) or not {"id", "key", "seq"} <= set(fields):
            self.misuse.append(f"handle was called with {fields!r:.120}; expected the entry's fields dict")
            raise TypeError("handle(conn, fields): fields must be the entry's field dict")
        if not hasattr(conn, "execute") or not hasattr(conn, "transaction"):
            self.misuse.append(f"handle was called with {conn!r:.80} as conn; expected an AsyncConnection")
            raise TypeError("handle(conn, fields): conn must be a psycopg AsyncConnection")
        mid, key = fields["id"], fields["key"]
        self.started.add(mid)
        step = self.world.step(mid)
        self.in_flight[key] += 1
        try:
            if self.in_flight[key] > 1:
                self.overlaps.append(mid)
            elif self.overlap_probe and fields.get("seq") == "1":
                until = time.monotonic() + OVERLAP_PROBE  # give a second message of this key time to start
                while self.in_flight[key] == 1 and time.monotonic() < until:
                    await asyncio.sleep(0.002)
            await asyncio.sleep(0)
            if step == "kill before change":
                await self.settle(mid)
                raise self.kill(f"inside handle({mid}), before its change")
            if step == "stop":
                raise Stopped(f"{mid} was attempted {self.world.attempts[mid]} times")
            if callable(step):
                raise step(mid)
            await conn.execute(
                "INSERT INTO ch05_applied (stream, message_id, key, seq, consumer) VALUES (%s, %s, %s, %s, %s)",
                (self.world.stream, mid, key, int(fields["seq"]), self.name),
            )
            if step == "kill after change":
                await self.settle(mid)
                raise self.kill(f"inside handle({mid}), after its change and before the commit")
            if self.kill_next_command_of == mid:  # armed: the next Redis command of this task, or the XACK
                self._armed_task = caller()
                self._armed_entry = next((e for e, m in self.world.by_entry.items() if m == mid), None)
        finally:
            self.in_flight[key] -= 1

    # --- what the Redis client sees ------------------------------------------------------
    async def before(self, args) -> None:
        if self.dead:
            if self.killed_task is not None and caller() == self.killed_task:
                self.after_kill.append(_name(args))
            raise mq.ConsumerKilled(f"consumer {self.name} is dead")
        self.commands += 1
        armed = self._armed_task is not None and (
            caller() == self._armed_task or (_name(args) == "XACK" and self._armed_entry in _ids(args))
        )
        if armed:  # (a handler wrapped in its own task, e.g. by wait_for, still meets the XACK)
            self._armed_task = None
            await self.settle(self.kill_next_command_of)
            raise self.kill(f"at its first Redis command ({_name(args)}) after {self.kill_next_command_of} committed")
        if _name(args) == "XACK":
            for entry_id in _ids(args):
                if entry_id in self.world.by_entry:
                    self.acks.append((entry_id, await self._effect_committed(entry_id)))

    async def after(self, args) -> None:
        if _name(args) == "XACK":
            self.acked.update(_ids(args))
        if _name(args) == "XACK" and self.kill_after_ack in _ids(args):
            await self.settle(self.world.by_entry[self.kill_after_ack])
            raise self.kill(f"just after the XACK of {self.world.by_entry[self.kill_after_ack]}")

    async def _effect_committed(self, entry_id: str) -> bool:
        mid = self.world.by_entry[entry_id]
        stream = self.world.stream
        cur = await self.watcher.execute(
            "SELECT EXISTS (SELECT 1 FROM ch05_applied WHERE stream = %s AND message_id = %s) "
            "OR EXISTS (SELECT 1 FROM mq_parked WHERE stream = %s AND entry_id = %s) "
            "OR EXISTS (SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND entry_id = %s)",
            (stream, mid, stream, entry_id, stream, entry_id),
        )
        return bool((await cur.fetchone())[0])


ConsumerKilled = mq.ConsumerKilled


def _name(args) -> str:
    head = args[0] if args else ""
    head = head.decode() if isinstance(head, bytes) else str(head)
    return head.split()[0].upper() if head else ""


def _ids(args) -> list[str]:
    return [a.decode() if isinstance(a, bytes) else str(a) for a in args[3:]]


class CheckPipeline(Pipeline):
    replica: Replica

    async def execute(self, raise_on_error: bool = True):
        stack = [args for args, _ in self.command_stack]
        for args in stack:
            await self.replica.before(args)
        result = await super().execute(raise_on_error)
        for args in stack:
            await self.replica.after(args)
        return result


class CheckRedis(aioredis.Redis):
    """The learner's Redis client: every command passes the replica's kill points and watch."""

    replica: Replica

    async def execute_command(self, *args, **options):
        await self.replica.before(args)
        result = await super().execute_command(*args, **options)
        await self.replica.after(args)
        return result

    def pipeline(self, transaction: bool = True, shard_hint=None):
        pipe = CheckPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.replica = self.replica
        return pipe


# ----------------------------------------------------------------------------- running a replica


def _killed(err: BaseException) -> bool:
    """Is ``err`` (or every leaf of an exception group) a kill or stop made by the check?"""
    if isinstance(err, Group):
        return all(_killed(e) for e in err.exceptions)
    return isinstance(err, (mq.ConsumerKilled, Stopped))


def _leaf(err: BaseException) -> BaseException:
    while isinstance(err, Group) and err.exceptions:
        err = err.exceptions[0]
    return err


class Run:
    """What one consumer run ended with."""

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.killed = False
        self.stopped = False
        self.hung = False


async def start_replica(ns, world: World, name: str, watcher, **kw) -> Replica:
    """A replica's pool, Redis client and the connection its XACK watch reads through (its own:
    a kill cancels the replica's tasks, and a query cancelled half-way breaks its connection)."""
    pool = await ns.pool(max_size=6, fresh=True)
    client = CheckRedis.from_url(ns.redis_url, decode_responses=True)
    observer = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
    return Replica(name, world, pool, client, observer, **kw)


async def stop_replica(rep: Replica) -> None:
    with contextlib.suppress(Exception):
        await rep.pool.close()
    with contextlib.suppress(Exception):
        await rep.watcher.close()
    with contextlib.suppress(Exception):
        await rep.redis.aclose()


async def run_consumer(
    consumer, rep: Replica, *, policy, sleeps: Sleeps, draws: Draws, clock: Clock, until=None
) -> Run:
    """Run the learner's consumer as replica ``rep`` until it returns, is killed or hangs.

    ``until`` (an async function) is polled meanwhile; once it returns True the held sleeps
    are released. Every task the run leaves behind is cancelled afterwards (a dead process
    leaves nothing running).
    """
    world = rep.world
    before = asyncio.all_tasks()
    run = Run()
    job = asyncio.ensure_future(
        consumer(
            rep.pool,
            rep.redis,
            rep.handle,
            stream=world.stream,
            group=GROUP,
            consumer=rep.name,
            dlq=world.dlq,
            policy=policy,
            sleep=sleeps,
            rand=draws,
            clock=clock,
        )
    )
    deadline = time.monotonic() + RUN_LIMIT
    watching = until is not None
    try:
        while not job.done() and time.monotonic() < deadline and not rep.dead:
            if watching and await until():
                watching = False
                sleeps.release()
            await asyncio.wait([job], timeout=0.01)
        if rep.dead and not job.done():
            # what the kill set off runs to its end first (an except that caught it and then failed): in
            # one process it does within the same loop turn; across two, only once both are idle
            await settled()
    finally:
        sleeps.release()
        if not job.done():  # killed (a dead process runs nothing more), or hung
            run.hung = not rep.dead
            job.cancel()
        leftovers = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
        for t in leftovers:
            t.cancel()
        if leftovers:
            await asyncio.wait(leftovers, timeout=5)
    if rep.dead:
        # a killed process raises nothing afterwards: what the run ended with is moot (with the answer in a
        # process of its own, whether a caught kill's TypeError or the next command's kill came first was up
        # to the scheduler). What is not moot: how the task the kill was raised in ended (a caught kill).
        run.killed = True
        await settled()
        rep.kill_ending = await ended(rep.killed_task) if rep.killed_task is not None else None
        return run
    if job.cancelled() or run.hung:
        return run
    err = job.exception()
    if err is None:
        pass
    elif _killed(err):
        run.killed = True
        run.stopped = isinstance(_leaf(err), Stopped)
    elif isinstance(_leaf(err), NotImplementedError):
        raise _leaf(err)
    elif isinstance(err, Exception | Group):
        run.error = err
    else:
        raise err
    if rep.dead:
        run.killed = True
    return run


# ----------------------------------------------------------------------------- reading the servers


async def applied(watcher, world: World) -> list[tuple[str, str]]:
    """``(key, message id)`` of every committed application, in commit order per key."""
    cur = await watcher.execute(
        "SELECT key, message_id FROM ch05_applied WHERE stream = %s ORDER BY n", (world.stream,)
    )
    return [tuple(row) for row in await cur.fetchall()]


def per_key(rows) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, mid in rows:
        out.setdefault(key, []).append(mid)
    return out


async def pending(redis, world: World) -> list[dict]:
    return await redis.xpending_range(world.stream, GROUP, "-", "+", 1000)


async def parked(watcher, world: World) -> dict[str, dict]:
    cur = await watcher.execute("SELECT entry_id, key, fields FROM mq_parked WHERE stream = %s", (world.stream,))
    return {e: {"key": k, "fields": f} for e, k, f in await cur.fetchall()}


async def blocked(watcher, world: World) -> dict[str, dict]:
    cur = await watcher.execute(
        "SELECT key, entry_id, message_id, dlq_id, fields, reason FROM mq_blocked_keys WHERE stream = %s",
        (world.stream,),
    )
    return {
        k: {"entry_id": e, "message_id": m, "dlq_id": d, "fields": f, "reason": r}
        for k, e, m, d, f, r in await cur.fetchall()
    }


def names(world: World, entry_ids) -> str:
    return ", ".join(world.by_entry.get(e, e) for e in entry_ids)


# ----------------------------------------------------------------------------- verdicts shared by scenarios


def _caught(ending) -> str | None:
    """How a task the kill was raised in ended, if not by the kill: it caught it."""
    if ending == "returned":
        return "returned normally"
    if not isinstance(ending, list) or not ending:
        return None  # still waiting (on PostgreSQL, say), cancelled, or unknown: no proof
    if any(name.endswith(("ConsumerKilled", ".Stopped", "ExceptionGroup")) for name in ending):
        return None
    return f"ended with {ending[0].rsplit('.', 1)[-1]} instead"


def expect_clean_run(r: Report, run: Run, rep: Replica, what: str) -> None:
    if rep.misuse:
        r.fail(f"{what}: {rep.misuse[0]}")
    if rep.after_kill:
        r.fail(
            f"{what}: after ConsumerKilled was raised {rep.killed_at}, the same task went on to send "
            f"{', '.join(dict.fromkeys(rep.after_kill))} to Redis: it caught the kill (an except BaseException, or "
            "an except that names ConsumerKilled). A kill is a BaseException: never catch it, let it end the consumer"
        )
    caught = _caught(rep.kill_ending)
    if caught and not rep.after_kill:
        r.fail(
            f"{what}: after ConsumerKilled was raised {rep.killed_at}, the task it was raised in {caught}: it caught "
            "the kill (an except BaseException, or an except that names ConsumerKilled). A kill is a BaseException: "
            "never catch it, let it end the consumer"
        )
    if run.hung:
        r.hung = True  # the next scenarios are skipped: each would wait as long again
        r.fail(
            f"{what}: the consumer was still running after {RUN_LIMIT:g} s of real time. It must return once a "
            "read finds nothing new and all its work is done (no XREADGROUP BLOCK, no endless loop)"
        )
    if run.error is not None:
        r.fail(f"{what}: the consumer raised {error_line(_leaf(run.error), 200)}")


def expect_order(
    r: Report, world: World, rows, expected: dict[str, list[str]], what: str, *, takeover: bool = False
) -> None:
    got = per_key(rows)
    for key, want in expected.items():
        have = got.get(key, [])
        if have == want:
            continue
        dup = [m for m, n in Counter(have).items() if n > 1]
        if dup:
            r.fail(
                f"{what}: key {key} applied {have}; {dup[0]} was applied {Counter(have)[dup[0]]} times. "
                + (
                    "The replica that took over did not know the first one had applied it: state kept in one "
                    "process is not shared between replicas. "
                    if takeover
                    else ""
                )
                + "Record the message id in mq_processed in the same transaction as the change, and skip it when "
                "it is already there"
            )
        missing = [m for m in want if m not in have]
        if sorted(have) == sorted(want):
            r.fail(
                # not the whole commit order: which of the key's later messages overtook first depends on timing
                f"{what}: key {key} did not commit {want} in that order (stream order). One key's messages must be "
                "handled one at a time, in stream order; a retry must not let later messages of the key overtake"
            )
        r.fail(
            f"{what}: key {key} applied {have}, expected {want}" + (f"; never applied: {missing}" if missing else "")
        )
    extra = {k: v for k, v in got.items() if k not in expected and v}
    if extra:
        r.fail(f"{what}: applied messages that should not have been: {extra}")


async def expect_all_acked(r: Report, redis, world: World, what: str) -> None:
    left = await pending(redis, world)
    if left:
        owners = Counter(p["consumer"] for p in left)
        r.fail(
            f"{what}: {len(left)} entr{'y' if len(left) == 1 else 'ies'} still pending "
            f"({names(world, [p['message_id'] for p in left])}; owned by {dict(owners)}): acknowledge every entry "
            "(XACK) once it is applied, parked or dead-lettered"
        )


def expect_ack_after_commit(r: Report, reps: list[Replica], world: World, what: str) -> None:
    order = {e: i for i, (e, _) in enumerate(world.entries)}
    early = sorted({e for rep in reps for e, committed in rep.acks if not committed}, key=lambda e: order.get(e, 0))
    if early:  # named in stream order, the first one only: which others were early can depend on timing
        r.fail(
            f"{what}: the XACK of {names(world, early[:1])}{' (and others)' if len(early) > 1 else ''} came before "
            "its change (or parking, or dead-lettering) was committed: a crash between them loses the message. "
            "Acknowledge only after the commit"
        )


def expect_no_overlap(r: Report, reps: list[Replica], what: str) -> None:
    for rep in reps:
        if rep.overlaps:
            # the key, not the message: which of its messages started second is up to the scheduler
            key = sorted(mid.split("-")[0] for mid in rep.overlaps)[0]
            r.fail(
                f"{what}: two messages of key {key} were in handle at the same time (one started before the "
                "other returned): one key's messages must be handled one at a time"
            )


# ----------------------------------------------------------------------------- ordered_consumer


def policy_of(attempts: int, base: float, cap: float) -> RetryPolicy:
    return RetryPolicy(
        max_attempts=attempts, max_elapsed=None, backoff=FullJitter(base, cap), retryable=mq.is_transient
    )


SCENARIOS: list[tuple[str, Callable]] = []


def scenario(title: str):
    def register(fn):
        SCENARIOS.append((title, fn))
        return fn

    return register
