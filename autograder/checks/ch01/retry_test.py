"""Hidden checks of ``retry_test``: the learner's test, graded by mutation.

The test must pass against correct versions of ``with_retry`` (:data:`CORRECT`) and fail
against each wrong one in :data:`MUTANTS`; each wrong one caught earns its share of the points.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable

from autograder import references
from autograder.checks.ch01.common import REAL_LIMIT, Cut, bounded
from autograder.checks.ch01.versions import CORRECT, MUTANTS
from autograder.harness import Report, error_line, task
from autograder.probes import seeded_random
from course.retry import with_retry as reference_with_retry


class _Spy:
    """What a learner's test did with the with_retry it was given."""

    def __init__(self) -> None:
        self.calls = 0
        self.without_sleep = 0


def _spy_on(impl) -> tuple[Callable, _Spy]:
    spy = _Spy()

    @functools.wraps(reference_with_retry)
    async def with_retry(fn, *args, **kwargs):
        spy.calls += 1
        if "sleep" not in kwargs:
            spy.without_sleep += 1
        return await impl(fn, *args, **kwargs)

    return with_retry, spy


async def _run_learner_test(test, impl, limit: float = REAL_LIMIT) -> tuple[BaseException | None, _Spy]:
    """Run the learner's test with ``impl`` as its with_retry; return what it raised (None: passed)."""
    wrapped, spy = _spy_on(impl)

    async def run():
        if inspect.iscoroutinefunction(test):
            return await test(wrapped)
        # a plain def may call asyncio.run itself: give it a thread without a running loop
        result = await asyncio.to_thread(test, wrapped)
        if inspect.isawaitable(result):
            await result

    try:
        await bounded(run(), limit)
    except Cut:
        return Cut(f"did not finish within {limit:g} s of real time"), spy
    except asyncio.CancelledError:
        return asyncio.CancelledError("the test was cancelled"), spy
    except BaseException as err:  # noqa: BLE001 - pytest.fail and friends derive from BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        return err, spy
    return None, spy


OWN = (
    "your test calls the course's own course.retry.with_retry (to compare against it?): its verdict would then "
    "come from the course's code, not from your assertions. Work the expected calls and delays out in the "
    "test from the rand() and sleep you inject"
)
FRESH = "Make the dependency, clock and recorders inside the test, so every run starts fresh"


def _calls_the_reference(test) -> bool:
    """Whether the learner's test names course.retry.with_retry itself (to compare against it, say)."""
    import types

    import course
    import course.retry

    names: set[str] = set()
    codes = [getattr(test, "__code__", None)]
    while codes:
        code = codes.pop()
        if code is None:
            continue
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    scope = getattr(test, "__globals__", None) or {}
    for name in names:
        value = scope.get(name)
        if value is reference_with_retry or getattr(value, "__course_reference__", None) == "course.retry.with_retry":
            return True
        if value is course.retry and "with_retry" in names:
            return True
        if value is course and {"retry", "with_retry"} <= names:
            return True
    return False


def _short(err: BaseException) -> str:
    return error_line(err, limit=160)


@task(
    "retry_test",
    points=4,
    title="a test of with_retry that catches wrong versions",
    needs=("test_survives_three_of_five_failures",),
    timeout=60,
    partial=True,
    seed=102,
)
async def check_retry_test(r: Report, test) -> None:
    # a test that lets with_retry draw from module random (no rand= injected) sees the same draws on every
    # run, so which wrong versions it catches does not change from one grading to the next
    with seeded_random(r):
        await _check_retry_test(r, test)


async def _check_retry_test(r: Report, test) -> None:
    if not callable(test):
        r.fail(f"test_survives_three_of_five_failures is a {type(test).__name__}, not a function")
    try:
        params = list(inspect.signature(test).parameters)
    except (TypeError, ValueError):
        params = ["with_retry"]
    if len(params) < 1:
        r.fail("test_survives_three_of_five_failures must take one argument, with_retry (the version under test)")

    err, spy = await _run_learner_test(test, reference_with_retry)
    if isinstance(err, NotImplementedError):
        raise err
    # the course's with_retry is left out of the learner's copy: a test that calls it fails with that error
    own = _calls_the_reference(test) or (err is not None and references.MARK in str(err))
    if own and spy.calls == 0:
        r.fail("your test never calls the with_retry it is given (its argument), so it cannot tell right from wrong")
    if own:
        r.fail(OWN)
    if err is not None:
        r.fail(f"against a correct with_retry (course.retry.with_retry) your test fails: {_short(err)}")
    if spy.calls == 0:
        r.fail("your test never calls the with_retry it is given (its argument), so it cannot tell right from wrong")
    if spy.without_sleep:
        r.fail(
            f"{spy.without_sleep} of its {spy.calls} with_retry calls pass no sleep=: inject a recording sleep "
            "(for example a VirtualClock's clock.sleep) so the test never waits for real and can see the delays"
        )
    r.ok(f"passes against course.retry.with_retry ({spy.calls} with_retry calls, sleep injected)")
    err, _ = await _run_learner_test(test, reference_with_retry)
    if err is not None:
        r.fail(f"run a second time against the correct with_retry, your test fails: {_short(err)}. {FRESH}")
    if r.public:
        return

    for name, impl in CORRECT.items():
        if impl is reference_with_retry:
            continue
        err, _ = await _run_learner_test(test, impl)
        if err is not None:
            r.fail(f"your test fails against {name} of with_retry, which is correct: {_short(err)}")
    r.ok("passes against two other correct versions (recursive, while loop)")

    caught, missed = [], []
    for name, (impl, what) in MUTANTS.items():
        err, _ = await _run_learner_test(test, impl)
        if err is None:
            missed.append(name)
            r.fail(f"got through: '{name}' ({what}) passed your test", stop=False)
        else:
            caught.append(name)
            r.ok(f"caught '{name}' ({what}): {_short(err)}")

    err, _ = await _run_learner_test(test, reference_with_retry)
    if err is not None:
        r.fraction = 0.0
        r.fail(
            f"run again against the correct with_retry after the wrong ones, your test fails: {_short(err)}. {FRESH}"
        )
    r.fraction = len(caught) / len(MUTANTS)
    r.note(
        f"{len(caught)}/{len(MUTANTS)} wrong versions caught"
        + (f"; got through: {', '.join(missed)}" if missed else "")
    )
