"""The grading process: the hidden checks here, the learner's cells in a sandboxed process of their own.

    python -m autograder.runner RESULTS_FD < job.json

This is the one place a grade is decided. :mod:`autograder.grading` starts it for ``course
check``, nbgrader's autograde and the class command alike, so they cannot disagree. The job
(JSON on stdin) holds:

- ``chapter``: ``"03"``; ``sandbox``: ``"on"`` or ``"off"``; ``cell_timeout``: seconds per cell;
- ``cells``: in notebook order, ``{"kind": "setup" | "answer", "id", "source"}``; setup cells
  come from the chapter's source (never from the learner), answer cells from the learner's
  notebook; demo cells are not in the job at all; ``test`` entries (``{"kind": "test", "id",
  "task"}``) stand where the notebook's test cells stand: each task is graded there, after the
  cells above it and before the ones below.

The cells run in a learner process (:mod:`autograder.learner`) in the sandbox, which holds
nothing of the grader's; the checks run here and call the learner's names across the wire
(:mod:`autograder.session`, issue 40). Results go to the file descriptor ``RESULTS_FD``, one
JSON line per event; no learner process holds it. A cell past its time limit ends its learner
process, which is started again with the cells before it, so only what depends on that cell
loses points.
"""

from __future__ import annotations

import json
import os
import sys
import time

#: Extra seconds past a cell's own limit before its learner process is ended.
GRACE = 5.0


def main() -> int:
    results_fd = int(sys.argv[1])
    job = json.loads(sys.stdin.read())
    out = os.fdopen(results_fd, "w", buffering=1, closefd=True)
    os.environ.setdefault("NBGRADER_EXECUTION", "autograde")
    os.environ.setdefault("MPLBACKEND", "Agg")

    def emit(body: dict) -> None:
        out.write(json.dumps(body) + "\n")
        out.flush()

    try:
        grade(job, emit)
    except BaseException as err:  # noqa: BLE001 - reported; the parent says what could not be graded
        emit({"event": "error", "error": f"{type(err).__name__}: {err}"[:300]})
    emit({"event": "done"})
    out.close()
    return 0


def grade(job: dict, emit) -> None:
    from autograder import harness
    from autograder import session as sessions

    timeout = float(job.get("cell_timeout", 60))
    try:
        session = sessions.Session(job["chapter"], unsandboxed=job.get("sandbox") == "off", cell_timeout=timeout)
    except Exception as err:
        _refused(err, emit)
        return
    with session:
        # the learner processes start, importing what the setup cells import, while the run's database is
        # made and the checks load here
        session.start(
            [c["source"] for c in job["cells"] if c["kind"] == "setup"],
            [c["task"] for c in job["cells"] if c["kind"] == "test"],
        )
        mark = time.perf_counter()
        tasks = {t.id: t for t in harness.load_chapter(job["chapter"])}
        session.phases["checks loaded"] = time.perf_counter() - mark
        try:
            session.wait_namespace()
        except Exception as err:
            _refused(err, emit)
            return
        last = max((i for i, c in enumerate(job["cells"]) if c["kind"] == "test"), default=-1)
        for i, cell in enumerate(job["cells"]):
            mark = time.perf_counter()
            if cell["kind"] == "test":
                session.spares.ahead = i < last  # no namespace made ahead for a check that never comes
                emit({"event": "task-start", "id": cell["task"]})
                if cell["task"] in tasks:
                    emit(_grade_task(session, tasks[cell["task"]], timeout))
                session.phases[f"checks of {cell['task']}"] = time.perf_counter() - mark
                continue
            emit({"event": "start", "cell": cell["id"], "kind": cell["kind"]})
            emit(_run_cell(session, cell, timeout))
            session.phases[f"{cell['kind']} cell {cell['id']}"] = time.perf_counter() - mark
        mark = time.perf_counter()
    session.phases["cleanup"] = time.perf_counter() - mark
    emit({"event": "phases", "seconds": {k: round(v, 3) for k, v in session.phases.items()}})


def _refused(err: Exception, emit) -> None:
    """The run could not make its namespace: the servers' refusal, said as one "servers" event (the
    parent raises ServersDown: nothing graded); anything else is the grader's own failure."""
    from autograder import health

    problem = health.namespace_problem(err)
    if problem is None:
        raise err
    emit({"event": "servers", "error": problem})


def _run_cell(session, cell: dict, timeout: float) -> dict:
    started = time.perf_counter()
    event = {"event": "cell", "id": cell["id"], "kind": cell["kind"]}
    try:
        got = session.run_cell(cell["kind"], cell["id"], cell["source"])
    except TimeoutError:
        session.main_kill()
        return {**event, "ok": False, "stdout": "", "cut": f"ran past its {timeout:g} s limit", "seconds": timeout}
    except Exception:  # noqa: BLE001 - the process died in this cell
        why = session.main_kill()
        return {**event, "ok": False, "stdout": "", "cut": f"ended its process ({why})", "seconds": 0.0}
    return {
        **event,
        "ok": bool(got.get("ok")),
        "stdout": str(got.get("stdout", ""))[-4000:],
        "error": got.get("error"),
        "seconds": round(time.perf_counter() - started, 3),
    }


def _grade_task(session, task, timeout: float) -> dict:
    from autograder import harness
    from autograder import session as sessions

    learner = session.main()
    namespace = sessions.RemoteNamespace(session, learner)
    result = harness.run_task(task, namespace)
    gone = None
    if not _responsive(session, learner):
        gone = learner.why_gone()
        learner.kill()
    else:
        namespace.after_task()
    lines = list(result.lines)
    if gone and result.points < result.max_points:
        lines.append(f"  - the process running your code ended or stopped answering during the checks: {gone}")
    return {
        "event": "task",
        "id": task.id,
        "points": result.points,
        "max_points": result.max_points,
        "lines": lines,
        "not_done": result.not_done,
        "seconds": round(result.seconds, 3),
        "unreachable": result.unreachable,
    }


def _responsive(session, learner, seconds: float = 3.0) -> bool:
    if not learner.alive:
        return False
    try:
        session.control.run(learner.conn.ping(), seconds)
        return True
    except Exception:  # noqa: BLE001 - no answer in time: wedged
        return False


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # threads left behind (gateways, readers) must not keep the grader waiting
