"""Hidden checks of chapter 01 (timeouts, retries, backoff and jitter).

- ``is_retryable``: a table of errors, made by hand and collected live from a flaky HTTP
  service with httpx.
- ``with_retry``: exact delays against a recorded, seeded ``rand``; attempts, the final
  error (the same object, unwrapped), no sleep after the last try, the ``retryable``
  predicate, 50 concurrent callers on a virtual clock, and cancellation.
- ``retry_test``: graded by mutation. The learner's test must pass against correct
  versions of ``with_retry`` and fail against each wrong one in :data:`MUTANTS`; each
  wrong one caught earns its share of the points.

Every ``with_retry`` call runs on injected time; a call that does not come back within
:data:`REAL_LIMIT` seconds of real time has slept for real or hung, and fails the task.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random
from collections.abc import Callable

import httpx

from autograder.checks.ch01.common import REAL_LIMIT, Cut, bounded, cut_message
from autograder.checks.ch01.versions import CORRECT, MUTANTS
from autograder.harness import Report, task
from autograder.probes import fmt, seeded_random, settled
from course.chapters.ch01 import live_errors
from course.kit.faults import DependencyError, FlakyDependency, Schedule, VirtualClock
from course.retry import is_retryable as reference_is_retryable

# ----------------------------------------------------------------------------- recorders


class Draws:
    """An injected ``rand``: seeded uniform numbers, each one remembered."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self.values: list[float] = []

    def __call__(self) -> float:
        value = self._rng.random()
        self.values.append(value)
        return value


class Sleeps:
    """An injected ``sleep`` that records each delay (and passes it to a virtual clock)."""

    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        if self.clock is not None:
            await self.clock.sleep(seconds)
        else:
            await asyncio.sleep(0)


class Raiser:
    """``fn`` for with_retry: raises the listed errors in turn (new objects each time), then
    returns ``value``; or, with ``forever``, raises a new one from that factory on every call."""

    def __init__(self, *errors, value: object = "ok", forever: Callable[[], BaseException] | None = None) -> None:
        self.errors = list(errors)
        self.value = value
        self.forever = forever
        self.raised: list[BaseException] = []
        self.calls = 0

    async def __call__(self):
        self.calls += 1
        if self.errors or self.forever:
            make = self.errors.pop(0) if self.errors else self.forever
            err = make() if callable(make) and not isinstance(make, BaseException) else make
            self.raised.append(err)
            raise err
        return self.value


def always(make: Callable[[], BaseException]) -> Raiser:
    return Raiser(forever=make)


def http_status_error(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "http://127.0.0.1/item")
    response = httpx.Response(status, request=request)
    return httpx.HTTPStatusError(f"{status} from the server", request=request, response=response)


class StatusError(Exception):
    """Any error that carries an HTTP status as an integer ``status`` attribute."""

    def __init__(self, status, message: str = "") -> None:
        super().__init__(message or f"answered {status}")
        self.status = status


def window(k: int, base: float, cap: float) -> float:
    return min(cap, base * 2**k)


def close(a, b) -> bool:
    return len(a) == len(b) and all(
        isinstance(x, (int, float)) and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
        for x, y in zip(a, b, strict=False)
    )


def diagnose_delays(got: list, draws: list[float], base: float, cap: float) -> str:
    """Name the usual mistake behind delays that do not follow rand() * min(cap, base * 2**k)."""
    n = len(got)
    windows = [window(k, base, cap) for k in range(n)]
    if close(got, windows):
        return "no jitter: each delay is the whole window min(max_delay, base_delay * 2**k); multiply it by rand()"
    u = draws[:n]
    if len(u) < n:
        return (
            f"it slept {n} times but drew rand() only {len(draws)} times: the delays must be "
            f"rand() * {fmt(windows)}, with the injected rand()"
        )
    guesses = {
        "constant delay: rand() * base_delay every time; the window must double after each failure": [
            u[k] * base for k in range(n)
        ],
        "no cap: rand() * base_delay * 2**k grows past max_delay; cap the window with min(max_delay, ...)": [
            u[k] * base * 2**k for k in range(n)
        ],
        "off by one: the wait after the first failure (k = 0) uses base_delay * 2**0 = base_delay": [
            u[k] * window(k + 1, base, cap) for k in range(n)
        ],
        "jitter before the cap: min(max_delay, rand() * ...) piles delays up at the cap; cap the window first": [
            min(cap, u[k] * base * 2**k) for k in range(n)
        ],
        "linear growth: the window must double (base_delay * 2**k), not grow by base_delay": [
            u[k] * min(cap, base * (k + 1)) for k in range(n)
        ],
    }
    for text, guess in guesses.items():
        if close(got, guess):
            return text
    return "the delays do not follow rand() * min(max_delay, base_delay * 2**k); did it use the injected rand()?"


def expect_jittered(r: Report, what: str, got: list, draws: Draws, base: float, cap: float, n: int) -> None:
    """``got`` must be ``n`` sleeps of rand() * min(cap, base * 2**k), rand() being ``draws``."""
    windows = [window(k, base, cap) for k in range(n)]
    if len(draws.values) >= n:
        expected = [draws.values[k] * windows[k] for k in range(n)]
        shown = fmt(expected)
    else:
        expected, shown = None, f"rand() * {fmt(windows)}"
    if expected is not None and close(got, expected):
        r.ok(f"{what}: slept {fmt(got)}")
        return
    if len(got) != n:
        r.fail(f"{what}: slept {len(got)} times {fmt(got)}, expected {n} sleeps ({shown})")
    r.fail(f"{what}: slept {fmt(got)}, expected {shown}: " + diagnose_delays(got, draws.values, base, cap))


# ----------------------------------------------------------------------------- is_retryable


def _retryable_cases() -> list[tuple[str, BaseException, bool]]:
    cases: list[tuple[str, BaseException, bool]] = [
        ("TimeoutError()", TimeoutError(), True),
        ("asyncio.TimeoutError()", TimeoutError(), True),
        ("httpx.ConnectTimeout", httpx.ConnectTimeout("connect timed out"), True),
        ("httpx.ReadTimeout", httpx.ReadTimeout("read timed out"), True),
        ("httpx.WriteTimeout", httpx.WriteTimeout("write timed out"), True),
        ("httpx.PoolTimeout (your own pool is full)", httpx.PoolTimeout("no free connection"), False),
        ("httpx.ConnectError", httpx.ConnectError("connection refused"), True),
        ("httpx.ReadError", httpx.ReadError("connection reset"), True),
        ("httpx.WriteError", httpx.WriteError("broken pipe"), True),
        ("httpx.RemoteProtocolError", httpx.RemoteProtocolError("server disconnected"), True),
        ("httpx.UnsupportedProtocol (a caller bug)", httpx.UnsupportedProtocol("ftp:// is not supported"), False),
        ("httpx.LocalProtocolError (a caller bug)", httpx.LocalProtocolError("Illegal header value"), False),
        ("ConnectionResetError()", ConnectionResetError(), True),
        ("ConnectionRefusedError()", ConnectionRefusedError(), True),
        ("BrokenPipeError()", BrokenPipeError(), True),
        ("ValueError('bad input')", ValueError("bad input"), False),
        ("KeyError('id')", KeyError("id"), False),
        ("RuntimeError('timeout while parsing')", RuntimeError("timeout while parsing"), False),
        ("Exception('503')", Exception("503"), False),
        ("FileNotFoundError (an OSError, not a connection error)", FileNotFoundError("config.toml"), False),
        ("PermissionError (an OSError, not a connection error)", PermissionError("/var/run/app.pid"), False),
        ("an error with status=None", StatusError(None), False),
        ("an error with status='503' (a string)", StatusError("503"), False),
    ]
    for status in (408, 429, 500, 502, 503, 504):
        cases.append((f"httpx.HTTPStatusError {status}", http_status_error(status), True))
    for status in (400, 401, 403, 404, 409, 422, 501, 505):
        cases.append((f"httpx.HTTPStatusError {status}", http_status_error(status), False))
    for status in (408, 429, 500, 503, 599):
        cases.append((f"an error with status={status}", StatusError(status), True))
    for status in (400, 404, 409, 418, 451, 501, 505, 600, 999):  # 600 and up: not 5xx
        cases.append((f"an error with status={status}", StatusError(status), False))
    cases.append(("course.kit.faults.DependencyError(503)", DependencyError(503), True))
    cases.append(("course.kit.faults.DependencyError(404)", DependencyError(404), False))
    return cases


def _judge(r: Report, is_retryable, cases) -> None:
    wrong = []
    for label, err, expected in cases:
        try:
            got = is_retryable(err)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - learner code
            r.fail(
                f"is_retryable({label}) raised {type(exc).__name__}: {exc}; it must answer True or False for any error"
            )
        if not isinstance(got, bool):
            r.fail(f"is_retryable({label}) returned {got!r}, not a bool; return True or False explicitly")
        if got != expected:
            wrong.append(f"{label} -> {got} (expected {expected})")
    r.expect(not wrong, f"{len(cases)} errors classified" + (": wrong for " + "; ".join(wrong) if wrong else ""))


@task("is_retryable", points=2, title="classify errors worth another try", timeout=30)
async def check_is_retryable(r: Report, is_retryable) -> None:
    r.note("public: a timeout, a 503, a 404 and a ValueError")
    _judge(
        r,
        is_retryable,
        [
            ("TimeoutError()", TimeoutError(), True),
            ("DependencyError(503)", DependencyError(503), True),
            ("DependencyError(404)", DependencyError(404), False),
            ("ValueError('bad input')", ValueError("bad input"), False),
        ],
    )
    if r.public:
        return
    r.note("timeouts, connection errors, caller bugs, your own pool, HTTP statuses (httpx and a `status` attribute)")
    _judge(r, is_retryable, _retryable_cases())
    r.note(
        "real errors from httpx: a live FlakyService (4xx, 5xx, reset, hang), a closed port, a full pool, bad requests"
    )
    collected = await live_errors()
    live = [
        (f"the live '{step}' ({type(err).__name__})", err, reference_is_retryable(err))
        for step, err in collected
        if err
    ]
    _judge(r, is_retryable, live)


# ----------------------------------------------------------------------------- with_retry


async def _expect_raise(r: Report, call, what: str):
    """Run ``call``; return (error, value). A cut or a wrong shape is reported by the caller."""
    try:
        value = await bounded(call)
    except Cut:
        r.fail(cut_message(what))
    except Exception as err:  # noqa: BLE001 - the error under test
        return err, None
    return None, value


def _check_final_error(r: Report, what: str, err, value, fn: Raiser) -> None:
    last = fn.raised[-1] if fn.raised else None
    if err is None:
        r.fail(f"{what}: with_retry returned {value!r} instead of raising: it swallowed the final error")
    if err is last:
        return
    if any(err is e for e in fn.raised):
        r.fail(f"{what}: it raised the error of attempt {fn.raised.index(err) + 1}, not the last one")
    if type(err).__name__ == "RetryError":
        r.fail(f"{what}: it raised tenacity's RetryError; re-raise the last error itself (tenacity: pass reraise=True)")
    cause = err.__cause__ or err.__context__
    wrapped = " wrapping it" if cause is last else ""
    r.fail(
        f"{what}: it raised {type(err).__name__}({err}){wrapped} instead of the last error itself "
        f"({type(last).__name__}({last})); re-raise it unchanged (a bare `raise`)"
    )


@task(
    "with_retry",
    points=4,
    title="retry with capped exponential backoff and full jitter",
    timeout=30,
    seed=101,
)
async def check_with_retry(r: Report, with_retry) -> None:
    with seeded_random(r):  # an answer that draws from module random reads the same numbers on every run
        await _check_with_retry(r, with_retry)


async def _check_with_retry(r: Report, with_retry) -> None:
    rs = reference_is_retryable
    # --- public: two failures, then success
    fn, draws, sleeps = FlakyDependency(Schedule("fail fail ok")), Draws(r.random.randrange(10**6)), Sleeps()
    what = "dependency fails twice, then answers (retries=4, base_delay=0.1, max_delay=2.0)"
    try:
        value = await bounded(
            with_retry(fn, retries=4, base_delay=0.1, max_delay=2.0, retryable=rs, sleep=sleeps, rand=draws)
        )
    except Cut:
        r.fail(cut_message(what))
    r.expect(
        value == "ok",
        f"{what}: returned {value!r}"
        + ("" if value == "ok" else ", expected 'ok', the first result (returned before the call succeeded?)"),
    )
    r.expect(
        fn.count == 3,
        f"{what}: {fn.count} calls"
        + ("" if fn.count == 3 else ", expected 3 (gave up early, or called again after the success?)"),
    )
    if not sleeps.delays:
        r.fail(
            f"{what}: the injected sleep was never awaited (did it call time.sleep / asyncio.sleep, "
            "or call sleep(...) without await?)"
        )
    expect_jittered(r, what, sleeps.delays, draws, 0.1, 2.0, 2)
    if r.public:
        return

    # --- defaults: retries=4, base_delay=0.1, max_delay=2.0
    params = inspect.signature(with_retry).parameters
    defaults = {name: params[name].default for name in ("retries", "base_delay", "max_delay") if name in params}
    r.expect(
        defaults == {"retries": 4, "base_delay": 0.1, "max_delay": 2.0},
        f"defaults {defaults}"
        + (
            ""
            if defaults == {"retries": 4, "base_delay": 0.1, "max_delay": 2.0}
            else ", expected retries=4, base_delay=0.1, max_delay=2.0"
        ),
    )
    fn, draws, sleeps = always(lambda: DependencyError(503)), Draws(r.random.randrange(10**6)), Sleeps()
    what = "always 503, default retries/base_delay/max_delay"
    err, value = await _expect_raise(r, with_retry(fn, retryable=rs, sleep=sleeps, rand=draws), what)
    _check_final_error(r, what, err, value, fn)
    r.expect(
        fn.calls == 5,
        f"{what}: {fn.calls} calls" + ("" if fn.calls == 5 else " (expected 5: the first try and 4 retries)"),
    )
    if len(sleeps.delays) == 5:
        r.fail(f"{what}: slept 5 times {fmt(sleeps.delays)}, expected 4: never sleep after the final attempt")
    expect_jittered(r, what, sleeps.delays, draws, 0.1, 2.0, 4)

    # --- the cap and the doubling, with rand() = 1
    fn, sleeps = always(lambda: DependencyError(502)), Sleeps()
    what = "always 502, retries=7, base_delay=0.1, max_delay=1.0, rand() always 1.0"
    err, value = await _expect_raise(
        r, with_retry(fn, retries=7, base_delay=0.1, max_delay=1.0, retryable=rs, sleep=sleeps, rand=lambda: 1.0), what
    )
    _check_final_error(r, what, err, value, fn)
    expected = [window(k, 0.1, 1.0) for k in range(7)]
    r.expect(
        close(sleeps.delays, expected),
        f"{what}: slept {fmt(sleeps.delays)}"
        + (
            ""
            if close(sleeps.delays, expected)
            else f", expected {fmt(expected)} (the window doubles, then stays at the cap)"
        ),
    )

    # --- jitter inside a small cap
    fn, draws, sleeps = always(lambda: DependencyError(503)), Draws(r.random.randrange(10**6)), Sleeps()
    what = "always 503, retries=6, base_delay=0.05, max_delay=0.3"
    err, value = await _expect_raise(
        r, with_retry(fn, retries=6, base_delay=0.05, max_delay=0.3, retryable=rs, sleep=sleeps, rand=draws), what
    )
    _check_final_error(r, what, err, value, fn)
    r.expect(fn.calls == 7, f"{what}: {fn.calls} calls" + ("" if fn.calls == 7 else ", expected 7"))
    expect_jittered(r, what, sleeps.delays, draws, 0.05, 0.3, 6)

    # --- attempts spent: the last error itself, no sleep after the final attempt
    for retries in (3, 1, 0):
        fn, sleeps = always(lambda: DependencyError(503, "payments answered 503")), Sleeps()
        what = f"always 503, retries={retries}"
        err, value = await _expect_raise(
            r, with_retry(fn, retries=retries, retryable=rs, sleep=sleeps, rand=lambda: 0.5), what
        )
        _check_final_error(r, what, err, value, fn)
        r.expect(
            fn.calls == retries + 1,
            f"{what}: {fn.calls} calls"
            + (
                ""
                if fn.calls == retries + 1
                else f", expected {retries + 1} (one attempt {'too few' if fn.calls <= retries else 'too many'})"
            ),
        )
        r.expect(
            len(sleeps.delays) == retries,
            f"{what}: {len(sleeps.delays)} sleeps"
            + ("" if len(sleeps.delays) == retries else f", expected {retries}: never sleep after the final attempt"),
        )

    # --- errors that must not be retried
    for label, make in (
        ("404 (DependencyError)", lambda: DependencyError(404)),
        ("400 (httpx.HTTPStatusError)", lambda: http_status_error(400)),
        ("ValueError", lambda: ValueError("bad input")),
    ):
        fn, sleeps = Raiser(make, value="ok"), Sleeps()
        what = f"first call raises {label}, the next would succeed"
        err, value = await _expect_raise(r, with_retry(fn, retryable=rs, sleep=sleeps, rand=lambda: 0.5), what)
        if err is None:
            r.fail(
                f"{what}: with_retry returned {value!r} after {fn.calls} calls: it retried an error that is not retryable"
            )
        _check_final_error(r, what, err, value, fn)
        r.expect(
            fn.calls == 1 and not sleeps.delays,
            f"{what}: {fn.calls} call(s), {len(sleeps.delays)} sleeps"
            + ("" if fn.calls == 1 and not sleeps.delays else ", expected 1 call and no sleep"),
        )

    # --- it asks the retryable argument, not a fixed rule
    fn, sleeps = Raiser(lambda: KeyError("cache"), lambda: KeyError("cache"), value="fresh"), Sleeps()
    what = "retryable=lambda e: isinstance(e, KeyError); KeyError twice, then a value"
    try:
        value = await bounded(
            with_retry(fn, retryable=lambda e: isinstance(e, KeyError), sleep=sleeps, rand=lambda: 0.5)
        )
    except Cut:
        r.fail(cut_message(what))
    except Exception as err:  # noqa: BLE001
        r.fail(f"{what}: raised {type(err).__name__}({err}); it must ask the retryable argument")
    r.expect(value == "fresh" and fn.calls == 3, f"{what}: returned {value!r} after {fn.calls} calls")
    fn, sleeps = always(lambda: DependencyError(503)), Sleeps()
    what = "retryable=lambda e: False; a 503"
    err, value = await _expect_raise(r, with_retry(fn, retryable=lambda e: False, sleep=sleeps, rand=lambda: 0.5), what)
    _check_final_error(r, what, err, value, fn)
    r.expect(fn.calls == 1, f"{what}: {fn.calls} call(s)" + ("" if fn.calls == 1 else ", expected 1"))

    # --- 50 callers at once on a virtual clock, through a 1-second outage
    clock = VirtualClock()
    dep = FlakyDependency(Schedule.outage(0.0, 1.0), clock=clock, name="inventory")
    seeds = [r.random.randrange(10**6) for _ in range(50)]
    per_caller = [(Draws(seed), Sleeps(clock)) for seed in seeds]
    counts = [0] * 50

    def counted(i: int):
        async def call():
            counts[i] += 1
            return await dep()

        return call

    what = "50 concurrent callers, a dependency down for its first second (virtual clock, retries=10)"
    try:
        results = await bounded(
            asyncio.gather(
                *(
                    with_retry(counted(i), retries=10, base_delay=0.1, max_delay=2.0, retryable=rs, sleep=s, rand=d)
                    for i, (d, s) in enumerate(per_caller)
                ),
                return_exceptions=True,
            )
        )
    except Cut:
        r.fail(cut_message(what))
    failed = [x for x in results if x != "ok"]
    r.expect(
        not failed,
        f"{what}: {50 - len(failed)}/50 got 'ok'"
        + (f"; others got {failed[:2]}: does one call's attempt count leak into another's?" if failed else ""),
    )
    bad = [
        i
        for i, (d, s) in enumerate(per_caller)
        if len(s.delays) != counts[i] - 1
        or not close(s.delays, [d.values[k] * window(k, 0.1, 2.0) for k in range(len(s.delays))])
    ]
    r.expect(
        not bad,
        f"{what}: every caller's delays follow its own rand() and attempt count"
        if not bad
        else f"{what}: caller {bad[0]} made {counts[bad[0]]} calls and slept {fmt(per_caller[bad[0]][1].delays)}; "
        "state shared between calls (a global attempt counter?) mixes callers up",
    )

    # --- cancellation stops it
    clock = VirtualClock()
    dep = FlakyDependency(Schedule("hang"), clock=clock, name="report")
    job = asyncio.ensure_future(with_retry(dep, retryable=rs, sleep=Sleeps(clock), rand=lambda: 0.5))
    await settled()  # until the attempt hangs (or the answer stopped before it)
    job.cancel()
    done, _ = await asyncio.wait({job}, timeout=REAL_LIMIT)
    what = "the caller cancels while an attempt hangs"
    r.expect(
        job in done and job.cancelled() and dep.count == 1,
        f"{what}: cancelled cleanly after {dep.count} call(s)"
        if job in done and job.cancelled() and dep.count == 1
        else f"{what}: {'still running' if job not in done else 'finished without CancelledError'} after {dep.count} "
        "call(s); do not catch CancelledError (catch Exception, not BaseException or a bare except)",
    )


# Imported after the checks above, so the chapter's tasks are reported in order.
from autograder.checks.ch01 import retry_test  # noqa: E402, F401 - the retry_test checks, graded by mutation
from autograder.checks.ch01.rules import REFERENCES, RULES  # noqa: E402 - the rule tables, kept beside the checks

__all__ = ["CORRECT", "MUTANTS", "REFERENCES", "RULES"]
