"""Chapter 02 grading: the checks accept correct breakers and bulkheads and reject the usual wrong ones."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers import (
    assert_accepted,
    assert_rejected,
    correct_params,
    notebook_with_answers,
    run_source,
    wrong_params,
)

NOTEBOOK = (
    Path(__file__).resolve().parent.parent
    / "solutions"
    / "02_circuit_breakers_and_bulkheads"
    / "02_circuit_breakers_and_bulkheads.ipynb"
)


def answer_cell(task_id: str) -> str:
    """The solution notebook's answer cell for ``task_id``, as source text."""
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == task_id:
            return "".join(cell["source"])
    raise LookupError(task_id)


# ----------------------------------------------------------------------------- circuit breaker

BREAKER_HEAD = """
import asyncio
import time
from collections import deque

from course.breaker import CircuitOpenError, counts_as_failure
"""

RING_BUFFER = (
    BREAKER_HEAD
    + """
class CircuitBreaker:
    def __init__(self, threshold=0.5, window_size=10, cooldown=30.0, *, clock=time.monotonic, is_failure=counts_as_failure):
        self.threshold, self.size, self.cooldown, self.clock, self.is_failure = threshold, window_size, cooldown, clock, is_failure
        self.state, self.opened_at, self.probe_out = "closed", 0.0, False
        self._reset()

    def _reset(self):  # on every open and close: calls in flight from before no longer count
        self.ring, self.pos, self.seen = [False] * self.size, 0, 0
        self.gen = getattr(self, "gen", 0) + 1

    def _note(self, failed):
        self.ring[self.pos] = failed
        self.pos = (self.pos + 1) % self.size
        self.seen = min(self.seen + 1, self.size)
        if failed and self.seen == self.size and sum(self.ring) >= self.threshold * self.size:
            self.state, self.opened_at = "open", self.clock()
            self._reset()

    async def call(self, fn):
        if self.state == "open":
            if self.clock() < self.opened_at + self.cooldown:
                raise CircuitOpenError("payments", self.opened_at + self.cooldown - self.clock())
            self.state = "half-open"
        if self.state == "half-open":
            if self.probe_out:
                raise CircuitOpenError("payments", 1)
            self.probe_out = True
            try:
                result = await fn()
            except Exception as err:
                if self.is_failure(err):
                    self.state, self.opened_at = "open", self.clock()
                else:
                    self.state = "closed"
                    self._reset()
                raise
            finally:
                self.probe_out = False
            self.state = "closed"
            self._reset()
            return result
        gen = self.gen
        try:
            result = await fn()
        except Exception as err:
            if self.state == "closed" and gen == self.gen:
                self._note(self.is_failure(err))
            raise
        if self.state == "closed" and gen == self.gen:
            self._note(False)
        return result
"""
)

LOCK_GATE = (
    BREAKER_HEAD
    + """
class CircuitBreaker:
    def __init__(self, threshold=0.5, window_size=10, cooldown=30.0, *, clock=time.monotonic, is_failure=counts_as_failure):
        self.threshold, self.window_size, self.cooldown = threshold, window_size, cooldown
        self.clock, self.is_failure = clock, is_failure
        self._window = deque(maxlen=window_size)
        self._opened_at = None
        self._gate = asyncio.Lock()
        self._epoch = 0  # bumped on every open and close

    @property
    def state(self):
        if self._opened_at is None:
            return "closed"
        if self._gate.locked() or self.clock() - self._opened_at >= self.cooldown:
            return "half-open"
        return "open"

    async def call(self, fn):
        if self._opened_at is None:
            epoch = self._epoch
            try:
                result = await fn()
            except Exception as err:
                if self._opened_at is None and epoch == self._epoch:
                    self._window.append(self.is_failure(err))
                    if len(self._window) == self.window_size and sum(self._window) >= self.threshold * self.window_size:
                        self._opened_at = self.clock()
                        self._epoch += 1
                raise
            if self._opened_at is None and epoch == self._epoch:
                self._window.append(False)
            return result
        if self.state == "open" or self._gate.locked():
            raise CircuitOpenError("payments", max(0.0, self._opened_at + self.cooldown - self.clock()))
        async with self._gate:
            try:
                result = await fn()
            except Exception as err:
                if self.is_failure(err):
                    self._opened_at = self.clock()
                    raise
                result = None
                error = err
            else:
                error = None
            self._opened_at = None
            self._window.clear()
            self._epoch += 1
            if error is not None:
                raise error
            return result
"""
)

SOLUTION_BREAKER = answer_cell("circuit_breaker")


def breaker_mutant(old: str, new: str, source: str = SOLUTION_BREAKER) -> str:
    assert old in source, f"mutation target not found: {old!r}"
    return source.replace(old, new)


NO_HALF_OPEN = breaker_mutant(
    """            self.state = "half-open"
        probe = self.state == "half-open\"""",
    """            self.state = "closed"
            self.window.clear()
        probe = False""",
)

COUNTS_4XX = breaker_mutant("failed=self.is_failure(err)", "failed=True")

ADMITS_EVERYONE_IN_HALF_OPEN = breaker_mutant(
    """            if self.probing:  # one probe at a time; everyone else still fails fast
                raise CircuitOpenError("payments", 1.0, reason="half-open")
""",
    "",
)

NEVER_RESETS_COUNTS = breaker_mutant(
    "                self.window.clear()  # a fresh start: old failures must not count again\n", ""
).replace(
    """        self.opened_at = self.clock()
        self.window.clear()""",
    """        self.opened_at = self.clock()""",
)

CALLS_FN_WHILE_OPEN = breaker_mutant(
    """            if now - self.opened_at < self.cooldown:
                raise""",
    """            if now - self.opened_at < self.cooldown:
                try:
                    await fn()  # "just to see if it is back"
                except Exception:
                    pass
                raise""",
)

WALL_CLOCK = breaker_mutant("now = self.clock()", "now = time.monotonic()").replace(
    "self.opened_at = self.clock()", "self.opened_at = time.monotonic()"
)

STALE_COOLDOWN = breaker_mutant(
    """            if failed:
                self._open()""",
    """            if failed:
                self.state = "open"  # back to open, but keeps the first opening time""",
)

IGNORES_NON_FAILURES = breaker_mutant(
    """            self._record(failed=self.is_failure(err), probe=probe, generation=generation)""",
    """            if self.is_failure(err) or probe:  # "a 404 tells us nothing": left out of the window
                self._record(failed=self.is_failure(err), probe=probe, generation=generation)""",
)

LATE_SUCCESS_CLOSES = breaker_mutant(
    """        if self.state != "closed" or generation != self.generation:
            return  # a call that started before the breaker opened (or before it closed again)""",
    """        if self.state != "closed":
            if not failed:  # "it worked, so payments is back"
                self.state = "closed"
                self.window.clear()
            return""",
)

# knows a call is stale only while the breaker is not closed: one that ends after a probe closed it counts again
LATE_FAILURE_IN_FRESH_WINDOW = breaker_mutant(
    """        if self.state != "closed" or generation != self.generation:""",
    """        if self.state != "closed":""",
)

# "the probe got an error, so payments is not back": a 404 answer reopens the breaker
PROBE_404_REOPENS = breaker_mutant(
    """            self._record(failed=self.is_failure(err), probe=probe, generation=generation)""",
    """            self._record(failed=self.is_failure(err) or probe, probe=probe, generation=generation)""",
)

# clears the probe flag on Exception only: a cancelled probe leaves the breaker half-open, rejecting everyone
CANCELLED_PROBE_WEDGES = breaker_mutant(
    """        except BaseException:  # cancelled: no verdict, let the next caller probe
            if probe:
                self.probing = False
            raise
""",
    "",
)

COPIED_SKETCH = """
from course.chapters.ch02 import SketchBreaker as _Sketch


class CircuitBreaker(_Sketch):
    def __init__(self, threshold=0.5, window_size=10, cooldown=30.0, *, clock=None, is_failure=None):
        super().__init__(threshold, window_size, cooldown, clock=clock)
"""


def test_breaker_stub_scores_zero_with_not_done():
    stub = re.sub(r"### BEGIN SOLUTION.*?### END SOLUTION", "raise NotImplementedError()", SOLUTION_BREAKER, flags=re.S)
    res = assert_rejected("circuit_breaker", stub)
    assert "not done yet" in res.text()


# ----------------------------------------------------------------------------- bulkhead

SOLUTION_BULKHEAD = answer_cell("bulkhead")

BULKHEAD_HEAD = """
import asyncio

from course.bulkhead import BulkheadFullError
"""

CONDITION_VARIANT = (
    BULKHEAD_HEAD
    + """
class Bulkhead:
    def __init__(self, limit: int, max_queue: int = 0):
        self.limit, self.max_queue = limit, max_queue
        self.running = self.waiting = 0
        self.cond = asyncio.Condition()

    async def call(self, fn):
        if self.running + self.waiting >= self.limit + self.max_queue:
            raise BulkheadFullError("b", self.limit, self.max_queue)
        self.waiting += 1
        try:
            async with self.cond:
                await self.cond.wait_for(lambda: self.running < self.limit)
                self.running += 1
        finally:
            self.waiting -= 1
        try:
            return await fn()
        finally:
            self.running -= 1
            async with self.cond:
                self.cond.notify_all()
"""
)

FUTURES_QUEUE_VARIANT = (
    BULKHEAD_HEAD
    + """
from collections import deque


class Bulkhead:
    # a hand-off semaphore (each release hands the slot to the next waiter), with cancellation handled
    def __init__(self, limit: int, max_queue: int = 0):
        self.free, self.max_queue = limit, max_queue
        self.queue = deque()

    async def call(self, fn):
        if self.free > 0:
            self.free -= 1
        elif len(self.queue) < self.max_queue:
            fut = asyncio.get_running_loop().create_future()
            self.queue.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release()  # we were handed a permit just as we were cancelled
                else:
                    self.queue.remove(fut)
                raise
        else:
            raise BulkheadFullError("b", 0, self.max_queue)
        try:
            return await fn()
        finally:
            self._release()

    def _release(self):
        while self.queue:
            fut = self.queue.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the permit straight to the next waiter
                return
        self.free += 1
"""
)


def bulkhead_mutant(old: str, new: str) -> str:
    assert old in SOLUTION_BULKHEAD, f"mutation target not found: {old!r}"
    return SOLUTION_BULKHEAD.replace(old, new)


COUNTER_BULKHEAD = (
    BULKHEAD_HEAD
    + """
class Bulkhead:
    def __init__(self, limit: int, max_queue: int = 0):
        self.limit, self.max_queue = limit, max_queue
        self.running = self.waiting = 0
        self.freed = asyncio.Event()

    async def _acquire(self):
        if self.running + self.waiting >= self.limit + self.max_queue:
            raise BulkheadFullError("b", self.limit, self.max_queue)
        self.waiting += 1
        while self.running >= self.limit:
            self.freed.clear()
            await self.freed.wait()
        self.waiting -= 1
        self.running += 1

    def _release(self):
        self.running -= 1
        self.freed.set()
"""
)

LEAKS_ON_EXCEPTION = (
    COUNTER_BULKHEAD
    + """
    async def call(self, fn):
        await self._acquire()
        result = await fn()
        self._release()  # never reached when fn raises
        return result
"""
)

LEAKS_ON_CANCELLED_RUNNING = (
    COUNTER_BULKHEAD
    + """
    async def call(self, fn):
        await self._acquire()
        try:
            result = await fn()
        except Exception:
            self._release()  # CancelledError is a BaseException: not caught here
            raise
        self._release()
        return result
"""
)

LEAKS_ON_CANCELLED_WAITING = (
    COUNTER_BULKHEAD
    + """
    async def call(self, fn):
        await self._acquire()  # a waiter cancelled inside _acquire never gives back its place in the queue
        try:
            return await fn()
        finally:
            self._release()
"""
)

UNBOUNDED_QUEUE = bulkhead_mutant(
    """        if self.admitted >= self.limit + self.max_queue:
            raise BulkheadFullError("bulkhead", self.limit, self.max_queue)
""",
    "",
)

SHARED_PERMITS = (
    BULKHEAD_HEAD
    + """
_semaphores = {}  # "reuse" one semaphore per size: bulkheads of the same size share permits


class Bulkhead:
    def __init__(self, limit: int, max_queue: int = 0):
        self.limit, self.max_queue = limit, max_queue
        self.slots = _semaphores.setdefault(limit, asyncio.Semaphore(limit))
        self.admitted = 0

    async def call(self, fn):
        if self.admitted >= self.limit + self.max_queue:
            raise BulkheadFullError("b", self.limit, self.max_queue)
        self.admitted += 1
        try:
            async with self.slots:
                return await fn()
        finally:
            self.admitted -= 1
"""
)


CONSECUTIVE_FAILURES = breaker_mutant(
    """        self.window.append(failed)
        if failed and len(self.window) >= self.window_size and sum(self.window) / len(self.window) >= self.threshold:
            self._open()""",
    """        self.window.append(failed)
        if not failed:
            self.window.clear()  # "a success resets the failure count"
        elif len(self.window) >= self.threshold * self.window_size:
            self._open()""",
)

TRIPS_BEFORE_THE_WINDOW_FILLS = breaker_mutant(
    "if failed and len(self.window) >= self.window_size and sum(self.window)",
    "if failed and sum(self.window)",
)

WRAPS_ERRORS = breaker_mutant(
    """            self._record(failed=self.is_failure(err), probe=probe, generation=generation)
            raise
""",
    """            self._record(failed=self.is_failure(err), probe=probe, generation=generation)
            raise RuntimeError(f"payments call failed: {err}") from err
""",
)

OWN_OPEN_ERROR = breaker_mutant(
    """                raise CircuitOpenError("payments", self.opened_at + self.cooldown - now)""",
    """                raise RuntimeError("circuit open")""",
)

SWALLOWS_NON_FAILURES = breaker_mutant(
    """            self._record(failed=self.is_failure(err), probe=probe, generation=generation)
            raise
""",
    """            self._record(failed=self.is_failure(err), probe=probe, generation=generation)
            if self.is_failure(err):
                raise
            return None  # "a 404 is not an outage": answered with nothing
""",
)

CANCELS_CALLS_IN_FLIGHT = (
    breaker_mutant(
        """        try:
            result = await fn()""",
        """        task = asyncio.ensure_future(fn())
        self.__dict__.setdefault("in_flight", set()).add(task)
        try:
            result = await task""",
    )
    .replace(
        """    def _open(self):
        self.state = "open\"""",
        """    def _open(self):
        for task in self.__dict__.get("in_flight", set()):
            task.cancel()  # "stop wasting time on a dead dependency"
        self.state = "open\"""",
    )
    .replace("import time\n", "import asyncio\nimport time\n", 1)
)

UPPERCASE_STATE = (
    SOLUTION_BREAKER.replace('self.state = "closed"', 'self.state = "CLOSED"')
    .replace('self.state = "open"', 'self.state = "OPEN"')
    .replace('self.state = "half-open"', 'self.state = "HALF_OPEN"')
    .replace('self.state == "open"', 'self.state == "OPEN"')
    .replace('self.state == "half-open"', 'self.state == "HALF_OPEN"')
    .replace('self.state != "closed"', 'self.state != "CLOSED"')
)

BULKHEAD_WRAPS_ERRORS = bulkhead_mutant(
    """            async with self.slots:  # released on success, error and cancellation alike
                return await fn()""",
    """            async with self.slots:  # released on success, error and cancellation alike
                try:
                    return await fn()
                except Exception as err:
                    raise RuntimeError(f"call failed: {err}") from err""",
)

BULKHEAD_WAITS_INSTEAD_OF_REJECTING = bulkhead_mutant(
    """        if self.admitted >= self.limit + self.max_queue:
            raise BulkheadFullError("bulkhead", self.limit, self.max_queue)
""",
    """        while self.admitted >= self.limit + self.max_queue:
            await asyncio.sleep(0.01)  # "wait for room rather than fail"
""",
)

BULKHEAD_LIMIT_OFF_BY_ONE = bulkhead_mutant(
    "self.slots = asyncio.Semaphore(limit)", "self.slots = asyncio.Semaphore(limit + 1)"
)

BULKHEAD_OWN_ERROR = bulkhead_mutant(
    'raise BulkheadFullError("bulkhead", self.limit, self.max_queue)', 'raise RuntimeError("bulkhead full")'
)


HALF_OPEN_DECIDED_BY_ANY_CALL = """
import time
from collections import deque
from course.breaker import CircuitOpenError, counts_as_failure


class CircuitBreaker:
    # wrong: whichever call finishes while half-open decides (an old in-flight call can close it)
    def __init__(self, threshold=0.5, window_size=10, cooldown=30.0, *, clock=time.monotonic, is_failure=counts_as_failure):
        self.threshold, self.window_size, self.cooldown = threshold, window_size, cooldown
        self.clock, self.is_failure = clock, is_failure
        self.state = "closed"
        self.window = deque(maxlen=window_size)
        self.opened_at = 0.0
        self.probing = False

    async def call(self, fn):
        if self.state == "open":
            if self.clock() - self.opened_at < self.cooldown:
                raise CircuitOpenError()
            self.state = "half-open"
            self.probing = False
        if self.state == "half-open":
            if self.probing:
                raise CircuitOpenError()
            self.probing = True
        try:
            result = await fn()
        except Exception as err:
            self._on_result(self.is_failure(err))
            raise
        self._on_result(False)
        return result

    def _on_result(self, failed):
        if self.state == "half-open":
            self.probing = False
            if failed:
                self._open()
            else:
                self.window.clear()
                self.state = "closed"
            return
        if self.state == "open":
            return
        self.window.append(failed)
        if len(self.window) >= self.window_size and sum(self.window) / len(self.window) >= self.threshold:
            self._open()

    def _open(self):
        self.state = "open"
        self.opened_at = self.clock()
        self.window.clear()
"""


WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "circuit_breaker": {
        "no half-open": (NO_HALF_OPEN, "half-open"),
        "counts 4xx": (COUNTS_4XX, "404"),
        "admits everyone in half-open": (ADMITS_EVERYONE_IN_HALF_OPEN, "let through"),
        "never resets counts": (NEVER_RESETS_COUNTS, "counting afresh"),
        "calls fn while open": (CALLS_FN_WHILE_OPEN, "into the 10 s cooldown"),
        "reads the wall clock": (WALL_CLOCK, "clock="),
        "failed probe keeps the old cooldown": (STALE_COOLDOWN, "fresh"),
        "copied typescript sketch": (COPIED_SKETCH, "failure rate over the last window_size"),
        "leaves 404s out of the window": (IGNORES_NON_FAILURES, "count as successes"),
        "a late success closes an open breaker": (LATE_SUCCESS_CLOSES, "in flight"),
        "any call that ends in half-open decides": (HALF_OPEN_DECIDED_BY_ANY_CALL, "Only the probe's outcome"),
        "a late failure counts in the fresh window": (LATE_FAILURE_IN_FRESH_WINDOW, "closed again when it ends"),
        "a probe answered 404 reopens it": (PROBE_404_REOPENS, "for a probe too"),
        "a cancelled probe wedges half-open": (CANCELLED_PROBE_WEDGES, "a cancelled probe decides nothing"),
        "consecutive failures instead of a rate": (CONSECUTIVE_FAILURES, "failure rate over the last window_size"),
        "trips before the window fills": (TRIPS_BEFORE_THE_WINDOW_FILLS, "only once window_size (10) calls"),
        "wraps the dependency's errors": (WRAPS_ERRORS, "wrapped or replaced"),
        "rejects with its own error type": (OWN_OPEN_ERROR, "Reject with CircuitOpenError"),
        "swallows a 404": (SWALLOWS_NON_FAILURES, "0 raised the 404"),
        "cancels calls in flight when it opens": (CANCELS_CALLS_IN_FLIGHT, "was cancelled"),
        "uppercase state names": (UPPERCASE_STATE, "expected 'closed'"),
        "the reference class": ("from course.breaker import CircuitBreaker", "write your own"),
    },
    "bulkhead": {
        "leaks on exception": (LEAKS_ON_EXCEPTION, "leaks on an error"),
        "leaks on a cancelled running call": (LEAKS_ON_CANCELLED_RUNNING, "CancelledError is a BaseException"),
        "leaks on a cancelled waiting call": (LEAKS_ON_CANCELLED_WAITING, "cancelled waiter must give its place back"),
        "unbounded queue": (UNBOUNDED_QUEUE, "unbounded queue"),
        "waits for room instead of rejecting": (BULKHEAD_WAITS_INSTEAD_OF_REJECTING, "unbounded queue"),
        "permits shared between bulkheads": (SHARED_PERMITS, "must not share permits"),
        "wraps fn's errors": (BULKHEAD_WRAPS_ERRORS, "propagate unchanged"),
        "one call too many at once": (BULKHEAD_LIMIT_OFF_BY_ONE, "at most limit calls"),
        "rejects with its own error type": (BULKHEAD_OWN_ERROR, "raises BulkheadFullError"),
        "the reference class": ("from course.bulkhead import Bulkhead", "write your own"),
    },
}

CORRECT: dict[str, dict[str, str]] = {
    "circuit_breaker": {"solution": SOLUTION_BREAKER, "ring buffer": RING_BUFFER, "asyncio lock gate": LOCK_GATE},
    "bulkhead": {
        "solution": SOLUTION_BULKHEAD,
        "counter and condition": CONDITION_VARIANT,
        "hand-off futures": FUTURES_QUEUE_VARIANT,
    },
}


@pytest.mark.parametrize(("task_id", "source", "mentions"), wrong_params(WRONG))
def test_02_wrong_answers_are_rejected_for_their_mistake(task_id, source, mentions):
    assert_rejected(task_id, source, mentions=mentions)


@pytest.mark.parametrize(("task_id", "source"), correct_params(CORRECT))
def test_02_correct_answers_get_full_marks(task_id, source):
    assert_accepted(task_id, source)


def test_verdicts_are_identical_run_after_run():
    for task_id, source in [("circuit_breaker", STALE_COOLDOWN), ("bulkhead", LEAKS_ON_CANCELLED_WAITING)]:
        texts = {run_source(task_id, source).text() for _ in range(3)}
        assert len(texts) == 1, texts


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_course_check_scores_wrong_answers_below_full_marks(tmp_path):
    from autograder.check import check

    answers = {"circuit_breaker": ADMITS_EVERYONE_IN_HALF_OPEN, "bulkhead": LEAKS_ON_CANCELLED_RUNNING}
    path = notebook_with_answers("02_circuit_breakers_and_bulkheads", answers, tmp_path)
    res = check(path)
    scores = {t.id: t.points for t in res.tasks}
    assert scores == {"circuit_breaker": 0.0, "bulkhead": 0.0}, scores
    shutil.rmtree(tmp_path, ignore_errors=True)
