"""The instructor's flow, run with nbgrader's own command-line tools on every chapter.

Each test builds a temporary course directory laid out like the repository (``solutions/``
is nbgrader's source folder, ``notebooks/`` its release folder) and configured by the
same ``autograder.settings.apply`` as the repository's ``nbgrader_config.py``. It then
runs what an instructor runs: ``nbgrader generate_assignment``, ``autograde`` (once per
assignment, over every student), ``generate_feedback`` and ``export``, and reads the
scores back from the CSV and the gradebook.

Three learners hand in every chapter: ``full`` (every answer cell holds the reference
solution), ``stub`` (the notebook as released) and ``partial`` (the solution in some
answer cells only). Two more cover what learners do to notebooks: ``deleted_test``
deletes a test cell (nbgrader must put it back and grade it), ``loops`` leaves a loop that
never ends in an answer cell (the per-cell time limit cuts it: that task scores 0, the
others are graded). The release, submit, collect and feedback round trip through
nbgrader's exchange is covered once, on the first chapter.

The live servers come from ``course.kit.backends.servers()`` in this process and reach the
grading kernels through ``REDIS_URL`` / ``DATABASE_URL`` with ``COURSE_BACKEND=env``.
"""

from __future__ import annotations

import ast
import csv
import html
import json
import os
import re
import shutil
import subprocess
import symtable
import sys
import time
from functools import cache
from pathlib import Path

import pytest

from autograder import settings
from autograder.check import chapters

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
CHAPTERS = chapters()  # assignment name -> solutions/NN_slug/NN_slug.ipynb
#: per-cell time limit of the course that grades the endless loop (the real one is 120 s)
SHORT_CELL_TIMEOUT = 10
#: what a learner might leave in an answer cell: a retry loop waiting for a success that never comes
ENDLESS = "attempts = 0\nwhile True:  # retry until it works\n    attempts += 1\n"
#: a test cell a learner "fixed"
TAMPERED = "# the checks were too strict\n"

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- notebooks


def _nb(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _src(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _meta(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def answer_cells(nb: dict) -> dict[str, dict]:
    """grade_id -> code answer cell (nbgrader ``solution: true``), in notebook order."""
    return {_meta(c)["grade_id"]: c for c in nb["cells"] if c["cell_type"] == "code" and _meta(c).get("solution")}


def graded_cells(nb: dict) -> dict[str, float]:
    """grade_id -> points of every autograded test cell (code, graded, not an answer), in notebook order."""
    return {
        _meta(c)["grade_id"]: float(_meta(c).get("points", 0))
        for c in nb["cells"]
        if c["cell_type"] == "code" and _meta(c).get("grade") and not _meta(c).get("solution")
    }


def manual_points(nb: dict) -> float:
    """Points of manually graded answers (graded answer cells): autograde leaves them at 0."""
    return sum(
        float(_meta(c).get("points", 0)) for c in nb["cells"] if _meta(c).get("grade") and _meta(c).get("solution")
    )


def solution_text(cell: dict) -> str:
    """The answer a learner who wrote the reference solution would hand in (markers removed)."""
    keep = [line for line in _src(cell).splitlines() if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION")]
    return "\n".join(keep)


def _parse(src: str) -> ast.AST | None:
    flags = ast.PyCF_ONLY_AST | getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
    try:
        return compile(src, "<cell>", "exec", flags=flags)
    except SyntaxError:
        return None


def _defines(src: str) -> set[str]:
    tree = _parse(src)
    names: set[str] = set()
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _uses(src: str) -> set[str]:
    """Global names a cell reads (not a function's parameters or locals)."""
    try:
        top = symtable.symtable(src, "<cell>", "exec")
    except SyntaxError:  # top-level await: fall back to every name in the cell
        tree = _parse(src)
        return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} if tree else set()
    names: set[str] = set()
    todo = [top]
    while todo:
        table = todo.pop()
        module_level = table.get_type() == "module"
        for sym in table.get_symbols():
            if sym.is_referenced() and (module_level or sym.is_global()):
                names.add(sym.get_name())
        todo.extend(table.get_children())
    return names


class Plan:
    """Which answer cells a task depends on, worked out from the solution notebook.

    A task needs its own answer cell, the answer cells that define the names its check
    takes (``needs=`` in autograder/checks), and whatever those cells use from other
    answer cells. A submission earns a task's points when all of them hold the solution.
    """

    def __init__(self, source: dict):
        from autograder.harness import get_task

        self.answers = answer_cells(source)
        self.tests = graded_cells(source)
        self.definer = {name: gid for gid, cell in self.answers.items() for name in _defines(solution_text(cell))}
        self.tasks = [gid.removeprefix("check_") for gid in self.tests]
        self.max_score = sum(self.tests.values()) + manual_points(source)
        self.deps: dict[str, set[str]] = {}
        for task in self.tasks:
            try:
                needs = set(get_task(task).needs)
            except KeyError:
                needs = set()
            start = {task} & set(self.answers) | {self.definer[n] for n in needs if n in self.definer}
            self.deps[task] = self._closure(start)

    def _closure(self, cells: set[str]) -> set[str]:
        todo, seen = list(cells), set(cells)
        while todo:
            gid = todo.pop()
            for name in _uses(solution_text(self.answers[gid])):
                other = self.definer.get(name)
                if other and other not in seen:
                    seen.add(other)
                    todo.append(other)
        return seen

    def points(self, task: str) -> float:
        return self.tests[f"check_{task}"]

    def solved(self, filled: set[str]) -> set[str]:
        return {t for t in self.tasks if self.deps[t] and self.deps[t] <= filled}

    def score(self, filled: set[str]) -> float:
        return sum(self.points(t) for t in self.solved(filled))

    def partial_fill(self) -> set[str] | None:
        """Answer cells to fill for a score strictly between 0 and full; None if impossible."""
        for k in range(max(1, len(self.tasks) // 2), 0, -1):
            for first in range(len(self.tasks) - k + 1):
                fill = set().union(*(self.deps[t] for t in self.tasks[first : first + k]))
                if 0 < self.score(fill) < self.score(set(self.answers)):
                    return fill
        return None

    def needed_by_others(self, task: str) -> bool:
        return any(task in self.deps[t] for t in self.tasks if t != task)

    def loop_fill(self) -> tuple[str, set[str]] | None:
        """A task whose answer cell can loop forever while a later task is solved: (task, cells to fill)."""
        for task in self.tasks:
            if task not in self.answers or self.needed_by_others(task):
                continue
            fill = set(self.answers) - {task}
            if any(t in self.solved(fill) for t in self.tasks[self.tasks.index(task) + 1 :]):
                return task, fill
        return None


def submission(released: dict, source: dict, fill: set[str], *, replace: dict[str, str] | None = None) -> dict:
    """The released notebook with the solution typed into the answer cells in ``fill``."""
    nb = json.loads(json.dumps(released))
    solutions = answer_cells(source)
    for cell in nb["cells"]:
        gid = _meta(cell).get("grade_id")
        if replace and gid in replace:
            cell["source"] = replace[gid]
        elif gid in fill and gid in solutions:
            cell["source"] = solution_text(solutions[gid])
    return nb


# ----------------------------------------------------------------------------- the course


@pytest.fixture(scope="module")
def grading_env() -> dict[str, str]:
    """Environment of the nbgrader commands: the live servers of this process, the venv first on PATH."""
    from course.kit import backends

    env = dict(os.environ)
    env.update(backends.servers().as_env())
    env["COURSE_BACKEND"] = "env"
    env["PATH"] = str(VENV_BIN) + os.pathsep + env.get("PATH", "")  # nbgrader runs `alembic` from PATH
    env.setdefault("MPLBACKEND", "Agg")
    env.pop("NBGRADER_EXECUTION", None)
    return env


class Course:
    """A temporary nbgrader course directory laid out like the repository."""

    def __init__(self, root: Path, env: dict[str, str], assignments: list[str], *, extra_config: str = ""):
        self.root = root
        # nbgrader keeps the learners' submission cache and kernels their connection files in Jupyter's
        # data and runtime folders: keep them in the test's folder, not in the home directory
        self.env = {
            **env,
            "JUPYTER_DATA_DIR": str(root.parent / "jupyter-data"),
            "JUPYTER_RUNTIME_DIR": str(root.parent / "jupyter-runtime"),
        }
        self.exchange = root.parent / "exchange"
        self.exchange.mkdir(exist_ok=True)
        self.times: dict[str, float] = {}
        for name in assignments:
            shutil.copytree(
                REPO / "solutions" / name, root / "solutions" / name, ignore=shutil.ignore_patterns(".*", "__pycache__")
            )
        settings.write_config(root, f"c.Exchange.root = {str(self.exchange)!r}\n" + extra_config)

    def nbgrader(self, *args: str, cwd: Path | None = None, timeout: float = 900) -> str:
        started = time.perf_counter()
        proc = subprocess.run(
            [str(VENV_BIN / "nbgrader"), *args],
            cwd=cwd or self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        key = " ".join(a for a in args if not a.startswith("-"))
        self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - started
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"`nbgrader {' '.join(args)}` exited with {proc.returncode}:\n{log[-4000:]}"
        return log

    def submit_folder(self, student: str, assignment: str, nb: dict) -> None:
        """Put a notebook where ``nbgrader collect`` (or zip_collect) would: submitted/<student>/<assignment>/."""
        folder = self.root / "submitted" / student / assignment
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{assignment}.ipynb").write_text(json.dumps(nb, indent=1))
        (folder / "timestamp.txt").write_text(time.strftime("%Y-%m-%d %H:%M:%S.000000 UTC", time.gmtime()))

    def learner_home(self, student: str) -> Path:
        """A learner's own folder, configured to reach the course's exchange."""
        home = self.root.parent / f"home-{student}"
        home.mkdir(exist_ok=True)
        (home / "nbgrader_config.py").write_text(
            "c = get_config()\n"
            f"c.Exchange.root = {str(self.exchange)!r}\n"
            f"c.CourseDirectory.course_id = {settings.COURSE_ID!r}\n"
        )
        return home

    def hand_in_through_exchange(self, student: str, assignment: str, answer) -> None:
        """The learner fetches the released assignment, works on it and submits it."""
        home = self.learner_home(student)
        self.nbgrader("fetch_assignment", assignment, cwd=home)
        fetched = home / assignment / f"{assignment}.ipynb"
        fetched.write_text(json.dumps(answer(_nb(fetched)), indent=1))
        self.nbgrader("submit", assignment, f"--student={student}", cwd=home)

    def released(self, assignment: str) -> dict:
        return _nb(self.root / "notebooks" / assignment / f"{assignment}.ipynb")

    def grades_csv(self) -> dict[tuple[str, str], dict]:
        self.nbgrader("export")
        with open(self.root / "grades.csv", newline="") as fh:
            return {(row["assignment"], row["student_id"]): row for row in csv.DictReader(fh)}

    def cell_grades(self, assignment: str, student: str) -> dict[str, float | None]:
        """grade_id -> score recorded in the gradebook (None: not graded)."""
        from nbgrader.api import Gradebook

        out = {}
        with Gradebook(f"sqlite:///{self.root}/gradebook.db") as gb:
            sub = gb.find_submission_notebook(assignment, assignment, student)
            for grade in sub.grades:
                out[grade.name] = grade.score
        return out

    def autograded(self, assignment: str, student: str) -> dict:
        return _nb(self.root / "autograded" / student / assignment / f"{assignment}.ipynb")

    def report(self, label: str) -> str:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.times.items())
        return f"{label}: {parts}; total {sum(self.times.values()):.1f} s"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cell_output(nb: dict, grade_id: str) -> str:
    for cell in nb["cells"]:
        if _meta(cell).get("grade_id") == grade_id:
            parts = []
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    parts.append(_src({"source": out.get("text", "")}))
                elif out.get("output_type") == "error":
                    parts.append(_ANSI.sub("", "\n".join(out.get("traceback", [])[-4:])))
            return "\n".join(parts).strip()
    return "<cell not found>"


def feedback_text(path: Path) -> str:
    text = re.sub(r"<[^>]+>", " ", path.read_text(encoding="utf-8"))
    return " ".join(html.unescape(text).split())


def _chapter_params():
    if not CHAPTERS:
        return [pytest.param(None, marks=pytest.mark.skip(reason="no chapter in solutions/"))]
    return list(CHAPTERS)


# ----------------------------------------------------------------------------- the tests


def test_repository_config_is_the_graded_config():
    """The config an instructor loads at the repository root is the one these courses use."""
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader("nbgrader_config.py", path=str(REPO)).load_config()
    cd = cfg.CourseDirectory
    assert (cd.root, cd.source_directory, cd.release_directory) == (str(REPO), "solutions", "notebooks")
    assert cd.course_id == settings.COURSE_ID
    assert cfg.OverwriteCells.add_missing_cells is True, "a deleted test cell would go ungraded"
    assert cfg.Execute.timeout == settings.CELL_TIMEOUT and cfg.Execute.interrupt_on_timeout is True
    assert cfg.Exchange.root, "the assignment list needs an exchange folder"


def test_a_submission_cannot_bring_its_own_autograder(tmp_path):
    """autograde copies every other file of a submission next to the notebook and runs the kernel there,
    so an ``autograder/`` package handed in beside a stub notebook would be imported instead of the
    course's and grade it full marks (tried: 2/2 on chapter 00). The instructor's config must keep
    such files out; this asks nbgrader's own file walk (the one autograde uses) what it would copy."""
    from nbgrader.utils import find_all_files
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader("nbgrader_config.py", path=str(REPO)).load_config()
    handed_in = tmp_path / "submitted" / "learner" / "00_setup_and_tour"
    for name in ("autograder/__init__.py", "course.py", "harness.cpython-311-x86_64-linux-gnu.so", "a.ipynb"):
        (handed_in / name).parent.mkdir(parents=True, exist_ok=True)
        (handed_in / name).write_text("def grade(*args): pass\n")
    copied = find_all_files(str(handed_in), list(cfg.CourseDirectory.ignore) + ["*.ipynb"])
    importable = [Path(f).relative_to(handed_in).as_posix() for f in copied if f.endswith((".py", ".so"))]
    assert not importable, (
        f"autograde would copy {importable} next to the learner's notebook, where the kernel imports them"
    )


@cache
def edge_chapter() -> str | None:
    """Where the deleted test cell and the endless loop go: the first chapter (01 by preference)
    with a task whose answer can loop while a later task is graded."""
    for name in sorted(CHAPTERS, key=lambda n: (not n.startswith("01_"), n)):
        if Plan(_nb(CHAPTERS[name])).loop_fill():
            return name
    return None


def test_a_chapter_takes_the_deleted_test_cell_and_the_endless_loop():
    assert edge_chapter(), (
        "no chapter has a task whose answer cell can loop forever while a later task is solved: "
        "the deleted-test-cell and endless-loop cases are not covered"
    )


@pytest.mark.parametrize("assignment", _chapter_params())
def test_generate_autograde_feedback_export(assignment, tmp_path, grading_env):
    """Learners hand in the chapter; the CSV says full, zero and partly right.

    On the edge chapter the partly right learner also deleted the test cell of a task they
    solved (nbgrader puts it back and grades it), left an endless loop in another task's answer
    cell (the per-cell time limit cuts it; that task scores 0, the later ones are graded) and
    emptied that task's test cell (nbgrader grades the original).
    """
    edge = assignment == edge_chapter()
    limit = f"c.Execute.timeout = {SHORT_CELL_TIMEOUT}\nc.ExecutePreprocessor.timeout = {SHORT_CELL_TIMEOUT}\n"
    course = Course(tmp_path / "course", grading_env, [assignment], extra_config=limit if edge else "")
    source = _nb(CHAPTERS[assignment])
    plan = Plan(source)
    assert plan.tasks, f"{assignment} has no autograded test cell"

    course.nbgrader("generate_assignment", assignment, "--force")
    released = course.released(assignment)
    released_text = json.dumps(released)
    for marker in ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS"):
        assert marker not in released_text, f"the released {assignment} notebook still contains {marker!r}"

    fills = {"full": set(plan.answers), "stub": set()}
    notebooks = {student: submission(released, source, fill) for student, fill in fills.items()}
    looping = deleted = None
    if edge:
        looping, fills["partial"] = plan.loop_fill()
        deleted = next(t for t in plan.tasks if t in plan.solved(fills["partial"]))
        # the looping task's test cell is also "fixed" by the learner: nbgrader must grade the original
        nb = submission(released, source, fills["partial"], replace={looping: ENDLESS, f"check_{looping}": TAMPERED})
        nb["cells"] = [c for c in nb["cells"] if _meta(c).get("grade_id") != f"check_{deleted}"]
        notebooks["partial"] = nb
    elif plan.partial_fill() is not None:
        fills["partial"] = plan.partial_fill()
        notebooks["partial"] = submission(released, source, fills["partial"])
    else:
        # a chapter with one all-or-nothing task has no partly right submission
        assert len(plan.tasks) == 1, f"no partial submission found for {plan.tasks}"
    expected = {student: plan.score(fill) for student, fill in fills.items()}

    # the first chapter's `full` learner goes through nbgrader's exchange (one JupyterHub class),
    # the others are dropped into submitted/ (what zip_collect or an LMS download gives)
    via_exchange = "full" if assignment == next(iter(CHAPTERS)) else None
    if via_exchange:
        course.nbgrader("release_assignment", assignment)
        course.hand_in_through_exchange(via_exchange, assignment, lambda fetched: notebooks[via_exchange])
        course.nbgrader("collect", assignment)
        assert (course.root / "submitted" / via_exchange / assignment / "timestamp.txt").exists()
    for student, nb in notebooks.items():
        if student != via_exchange:
            course.submit_folder(student, assignment, nb)

    course.nbgrader("autograde", assignment, "--create", "--force")
    course.nbgrader("generate_feedback", assignment, "--force")
    rows = course.grades_csv()
    if via_exchange:
        # only this learner used the exchange; the others get their feedback/ folder by other means
        course.nbgrader("release_feedback", assignment, f"--student={via_exchange}")
        home = course.learner_home(via_exchange)
        course.nbgrader("fetch_feedback", assignment, f"--student={via_exchange}", cwd=home)
        returned = list((home / assignment / "feedback").glob(f"*/{assignment}.html"))
        assert returned, f"fetch_feedback brought no feedback back to the learner's {home / assignment}"
        assert f"(Score: {expected[via_exchange]:.1f} / {plan.max_score:.1f})" in feedback_text(returned[0])
    print(course.report(f"{assignment}, {len(fills)} submissions"))

    for student, fill in fills.items():
        solved = plan.solved(fill)
        graded = course.cell_grades(assignment, student)
        autograded = course.autograded(assignment, student)
        for task in plan.tasks:
            want = plan.points(task) if task in solved else 0.0
            got = graded.get(f"check_{task}")
            assert got == want, (
                f"{assignment}, learner {student!r}: task {task} scored {got} in the gradebook, expected {want} "
                f"(its answer cells {'hold' if task in solved else 'do not hold'} the solution). Cell output:\n"
                + cell_output(autograded, f"check_{task}")
            )
        row = rows[(assignment, student)]
        assert float(row["max_score"]) == plan.max_score
        assert float(row["score"]) == expected[student], (
            f"grades.csv: {student} scored {row['score']}/{row['max_score']} on {assignment}, expected {expected[student]}"
        )
        fb = course.root / "feedback" / student / assignment / f"{assignment}.html"
        assert fb.exists(), f"no feedback for {student}"
        text = feedback_text(fb)
        assert f"{assignment} (Score: {expected[student]:.1f} / {plan.max_score:.1f})" in text
        if student == "stub":
            assert "raises NotImplementedError" in text, "the feedback does not tell the learner the task is not done"
    if "partial" in expected:
        assert 0 < expected["partial"] < expected["full"], expected

    if edge:
        autograded = course.autograded(assignment, "partial")
        assert any(_meta(c).get("grade_id") == f"check_{deleted}" for c in autograded["cells"]), (
            f"the deleted test cell check_{deleted} was not put back into the autograded notebook"
        )
        loop_cell = next(c for c in autograded["cells"] if _meta(c).get("grade_id") == looping)
        cut = [f"{o['ename']}: {o['evalue']}" for o in loop_cell.get("outputs", []) if o.get("output_type") == "error"]
        assert cut, f"the endless loop in {looping}'s answer cell shows no error: was it interrupted at all?"
        test_cell = next(c for c in autograded["cells"] if _meta(c).get("grade_id") == f"check_{looping}")
        assert _src(test_cell) != TAMPERED, f"the edited test cell check_{looping} was graded as the learner left it"
        print(
            f"{assignment}: the endless loop in {looping} was cut ({cut[0]}); "
            f"test cells check_{deleted} (deleted) and check_{looping} (edited) restored"
        )
