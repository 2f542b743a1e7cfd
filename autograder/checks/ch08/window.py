"""Hidden checks of ``sliding_window``."""

from __future__ import annotations

import math

from autograder.checks.ch08.common import (
    LOCKSTEP,
    SKEW,
    T0,
    _admitted,
    _calls,
    _errors,
    _in_processes,
    _judge_stale_read,
    _many,
    _secs,
    _server_minute,
    _shape,
    _shown,
    _skewed_turns,
    _stalls,
    _start_workers,
    _take_inside_a_read,
    _ttls,
    _waits,
    _workers_ready,
)
from autograder.harness import Report, task
from autograder.probes import Workers, gated_redis
from course.kit import lab

# ----------------------------------------------------------------------------- sliding_window


@task("sliding_window", points=6, title="a sliding window with no boundary burst", timeout=90, seed=809)
async def check_sliding_window(r: Report, sliding_window) -> None:
    async with lab.scratch("ch08") as ns:
        redis = ns.redis()
        await _check_sliding_window(r, sliding_window, redis, ns)


async def _check_sliding_window(r: Report, sliding_window, redis, ns) -> None:
    # --- public: the expiry of a write, on a window of an hour ---------------------------------------
    # First, and with a window long enough that no machine is that slow: a key set to expire in `window`
    # milliseconds instead of seconds lives 3.6 s here, and is read well before it goes. With a 10 s window
    # it would vanish (or not) in the middle of the next steps, depending on the machine's speed.
    await _expiry_after_a_write(r, sliding_window, redis, "sw:hour", 3600.0)

    # --- public: 3 per 10 s --------------------------------------------------------------------
    got = await _calls(sliding_window, 4, redis, "sw:pub", 3, 10.0, now=T0 + 1)
    r.expect(
        [ok for ok, _ in got] == [True, True, True, False] and got[3][1] > 0,
        "limit 3 per 10 s, 4 requests at one instant: 3 admitted, the 4th refused with a wait above 0",
        f"limit 3 per 10 s, 4 requests at one instant: {_waits(got)}; expected 3 admitted, then refused with a "
        "wait above 0"
        + (
            ". Requests that share a timestamp must each count: make members unique" if all(ok for ok, _ in got) else ""
        ),
    )
    # the wait is not printed: an answer that reads the real clock says a few milliseconds less than 10 s,
    # how many depends on the machine
    ok, _ = _shape(await sliding_window(redis, "sw:pub", 3, 10.0, now=T0 + 1 + got[3][1] + 0.001))
    r.expect(
        ok,
        "after the wait it said (plus 1 ms): admitted",
        f"a retry after the wait it said ({_shown(got[3][1], 10.0)} s, plus 1 ms) was refused again: a client "
        "that honours Retry-After must get through"
        + (
            ". The wait is a little less than 10 s, as if time had passed: use the injected now"
            if 9 < got[3][1] < 10
            else ""
        ),
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
    # a quarter of a second past each whole second, so a wait truncated to whole seconds is too short
    key = "sw:retry"
    for k in range(1, 5):
        await sliding_window(redis, key, 4, 10.0, now=T0 + k + 0.25)
    refused, wait = _shape(await sliding_window(redis, key, 4, 10.0, now=T0 + 5))
    r.expect(
        not refused and wait > 0,
        f"limit 4 per 10 s, requests at t=1.25, 2.25, 3.25, 4.25 s; the one at 5 s was refused, told to wait "
        f"{wait:.4g} s",
        f"limit 4 per 10 s, requests at t=1.25, 2.25, 3.25, 4.25 s; the one at 5 s returned {(refused, wait)}; "
        "expected refused with a wait above 0",
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
        "(Do refused requests count? They must not: only admitted ones take a place in the window.)"
        + (
            " The wait is a whole number of seconds: Redis turns a Lua number into an integer in a reply (6.25 "
            "becomes 6); return milliseconds, or a string"
            if wait == int(wait)
            else ""
        ),
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
        # no number: seconds have passed since the last write to these keys, a different number on each run
        f"keys of a 60 s window expire more than {high:g} s after a write; expected at most {high:g} s (twice the "
        "window, plus a second)",
    )

    await _expiry_again(r, sliding_window, redis, "sw:again", 60.0)

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
    r.note(f"20 concurrent requests, limit 5, {LOCKSTEP}" + _stalls(gated.gate))
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

    # --- a write between another request's read and its WATCH --------------------------------------------
    stale = await _take_inside_a_read(ns, lambda client: sliding_window(client, "sw:stale", 1, 60.0, now=T0 + 9))
    _judge_stale_read(r, stale, "a limit of 1", "was admitted and added its entry")

    # --- two processes ------------------------------------------------------------------------------------
    # limit 11, odd: a read-then-write under a per-process lock admits two per round (one per replica)
    await _workers_ready(r, workers)
    await _in_processes(r, workers, 12, 11, "limit 11", gated.gate, "sw:procs", 11, 60.0, now=T0 + 8)

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


async def _expiry_after_a_write(r: Report, sliding_window, redis, key: str, window: float) -> None:
    """One admitted request on a fresh key: some key it wrote must live at least ``window`` (less a second);
    no key (state kept elsewhere) or no expiry is judged by later steps."""
    ok, _ = _shape(await sliding_window(redis, key, 3, window, now=T0 + 1))
    ttls = await _ttls(redis, key)
    r.expect(
        not ttls or any(v == -1 or v >= (window - 1) * 1000 for v in ttls.values()),
        f"limit 3 per {window:g} s: after an admitted request, its key expires no sooner than the window",
        f"limit 3 per {window:g} s, one {'admitted' if ok else 'refused'} request: its keys expire in "
        f"{_secs(ttls.values())} s; expected at least {window:g} s (the entry stays in the window that long) and at "
        f"most {2 * window + 1:g}. PEXPIRE takes milliseconds (window * 1000), EXPIRE seconds",
    )


async def _expiry_again(r: Report, sliding_window, redis, key: str, window: float) -> None:
    """The check shortens the keys' TTLs to half the window, then one admitted request (injected time) must set
    them again: an expiry set only when the key is created drops the window's entries while they still count.
    Half the window, not a fraction of a second: a key that vanished before the request would be made anew and
    hide the mistake on a slow run."""
    await sliding_window(redis, key, 5, window, now=T0 + 11)
    for name in await _ttls(redis, key):
        await redis.pexpire(name, int(window * 500))
    ok, _ = _shape(await sliding_window(redis, key, 5, window, now=T0 + 12))
    ttls = await _ttls(redis, key)
    r.note(
        f"the check shortened the keys' TTLs to {window / 2:g} s, then made one more request (limit 5 per {window:g} s)"
    )
    r.expect(
        ok and any(v == -1 or v >= (window - 1) * 1000 for v in ttls.values()),
        "that write set the expiry again",
        f"after that request the keys expire in {_secs(ttls.values())} s"
        + ("" if ok else " (and it was refused, the 2nd of a limit of 5)")
        + f"; expected at least {window:g} s: set the expiry on every write, not only when the key is created. "
        "When the key vanishes early, the requests still in the window are forgotten and more get through",
    )
