"""What every chapter's checks do alike: fire a concurrent burst, tally its outcomes, clean up,
force a read-then-write race on Redis (:func:`gated_redis`), run the answer in other
processes (:class:`Workers`).

Checks in ``autograder/checks/chNN.py`` import these instead of writing their own, so a
report reads the same in every chapter: ``10 x a response, 2 x UniqueViolation: ...``.
:class:`Crowd` makes a race between concurrent callers on PostgreSQL happen every time
(chapters 03 and 12).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import contextvars
import importlib
import inspect
import json
import os
import random
import re
import secrets
import subprocess
import sys
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import redis as redis_sync
import redis.asyncio as aioredis

from autograder import lockstep
from autograder.harness import Report, cell_source, error_line
from autograder.loops import fire_timers, loop_timers
from course.kit.faults import VirtualClock
from course.kit.lab import LOCK_WAITERS

REPO = Path(__file__).resolve().parent.parent


async def burst(n: int, call: Callable[[], Awaitable]) -> list:
    """Start ``call()`` ``n`` times at once; results and exceptions, in call order."""
    return await asyncio.gather(*(call() for _ in range(n)), return_exceptions=True)


def label(outcome, ok: str | None = None) -> str:
    """One outcome as a report word: ``ok`` (or its repr) for a value, ``Type: message`` for an error."""
    if isinstance(outcome, BaseException):
        return error_line(outcome, 120)
    return ok if ok is not None else repr(outcome)[:120]


def tally(outcomes: Iterable, ok: str | None = None, top: int | None = None) -> str:
    """``"8 x a response, 2 x UniqueViolation: duplicate key ..."``, most frequent first."""
    counts = Counter(label(x, ok) for x in outcomes)
    return ", ".join(f"{n} x {what}" for what, n in counts.most_common(top))


def fmt(values) -> str:
    """A list of numbers as ``[0.1, 0.2031, 0.4]`` (4 significant digits), others as repr."""
    return "[" + ", ".join(f"{v:.4g}" if isinstance(v, (int, float)) else repr(v) for v in values) + "]"


class Spawned(list):
    """Tasks a check starts; at the end every one is cancelled or has its outcome retrieved,
    so no "exception was never retrieved" warning leaks into a later notebook cell."""

    def __call__(self, coro) -> asyncio.Future:
        fut = asyncio.ensure_future(coro)
        self.append(fut)
        return fut

    async def settle(self) -> None:
        for fut in self:
            if not fut.done():
                fut.cancel()
        await asyncio.gather(*self, return_exceptions=True)


async def settled() -> None:
    """Until nothing is ready to run on this loop, nor in the learner's processes when its code runs in
    its own (:mod:`autograder.session`): where "wait a few loop turns" would race another process."""
    from course.kit.faults import _until_idle

    await _until_idle()


def call_seeing_args(r: Report, name: str, *args) -> tuple:
    """``name(*args)`` from the answer, and its arguments as they are afterwards: does it change what it
    was given? (In a learner's process its arguments are copies: a change shows only there.)"""
    remote = getattr(r.namespace, "call_seeing_args", None)
    if remote is not None:
        return remote(name, *args)
    return r.namespace[name](*args), list(args)


class AnswerLoop:
    """The event loop the answer's code runs on (this one, or its process's): its timers and tasks.

    ``mark()`` notes what is pending now; ``fire(mark)`` makes every timer set since then due at once
    (a ticker's sleep, a delayed flush), returning how many; ``left_running(mark)`` says whether a
    timer or task was started since then.
    """

    def __init__(self, r: Report) -> None:
        self.remote = getattr(r.namespace, "learner", None)

    def mark(self):
        if self.remote is not None:
            return self.remote.root.loop_mark()
        loop = asyncio.get_running_loop()
        return (loop_timers(loop), asyncio.all_tasks())

    def fire(self, mark) -> int:
        if self.remote is not None:
            return self.remote.root.loop_fire(mark)
        return fire_timers(asyncio.get_running_loop(), mark[0])

    def left_running(self, mark) -> bool:
        if self.remote is not None:
            return self.remote.root.loop_left_running(mark)
        loop = asyncio.get_running_loop()
        known = {id(h) for h in mark[0]}
        return any(id(h) not in known for h in loop_timers(loop)) or any(
            not t.done() for t in asyncio.all_tasks() - mark[1]
        )


@contextlib.contextmanager
def seeded_random(r: Report):
    """Seed the ``random`` module from the report's seed for one check (restored afterwards),
    for learner code that draws from ``random`` itself rather than an injected source."""
    state = random.getstate()
    seed = r.random.getrandbits(64)
    random.seed(seed)
    session = getattr(r.namespace, "session", None)  # the learner's processes draw from their own random
    learners = [x for x in session.learners if x.alive] if session is not None else []
    for learner in learners:
        learner.root.seed_random(seed)
    try:
        yield
    finally:
        random.setstate(state)
        for learner in learners:
            if learner.alive:
                learner.root.restore_random()


# ----------------------------------------------------------------------------- races in a Redis client


def gated_redis(url: str, n: int, busy=None) -> lockstep.GatedRedis:
    """A client whose ``n`` callers run in lockstep (:mod:`autograder.lockstep`): each Redis command
    is held until every caller still running has sent its own, so a read-then-write loses its race
    on every run. Run the callers with ``await client.gate.run([make_call, ...])``. ``busy``: see
    :func:`postgres_busy`, for callers that also talk to PostgreSQL."""
    return lockstep.gated_redis(url, lockstep.Gate(n, busy))


ACTIVE_BACKENDS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()
"""


def postgres_busy(watcher):
    """``await busy()``: whether a statement runs in the watcher's database (a caller on its way to
    its next Redis command through PostgreSQL, which the event loop does not show as work)."""

    async def busy() -> bool:
        cur = await watcher.execute(ACTIVE_BACKENDS)
        return (await cur.fetchone())[0] > 0

    return busy


# ----------------------------------------------------------------------------- worker processes

WORKER = r"""
import asyncio, importlib, json, sys, time

import redis as redis_sync

redis_url, tag, me = sys.argv[1], sys.argv[2], int(sys.argv[3])
with redis_sync.Redis.from_url(redis_url, decode_responses=True) as boot:
    spec = json.loads(boot.get(f"{tag}:spec:{me}"))
if spec["skew"]:
    def shifted(real, by):
        return lambda: real() + by
    for name in ("time", "monotonic"):
        setattr(time, name, shifted(getattr(time, name), spec["skew"]))
    for name in ("time_ns", "monotonic_ns"):
        setattr(time, name, shifted(getattr(time, name), int(spec["skew"] * 1e9)))

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from autograder.child import build_namespace
from autograder.lockstep import RemoteGate, gated_redis


def build():
    ns = build_namespace(spec)
    return ns[spec["fn"]]


def shape(out):
    try:
        json.dumps(out)
    except (TypeError, ValueError):
        return {"error": f"returned {out!r:.80}, which is not JSON-able"}
    return {"ok": out}


async def main():
    ctl = aioredis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=None)  # BLPOP waits its own timeout
    try:
        fn = build()
    except BaseException as err:
        import traceback
        where = traceback.extract_tb(err.__traceback__)[-1]
        await ctl.rpush(f"{tag}:ready", json.dumps({"index": me, "error": f"{type(err).__name__}: {err} ({where.filename}:{where.lineno})"}))
        return
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await ctl.rpush(f"{tag}:ready", json.dumps({"index": me}))
    while True:
        got = await ctl.blpop([f"{tag}:cmd:{me}"], timeout=120)
        if got is None:
            return
        cmd = json.loads(got[1])
        if cmd["op"] == "stop":
            return

        async def one(redis):
            try:
                return shape(await fn(redis, *cmd["args"], **cmd["kwargs"]))
            except Exception as err:
                return {"error": f"{type(err).__name__}: {err}"[:200]}

        if cmd.get("lockstep"):
            gate = RemoteGate(cmd["n"], ctl, tag, me)
            gated = gated_redis(redis_url, gate)
            try:
                results = await gate.run([lambda: one(gated) for _ in range(cmd["n"])])
            finally:
                await gated.aclose()
        else:
            results = await asyncio.gather(*(one(client) for _ in range(cmd["n"])))
        await ctl.rpush(f"{tag}:res:{me}", json.dumps(results))


asyncio.run(main())
"""


def _names_used(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def _environment(namespace: dict, source: str) -> list:
    """What a fresh process needs to run the answer cell: the modules, importable names and
    plain constants of the notebook's globals (the setup cells' imports) that the cell uses."""
    env = []
    used = _names_used(source)
    for name, value in namespace.items():
        if name not in used or name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            env.append(["module", name, value.__name__])
        elif isinstance(value, (bool, int, float, str)) or value is None:
            env.append(["value", name, value])
        elif isinstance(value, bytes):  # a key from a setup cell (chapter 12's CODE_KEY)
            env.append(["bytes", name, value.hex()])
        elif (entry := _importable(name, value)) is not None:
            env.append(entry)
    return env


def carried(namespace: dict, source: str) -> set[str]:
    """The notebook names a fresh process gets for the answer cell ``source`` (:func:`_environment`)."""
    return {entry[1] for entry in _environment(namespace, source)}


def _importable(name: str, value) -> list | None:
    """``["attr", name, module, qualname]`` when ``value`` can be imported again by name."""
    if not (inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value)):
        return None
    module = getattr(value, "__module__", None) or ""
    qualname = getattr(value, "__qualname__", "")
    if not module or module in ("__main__", "__learner__", "builtins") or "<" in qualname:
        return None
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001 - not importable: leave it out
        return None
    return ["attr", name, module, qualname] if found is value else None


def _spec_of(r: Report, name: str) -> dict:
    """What a fresh process needs to define ``name`` as the answer does: its cell and the notebook
    names that cell uses, or the module to import it from."""
    fn = r.namespace[name]
    imported = _importable(name, fn)
    if imported is not None:  # imported from a module (the course's own reference): import it there too
        return {"source": "", "filename": "<import>", "env": [imported], "fn": name}
    found = cell_source(fn)
    if found is None:
        raise LookupError(f"cannot find the cell that defines {name}; run it again")
    filename, source = found
    return {"source": source, "filename": filename, "env": _environment(r.namespace, source), "fn": name}


FRESH = r"""
import json, sys
from autograder.child import build_namespace
job = json.load(sys.stdin)
out, cells = [], {}  # one namespace per cell: two functions of one cell share its state, as in the notebook
for name, args in job["calls"]:
    try:
        spec = job["specs"][name]
        cell = (spec["filename"], spec["source"]) if spec["source"] else ("<import>", name)
        if cell not in cells:
            cells[cell] = build_namespace(spec)
        out.append({"ok": cells[cell][name](*args)})
    except Exception as err:
        out.append({"error": f"{type(err).__name__}: {err}"[:200]})
json.dump(out, sys.stdout, default=repr)
"""


def in_fresh_process(r: Report, calls: list[tuple[str, list]], timeout: float = 30.0) -> list:
    """``[name(*args) for name, args in calls]`` in a new Python process with a fixed ``PYTHONHASHSEED``
    (another replica of the service, whose ``hash()`` of a str or bytes differs from this one's), each
    answer cell run afresh there: ``[{"ok": value} | {"error": "Type: message"}, ...]``. Plain
    functions of JSON-able arguments only. LookupError(name) when the cell uses a notebook name
    that could not be carried to the other process (see :func:`_environment`)."""
    hashseed = 2 if os.environ.get("PYTHONHASHSEED") == "1" else 1  # never this process's own
    remote = getattr(r.namespace, "fresh_process", None)
    if remote is not None:  # the learner's code runs in processes of its own: one more of them
        return remote(calls, hashseed)
    specs = {name: _spec_of(r, name) for name in {name for name, _ in calls}}
    env = dict(
        os.environ,
        PYTHONHASHSEED=str(hashseed),
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", FRESH],
            input=json.dumps({"specs": specs, "calls": calls}),
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the answer did not finish within {timeout:g} s in a fresh process") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"in a fresh process the answer cell failed: {last[:200]}")
    out = json.loads(done.stdout)
    for x in out:  # a notebook name the check could not carry over is the check's limit, not the answer's
        missing = re.fullmatch(r"NameError: name '(\w+)' is not defined", x.get("error", ""))
        if missing and missing[1] in r.namespace:
            raise LookupError(missing[1])
    return out


class Workers:
    """The learner's answer, run in ``len(skews)`` fresh Python processes, as replicas on other hosts.

    :meth:`Report.replicas` copies an answer inside the grader's process; these are real
    processes, as a service's replicas are. Each runs the answer cell that defined ``name``
    (or imports ``name`` again, when the answer imported it) after the notebook's imports that
    the cell uses, and takes commands from a Redis list: "call ``name(redis, *args, **kwargs)``
    ``n`` times at once" (``redis`` is its own ``redis.asyncio.Redis`` with
    ``decode_responses=True``), answering ``[{"ok": result} | {"error": "Type: message"}, ...]``.
    ``skews[i]`` sets worker ``i``'s clocks (``time.time``, ``time.monotonic`` and their
    ``_ns`` forms) that many seconds off. Always :meth:`close` them (a ``finally``).
    """

    def __new__(cls, r: Report, name: str, redis_url: str, skews: tuple[float, ...] = (0.0, 0.0)):
        remote = getattr(r.namespace, "workers", None)
        if remote is not None:  # the learner's code runs in processes of its own: these are more of them
            return remote(name, redis_url, skews)
        return super().__new__(cls)

    def __init__(self, r: Report, name: str, redis_url: str, skews: tuple[float, ...] = (0.0, 0.0)) -> None:
        base = _spec_of(r, name)
        self.tag = f"ch08:workers:{secrets.token_hex(4)}"
        self.redis_url = redis_url
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with redis_sync.Redis.from_url(redis_url, decode_responses=True) as boot:
            for i, skew in enumerate(skews):
                spec = {**base, "skew": skew}
                boot.set(f"{self.tag}:spec:{i}", json.dumps(spec), ex=600)
        for i in range(len(skews)):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER, redis_url, self.tag, str(i)],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        # socket_timeout=None: redis-py 8 cuts every read at 5 s, so a BLPOP for a worker slowed by a
        # loaded machine would raise instead of waiting its own timeout (a grade that depends on load)
        self.ctl = aioredis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=None)

    async def ready(self, timeout: float = 60.0) -> str | None:
        """None when every worker is up; else what went wrong in the first that failed."""
        deadline = time.monotonic() + timeout
        up = 0
        while up < len(self.procs):
            got = await self.ctl.blpop([f"{self.tag}:ready"], timeout=1)
            if got is None:
                if any(p.poll() is not None for p in self.procs):
                    return "a worker process exited before it was ready (see its traceback by running the cell)"
                if time.monotonic() > deadline:
                    return f"a worker process did not start within {timeout:g} s"
                continue
            msg = json.loads(got[1])
            if "error" in msg:
                return msg["error"]
            up += 1
        return None

    async def send(self, i: int, n: int, *args, **kwargs) -> None:
        await self.ctl.rpush(f"{self.tag}:cmd:{i}", json.dumps({"op": "call", "n": n, "args": args, "kwargs": kwargs}))

    async def receive(self, i: int, timeout: float = 30.0) -> list:
        got = await self.ctl.blpop([f"{self.tag}:res:{i}"], timeout=timeout)
        if got is None:
            raise TimeoutError(f"worker {i} did not answer within {timeout:g} s")
        return json.loads(got[1])

    async def call_in_lockstep(self, n: int, *args, **kwargs) -> tuple[list, dict]:
        """``n`` concurrent calls in every worker at once, all of them in one lockstep
        (:mod:`autograder.lockstep`): each Redis command waits until every call still running, in
        every process, has sent its own. The results of worker 0, then worker 1, ..., and how the
        lockstep went (``rounds``, ``commands``, ``stalled``)."""
        for i in range(len(self.procs)):
            await self.ctl.rpush(
                f"{self.tag}:cmd:{i}",
                json.dumps({"op": "call", "n": n, "args": args, "kwargs": kwargs, "lockstep": True}),
            )
        alive = lambda: all(p.poll() is None for p in self.procs)  # noqa: E731
        summary = await lockstep.coordinate(self.ctl, self.tag, len(self.procs), alive)
        results = []
        for i in range(len(self.procs)):
            results += await self.receive(i)
        return results, summary

    async def call(self, i: int, n: int, *args, **kwargs) -> list:
        await self.send(i, n, *args, **kwargs)
        return await self.receive(i)

    async def close(self) -> None:
        for i in range(len(self.procs)):
            await self.ctl.rpush(f"{self.tag}:cmd:{i}", json.dumps({"op": "stop"}))
        deadline = time.monotonic() + 3
        for proc in self.procs:
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        await self.ctl.aclose()


# ----------------------------------------------------------------------------- races on PostgreSQL

SETTLE_LIMIT = 2.0  # real seconds a crowd may take to settle before the check moves it on anyway


class Crowd:
    """``n`` concurrent callers whose progress the check can see.

    Each caller is "calling" (running learner code), "charging" (held in ``charge``),
    "sleeping" (in its retry backoff, on a VirtualClock) or "done". The crowd is *settled*
    when every caller still "calling" is blocked on a PostgreSQL lock. At the first settle
    the crowd runs ``on_settled`` (open the charge gate, or commit the transaction that
    holds the accounts); at later settles it wakes the earliest sleeper by advancing the clock.
    """

    def __init__(self, n: int, watcher, on_settled: Callable[[], Awaitable[None]] | None = None) -> None:
        self.n = n
        self.watcher = watcher
        self.clock = VirtualClock(auto=False)
        self.state = ["calling"] * n
        self.wake = [0.0] * n
        self.gate = asyncio.Event()
        self.on_settled = on_settled
        self.released = False
        self.stalls = 0
        self.charging_at_release = 0
        self.sleeping_at_release = 0
        self.blocked_at_release = 0
        self._who: contextvars.ContextVar[int | None] = contextvars.ContextVar("caller", default=None)

    async def sleep(self, seconds: float) -> None:
        i = self._who.get()
        if i is None:
            await self.clock.sleep(seconds)
            return
        self.state[i] = "sleeping"
        self.wake[i] = self.clock() + seconds
        try:
            await self.clock.sleep(seconds)
        finally:
            self.state[i] = "calling"

    async def hold(self) -> None:
        """Called inside ``charge``: wait here until the crowd has settled once."""
        i = self._who.get()
        if i is None or self.gate.is_set():
            return
        self.state[i] = "charging"
        try:
            await self.gate.wait()
        finally:
            self.state[i] = "calling"

    async def _blocked(self) -> int:
        cur = await self.watcher.execute(LOCK_WAITERS)
        return (await cur.fetchone())[0]

    async def _settle(self) -> tuple[bool, int]:
        deadline = time.monotonic() + SETTLE_LIMIT
        while True:
            await asyncio.sleep(0.002)
            calling = self.state.count("calling")
            blocked = await self._blocked() if calling else 0
            if blocked >= calling:
                return True, blocked
            if time.monotonic() > deadline:
                return False, blocked

    async def run(self, make_call: Callable[[int], Awaitable]) -> list:
        async def one(i: int):
            self._who.set(i)
            try:
                return await make_call(i)
            finally:
                self.state[i] = "done"

        tasks = [asyncio.create_task(one(i)) for i in range(self.n)]
        while not all(t.done() for t in tasks):
            settled, blocked = await self._settle()
            if all(t.done() for t in tasks):
                break
            self.stalls += not settled
            if not self.released:
                self.released = True
                self.charging_at_release = self.state.count("charging")
                self.sleeping_at_release = self.state.count("sleeping")
                self.blocked_at_release = blocked
                self.gate.set()
                if self.on_settled is not None:
                    await self.on_settled()
                continue
            sleepers = [i for i, s in enumerate(self.state) if s == "sleeping"]
            if sleepers:
                t = min(self.wake[i] for i in sleepers)
                for i in sleepers:
                    if self.wake[i] <= t:
                        self.state[i] = "calling"
                self.clock.advance(max(0.0, t - self.clock()))
        return await asyncio.gather(*tasks, return_exceptions=True)


# ----------------------------------------------------------------------------- watching a learner's Redis traffic

#: ``await hook(commands, send)``: ``commands`` are the argument tuples sent in one round trip
#: (one for a command, several for a pipeline); ``send()`` sends them and returns the reply.
RoundTripHook = Callable[[list[tuple], Callable[[], Awaitable]], Awaitable]


def hooked_redis(url: str, hook: RoundTripHook, **kwargs):
    """A ``redis.asyncio.Redis`` (``decode_responses=True``) whose every round trip goes through ``hook``.

    Commands, pipelines (``MULTI`` or not), ``WATCH`` mode and scripts all pass through it, so a
    check can count round trips and what they returned, hold a write back until other callers
    have caught up, or act just before a write reaches the server.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.client import Pipeline

    class HookedPipeline(Pipeline):
        async def execute(self, raise_on_error: bool = True):
            stack = [args for args, _ in self.command_stack]
            return await hook(stack, lambda: super(HookedPipeline, self).execute(raise_on_error))

        async def immediate_execute_command(self, *args, **options):
            return await hook([args], lambda: super(HookedPipeline, self).immediate_execute_command(*args, **options))

    class HookedRedis(aioredis.Redis):
        async def execute_command(self, *args, **options):
            return await hook([args], lambda: super(HookedRedis, self).execute_command(*args, **options))

        def pipeline(self, transaction: bool = True, shard_hint=None):
            return HookedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)

    kwargs.setdefault("decode_responses", True)
    return HookedRedis.from_url(url, **kwargs)
