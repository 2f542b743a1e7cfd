"""One grading path for everyone: ``course check``, nbgrader's autograde, the class command.

:func:`grade` takes a learner's notebook and the chapter's *trusted cells* (from the source
notebook as nbgrader restores it, or from the manifest that ships with the course), builds a
job of the setup cells, the learner's answer cells and the task ids, and runs it in a fresh
:mod:`autograder.runner` process, inside the sandbox. Demo cells are never run: a grade
depends only on what is graded, so grading takes seconds, and two callers given the same
notebook build the same job and get the same grade.

A cell that ignores its time limit, or a process that dies in learner code, is handled the
way a careful person would: the run is repeated with that cell (or task) cut, so only the
tasks that depend on it lose their points, with one line that says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autograder import health, settings
from autograder.health import KEPT, broken_submission  # noqa: F401 - the grading paths name them as grading.*
from course.kit import procs

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = Path(__file__).resolve().parent / "manifests"

#: Extra seconds the grading process gets past a cell's or a task's own limit before it is cut.
GRACE = 10.0


class GradingError(Exception):
    """The grading itself could not run (no servers, no sandbox): nothing to do with the learner."""


# ----------------------------------------------------------------------------- trusted cells


def _nbgrader(cell: dict) -> dict:
    """A cell's nbgrader metadata; ``{}`` for anything a hand-edited notebook put there instead."""
    meta = cell.get("metadata") if isinstance(cell, dict) else None
    found = meta.get("nbgrader") if isinstance(meta, dict) else None
    return found if isinstance(found, dict) else {}


def _grade_id(cell: dict) -> str | None:
    gid = _nbgrader(cell).get("grade_id")
    return gid if isinstance(gid, str) else None


def _source(cell: dict) -> str:
    src = cell.get("source", "") if isinstance(cell, dict) else ""
    if isinstance(src, list):
        return "".join(part if isinstance(part, str) else str(part) for part in src)
    return src if isinstance(src, str) else ""


def trusted_cells(nb: dict) -> list[dict]:
    """What grading takes from a chapter's source notebook, in order.

    ``setup`` (locked code cells that are not tests, with their source), ``answer`` (the
    learner's cells, by grade_id), ``test`` (the task and its points) and ``manual``
    (answers an instructor grades by hand, with their points).
    """
    cells = []
    for index, cell in enumerate(nb.get("cells", [])):
        meta = _nbgrader(cell)
        gid = meta.get("grade_id") or cell.get("id") or f"cell{index}"
        if cell.get("cell_type") == "code":
            if meta.get("grade"):
                cells.append({"kind": "test", "id": gid, "task": gid.removeprefix("check_"), "points": meta["points"]})
            elif meta.get("solution"):
                cells.append({"kind": "answer", "id": gid})
            elif meta.get("locked"):
                cells.append({"kind": "setup", "id": gid, "source": _source(cell)})
        elif cell.get("cell_type") == "markdown" and meta.get("solution") and meta.get("grade"):
            cells.append({"kind": "manual", "id": gid, "points": meta.get("points", 0)})
    return cells


def manifest_path(chapter: str) -> Path:
    return MANIFESTS / f"{chapter}.json"


def manifest_text(chapter: str, source_nb: dict) -> str:
    """The JSON of ``autograder/manifests/<chapter>.json``: the trusted cells, shipped with the course."""
    return json.dumps({"chapter": chapter, "cells": trusted_cells(source_nb)}, indent=1) + "\n"


def write_manifest(chapter: str, source_nb: dict) -> Path:
    """``autograder/manifests/<chapter>.json``: the trusted cells, shipped with the course."""
    path = manifest_path(chapter)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest_text(chapter, source_nb))
    return path


def read_manifest(chapter: str) -> list[dict]:
    path = manifest_path(chapter)
    if not path.exists():
        raise GradingError(f"no grading manifest for {chapter} at {path}: run `make release`")
    return json.loads(path.read_text())["cells"]


def stale_setup(trusted: list[dict], nb: dict) -> list[str]:
    """Setup cells whose source in ``nb`` (as nbgrader restored it) differs from ``trusted``."""
    sources = {_grade_id(c): _source(c) for c in nb.get("cells", []) if _nbgrader(c).get("locked") and _grade_id(c)}
    return [c["id"] for c in trusted if c["kind"] == "setup" and c["id"] in sources and sources[c["id"]] != c["source"]]


def known_chapters() -> list[str]:
    return sorted(p.stem for p in MANIFESTS.glob("[0-9][0-9]_*.json"))


# ----------------------------------------------------------------------------- results


@dataclass
class TaskGrade:
    id: str
    points: float
    max_points: float
    feedback: list[str] = field(default_factory=list)
    status: str = "failed"  # passed | failed | not_done | tampered | cut | not_graded
    tampered: str | None = None
    flags: list[str] = field(default_factory=list)  # what a human should read in its answer (autograder/flags.py)
    unreachable: str | None = None  # the connection error the check ended on, if any

    @property
    def passed(self) -> bool:
        return self.points >= self.max_points

    def text(self) -> str:
        return "\n".join([f"{self.id}: {self.points:g}/{self.max_points:g} points", *self.feedback])


@dataclass
class CellRun:
    id: str
    kind: str
    ok: bool
    stdout: str = ""
    error: str | None = None
    cut: str | None = None


@dataclass
class Graded:
    chapter: str
    tasks: list[TaskGrade] = field(default_factory=list)
    cells: dict[str, CellRun] = field(default_factory=dict)
    manual: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    sandboxed: bool = False
    not_graded: str | None = None  # the servers stopped answering: why (see _mark_not_graded)

    @property
    def complete(self) -> bool:
        """Was every task really graded? A result that is not is never cached nor recorded."""
        return self.not_graded is None and not any(t.status == "not_graded" for t in self.tasks)

    @property
    def score(self) -> float:
        return round(sum(t.points for t in self.tasks), 2)

    @property
    def max_score(self) -> float:
        return round(sum(t.max_points for t in self.tasks), 2)

    @property
    def tampered(self) -> list[TaskGrade]:
        return [t for t in self.tasks if t.tampered]

    @property
    def flagged(self) -> list[str]:
        """``["create_order: line 3: uses sys._getframe (frames)", ...]``: for the instructor to read."""
        return [f"{t.id}: {line}" for t in self.tasks for line in t.flags]

    def to_json(self) -> dict:
        data = asdict(self)
        data["score"], data["max_score"] = self.score, self.max_score
        return data

    @classmethod
    def from_json(cls, data: dict) -> Graded:
        graded = cls(data["chapter"], notes=data.get("notes", []), seconds=data.get("seconds", 0.0))
        graded.tasks = [TaskGrade(**t) for t in data["tasks"]]
        graded.cells = {k: CellRun(**v) for k, v in data["cells"].items()}
        graded.manual = data.get("manual", [])
        graded.sandboxed = data.get("sandboxed", False)
        graded.not_graded = data.get("not_graded")
        return graded


# ----------------------------------------------------------------------------- the job


def build_job(chapter: str, trusted: list[dict], submission: dict) -> dict:
    """The runner's job: trusted setup cells and the learner's answer cells, in order."""
    answers: dict[str, str] = {}
    cells = submission.get("cells", []) if isinstance(submission, dict) else []
    for cell in cells if isinstance(cells, list) else []:
        gid = _grade_id(cell)  # a hand-edited notebook's odd cells are no answers, and no traceback
        if gid and cell.get("cell_type") == "code" and gid not in answers:
            answers[gid] = _source(cell)
    cells, tasks = [], []
    for cell in trusted:
        if cell["kind"] == "setup":
            cells.append({"kind": "setup", "id": cell["id"], "source": cell["source"]})
        elif cell["kind"] == "answer":
            cells.append({"kind": "answer", "id": cell["id"], "source": answers.get(cell["id"], "")})
        elif cell["kind"] == "test":
            cells.append({"kind": "test", "id": cell["id"], "task": cell["task"]})
            tasks.append(cell["task"])
    return {"chapter": chapter[:2], "cells": cells, "tasks": tasks, "cell_timeout": settings.CELL_TIMEOUT}


def _code_version() -> str:
    digest = hashlib.sha256()
    for folder in ("autograder", "course"):
        for path in sorted((REPO / folder).rglob("*.py")):
            digest.update(path.relative_to(REPO).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


_VERSION: str | None = None


def job_key(job: dict) -> str:
    """A digest of the job and of the grader's code: equal keys, equal grades."""
    global _VERSION
    if _VERSION is None:
        _VERSION = _code_version()
    return hashlib.sha256((_VERSION + json.dumps(job, sort_keys=True)).encode()).hexdigest()


# ----------------------------------------------------------------------------- running


@dataclass
class _Run:
    events: list[dict]
    stuck: str | None = None  # the cell or task the process was in when it stopped answering
    why: str = ""
    output: str = ""


def _servers_env() -> dict[str, str]:
    from course.kit import backends

    try:
        return backends.servers().as_env()
    except Exception as err:  # noqa: BLE001 - any failure to find servers is the grader's problem
        raise GradingError(
            f'no live servers to grade with: {err} (run `eval "$(course up --export)"` first, or unset COURSE_BACKEND)'
        ) from err


# ----------------------------------------------------------------------------- server health


class ServersDown(GradingError):
    """The course's servers do not answer (or cannot make a namespace): nothing was graded."""


_healthy: set[tuple[str, str]] = set()  # servers that made a namespace in this process once


def check_servers(env: dict[str, str] | None = None, *, namespace: bool = True) -> dict[str, str]:
    """Raise :class:`ServersDown` unless the course's servers answer; return their URLs.

    Run before any submission is graded. The first time in a process the servers must also
    make a grading namespace (unless ``namespace`` is False: a run about to start makes its
    own first, and says so when it cannot); after that a round trip to each is enough.
    """
    env = env or _servers_env()
    ident = (env.get("REDIS_URL", ""), env.get("DATABASE_URL", ""))
    made = namespace and ident not in _healthy
    problem = health.server_problem(env, namespace=made)
    if problem:
        raise ServersDown(problem)
    if made:
        _healthy.add(ident)
    return env


def _mark_not_graded(graded: Graded, env: dict[str, str]) -> None:
    """After a run in which something fell short: if the servers stopped answering, the
    shortfall is theirs. Every task that did not pass becomes "not graded" (never "failed"),
    and :attr:`Graded.not_graded` says why; such a result is never cached or recorded."""
    short = [t for t in graded.tasks if t.status not in ("passed", "tampered")]
    if not short:
        return
    problem = health.server_problem(env)
    unreachable = [t for t in short if t.unreachable]
    if problem is None:
        for t in unreachable:
            t.feedback.append(
                f"  - a connection failed in this check ({t.unreachable}), but the course's servers answer: "
                "the connection that failed was your code's (a hard-coded address?)"
            )
        return
    graded.not_graded = problem
    for t in short:
        t.status, t.points = "not_graded", 0.0
        t.feedback.append(f"  [NOT GRADED] the course's servers stopped answering while grading: {problem}")


def _launch(job: dict) -> tuple[subprocess.Popen, int]:
    """Start the grading process (trusted: the checks; it starts the learner's sandboxed processes)."""
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "autograder.runner", str(write_fd)]
    owner = json.dumps({"host": socket.gethostname(), **procs.identity()})
    env = {**os.environ, **_servers_env(), "NBGRADER_EXECUTION": "autograde", "COURSE_OWNER": owner}
    env.pop("COURSE_NAMESPACE", None)
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            start_new_session=True,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    proc.stdin.write(json.dumps(job).encode())
    proc.stdin.close()
    return proc, read_fd


def sandbox_warning(mode: str) -> str:
    """What grading in ``mode`` gives up, in one line ("" when learner code is sandboxed)."""
    from autograder import sandbox as sb

    if mode == "off" or (mode == "auto" and not sb.available()[0]):
        return sb._UNSANDBOXED
    return ""


def _sandbox_mode(mode: str) -> str:
    """``"on"`` or ``"off"`` for the job; a GradingError when a sandbox is required and none works here."""
    from autograder import sandbox as sb

    if mode == "off":
        return "off"
    ok, why = sb.available()
    if ok:
        return "on"
    if mode == "required":
        raise GradingError(f"{why}. {sb._INSTALL}.")
    return "off"


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(Exception):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(10)


def _run_once(job: dict, run_timeout: float) -> _Run:
    proc, read_fd = _launch(job)
    events: list[dict] = []
    output: list[str] = []
    lines: list[str] = []
    done = threading.Event()

    def drain() -> None:
        for raw in iter(proc.stdout.readline, b""):
            output.append(raw.decode(errors="replace"))
            del output[:-50]

    def read() -> None:
        with os.fdopen(read_fd, "r", encoding="utf-8", errors="replace") as results:
            for line in results:
                lines.append(line)
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started = time.monotonic()
    seen = 0
    current: dict | None = None
    deadline = started + 120  # imports, the run's servers and the first learner process
    stuck, why = None, ""
    ended_at = None
    while True:
        done.wait(0.05)
        while seen < len(lines):
            try:
                body = json.loads(lines[seen])
            except ValueError:
                body = {"event": "error", "error": f"an unreadable result line: {lines[seen][:80]!r}"}
            seen += 1
            events.append(body)
            if body["event"] == "start":
                current = body
                deadline = time.monotonic() + job.get("cell_timeout", 60) * 3 + GRACE  # a cut cell's replays
            elif body["event"] == "task-start":
                current = body
                deadline = time.monotonic() + _task_timeout(job["chapter"], body["id"]) + 60 + GRACE
            elif body["event"] in ("cell", "task", "done"):
                current = None
                deadline = time.monotonic() + 120
        if done.is_set() and seen >= len(lines):
            break
        now = time.monotonic()
        if proc.poll() is not None:
            ended_at = ended_at or now
            if now - ended_at > 1.0:
                break
            continue
        if now > deadline or now - started > run_timeout:
            stuck = _where(current)
            why = "the grader stopped answering (a fault of the grader's, not of your code)"
            if now - started > run_timeout:
                why = f"grading took over {run_timeout:g} s in all"
            _kill(proc)
            reader.join(5)
            break
    if stuck is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if not any(e["event"] == "done" for e in events):
            stuck = _where(current)
            why = _death(proc.returncode)
        _kill(proc)
    return _Run(events, stuck, why, "".join(output))


def _where(current: dict | None) -> str | None:
    """``"cell:<id>"`` or ``"task:<id>"``: what the runner was doing (ids of the two may match)."""
    if not current:
        return None
    return f"cell:{current['cell']}" if current["event"] == "start" else f"task:{current['id']}"


def _death(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"ended the grading process (signal {name})"
    return f"ended the grading process (exit code {code})"


def _task_timeout(chapter: str, task_id: str) -> float:
    from autograder import harness

    try:
        return harness.get_task(task_id).timeout + 2
    except KeyError:
        return 60.0


def grade(
    chapter: str,
    trusted: list[dict],
    submission: dict,
    *,
    sandbox: str = "auto",
    run_timeout: float = settings.RUN_TIMEOUT,
) -> Graded:
    """Grade ``submission`` (a notebook as JSON) against ``trusted`` cells of ``chapter``.

    ``sandbox``: ``"required"`` (fail when there is none), ``"auto"`` (use it when it
    works here) or ``"off"``.
    """
    started = time.perf_counter()
    # Before anything is made for the run: a failure leaves nothing behind. Whether a namespace can be
    # made is the run's first step (no second database made and dropped just to see: 0.2-0.4 s of
    # every `course check`); a run that cannot make one makes nothing and says why ("servers").
    env = check_servers(namespace=False)
    job = build_job(chapter, trusted, submission)
    run = _run_once({**job, "sandbox": _sandbox_mode(sandbox)}, run_timeout)
    refused = next((e for e in run.events if e.get("event") == "servers"), None)
    if refused is not None:
        raise ServersDown(str(refused.get("error") or "the servers could not make a grading namespace"))
    graded = _assemble(chapter, trusted, job, run)
    _flag(graded, job)
    _mark_not_graded(graded, env)
    _scrub_graded(graded)
    graded.seconds = time.perf_counter() - started
    warning = sandbox_warning(sandbox)
    graded.sandboxed = not warning
    if warning:
        graded.notes.append(warning)
    return graded


def _assemble(chapter: str, trusted: list[dict], job: dict, run: _Run) -> Graded:
    graded = Graded(chapter)
    answer_of = {}  # task id -> its answer cell's run
    for event in run.events:
        if event["event"] == "cell":
            cell = CellRun(event["id"], event["kind"], event["ok"], event.get("stdout", ""), event.get("error"))
            cell.cut = event.get("cut")
            graded.cells[event["id"]] = cell
            if event["kind"] == "answer":
                answer_of[event["id"]] = cell
    results = {e["id"]: e for e in run.events if e["event"] == "task"}
    for event in run.events:
        if event["event"] == "error":
            graded.notes.append(f"the grading process failed: {event.get('error')}")
    for cell in graded.cells.values():
        if cell.kind == "setup" and not cell.ok:
            graded.notes.append(f"setup cell {cell.id} failed while grading: {cell.error or cell.cut}")
    for cell in trusted:
        if cell["kind"] == "manual":
            graded.manual.append({"id": cell["id"], "points": cell["points"]})
        if cell["kind"] != "test":
            continue
        task_id, points = cell["task"], float(cell["points"])
        tg = TaskGrade(task_id, 0.0, points)
        answer = answer_of.get(task_id)
        if answer is not None and answer.cut:
            tg.feedback.append(
                f"  [FAIL] your answer cell {answer.cut}: it was cut, so {task_id} was graded without it"
            )
        elif answer is not None and answer.error and "NotImplementedError" not in answer.error:
            tg.feedback.append(f"  [FAIL] your answer cell raised {answer.error}")
        result = results.get(task_id)
        if result is None:
            why = run.why or (
                "the grader failed (a fault of the grader's, not of your code; see the notes)"
                if any(e["event"] == "error" for e in run.events)
                else "the grading process ended first"
            )
            tg.feedback.append(f"  [FAIL] {task_id} was not graded: {why}")
        else:
            tg.feedback.extend(result["lines"])
            tg.points = min(float(result["points"]), points)
            tg.unreachable = result.get("unreachable")
            if result.get("not_done"):
                tg.status = "not_done"
            else:
                tg.status = "passed" if tg.points >= points else "failed"
        graded.tasks.append(tg)
    if run.stuck:
        graded.notes.append(f"grading stopped at {run.stuck}: {run.why}")
    return graded


def _flag(graded: Graded, job: dict) -> None:
    """Mark each task whose answer cell a human should read (autograder/flags.py); the grade stands."""
    from autograder import flags

    found = flags.scan_answers(job)
    for task in graded.tasks:
        lines = found.get(task.id, [])
        if lines:
            task.flags = lines
            task.feedback.append(
                f"  [FLAG] your instructor will read this answer (it {lines[0].split(': ', 1)[1]}"
                + (f", and {len(lines) - 1} more" if len(lines) > 1 else "")
                + "); the points above are graded as usual"
            )


# ----------------------------------------------------------------------------- host paths


def _host_paths() -> list[tuple[str, str]]:
    """(host path, what the learner reads instead), longest first.

    The sandbox shows the repository, the venv and the Python installation at their real
    paths, so a traceback or a printed ``__file__`` names them; the course directory (where
    grading runs) and the home folder are the instructor's too.
    """
    pairs = {str(REPO): ""}
    for prefix in {str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve())}:
        if not prefix.startswith(str(REPO) + os.sep) and prefix not in ("/usr", "/usr/local"):
            pairs[prefix] = "<python>"  # a venv or an installation of the instructor's own
    home = os.path.expanduser("~")
    pairs.setdefault(home, "~")
    pairs.setdefault(os.getcwd(), "")
    return sorted(((k, v) for k, v in pairs.items() if k.strip("/")), key=lambda kv: len(kv[0]), reverse=True)


def scrub(text: str) -> str:
    """``text`` with the grading machine's own paths taken out (``course/orders_app.py``, ``~``).

    Feedback goes back to learners: what their notebook printed and the checks' lines, never
    where the instructor keeps the course, the venv, the home folder or the grading folders.
    """
    import re
    import tempfile

    if not text or "/" not in text:
        return text
    tmp = re.escape(tempfile.gettempdir().rstrip("/"))
    text = re.sub(tmp + r"/course-grade-[^/\s'\"]+(/|(?!\w|-|\.\w))", lambda m: "" if m.group(1) else ".", text)
    for host, shown in _host_paths():
        pattern = re.escape(host) + r"(/|(?!\w|-|\.\w))"
        text = re.sub(pattern, lambda m, s=shown: (s + "/" if s else "") if m.group(1) else (s or "."), text)
    return text


def _scrub_graded(graded: Graded) -> None:
    for task in graded.tasks:
        task.feedback = [scrub(line) for line in task.feedback]
        task.tampered = scrub(task.tampered) if task.tampered else task.tampered
    for cell in graded.cells.values():
        cell.stdout, cell.error, cell.cut = scrub(cell.stdout), scrub(cell.error or "") or None, cell.cut
    graded.notes = [scrub(note) for note in graded.notes]
