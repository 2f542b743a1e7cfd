"""Grading settings shared by the instructor's nbgrader config and ``course check``."""

import os

COURSE_ID = "resilient-backend-patterns"
#: nbgrader's per-cell limit: a cell running longer is interrupted and scores 0.
CELL_TIMEOUT = int(os.environ.get("COURSE_CELL_TIMEOUT", "60"))
#: ``course check``'s hard limit on one whole grading run, past which it kills the kernel.
RUN_TIMEOUT = int(os.environ.get("COURSE_RUN_TIMEOUT", "600"))
#: Where learner code runs while graded: "required" (in the sandbox, or not at all),
#: "auto" (in the sandbox where one works here), "off" (with the grader's own rights).
SANDBOX = os.environ.get("COURSE_SANDBOX", "required")


def apply(c, root: str) -> None:
    """Fill an nbgrader config object ``c`` for a course rooted at ``root``."""
    c.CourseDirectory.course_id = COURSE_ID
    c.CourseDirectory.root = root
    c.CourseDirectory.source_directory = "solutions"
    c.CourseDirectory.release_directory = "notebooks"
    c.CourseDirectory.submitted_directory = "submitted"
    c.CourseDirectory.autograded_directory = "autograded"
    c.CourseDirectory.feedback_directory = "feedback"
    c.CourseDirectory.db_url = f"sqlite:///{root}/gradebook.db"
    # Files nbgrader never copies between folders. Code files are among them: autograde runs
    # the kernel beside the submission's other files, so a handed-in `autograder/` or
    # `course/` package would be imported instead of the real one and grade itself.
    c.CourseDirectory.ignore = [".ipynb_checkpoints", "__pycache__", "feedback", "*.py", "*.pyc", "*.so", "*.pth"]
    c.Execute.timeout = CELL_TIMEOUT
    c.Execute.interrupt_on_timeout = True
    c.ExecutePreprocessor.timeout = CELL_TIMEOUT
    c.OverwriteCells.add_missing_cells = True
    c.ClearSolutions.code_stub = {"python": '# YOUR CODE HERE\nraise NotImplementedError("not done yet")'}
    c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
    c.GenerateAssignment.create_assignment = True
    # Grading runs the setup and answer cells and the checks in a sandboxed process of its
    # own (autograder/grading.py), in place of nbgrader's Execute: demos are never run.
    # (Named as import strings: nbconvert imports them, and this module imports no grader.)
    c.Autograde.autograde_preprocessors = [
        "autograder.nbgrader_plugin.GradeInSandbox",
        "nbgrader.preprocessors.IgnorePattern",
        "nbconvert.preprocessors.ClearMetadataPreprocessor",
        "nbgrader.preprocessors.LimitOutput",
        "nbgrader.preprocessors.SaveAutoGrades",
        "nbgrader.preprocessors.AssignLatePenalties",
        "nbgrader.preprocessors.CheckCellMetadata",
    ]


def write_config(root, extra: str = ""):
    """Write ``root/nbgrader_config.py`` for a throwaway course that applies these settings.

    ``extra`` is appended as more config lines (``c`` is the config object). Used by
    ``course check`` and the tests that drive nbgrader in a temporary folder.
    """
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    path = Path(root) / "nbgrader_config.py"
    path.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(repo)!r})\n"
        "from autograder import settings\n"
        "c = get_config()\n"
        f"settings.apply(c, {str(root)!r})\n" + extra
    )
    return path
