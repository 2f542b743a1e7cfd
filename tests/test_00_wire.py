"""The wire between the grader and a learner's process (autograder/wire.py), on its own.

A real second process (a learner process without a sandbox, as `course check` runs one where no
bubblewrap works) serves an answer cell; the test side plays the grader with the grader's policy.
Each test is one promise of the protocol: calls read as calls, errors come back as errors of the
right class (the very object, when it was the grader's), callbacks and cancellation cross both
ways, the grader's objects offer learner code only what the policy lets it use, and nothing the
other side sends can crash the grader.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import socket
import subprocess
import sys
import textwrap

import pytest

from autograder import wire
from autograder.policy import GraderPolicy
from course.kit.faults import DependencyError, VirtualClock

ANSWER = textwrap.dedent(
    """
    import asyncio
    import psycopg

    def add(a, b):
        return a + b

    async def with_retry(fn, attempts, sleep, rand):
        for i in range(attempts):
            try:
                return await fn()
            except Exception:
                if i == attempts - 1:
                    raise
                await sleep(rand() * 2**i)

    class Ring:
        def __init__(self, nodes):
            self.nodes = list(nodes)
        def node_for(self, key):
            return self.nodes[sum(key.encode()) % len(self.nodes)]
        def __len__(self):
            return len(self.nodes)
        async def aget(self, key, cb):
            return cb(key) + 1

    class Refusal(Exception):
        def __str__(self):
            return "refused: " + self.args[0]

    def refuse():
        raise Refusal("no")

    def unique():
        raise psycopg.errors.UniqueViolation("duplicate key")

    async def hang_then_see(fn):
        try:
            await fn()
        finally:
            seen.append("cancelled")

    seen = []

    def peek(clock):
        return clock.advance

    async def wrap(err_factory):
        try:
            await err_factory()
        except Exception as e:
            raise RuntimeError("wrapped") from e

    def sync_loop_free():
        return asyncio.run(asyncio.sleep(0, result="own loop"))

    async def fill(stack, items):
        for item in items:
            stack.push(item)
        stack.push("y").push("z")
        return await stack.execute()

    async def at_once(stack):
        stack.now = True
        return await stack.push(21)
    """
)


class Stack:
    """A pipeline in miniature: ``push`` queues and returns the stack, or runs at once (WATCH mode)."""

    def __init__(self) -> None:
        self.items: list = []
        self.now = False

    def push(self, item):
        if item == "boom":
            raise ValueError("boom")
        if self.now:
            return self._double(item)
        self.items.append(item)
        return self

    async def _double(self, item):
        return item * 2

    async def execute(self) -> list:
        return list(self.items)


class StackPolicy(wire.Policy):
    def chains(self, obj, name, function) -> bool:
        return isinstance(obj, Stack) and name == "push"


@pytest.fixture
def learner():
    """A learner process serving ANSWER; yields the grader's end of the wire."""
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "autograder.learner", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        env={"PATH": "/usr/bin:/bin", "COURSE_LEARNER": json.dumps({}), "PYTHONPATH": sys.path[0] or "."},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    theirs.close()
    conn = wire.Conn(ours, object(), GraderPolicy(), name="test-grader")
    root = conn.root()
    root._meta = {"k": "obj", "t": ["", "Root"], "m": {"exec_cell": True, "get": False}, "d": []}

    async def boot():
        got = await root.exec_cell("answer", "t", ANSWER)
        assert got["ok"], got

    asyncio.run(boot())
    yield conn, root
    conn.close()
    proc.kill()
    proc.wait(10)


def test_functions_classes_and_methods_read_as_calls(learner):
    _, root = learner
    assert root.get("add")(2, 3) == 5
    ring = root.get("Ring")(["a", "b", "c"])
    assert type(ring).__name__ == "Ring" and len(ring) == 3
    assert ring.nodes == ["a", "b", "c"]  # an attribute that is data crosses as data
    assert ring.node_for("x") in "abc"
    assert wire.each(ring.node_for, ["x", "y", "z"]) == [ring.node_for(k) for k in "xyz"]  # one round trip
    assert [p.name for p in inspect.signature(root.get("with_retry")).parameters.values()] == [
        "fn",
        "attempts",
        "sleep",
        "rand",
    ]


def test_callbacks_cross_both_ways_on_injected_time(learner):
    _, root = learner

    async def run():
        clock = VirtualClock()
        calls = []

        async def flaky():
            calls.append(clock())
            if len(calls) < 3:
                raise DependencyError(503)
            return "ok"

        got = await root.get("with_retry")(flaky, 5, clock.sleep, lambda: 0.5)
        return got, clock.sleeps, calls, await root.get("Ring")(["a"]).aget(3, lambda k: k * 10)

    assert asyncio.run(run()) == ("ok", [0.5, 1.0], [0.0, 0.5, 1.5], 31)


def test_an_error_comes_back_of_its_class_with_its_text_and_the_graders_own_as_itself(learner):
    _, root = learner
    with pytest.raises(Exception) as caught:
        root.get("refuse")()
    assert type(caught.value).__name__ == "Refusal" and str(caught.value) == "refused: no"
    import psycopg

    with pytest.raises(psycopg.errors.UniqueViolation, match="duplicate key"):
        root.get("unique")()
    mine = DependencyError(503)

    async def fail():
        raise mine

    async def run():
        try:
            await root.get("wrap")(fail)
        except RuntimeError as err:
            return err

    err = asyncio.run(run())
    assert str(err) == "wrapped" and err.__cause__ is mine  # the grader's error, returned as itself


def test_cancelling_a_call_reaches_the_learners_code(learner):
    _, root = learner

    async def run():
        hang = asyncio.Event()

        async def forever():
            await hang.wait()

        task = asyncio.ensure_future(root.get("hang_then_see")(forever))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert root.get("seen") == ["cancelled"]


def test_a_call_made_off_any_event_loop_is_served_off_one(learner):
    _, root = learner
    assert asyncio.run(asyncio.to_thread(root.get("sync_loop_free"))) == "own loop"


def test_the_graders_objects_offer_only_what_the_policy_opens(learner):
    _, root = learner
    with pytest.raises(wire.Refused, match="advance is not open"):
        root.get("peek")(VirtualClock())


def test_context_variables_follow_a_callback_across(learner):
    _, root = learner
    where = contextvars.ContextVar("where", default="outside")

    async def run():
        where.set("inside the check")
        return await root.get("Ring")(["a"]).aget(1, lambda k: len(where.get()))

    assert asyncio.run(run()) == len("inside the check") + 1  # the callback ran in the caller's context


def test_a_chained_call_goes_without_a_wait_and_its_answer_comes_when_asked(learner):
    """A pipeline's commands return the pipeline: 500 of them are sent without a round trip each, the
    answer of one that ran at once (WATCH mode) comes when awaited, and an error with the next call."""
    conn, root = learner
    conn.policy = StackPolicy()

    async def run():
        stack = Stack()
        before = conn.sent
        assert await root.get("fill")(stack, list(range(500))) == [*range(500), "y", "z"]
        assert conn.sent - before < 10, conn.sent - before  # the 502 pushes were answered by none
        assert await root.get("at_once")(Stack()) == 42
        with pytest.raises(ValueError, match="boom"):
            await root.get("fill")(Stack(), [1, "boom", 2])

    asyncio.run(run())


def test_garbage_from_the_other_side_ends_that_connection_only():
    ours, theirs = socket.socketpair()
    conn = wire.Conn(ours, object(), GraderPolicy(), name="test-grader")
    theirs.sendall(b"\x00\x00\x00\x05{oops")
    theirs.close()
    for _ in range(200):
        if not conn.alive:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert not conn.alive and "protocol" in (conn.error or "") or "closed" in (conn.error or "")
    with pytest.raises(wire.WireError):
        conn.root()._conn.call_sync(wire.ROOT, "method", "get", ("x",), {})
