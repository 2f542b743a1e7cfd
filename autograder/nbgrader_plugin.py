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

:class:`RestoreLockedCells` takes the place of nbgrader's ``OverwriteCells`` in the sanitizing
step: it puts back every locked and test cell from the gradebook as nbgrader does, but
compares a learner's cell with what the learner was *given* (the released cell, hidden tests
removed), so an untouched notebook passes in silence and a real change is one log line.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path

from nbformat.notebooknode import NotebookNode, from_dict
from nbgrader.api import MissingEntry
from nbgrader.preprocessors import ClearHiddenTests, NbGraderPreprocessor, OverwriteCells
from traitlets import Unicode

from autograder import gradecache, grading, settings


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


def forget_ungraded(resources: dict) -> None:
    """Take back the submission nbgrader recorded before grading failed, if it holds no grade.

    nbgrader's autograde records a submission (grades empty) before it grades; when grading
    cannot run at all (no servers, no sandbox) that record would stay, half done. A submission
    graded before (autograde ``--force``) keeps its earlier grades.
    """
    from nbgrader.api import Gradebook

    info = resources.get("nbgrader") or {}
    try:
        with Gradebook(info["db_url"]) as gb:
            sub = gb.find_submission(info["assignment"], info["student"])
            grades = [g for notebook in sub.notebooks for g in notebook.grades]
            if all(g.auto_score is None and g.manual_score is None for g in grades):
                gb.remove_submission(info["assignment"], info["student"])
    except (KeyError, MissingEntry):
        pass


#: How a flagged answer starts in nbgrader's log (``course grade`` lists flagged submissions too).
FLAGGED = "flagged for a human:"


def flag_submission(resources: dict, lines: list[str]) -> bool:
    """Mark the submitted notebook ``flagged`` in nbgrader's gradebook (formgrader shows the flag).

    A flag is only ever set here, never cleared: an instructor's own flag stays.
    """
    from nbgrader.api import Gradebook

    info = resources.get("nbgrader") or {}
    try:
        with Gradebook(info["db_url"]) as gb:
            notebook = gb.find_submission_notebook(info["notebook"], info["assignment"], info["student"])
            notebook.flagged = True
            gb.db.commit()
        return True
    except (KeyError, MissingEntry):
        return False


def _shown(path: str | Path, root: str | Path) -> str:
    """``path`` relative to the course directory ``root`` when under it."""
    path, root = Path(path).resolve(), Path(root).resolve()
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _guarded_init_destination(original):
    """nbgrader's ``init_destination``, first refusing what cannot be graded, and grading it.

    nbgrader's autograde, before it grades, deletes the autograded folder (``--force`` or a
    newer submission) and stamps the submission's new time in the gradebook; a broken
    notebook then failed with a traceback, leaving the old score under the broken file's
    time, and servers lost mid-run left a traceback and no autograded folder at all. Here,
    before any of that: a submission that is not a notebook or not one of this chapter
    (:mod:`autograder.intake`), servers that do not answer, or a grading run the servers
    stopped answering in is named in one line and skipped (nothing deleted, grade and time
    kept), and the command ends with an error (``_guarded_convert``). A complete grade is
    kept for :class:`GradeInSandbox`, which then only writes it into the notebook.
    """

    def init_destination(self, assignment_id: str, student_id: str) -> bool:
        from autograder import intake

        failed = self.__dict__.setdefault("_course_not_graded", [])
        root = self.coursedir.root
        for notebook in self.notebooks:
            path = Path(notebook)
            why = intake.refusal(path, assignment_id) if path.stem == assignment_id else grading.broken_submission(path)
            if why:
                self.log.error("%s: %s", why.replace(str(path), _shown(path, root)), grading.KEPT)
                failed.append((assignment_id, student_id))
                return False
        try:
            grading.check_servers()
            if _would_grade(self, assignment_id, student_id):
                _pregrade(self, assignment_id)
        except grading.GradingError as err:
            self.log.error("%s of %s not graded: %s", assignment_id, student_id, err)
            failed.append((assignment_id, student_id))
            return False
        return original(self, assignment_id, student_id)

    init_destination._course_guard = True
    return init_destination


def _would_grade(app, assignment_id: str, student_id: str) -> bool:
    """Whether nbgrader's ``init_destination`` will (re)grade this submission (its own rules)."""
    if student_id in (app.coursedir.student_id_exclude or "").split(","):
        return False
    dest = Path(app._format_dest(assignment_id, student_id))
    if not dest.exists() or app.force or app.coursedir.notebook_id != "*":
        return True
    new = app.coursedir.get_existing_timestamp(app._format_source(assignment_id, student_id))
    old = app.coursedir.get_existing_timestamp(str(dest))
    return new is not None and old is not None and new > old


#: Grades made before nbgrader touched anything (``_pregrade``), by cache key, for :class:`GradeInSandbox`.
_PREGRADED: dict[str, grading.Graded] = {}


def _pregrade(app, assignment_id: str) -> None:
    """Grade the chapter's notebook now; :class:`grading.ServersDown` when the run was not complete."""
    import json

    trusted = grading.read_manifest(assignment_id)
    cache = os.environ.get("COURSE_GRADE_CACHE")
    mode = GradeInSandbox(config=app.config).sandbox
    for notebook in app.notebooks:
        if Path(notebook).stem != assignment_id:
            continue
        nb = json.loads(Path(notebook).read_text(encoding="utf-8"))
        graded = gradecache.cached_grade(Path(cache) if cache else None, assignment_id, trusted, nb, sandbox=mode)
        if not graded.complete:
            raise grading.ServersDown(f"the servers stopped answering while grading: {graded.not_graded}")
        _PREGRADED[gradecache.cache_key(grading.build_job(assignment_id, trusted, nb))] = graded


def _guarded_convert(original):
    def convert_notebooks(self) -> None:
        from nbgrader.converters import NbGraderException

        original(self)
        failed = self.__dict__.get("_course_not_graded") or []
        if failed:
            who = ", ".join(f"{s} ({a})" for a, s in failed)
            raise NbGraderException(f"not graded (see the lines above; earlier grades are kept): {who}")

    convert_notebooks._course_guard = True
    return convert_notebooks


def _guarded_check_filename_diff(original):
    """``nbgrader submit``: a notebook that is not valid JSON, or not one of this chapter (a notebook of
    another chapter, a graded cell twice or without its grade_id), is refused with one line, before any copy."""

    def check_filename_diff(self) -> None:
        from autograder import intake

        chapter = self.coursedir.assignment_id
        for nb in sorted(Path(self.src_path).rglob("*.ipynb")):
            if ".ipynb_checkpoints" in nb.parts:
                continue
            why = grading.broken_submission(nb)
            if why:
                self.fail(
                    f"{why.replace(str(nb), _shown(nb, self.src_path))}: nothing was submitted. Open it in "
                    "JupyterLab and save it again (or fetch the chapter again into another folder and copy "
                    "your answers over), then submit"
                )
            if nb == Path(self.src_path) / f"{chapter}.ipynb" and chapter in grading.known_chapters():
                why = intake.refusal(nb, chapter)
                if why:
                    self.fail(f"{why.replace(str(nb), _shown(nb, self.src_path))}: nothing was submitted")
        return original(self)

    check_filename_diff._course_guard = True
    return check_filename_diff


def install_guards() -> None:
    """Put the course's checks into nbgrader's autograde, submit, collect and feedback (idempotent).

    nbgrader has no hook that runs before autograde deletes a learner's autograded folder,
    nor one before submit copies a notebook, nor one to choose what collect takes or to go on
    past a feedback it cannot release, so those methods are wrapped (:mod:`autograder.collect`,
    :mod:`autograder.feedback`): the course's ``nbgrader_config.py`` calls this (through
    :func:`autograder.settings.apply`).
    """
    from nbgrader.converters import Autograde
    from nbgrader.exchange.default.submit import ExchangeSubmit

    if not getattr(Autograde.init_destination, "_course_guard", False):
        Autograde.init_destination = _guarded_init_destination(Autograde.init_destination)
    if not getattr(Autograde.convert_notebooks, "_course_guard", False):
        Autograde.convert_notebooks = _guarded_convert(Autograde.convert_notebooks)
    if not getattr(ExchangeSubmit.check_filename_diff, "_course_guard", False):
        ExchangeSubmit.check_filename_diff = _guarded_check_filename_diff(ExchangeSubmit.check_filename_diff)
    from autograder import collect, feedback

    collect.install()
    feedback.install()


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
        try:
            graded = _PREGRADED.pop(gradecache.cache_key(grading.build_job(assignment, trusted, nb)), None)
            graded = graded or gradecache.cached_grade(
                Path(cache) if cache else None, assignment, trusted, nb, sandbox=self.sandbox
            )
            if not graded.complete:  # the servers stopped answering: nothing may be recorded
                raise grading.ServersDown(f"not graded: {graded.not_graded}")
        except grading.GradingError:
            forget_ungraded(resources)
            raise
        for task in graded.tampered:
            self.log.warning("tampering in %s: %s", task.id, task.tampered)
        if graded.flagged:
            flag_submission(resources, graded.flagged)
            for line in graded.flagged:
                self.log.warning("%s %s", FLAGGED, line)
        for note in graded.notes:
            self.log.warning("%s", note)
        return write_outputs(nb, graded), resources


#: How a change to a locked or test cell starts in nbgrader's log (``course grade`` collects these lines).
CHANGED = "changed by the learner:"


def _snippet(line: str, width: int = 60) -> str:
    line = line.strip()
    return repr(line if len(line) <= width else line[: width - 3] + "...")


def describe_edit(given: str, submitted: str) -> str:
    """What differs between two versions of a cell, in a few words: the first change and how many more."""
    old, new = given.splitlines(), submitted.splitlines()
    changes = [op for op in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not changes:
        return "whitespace changed"
    tag, i1, i2, j1, j2 = changes[0]
    if not new or not "".join(new).strip():
        first = "emptied"
    elif tag == "replace":
        first = f"line {i1 + 1} {_snippet(old[i1])} became {_snippet(new[j1])}"
    elif tag == "delete":
        first = f"line {i1 + 1} {_snippet(old[i1])} removed"
    else:
        first = f"{_snippet(new[j1])} added after line {i1}"
    more = len(changes) - 1
    return first + (f", and {more} more change{'s' * (more > 1)}" if more and first != "emptied" else "")


class _Drop(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


class RestoreLockedCells(OverwriteCells):
    """nbgrader's ``OverwriteCells``, comparing a learner's cell with the cell the learner was given.

    nbgrader compares a submitted test cell's checksum with the *source* cell's, which still
    holds the hidden tests the learner never saw, so every untouched notebook warned
    "Attribute 'checksum' for cell check_... has changed!". Here the source cell is put back
    all the same (the hidden tests must run), and a warning is logged only when the cell
    differs from its released version: one line naming the learner, the cell and the change.
    """

    def preprocess(self, nb: NotebookNode, resources: dict):
        self._student = (resources.get("nbgrader") or {}).get("student") or "a learner"
        self._hidden = ClearHiddenTests(parent=self)
        self._reported: set[str] = set()
        return super().preprocess(nb, resources)

    def _kind(self, source_cell) -> str:
        try:
            graded = self.gradebook.find_graded_cell(source_cell.name, self.notebook_id, self.assignment_id)
        except MissingEntry:
            graded = None
        if graded is not None and source_cell.locked:
            return "test cell"
        return "locked cell" if source_cell.locked else "cell"

    def _changed(self, name: str, what: str) -> None:
        self._reported.add(name)
        self.log.warning("%s %s: %s", CHANGED, self._student, what)

    def report_change(self, name: str, attr: str, old, new) -> None:
        source = self.gradebook.find_source_cell(name, self.notebook_id, self.assignment_id)
        kind = self._kind(source)
        if attr == "checksum" and name in self._reported:
            return  # the change that broke the checksum is already named
        if attr == "points":
            self._changed(name, f"{kind} {name}'s points set to {new:g}; graded out of {old:g}")
        elif attr == "cell_type":
            self._changed(name, f"{kind} {name} turned from {old} into {new}; put back as {old}")
        elif attr == "locked":
            self._changed(name, f"{kind} {name} {'unlocked' if old else 'locked'} in its metadata; put back")
        else:  # its nbgrader metadata (grade, solution flags) edited
            self._changed(name, f"{kind} {name}'s nbgrader metadata edited ({attr} differs); put back")

    def released_source(self, source_cell) -> str:
        """The cell's source as the learner received it (nbgrader's release removes hidden tests)."""
        cell = from_dict({"cell_type": source_cell.cell_type, "source": source_cell.source, "metadata": {}})
        if source_cell.cell_type == "code":
            self._hidden._remove_hidden_test_region(cell)
        return cell.source

    def preprocess_cell(self, cell: NotebookNode, resources: dict, cell_index: int):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id is None:
            return cell, resources
        try:
            source_cell = self.gradebook.find_source_cell(grade_id, self.notebook_id, self.assignment_id)
        except MissingEntry:
            return super().preprocess_cell(cell, resources, cell_index)
        if not source_cell.locked or cell.cell_type != source_cell.cell_type:
            return super().preprocess_cell(cell, resources, cell_index)  # nbgrader's checks, worded by report_change
        submitted = cell.source
        given = self.released_source(source_cell)
        if submitted not in (given, source_cell.source):
            kind = self._kind(source_cell)
            self._changed(grade_id, f"{kind} {grade_id} edited ({describe_edit(given, submitted)}); graded as given")
        cell.source = source_cell.source  # nbgrader then finds the checksum it expects and stays quiet
        return super().preprocess_cell(cell, resources, cell_index)

    def add_missing_grade_cells(self, nb: NotebookNode, resources: dict):
        present = {c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells}
        source_nb = self.gradebook.find_notebook(self.notebook_id, self.assignment_id)
        for graded in source_nb.grade_cells:
            if graded.name not in present:
                kind = "test cell" if graded.name in {c.name for c in source_nb.source_cells if c.locked} else "cell"
                self._changed(graded.name, f"{kind} {graded.name} deleted; put back and graded")
        quiet = _Drop("Missing grade cell")
        self.log.addFilter(quiet)
        try:
            nb, resources = super().add_missing_grade_cells(nb, resources)
        finally:
            self.log.removeFilter(quiet)
        if (nb.get("nbformat"), nb.get("nbformat_minor", 0)) >= (4, 5):
            from nbformat.v4.nbbase import random_cell_id

            for cell in nb.cells:  # nbgrader puts cells back without the id nbformat 4.5 requires
                cell.setdefault("id", random_cell_id())
        return nb, resources
