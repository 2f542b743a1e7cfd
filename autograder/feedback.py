"""Feedback for every learner: ``nbgrader generate_feedback`` and ``release_feedback`` go through the whole class.

nbgrader makes feedback from ``autograded/`` only, so a learner whose submission could not be
graded (another chapter's notebook, a broken file, servers lost while grading) got nothing, and
nobody was told; ``release_feedback`` stopped with a traceback at the first feedback of a
notebook handed in by hand (no ``submission_secret.txt``), so every learner after it got
nothing either. Installed into nbgrader's own commands
(:func:`autograder.nbgrader_plugin.install_guards`):

- ``generate_feedback`` writes, for each learner whose newest submission was not graded, a
  feedback page that says why (:func:`why_not_graded`), and ends with one line listing them.
  A learner whose earlier submission was graded keeps that feedback, with a note on top that
  the newest one was not graded, and why.
- ``release_feedback`` releases every learner's feedback it can and lists, in one line, those
  it cannot (handed in by hand, not through the exchange: send them their file).
"""

from __future__ import annotations

import html
import shutil
from pathlib import Path

#: Why a submission that nothing is wrong with has no grade (servers lost while grading it, say).
NOT_YET = "it has not been graded yet (the grading run did not finish for it); your instructor grades it again"
#: Marks a page this module wrote (and may replace), and the note it puts on nbgrader's pages.
MARK = '<meta name="resilient-course" content="not-graded">'
NOTE = '<div class="resilient-course-note"'


def _stamp(folder: Path) -> str | None:
    try:
        return (folder / "timestamp.txt").read_text().strip()
    except OSError:
        return None


def why_not_graded(root: Path, student: str, chapter: str) -> str | None:
    """Why ``student``'s newest submission of ``chapter`` (``submitted/``) has no grade, in words for
    the learner; None when it was graded (its autograded copy is of the same hand-in) or there is none."""
    from autograder import intake

    submitted = root / "submitted" / student / chapter
    notebook = submitted / f"{chapter}.ipynb"
    if not notebook.is_file():
        return None
    autograded = root / "autograded" / student / chapter
    if (autograded / f"{chapter}.ipynb").is_file() and _stamp(autograded) == _stamp(submitted):
        return None
    why = intake.refusal(notebook, chapter)
    if why:
        return why.replace(str(notebook), notebook.name)
    return NOT_YET


def _page(chapter: str, when: str | None, why: str) -> str:
    title = html.escape(f"{chapter}: not graded")
    handed_in = f" (handed in at {html.escape(when)})" if when else ""
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8">{MARK}<title>{title}</title></head>\n'
        f"<body><h1>{html.escape(chapter)}: not graded</h1>\n"
        f"<p>Your submission{handed_in} was not graded: {html.escape(why)}.</p>\n"
        "<p>It has no score, which is not a score of zero. "
        + (
            "Nothing is needed from you.</p>\n"
            if why == NOT_YET
            else "Hand in the chapter's own notebook again (<code>course check</code> on it says the same "
            "first), or ask your instructor.</p>\n"
        )
        + "</body></html>\n"
    )


def _note(when: str | None, why: str, graded_when: str | None) -> str:
    text = (
        f"Your newest submission{f' (handed in at {when})' if when else ''} was not graded: {why}. "
        f"This feedback is on the one handed in{f' at {graded_when}' if graded_when else ' before'}."
    )
    return f'{NOTE} style="border:2px solid #c00;padding:0.5em;margin:1em"><p>{html.escape(text)}</p></div>\n'


def _students(converter) -> list[str]:
    """The learners ``generate_feedback`` is asked about: ``submitted/<student>/<chapter>/``."""
    import fnmatch

    root = Path(converter.coursedir.root)
    pattern = converter.coursedir.student_id or "*"
    excluded = set(filter(None, (converter.coursedir.student_id_exclude or "").split(",")))
    chapter = converter.coursedir.assignment_id
    return sorted(
        folder.parent.name
        for folder in (root / "submitted").glob(f"*/{chapter}")
        if fnmatch.fnmatchcase(folder.parent.name, pattern) and folder.parent.name not in excluded
    )


def write_not_graded(converter) -> list[tuple[str, str]]:
    """The pages and notes above for ``converter``'s chapter; ``[(student, why)]`` for the log line."""
    root = Path(converter.coursedir.root)
    chapter = converter.coursedir.assignment_id
    listed = []
    for student in _students(converter):
        why = why_not_graded(root, student, chapter)
        if why is None:
            continue
        submitted = root / "submitted" / student / chapter
        out = root / "feedback" / student / chapter
        page = out / f"{chapter}.html"
        graded = root / "autograded" / student / chapter / f"{chapter}.ipynb"
        if graded.is_file() and page.is_file() and MARK not in page.read_text(encoding="utf-8"):
            text = page.read_text(encoding="utf-8")
            if NOTE in text:  # a note from an earlier run: replaced
                start = text.index(NOTE)
                text = text[:start] + text[text.index("</div>\n", start) + len("</div>\n") :]
            body = text.find("<body")
            at = text.index(">", body) + 1 if body >= 0 else 0
            note = _note(_stamp(submitted), why, _stamp(graded.parent))
            page.write_text(text[:at] + "\n" + note + text[at:], encoding="utf-8")
        elif not graded.is_file():
            out.mkdir(parents=True, exist_ok=True)
            page.write_text(_page(chapter, _stamp(submitted), why), encoding="utf-8")
            for name in ("timestamp.txt", "submission_secret.txt"):  # what release_feedback needs
                if (submitted / name).is_file():
                    shutil.copy(submitted / name, out / name)
        listed.append((student, why))
    return listed


def _remove_stale(converter) -> None:
    """Pages of this module for learners graded since: nbgrader makes their feedback anew."""
    root = Path(converter.coursedir.root)
    chapter = converter.coursedir.assignment_id
    for page in (root / "feedback").glob(f"*/{chapter}/{chapter}.html"):
        graded = root / "autograded" / page.parent.parent.name / chapter / f"{chapter}.ipynb"
        if graded.is_file() and MARK in page.read_text(encoding="utf-8"):
            shutil.rmtree(page.parent)


def _guarded_generate(original):
    def start(self) -> None:
        from nbgrader.converters.base import NbGraderException

        _remove_stale(self)
        failure = None
        try:
            original(self)
        except NbGraderException as err:
            failure = err
        listed = write_not_graded(self)
        if listed:
            self.log.warning(
                "not graded, so their feedback says why: %s", "; ".join(f"{s} ({why})" for s, why in listed)
            )
        nothing_graded = failure is not None and str(failure).startswith("No notebooks were matched")
        if failure is not None and not (nothing_graded and listed):
            raise failure

    start._course_guard = True
    return start


def _guarded_release(original):
    def copy_files(self) -> None:
        chapter = self.coursedir.assignment_id
        root = Path(self.coursedir.root) / self.coursedir.feedback_directory
        cannot = [
            student
            for student in _released_students(self)
            if list((root / student / chapter).glob("*.html"))
            and not all(
                (root / student / chapter / name).is_file() for name in ("timestamp.txt", "submission_secret.txt")
            )
        ]
        excluded = self.coursedir.student_id_exclude
        self.coursedir.student_id_exclude = ",".join(filter(None, [excluded, *cannot]))
        try:
            original(self)
        finally:
            self.coursedir.student_id_exclude = excluded
        if cannot:
            self.log.warning(
                "not released (handed in by hand, not through the exchange, so there is nothing of theirs "
                "to release it to; send them the file): %s",
                ", ".join(f"{s} (feedback/{s}/{chapter}/)" for s in cannot),
            )

    copy_files._course_guard = True
    return copy_files


def _released_students(app) -> list[str]:
    """The learners ``release_feedback`` is asked about (``--student``, ``--CourseDirectory.student_id_exclude``)."""
    import fnmatch

    chapter = app.coursedir.assignment_id
    pattern = app.coursedir.student_id or "*"
    excluded = set(filter(None, (app.coursedir.student_id_exclude or "").split(",")))
    root = Path(app.coursedir.root) / app.coursedir.feedback_directory
    return sorted(
        folder.parent.name
        for folder in root.glob(f"*/{chapter}")
        if fnmatch.fnmatchcase(folder.parent.name, pattern) and folder.parent.name not in excluded
    )


def install() -> None:
    """Put the pages and lists above into nbgrader's generate_feedback and release_feedback (idempotent)."""
    from nbgrader.converters import GenerateFeedback
    from nbgrader.exchange.default.release_feedback import ExchangeReleaseFeedback

    if not getattr(GenerateFeedback.start, "_course_guard", False):
        GenerateFeedback.start = _guarded_generate(GenerateFeedback.start)
    if not getattr(ExchangeReleaseFeedback.copy_files, "_course_guard", False):
        ExchangeReleaseFeedback.copy_files = _guarded_release(ExchangeReleaseFeedback.copy_files)
