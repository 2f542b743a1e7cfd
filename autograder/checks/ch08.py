"""Hidden checks of chapter 08 (rate limiting): ``token_bucket`` and ``sliding_window``.

Both limiters must hold across processes, so the checks run the learner's answer cell in
**real worker processes** (two Python processes on the same Redis, see :class:`Workers`)
as well as in the grader: a bucket kept in a dict admits twice as much there. One worker
can run with its clock set two minutes back, so a limiter that reads the client's clock
instead of Redis ``TIME`` admits more than its limit.

Time is injected (``now=``) everywhere else, so every verdict is exact: refill after 0.2 s,
a burst on both sides of a window boundary, the retry a ``Retry-After`` promises. Races
are made to happen every time: a :class:`Gate` in front of the Redis client holds each
caller's first command until all twenty callers have sent one, so a read-then-write lets
all twenty read the same state, while one Lua script (or WATCH/MULTI) stays exact.
"""

from __future__ import annotations

import ast
import asyncio
import contextvars
import importlib
import inspect
import json
import math
import os
import secrets
import subprocess
import sys
import time
import types
from pathlib import Path

import redis as redis_sync
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from autograder.harness import Report, cell_source, task
from autograder.probes import fmt, tally
from course.kit import lab

REPO = Path(__file__).resolve().parents[2]
T0 = 1_000_020.0  # injected time: a multiple of 60, so window boundaries fall on whole minutes
SKEW = -120.0  # seconds the second worker's clock is set back

# ----------------------------------------------------------------------------- the gate


_caller: contextvars.ContextVar[int | None] = contextvars.ContextVar("caller", default=None)


class Gate:
    """Holds each caller's first Redis command until ``n`` callers are held, then lets all go.

    If the callers cannot all arrive (they queue on an in-process lock, say), the gate
    opens once nothing on the loop can move, and says so.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.held = 0
        self.passed: set[int] = set()
        self.open = asyncio.Event()
        self.stalled = False

    async def hold(self) -> None:
        who = _caller.get()
        if who is None or self.open.is_set() or who in self.passed:
            return
        self.passed.add(who)
        self.held += 1
        if self.held >= self.n:
            self.open.set()
            return
        await self.open.wait()

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        calm = 0
        while not self.open.is_set():
            await asyncio.sleep(0.003)
            calm = calm + 1 if not getattr(loop, "_ready", None) else 0
            if calm >= 10:
                self.stalled = True
                self.open.set()

    async def run(self, calls: list) -> list:
        async def one(i: int, make):
            _caller.set(i)
            return await make()

        watcher = asyncio.ensure_future(self.watch())
        try:
            return await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)), return_exceptions=True)
        finally:
            self.open.set()
            await watcher


class _GatedPipeline(Pipeline):
    gate: Gate

    async def immediate_execute_command(self, *args, **options):
        await self.gate.hold()
        return await super().immediate_execute_command(*args, **options)

    async def execute(self, raise_on_error: bool = True):
        await self.gate.hold()
        return await super().execute(raise_on_error)


class _GatedRedis(aioredis.Redis):
    gate: Gate

    async def execute_command(self, *args, **options):
        await self.gate.hold()
        return await super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint=None):
        pipe = _GatedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.gate = self.gate
        return pipe


def gated_redis(url: str, n: int) -> _GatedRedis:
    client = _GatedRedis.from_url(url, decode_responses=True)
    client.gate = Gate(n)
    return client


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


def build():
    ns = {"__name__": "__learner__"}
    for entry in spec["env"]:
        try:
            if entry[0] == "module":
                ns[entry[1]] = importlib.import_module(entry[2])
            elif entry[0] == "attr":
                obj = importlib.import_module(entry[2])
                for part in entry[3].split("."):
                    obj = getattr(obj, part)
                ns[entry[1]] = obj
            else:
                ns[entry[1]] = entry[2]
        except Exception:
            pass
    if spec["source"]:
        exec(compile(spec["source"], spec["filename"], "exec"), ns)
    return ns[spec["fn"]]


def shape(out):
    try:
        return {"ok": [bool(out[0]), float(out[1])]}
    except Exception:
        return {"error": f"returned {out!r:.80}, expected (admitted, retry_after)"}


async def main():
    ctl = aioredis.Redis.from_url(redis_url, decode_responses=True)
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

        async def one():
            try:
                return shape(await fn(client, *cmd["args"], **cmd["kwargs"]))
            except Exception as err:
                return {"error": f"{type(err).__name__}: {err}"[:200]}

        results = await asyncio.gather(*(one() for _ in range(cmd["n"])))
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
        elif (entry := _importable(name, value)) is not None:
            env.append(entry)
    return env


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


class Workers:
    """The learner's answer cell, run in ``len(skews)`` fresh Python processes on one Redis.

    Each worker takes commands from a Redis list: "call your function ``n`` times at once
    with these arguments" and answers with the outcomes. ``skews[i]`` sets worker ``i``'s
    clocks (``time.time``, ``time.monotonic``) that many seconds off.
    """

    def __init__(self, r: Report, name: str, redis_url: str, skews: tuple[float, ...] = (0.0, 0.0)) -> None:
        fn = r.namespace[name]
        imported = _importable(name, fn)
        if imported is not None:  # imported from a module (the course's own reference): import it there too
            filename, source, names = "<import>", "", [imported]
        else:
            found = cell_source(fn)
            if found is None:
                raise LookupError(f"cannot find the cell that defines {name}; run it again")
            filename, source = found
            names = _environment(r.namespace, source)
        self.tag = f"ch08:workers:{secrets.token_hex(4)}"
        self.redis_url = redis_url
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with redis_sync.Redis.from_url(redis_url, decode_responses=True) as boot:
            for i, skew in enumerate(skews):
                spec = {"source": source, "filename": filename, "env": names, "fn": name, "skew": skew}
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
        self.ctl = aioredis.Redis.from_url(redis_url, decode_responses=True)

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


def _admitted(results: list) -> int:
    return sum(1 for x in results if "ok" in x and x["ok"][0])


def _errors(results: list) -> list[str]:
    return [x["error"] for x in results if "error" in x]


# ----------------------------------------------------------------------------- shared probes


def _shape(out) -> tuple[bool, float]:
    """``(admitted, retry_after)`` from what the learner returned, or TypeError."""
    try:
        admitted, wait = out[0], out[1]
        return bool(admitted), float(wait)
    except (TypeError, IndexError, KeyError, ValueError):
        raise TypeError(f"returned {out!r:.80}, expected a tuple (admitted, retry_after)") from None


async def _calls(fn, n: int, *args, **kwargs) -> list[tuple[bool, float]]:
    return [_shape(await fn(*args, **kwargs)) for _ in range(n)]


async def _ttls(redis, key: str) -> dict[str, int]:
    """PTTL (ms) of every key whose name contains ``key``."""
    names = [k async for k in redis.scan_iter(match=f"*{key}*")]
    return {k: await redis.pttl(k) for k in names}


def _close(wait: float, exact: float) -> bool:
    """``wait`` is ``exact`` seconds, or that rounded up to the millisecond."""
    return exact - 1e-6 <= wait <= exact + 0.0011


def _wait_hint(wait: float, exact: float) -> str:
    """Why a token bucket's wait may be off, when the number itself says so."""
    if math.isclose(wait, exact * 1000, rel_tol=0.01):
        return ": that is milliseconds; return seconds"
    if wait == 0 or (wait == int(wait) and exact != int(exact) and wait == int(exact)):
        return ": Redis turns a Lua number into an integer (0.25 -> 0); return milliseconds or a string"
    if exact * 0.9 < wait < exact:
        return ": a little less, as if time had passed; use the injected now"
    if exact != 0.5 and math.isclose(wait, 0.5):
        return ": that is one token's time (1 / rate), but half a token is already there"
    if wait > exact:
        return ": longer than needed (a refused request takes no tokens, and partial tokens count)"
    return ""


def _waits(outcomes) -> str:
    return ", ".join(f"{'admitted' if ok else f'refused, wait {w:.4g} s'}" for ok, w in outcomes)


async def _in_processes(r: Report, workers: Workers, per_worker: int, *args, **kwargs) -> list:
    for i in range(len(workers.procs)):
        await workers.send(i, per_worker, *args, **kwargs)
    results = []
    for i in range(len(workers.procs)):
        results += await workers.receive(i)
    return results


async def _skewed_turns(workers: Workers, turns: int, *args, **kwargs) -> list:
    """Worker 0 and worker 1 (whose clock is off by ``SKEW``) call in turn, one call each."""
    results = []
    for k in range(turns):
        results += await workers.call(k % 2, 1, *args, **kwargs)
    return results


async def _start_workers(r: Report, name: str, ns) -> Workers | None:
    try:
        return Workers(r, name, ns.redis_url, skews=(0.0, SKEW))
    except LookupError as err:
        r.fail(str(err))
    return None


async def _workers_ready(r: Report, workers: Workers) -> None:
    problem = await workers.ready()
    r.expect(
        problem is None,
        "two worker processes loaded your answer cell",
        f"in a fresh process your answer cell failed: {problem}. Everything the answer uses must be defined or "
        "imported in its own cell (or a setup cell above it)",
    )


# ----------------------------------------------------------------------------- token_bucket


@task("token_bucket", points=6, title="a token bucket in Redis, shared by every process", timeout=90, seed=808)
async def check_token_bucket(r: Report, token_bucket) -> None:
    async with lab.scratch("ch08") as ns:
        redis = ns.redis()
        await _check_token_bucket(r, token_bucket, redis, ns)


async def _check_token_bucket(r: Report, token_bucket, redis, ns) -> None:
    # --- public: a bucket of 3 at 1 token per second --------------------------------------------
    got = await _calls(token_bucket, 4, redis, "tb:pub", 3, 1.0, cost=1, now=T0)
    want = [True, True, True, False]
    r.expect(
        [ok for ok, _ in got] == want,
        "capacity 3, rate 1/s, 4 requests at one instant: 3 admitted, the 4th refused",
        f"capacity 3, rate 1/s, 4 requests at one instant: {_waits(got)}; expected 3 admitted, then refused",
    )
    r.expect(
        _close(got[3][1], 1.0),
        "the refused one was told to wait 1 s (one token at 1 token/s)",
        f"the refused request was told to wait {got[3][1]!r} s; expected 1.0 (one token at 1 token/s), in "
        f"seconds{_wait_hint(got[3][1], 1.0)}",
    )
    ok, _ = _shape(await token_bucket(redis, "tb:pub", 3, 1.0, cost=1, now=T0 + 1.0))
    r.expect(
        ok,
        "1 s later (injected now): admitted",
        "1 s later (injected now) it was refused; expected a refill from the injected now (and a refused request "
        "takes no tokens)",
    )
    if r.public:
        return

    workers: list[Workers] = []  # started before the last in-process step, so they boot while it runs
    try:
        await _token_bucket_hidden(r, token_bucket, redis, ns, workers)
    finally:
        for w in workers:
            await w.close()


async def _token_bucket_hidden(r: Report, token_bucket, redis, ns, started: list) -> None:
    # --- refill on injected time --------------------------------------------------------------
    r.note("capacity 4, rate 2 tokens/s; time is injected with now=")
    key = "tb:refill"
    steps = [
        (T0, 5, [True] * 4 + [False], [0.5]),
        (T0 + 0.25, 1, [False], [0.25]),
        (T0 + 0.5, 2, [True, False], [0.5]),
        (T0 + 10.0, 5, [True] * 4 + [False], [0.5]),
    ]
    for now, n, want, waits in steps:
        got = await _calls(token_bucket, n, redis, key, 4, 2.0, cost=1, now=now)
        t = f"t={now - T0:g} s"
        r.expect(
            [ok for ok, _ in got] == want,
            f"{t}: {n} request(s): {_waits(got)}",
            f"{t}: {n} request(s): {_waits(got)}; expected "
            f"{sum(want)} admitted then refused"
            + (
                ". Refill from the injected now: tokens = min(capacity, tokens + (now - last) * rate)"
                if now > T0
                else ""
            ),
        )
        wait = got[-1][1]
        exact = waits[0]
        if not _close(wait, exact):
            r.fail(
                f"{t}: the refused request was told to wait {wait!r} s; expected {exact} s "
                f"((cost - tokens) / rate, exactly or rounded up to the millisecond){_wait_hint(wait, exact)}"
            )
        r.ok(f"{t}: the refused request was told to wait {wait:.4g} s, exactly what the bucket needs")

    # --- cost ---------------------------------------------------------------------------------
    key = "tb:cost"
    got = await _calls(token_bucket, 3, redis, key, 10, 1.0, cost=4, now=T0)
    later = _shape(await token_bucket(redis, key, 10, 1.0, cost=4, now=T0 + 1.0))
    last = _shape(await token_bucket(redis, key, 10, 1.0, cost=4, now=T0 + 2.0))
    seen = [*got, later, last]
    want = [(True, 0.0), (True, 0.0), (False, 2.0), (False, 1.0), (True, 0.0)]
    good = [a == b[0] for (a, _), b in zip(seen, want, strict=True)] == [True] * 5 and all(
        _close(w, b[1]) for (_, w), b in zip(seen, want, strict=True) if not b[0]
    )
    r.expect(
        good,
        "capacity 10, cost 4: admitted, admitted, refused (wait 2 s), 1 s later refused (wait 1 s), 2 s later admitted",
        f"capacity 10, rate 1/s, cost=4 at t=0, 0, 0, 1, 2 s: {_waits(seen)}; expected admitted, admitted, "
        "refused with wait 2 s ((4 - 2) / 1), refused with wait 1 s, admitted (a refused request takes no tokens)",
    )

    # --- expiry -------------------------------------------------------------------------------
    key = "tb:ttl"
    await _calls(token_bucket, 10, redis, key, 10, 2.0, cost=1, now=T0)
    ttls = await _ttls(redis, key)
    r.expect(
        bool(ttls),
        f"the bucket's state is in Redis: {sorted(ttls)}",
        f"no Redis key containing {key!r} exists: keep the bucket in Redis under that key; state in one process "
        "is not shared by the replicas",
    )
    r.expect(
        all(v > 0 for v in ttls.values()),
        "every key of the bucket has an expiry",
        f"keys without an expiry (PTTL -1): {[k for k, v in ttls.items() if v < 0]}. One key per client, forever: "
        "a million clients seen once are a million keys; expire the bucket once it would be full again",
    )
    low, high = 5.0 - 0.25, 2 * 5.0 + 1
    r.expect(
        all(low * 1000 <= v <= high * 1000 for v in ttls.values()),
        f"an empty bucket of 10 at 2/s expires in {fmt(sorted(v / 1000 for v in ttls.values()))} s "
        "(the 5 s it takes to refill)",
        f"an empty bucket of 10 at 2/s expires in {fmt(sorted(v / 1000 for v in ttls.values()))} s; expected between "
        f"{5:g} s (the time to refill: sooner, the key vanishes and the bucket is full early) and {high:g} s",
    )
    for name in ttls:
        await redis.pexpire(name, 200)
    ok, _ = _shape(await token_bucket(redis, key, 10, 2.0, cost=1, now=T0 + 1.0))
    ttls = await _ttls(redis, key)
    r.note("the check shortened the keys' TTL to 0.2 s, then 1 s later (injected) one request was admitted")
    r.expect(
        ok and bool(ttls) and all(v >= (4.5 - 0.25) * 1000 for v in ttls.values()),
        f"that write set the expiry again: {fmt(sorted(v / 1000 for v in ttls.values()))} s",
        f"after that request the keys expire in {fmt(sorted(v / 1000 for v in ttls.values()))} s"
        + ("" if ok else " (and it was refused)")
        + ": set the expiry on every write, not only when the key is created; when the key vanishes early, the "
        "bucket reads as full again and a drained client gets a fresh burst",
    )

    # --- twenty concurrent requests, one bucket ---------------------------------------------
    workers = await _start_workers(r, "token_bucket", ns)
    started.append(workers)
    gated = gated_redis(ns.redis_url, 20)
    try:
        results = await gated.gate.run(
            [lambda: token_bucket(gated, "tb:race", 5, 0.001, cost=1, now=T0) for _ in range(20)]
        )
    finally:
        await gated.aclose()
    shaped = [_shape(x) if not isinstance(x, BaseException) else x for x in results]
    admitted = sum(1 for x in shaped if isinstance(x, tuple) and x[0])
    r.note(
        "20 concurrent requests on a bucket of 5, at one instant; the check holds each request's first Redis "
        "command until all 20 have sent one"
        + (" (they never all arrived: the gate opened when nothing could move)" if gated.gate.stalled else "")
    )
    r.expect(
        admitted == 5,
        "exactly 5 of the 20 were admitted",
        f"20 concurrent requests on a bucket of 5: {admitted} admitted ({tally(shaped, top=3)}). "
        + (
            "They all read the bucket before any of them wrote it back (read, then write): make the read and the "
            "write one step, in one Lua script (or WATCH/MULTI with a retry)"
            if admitted > 5
            else "expected 5"
        ),
    )

    # --- two processes, one bucket ---------------------------------------------------------------
    await _workers_ready(r, workers)
    results = await _in_processes(r, workers, 15, "tb:procs", 10, 0.001, cost=1, now=T0)
    errors = _errors(results)
    r.expect(not errors, "both processes ran their requests", f"the worker processes raised: {errors[:2]}")
    admitted = _admitted(results)
    r.expect(
        admitted == 10,
        "2 processes x 15 concurrent requests on one bucket of 10: exactly 10 admitted",
        f"2 processes x 15 concurrent requests on one bucket of 10: {admitted} admitted, expected 10"
        + (
            ". State kept in one process is not shared: every replica had its own bucket; keep it in Redis"
            if admitted >= 20
            else ""
        ),
    )

    # --- the server's clock ---------------------------------------------------------------------
    results = await _skewed_turns(workers, 16, "tb:clock", 5, 0.05, cost=1)
    errors = _errors(results)
    r.expect(not errors, "calls without now= ran in both processes", f"calls without now= raised: {errors[:2]}")
    admitted = _admitted(results)
    r.note(
        f"now=None: two processes take turns, 16 requests on a bucket of 5 at 0.05 token/s; the second "
        f"process's clock is {abs(SKEW):g} s behind"
    )
    r.expect(
        admitted == 5,
        "5 admitted: the bucket read the Redis server's clock, so the skew did not matter",
        f"{admitted} admitted, expected 5: the bucket took its time from the processes' clocks (each turn, the "
        f"{abs(SKEW):g} s between them looked like a refill). Without now=, read the time inside the script with "
        "redis.call('TIME')",
    )
    waits = [x["ok"][1] for x in results if "ok" in x and not x["ok"][0]]
    r.expect(
        all(0 < w <= 20.001 for w in waits),
        f"the refused ones were told to wait {fmt(sorted(set(round(w, 1) for w in waits))[:4])} s (at most 20 s "
        "for one token at 0.05/s)",
        f"the refused ones were told to wait {fmt(waits[:4])} s; expected more than 0 and at most 20 s",
    )


# ----------------------------------------------------------------------------- sliding_window


@task("sliding_window", points=6, title="a sliding window with no boundary burst", timeout=90, seed=809)
async def check_sliding_window(r: Report, sliding_window) -> None:
    async with lab.scratch("ch08") as ns:
        redis = ns.redis()
        await _check_sliding_window(r, sliding_window, redis, ns)


async def _check_sliding_window(r: Report, sliding_window, redis, ns) -> None:
    # --- public: 3 per 10 s --------------------------------------------------------------------
    got = await _calls(sliding_window, 4, redis, "sw:pub", 3, 10.0, now=T0 + 1)
    r.expect(
        [ok for ok, _ in got] == [True, True, True, False] and got[3][1] > 0,
        f"limit 3 per 10 s, 4 requests at one instant: {_waits(got)}",
        f"limit 3 per 10 s, 4 requests at one instant: {_waits(got)}; expected 3 admitted, then refused with a "
        "wait above 0"
        + (
            ". Requests that share a timestamp must each count: make members unique" if all(ok for ok, _ in got) else ""
        ),
    )
    ok, _ = _shape(await sliding_window(redis, "sw:pub", 3, 10.0, now=T0 + 1 + got[3][1] + 0.001))
    r.expect(
        ok,
        f"after the {got[3][1]:.4g} s it said to wait: admitted",
        f"after the {got[3][1]:.4g} s it said to wait, the retry was refused again: a client that honours "
        "Retry-After must get through",
    )
    if r.public:
        return

    workers: list[Workers] = []
    try:
        await _sliding_window_hidden(r, sliding_window, redis, ns, workers)
    finally:
        for w in workers:
            await w.close()


async def _sliding_window_hidden(r: Report, sliding_window, redis, ns, started: list) -> None:
    # --- the boundary burst -------------------------------------------------------------------
    limit, window = 100, 60.0
    extra = math.ceil(limit * 2 / window)
    r.note(
        f"limit {limit} per {window:g} s; 100 requests in the second before a whole minute, 100 in the second after "
        f"(a sliding window counter may let {extra} through by its approximation; a sliding log none)"
    )
    before = [
        _shape(await sliding_window(redis, "sw:edge", limit, window, now=T0 + 59 + i * 0.0099)) for i in range(100)
    ]
    after = [
        _shape(await sliding_window(redis, "sw:edge", limit, window, now=T0 + 60 + i * 0.0099)) for i in range(100)
    ]
    a, b = sum(ok for ok, _ in before), sum(ok for ok, _ in after)
    r.expect(a == 100, "the first 100 were admitted", f"of the first 100 requests {a} were admitted, expected 100")
    r.expect(
        b <= extra,
        f"of the 100 after the minute turned, {b} admitted: no double burst",
        f"of the 100 requests after the minute turned, {b} were admitted: {a + b} within 2 s through a limit of "
        f"{limit} per minute. That is a fixed window's double burst at the boundary; count the requests of the last "
        f"{window:g} s, wherever the clock's minute starts (a sliding log, or a weighted sliding counter)",
    )

    # --- same instant, one after another ---------------------------------------------------------
    got = await _calls(sliding_window, 8, redis, "sw:same", 5, window, now=T0 + 5)
    n = sum(ok for ok, _ in got)
    r.expect(
        n == 5,
        "8 requests at one instant, one after another, limit 5: 5 admitted",
        f"8 requests at one instant, one after another, limit 5: {n} admitted. Requests that share a timestamp must "
        "each count: in a sorted set, a member equal to the timestamp overwrites the previous entry; make members "
        "unique (the time plus a random or counter suffix)",
    )

    # --- a window that starts with the first request -------------------------------------------
    start = T0 + 30
    first = _shape(await sliding_window(redis, "sw:first", 10, window, now=start))
    mid = [_shape(await sliding_window(redis, "sw:first", 10, window, now=start + 59)) for _ in range(9)]
    late = [_shape(await sliding_window(redis, "sw:first", 10, window, now=start + 61)) for _ in range(10)]
    inside = sum(ok for ok, _ in mid) + sum(ok for ok, _ in late)
    r.expect(
        first[0] and all(ok for ok, _ in mid) and inside <= 10 + math.ceil(10 * 2 / window),
        f"limit 10 per 60 s: 1 request at t=30 s, 9 at 89 s, 10 at 91 s: {sum(ok for ok, _ in late)} of the last 10 "
        f"admitted ({inside} in the 60 s from 31 s to 91 s)",
        f"limit 10 per 60 s: 1 request at t=30 s, 9 at 89 s, then 10 at 91 s: "
        f"{first[0] + sum(ok for ok, _ in mid)} of the first 10 and {sum(ok for ok, _ in late)} of the last 10 "
        f"admitted ({inside} in the 60 s from 31 s to 91 s); expected all of the first 10 and at most 1 more. "
        "A window that starts with a client's first request is still a fixed window: it resets all at once",
    )

    # --- Retry-After ---------------------------------------------------------------------------------
    key = "sw:retry"
    for k in range(1, 5):
        await sliding_window(redis, key, 4, 10.0, now=T0 + k)
    refused, wait = _shape(await sliding_window(redis, key, 4, 10.0, now=T0 + 5))
    r.expect(
        not refused and wait > 0,
        f"limit 4 per 10 s, requests at t=1, 2, 3, 4 s; the one at 5 s was refused, told to wait {wait:.4g} s",
        f"limit 4 per 10 s, requests at t=1, 2, 3, 4 s; the one at 5 s returned {(refused, wait)}; expected refused "
        "with a wait above 0",
    )
    slack = max(0.5, 0.1 * wait)
    early, _ = _shape(await sliding_window(redis, key, 4, 10.0, now=T0 + 5 + wait - slack))
    r.expect(
        not early,
        f"a retry {slack:.2g} s before that was still refused (the wait is not longer than it must be)",
        f"a retry {wait - slack:.4g} s later was already admitted, {slack:.2g} s before the {wait:.4g} s it said: "
        "Retry-After is longer than it must be"
        + (" (milliseconds? return seconds)" if wait >= 1000 else "")
        + ". For a sliding log: the oldest entry in the window + window - now",
    )
    ontime, _ = _shape(await sliding_window(redis, key, 4, 10.0, now=T0 + 5 + wait + 0.001))
    r.expect(
        ontime,
        "a retry after the wait it said was admitted",
        f"a retry after the {wait:.4g} s it said was refused: a client that honours Retry-After is refused again. "
        "(Do refused requests count? They must not: only admitted ones take a place in the window.)",
    )

    # --- expiry --------------------------------------------------------------------------------------
    ttls = {}
    for name in ("sw:edge", "sw:retry", "sw:same"):
        ttls.update(await _ttls(redis, name))
    r.expect(
        bool(ttls) and all(v > 0 for v in ttls.values()),
        f"every key the limiter wrote ({len(ttls)}) has an expiry",
        f"keys without an expiry (PTTL -1): {[k for k, v in ttls.items() if v < 0] or 'no keys found'}. A key per "
        "client that never expires is a memory leak; expire it once its entries have left the window",
    )
    high = 2 * 60.0 + 1
    r.expect(
        all(v <= high * 1000 for k, v in ttls.items() if "sw:edge" in k),
        f"and none lives longer than {high:g} s for a 60 s window",
        f"keys of a 60 s window expire in {fmt(sorted(v / 1000 for k, v in ttls.items() if 'sw:edge' in k))} s; "
        f"expected at most {high:g} s (twice the window, plus a second)",
    )

    # --- twenty concurrent requests ---------------------------------------------------------------------
    workers = await _start_workers(r, "sliding_window", ns)
    started.append(workers)
    gated = gated_redis(ns.redis_url, 20)
    try:
        results = await gated.gate.run(
            [lambda: sliding_window(gated, "sw:race", 5, 60.0, now=T0 + 7) for _ in range(20)]
        )
    finally:
        await gated.aclose()
    shaped = [_shape(x) if not isinstance(x, BaseException) else x for x in results]
    admitted = sum(1 for x in shaped if isinstance(x, tuple) and x[0])
    r.note("20 concurrent requests, limit 5; the check holds each request's first Redis command until all 20 sent one")
    r.expect(
        admitted == 5,
        "exactly 5 of the 20 were admitted",
        f"20 concurrent requests, limit 5: {admitted} admitted ({tally(shaped, top=3)}). "
        + (
            "They all counted the window before any of them added to it (count, then add): do both in one Lua "
            "script (or WATCH/MULTI with a retry)"
            if admitted > 5
            else "expected 5"
        ),
    )

    # --- two processes ------------------------------------------------------------------------------------
    await _workers_ready(r, workers)
    results = await _in_processes(r, workers, 12, "sw:procs", 10, 60.0, now=T0 + 8)
    errors = _errors(results)
    r.expect(not errors, "both processes ran their requests", f"the worker processes raised: {errors[:2]}")
    admitted = _admitted(results)
    r.expect(
        admitted == 10,
        "2 processes x 12 concurrent requests, limit 10: exactly 10 admitted",
        f"2 processes x 12 concurrent requests, limit 10: {admitted} admitted, expected 10"
        + (
            ". State kept in one process is not shared: each replica counted alone; keep the window in Redis"
            if admitted >= 20
            else ""
        ),
    )

    # --- the server's clock -------------------------------------------------------------------------------
    results = await _skewed_turns(workers, 12, "sw:clock", 5, 60.0)
    errors = _errors(results)
    r.expect(not errors, "calls without now= ran in both processes", f"calls without now= raised: {errors[:2]}")
    admitted = _admitted(results)
    r.note(f"now=None: two processes take turns, 12 requests, limit 5 per 60 s; one clock is {abs(SKEW):g} s behind")
    r.expect(
        admitted == 5,
        "5 admitted: the window followed the Redis server's clock",
        f"{admitted} admitted, expected 5: the window took its time from the processes' clocks, and the "
        f"{abs(SKEW):g} s between them moved entries out of the window. Without now=, read the time inside the "
        "script with redis.call('TIME')",
    )
