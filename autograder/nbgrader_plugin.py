"""nbgrader's autograde, graded the course's way: in a fresh, sandboxed process, demos not run.

``autograder/settings.py`` puts :class:`GradeInSandbox` where nbgrader's ``Execute``
preprocessor sits in ``Autograde.autograde_preprocessors``. nbgrader has by then restored
every locked and test cell from its gradebook (its own ``OverwriteCells``), so the
notebook's setup cells are the instructor's and its answer cells the learner's. This
preprocessor hands both to :func:`autograder.grading.grade` (the same function behind
``course check``) and writes the result back as cell outputs in the form nbgrader scores:

- a test cell gets the checks' report as its output, plus an error when the task fell
  short (nbgrader then gives 0) or a number when it earned partial credit;
- an answer cell gets what it printed and its error, if any, in one line;
- demo cells are not run while grading and keep no output.

The instructor's commands stay nbgrader's own (``nbgrader autograde``, formgrader); the
class command (:mod:`autograder.classroom`) grades many submissions in parallel first and
leaves the results where this preprocessor finds them (``COURSE_GRADE_CACHE``).
"""

from __future__ import annotations

import os
from pathlib import Path

from nbformat.notebooknode import NotebookNode, from_dict
from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets import Unicode

from autograder import grading, settings


def _stream(text: str) -> NotebookNode:
    return from_dict({"output_type": "stream", "name": "stdout", "text": text if text.endswith("\n") else text + "\n"})


def _error(ename: str, evalue: str) -> NotebookNode:
    return from_dict({"output_type": "error", "ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]})


def _number(points: float) -> NotebookNode:
    return from_dict(
        {
            "output_type": "execute_result",
            "execution_count": None,
            "metadata": {},
            "data": {"text/plain": f"{points:g}"},
        }
    )


def write_outputs(nb: NotebookNode, graded: grading.Graded) -> NotebookNode:
    """Put ``graded`` into ``nb``'s cells as nbgrader-readable outputs."""
    by_task = {t.id: t for t in graded.tasks}
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        meta = cell.get("metadata", {}).get("nbgrader", {}) or {}
        gid = meta.get("grade_id")
        cell["outputs"] = []
        cell["execution_count"] = None
        if meta.get("grade") and gid:
            task = by_task.get(gid.removeprefix("check_"))
            if task is None:
                continue
            cell["outputs"].append(_stream(task.text()))
            if not task.passed:
                if task.points > 0:
                    cell["outputs"].append(_number(task.points))
                else:
                    cell["outputs"].append(
                        _error("TaskFailed", f"{task.id}: {task.points:g}/{task.max_points:g} points")
                    )
        elif gid and gid in graded.cells:
            run = graded.cells[gid]
            if run.stdout:
                cell["outputs"].append(_stream(run.stdout))
            if run.error or run.cut:
                cell["outputs"].append(_error("AnswerCell", run.error or f"cut: {run.cut}"))
    if graded.notes and nb.cells:
        nb.metadata.setdefault("course", {})["grading_notes"] = graded.notes
    return nb


class GradeInSandbox(NbGraderPreprocessor):
    """Grade the notebook with :func:`autograder.grading.grade` instead of executing it."""

    sandbox = Unicode(
        settings.SANDBOX,
        help="'required' (stop when no sandbox works here), 'auto', or 'off' (grade with full rights)",
    ).tag(config=True)

    def preprocess(self, nb: NotebookNode, resources: dict):
        assignment = resources["nbgrader"]["assignment"]
        trusted = grading.read_manifest(assignment)
        stale = grading.stale_setup(trusted, nb)
        if stale:
            raise grading.GradingError(
                f"{assignment}: the grading manifest's setup cells differ from the source notebook's "
                f"({', '.join(stale)}): run `make release` after editing solutions/"
            )
        cache = os.environ.get("COURSE_GRADE_CACHE")
        graded = grading.cached_grade(Path(cache) if cache else None, assignment, trusted, nb, sandbox=self.sandbox)
        for task in graded.tampered:
            self.log.warning("tampering in %s: %s", task.id, task.tampered)
        for note in graded.notes:
            self.log.warning("%s", note)
        return write_outputs(nb, graded), resources
