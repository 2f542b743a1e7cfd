"""Chapter 02 grading: the checks accept correct breakers and bulkheads and reject the usual wrong ones."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.helpers import assert_accepted, assert_rejected, notebook_with_answers, run_source

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

    def _reset(self):
        self.ring, self.pos, self.seen = [False] * self.size, 0, 0

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
        try:
            result = await fn()
        except Exception as err:
            if self.state == "closed":
                self._note(self.is_failure(err))
            raise
        if self.state == "closed":
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

    @property
    def state(self):
        if self._opened_at is None:
            return "closed"
        if self._gate.locked() or self.clock() - self._opened_at >= self.cooldown:
            return "half-open"
        return "open"

    async def call(self, fn):
        if self._opened_at is None:
            try:
                result = await fn()
            except Exception as err:
                if self._opened_at is None:
                    self._window.append(self.is_failure(err))
                    if len(self._window) == self.window_size and sum(self._window) >= self.threshold * self.window_size:
                        self._opened_at = self.clock()
                raise
            if self._opened_at is None:
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
    """            self._record(failed=self.is_failure(err), probe=probe)""",
    """            if self.is_failure(err) or probe:  # "a 404 tells us nothing": left out of the window
                self._record(failed=self.is_failure(err), probe=probe)""",
)

LATE_SUCCESS_CLOSES = breaker_mutant(
    """        if self.state != "closed":
            return  # a call that started before the breaker opened""",
    """        if self.state != "closed":
            if not failed:  # "it worked, so payments is back"
                self.state = "closed"
                self.window.clear()
            return""",
)

COPIED_SKETCH = """
from course.chapters.ch02 import SketchBreaker as _Sketch


class CircuitBreaker(_Sketch):
    def __init__(self, threshold=0.5, window_size=10, cooldown=30.0, *, clock=None, is_failure=None):
        super().__init__(threshold, window_size, cooldown, clock=clock)
"""


def test_solution_notebook_breaker_passes():
    assert_accepted("circuit_breaker", SOLUTION_BREAKER)


@pytest.mark.parametrize("source", [RING_BUFFER, LOCK_GATE], ids=["ring-buffer", "asyncio-lock-gate"])
def test_correct_breaker_variants_pass(source):
    assert_accepted("circuit_breaker", source)


def test_course_reference_breaker_cannot_be_handed_in():
    assert_rejected("circuit_breaker", "from course.breaker import CircuitBreaker", mentions="write your own")


def test_a_subclass_of_the_reference_breaker_passes():
    assert_accepted(
        "circuit_breaker", "from course.breaker import CircuitBreaker as _B\nclass CircuitBreaker(_B): pass"
    )


@pytest.mark.parametrize(
    ("source", "mentions"),
    [
        (NO_HALF_OPEN, "half-open"),
        (COUNTS_4XX, "404"),
        (ADMITS_EVERYONE_IN_HALF_OPEN, "let through"),
        (NEVER_RESETS_COUNTS, "counting afresh"),
        (CALLS_FN_WHILE_OPEN, "into the 10 s cooldown"),
        (WALL_CLOCK, "clock="),
        (STALE_COOLDOWN, "fresh"),
        (COPIED_SKETCH, "let through"),
        (IGNORES_NON_FAILURES, "count as successes"),
        (LATE_SUCCESS_CLOSES, "in flight"),
    ],
    ids=[
        "no-half-open",
        "counts-4xx",
        "admits-everyone-in-half-open",
        "never-resets-counts",
        "calls-fn-while-open",
        "reads-the-wall-clock",
        "failed-probe-keeps-old-cooldown",
        "copied-typescript-sketch",
        "leaves-404s-out-of-the-window",
        "a-late-success-closes-an-open-breaker",
    ],
)
def test_wrong_breakers_are_rejected(source, mentions):
    assert_rejected("circuit_breaker", source, mentions=mentions)


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


def test_solution_notebook_bulkhead_passes():
    assert_accepted("bulkhead", SOLUTION_BULKHEAD)


@pytest.mark.parametrize(
    "source", [CONDITION_VARIANT, FUTURES_QUEUE_VARIANT], ids=["counter-and-condition", "hand-off-futures"]
)
def test_correct_bulkhead_variants_pass(source):
    assert_accepted("bulkhead", source)


def test_course_reference_bulkhead_cannot_be_handed_in():
    assert_rejected("bulkhead", "from course.bulkhead import Bulkhead", mentions="write your own")


@pytest.mark.parametrize(
    ("source", "mentions"),
    [
        (LEAKS_ON_EXCEPTION, "leaks on an error"),
        (LEAKS_ON_CANCELLED_RUNNING, "CancelledError is a BaseException"),
        (LEAKS_ON_CANCELLED_WAITING, "cancelled waiter must give its place back"),
        (UNBOUNDED_QUEUE, "unbounded queue"),
        (SHARED_PERMITS, "must not share permits"),
    ],
    ids=["leaks-on-exception", "leaks-on-cancel-running", "leaks-on-cancel-waiting", "unbounded-queue", "shared"],
)
def test_wrong_bulkheads_are_rejected(source, mentions):
    assert_rejected("bulkhead", source, mentions=mentions)


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
