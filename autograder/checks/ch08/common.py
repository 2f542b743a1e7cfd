"""What both of chapter 08's checks use: shapes of answers, TTLs, worker processes, the lockstep."""

from __future__ import annotations

import asyncio
import contextvars
import math

import redis.asyncio as aioredis

from autograder.harness import Report
from autograder.probes import Workers, fmt, hooked_redis, tally

T0 = 1_000_020.0  # injected time: a multiple of 60, so window boundaries fall on whole minutes
SKEW = -120.0  # seconds the second worker's clock is set back


def _outcome(x: dict):
    """A worker's ``{"ok": [admitted, wait]}`` as ``(admitted, wait)``; an error line otherwise."""
    if "error" in x:
        return x["error"]
    try:
        return _shape(x["ok"])
    except TypeError as err:
        return str(err)


def _admitted(results: list) -> int:
    return sum(1 for x in map(_outcome, results) if isinstance(x, tuple) and x[0])


def _errors(results: list) -> list[str]:
    return [x for x in map(_outcome, results) if isinstance(x, str)]


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


def _secs(pttls) -> str:
    """PTTLs (ms) shown in whole seconds, to the nearest: the milliseconds that pass between the write and
    the PTTL vary from run to run (more when the answer runs in a process of its own, behind the grading
    gateway), and the feedback must not. Rounding up was not enough: a PEXPIRE of 5001 ms read 1 ms later
    showed 6 on one run and 5 on the next; to the nearest, anything read within half a second is stable."""
    return fmt(sorted(math.floor(v / 1000 + 0.5) if v > 0 else v for v in pttls))


async def _ttls(redis, key: str) -> dict[str, int]:
    """PTTL (ms) of every key whose name contains ``key``."""
    names = [k async for k in redis.scan_iter(match=f"*{key}*")]
    return {k: await redis.pttl(k) for k in names}


def _close(wait: float, exact: float) -> bool:
    """``wait`` is ``exact`` seconds, or that rounded up to the millisecond."""
    return exact - 1e-6 <= wait <= exact + 0.0011


def _many(admitted: int, shaped) -> str:
    """How many of a gated crowd were admitted, and what the others returned (lockstep makes it the same
    number on every run)."""
    return f"{admitted} admitted ({tally(shaped, top=3)})"


LOCKSTEP = "in lockstep: the check holds each Redis command until every request still running has sent its own"


def _stalls(gate) -> str:
    """A note's tail about rounds that went without every request: nothing. How many there were depends on
    timing (a caller that polls a lock with a sleep stalls a different number of rounds on each run), and a
    note must read the same on every run; failures explain stalls in words (see :func:`_in_processes`)."""
    return ""


def _rounded_down(wait: float, exact: float) -> bool:
    """``wait`` is ``exact`` (not a whole number of milliseconds) rounded down to the millisecond; a wait a
    little short because real time passed is not a whole number of milliseconds, so it never counts here."""
    whole = abs(wait * 1000 - round(wait * 1000)) < 1e-6
    return whole and abs(exact * 1000 - round(exact * 1000)) > 1e-6 and exact - 0.001 <= wait < exact


def _shown(wait, exact: float) -> str:
    """A wait as printed: one a few milliseconds short of ``exact`` (real time passed) without its digits."""
    if isinstance(wait, (int, float)) and _rounded_down(wait, exact):
        return repr(wait)  # rounded down to the millisecond: the digits say so
    if isinstance(wait, (int, float)) and exact * 0.9 < wait < exact:
        return f"a little less than {exact:g}"
    return repr(wait)


def _wait_hint(wait: float, exact: float) -> str:
    """Why a token bucket's wait may be off, when the number itself says so."""
    if math.isclose(wait, exact * 1000, rel_tol=0.01):
        return ": that is milliseconds; return seconds"
    if wait == 0 or (wait == int(wait) and exact != int(exact) and wait == int(exact)):
        return ": Redis turns a Lua number into an integer (0.25 -> 0); return milliseconds or a string"
    if _rounded_down(wait, exact):
        return ": rounded down, so a retry after that long is still refused; round up (math.ceil) to the millisecond"
    if exact * 0.9 < wait < exact:
        return ": a little less, as if time had passed; use the injected now"
    if exact != 0.5 and math.isclose(wait, 0.5):
        return ": that is one token's time (1 / rate), but half a token is already there"
    if wait > exact:
        return ": longer than needed (a refused request takes no tokens, and partial tokens count)"
    return ""


def _waits(outcomes) -> str:
    return ", ".join(f"{'admitted' if ok else f'refused, wait {w:.4g} s'}" for ok, w in outcomes)


async def _in_processes(
    r: Report, workers: Workers, per_worker: int, limit: int, what: str, alone, *args, **kwargs
) -> None:
    """The answer in two processes, ``per_worker`` concurrent requests each, all in one lockstep:
    exactly ``limit`` admitted. ``alone`` is the gate of the in-process crowd, whose stalls show
    requests queued on something in-process (a lock)."""
    crowd = f"2 processes x {per_worker} concurrent requests, {what}"
    try:
        results, went = await workers.call_in_lockstep(per_worker, *args, **kwargs)
    except (RuntimeError, TimeoutError) as err:
        r.fail(f"{crowd}: {err}")
    errors = _errors(results)
    r.expect(not errors, "both processes ran their requests", f"the worker processes raised: {errors[:2]}")
    admitted = _admitted(results)
    r.note(f"{crowd}, in lockstep across the processes")  # no round count: it depends on timing
    if alone.stalled and went["commands"]:
        why = (
            ". In one process your requests queued on something in-process (a lock?), so each replica let one "
            "through at a time, and the two replicas' requests read the same state in the same round: a lock in "
            "one process does not reach another. Make the read and the write one step in Redis, in one Lua "
            "script (or WATCH/MULTI with a retry)"
        )
    elif admitted == 2 * limit or not went["commands"]:
        why = ". State kept in one process is not shared: each replica counted alone; keep the state in Redis"
    else:
        why = (
            ". Requests of the two processes read the same state before either wrote: make the read and the "
            "write one step in Redis, in one Lua script (or WATCH/MULTI with a retry)"
        )
    r.expect(
        admitted == limit,
        f"{crowd}: exactly {limit} admitted",
        f"{crowd}: {admitted} admitted, expected {limit}" + (why if admitted > limit else ""),
    )


async def _skewed_turns(workers: Workers, turns: int, *args, **kwargs) -> list:
    """Worker 0 and worker 1 (whose clock is off by ``SKEW``) call in turn, one call each."""
    results = []
    for k in range(turns):
        results += await workers.call(k % 2, 1, *args, **kwargs)
    return results


async def _server_minute(ns) -> int:
    """Which whole minute the Redis server's clock (``TIME``) is in."""
    async with aioredis.Redis.from_url(ns.redis_url) as client:
        return int((await client.time())[0]) // 60


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


async def _take_inside_a_read(ns, call) -> list:
    """Two requests, ``call(client)`` each, on one fresh limit that admits one. The second one's round trips
    go until it sends WATCH; it is held there while the first one runs start to end, then it goes on. WATCH
    first, read, MULTI/EXEC (retry on WatchError) sees the first one's write: its EXEC fails and the retry
    reads the new state. A read made before WATCH is stale, and the transaction that follows does not notice:
    both are admitted. A Lua script or one atomic command sends no WATCH and is never held. The lockstep crowd
    cannot show this: there every request sends its WATCH before any sends EXEC. If the first one cannot
    finish while the second is held (it waits on a lock the second took), the second goes once nothing else
    can move. Returns the two outcomes (``(admitted, wait)`` or an exception), first one first."""
    who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="")
    first_done, held = asyncio.Event(), asyncio.Event()
    state = {"held": False, "in_flight": 0}

    async def hook(commands, send):
        if who.get() == "second" and not state["held"] and any(str(c[0]).upper() == "WATCH" for c in commands):
            state["held"] = True
            held.set()
            await _until_done_or_stuck(first_done, state)
        state["in_flight"] += 1
        try:
            return await send()
        finally:
            state["in_flight"] -= 1

    async def one(name: str):
        who.set(name)
        try:
            return _shape(await call(client))
        finally:
            if name == "first":
                first_done.set()

    client = hooked_redis(ns.redis_url, hook)
    waiter = asyncio.ensure_future(held.wait())
    try:
        second = asyncio.ensure_future(one("second"))
        await asyncio.wait([second, waiter], return_when=asyncio.FIRST_COMPLETED)
        first = await asyncio.gather(one("first"), return_exceptions=True)
        return [*first, *(await asyncio.gather(second, return_exceptions=True))]
    finally:
        held.set()
        await waiter
        await client.aclose()


async def _until_done_or_stuck(done: asyncio.Event, state: dict, ticks: int = 5) -> None:
    """Wait until ``done`` is set, or until no round trip is in flight and nothing on the loop is ready to
    run for ``ticks`` looks 3 ms apart (the other request waits on something the held one has)."""
    loop = asyncio.get_running_loop()
    calm = 0
    while not done.is_set() and calm < ticks:
        await asyncio.sleep(0.003)
        idle = not getattr(loop, "_ready", None) and state["in_flight"] == 0
        calm = calm + 1 if idle else 0


def _judge_stale_read(r: Report, outcomes: list, what: str, took: str) -> None:
    errors = [x for x in outcomes if isinstance(x, BaseException)]
    if errors:
        r.fail(f"two requests on {what}, one held at its WATCH: your code raised {errors[0]!r:.160}")
    admitted = sum(1 for ok, _ in outcomes if ok)
    r.note(
        f"two requests on {what}: the second one's commands go until its WATCH, where it is held while the first "
        "one runs, start to end"
    )
    r.expect(
        admitted == 1,
        "exactly 1 of the 2 was admitted: the write between the other's read and its EXEC was seen",
        f"{admitted} of the 2 were admitted on {what}. The second request read the state, then (before its WATCH) "
        f"the first {took}; the second's transaction did not see that, because the key was watched only after "
        "the read. WATCH the key first, then read, then MULTI/EXEC, and retry on WatchError (or do it all in one "
        "Lua script)",
    )
