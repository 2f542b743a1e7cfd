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
that descriptor cannot pass for the grader. Before any learner code runs the process
snapshots the grader (:mod:`autograder.integrity`); a change found after an answer cell
or a task's checks zeroes that task, is named in its feedback, and is undone.
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
import signal
import sys
import time
import traceback


class CellTimeout(BaseException):
    """Raised in a cell that ran past its time limit."""


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


def run_cell(source: str, namespace: dict, filename: str, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
    """Run one cell like a kernel would (top-level ``await`` allowed), under a time limit.

    IPython magics and shell lines (``%matplotlib inline``, ``!pip ...``) mean nothing here
    and become ``pass``.
    """
    source = _MAGIC.sub(r"\1pass", source)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    code = compile(source, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)

    def on_alarm(signum, frame):  # noqa: ARG001
        raise CellTimeout(f"the cell ran past its {timeout:g} s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        result = eval(code, namespace)  # noqa: S307 - this process exists to run these cells
        if asyncio.iscoroutine(result):
            loop.run_until_complete(result)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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


def main() -> int:
    results_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.read())
    key = bytes.fromhex(job.pop("key"))
    out = os.fdopen(results_fd, "w", buffering=1, closefd=True)
    os.environ.setdefault("NBGRADER_EXECUTION", "autograde")
    os.environ.setdefault("MPLBACKEND", "Agg")

    def emit(body: dict) -> None:  # key stays in this frame's closure only
        out.write(sign(key, body) + "\n")
        out.flush()

    # The grader and the chapter's checks are loaded before any learner code runs.
    from autograder import harness, integrity

    tasks = {t.id: t for t in harness.load_chapter(job["chapter"])}
    _preload()  # every pattern and tool a check could import later is in the snapshot too
    run_task = harness.run_task
    snapshot_cls = integrity.Snapshot
    summarize = integrity.summary
    skip = set(job.get("skip", []))
    timeout = float(job.get("cell_timeout", 60))
    real_stdout, real_stderr = sys.stdout, sys.stderr

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    tampered: dict[str, str] = {}
    snapshot = None

    def grade_task(task_id: str) -> None:
        nonlocal snapshot
        if snapshot is None:
            snapshot = snapshot_cls.take()
        emit({"event": "task-start", "id": task_id})
        if f"task:{task_id}" in skip or task_id not in tasks:
            return
        result = run_task(tasks[task_id], namespace)
        changed = snapshot.changes()
        if changed:
            snapshot.restore()
            tampered.setdefault(task_id, summarize(changed))
        verdict = {
            "event": "task",
            "id": task_id,
            "points": result.points,
            "max_points": result.max_points,
            "lines": result.lines,
            "not_done": result.not_done,
            "seconds": round(result.seconds, 3),
            "tampered": tampered.get(task_id),
            "unreachable": result.unreachable,
        }
        if verdict["tampered"]:
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
                "seconds": round(time.perf_counter() - started, 3),
            }
        )

    emit({"event": "done"})
    out.close()
    with contextlib.suppress(Exception):
        loop.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # learner threads or pools left behind must not keep the grader waiting
