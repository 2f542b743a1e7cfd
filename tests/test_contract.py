"""The grading contract of every chapter, end to end through `course check` (nbgrader autograde).

For each chapter in solutions/: the solution notebook runs top to bottom against the live
servers with no error and scores full marks; the generated student notebook runs without
crashing the grader and scores zero on every task.
"""

from pathlib import Path

import pytest

from autograder import check

REPO = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(check.chapters())


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_solution_runs_cleanly_and_scores_full_marks(chapter):
    res = check.check(REPO / "solutions" / chapter / f"{chapter}.ipynb")
    report = check.render(res)
    assert res.tasks, report
    assert not res.cell_errors, f"cells raised while grading the solution: {res.cell_errors}"
    assert res.score == res.max_score > 0, report


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_student_notebook_scores_zero_without_crashing_the_grader(chapter):
    solution = check.read_notebook(REPO / "solutions" / chapter / f"{chapter}.ipynb")
    res = check.check(REPO / "notebooks" / chapter / f"{chapter}.ipynb")
    report = check.render(res)
    graded = [c for c in solution["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade")]
    assert len(res.tasks) == len(graded), report
    assert res.score == 0, report
    assert all(t.feedback for t in res.tasks), report
    assert not res.notes, report
