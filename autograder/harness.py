"""The grading harness: runs a task's checks on a learner's code and explains the verdict.

A chapter's checks live in ``autograder/checks/chNN.py`` (a package ``autograder/checks/chNN/``
once they outgrow one file; its ``__init__`` registers the tasks) and register themselves
with :func:`task`. Notebooks call into them with one line, so nbgrader's feedback (which
shows test cells word for word) shows the call, not the checks:

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
import re
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from autograder.cellsource import cell_source as _cell_source


def cell_source(obj) -> tuple[str, str] | None:
    """``(filename, source)`` of the cell that defined ``obj`` (see :mod:`autograder.cellsource`); for an
    object of the learner's process, that process says (what a check reads to explain a failure)."""
    from autograder import wire

    if isinstance(obj, (wire.Proxy, wire.BoundMethod)):
        owner = obj._owner if isinstance(obj, wire.BoundMethod) else obj  # noqa: SLF001
        try:
            found = owner._conn.call_sync(wire.ROOT, "method", "source_of", (owner,), {})  # noqa: SLF001
        except Exception:  # noqa: BLE001 - a process that will not say: no source, as for a lost cell
            return None
        return tuple(found) if isinstance(found, (list, tuple)) and len(found) == 2 else None
    return _cell_source(obj)


PUBLIC_PASSED = "public checks passed (a smoke test, not the grade: selfcheck runs the hidden checks)"


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

#: Where chapters' checks live: ``autograder/checks/chNN.py`` registers chapter NN's tasks.
CHECKS_PACKAGE = "autograder.checks"


def _chapter_of(module: str) -> str | None:
    """``"03"`` for ``autograder.checks.ch03`` (or a module of a ``ch03`` package); None otherwise."""
    match = re.fullmatch(rf"{re.escape(CHECKS_PACKAGE)}\.ch(\d\d)(\.\w+)*", module)
    return match.group(1) if match else None


def chapters() -> list[str]:
    """Chapter numbers that have checks, found on disk (``autograder/checks/chNN.py``)."""
    import pkgutil

    package = importlib.import_module(CHECKS_PACKAGE)
    found = (_chapter_of(f"{CHECKS_PACKAGE}.{m.name}") for m in pkgutil.iter_modules(package.__path__))
    return sorted(ch for ch in found if ch)


def task(
    task_id: str,
    *,
    points: float,
    title: str,
    needs: tuple[str, ...] | None = None,
    timeout: float = 30.0,
    partial: bool = False,
    seed: int = 0,
    chapter: str | None = None,
):
    """Register ``async def check(r: Report, *needed)`` as the grader of ``task_id``.

    The chapter is the one of the module the check is written in (``checks/ch03.py`` is
    chapter 03); ``chapter=`` is only for checks defined elsewhere (the harness's own tests).
    """
    caller = sys._getframe(1).f_globals.get("__name__", "")
    chapter = chapter or _chapter_of(caller)
    if chapter is None:
        raise ValueError(f"task {task_id!r} is defined in {caller}, not in {CHECKS_PACKAGE}.chNN: pass chapter=")

    def register(fn: Callable) -> Callable:
        if task_id in REGISTRY and REGISTRY[task_id].check.__qualname__ != fn.__qualname__:
            raise ValueError(f"task id {task_id!r} registered twice")
        REGISTRY[task_id] = Task(task_id, chapter, points, fn, needs or (task_id,), title, timeout, partial, seed)
        return fn

    return register


def load_chapter(chapter: str) -> list[Task]:
    """The tasks of a chapter, in the order the chapter registers them."""
    if chapter not in chapters():
        raise KeyError(f"no chapter {chapter!r} has checks; known: {', '.join(chapters())}")
    importlib.import_module(f"{CHECKS_PACKAGE}.ch{chapter}")
    return [t for t in REGISTRY.values() if t.chapter == chapter]


def get_task(task_id: str) -> Task:
    if task_id not in REGISTRY:
        for chapter in chapters():
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
    namespace: dict = field(default_factory=dict, repr=False)  # where the learner's names were found

    def note(self, msg: str) -> None:
        self.lines.append(f"  - {msg}")

    def ok(self, msg: str) -> None:
        self.lines.append(f"  [ok] {msg}")

    def fail(self, msg: str, *, stop: bool = True) -> None:
        self.failures += 1
        self.lines.append(f"  [FAIL] {msg}")
        if stop:
            raise Stop(msg)

    def expect(self, cond: bool, msg: str, fail: str | None = None, *, stop: bool = True) -> bool:
        """``[ok] msg`` when ``cond`` holds, else ``[FAIL] fail`` (or ``msg``): one observation."""
        if cond:
            self.ok(msg)
        else:
            self.fail(fail or msg, stop=stop)
        return bool(cond)

    def replicas(self, name: str, n: int = 2) -> list:
        """``n`` independent copies of the learner's ``name``, as ``n`` service replicas.

        Each copy comes from running the answer cell that defined ``name`` again, into its
        own copy of the notebook's globals: module-level state of that cell (a dict of
        locks, a set of seen ids, a cache) is made anew for each replica, exactly as two
        processes of one service would each have their own. State that must be shared
        between replicas has to live in PostgreSQL or Redis.
        """
        remote = getattr(self.namespace, "replicas", None)
        if remote is not None:  # the learner's code runs in processes of its own: one replica per process
            return remote(name, n)
        return [replica(self.namespace, name) for _ in range(n)]


@dataclass
class Result:
    task: str
    points: float
    max_points: float
    lines: list[str]
    seconds: float
    not_done: bool = False  # the learner's answer is still the stub
    unreachable: str | None = None  # the check ended on a connection error (a server down?)

    @property
    def passed(self) -> bool:
        return self.points >= self.max_points

    def text(self) -> str:
        head = f"{self.task}: {self.points:g}/{self.max_points:g} points"
        return "\n".join([head, *self.lines])


def run_cell(source: str, namespace: dict, filename: str) -> None:
    """Run a cell's ``source`` in ``namespace`` as ``filename``, kept in :mod:`linecache`
    so tracebacks show its lines and :meth:`Report.replicas` can run it again."""
    import linecache

    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)  # noqa: S102 - the learner's answer cell


def replica(namespace: dict, name: str):
    """One fresh copy of ``namespace[name]``: its defining cell run again into a copy of the globals."""
    import ast

    found = cell_source(namespace[name])
    if found is None:
        raise LookupError(f"cannot find the cell that defined {name}; run that cell again")
    filename, source = found
    fresh = dict(namespace)
    code = compile(source, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    result = eval(code, fresh)  # noqa: S307 - the learner's own cell, run again
    if inspect.iscoroutine(result):
        result.close()
        raise LookupError(f"the cell that defines {name} awaits at top level; move the await into a function")
    if name not in fresh:
        raise LookupError(f"running the cell that defined {name} again did not define it")
    return fresh[name]


def error_line(err: BaseException, limit: int | None = None) -> str:
    """``TypeName: first line of the message`` (cut to ``limit`` characters, masked as in
    :func:`stable_text`), for check reports."""
    text = stable_text(str(err).strip().splitlines()[0]) if str(err).strip() else ""
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(err).__name__}{': ' + text if text else ''}"


# What changes from run to run in an error's text and says nothing about the mistake: object
# addresses, PostgreSQL's process and transaction numbers (a deadlock's DETAIL), and timestamps
# (a failing row's DETAIL shows its ``created_at``). Feedback must read the same on every run.
_VOLATILE = [
    (re.compile(r"\b0x[0-9a-fA-F]{5,}\b"), "0x…"),
    (re.compile(r"\b(process|transaction|relation|pid|tuple) \d+", re.IGNORECASE), r"\1 N"),
    (re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(\.\d+)?([+-]\d{2}(:?\d{2})?|Z)?"), "<timestamp>"),
]


def stable_text(text: str) -> str:
    """``text`` with what differs between runs of the same answer (see ``_VOLATILE``) masked."""
    for pattern, mask in _VOLATILE:
        text = pattern.sub(mask, text)
    return text


def _describe(err: BaseException) -> str:
    """One line for an exception raised by learner code: type, message and where; what differs
    between runs (addresses, PostgreSQL process numbers, timestamps) is masked."""
    from autograder.values import frames_of  # an error from the learner's process carries its frames as data

    where = ""
    for filename, lineno, line in reversed(frames_of(err)):
        if "autograder" not in filename and "site-packages" not in filename:
            where = f" (line {lineno}: {line.strip() if line else ''})"
            break
    text = stable_text(str(err))
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


def _unfinished(namespace, names) -> bool:
    """Is every answer ``names`` names a function still as handed out? Its check would only build its
    scenario (a database, tables, rows) to meet NotImplementedError: a learner who ran Validate on a
    half-done notebook, or a class handing in unfinished tasks, waited for that."""
    from autograder.cellsource import unfinished

    ask = getattr(namespace, "unfinished", None)  # a learner in another process answers for its own names
    try:
        if ask is not None:
            return bool(ask(names))
        return bool(names) and all(unfinished(namespace[name]) for name in names)
    except Exception:  # noqa: BLE001 - not known: the check finds out
        return False


def run_task(t: Task, namespace: dict, *, public: bool = False) -> Result:
    """Run one task's check against names taken from ``namespace``; never raises."""
    start = time.perf_counter()
    r = Report(t, public=public, random=random.Random(t.seed), namespace=namespace)
    missing = [name for name in t.needs if name not in namespace]
    if missing:
        r.fail(f"{', '.join(missing)} is not defined: run the cell that defines it, then this one", stop=False)
        return Result(t.id, 0.0, t.points, r.lines, 0.0)
    args = [namespace[name] for name in t.needs]
    if _unfinished(namespace, t.needs):  # every answer still the stub handed out: nothing to run it against
        r.fail(f"not done yet: {', '.join(t.needs)} raises NotImplementedError", stop=False)
        return Result(t.id, 0.0, t.points, r.lines, time.perf_counter() - start, not_done=True)

    outcome: dict = {}

    def body() -> None:
        loop = asyncio.new_event_loop()
        bind = getattr(namespace, "bind", None)  # a learner in another process: virtual time waits on it too
        bound = bind(loop) if bind is not None else contextlib.ExitStack()
        try:
            result = t.check(r, *args)
            if inspect.isawaitable(result):
                loop.run_until_complete(asyncio.wait_for(result, t.timeout))
            outcome["done"] = True
        except Stop as err:
            if r.failures:  # raised by Report.fail, after it counted the failure
                outcome["done"] = True
            else:  # raised by learner code (a check that stopped with nothing failed is no pass)
                outcome["error"] = err
        except _Abandoned:
            outcome["abandoned"] = True
        except TimeoutError as err:
            outcome["error"] = err
            outcome["timeout"] = True
        except NotImplementedError as err:
            outcome["error"] = err
            outcome["not_done"] = True
        except BaseException as err:  # noqa: BLE001 - learner code may raise anything
            outcome["error"] = err
            if os.environ.get("COURSE_DEBUG_CHECKS"):
                traceback.print_exc(file=sys.__stderr__)
        finally:
            with contextlib.suppress(Exception):
                pending = [x for x in asyncio.all_tasks(loop) if not x.done()]
                for x in pending:
                    x.cancel()
                loop.run_until_complete(asyncio.wait(pending, timeout=2)) if pending else None
            with contextlib.suppress(Exception):
                loop.close()
            bound.close()

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
    elif "error" in outcome and _checks_own_use(outcome["error"], args):
        outcome["left_out"] = True
        r.note(
            f"not graded here: this check builds its scenario with {str(outcome['error']).split(' is ')[0]}, "
            "the course's own answer to a graded task, which this copy of the course leaves out (a class "
            "hand-out); your instructor's grading runs it"
        )
    elif "error" in outcome:
        r.fail(f"your code raised {_describe(outcome['error'])}", stop=False)

    cut = worker.is_alive() or outcome.get("abandoned")
    if outcome.get("left_out"):
        return Result(t.id, 0.0, t.points, r.lines, time.perf_counter() - start, not_done=True)
    if t.partial and r.fraction is not None and not cut and "error" not in outcome:
        points = round(t.points * max(0.0, min(1.0, r.fraction)), 2)
    else:
        points = t.points if r.failures == 0 and not cut else 0.0
    not_done = bool(outcome.get("not_done")) and not cut
    if not public and t.seed and not not_done:  # last, one line: the verdict comes first
        r.note(f"random choices come from seed {t.seed}: the same code gets the same verdict on every run")
    result = Result(t.id, points, t.points, r.lines, time.perf_counter() - start, not_done=not_done)
    if "error" in outcome and connection_error(outcome["error"]):
        result.unreachable = _describe(outcome["error"])
    return result


#: Exceptions that mean "a server did not answer", by module and name (no import needed).
_CONNECTION_ERRORS = {
    ("psycopg", "OperationalError"),
    ("psycopg_pool", "PoolTimeout"),
    ("redis.exceptions", "ConnectionError"),
    ("redis.exceptions", "TimeoutError"),
    ("builtins", "ConnectionError"),
}


def _checks_own_use(err: BaseException, answers: list = ()) -> bool:
    """An answer left out of this copy of the course (``course handout``), called by a check, not by the
    learner's code: it was raised in this process (an error from the learner's process crossed the wire)
    and no frame of its traceback is a learner's cell."""
    from autograder import references
    from autograder.proxies import Proxy
    from autograder.values import frames_of

    if getattr(err, "__remote_str__", None) is not None:
        return False  # the learner's code called it (re-exported it, wrapped it): its own failure
    if any(getattr(a, "__course_reference__", None) for a in answers if not isinstance(a, Proxy)):
        return False  # the answer is the left-out reference itself, re-exported
    return references.left_out(err) and not any(name.startswith("<") for name, _, _ in frames_of(err))


def connection_error(err: BaseException) -> bool:
    """Is ``err`` (or what it was raised from) a failure to reach a server?"""
    seen = 0
    while err is not None and seen < 5:
        for cls in type(err).__mro__:
            module = cls.__module__.split(".")[0] if cls.__module__.startswith("psycopg") else cls.__module__
            if (module, cls.__name__) in _CONNECTION_ERRORS:
                return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


# ----------------------------------------------------------------------------- notebook entry points


#: Printed report lines wrap here, so a notebook in a browser (about 1,400 px) never wraps them mid-word.
WIDTH = 108
#: Validate's dialog shows a failing cell's error in a box about 80 characters wide (``nbgrader
#: validate`` cuts its lines at 87, indent included): the lines it carries are wrapped a little inside.
DIALOG_WIDTH = 76

_MARK = re.compile(r"(\[\w+\]|-) ")


def fit(text: str, width: int = WIDTH) -> str:
    """``text`` with each line longer than ``width`` wrapped at spaces, continuation lines
    indented under the line's text (past its ``[ok]`` / ``[FAIL]`` / ``-`` mark).

    One item reads as one item: a wrapped line never starts with a lone ``-`` (it would read as a
    bullet of its own), and the further lines of a multi-line message (a PostgreSQL error's
    ``DETAIL``) are indented under its first line, not set flush left as if they were new items.
    """
    import textwrap

    out = []
    hang: str | None = None  # the indent of the last marked line's text
    for raw in text.splitlines():
        body = raw.lstrip()
        lead = len(raw) - len(body)
        mark = _MARK.match(body)
        if not body:
            hang = None
        elif mark:
            hang = " " * (lead + len(mark.group(0)))
        elif hang is not None and lead == 0 < len(hang) - 2:
            raw, lead = hang + body, len(hang)  # flush left under an indented item: the item's next line
        if len(raw) <= width:
            out.append(raw)
            continue
        head = lead + (len(mark.group(0)) if mark else 0)
        if mark or (hang is not None and lead == len(hang)):
            indent = " " * head  # under the item's text
        else:
            indent = " " * (lead or 2)  # a line of its own: a heading's next lines a little in
        glued = raw[:head] + raw[head:].replace(" - ", "\u00a0- ")  # textwrap breaks at ASCII spaces only
        wrapped = textwrap.fill(
            glued, width=width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
        )
        out.append(wrapped.replace("\u00a0", " "))
    return "\n".join(out)


class TaskFailed(AssertionError):
    """A task fell short; shown in the notebook as a short message, not a traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"TaskFailed: {self}"]


def _caller_namespace(depth: int = 2) -> dict:
    frame = sys._getframe(depth)
    return frame.f_globals


def _names(t: Task) -> str:
    """``buy`` or ``HashRing and node_names``: what a task's answer cell defines (its ``needs``)."""
    names = [f"`{n}`" for n in t.needs]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _not_done_line(t: Task) -> str:
    """``create_order: not done yet (write `create_order` in its answer cell, ...)``: one line, and
    it names the answer, since the cell right above a test cell is a try-it cell."""
    line = f"{t.id}: not done yet (write {_names(t)} in the answer cell, run it, then this cell)"
    if len(line) > WIDTH:
        line = f"{t.id}: not done yet (write `{t.needs[0]}` in the answer cell, run it, then this cell)"
    return line


def grade(task_id: str, namespace: dict | None = None):
    """Grade one task (hidden test cells). Prints the report; partial credit as the cell value."""
    ns = namespace if namespace is not None else _caller_namespace()
    t = get_task(task_id)
    res = run_task(t, ns)
    print(fit(res.text()))
    if res.passed:
        return None
    if t.partial and res.points > 0:
        return res.points  # nbgrader reads a number in the cell's output as partial credit
    raise TaskFailed(f"{task_id}: {res.points:g}/{res.max_points:g} points (see the lines above)")


def public(task_id: str, namespace: dict | None = None) -> None:
    """The visible checks of a task: a quick subset of the graded ones."""
    ns = namespace if namespace is not None else _caller_namespace()
    t = get_task(task_id)
    if _validating():
        _validate(t, ns)
        return
    res = run_task(t, ns, public=True)
    if res.not_done:  # an unfinished task is not an error: Run All goes on to the next task
        print(_not_done_line(t))
        return
    print(fit("\n".join(res.lines)))
    if res.passed:
        print(f"{task_id}: {PUBLIC_PASSED}")
        return
    raise TaskFailed(f"{task_id}: a public check failed (see the lines above)")


def _validating() -> bool:
    """True while nbgrader's Validate (the toolbar button, or `nbgrader validate`) runs the notebook."""
    return os.environ.get("NBGRADER_EXECUTION") == "validate" or os.environ.get("NBGRADER_VALIDATING") == "1"


def _validate(t: Task, ns: dict) -> None:
    """What a test cell does under Validate: the hidden checks, and an error unless they all pass.

    Validate calls a notebook good when no test cell fails, and the public checks are a smoke
    test: an unfinished task or one the hidden checks reject must fail here, or Validate says
    "Success!" to a notebook worth 0 points. Run in the learner's own kernel, so it is the
    learner's help, not the grade.

    Validate's dialog shows each failing cell's source and its error, and nothing the cell
    printed: so the error carries the reason (:func:`validate_message`).
    """
    res = run_task(t, ns)
    if not res.passed:
        raise TaskFailed(validate_message(t, res))
    print(f"{t.id}: {res.points:g}/{res.max_points:g} points (hidden checks, run by Validate)")


def validate_message(t: Task, res: Result, width: int = DIALOG_WIDTH) -> str:
    """Why a task fails Validate, for its dialog: the dialog names the test cell (``public("buy")``),
    whose public checks may well pass, so the message says that the hidden checks ran there, which
    cell to fix (the answer cell), and each ``[FAIL]`` line with the observation that led to it."""
    where = f"the cell that defines {_names(t)}"
    if res.not_done:
        return fit(
            f"{t.id}: not done yet (0/{t.points:g} points)\n  write your answer in {where}, then Validate again", width
        )
    shown: list[str] = []
    doing = None  # the last note before a [FAIL]: what the check was doing when it failed
    for line in res.lines:
        if line.lstrip().startswith("- "):
            doing = line
        elif line.lstrip().startswith("[FAIL]"):
            if doing is not None and doing not in shown:
                shown.append(doing)
            shown.append(line)
    head = [
        f"{t.id}: {res.points:g}/{res.max_points:g} points from the hidden checks",  # after "TaskFailed: "
        f"  Validate runs them in this test cell, whose public checks may pass; what falls short is your answer, in {where}:",
    ]
    tail = f'  (selfcheck("{t.chapter}") in the notebook shows every line)'
    return fit("\n".join([*head, *shown, tail]), width)


def _status(res: Result, missing: tuple[str, ...] | list[str] = ()) -> str:
    """A task's state in one phrase; ``missing``: the names it needs that are not defined at all."""
    if res.passed:
        return "done"
    if missing:
        return f"not started: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not defined (run its cell)"
    if res.not_done:
        return "not done"
    return "started, falls short" if res.points > 0 else "started, 0 points"


def _in_notebook_order(chapter: str, tasks: list[Task]) -> list[Task]:
    """The chapter's tasks in the order its test cells stand in the notebook."""
    import json
    from pathlib import Path

    found = sorted((Path(__file__).resolve().parent / "manifests").glob(f"{chapter}_*.json"))
    try:
        order = [c.get("task") for c in json.loads(found[0].read_text())["cells"] if c.get("kind") == "test"]
    except (IndexError, OSError, ValueError, KeyError):  # no manifest (a harness test): registration order
        return tasks
    return sorted(tasks, key=lambda t: order.index(t.id) if t.id in order else len(order))


def selfcheck(chapter: str, namespace: dict | None = None, *, every_line: bool = False) -> list[Result]:
    """Run every graded check of a chapter on this notebook's code and print a summary.

    A task at full marks is one line of the summary (how many observations passed); the lines of
    a task that falls short come first, whole, since they say why. ``every_line=True`` prints every
    task's lines.
    """
    ns = namespace if namespace is not None else _caller_namespace()
    if os.environ.get("NBGRADER_EXECUTION") in ("autograde", "validate"):
        print("selfcheck: skipped while nbgrader grades this notebook (the test cells above are the grade)")
        return []
    tasks = _in_notebook_order(chapter, load_chapter(chapter))
    results = [run_task(t, ns) for t in tasks]
    if not results:
        print(f"selfcheck: chapter {chapter} has no graded tasks (its practice is self-rated)")
        return results
    missing = {t.id: [n for n in t.needs if n not in ns] for t in tasks}
    for res in results:
        if every_line or not (res.passed or res.not_done or missing[res.task]):
            print(fit(res.text()))
            print()
    total = sum(r.points for r in results)
    top = sum(r.max_points for r in results)
    for res in results:
        status = _status(res, missing[res.task])
        if res.passed:
            status += f" ({sum(line.lstrip().startswith('[ok]') for line in res.lines)} observations passed)"
        print(f"{'[ok]  ' if res.passed else '[..]  '}{res.task:<24} {res.points:>5g}/{res.max_points:<4g} {status}")
    print(f"total: {total:g}/{top:g}")
    if not every_line and any(r.passed for r in results):
        print(f'(selfcheck("{chapter}", every_line=True) also shows what the checks saw in the tasks that passed)')
    print(
        "(selfcheck runs in this kernel, where code can change what it checks; `course check` grades a saved\n"
        " copy in a fresh, sandboxed process, as your instructor's grading does)"
    )
    _record_progress(chapter, total, top)
    return results


def _record_progress(chapter: str, score: float, max_score: float) -> None:
    """``course progress`` shows the last result (:mod:`course.progress`); recording never breaks a selfcheck."""
    try:
        from course.progress import record_check

        record_check(chapter, score, max_score, via="selfcheck")
    except Exception:  # noqa: BLE001, S110
        pass
