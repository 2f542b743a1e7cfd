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
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable

import psycopg
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from autograder.harness import Report, Stop, error_line, task
from autograder.probes import fmt
from course import messaging as mq
from course.backoff import FullJitter
from course.chapters import ch05
from course.kit import lab
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
        self.overlap_probe = overlap_probe
        self.in_flight: Counter = Counter()
        self.overlaps: list[str] = []
        self.misuse: list[str] = []
        self.kill_after_ack: str | None = None  # entry id
        self.kill_next_command_of: str | None = None  # message id: its task's next Redis command
        self._armed_task = None
        self._armed_entry: str | None = None
        self.acks: list[tuple[str, bool]] = []  # (entry id, its effect was committed before the XACK)
        self.commands = 0
        redis.replica = self

    def kill(self, where: str) -> ConsumerKilled:
        self.dead = True
        self.killed_at = where
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
                raise self.kill(f"inside handle({mid}), after its change and before the commit")
            if self.kill_next_command_of == mid:  # armed: the next Redis command of this task, or the XACK
                self._armed_task = asyncio.current_task()
                self._armed_entry = next((e for e, m in self.world.by_entry.items() if m == mid), None)
        finally:
            self.in_flight[key] -= 1

    # --- what the Redis client sees ------------------------------------------------------
    async def before(self, args) -> None:
        if self.dead:
            raise mq.ConsumerKilled(f"consumer {self.name} is dead")
        self.commands += 1
        armed = self._armed_task is not None and (
            asyncio.current_task() is self._armed_task or (_name(args) == "XACK" and self._armed_entry in _ids(args))
        )
        if armed:  # (a handler wrapped in its own task, e.g. by wait_for, still meets the XACK)
            self._armed_task = None
            raise self.kill(f"at its first Redis command ({_name(args)}) after {self.kill_next_command_of} committed")
        if _name(args) == "XACK":
            for entry_id in _ids(args):
                if entry_id in self.world.by_entry:
                    self.acks.append((entry_id, await self._effect_committed(entry_id)))

    async def after(self, args) -> None:
        if _name(args) == "XACK" and self.kill_after_ack in _ids(args):
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
        run.killed = True
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


def expect_clean_run(r: Report, run: Run, rep: Replica, what: str) -> None:
    if rep.misuse:
        r.fail(f"{what}: {rep.misuse[0]}")
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
                f"{what}: key {key} committed {have}, expected {want} (stream order). One key's messages must be "
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
    early = [e for rep in reps for e, committed in rep.acks if not committed]
    if early:
        r.fail(
            f"{what}: XACK of {names(world, early[:3])} came before its change (or parking, or dead-lettering) was "
            "committed: a crash between them loses the message. Acknowledge only after the commit"
        )


def expect_no_overlap(r: Report, reps: list[Replica], what: str) -> None:
    for rep in reps:
        if rep.overlaps:
            r.fail(
                f"{what}: handle({rep.overlaps[0]}) started while an earlier message of its key was still being "
                "handled: one key's messages must be handled one at a time"
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


@task(
    "ordered_consumer",
    points=10,
    title="per-key ordered consumer: retries, dead letters, parking, takeover",
    timeout=90,
    partial=True,
    seed=505,
)
async def check_ordered_consumer(r: Report, ordered_consumer) -> None:
    async with lab.scratch("ch05") as ns:
        pool = await ns.pool(max_size=4)
        await ch05.setup_schema(pool)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        admin = ns.redis()
        try:
            chosen = SCENARIOS[:1] if r.public else SCENARIOS
            passed = 0
            for title, fn in chosen:
                r.note(title)
                before = r.failures
                if getattr(r, "hung", False):
                    r.fail("skipped: the consumer did not return in an earlier scenario", stop=False)
                    continue
                try:
                    await fn(r, ordered_consumer, ns, watcher, admin)
                except Stop:
                    pass
                if r.failures == before:
                    passed += 1
            r.fraction = passed / len(chosen)
            if not r.public:
                r.note(f"{passed} of {len(chosen)} scenarios passed")
        finally:
            await watcher.close()


async def _setup_world(ns, admin, name: str, watcher) -> World:
    """A fresh stream and group; the tables emptied (message ids repeat from one scenario to the next)."""
    await watcher.execute("TRUNCATE mq_processed, mq_parked, mq_blocked_keys, ch05_applied")
    world = World(ns, name)
    await admin.delete(world.stream, world.dlq)
    await admin.xgroup_create(world.stream, GROUP, id="0", mkstream=True)
    return world


@scenario("1. healthy messages of 3 keys, two of them delivered twice: each applied once, in its key's order")
async def _basic(r: Report, consumer, ns, watcher, admin) -> None:
    world = await _setup_world(ns, admin, "basic", watcher)
    specs = [("A", 1), ("B", 1), ("A", 2), ("C", 1), ("B", 2), ("A", 3), ("C", 2), ("B", 2), ("A", 1), ("C", 3)]
    await world.publish(admin, specs)
    clock = Clock()
    rep = await start_replica(ns, world, "c1", watcher, overlap_probe=True)
    try:
        run = await run_consumer(
            consumer, rep, policy=policy_of(4, 0.1, 1.0), sleeps=Sleeps(clock), draws=Draws(r.random), clock=clock
        )
        expect_clean_run(r, run, rep, "10 entries")
        if run.killed:
            r.fail(f"10 healthy entries: the consumer died with {rep.killed_at or 'a ConsumerKilled'}")
        expect_no_overlap(r, [rep], "10 entries")
        rows = await applied(watcher, world)
        expect_order(
            r, world, rows, {"A": ["A-1", "A-2", "A-3"], "B": ["B-1", "B-2"], "C": ["C-1", "C-2", "C-3"]}, "10 entries"
        )
        r.ok("10 entries (A-1 and B-2 twice): 8 messages applied once each, every key in stream order")
        await expect_all_acked(r, admin, world, "10 entries")
        expect_ack_after_commit(r, [rep], world, "10 entries")
        r.ok("every entry acknowledged, each after its commit; nothing pending")
        dead = await admin.xrange(world.dlq)
        r.expect(
            not dead, "nothing dead-lettered", f"healthy messages were dead-lettered: {[f.get('id') for _, f in dead]}"
        )
    finally:
        await stop_replica(rep)


@scenario(
    "2. R-1 fails 3 times (timeout, 503, serialization failure), then succeeds: full-jitter backoff, "
    "R-2 and R-3 wait, keys S and T go on"
)
async def _retries(r: Report, consumer, ns, watcher, admin) -> None:
    world = await _setup_world(ns, admin, "retries", watcher)
    world.plan["R-1"] = [timeout_error, unavailable, serialization_failure, "ok"]
    await world.publish(admin, [("R", 1), ("S", 1), ("R", 2), ("T", 1), ("S", 2), ("R", 3), ("T", 2)])
    healthy = {"S-1", "S-2", "T-1", "T-2"}
    base, cap = 0.1, 0.3
    clock = Clock()
    sleeps = Sleeps(clock, held=True)
    draws = Draws(r.random)
    rep = await start_replica(ns, world, "c1", watcher)
    seen: dict = {}
    last = {"progress": None, "since": time.monotonic()}

    async def until() -> bool:
        rows = await applied(watcher, world)
        done = {m for _, m in rows}
        progress = (rep.commands, len(rows), len(sleeps.delays))
        if progress != last["progress"]:
            last["progress"], last["since"] = progress, time.monotonic()
        if sleeps.waiting and healthy <= done:
            seen.update(rows=rows, why="done")
            return True
        if time.monotonic() - last["since"] > IDLE_LIMIT:
            seen.update(rows=rows, why="stuck")
            return True
        return False

    try:
        run = await run_consumer(
            consumer, rep, policy=policy_of(5, base, cap), sleeps=sleeps, draws=draws, clock=clock, until=until
        )
        expect_clean_run(r, run, rep, "R-1 failing 3 times")
        rows = await applied(watcher, world)
        expect_order(
            r,
            world,
            rows,
            {"R": ["R-1", "R-2", "R-3"], "S": ["S-1", "S-2"], "T": ["T-1", "T-2"]},
            "R-1 failing 3 times",
        )
        tries = world.attempts["R-1"]
        r.expect(
            tries == 4,
            "R-1 was attempted 4 times: 3 transient failures, then success",
            f"R-1 was attempted {tries} time(s); it fails with TimeoutError, a 503 and a SerializationFailure (all "
            "transient: policy.retryable says so), then succeeds: expected 4 attempts",
        )
        if seen.get("why") == "stuck":
            done = {m for _, m in seen["rows"]}
            r.fail(
                f"while R-1 waited in its first backoff, {len(healthy & done)} of the 4 messages of keys S and T were "
                f"applied and the consumer made no progress for {IDLE_LIMIT:g} s: head-of-line blocking. Give every key its own lane "
                "(a task) so one key's retry never holds another key's messages, even those read in a later batch"
            )
        if seen:
            early = [m for _, m in seen["rows"] if m in ("R-2", "R-3")]
            r.expect(
                not early,
                "while R-1 waited in its backoff: S-1, S-2, T-1, T-2 applied; R-2 and R-3 not yet",
                f"{', '.join(early)} applied while R-1 was still waiting for its retry: the key's later messages "
                "overtook it (a separate retry queue, or moving on, reorders a key)",
            )
        else:
            r.fail(
                "the consumer finished without ever waiting in the injected sleep: retry R-1 after "
                "await sleep(rand() * min(cap, base * 2**k))"
            )
        expect_jitter(r, sleeps.delays, draws.values, base, cap)
        await expect_all_acked(r, admin, world, "R-1 failing 3 times")
        expect_ack_after_commit(r, [rep], world, "R-1 failing 3 times")
        r.ok("every entry acknowledged after its commit")
    finally:
        await stop_replica(rep)


def _close(a, b) -> bool:
    return len(a) == len(b) and all(
        isinstance(x, (int, float)) and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
        for x, y in zip(a, b, strict=False)
    )


def expect_jitter(r: Report, got: list, draws: list[float], base: float, cap: float) -> None:
    n = 3
    windows = [min(cap, base * 2**k) for k in range(n)]
    if len(got) != n:
        r.fail(
            f"R-1 failed 3 times: the consumer slept {len(got)} time(s) {fmt(got)}, expected 3 backoff sleeps "
            f"(rand() * {fmt(windows)}). Use the injected sleep for the backoff waits only"
        )
    if len(draws) < n:
        if _close(got, windows):
            r.fail(
                f"backoff sleeps {fmt(got)}: no jitter, every delay is the whole window min(cap, base * 2**k). "
                "Multiply it by rand() (full jitter), or many consumers retry in lockstep"
            )
        r.fail(
            f"backoff sleeps {fmt(got)} drew rand() only {len(draws)} time(s): the delays must be rand() * {fmt(windows)}"
        )
    expected = [draws[k] * windows[k] for k in range(n)]
    if _close(got, expected):
        r.ok(f"backoff sleeps {fmt(got)} = rand() * {fmt(windows)} (capped exponential, full jitter)")
        return
    guesses = {
        "no jitter: each delay is the whole window min(cap, base * 2**k); multiply it by rand()": windows,
        "no cap: rand() * base * 2**k grows past the cap; take min(cap, base * 2**k) first": [
            draws[k] * base * 2**k for k in range(n)
        ],
        "constant window: rand() * base every time; the window must double after each failure": [
            draws[k] * base for k in range(n)
        ],
        "off by one: the wait after the first failure (k = 0) uses the window base * 2**0 = base": [
            draws[k] * min(cap, base * 2 ** (k + 1)) for k in range(n)
        ],
    }
    for text, guess in guesses.items():
        if _close(got, guess):
            r.fail(f"backoff sleeps {fmt(got)}: {text}")
    r.fail(f"backoff sleeps {fmt(got)}, expected {fmt(expected)} = rand() * {fmt(windows)} with the injected rand")


@scenario(
    "3. P-1 is malformed (permanent), X-1 times out on every attempt, G is healthy: two dead letters with their "
    "metadata, P and X blocked, their later messages parked, G applied"
)
async def _dead_letters(r: Report, consumer, ns, watcher, admin) -> None:
    world = await _setup_world(ns, admin, "dlq", watcher)
    attempts = 4
    world.then["P-1"] = malformed
    world.plan["X-1"] = [timeout_error] * attempts + ["stop"] * 1
    world.then["X-1"] = "stop"
    await world.publish(
        admin, [("P", 1), ("G", 1), ("X", 1), ("P", 2), ("G", 2), ("X", 2), ("P", 3), ("G", 3), ("P", 2)]
    )
    clock = Clock()
    sleeps = Sleeps(clock)
    rep = await start_replica(ns, world, "c1", watcher)
    try:
        run = await run_consumer(
            consumer, rep, policy=policy_of(attempts, 0.05, 1.0), sleeps=sleeps, draws=Draws(r.random), clock=clock
        )
        if run.stopped or world.attempts["X-1"] > attempts:
            r.fail(
                f"X-1 fails with TimeoutError on every attempt; the check stopped the consumer after "
                f"{world.attempts['X-1']} attempts. With policy.max_attempts = {attempts} it must go to the "
                f"dead-letter stream after attempt {attempts}: unbounded retries let one message consume a worker forever"
            )
        expect_clean_run(r, run, rep, "poison messages")
        r.expect(
            world.attempts["P-1"] == 1,
            "P-1 (MalformedMessage, permanent) was attempted once",
            f"P-1 raised MalformedMessage, a permanent error, and was attempted {world.attempts['P-1']} times: "
            "a retry cannot fix malformed data. Send it to the dead-letter stream at once (policy.retryable(err) is False)",
        )
        r.expect(
            world.attempts["X-1"] == attempts,
            f"X-1 (TimeoutError every time) was attempted {attempts} times, then dead-lettered",
            f"X-1 was attempted {world.attempts['X-1']} time(s), expected exactly policy.max_attempts = {attempts}",
        )
        rows = await applied(watcher, world)
        got = per_key(rows)
        late = [m for m in got.get("P", []) + got.get("X", [])]
        if late:
            r.fail(
                f"{', '.join(late)} applied after the first message of its key was dead-lettered: the key's state "
                "skipped an event. Block the key (mq_blocked_keys) and park its later messages (mq_parked)"
            )
        if got.get("G", []) != ["G-1", "G-2", "G-3"]:
            r.fail(
                f"key G applied {got.get('G', [])}, expected ['G-1', 'G-2', 'G-3']: a dead letter must block its "
                "own key only, not the whole stream"
            )
        r.ok("G-1, G-2, G-3 applied in order; nothing of P or X applied")
        await _expect_dead_letters(r, world, admin, watcher, sleeps, attempts)
        park = await parked(watcher, world)
        want = ["P-2", "X-2", "P-3"]
        have = {world.by_entry.get(e, e) for e in park}
        missing = [m for m in want if m not in have]
        if missing:
            r.fail(
                f"{', '.join(missing)} not in mq_parked (parked: {sorted(have) or 'nothing'}). Later messages of a "
                "blocked key must be parked (INSERT INTO mq_parked), then acknowledged: not applied, not lost"
            )
        bad = [
            world.by_entry.get(e, e)
            for e, row in park.items()
            if e in world.by_entry
            and (row["fields"] != dict(world.entries)[e] or row["key"] != dict(world.entries)[e]["key"])
        ]
        r.expect(
            not bad,
            "P-2, P-3 and X-2 parked in mq_parked with their key and fields",
            f"mq_parked rows for {bad} do not hold the entry's key and its fields as read from the stream",
        )
        await expect_all_acked(r, admin, world, "poison messages")
        expect_ack_after_commit(r, [rep], world, "poison messages")
        r.ok("every entry acknowledged after its commit (parked and dead-lettered ones too)")
    finally:
        await stop_replica(rep)


async def _expect_dead_letters(r: Report, world: World, admin, watcher, sleeps: Sleeps, attempts: int) -> None:
    dead = await admin.xrange(world.dlq)
    ids = [f.get("id") for _, f in dead]
    if sorted(ids) != ["P-1", "X-1"]:
        r.fail(f"the dead-letter stream {world.dlq!r} holds {ids}, expected one entry each for P-1 and X-1")
    blocks = await blocked(watcher, world)
    for dlq_id, entry in dead:
        mid = entry["id"]
        fields = world.fields_of(mid)
        source = world.entry_of(mid)
        missing = [k for k in (*mq.FIELDS, *mq.DLQ_FIELDS) if k not in entry]
        if missing:
            r.fail(
                f"the dead letter of {mid} lacks {missing}: an operator needs the original fields and the failure's "
                f"metadata to fix and replay it (got {sorted(entry)})"
            )
        changed = [k for k in mq.FIELDS if entry[k] != fields[k]]
        if changed:
            r.fail(f"the dead letter of {mid} changed the original fields {changed}: copy them as read from the stream")
        perm = mid == "P-1"
        err_text = "body is not valid JSON" if perm else "the payment service timed out"
        problems = []
        if entry["source_stream"] != world.stream:
            problems.append(f"source_stream {entry['source_stream']!r}, expected {world.stream!r}")
        if entry["source_entry_id"] != source:
            problems.append(f"source_entry_id {entry['source_entry_id']!r}, expected {source!r}")
        want_attempts = 1 if perm else attempts
        if entry["attempts"] != str(want_attempts):
            problems.append(f"attempts {entry['attempts']!r}, expected '{want_attempts}'")
        if err_text not in entry["error"]:
            problems.append(f"error {entry['error']!r} does not hold the last error's text ({err_text!r})")
        want_type = "MalformedMessage" if perm else "TimeoutError"
        if entry["error_type"] != want_type:
            problems.append(f"error_type {entry['error_type']!r}, expected {want_type!r}")
        want_reason = "permanent" if perm else "exhausted"
        if entry["reason"] != want_reason:
            problems.append(f"reason {entry['reason']!r}, expected {want_reason!r}")
        try:
            first, last = float(entry["first_failed_at"]), float(entry["last_failed_at"])
        except ValueError:
            problems.append(
                f"first_failed_at {entry['first_failed_at']!r} / last_failed_at {entry['last_failed_at']!r} are not "
                "numbers: store str(clock()) at the first and the last failure"
            )
        else:
            if not (CLOCK_START <= first <= last <= CLOCK_START + 3600):
                problems.append(
                    f"first_failed_at {first!r} and last_failed_at {last!r} are not times of the injected clock "
                    f"(which started at {CLOCK_START:.0f}): read the time with clock()"
                )
            elif not perm:
                waited = sum(d for d in sleeps.delays if isinstance(d, (int, float)))
                if not math.isclose(last - first, waited, abs_tol=1e-6):
                    problems.append(
                        f"last_failed_at - first_failed_at = {last - first:.6g} s, but the backoff between X-1's "
                        f"failures took {waited:.6g} s: first is the time of the first failure, last of the last one"
                    )
            elif first != last:
                problems.append(f"P-1 failed once, yet first_failed_at {first!r} != last_failed_at {last!r}")
        if problems:
            r.fail(f"the dead letter of {mid}: " + "; ".join(problems))
        block = blocks.get(fields["key"])
        if block is None:
            r.fail(
                f"{mid} was dead-lettered but its key {fields['key']} has no row in mq_blocked_keys: block the key "
                "so its later messages are parked"
            )
        wrong = []
        if block["entry_id"] != source:
            wrong.append(f"entry_id {block['entry_id']!r} (expected {source!r})")
        if block["message_id"] != mid:
            wrong.append(f"message_id {block['message_id']!r}")
        if block["dlq_id"] != dlq_id:
            wrong.append(f"dlq_id {block['dlq_id']!r} (the dead letter is {dlq_id!r})")
        if block["fields"] != fields:
            wrong.append("fields (expected the entry's fields as read)")
        if wrong:
            r.fail(f"mq_blocked_keys row of key {fields['key']}: wrong " + ", ".join(wrong))
    r.ok(
        "dead letters of P-1 (permanent, 1 attempt) and X-1 (exhausted, 4 attempts): original fields, source, "
        "attempts, first/last failure times, error text and type, reason; both keys blocked with the dead letter's id"
    )


KILLS = {
    "before change": "inside the handler of {k}-2, before its change",
    "after change": "inside the handler of {k}-2, after its change, before the commit",
    "before ack": "after {k}-2 committed, at the consumer's next Redis command (before its XACK)",
    "after ack": "right after the XACK of {k}-2",
}
#: Each crash scenario has keys of its own, so message ids never repeat between scenarios.
CRASH_KEYS = {
    "before change": ("K", "L"),
    "after change": ("M", "N"),
    "before ack": ("U", "V"),
    "after ack": ("W", "Y"),
}


def _crash_scenario(where: str, number: int):
    k = CRASH_KEYS[where][0]

    @scenario(
        f"{number}. a consumer is killed {KILLS[where].format(k=k)}; another replica takes over "
        f"({k}-5 arrives meanwhile)"
    )
    async def crash(r: Report, consumer, ns, watcher, admin) -> None:
        await _crash(r, ns, watcher, admin, where)

    crash.__name__ = f"_crash_{where.replace(' ', '_')}"
    return crash


async def _crash(r: Report, ns, watcher, admin, where: str) -> None:
    first, second = r.replicas("ordered_consumer", 2)
    k, other = CRASH_KEYS[where]
    k2 = f"{k}-2"
    where_text = KILLS[where].format(k=k)
    world = await _setup_world(ns, admin, "crash-" + where.replace(" ", "-"), watcher)
    if where == "before change":
        world.plan[k2] = ["kill before change"]
    elif where == "after change":
        world.plan[k2] = ["kill after change"]
    await world.publish(admin, [(k, 1), (other, 1), (k, 2), (other, 2), (k, 3), (k, 4), (other, 3)])
    clock = Clock()
    a = await start_replica(ns, world, "replica-a", watcher)
    if where == "before ack":
        a.kill_next_command_of = k2
    elif where == "after ack":
        a.kill_after_ack = world.entry_of(k2)
    what = f"killed {where_text}"
    try:
        run = await run_consumer(
            first, a, policy=policy_of(4, 0.1, 1.0), sleeps=Sleeps(clock), draws=Draws(r.random), clock=clock
        )
        expect_clean_run(r, run, a, f"replica a ({what})")
    finally:
        await stop_replica(a)
    if not a.dead:
        r.fail(
            f"the check armed a kill {where_text}, but replica a never got there: "
            + (
                f"does it call handle(conn, fields) for {k2}?"
                if "change" in where
                else "does it acknowledge with redis.xack(stream, group, entry_id) after the commit?"
            )
        )
    # the dead consumer's entries look long idle; a new message of K arrives meanwhile
    left = await pending(admin, world)
    for p in left:
        await admin.xclaim(world.stream, GROUP, p["consumer"], 0, [p["message_id"]], idle=3_600_000, justid=True)
    await world.publish(admin, [(k, 5), (other, 4)])
    b = await start_replica(ns, world, "replica-b", watcher)
    try:
        run = await run_consumer(
            second, b, policy=policy_of(4, 0.1, 1.0), sleeps=Sleeps(clock), draws=Draws(r.random), clock=clock
        )
        expect_clean_run(r, run, b, "replica b, taking over")
        if run.killed:
            r.fail(f"replica b died too: {b.killed_at or 'ConsumerKilled'} (catch nothing you did not raise)")
    finally:
        await stop_replica(b)
    rows = await applied(watcher, world)
    got = per_key(rows)
    if k2 not in got.get(k, []):
        cur = await watcher.execute("SELECT 1 FROM mq_processed WHERE message_id = %s", (k2,))
        recorded = await cur.fetchone() is not None
        still = [p for p in await pending(admin, world) if world.by_entry.get(p["message_id"]) == k2]
        if still:
            why = (
                f"its entry is still pending for {still[0]['consumer']}: replica b must first take over entries a dead "
                "consumer left pending (XAUTOCLAIM with claim_idle_ms; the check made them look idle for an hour)"
            )
        elif recorded:
            why = (
                "mq_processed says it was processed, but its change was never committed: the id was recorded in a "
                "commit of its own. Record it in the same transaction as the change"
            )
        elif any(e == world.entry_of(k2) for e, _ in a.acks):
            why = "replica a acknowledged it before its change was committed, so nobody redelivered it"
        else:
            why = "it was acknowledged without being applied"
        r.fail(f"killed {where_text}: {k2} was lost (never applied): {why}")
    expect_order(
        r,
        world,
        rows,
        {k: [f"{k}-{i}" for i in range(1, 6)], other: [f"{other}-{i}" for i in range(1, 5)]},
        what,
        takeover=True,
    )
    r.ok(f"{what}: after the takeover {k}-1..{k}-5 and {other}-1..{other}-4 applied once each, in order")
    await expect_all_acked(r, admin, world, what)
    expect_ack_after_commit(r, [a, b], world, what)
    r.ok("nothing left pending, every XACK after its commit")


for _i, _where in enumerate(KILLS, start=4):
    _crash_scenario(_where, _i)


# ----------------------------------------------------------------------------- replay_key


class ReplayHandler:
    """The handler for replays: applies, fails while ``broken``, can kill, and watches the block row."""

    def __init__(self, world: World, watcher, *, broken: set | None = None, kill_after: str | None = None) -> None:
        self.world = world
        self.watcher = watcher
        self.broken = set(broken or ())
        self.kill_after = kill_after
        self.calls: list[str] = []
        self.unblocked_early: list[str] = []
        self.misuse: list[str] = []
        self.dead = False

    async def __call__(self, conn, fields) -> None:
        if self.dead:
            raise mq.ConsumerKilled("this replica is dead")
        if not isinstance(fields, dict) or "id" not in fields:
            self.misuse.append(f"handle was called with {fields!r:.120}; expected the message's fields dict")
            raise TypeError("handle(conn, fields): fields must be the message's fields dict")
        mid = fields["id"]
        self.calls.append(mid)
        if mid in self.broken:
            raise malformed(mid)
        if fields.get("seq") != "1":  # a parked message: is the key still blocked for everyone else?
            cur = await self.watcher.execute(
                "SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s", (self.world.stream, fields["key"])
            )
            if await cur.fetchone() is None:
                self.unblocked_early.append(mid)
        await conn.execute(
            "INSERT INTO ch05_applied (stream, message_id, key, seq, consumer) VALUES (%s, %s, %s, %s, 'replay')",
            (self.world.stream, mid, fields["key"], int(fields["seq"])),
        )
        if mid == self.kill_after:
            self.dead = True
            raise mq.ConsumerKilled(f"the check killed the replay inside handle({mid}), after its change")


async def _blocked_world(ns, watcher, admin, name: str) -> World:
    """P-1 dead (malformed), P-2..P-12 parked (with ids 1-3..1-13, so text order is wrong), a
    duplicate of P-3, Q-1 dead too, B healthy: the state the reference consumer leaves."""
    world = await _setup_world(ns, admin, name, watcher)
    specs = [("B", 1), ("P", 1), *[("P", s) for s in range(2, 13)], ("Q", 1), ("B", 2), ("P", 3), ("Q", 2)]
    await world.publish(admin, specs)
    handler = ReplayHandler(world, watcher, broken={"P-1", "Q-1"})
    pool = await ns.pool(max_size=4)
    await mq.ordered_consumer(
        pool,
        admin,
        handler,
        stream=world.stream,
        group=GROUP,
        consumer="reference",
        dlq=world.dlq,
        policy=policy_of(3, 0.1, 1.0),
        sleep=Sleeps(Clock()),
        clock=Clock(),
    )
    return world


class ReplayHung(Exception):
    pass


async def _replay(replay_key, pool, admin, handler, world: World, key: str):
    job = asyncio.ensure_future(replay_key(pool, admin, handler, stream=world.stream, key=key, dlq=world.dlq))
    done, _ = await asyncio.wait([job], timeout=RUN_LIMIT)
    if not done:
        job.cancel()
        raise ReplayHung(f"replay_key(stream, key={key!r}) did not return within {RUN_LIMIT:g} s of real time")
    return job.result()


P_ORDER = [f"P-{s}" for s in range(1, 13)]


async def _expect_replayed(r: Report, watcher, admin, world: World, what: str) -> None:
    got = per_key(await applied(watcher, world))
    p = got.get("P", [])
    if p != P_ORDER:
        dup = [m for m, n in Counter(p).items() if n > 1]
        if dup:
            r.fail(
                f"{what}: key P applied {p}; {dup[0]} twice. A replay applies each message once: record its id in "
                "mq_processed with its change, skip ids already there (the parked P-3 was delivered twice)"
            )
        if sorted(p) == sorted(P_ORDER):
            hint = (
                " The parked entries were sorted as text ('1-10' < '1-3'): order by the entry id as two numbers"
                if p[1:] and p[1] != "P-2" and "P-10" in p[:5]
                else " Apply the dead-lettered message first, then the parked ones in stream order"
            )
            r.fail(f"{what}: key P applied {p}, expected {P_ORDER}.{hint}")
        r.fail(f"{what}: key P applied {p}, expected {P_ORDER}")
    r.ok(f"{what}: P-1 (the dead letter), then P-2..P-12 (parked) applied once each, in stream order")
    blocks = await blocked(watcher, world)
    park = await parked(watcher, world)
    left = [world.by_entry.get(e, e) for e, row in park.items() if row["key"] == "P"]
    r.expect("P" not in blocks, "key P unblocked", "key P is still in mq_blocked_keys after the replay: unblock it")
    r.expect(not left, "no parked rows left for P", f"mq_parked still holds {left} after the replay: delete them")
    dead = {f.get("id") for _, f in await admin.xrange(world.dlq)}
    r.expect(
        "P-1" not in dead,
        "P-1's dead letter deleted (XDEL)",
        "the dead-letter stream still holds P-1 after the replay: delete it (XDEL dlq_id) once the replay committed, "
        "or the DLQ size alert never clears",
    )
    r.expect(
        "Q" in blocks and "Q-1" in dead and "Q-2" in {world.by_entry.get(e) for e in park},
        "key Q (another dead letter) untouched: still blocked, its dead letter and parked message kept",
        f"replaying P changed key Q: blocked {sorted(blocks)}, dead letters {sorted(dead)}; replay only the given key",
    )


REPLAYS: list[tuple[str, Callable]] = []


def replay_scenario(title: str):
    def register(fn):
        REPLAYS.append((title, fn))
        return fn

    return register


@task("replay_key", points=5, title="replay a blocked key in order, once", timeout=60, partial=True, seed=506)
async def check_replay_key(r: Report, replay_key) -> None:
    async with lab.scratch("ch05") as ns:
        pool = await ns.pool(max_size=4)
        await ch05.setup_schema(pool)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        admin = ns.redis()
        try:
            chosen = REPLAYS[:1] if r.public else REPLAYS
            passed = 0
            for title, fn in chosen:
                r.note(title)
                before = r.failures
                try:
                    await fn(r, replay_key, ns, pool, watcher, admin)
                except Stop:
                    pass
                except Exception as err:  # noqa: BLE001 - the learner's replay raised where it must not
                    if isinstance(err, NotImplementedError):
                        raise
                    r.fail(f"replay_key raised {error_line(err, 200)}", stop=False)
                if r.failures == before:
                    passed += 1
            r.fraction = passed / len(chosen)
            if not r.public:
                r.note(f"{passed} of {len(chosen)} scenarios passed")
        finally:
            await watcher.close()


@replay_scenario(
    "1. key P blocked by its dead letter P-1 with 11 parked messages (P-3 twice), key Q blocked too; "
    "the cause is fixed: replay P"
)
async def _replay_basic(r: Report, replay_key, ns, pool, watcher, admin) -> None:
    world = await _blocked_world(ns, watcher, admin, "replay")
    handler = ReplayHandler(world, watcher, broken={"Q-1"})
    await _replay(replay_key, pool, admin, handler, world, "P")
    if handler.misuse:
        r.fail(handler.misuse[0])
    if handler.unblocked_early:
        r.fail(
            f"key P was already unblocked (committed) while {handler.unblocked_early[0]} was being applied: a new "
            "message of P could overtake the parked ones. Unblock only after (or in the transaction of) the last one"
        )
    await _expect_replayed(r, watcher, admin, world, "replay of P")


@replay_scenario("2. replay P again, from another replica; then a new P-13 arrives: nothing changes, P-13 applies")
async def _replay_twice(r: Report, replay_key, ns, pool, watcher, admin) -> None:
    world = await _blocked_world(ns, watcher, admin, "twice")
    first, second = r.replicas("replay_key", 2)
    await _replay(first, pool, admin, ReplayHandler(world, watcher, broken={"Q-1"}), world, "P")
    handler = ReplayHandler(world, watcher, broken={"Q-1"})
    await _replay(second, pool, admin, handler, world, "P")
    r.expect(
        not handler.calls,
        "a second replay of P (another replica) called handle for nothing",
        f"a second replay of P called handle for {handler.calls}: once a key is replayed (unblocked), replaying "
        "it again must change nothing",
    )
    await _expect_replayed(r, watcher, admin, world, "two replays of P")
    await world.publish(admin, [("P", 13)])
    await mq.ordered_consumer(
        pool,
        admin,
        ReplayHandler(world, watcher, broken={"Q-1"}),
        stream=world.stream,
        group=GROUP,
        consumer="reference",
        dlq=world.dlq,
        policy=policy_of(3, 0.1, 1.0),
        sleep=Sleeps(Clock()),
        clock=Clock(),
    )
    p = per_key(await applied(watcher, world)).get("P", [])
    r.expect(
        p == [*P_ORDER, "P-13"],
        "a new P-13 after the replay is applied by the consumer, after P-12",
        f"after the replay a new P-13 was not applied in order ({p[-3:]}): the key must be unblocked",
    )


@replay_scenario("3. replay P while the cause is not fixed (P-1 still fails): nothing changes")
async def _replay_not_fixed(r: Report, replay_key, ns, pool, watcher, admin) -> None:
    world = await _blocked_world(ns, watcher, admin, "notfixed")
    handler = ReplayHandler(world, watcher, broken={"P-1", "Q-1"})
    try:
        await _replay(replay_key, pool, admin, handler, world, "P")
        r.note("replay_key returned although P-1 failed again (letting the error through tells the operator)")
    except Exception as err:  # noqa: BLE001 - expected: the handler's error comes through
        if isinstance(err, NotImplementedError):
            raise
        r.ok(f"replay_key let the error through: {error_line(err, 100)}")
    got = per_key(await applied(watcher, world)).get("P", [])
    blocks = await blocked(watcher, world)
    park = await parked(watcher, world)
    left = sorted((world.by_entry.get(e, e) for e, row in park.items() if row["key"] == "P"), key=lambda m: int(m[2:]))
    dead = {f.get("id") for _, f in await admin.xrange(world.dlq)}
    r.expect(
        not got and "P" in blocks and len(left) >= 11 and "P-1" in dead,
        "P-1 failed again: nothing of P applied, P still blocked, its 11 parked messages and its dead letter kept",
        f"P-1 failed again during the replay, and then: applied {got}, P blocked: {'P' in blocks}, parked "
        f"{left}, dead letter kept: {'P-1' in dead}. A failed replay must leave the key as it was (roll back)",
    )
    handler = ReplayHandler(world, watcher, broken={"Q-1"})
    await _replay(replay_key, pool, admin, handler, world, "P")
    await _expect_replayed(r, watcher, admin, world, "the replay after the fix")


@replay_scenario("4. the replay is killed inside the handler of P-4 (after its change); another replica replays again")
async def _replay_crash(r: Report, replay_key, ns, pool, watcher, admin) -> None:
    world = await _blocked_world(ns, watcher, admin, "crash")
    first, second = r.replicas("replay_key", 2)
    killer = ReplayHandler(world, watcher, broken={"Q-1"}, kill_after="P-4")
    small = await ns.pool(max_size=2, fresh=True)
    try:
        await _replay(first, small, admin, killer, world, "P")
        r.fail("the check killed the replay inside handle(P-4), yet replay_key returned: do not catch ConsumerKilled")
    except mq.ConsumerKilled:
        pass
    except Group as eg:
        if not _killed(eg):
            raise
    finally:
        await small.close()
    r.expect(bool(killer.dead), "killed the replay inside handle(P-4)", "the replay never called handle for P-4")
    await _replay(second, pool, admin, ReplayHandler(world, watcher, broken={"Q-1"}), world, "P")
    await _expect_replayed(r, watcher, admin, world, "a replay killed mid-way, then run again")
