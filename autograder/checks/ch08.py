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

import math

import redis.asyncio as aioredis

from autograder.harness import Report, task
from autograder.probes import Workers, fmt, gated_redis, tally
from autograder.rules import Rule
from course.kit import lab

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


async def _ttls(redis, key: str) -> dict[str, int]:
    """PTTL (ms) of every key whose name contains ``key``."""
    names = [k async for k in redis.scan_iter(match=f"*{key}*")]
    return {k: await redis.pttl(k) for k in names}


def _close(wait: float, exact: float) -> bool:
    """``wait`` is ``exact`` seconds, or that rounded up to the millisecond."""
    return exact - 1e-6 <= wait <= exact + 0.0011


def _many(admitted: int, shaped) -> str:
    """How many of a gated crowd were admitted; above the limit only "more than", because how many more
    depends on how the requests interleaved after the gate opened (the verdict does not)."""
    if admitted > 5:
        return "more than 5 admitted (how many more depends on the interleaving)"
    return f"{admitted} admitted ({tally(shaped, top=3)})"


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
        f"the refused request was told to wait {_shown(got[3][1], 1.0)} s; expected 1.0 (one token at 1 token/s), in "
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
                f"{t}: the refused request was told to wait {_shown(wait, exact)} s; expected {exact} s "
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
    low, high = 5.0 - 1.0, 2 * 5.0 + 1  # a second of slack for a loaded machine between the write and PTTL
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
        ok and bool(ttls) and all(v >= (4.5 - 1.0) * 1000 for v in ttls.values()),
        f"that write set the expiry again: {fmt(sorted(v / 1000 for v in ttls.values()))} s",
        f"after that request the keys expire in {fmt(sorted(round(v / 1000, 1) for v in ttls.values()))} s"
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
        f"20 concurrent requests on a bucket of 5: {_many(admitted, shaped)}. "
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
    waits = [x[1] for x in map(_outcome, results) if isinstance(x, tuple) and not x[0]]
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
        f"20 concurrent requests, limit 5: {_many(admitted, shaped)}. "
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
    # The server's real clock: a sliding window counter rightly admits one more across a whole minute, so a
    # run that straddled one (by TIME) runs again on a fresh key; the verdict never depends on when it ran.
    for key in ("sw:clock", "sw:clock:again"):
        minute = await _server_minute(ns)
        results = await _skewed_turns(workers, 12, key, 5, 60.0)
        if await _server_minute(ns) == minute:
            break
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


# ============================================================================= rule tables (issue 28)

RULES: dict[str, list[Rule]] = {
    "token_bucket": [
        Rule(
            "Keep all the bucket's state in Redis under keys whose names contain",
            "_in_processes: the answer cell in two separate processes, 15 concurrent requests each, on one bucket "
            "of 10: exactly 10 admitted",
            "dict-in-one-process",
        ),
        Rule(
            "refills `rate` tokens per second",
            "_check_token_bucket: refill on injected time (now=), fractions included",
            "ignores-injected-now",
        ),
        Rule(
            "Never the caller's clock",
            "_skewed_turns: two processes take turns with now=None while the second one's clock is two minutes behind",
            "client-clock",
        ),
        Rule(
            "Otherwise it takes **none**",
            "_token_bucket_hidden: a request of cost above the tokens left is refused, then a cheaper one admitted",
            "refused-takes-tokens",
        ),
        Rule(
            "`(cost - tokens) / rate`, exactly or rounded up to the millisecond",
            "_check_token_bucket: the wait returned is compared with (cost - tokens) / rate",
            "wait-one-token",
        ),
        Rule(
            "`now` (seconds, a float) when it is given",
            "_check_token_bucket: every request of the visible part passes now=; the clock must be that one",
            "ignores-injected-now",
        ),
        Rule(
            "the **Redis server's clock**",
            "_skewed_turns: two processes take turns with now=None while the second one's clock is two minutes behind",
            "client-clock",
        ),
        Rule(
            "read, decide and write in **one Lua script**",
            "_token_bucket_hidden: 20 concurrent requests on a bucket of 5, each request's first Redis command "
            "held until all 20 have sent one (gated): exactly 5 admitted",
            "get-then-set",
        ),
        Rule(
            "return milliseconds, or a string",
            "_check_token_bucket: a wait of a fraction of a second must come back as that fraction, not 0",
            "lua-float-truncated",
        ),
        Rule(
            "Expiry on **every write**",
            "_token_bucket_hidden: the check shortens the keys' TTLs, makes a request, and reads them again",
            "expire-only-on-create",
        ),
        Rule(
            "the key must expire no sooner than the bucket would be full again",
            "_token_bucket_hidden: an empty bucket's keys must have a TTL between capacity / rate - 1 and "
            "2 x capacity / rate + 1 seconds",
            "no-expiry",
        ),
        Rule(
            "returns a tuple `(admitted, retry_after)`",
            "_check_token_bucket: every answer is read as (admitted, retry_after) in seconds",
            "wait-in-milliseconds",
        ),
    ],
    "sliding_window": [
        Rule(
            "at most `limit` requests admitted in any `window` seconds",
            "_sliding_window_hidden: 100 requests in the second before a whole minute and 100 in the second after, "
            "limit 100 per 60 s",
            "fixed-window",
        ),
        Rule(
            "a limiter with **no boundary burst**",
            "_sliding_window_hidden: a window that would start at a client's first request",
            "fixed-window-from-first-request",
        ),
        Rule(
            "only admitted requests count",
            "_sliding_window_hidden: refused requests are retried; they must not push the window out",
            "refused-requests-count",
        ),
        Rule(
            "requests with the same timestamp each count",
            "_sliding_window_hidden: eight requests at one instant",
            "member-is-the-timestamp",
        ),
        Rule(
            "A retry after that long must be admitted",
            "_sliding_window_hidden: the promised wait is probed at that time",
            "counter-waits-for-next-window",
        ),
        Rule(
            "one at `max(0.5, 10%)` of it earlier must still be refused",
            "_sliding_window_hidden: the promised wait is probed before it ends",
            "wait-always-window",
        ),
        Rule(
            "one Lua script (or `WATCH`/`MULTI`)",
            "_sliding_window_hidden: 20 concurrent requests held at a gate until all have sent their first command",
            "count-then-add",
        ),
        Rule(
            "each with an expiry of at most `2 x window + 1` seconds",
            "_sliding_window_hidden: the keys' TTLs are read",
            "no-expiry",
        ),
        Rule(
            "`now` when given, else `redis.call('TIME')`",
            "_skewed_turns: two processes taking turns with now=None, one clock two minutes behind",
            "client-clock",
        ),
        Rule(
            "keys whose names contain `key`",
            "_in_processes: two processes with 12 concurrent requests each",
            "deque-in-one-process",
        ),
        Rule(
            "A sliding log (a sorted set of admitted requests' times, at `key`) does this exactly",
            "_sliding_window_hidden: 100 requests either side of a whole minute, limit 100 per 60 s: at most 100 "
            "admitted (plus the counter's allowance)",
            "fixed-window",
        ),
        Rule(
            "is accepted too: the checks allow it",
            "_sliding_window_hidden: the boundary probe allows ceil(limit x 2 / window) extra requests, not the "
            "limit extra a fixed window lets through",
            "fixed-window",
        ),
        Rule(
            "100 requests in the second before a whole minute and 100 in the second after",
            "_sliding_window_hidden: runs the scenarios this sentence lists, each against its kept wrong answer",
            "fixed-window",
        ),
    ],
}

#: The course's own answers: a learner who only calls one of these earns nothing for the task.
REFERENCES: dict[str, list[str]] = {
    "token_bucket": ["course.ratelimit:token_bucket"],
    "sliding_window": ["course.ratelimit:sliding_window"],
}
