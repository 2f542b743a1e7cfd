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
#: nbgrader's exchange on a shared machine: outside every repository, writable by every learner.
#: An account's own Jupyter config (``c.Exchange.root`` in ``~/.jupyter/nbgrader_config.py``,
#: or the machine's in ``/etc/jupyter/``) wins over this default: see :func:`exchange_root`.
EXCHANGE = "/srv/nbgrader/exchange"
#: Where nbgrader writes grades when none is named (``nbgrader export``), git-ignored.
GRADES_CSV = "grades.csv"


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
    # Locked and test cells are put back from the gradebook before grading, as nbgrader does,
    # but compared with what the learner was given (hidden tests removed), so an untouched
    # notebook grades without a warning and a real change is named in one line.
    c.Autograde.sanitize_preprocessors = [
        "nbgrader.preprocessors.ClearOutput",
        "nbgrader.preprocessors.DeduplicateIds",
        "nbgrader.preprocessors.OverwriteKernelspec",
        "autograder.nbgrader_plugin.RestoreLockedCells",
        "nbgrader.preprocessors.CheckCellMetadata",
    ]
    # `nbgrader export`: assigned chapters only, a status and a timestamp per submission,
    # a missing submission distinct from a zero (autograder/export.py).
    c.ExportApp.plugin_class = "autograder.export.RegistrarExport"
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
    # Before autograde deletes or stamps anything, and before submit copies: a notebook that
    # is not valid JSON (or servers that do not answer) is named in one line, never graded.
    # (Another account may load this config where the course's packages are not importable,
    # as the instructor-flow test does: the config still loads, and nbgrader runs unguarded.)
    import importlib

    try:
        importlib.import_module("autograder.nbgrader_plugin").install_guards()
    except ImportError:
        pass


def exchange_root() -> str | None:
    """The exchange this course should set, or None when the account's Jupyter config sets one.

    nbgrader reads the course directory's ``nbgrader_config.py`` after the account's own
    (``~/.jupyter``, ``$JUPYTER_CONFIG_DIR``, ``/etc/jupyter``), so whatever it sets wins.
    This repository's config therefore sets the exchange only when none of those does: a
    learner's ``c.Exchange.root`` stays theirs, and an account with no setting gets
    :data:`EXCHANGE`.
    """
    global _LOOKING
    if _LOOKING:  # an account's config that loads this repository's config: it is being read already
        return None
    _LOOKING = True
    try:
        return _exchange_root()
    finally:
        _LOOKING = False


_LOOKING = False


def _exchange_root() -> str | None:
    from jupyter_core.paths import jupyter_config_path
    from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder in jupyter_config_path():
        if os.path.abspath(folder) == here:
            continue
        for loader, name in (
            (PyFileConfigLoader, "nbgrader_config.py"),
            (JSONFileConfigLoader, "nbgrader_config.json"),
        ):
            if not os.path.isfile(os.path.join(folder, name)):
                continue
            try:
                config = loader(name, path=folder).load_config()
            except Exception:  # noqa: BLE001 - nbgrader reports a broken file of the account's itself
                continue
            if "root" in config.get("Exchange", {}):
                return None
    return EXCHANGE


def prepare_process() -> None:
    """What every process that runs nbgrader on this course needs, whatever its ``PATH``.

    - nbgrader runs the ``alembic`` program when it creates ``gradebook.db``: without the
      interpreter's own ``bin`` folder on ``PATH`` (a venv not activated) it fails after
      creating half a database. The folder goes first on ``PATH``.
    - nbgrader's gradebook code makes SQLAlchemy 2 warn "Object of type <SubmittedAssignment>
      not in session" for every new submission; the objects are added to the session right
      after, so the warning says nothing an instructor can act on and is silenced (that one
      message only).
    """
    import sys
    import warnings

    bin_dir = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + (os.pathsep + path if path else "")
    try:
        from sqlalchemy.exc import SAWarning
    except ImportError:  # pragma: no cover - nbgrader depends on SQLAlchemy
        return
    warnings.filterwarnings("ignore", r"Object of type <Submitted\w+> not in session", SAWarning)


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
        "settings.prepare_process()\n"
        f"settings.apply(c, {str(root)!r})\n" + extra
    )
    return path
