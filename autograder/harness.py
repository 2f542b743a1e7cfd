"""The grading harness: runs a task's checks on a learner's code and explains the verdict.

A chapter's checks live in ``autograder/checks/chNN.py`` and register themselves with
:func:`task`. Notebooks call into them with one line, so nbgrader's feedback (which shows
test cells word for word) shows the call, not the checks:

    grade("with_retry")        # hidden test cell: full, partial or zero points
    public("with_retry")       # visible test cell: a quick subset, never the whole grade
    selfcheck("01")            # run every task of a chapter from inside the notebook

Each check runs in its own thread and event loop under a hard wall-clock limit, so code
that loops forever, sleeps for real or swallows KeyboardInterrupt costs that task its
points and nothing else. Checks never sleep real seconds: time is a VirtualClock and any
randomness comes from a seed that the report prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import io
import os
import random
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

PUBLIC_PASSED = "public checks passed; hidden checks run at grading"


@dataclass
class Task:
    id: str
    chapter: str
    points: float
    check: Callable
    needs: tuple[str, ...]
    title: str
    timeout: float = 30.0
    partial: bool = False
    seed: int = 0


REGISTRY: dict[str, Task] = {}

#: chapter number -> module with its checks (imported on demand)
CHAPTER_MODULES = {
    "00": "autograder.checks.ch00",
    "01": "autograder.checks.ch01",
    "02": "autograder.checks.ch02",
    "03": "autograder.checks.ch03",
    "04": "autograder.checks.ch04",
}


def task(
    task_id: str,
    *,
    chapter: str,
    points: float,
    title: str,
    needs: tuple[str, ...] | None = None,
    timeout: float = 30.0,
    partial: bool = False,
    seed: int = 0,
):
    """Register ``async def check(r: Report, *needed)`` as the grader of ``task_id``."""

    def register(fn: Callable) -> Callable:
        if task_id in REGISTRY and REGISTRY[task_id].check.__qualname__ != fn.__qualname__:
            raise ValueError(f"task id {task_id!r} registered twice")
        REGISTRY[task_id] = Task(task_id, chapter, points, fn, needs or (task_id,), title, timeout, partial, seed)
        return fn

    return register


def load_chapter(chapter: str) -> list[Task]:
    """The tasks of a chapter, in the order the chapter registers them."""
    module = CHAPTER_MODULES.get(chapter)
    if module is None:
        raise KeyError(f"no chapter {chapter!r}; known: {', '.join(CHAPTER_MODULES)}")
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module:
            return []
        raise
    return [t for t in REGISTRY.values() if t.chapter == chapter]


def get_task(task_id: str) -> Task:
    if task_id not in REGISTRY:
        for chapter in CHAPTER_MODULES:
            load_chapter(chapter)
            if task_id in REGISTRY:
                break
    if task_id not in REGISTRY:
        raise KeyError(f"no graded task {task_id!r}")
    return REGISTRY[task_id]


# ----------------------------------------------------------------------------- reports


class Stop(Exception):
    """Raised by :meth:`Report.fail` to end an all-or-nothing check at its first failure."""


@dataclass
class Report:
    """What a check did and saw. Lines read like a lab notebook, one per observation."""

    task: Task
    public: bool = False
    lines: list[str] = field(default_factory=list)
    failures: int = 0
    fraction: float | None = None  # set by partial-credit checks
    random: random.Random = field(default_factory=random.Random)

    def note(self, msg: str) -> None:
        self.lines.append(f"  - {msg}")

    def ok(self, msg: str) -> None:
        self.lines.append(f"  [ok] {msg}")

    def fail(self, msg: str, *, stop: bool = True) -> None:
        self.failures += 1
        self.lines.append(f"  [FAIL] {msg}")
        if stop:
            raise Stop(msg)

    def expect(self, cond: bool, msg: str, *, stop: bool = True) -> bool:
        if cond:
            self.ok(msg)
        else:
            self.fail(msg, stop=stop)
        return bool(cond)


@dataclass
class Result:
    task: str
    points: float
    max_points: float
    lines: list[str]
    seconds: float

    @property
    def passed(self) -> bool:
        return self.points >= self.max_points

    def text(self) -> str:
        head = f"{self.task}: {self.points:g}/{self.max_points:g} points"
        return "\n".join([head, *self.lines])


def error_line(err: BaseException, limit: int | None = None) -> str:
    """``TypeName: first line of the message`` (cut to ``limit`` characters), for check reports."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(err).__name__}{': ' + text if text else ''}"


def _describe(err: BaseException) -> str:
    """One line for an exception raised by learner code: type, message and where."""
    where = ""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if "autograder" not in frame.filename and "site-packages" not in frame.filename:
            where = f" (line {frame.lineno}: {frame.line.strip() if frame.line else ''})"
            break
    text = str(err)
    return f"{type(err).__name__}{': ' + text if text else ''}{where}"


class _Abandoned(BaseException):
    """Injected into a check thread that outlived its limit, to stop it spinning."""


def _stop_thread(worker: threading.Thread, seconds: float = 2.0) -> None:
    """Keep raising :class:`_Abandoned` in ``worker`` until it ends (or ``seconds`` pass).

    A loop that swallows every exception catches most of them, but sooner or later one
    lands outside its ``try``. A thread blocked in C (a long ``time.sleep``) ends later.
    """
    import ctypes

    deadline = time.monotonic() + seconds
    while worker.is_alive() and time.monotonic() < deadline:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(_Abandoned))
        worker.join(0.01)
    if worker.is_alive():  # clear the pending exception we may have left behind
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), None)


def run_task(t: Task, namespace: dict, *, public: bool = False) -> Result:
    """Run one task's check against names taken from ``namespace``; never raises."""
    start = time.perf_counter()
    r = Report(t, public=public, random=random.Random(t.seed))
    missing = [name for name in t.needs if name not in namespace]
    if missing:
        r.fail(f"{', '.join(missing)} is not defined: run the cell that defines it, then this one", stop=False)
        return Result(t.id, 0.0, t.points, r.lines, 0.0)
    args = [namespace[name] for name in t.needs]
    if not public and t.seed:
        r.note(f"randomness seeded with {t.seed}")

    outcome: dict = {}

    def body() -> None:
        loop = asyncio.new_event_loop()
        try:
            result = t.check(r, *args)
            if inspect.isawaitable(result):
                loop.run_until_complete(asyncio.wait_for(result, t.timeout))
            outcome["done"] = True
        except Stop:
            outcome["done"] = True
        except _Abandoned:
            outcome["abandoned"] = True
        except (asyncio.TimeoutError, TimeoutError) as err:
            outcome["error"] = err
            outcome["timeout"] = True
        except NotImplementedError as err:
            outcome["error"] = err
            outcome["not_done"] = True
        except BaseException as err:  # noqa: BLE001 - learner code may raise anything
            outcome["error"] = err
        finally:
            with contextlib.suppress(Exception):
                pending = [x for x in asyncio.all_tasks(loop) if not x.done()]
                for x in pending:
                    x.cancel()
                loop.run_until_complete(asyncio.wait(pending, timeout=2)) if pending else None
            with contextlib.suppress(Exception):
                loop.close()

    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")
        worker = threading.Thread(target=body, name=f"check-{t.id}", daemon=True)
        worker.start()
        worker.join(t.timeout + 2)
        if worker.is_alive():
            _stop_thread(worker)
    if worker.is_alive() or outcome.get("abandoned"):
        r.fail(
            f"cut after {t.timeout + 2:g} s: the code under test did not return. Does it loop forever, "
            "sleep for real instead of awaiting the injected sleep, or swallow cancellation?",
            stop=False,
        )
    elif outcome.get("not_done"):
        r.fail(f"not done yet: {', '.join(t.needs)} raises NotImplementedError", stop=False)
    elif outcome.get("timeout"):
        r.fail(
            f"cut after {t.timeout:g} s (virtual time is instant, so something waited on real time or never finished)",
            stop=False,
        )
    elif "error" in outcome:
        r.fail(f"your code raised {_describe(outcome['error'])}", stop=False)

    cut = worker.is_alive() or outcome.get("abandoned")
    if t.partial and r.fraction is not None and not cut and "error" not in outcome:
        points = round(t.points * max(0.0, min(1.0, r.fraction)), 2)
    else:
        points = t.points if r.failures == 0 and not cut else 0.0
    return Result(t.id, points, t.points, r.lines, time.perf_counter() - start)


# ----------------------------------------------------------------------------- notebook entry points


class TaskFailed(AssertionError):
    """A task fell short; shown in the notebook as a short message, not a traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"TaskFailed: {self}"]


def _caller_namespace(depth: int = 2) -> dict:
    frame = sys._getframe(depth)
    return frame.f_globals


def grade(task_id: str, namespace: dict | None = None):
    """Grade one task (hidden test cells). Prints the report; partial credit as the cell value."""
    ns = namespace if namespace is not None else _caller_namespace()
    t = get_task(task_id)
    res = run_task(t, ns)
    print(res.text())
    if res.passed:
        return None
    if t.partial and res.points > 0:
        return res.points  # nbgrader reads a number in the cell's output as partial credit
    raise TaskFailed(f"{task_id}: {res.points:g}/{res.max_points:g} points (see the lines above)")


def public(task_id: str, namespace: dict | None = None) -> None:
    """The visible checks of a task: a quick subset of the graded ones."""
    ns = namespace if namespace is not None else _caller_namespace()
    t = get_task(task_id)
    res = run_task(t, ns, public=True)
    print("\n".join(res.lines))
    if res.passed:
        print(f"{task_id}: {PUBLIC_PASSED}")
        return
    raise TaskFailed(f"{task_id}: a public check failed (see the lines above)")


def selfcheck(chapter: str, namespace: dict | None = None) -> list[Result]:
    """Run every graded check of a chapter on this notebook's code and print a summary."""
    ns = namespace if namespace is not None else _caller_namespace()
    if os.environ.get("NBGRADER_EXECUTION") in ("autograde", "validate"):
        print("selfcheck: skipped while nbgrader grades this notebook (the test cells above are the grade)")
        return []
    results = [run_task(t, ns) for t in load_chapter(chapter)]
    for res in results:
        print(res.text())
        print()
    total = sum(r.points for r in results)
    top = sum(r.max_points for r in results)
    for res in results:
        status = "done" if res.passed else "not done"
        print(f"{'[ok]  ' if res.passed else '[..]  '}{res.task:<24} {res.points:>5g}/{res.max_points:<4g} {status}")
    print(f"total: {total:g}/{top:g}")
    return results
