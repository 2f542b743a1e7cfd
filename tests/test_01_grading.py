"""Chapter 01's checks reject the wrong answers learners write and accept the right ones.

Each wrong solution below is one a learner would plausibly write; each must lose points,
with feedback that names the mistake. Several correct variants must get full marks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from autograder.checks import ch01
from tests.helpers import (
    assert_accepted,
    assert_rejected,
    correct_params,
    notebook_with_answers,
    run_source,
    wrong_params,
)

REPO = Path(__file__).resolve().parent.parent

HEAD = """
import asyncio
import random
import time
import httpx
from course.retry import is_retryable
"""

# ----------------------------------------------------------------------------- is_retryable

RETRYABLE_OK = {
    "reference": HEAD + "from course.retry import is_retryable as _r\ndef is_retryable(err):\n    return _r(err)\n",
    "status sets": """
import asyncio
import httpx

RETRY = {408, 429} | set(range(500, 600)) - {501, 505}

def is_retryable(err: BaseException) -> bool:
    if isinstance(err, (httpx.PoolTimeout, httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
        return False
    if isinstance(err, (TimeoutError, httpx.TimeoutException, httpx.TransportError, ConnectionError)):
        return True
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code in RETRY
    status = getattr(err, "status", None)
    return type(status) is int and status in RETRY
""",
    "response attribute and match": """
import httpx

def is_retryable(err):
    match err:
        case httpx.PoolTimeout() | httpx.UnsupportedProtocol() | httpx.LocalProtocolError():
            return False
        case TimeoutError() | httpx.TimeoutException() | httpx.TransportError() | ConnectionError():
            return True
    status = getattr(getattr(err, "response", None), "status_code", None) if isinstance(err, httpx.HTTPStatusError) else getattr(err, "status", None)
    if isinstance(status, bool) or not isinstance(status, int):
        return False
    return status == 408 or status == 429 or (500 <= status < 600 and status not in (501, 505))
""",
    "lists what may go away by itself": """
import httpx

TRANSIENT = (TimeoutError, ConnectionError, httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout,
             httpx.WriteTimeout, httpx.ReadError, httpx.WriteError, httpx.CloseError, httpx.RemoteProtocolError)

def is_retryable(err):
    if isinstance(err, TRANSIENT):
        return True
    if isinstance(err, httpx.HTTPStatusError):
        status = err.response.status_code
    else:
        status = getattr(err, "status", None)
    if type(status) is not int:
        return False
    return status in (408, 429) or (500 <= status <= 599 and status not in (501, 505))
""",
}

RETRYABLE_WRONG = {
    "everything": ("def is_retryable(err):\n    return True\n", "ValueError"),
    "every HTTP error": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (TimeoutError, httpx.HTTPError, ConnectionError)):
        return True
    s = getattr(err, "status", None)
    return isinstance(s, int) and s >= 500
""",
        "404",
    ),
    "5xx only, forgets 408 and 429": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (TimeoutError, httpx.TimeoutException, httpx.TransportError, ConnectionError)):
        return True
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code >= 500
    s = getattr(err, "status", None)
    return isinstance(s, int) and s >= 500
""",
        "429",
    ),
    "only a status attribute (httpx errors have none)": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (TimeoutError, httpx.TimeoutException, httpx.TransportError, ConnectionError)):
        return True
    s = getattr(err, "status", None)
    return isinstance(s, int) and (s in (408, 429) or 500 <= s <= 599)
""",
        "HTTPStatusError 503",
    ),
    "forgets connection errors": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (TimeoutError, httpx.TimeoutException)):
        return True
    if isinstance(err, httpx.HTTPStatusError):
        s = err.response.status_code
    else:
        s = getattr(err, "status", None)
    return isinstance(s, int) and (s in (408, 429) or 500 <= s <= 599)
""",
        "ConnectError",
    ),
    "matches 'timeout' in the message": (
        """
def is_retryable(err):
    if "timeout" in str(err).lower() or "timed out" in str(err).lower():
        return True
    s = getattr(err, "status", None)
    return isinstance(s, int) and (s in (408, 429) or s >= 500)
""",
        "TimeoutError() -> False",
    ),
    "all 4xx and 5xx": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (TimeoutError, httpx.TimeoutException, httpx.TransportError, ConnectionError)):
        return True
    s = err.response.status_code if isinstance(err, httpx.HTTPStatusError) else getattr(err, "status", None)
    return isinstance(s, int) and s >= 400
""",
        "404",
    ),
    "falls off the end (returns None)": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (TimeoutError, httpx.TimeoutException, httpx.TransportError, ConnectionError)):
        return True
    s = err.response.status_code if isinstance(err, httpx.HTTPStatusError) else getattr(err, "status", None)
    if isinstance(s, int) and (s in (408, 429) or 500 <= s <= 599):
        return True
""",
        "not a bool",
    ),
    "compares a string status": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (TimeoutError, httpx.TimeoutException, httpx.TransportError, ConnectionError)):
        return True
    s = err.response.status_code if isinstance(err, httpx.HTTPStatusError) else getattr(err, "status", None)
    if s is None:
        return False
    return s in (408, 429) or 500 <= s <= 599
""",
        "raised TypeError",
    ),
    "every transport error (caller bugs and your own pool too)": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (TimeoutError, httpx.TimeoutException, httpx.TransportError, ConnectionError)):
        return True
    s = err.response.status_code if isinstance(err, httpx.HTTPStatusError) else getattr(err, "status", None)
    return isinstance(s, int) and not isinstance(s, bool) and (s in (408, 429) or 500 <= s <= 599)
""",
        "PoolTimeout",
    ),
    "every 5xx, 501 and 505 too": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (httpx.PoolTimeout, httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
        return False
    if isinstance(err, (TimeoutError, httpx.TransportError, ConnectionError)):
        return True
    s = err.response.status_code if isinstance(err, httpx.HTTPStatusError) else getattr(err, "status", None)
    return isinstance(s, int) and not isinstance(s, bool) and (s in (408, 429) or 500 <= s <= 599)
""",
        "505",
    ),
    "timeouts only when the message says so": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (httpx.PoolTimeout, httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
        return False
    if isinstance(err, (httpx.TransportError, ConnectionError)):
        return True
    s = err.response.status_code if isinstance(err, httpx.HTTPStatusError) else getattr(err, "status", None)
    return isinstance(s, int) and not isinstance(s, bool) and (s in (408, 429) or (s >= 500 and s not in (501, 505)))
""",
        "TimeoutError() -> False",
    ),
    "5xx as any status from 500 up": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (httpx.PoolTimeout, httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
        return False
    if isinstance(err, (TimeoutError, httpx.TransportError, ConnectionError)):
        return True
    s = err.response.status_code if isinstance(err, httpx.HTTPStatusError) else getattr(err, "status", None)
    return isinstance(s, int) and (s in (408, 429) or (s >= 500 and s not in (501, 505)))
""",
        "status=600 -> True",
    ),
    "every OSError as a connection error": (
        """
import httpx
def is_retryable(err):
    if isinstance(err, (httpx.PoolTimeout, httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
        return False
    if isinstance(err, (TimeoutError, httpx.TransportError, OSError)):
        return True
    s = err.response.status_code if isinstance(err, httpx.HTTPStatusError) else getattr(err, "status", None)
    return isinstance(s, int) and (s in (408, 429) or (500 <= s <= 599 and s not in (501, 505)))
""",
        "FileNotFoundError",
    ),
    "not done": ('def is_retryable(err):\n    raise NotImplementedError("not done yet")\n', "not done yet"),
}


# ----------------------------------------------------------------------------- with_retry

SIG = "async def with_retry(fn, *, retries=4, base_delay=0.1, max_delay=2.0, retryable=is_retryable, sleep=asyncio.sleep, rand=random.random):"

WITH_RETRY_OK = {
    "for loop": HEAD
    + SIG
    + """
    for attempt in range(retries + 1):
        try:
            return await fn()
        except Exception as err:
            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))
""",
    "recursion": HEAD
    + """
async def with_retry(fn, *, retries=4, base_delay=0.1, max_delay=2.0, retryable=is_retryable, sleep=asyncio.sleep, rand=random.random, _attempt=0):
    try:
        return await fn()
    except Exception as err:
        if _attempt >= retries or not retryable(err):
            raise
        await sleep(rand() * min(max_delay, base_delay * 2 ** _attempt))
    return await with_retry(fn, retries=retries, base_delay=base_delay, max_delay=max_delay,
                            retryable=retryable, sleep=sleep, rand=rand, _attempt=_attempt + 1)
""",
    "while loop with a saved error": HEAD
    + SIG
    + """
    attempt = 0
    while True:
        try:
            return await fn()
        except Exception as err:
            last = err
        if attempt >= retries or not retryable(last):
            raise last
        await sleep(min(max_delay, base_delay * 2 ** attempt) * rand())
        attempt += 1
""",
    "tenacity underneath": HEAD
    + """
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt
"""
    + SIG
    + """
    def wait(state):
        return rand() * min(max_delay, base_delay * 2 ** (state.attempt_number - 1))

    async for attempt in AsyncRetrying(stop=stop_after_attempt(retries + 1), wait=wait,
                                       retry=retry_if_exception(retryable), sleep=sleep, reraise=True):
        with attempt:
            return await fn()
""",
}


def _loop(body_except: str, *, loop: str = "for attempt in range(retries + 1):") -> str:
    return (
        HEAD
        + SIG
        + f"""
    {loop}
        try:
            return await fn()
        except Exception as err:
{body_except}
"""
    )


WITH_RETRY_WRONG = {
    "no jitter": (
        _loop("""            if attempt == retries or not retryable(err):
                raise
            await sleep(min(max_delay, base_delay * 2 ** attempt))"""),
        "no jitter",
    ),
    "constant delay": (
        _loop("""            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * base_delay)"""),
        "constant delay",
    ),
    "no cap": (
        _loop("""            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * base_delay * 2 ** attempt)"""),
        "slept",
    ),
    "jitter before the cap": (
        _loop("""            if attempt == retries or not retryable(err):
                raise
            await sleep(min(max_delay, rand() * base_delay * 2 ** attempt))"""),
        "jitter before the cap",
    ),
    "off by one exponent": (
        _loop("""            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** (attempt + 1)))"""),
        "off by one",
    ),
    "linear backoff": (
        _loop("""            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * (attempt + 1)))"""),
        "linear",
    ),
    "module random instead of the injected rand": (
        _loop("""            if attempt == retries or not retryable(err):
                raise
            await sleep(random.random() * min(max_delay, base_delay * 2 ** attempt))"""),
        "injected rand",
    ),
    "one attempt too few": (
        _loop(
            """            if attempt == retries - 1 or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))""",
            loop="for attempt in range(max(retries, 1)):",
        ),
        "calls",
    ),
    "retries a non-retryable error": (
        _loop("""            if attempt == retries:
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))"""),
        "not retryable",
    ),
    "retries 4xx even when retryable says no": (
        _loop("""            status = getattr(err, "status", None)
            if attempt == retries or not (retryable(err) or (isinstance(status, int) and status >= 400)):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))"""),
        "404",
    ),
    "ignores the retryable argument": (  # its own is_retryable, from the cell above (the course's is left out)
        _loop("""            if attempt == retries or not is_retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))""")
        + """
def is_retryable(err):
    status = getattr(err, "status", None) or getattr(getattr(err, "response", None), "status_code", None)
    if status is not None:
        return status in (408, 429) or status >= 500
    return isinstance(err, (TimeoutError, ConnectionError, httpx.TransportError))
""",
        "retryable argument",
    ),
    "sleeps after the final attempt": (
        _loop("""            if not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))
            if attempt == retries:
                raise"""),
        "never sleep after the final attempt",
    ),
    "swallows the final error": (
        _loop("""            if not retryable(err):
                raise
            if attempt == retries:
                return None
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))"""),
        "swallowed",
    ),
    "wraps the final error": (
        _loop("""            if attempt == retries or not retryable(err):
                raise RuntimeError(f"gave up after {attempt + 1} attempts") from err
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))"""),
        "unchanged",
    ),
    "raises the first error": (
        _loop(
            """            first = first or err
            if attempt == retries or not retryable(err):
                raise first
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))""",
            loop="first = None\n    for attempt in range(retries + 1):",
        ),
        "not the last one",
    ),
    "tenacity without reraise": (
        HEAD
        + "from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt\n"
        + SIG
        + """
    def wait(state):
        return rand() * min(max_delay, base_delay * 2 ** (state.attempt_number - 1))
    async for attempt in AsyncRetrying(stop=stop_after_attempt(retries + 1), wait=wait,
                                       retry=retry_if_exception(retryable), sleep=sleep):
        with attempt:
            return await fn()
""",
        "reraise=True",
    ),
    "catches BaseException (retries cancellation)": (
        HEAD
        + SIG
        + """
    for attempt in range(retries + 1):
        try:
            return await fn()
        except BaseException as err:
            if attempt == retries or not (retryable(err) or isinstance(err, asyncio.CancelledError)):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))
""",
        "CancelledError",
    ),
    "a global attempt counter": (
        HEAD
        + "STATE = {'attempt': 0}\n"
        + SIG
        + """
    STATE['attempt'] = 0
    while True:
        try:
            return await fn()
        except Exception as err:
            if STATE['attempt'] >= retries or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** STATE['attempt']))
            STATE['attempt'] += 1
""",
        "concurrent callers",
    ),
    "awaits one coroutine twice": (
        HEAD
        + SIG
        + """
    call = fn()
    for attempt in range(retries + 1):
        try:
            return await call
        except Exception as err:
            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** attempt))
""",
        "RuntimeError",
    ),
    "sleeps for real with asyncio.sleep": (
        _loop("""            if attempt == retries or not retryable(err):
                raise
            await asyncio.sleep(rand() * min(max_delay, base_delay * 2 ** attempt) / 10)"""),
        "never awaited",
    ),
    "sleeps for real with time.sleep": (
        _loop("""            if attempt == retries or not retryable(err):
                raise
            time.sleep(rand() * min(max_delay, base_delay * 2 ** attempt) / 10)"""),
        "never awaited",
    ),
    "not done": (HEAD + SIG + '\n    raise NotImplementedError("not done yet")\n', "not done yet"),
}

#: never returns: each costs the check's real-time limit, so they run in parallel
WITH_RETRY_HANGS = {
    "retries forever": HEAD
    + SIG
    + """
    attempt = 0
    while True:
        try:
            return await fn()
        except Exception as err:
            if not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2 ** min(attempt, 20)))
            attempt += 1
""",
    "waits on an event nobody sets": HEAD
    + SIG
    + """
    await asyncio.Event().wait()
""",
}


def test_01_with_retry_that_never_returns_is_cut_and_fails_only_itself():
    started = time.perf_counter()
    with ThreadPoolExecutor(len(WITH_RETRY_HANGS)) as pool:
        results = list(pool.map(lambda src: run_source("with_retry", src), WITH_RETRY_HANGS.values()))
    for res in results:
        assert res.points == 0, res.text()
        assert "real time" in res.text(), res.text()
    # other tasks still grade normally afterwards
    assert_accepted("is_retryable", RETRYABLE_OK["status sets"])
    assert time.perf_counter() - started < 30


def test_01_with_retry_verdicts_repeat():
    source = WITH_RETRY_WRONG["jitter before the cap"][0]
    first, second = run_source("with_retry", source), run_source("with_retry", source)
    assert first.lines == second.lines
    assert any("from seed 101" in line for line in first.lines)


# ----------------------------------------------------------------------------- retry_test

TEST_HEAD = """
import asyncio
import random
import pytest
from course.kit.faults import DependencyError, FlakyDependency, Schedule, VirtualClock
"""

GOOD_TEST = (
    TEST_HEAD
    + """
async def test_survives_three_of_five_failures(with_retry):
    clock = VirtualClock()
    flaky = FlakyDependency(Schedule("fail fail fail ok ok"), clock=clock)
    rng, draws = random.Random(42), []
    def rand():
        draws.append(rng.random())
        return draws[-1]
    assert await with_retry(flaky, retries=3, base_delay=0.1, max_delay=0.3, sleep=clock.sleep, rand=rand) == "ok"
    assert flaky.count == 4
    assert len(draws) >= 3
    assert clock.sleeps == pytest.approx([u * w for u, w in zip(draws, [0.1, 0.2, 0.3])])
    clock = VirtualClock()
    flaky = FlakyDependency(Schedule("fail fail fail ok ok"), clock=clock)
    with pytest.raises(DependencyError):
        await with_retry(flaky, retries=2, sleep=clock.sleep, rand=rand)
    assert flaky.count == 3 and len(clock.sleeps) == 2
    clock = VirtualClock()
    flaky = FlakyDependency(Schedule("404 ok"), clock=clock)
    with pytest.raises(DependencyError):
        await with_retry(flaky, sleep=clock.sleep, rand=rand)
    assert flaky.count == 1
"""
)

SYNC_GOOD_TEST = (
    TEST_HEAD
    + """
def test_survives_three_of_five_failures(with_retry):
    async def scenario():
        sleeps = []
        async def sleep(s):
            sleeps.append(s)
        draws = iter([0.5, 0.25, 0.75, 0.5, 0.5])
        flaky = FlakyDependency(Schedule("fail fail fail ok ok"))
        assert await with_retry(flaky, retries=3, base_delay=1.0, max_delay=3.0, sleep=sleep, rand=lambda: next(draws)) == "ok"
        assert flaky.count == 4
        assert sleeps == [0.5 * 1.0, 0.25 * 2.0, 0.75 * 3.0]
        sleeps.clear()
        flaky = FlakyDependency(Schedule("fail fail fail ok ok"))
        try:
            await with_retry(flaky, retries=2, sleep=sleep, rand=lambda: 0.5)
        except DependencyError:
            pass
        else:
            raise AssertionError("the error was swallowed")
        assert len(sleeps) == 2
        flaky = FlakyDependency(Schedule("404 ok"))
        try:
            await with_retry(flaky, sleep=sleep, rand=lambda: 0.5)
        except DependencyError:
            pass
        assert flaky.count == 1
    asyncio.run(scenario())
"""
)

#: only the happy path with loose bounds: catches some wrong versions, not all
WEAK_TEST = (
    TEST_HEAD
    + """
async def test_survives_three_of_five_failures(with_retry):
    clock = VirtualClock()
    flaky = FlakyDependency(Schedule("fail fail fail ok ok"), clock=clock)
    assert await with_retry(flaky, retries=3, sleep=clock.sleep) == "ok"
    assert flaky.count == 4
    assert len(clock.sleeps) == 3
    assert all(0 <= s <= 0.1 * 2 ** k for k, s in enumerate(clock.sleeps))
"""
)

#: the zip() trap: with no rand() draws, the comparison is vacuously true
VACUOUS_TEST = (
    TEST_HEAD
    + """
async def test_survives_three_of_five_failures(with_retry):
    clock = VirtualClock()
    flaky = FlakyDependency(Schedule("fail fail fail ok ok"), clock=clock)
    draws = []
    def rand():
        draws.append(random.Random(len(draws)).random())
        return draws[-1]
    assert await with_retry(flaky, retries=3, base_delay=0.1, max_delay=0.3, sleep=clock.sleep, rand=rand) == "ok"
    assert flaky.count == 4
    assert all(abs(s - u * w) < 1e-9 for s, u, w in zip(clock.sleeps, draws, [0.1, 0.2, 0.3]))
    clock = VirtualClock()
    flaky = FlakyDependency(Schedule("fail fail fail ok ok"), clock=clock)
    with pytest.raises(DependencyError):
        await with_retry(flaky, retries=2, sleep=clock.sleep, rand=rand)
    assert len(clock.sleeps) == 2
    flaky = FlakyDependency(Schedule("404 ok"), clock=clock)
    with pytest.raises(DependencyError):
        await with_retry(flaky, sleep=clock.sleep, rand=rand)
"""
)


def test_01_retry_test_full_marks_for_a_thorough_test():
    res = assert_accepted("retry_test", GOOD_TEST)
    assert "7/7 wrong versions caught" in res.text()


def test_01_retry_test_partial_credit_names_what_got_through():
    res = run_source("retry_test", WEAK_TEST)
    assert 0 < res.points < res.max_points, res.text()
    assert "got through" in res.text()
    caught = sum(1 for line in res.lines if line.startswith("  [ok] caught"))
    assert res.points == round(res.max_points * caught / len(ch01.MUTANTS), 2)


def test_01_retry_test_sees_through_a_vacuous_zip():
    res = run_source("retry_test", VACUOUS_TEST)
    assert res.points == round(res.max_points * 6 / 7, 2), res.text()
    assert "got through: 'no jitter'" in res.text()


RETRY_TEST_WRONG = {
    "compares against the course's with_retry": (
        TEST_HEAD
        + """
from course.retry import with_retry as reference
async def test_survives_three_of_five_failures(with_retry):
    for schedule in ("fail fail fail ok ok", "fail fail fail fail fail fail", "404 ok"):
        for kwargs in ({}, {"retries": 2}, {"max_delay": 0.15}):
            seen = []
            for impl in (with_retry, reference):
                clock = VirtualClock()
                dep = FlakyDependency(Schedule(schedule), clock=clock)
                try:
                    out = await impl(dep, sleep=clock.sleep, rand=random.Random(3).random, **kwargs)
                except DependencyError as err:
                    out = ("raised", err.status)
                seen.append((out, dep.count, [round(s, 9) for s in clock.sleeps]))
            assert seen[0] == seen[1], seen
""",
        "calls the course's own",
    ),
    "fails against a correct with_retry": (
        TEST_HEAD
        + """
async def test_survives_three_of_five_failures(with_retry):
    clock = VirtualClock()
    flaky = FlakyDependency(Schedule("fail fail fail ok ok"), clock=clock)
    assert await with_retry(flaky, sleep=clock.sleep) == "ok"
    assert flaky.count == 5
""",
        "your test fails",
    ),
    "sleeps for real": (
        TEST_HEAD
        + """
async def test_survives_three_of_five_failures(with_retry):
    flaky = FlakyDependency(Schedule("fail fail fail ok ok"))
    assert await with_retry(flaky, base_delay=0.001) == "ok"
    assert flaky.count == 4
""",
        "no sleep=",
    ),
    "never calls the with_retry it is given": (
        TEST_HEAD
        + """
from course.retry import with_retry as reference
async def test_survives_three_of_five_failures(with_retry):
    clock = VirtualClock()
    flaky = FlakyDependency(Schedule("fail fail fail ok ok"), clock=clock)
    assert await reference(flaky, sleep=clock.sleep) == "ok"
""",
        "never calls",
    ),
    "checks which function it got": (
        TEST_HEAD
        + """
import course.retry
async def test_survives_three_of_five_failures(with_retry):
    clock = VirtualClock()
    flaky = FlakyDependency(Schedule("fail fail fail ok ok"), clock=clock)
    await with_retry(flaky, sleep=clock.sleep)
    assert with_retry is course.retry.with_retry
""",
        "your test fails",
    ),
    "state shared between runs": (
        TEST_HEAD
        + """
CLOCK = VirtualClock()
FLAKY = FlakyDependency(Schedule("fail fail fail ok ok"), clock=CLOCK)
async def test_survives_three_of_five_failures(with_retry):
    assert await with_retry(FLAKY, retries=3, base_delay=0.1, max_delay=0.3, sleep=CLOCK.sleep) == "ok"
    assert FLAKY.count == 4
""",
        "inside the test",
    ),
    "hangs": (
        TEST_HEAD
        + """
async def test_survives_three_of_five_failures(with_retry):
    await asyncio.Event().wait()
""",
        "real time",
    ),
    "not done": (
        'async def test_survives_three_of_five_failures(with_retry):\n    raise NotImplementedError("not done yet")\n',
        "not done yet",
    ),
}


def test_01_every_mutant_is_wrong_and_every_correct_version_right():
    """The mutants must really be wrong (the reference check rejects each) and the correct
    versions really correct: otherwise the mutation grade would punish good tests."""
    import inspect
    import textwrap

    for name, impl in ch01.CORRECT.items():
        source = HEAD + textwrap.dedent(inspect.getsource(impl)).replace(impl.__name__, "with_retry")
        if name == "course.retry.with_retry":
            continue
        assert_accepted("with_retry", source.replace("reference_is_retryable", "is_retryable"))
    for impl, _ in ch01.MUTANTS.values():
        source = HEAD + textwrap.dedent(inspect.getsource(impl)).replace(impl.__name__, "with_retry")
        assert_rejected("with_retry", source.replace("reference_is_retryable", "is_retryable"))


STATUS_SETS = RETRYABLE_OK["status sets"]

RETRYABLE_NEW_WRONG = {
    "retries a full pool (PoolTimeout)": (
        STATUS_SETS.replace("(httpx.PoolTimeout, httpx.UnsupportedProtocol", "(httpx.UnsupportedProtocol"),
        "PoolTimeout",
    ),
    "retries the caller bugs": (
        STATUS_SETS.replace(
            "(httpx.PoolTimeout, httpx.UnsupportedProtocol, httpx.LocalProtocolError)", "httpx.PoolTimeout"
        ),
        "UnsupportedProtocol",
    ),
    "only httpx status errors (a status attribute is ignored)": (
        STATUS_SETS.replace(
            '    status = getattr(err, "status", None)\n    return type(status) is int and status in RETRY\n',
            "    return False\n",
        ),
        "DependencyError",
    ),
    "converts a string status": (
        STATUS_SETS.replace(
            "return type(status) is int and status in RETRY", "return status is not None and int(status) in RETRY"
        ),
        "status",
    ),
}


#: a thorough test with one check left out: each lets exactly one wrong version through
RETRY_TEST_MISSES_ONE = {
    "misses no jitter (a vacuous zip)": (VACUOUS_TEST, "got through: 'no jitter'"),
    "misses constant delay (only upper bounds)": (
        GOOD_TEST.replace(
            "    rng, draws = random.Random(42), []\n    def rand():\n        draws.append(rng.random())",
            "    draws = []\n    def rand():\n        draws.append(0.999)",
        ).replace(
            "    assert clock.sleeps == pytest.approx([u * w for u, w in zip(draws, [0.1, 0.2, 0.3])])\n",
            "    assert all(s <= w + 1e-9 for s, w in zip(clock.sleeps, [0.1, 0.2, 0.3]))\n",
        ),
        "got through: 'constant delay'",
    ),
    "misses no cap (max_delay never reached)": (
        GOOD_TEST.replace("max_delay=0.3", "max_delay=1.0").replace("[0.1, 0.2, 0.3]", "[0.1, 0.2, 0.4]"),
        "got through: 'no cap'",
    ),
    "misses one attempt too few (counts sleeps, not calls)": (
        GOOD_TEST.replace("retries=3, base_delay", "retries=4, base_delay")
        .replace("    assert flaky.count == 4\n", "")
        .replace(
            "    assert flaky.count == 3 and len(clock.sleeps) == 2\n",
            "    assert len(clock.sleeps) == flaky.count - 1\n",
        ),
        "got through: 'one attempt too few'",
    ),
    "misses retries of a non-retryable error (no 404)": (
        GOOD_TEST[: GOOD_TEST.index('    flaky = FlakyDependency(Schedule("404 ok")')].rsplit(
            "    clock = VirtualClock()", 1
        )[0],
        "got through: 'retries a non-retryable error'",
    ),
    "misses a sleep after the last attempt (counts calls only)": (
        GOOD_TEST.replace("    assert flaky.count == 3 and len(clock.sleeps) == 2\n", "    assert flaky.count == 3\n"),
        "got through: 'sleeps after the last attempt'",
    ),
    "misses a swallowed final error (no pytest.raises)": (
        GOOD_TEST.replace(
            "    with pytest.raises(DependencyError):\n        await with_retry(flaky, retries=2, sleep=clock.sleep, rand=rand)\n",
            "    try:\n        await with_retry(flaky, retries=2, sleep=clock.sleep, rand=rand)\n    except DependencyError:\n        pass\n",
        ),
        "got through: 'swallows the final error'",
    ),
}

WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "is_retryable": {**RETRYABLE_WRONG, **RETRYABLE_NEW_WRONG},
    "with_retry": WITH_RETRY_WRONG,
    "retry_test": {**RETRY_TEST_WRONG, **RETRY_TEST_MISSES_ONE},
}

#: an answer that only calls the course's reference is not a correct answer (REFERENCES)
CORRECT: dict[str, dict[str, str]] = {
    "is_retryable": {name: src for name, src in RETRYABLE_OK.items() if name != "reference"},
    "with_retry": WITH_RETRY_OK,
    "retry_test": {"thorough": GOOD_TEST, "a sync test running its own loop": SYNC_GOOD_TEST},
}


@pytest.mark.parametrize(("task_id", "source", "mentions"), wrong_params(WRONG))
def test_01_wrong_answers_are_rejected_for_their_mistake(task_id, source, mentions):
    assert_rejected(task_id, source, mentions=mentions)


@pytest.mark.parametrize(("task_id", "source"), correct_params(CORRECT))
def test_01_correct_answers_get_full_marks(task_id, source):
    assert_accepted(task_id, source)


def test_01_retry_test_answers_that_break_a_rule_outright_earn_nothing():
    for name, (source, _) in RETRY_TEST_WRONG.items():
        res = run_source("retry_test", source)
        assert res.points == 0, f"{name}:\n{res.text()}"


def test_01_a_test_that_misses_one_wrong_version_earns_six_sevenths():
    for name, (source, _) in RETRY_TEST_MISSES_ONE.items():
        res = run_source("retry_test", source)
        assert res.points == round(res.max_points * 6 / 7, 2), f"{name}:\n{res.text()}"


# ----------------------------------------------------------------------------- the whole notebook


@pytest.mark.slow
def test_01_course_check_scores_wrong_answers_below_full_marks(tmp_path):
    from autograder.check import check

    answers = {
        # the answer cells run in order: the with_retry cell must not re-import the reference is_retryable
        "with_retry": WITH_RETRY_WRONG["no jitter"][0].replace("from course.retry import is_retryable\n", ""),
        "is_retryable": RETRYABLE_WRONG["every HTTP error"][0],
        "retry_test": WEAK_TEST,
    }
    path = notebook_with_answers("01_timeouts_and_retries", answers, tmp_path)
    res = check(path)
    scores = {t.id: t.points for t in res.tasks}
    assert scores["is_retryable"] == 0 and scores["with_retry"] == 0, scores
    assert 0 < scores["retry_test"] < 4, scores
    assert res.score < res.max_score == 10
