"""What both of chapter 08's checks use: shapes of answers, TTLs, worker processes, the lockstep."""

from __future__ import annotations

import math

import redis.asyncio as aioredis

from autograder.harness import Report
from autograder.probes import Workers, fmt, tally

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
    """PTTLs (ms) shown in seconds, rounded to a tenth: the milliseconds that passed between the
    write and the PTTL vary from run to run, and the feedback must not."""
    return fmt(sorted(round(v / 100) / 10 if v > 0 else v for v in pttls))


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
    """A note's tail when some rounds went without every request (one queued on something in-process)."""
    if not gate.stalled:
        return ""
    return f" ({gate.stalled} of {gate.rounds} rounds went without every request: the others could not move)"


def _shown(wait, exact: float) -> str:
    """A wait as printed: one a few milliseconds short of ``exact`` (real time passed) without its digits."""
    if isinstance(wait, (int, float)) and exact * 0.9 < wait < exact:
        return f"a little less than {exact:g}"
    return repr(wait)


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
    r.note(f"{crowd}, in lockstep across the processes ({went['rounds']} rounds)")
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
