"""Hidden checks of ``token_bucket``."""

from __future__ import annotations

import asyncio

from autograder.checks.ch08.common import (
    LOCKSTEP,
    SKEW,
    T0,
    _admitted,
    _calls,
    _close,
    _errors,
    _in_processes,
    _judge_stale_read,
    _many,
    _outcome,
    _secs,
    _shape,
    _shown,
    _skewed_turns,
    _stalls,
    _start_workers,
    _take_inside_a_read,
    _ttls,
    _wait_hint,
    _waits,
    _workers_ready,
)
from autograder.harness import Report, task
from autograder.probes import Workers, gated_redis
from course.kit import lab

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
    # the refill on injected time is judged before the wait: an answer that reads the real clock returns a
    # wait a few microseconds short of 1 s, rounded to the millisecond either way depending on how fast the
    # machine was, while its refusal 1 s later (injected) is certain
    ok, _ = _shape(await token_bucket(redis, "tb:pub", 3, 1.0, cost=1, now=T0 + 1.0))
    r.expect(
        ok,
        "1 s later (injected now): admitted",
        "1 s later (injected now) it was refused; expected a refill from the injected now (and a refused request "
        "takes no tokens)",
    )
    r.expect(
        _close(got[3][1], 1.0),
        "the refused one was told to wait 1 s (one token at 1 token/s)",
        f"the refused request was told to wait {_shown(got[3][1], 1.0)} s; expected 1.0 (one token at 1 token/s), in "
        f"seconds{_wait_hint(got[3][1], 1.0)}",
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

    # --- a wait that is not a whole number of milliseconds: exact, or rounded up ------------------
    key = "tb:third"
    got = await _calls(token_bucket, 3, redis, key, 2, 3.0, cost=1, now=T0)
    wait, exact = got[-1][1], 1 / 3
    r.expect(
        [ok for ok, _ in got] == [True, True, False] and _close(wait, exact),
        "capacity 2, rate 3/s: the refused request was told to wait 1/3 s (exactly, or rounded up to the ms)",
        f"capacity 2, rate 3/s, 3 requests at one instant: {_waits(got)}; expected admitted, admitted, then "
        f"refused with a wait of 1/3 s ({exact:.6f}), exactly or rounded up to the millisecond (0.334)"
        + _wait_hint(wait, exact),
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
        # no measured value on an [ok] line: what PTTL reads depends on the real time since the write
        f"an empty bucket of 10 at 2/s expires once it would be full again (5 s to refill), within {high:g} s",
        f"an empty bucket of 10 at 2/s expires in {_secs(ttls.values())} s; expected between "
        f"{5:g} s (the time to refill: sooner, the key vanishes and the bucket is full early) and {high:g} s",
    )
    for name in ttls:
        await redis.pexpire(name, 2000)  # 2 s, below the 3.5 s a write must set, and too long to vanish first
    ok, _ = _shape(await token_bucket(redis, key, 10, 2.0, cost=1, now=T0 + 1.0))
    ttls = await _ttls(redis, key)
    r.note("the check shortened the keys' TTL to 2 s, then 1 s later (injected) one request was admitted")
    r.expect(
        ok and bool(ttls) and all(v >= (4.5 - 1.0) * 1000 for v in ttls.values()),
        "that write set the expiry again (to at least the 4.5 s the bucket needs to refill)",
        f"after that request the keys expire in {_secs(ttls.values())} s"
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
    r.note(f"20 concurrent requests on a bucket of 5, at one instant, {LOCKSTEP}" + _stalls(gated.gate))
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

    # --- a take that lands between another request's read and its WATCH ------------------------------
    stale = await _take_inside_a_read(ns, lambda client: token_bucket(client, "tb:stale", 1, 0.001, cost=1, now=T0))
    _judge_stale_read(r, stale, "a bucket of 1 token", "took the token")

    # --- two processes, one bucket ---------------------------------------------------------------
    await _workers_ready(r, workers)
    await _in_processes(r, workers, 15, 10, "on one bucket of 10", gated.gate, "tb:procs", 10, 0.001, cost=1, now=T0)

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
    # no numbers: real time passes between the turns, so the waits differ from run to run
    short, long = sum(1 for w in waits if w <= 0), sum(1 for w in waits if w > 20.001)
    r.expect(
        not short and not long,
        "the refused ones were told to wait more than 0 and at most 20 s (one token at 0.05/s)",
        f"of the {len(waits)} refused, {short} were told to wait 0 s or less and {long} more than 20 s; expected "
        "more than 0 and at most 20 s (one token at 0.05/s)",
    )

    # --- fractions of a second on the server's clock ---------------------------------------------------
    await _subsecond_refill(r, token_bucket, redis)


async def _server_now(redis) -> float:
    sec, usec = await redis.time()
    return sec + usec / 1e6


async def _subsecond_refill(r: Report, token_bucket, redis) -> None:
    """now=None, capacity 2 at 10 tokens/s: empty the bucket, then ask again 120 ms later. At least 1.2 tokens
    are back however long the machine took, so a refusal is a certain failure; a script that reads only the
    seconds of TIME is refused when both requests fall in one second of the server's clock. A try that left its
    second, or took over 180 ms (the key may have expired), and was admitted proves nothing: it is made again on
    a fresh key. The lines printed are the same whichever try decided."""
    passed = "now=None: 120 ms after emptying a bucket of 2 at 10/s, a request is admitted (1.2 tokens back)"
    for attempt in range(4):
        key = f"tb:subsecond:{attempt}"
        start = await _server_now(redis)
        if start % 1 > 0.4:  # start 50 ms past a whole second of the server's clock
            await asyncio.sleep(1.05 - start % 1)
            start = await _server_now(redis)
        got = await _calls(token_bucket, 2, redis, key, 2, 10.0, cost=1)
        await asyncio.sleep(0.12)
        again = _shape(await token_bucket(redis, key, 2, 10.0, cost=1))
        end = await _server_now(redis)
        if [ok for ok, _ in got] != [True, True]:
            r.fail("now=None, a fresh bucket of 2 at 10 tokens/s: two requests at once were not both admitted")
        if not again[0]:
            r.fail(
                "now=None, capacity 2 at 10 tokens/s: two requests, then one 120 ms later (by the server's clock) "
                "was refused; expected admitted (at least 1.2 tokens are back). Likely cause: only the seconds of "
                "redis.call('TIME') are used; add the microseconds: t[1] + t[2] / 1000000"
            )
        if int(end) == int(start) and end - start < 0.18:
            break
    r.ok(passed)
