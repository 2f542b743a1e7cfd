"""The grading contract of every chapter, end to end through `course check` (nbgrader autograde).

For each chapter in solutions/: the solution notebook runs top to bottom against the live
servers with no error and scores full marks; the generated student notebook runs without
crashing the grader and scores zero on every task.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import check, harness
from tests.helpers import servers_env

REPO = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(check.chapters())


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_solution_runs_cleanly_and_scores_full_marks(chapter):
    res = check.check(REPO / "solutions" / chapter / f"{chapter}.ipynb")
    report = check.render(res)
    if not harness.load_chapter(chapter[:2]):  # self-rated (14): nothing to grade, and nothing may break
        assert not res.tasks and not res.cell_errors, report
        return
    assert res.tasks, report
    assert not res.cell_errors, f"cells raised while grading the solution: {res.cell_errors}"
    assert res.score == res.max_score > 0, report


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_student_notebook_scores_zero_without_crashing_the_grader(chapter):
    """Every task 0 points with feedback, and no cell but the stubs raised. Chapter 00 goes through the
    command a learner runs (`course check --json`: exit 1 and the documented JSON); the others call the
    same grader in this process, which saves two interpreter starts each."""
    solution = check.read_notebook(REPO / "solutions" / chapter / f"{chapter}.ipynb")
    student = REPO / "notebooks" / chapter / f"{chapter}.ipynb"
    self_rated = not harness.load_chapter(chapter[:2])  # 14: exit 0, no tasks, nothing to score
    if chapter.startswith("00"):
        proc = subprocess.run(
            [sys.executable, "-m", "course.kit.cli", "check", f"notebooks/{chapter}/{chapter}.ipynb", "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=servers_env(),  # this worker's servers: none started for the call
            timeout=600,
        )
        assert proc.returncode == (0 if self_rated else 1), proc.stdout + proc.stderr
        result = json.loads(proc.stdout)
        assert set(result) == {"notebook", "score", "max_score", "tasks"}
    else:
        res = check.check(student)
        assert not res.cell_errors, f"cells raised while grading the student notebook: {res.cell_errors}"
        result = res.as_json()
    if self_rated:
        assert result["tasks"] == [] and result["max_score"] == 0, result
        return
    autograded = [c for c in solution["cells"] if c["cell_type"] == "code"]  # manually graded answers are markdown
    graded = [c for c in autograded if c.get("metadata", {}).get("nbgrader", {}).get("grade")]
    assert len(result["tasks"]) == len(graded), result
    assert result["score"] == 0 and result["max_score"] > 0, result
    for task in result["tasks"]:
        assert set(task) == {"id", "points", "max_points", "passed", "feedback"}
        assert task["points"] == 0 and not task["passed"] and task["feedback"], task
