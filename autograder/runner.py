"""The grading process: a chapter's setup cells, a learner's answer cells, then the hidden checks.

    python -m autograder.runner RESULTS_FD < job.json

This is the one place a grade is decided. :mod:`autograder.grading` starts it in a fresh
process (inside the sandbox) for ``course check``, nbgrader's autograde and the class
command alike, so they cannot disagree. The job (JSON on stdin) holds:

- ``chapter``: ``"03"``; ``key``: a secret that signs every result line;
- ``cells``: in notebook order, ``{"kind": "setup" | "answer", "id", "source"}``; setup
  cells come from the chapter's source (never from the learner), answer cells from the
  learner's notebook; demo cells are not in the job at all;
  ``test`` entries (``{"kind": "test", "id", "task"}``) stand where the notebook's test
  cells stand: each task is graded there, after the cells above it and before the ones below;
- ``skip``: cells and tasks a previous run could not finish (reported as cut, not run
  again); ``cell_timeout``: seconds per cell.

Results go to the file descriptor ``RESULTS_FD`` (not stdout, which learner code shares),
one JSON line per event, each signed with the job's key so that learner code writing to
that descriptor cannot pass for the grader. The key and the signing stay in the main thread,
which runs no learner code: cells and checks run in a worker thread ("grading") and hand
their verdicts over a queue. Before the first answer cell the process installs the audit
hook of :mod:`autograder.guard` (frames, gc walks, tracers, ctypes, signals, /proc/self/mem
refused to learner code; a refusal zeroes the task and is named) and snapshots the grader
(:mod:`autograder.integrity`); a change found after an answer cell or a task's checks zeroes
that task, is named in its feedback, and is undone. While a task is graded, a call from
learner code into the course's own reference answer of that task (the check module's
``REFERENCES``) zeroes it too. Finalizers of learner objects run at a fixed point, after
each task's checks, so what they do counts against their cell.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import hashlib
import hmac
import io
import json
import linecache
import os
import re
import sys
import threading
import time
import traceback


class CellTimeout(BaseException):
    """Raised in a cell that ran past its time limit."""

    limit = 60.0

    def __init__(self, *args) -> None:
        super().__init__(*(args or (f"the cell ran past its {self.limit:g} s limit",)))


def sign(key: bytes, body: dict) -> str:
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"body": body, "mac": hmac.new(key, text.encode(), hashlib.sha256).hexdigest()})


def verify(key: bytes, line: str) -> dict | None:
    """The body of a signed line, or None when the line is not the grader's."""
    try:
        packet = json.loads(line)
        body = packet["body"]
        text = json.dumps(body, sort_keys=True)
        good = hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
        return body if hmac.compare_digest(good, str(packet["mac"])) else None
    except (ValueError, KeyError, TypeError):
        return None


def cell_filename(kind: str, cell_id: str) -> str:
    return f"<{kind} cell {cell_id}>"


def _error_text(err: BaseException, filename: str) -> str:
    """``NotImplementedError: not done yet (line 3: raise ...)``: one line, learner frames only."""
    where = ""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if frame.filename == filename:
            where = f" (line {frame.lineno}: {(frame.line or '').strip()})"
            break
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}{': ' + text[:300] if text else ''}{where}"


_MAGIC = re.compile(r"^(\s*)[%!].*$", re.MULTILINE)


def run_cell(
    source: str,
    namespace: dict,
    filename: str,
    loop: asyncio.AbstractEventLoop,
    timeout: float,
    on_compile=None,
) -> None:
    """Run one cell like a kernel would (top-level ``await`` allowed), under a time limit.

    IPython magics and shell lines (``%matplotlib inline``, ``!pip ...``) mean nothing here
    and become ``pass``. Cells run in the grading thread, not the main thread: past its
    limit a :class:`CellTimeout` is raised in that thread (a cell blocked in C gets it when
    it returns, or is cut by the grading parent).
    """
    source = _MAGIC.sub(r"\1pass", source)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    code = compile(source, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    if on_compile is not None:
        on_compile(code)
    CellTimeout.limit = timeout
    deadline = _Deadline(threading.get_ident(), timeout)
    try:
        try:
            result = eval(code, namespace)  # noqa: S307 - this process exists to run these cells
            if asyncio.iscoroutine(result):
                loop.run_until_complete(result)
        finally:
            deadline.disarm()
    except CellTimeout:
        raise
    except BaseException as err:
        if deadline.fired and not isinstance(err, CellTimeout):
            raise CellTimeout() from err
        raise


class _Deadline:
    """Raise :class:`CellTimeout` in thread ``ident`` after ``seconds``, unless disarmed first."""

    def __init__(self, ident: int, seconds: float) -> None:
        self.ident = ident
        self.lock = threading.Lock()
        self.armed = True
        self.fired = False
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        from autograder import guard

        with self.lock:
            if self.armed:
                self.fired = True
                guard.async_raise(self.ident, CellTimeout)

    def disarm(self) -> None:
        with self.lock:
            self.armed = False
        self.timer.cancel()


def _preload() -> None:
    """Import the toolkit and every pattern module, so the snapshot covers what checks import lazily."""
    import importlib
    import pkgutil

    import course
    import course.kit

    for package in (course, course.kit):
        for module in pkgutil.iter_modules(package.__path__):
            if not module.ispkg:
                with contextlib.suppress(Exception):
                    importlib.import_module(f"{package.__name__}.{module.name}")


def _references(chapter: str) -> dict[str, dict[str, object]]:
    """task id -> {"module:qualname": the course's reference answer}, from the check module's REFERENCES."""
    from autograder import guard

    module = sys.modules.get(f"autograder.checks.ch{chapter}")
    found: dict[str, dict[str, object]] = {}
    for task_id, specs in (getattr(module, "REFERENCES", None) or {}).items():
        for spec in specs:
            with contextlib.suppress(Exception):
                found.setdefault(task_id, {})[spec] = guard.resolve(spec)
    return found


def reference_use(task, namespace: dict, references: dict[str, object], source: str) -> list[str]:
    """How the learner's names of ``task`` are the course's reference answer, before its checks run.

    The name itself (a re-export), something it wraps (``functools.wraps``, ``partial``), a
    subclass of the reference class, or an answer cell that imports the reference by name.
    """
    from autograder import guard

    found = []
    for name in task.needs:
        value = namespace.get(name)
        if value is None:
            continue
        for item in guard.unwrap_all(value):
            for spec, ref in references.items():
                if item is ref and spec not in found:
                    found.append(spec)
    try:
        tree = ast.parse(_MAGIC.sub(r"\1pass", source))
    except SyntaxError:
        return found
    for spec in references:
        module, _, qualname = spec.partition(":")
        top = qualname.split(".")[0]
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == module and any(a.name == top for a in node.names):
                found.append(spec) if spec not in found else None
            elif isinstance(node, ast.ImportFrom) and node.module and f"{node.module}.{node.names[0].name}" == module:
                aliases.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                aliases.update(a.asname or a.name for a in node.names if a.name == module)
        if aliases:
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr == top and spec not in found:
                    base = node.value
                    while isinstance(base, ast.Attribute):
                        base = base.value
                    if isinstance(base, ast.Name) and (base.id in aliases or base.id == module.split(".")[0]):
                        found.append(spec)
    return found


def main() -> int:
    results_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.read())
    key = bytes.fromhex(job.pop("key"))
    out = os.fdopen(results_fd, "w", buffering=1, closefd=True)
    os.environ.setdefault("NBGRADER_EXECUTION", "autograde")
    os.environ.setdefault("MPLBACKEND", "Agg")

    def emit(body: dict) -> None:  # key stays in this frame's closure only, in the main thread
        out.write(sign(key, body) + "\n")
        out.flush()

    # The grader and the chapter's checks are loaded before any learner code runs.
    import _queue
    import dataclasses

    from autograder import guard, harness

    # Private copies of the tasks: a learner who rebinds REGISTRY[...].check changes nothing here.
    tasks = {t.id: dataclasses.replace(t) for t in harness.load_chapter(job["chapter"])}
    _preload()  # every pattern and tool a check could import later is in the snapshot too
    references = _references(job["chapter"])
    shield = guard.install(protected_fds={results_fd})
    # Learner code runs in the grading thread, never here: this thread only signs what that
    # one reports. A frame walk from learner code ends at that thread's bootstrap, signal
    # handlers (which run here) cannot be installed from it, and the audit hook refuses the
    # primitives that reach across (autograder/guard.py).
    outbox = _queue.SimpleQueue()
    worker = threading.Thread(
        target=_grade_in_thread, args=(job, tasks, references, shield, outbox.put), name="grading", daemon=True
    )
    worker.start()
    while True:
        body = outbox.get()
        if body is None:
            break
        emit(body)
    emit({"event": "done"})
    out.close()
    return 0


def _grade_in_thread(job: dict, tasks: dict, references: dict, shield, put) -> None:
    try:
        _grade(job, tasks, references, shield, put)
    except BaseException as err:  # noqa: BLE001 - reported, and the main thread still ends the run
        with contextlib.suppress(BaseException):
            put({"event": "error", "error": f"{type(err).__name__}: {err}"[:300]})
    finally:
        put(None)


def _grade(job: dict, tasks: dict, references: dict, shield, emit) -> None:
    import gc

    from autograder import guard, harness, integrity

    collect = gc.collect
    run_task = harness.run_task
    snapshot_cls = integrity.Snapshot
    summarize = integrity.summary
    watch_cls = guard.ReferenceWatch
    skip = set(job.get("skip", []))
    timeout = float(job.get("cell_timeout", 60))
    real_stdout, real_stderr = sys.stdout, sys.stderr
    sources = {c["id"]: c.get("source", "") for c in job["cells"] if c["kind"] == "answer"}

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    tampered: dict[str, str] = {}
    refused: dict[str, list[str]] = {}
    snapshot = None

    def note_refusals(scope: str, task_id: str) -> None:
        for what in shield.refused.pop(scope, []):
            if what not in refused.setdefault(task_id, []):
                refused[task_id].append(what)

    def grade_task(task_id: str) -> None:
        nonlocal snapshot
        if snapshot is None:
            snapshot = snapshot_cls.take()
        emit({"event": "task-start", "id": task_id})
        if f"task:{task_id}" in skip or task_id not in tasks:
            return
        shield.scope = f"task:{task_id}"
        task_refs = references.get(task_id, {})
        used = reference_use(tasks[task_id], namespace, task_refs, sources.get(task_id, "")) if task_refs else []
        with watch_cls(shield, task_refs) as watch:
            result = run_task(tasks[task_id], namespace)
            collect()  # learner finalizers run here, at a fixed point, not at a random later one
        for spec in watch.hits:
            if spec not in used:
                used.append(spec)
        changed = snapshot.changes()
        if changed:
            snapshot.restore()
            tampered.setdefault(task_id, summarize(changed))
        note_refusals(f"task:{task_id}", task_id)
        note_refusals(f"cell:{task_id}", task_id)  # its cell's code, run by the checks or a finalizer
        verdict = {
            "event": "task",
            "id": task_id,
            "points": result.points,
            "max_points": result.max_points,
            "lines": result.lines,
            "not_done": result.not_done,
            "seconds": round(result.seconds, 3),
            "tampered": tampered.get(task_id),
            "refused": "; ".join(refused.get(task_id, [])) or None,
            "reference": used or None,
            "unreachable": result.unreachable,
        }
        if verdict["tampered"] or verdict["refused"] or verdict["reference"]:
            verdict["points"] = 0.0
        emit(verdict)

    # In notebook order, as a kernel would run them: a task is graded where its test cell
    # stands, so a later cell that rebinds a name cannot change what an earlier task graded.
    for cell in job["cells"]:
        kind, cell_id = cell["kind"], cell["id"]
        if kind == "test":
            grade_task(cell["task"])
            continue
        if kind == "answer" and snapshot is None:
            snapshot = snapshot_cls.take()  # after the trusted setup, before the learner
        emit({"event": "start", "cell": cell_id, "kind": kind})
        if f"cell:{cell_id}" in skip:
            emit({"event": "cell", "id": cell_id, "kind": kind, "ok": False, "stdout": "", "cut": True})
            continue
        buffer = io.StringIO()
        filename = cell_filename(kind, cell_id)
        failure = None
        started = time.perf_counter()
        if kind == "answer":
            shield.add_learner_cell(filename, cell_id)
            shield.scope = f"cell:{cell_id}"
            shield.active = True  # from the first answer cell on, for good
        try:
            with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
                run_cell(cell["source"], namespace, filename, loop, timeout)
        except BaseException as err:  # noqa: BLE001 - learner code may raise anything, even SystemExit
            failure = err
        finally:
            sys.stdout, sys.stderr = real_stdout, real_stderr
        if kind == "answer" and snapshot is not None:
            changed = snapshot.changes()  # first, before anything here leans on what it may have patched
            if changed:
                snapshot.restore()
                tampered[cell_id] = summarize(changed)
        if kind == "answer":
            note_refusals(f"cell:{cell_id}", cell_id)
        error = _error_text(failure, filename) if failure is not None else None
        emit(
            {
                "event": "cell",
                "id": cell_id,
                "kind": kind,
                "ok": error is None,
                "stdout": buffer.getvalue()[-4000:],
                "error": error,
                "tampered": tampered.get(cell_id),
                "refused": "; ".join(refused.get(cell_id, [])) or None,
                "seconds": round(time.perf_counter() - started, 3),
            }
        )
    with contextlib.suppress(Exception):
        loop.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # learner threads or pools left behind must not keep the grader waiting
