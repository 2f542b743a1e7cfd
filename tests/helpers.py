"""Helpers for grading tests: run a task's hidden checks on a piece of learner code."""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from pathlib import Path

from autograder.harness import Result, get_task, run_cell, run_task

REPO = Path(__file__).resolve().parent.parent


def run_source(task_id: str, source: str, extra: dict | None = None) -> Result:
    """Exec ``source`` (a learner's answer cell) in a fresh namespace and grade ``task_id``."""
    from autograder import references

    task = get_task(task_id)
    # the answer's imports of the chapter's reference modules give copies whose references raise, as the
    # sandbox's files do when it is graded; the checks keep the real modules
    namespace: dict = {"__name__": "__learner__", "__builtins__": references.learner_builtins(task.chapter)}
    if extra:
        namespace.update(extra)
    run_cell(textwrap.dedent(source), namespace, f"<answer {task_id} {id(namespace):x}>")
    return run_task(task, namespace)


def assert_rejected(task_id: str, source: str, *, mentions: str | None = None) -> Result:
    res = run_source(task_id, source)
    assert res.points < res.max_points, f"{task_id}: a wrong solution got full marks:\n{res.text()}"
    if mentions:
        assert mentions.lower() in res.text().lower(), f"feedback does not mention {mentions!r}:\n{res.text()}"
    return res


def assert_accepted(task_id: str, source: str) -> Result:
    res = run_source(task_id, source)
    assert res.passed, f"{task_id}: a correct solution was rejected:\n{res.text()}"
    return res


def outcome_of(result: Result) -> tuple[float, bool, tuple[str, ...]]:
    """What a learner is shown of a grade: ``(points, passed, feedback lines)``; two runs of
    the same answer must give equal outcomes (tests/test_00_determinism.py)."""
    return (result.points, result.passed, tuple(result.lines))


def wrong_params(wrong: dict[str, dict[str, tuple[str, str]]]) -> list:
    """``WRONG`` (task -> {name: (source, mentions)}) as ``pytest.param(task, source, mentions)``
    with ids ``task-name``, for ``@pytest.mark.parametrize(("task_id", "source", "mentions"), ...)``."""
    import pytest

    return [
        pytest.param(task_id, source, mentions, id=f"{task_id}-{name}")
        for task_id, entries in wrong.items()
        for name, (source, mentions) in entries.items()
    ]


def correct_params(correct: dict[str, dict[str, str]]) -> list:
    """``CORRECT`` (task -> {name: source}) as ``pytest.param(task, source)`` with ids ``task-name``."""
    import pytest

    return [
        pytest.param(task_id, source, id=f"{task_id}-{name}")
        for task_id, entries in correct.items()
        for name, source in entries.items()
    ]


def solution_source(chapter: str, task_id: str) -> str:
    """The answer cell of ``task_id`` in chapter ``NN``'s solution notebook, as source text."""
    from autograder.rules import notebook_path

    for cell in json.loads(notebook_path(chapter).read_text())["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == task_id and cell["cell_type"] == "code":
            return "".join(cell["source"])
    raise KeyError(f"chapter {chapter} has no answer cell {task_id!r}")


def notebook_with_answers(chapter: str, answers: dict[str, str], folder) -> Path:
    """A copy of a chapter's solution notebook in ``folder`` with some answer cells replaced.

    ``answers`` maps a task id (an answer cell's grade_id) to the source to put there.
    """
    solution = Path(__file__).resolve().parent.parent / "solutions" / chapter / f"{chapter}.ipynb"
    nb = json.loads(solution.read_text())
    missing = set(answers)
    for cell in nb["cells"]:
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell["source"] = textwrap.dedent(answers[grade_id])
            missing.discard(grade_id)
    if missing:
        raise KeyError(f"{chapter} has no answer cell {sorted(missing)}")
    path = Path(folder) / f"{chapter}.ipynb"
    path.write_text(json.dumps(nb))
    return path


def servers_env(**extra: str) -> dict[str, str]:
    """The environment for a ``course``/``nbgrader`` subprocess that grades: this test worker's
    servers (so the child starts none of its own) and this venv's scripts first on ``PATH``."""
    import os
    import sys

    from course.kit import backends

    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, **backends.servers().as_env(), "PATH": path, **extra}


def clear_runtime_folder(uid: int) -> None:
    """``/tmp/resilient-course-UID``, gone: an account made by a test may get the uid of one an earlier test
    removed, and what that one left (its servers' runtime folder) is not the new account's."""
    shutil.rmtree(f"/tmp/resilient-course-{uid}", ignore_errors=True)


def account_python(
    uid: int, gid: int, env: dict[str, str], imports: str, cwd: Path | None = None
) -> tuple[str, dict[str, str]] | None:
    """An interpreter another Unix account can run with the course's packages, and the
    environment it needs: this one, or the distribution's with this venv's site-packages on
    ``PYTHONPATH`` (a venv under /root, 0700, is not theirs to run). ``imports``: what it must import."""
    import subprocess
    import sys
    import sysconfig

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = sysconfig.get_paths()["purelib"]
    for exe, extra in ((sys.executable, {}), (f"/usr/bin/{version}", {"PYTHONPATH": site})):
        try:
            proc = subprocess.run(
                [exe, "-c", f"import {imports}"],
                env={**env, **extra},
                cwd=cwd,
                user=uid,
                group=gid,
                extra_groups=[],
                capture_output=True,
                timeout=60,
            )
        except OSError:
            continue
        if proc.returncode == 0:
            return exe, extra
    return None


def make_handout(dest: Path) -> Path:
    """The docs' hand-out: ``git archive`` of the repository without ``solutions/`` (working tree's tracked files),
    as a tar file at ``dest``."""
    rev = subprocess.run(["git", "-C", str(REPO), "stash", "create"], capture_output=True, text=True).stdout.strip()
    proc = subprocess.run(
        [
            "git",
            "-C",
            str(REPO),
            "archive",
            "--format=tar",
            "-o",
            str(dest),
            rev or "HEAD",
            "--",
            ".",
            ":(exclude)solutions",
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:  # not a git checkout: the same files, copied
        stage = dest.with_suffix(".d")
        shutil.copytree(REPO, stage, ignore=shutil.ignore_patterns(".git", ".venv*", "solutions", "__pycache__"))
        subprocess.run(["tar", "-cf", str(dest), "-C", str(stage), "."], check=True)
        shutil.rmtree(stage)
    dest.chmod(0o644)
    return dest


def kept_wrong_solutions() -> list[tuple[str, str, str, bool]]:
    """``(task, name, source, random)`` of every WRONG entry of every chapter's grading tests;
    ``random`` when the module lists it in ``RANDOM_BY_DESIGN`` (its own output differs per run)."""
    import importlib

    from autograder import harness

    found = []
    for chapter in harness.chapters():
        if not (Path(__file__).resolve().parent / f"test_{chapter}_grading.py").exists():
            continue
        module = importlib.import_module(f"tests.test_{chapter}_grading")
        randoms = getattr(module, "RANDOM_BY_DESIGN", set())
        for task_id, entries in sorted(getattr(module, "WRONG", {}).items()):
            for name, (source, _mentions) in sorted(entries.items()):
                found.append((task_id, name, source, (task_id, name) in randoms))
    return found
