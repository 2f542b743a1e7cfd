"""``course check``: grade one notebook exactly as the instructor's ``nbgrader autograde`` would.

It builds a throwaway nbgrader course around the notebook (the chapter's source from
``solutions/``, the notebook as a submission), runs nbgrader's own generate_assignment
and autograde in a child process under a hard time limit, and reads the scores back from
nbgrader's gradebook, so ``course check`` and the instructor can never disagree.

Code that hangs in a way nbgrader cannot interrupt (a loop that swallows
KeyboardInterrupt) is found by running the notebook cell by cell; such a cell is replaced
by one that raises, and the grading is run again, so only that cell's tasks lose points.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autograder import settings

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO / "solutions"
STUDENT = "learner"
CUT_CELL = 'raise RuntimeError("course check: this cell ran past the time limit and ignored the interrupt; it was cut")'


class BadInput(Exception):
    """The notebook cannot be graded: missing, not a notebook, or of no known chapter."""


@dataclass
class TaskResult:
    id: str
    points: float
    max_points: float
    passed: bool
    feedback: str


@dataclass
class CheckResult:
    notebook: str
    chapter: str
    score: float
    max_score: float
    tasks: list[TaskResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cell_errors: list[str] = field(default_factory=list)  # non-test cells that raised
    seconds: float = 0.0

    def as_json(self) -> dict:
        return {
            "notebook": self.notebook,
            "score": self.score,
            "max_score": self.max_score,
            "tasks": [asdict(t) for t in self.tasks],
        }


# ----------------------------------------------------------------------------- input


def chapters() -> dict[str, Path]:
    """Assignment name -> its source notebook in solutions/."""
    found = {}
    for nb in sorted(SOLUTIONS.glob("[0-9][0-9]_*/*.ipynb")):
        if nb.stem == nb.parent.name:
            found[nb.parent.name] = nb
    return found


def _grade_ids(nb: dict) -> set[str]:
    ids = set()
    for cell in nb.get("cells", []):
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade_id"):
            ids.add(meta["grade_id"])
    return ids


def read_notebook(path: Path) -> dict:
    if not path.exists():
        raise BadInput(f"{path}: no such file")
    if path.is_dir():
        raise BadInput(f"{path}: is a folder; give the path of a chapter notebook (.ipynb)")
    if path.suffix != ".ipynb":
        raise BadInput(f"{path}: not a notebook (expected a .ipynb file)")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not a notebook (not UTF-8 text)") from None
    except json.JSONDecodeError as err:
        raise BadInput(f"{path}: broken JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise BadInput(f"{path}: not a notebook (no list of cells)")
    return nb


def identify(path: Path, nb: dict) -> str:
    """Which chapter a notebook belongs to: by its metadata, its graded cells or its name."""
    known = chapters()
    tagged = nb.get("metadata", {}).get("course", {}).get("chapter")
    if tagged in known:
        return tagged
    ids = _grade_ids(nb)
    if ids:
        best = max(known, key=lambda ch: len(ids & _grade_ids(read_notebook(known[ch]))), default=None)
        if best and ids & _grade_ids(read_notebook(known[best])):
            return best
    if path.stem in known:
        return path.stem
    raise BadInput(f"{path}: not a notebook of a known chapter ({', '.join(known) or 'none found'})")


# ----------------------------------------------------------------------------- grading


def _cache_dir(source: Path) -> Path:
    """Where the gradebook generated from this exact source (and nbgrader) is kept."""
    import hashlib

    import nbgrader

    from course.kit.backends import state_dir

    digest = hashlib.sha256(nbgrader.__version__.encode())
    for path in sorted(source.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and not path.name.startswith("."):
            digest.update(path.relative_to(source).as_posix().encode())
            digest.update(path.read_bytes())
    return state_dir() / "check-cache" / f"{source.name}-{digest.hexdigest()[:16]}"


def _child_env() -> dict:
    """Environment for the grading process: live servers resolved once, here."""
    from course.kit import backends

    env = dict(os.environ)
    srv = backends.servers()
    env.update(srv.as_env())
    env["COURSE_BACKEND"] = "env"
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _run_job(root: Path, assignment: str, timeout: float) -> tuple[bool, str]:
    """Run generate_assignment + autograde in a child; kill its whole group when it is stuck.

    Stuck means past ``timeout``, or a second cell timing out: after a cell ignored
    nbgrader's interrupt, every later cell would wait out its own time limit in turn.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "autograder.nbgrader_job", str(root), assignment, STUDENT],
        cwd=root,
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    stuck = threading.Event()
    interrupts = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "Interrupting kernel" in line:
                interrupts.append(line)
                if len(interrupts) >= 2:
                    stuck.set()
        stuck.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stuck.wait(timeout)  # set at the end of the output too
    if proc.poll() is None:
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):  # already gone
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(5)
            why = "a cell kept running after its time limit" if len(interrupts) >= 2 else f"it took over {timeout:g} s"
            return False, f"grading was stopped: {why}\n" + "".join(lines[-20:])
    reader.join(5)
    return proc.returncode == 0, "".join(lines)


def _find_hanging_cells(nb_path: Path, timeout: float) -> list[int]:
    """Run the notebook cell by cell; return indices of cells that would not stop."""
    proc = subprocess.run(
        [sys.executable, "-m", "autograder.nbgrader_job", "--probe", str(nb_path), str(timeout)],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=settings.RUN_TIMEOUT,
    )
    match = re.search(r"HANGING (\[.*\])", proc.stdout)
    return json.loads(match.group(1)) if match else []


def _cell_errors(graded_nb: dict) -> list[str]:
    """``cell N: NameError: ...`` for every cell outside the test cells that raised."""
    found = []
    for index, cell in enumerate(graded_nb["cells"]):
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade"):
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                found.append(f"cell {index + 1}: {out.get('ename')}: {_ANSI.sub('', out.get('evalue', ''))[:200]}")
    return found


def _results(root: Path, assignment: str, nb_name: str, source: dict, into: CheckResult) -> list[TaskResult]:
    from nbgrader.api import Gradebook

    autograded = root / "autograded" / STUDENT / assignment / f"{nb_name}.ipynb"
    outputs: dict[str, str] = {}
    if autograded.exists():
        graded_nb = json.loads(autograded.read_text())
        into.cell_errors = _cell_errors(graded_nb)
        for cell in graded_nb["cells"]:
            gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            if gid:
                outputs[gid] = _cell_text(cell)
    tasks = []
    with Gradebook(f"sqlite:///{root}/gradebook.db") as gb:
        for cell in source["cells"]:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if not (meta.get("grade") and cell["cell_type"] == "code"):
                continue
            gid = meta["grade_id"]
            try:
                grade = gb.find_grade(gid, nb_name, assignment, STUDENT)
                points = grade.score
            except Exception:  # noqa: BLE001 - no grade recorded means nothing earned
                points = 0.0
            max_points = float(meta.get("points", 0))
            task_id = gid.removeprefix("check_")
            feedback = _feedback(task_id, outputs.get(gid, ""))
            tasks.append(TaskResult(task_id, float(points or 0.0), max_points, (points or 0) >= max_points, feedback))
    return tasks


def _manual_notes(source: dict) -> list[str]:
    """One line per manually graded answer (a graded answer cell): nbgrader leaves it to the instructor."""
    notes = []
    for cell in source["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade") and meta.get("solution"):
            notes.append(
                f"{meta['grade_id']} ({float(meta.get('points', 0)):g} points) is graded by hand by your "
                "instructor; course check does not score it"
            )
    return notes


def _feedback(task_id: str, text: str) -> str:
    """The hidden checks' report when they ran (the public lines repeat part of it)."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if re.match(rf"{re.escape(task_id)}: [0-9.]+/[0-9.]+ points$", line):
            body = [x for x in lines[index + 1 :] if not x.startswith("TaskFailed:")]
            return "\n".join(x[2:] if x.startswith("  ") else x for x in body).strip()
    return "\n".join(x.strip() for x in lines if x.strip()).strip()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _cell_text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append("".join(out.get("text", "")))
        elif out.get("output_type") == "error":
            parts.append(_ANSI.sub("", "\n".join(out.get("traceback", [])[-3:])))
        elif out.get("output_type") == "execute_result":
            parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(p.rstrip("\n") for p in parts if p).strip()


def check(path: str | Path, *, timeout: float = settings.RUN_TIMEOUT, keep: bool = False) -> CheckResult:
    """Grade ``path`` with nbgrader; raise :class:`BadInput` for what cannot be graded."""
    started = time.perf_counter()
    path = Path(path)
    nb = read_notebook(path)
    assignment = identify(path, nb)
    source_nb = chapters()[assignment]
    source = read_notebook(source_nb)
    nb_name = source_nb.stem
    result = CheckResult(str(path), assignment, 0.0, 0.0)

    root = Path(tempfile.mkdtemp(prefix="course-check-"))
    try:
        settings.write_config(
            root, "c.CourseDirectory.source_directory = 'source'\nc.CourseDirectory.release_directory = 'release'\n"
        )
        shutil.copytree(
            source_nb.parent, root / "source" / assignment, ignore=shutil.ignore_patterns(".*", "__pycache__")
        )
        cached = _cache_dir(source_nb.parent) / "gradebook.db"
        if cached.exists():
            shutil.copy2(cached, root / "gradebook.db")
        submitted = root / "submitted" / STUDENT / assignment
        submitted.mkdir(parents=True)
        (submitted / f"{nb_name}.ipynb").write_text(json.dumps(nb))
        ok, log = _run_job(root, assignment, timeout)
        if (root / "gradebook.generated.db").exists() and not cached.exists():
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(f".{os.getpid()}.tmp")
            shutil.copy2(root / "gradebook.generated.db", partial)
            os.replace(partial, cached)  # atomic: concurrent checks never read half a file
        if not ok or "GRADED" not in log:
            cut = _find_hanging_cells(submitted / f"{nb_name}.ipynb", settings.CELL_TIMEOUT)
            if cut:
                for index in cut:
                    nb["cells"][index]["source"] = CUT_CELL
                    result.notes.append(f"cell {index + 1} ran past the time limit and ignored the interrupt: cut")
                (submitted / f"{nb_name}.ipynb").write_text(json.dumps(nb))
                shutil.rmtree(root / "autograded", ignore_errors=True)
                ok, log = _run_job(root, assignment, timeout)
            if not ok or "GRADED" not in log:
                result.notes.append(
                    "nbgrader could not grade this notebook: " + log.strip().splitlines()[-1:][0]
                    if log.strip()
                    else "nbgrader could not grade this notebook"
                )
        result.tasks = _results(root, assignment, nb_name, source, result)
        result.notes.extend(_manual_notes(source))
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    result.score = round(sum(t.points for t in result.tasks), 2)
    result.max_score = round(sum(t.max_points for t in result.tasks), 2)
    result.seconds = time.perf_counter() - started
    return result


def render(res: CheckResult) -> str:
    lines = [f"course check {res.notebook} (chapter {res.chapter})", ""]
    for t in res.tasks:
        mark = "[ok]  " if t.passed else "[FAIL]"
        lines.append(f"{mark} {t.id}: {t.points:g}/{t.max_points:g} points")
        lines.extend(f"    {line}" for line in t.feedback.splitlines())
        lines.append("")
    lines.extend(f"note: {n}" for n in res.notes)
    lines.extend(f"note: {e}" for e in res.cell_errors)
    lines.append(f"total: {res.score:g}/{res.max_score:g} ({res.seconds:.1f} s)")
    return "\n".join(lines)
