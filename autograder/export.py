"""``nbgrader export`` for a registrar: one row per learner and assigned chapter, a status each.

``autograder/settings.py`` makes this nbgrader's export plugin, so the instructor's command
stays ``nbgrader export`` (``--to FILE``, ``--assignment``, ``--student`` work as before) and
writes ``grades.csv``:

- **assigned chapters only**: the chapters recorded in the gradebook, which ``course assign``
  does when a chapter is handed out; a chapter never assigned has no row;
- **every learner in the gradebook** (import the roster with ``nbgrader db student import``
  so that a learner who handed in nothing still has rows);
- ``status``: ``graded``, ``missing`` (nothing handed in: no score, not a zero),
  ``not graded`` (collected into ``submitted/`` or recorded, but autograde has not given it
  its grades yet) or ``needs manual grading``;
- ``timestamp``: when the submission was handed in (UTC, ISO 8601), from the exchange or the
  ``timestamp.txt`` put beside a notebook handed in by hand; ``seconds_late`` past the due date;
- ``note``: why a collected submission is ``not graded`` (another chapter's notebook, not a
  notebook, not graded yet), or that the newest one was not graded and the score is an earlier
  one's (:func:`autograder.feedback.why_not_graded`).
"""

from __future__ import annotations

import csv
from datetime import UTC, datetime
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.plugins import ExportPlugin

from autograder import settings
from autograder.feedback import why_not_graded

COLUMNS = [
    "assignment",
    "student_id",
    "last_name",
    "first_name",
    "email",
    "status",
    "timestamp",
    "duedate",
    "seconds_late",
    "raw_score",
    "late_submission_penalty",
    "score",
    "max_score",
    "note",
]


def _utc(moment: datetime | None) -> str:
    if moment is None:
        return ""
    if moment.tzinfo is None:  # nbgrader stores naive UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _number(value: float | None) -> str:
    return "" if value is None else f"{float(value):g}"


def _status(submission) -> str:
    grades = [g for nb in submission.notebooks for g in nb.grades]
    if grades and all(g.auto_score is None and g.manual_score is None for g in grades):
        return "not graded"  # recorded, but autograde never finished (nbgrader marks such cells "manual")
    if submission.needs_manual_grade:
        return "needs manual grading"
    return "graded"


def rows(gradebook: Gradebook, root: Path | None, assignments=(), students=()) -> list[dict[str, str]]:
    """The export's rows, assignment by assignment, learner by learner."""
    out = []
    for assignment in sorted(gradebook.assignments, key=lambda a: a.name):
        if assignments and assignment.name not in assignments:
            continue
        for student in sorted(gradebook.students, key=lambda s: s.id):
            if students and student.id not in students:
                continue
            row = dict.fromkeys(COLUMNS, "")
            row.update(
                assignment=assignment.name,
                student_id=student.id,
                last_name=student.last_name or "",
                first_name=student.first_name or "",
                email=student.email or "",
                duedate=_utc(assignment.duedate),
                max_score=_number(assignment.max_score),
            )
            try:
                sub = gradebook.find_submission(assignment.name, student.id)
            except MissingEntry:
                collected = root is not None and (root / "submitted" / student.id / assignment.name).is_dir()
                row["status"] = "not graded" if collected else "missing"
                if collected:
                    stamp = root / "submitted" / student.id / assignment.name / "timestamp.txt"
                    row["timestamp"] = _read_stamp(stamp)
                    row["note"] = why_not_graded(root, student.id, assignment.name) or ""
                out.append(row)
                continue
            row["status"] = _status(sub)
            row["timestamp"] = _utc(sub.timestamp)
            row["seconds_late"] = _number(sub.total_seconds_late) if sub.timestamp else ""
            if row["status"] != "not graded":
                penalty = sub.late_submission_penalty or 0.0
                row["raw_score"] = _number(sub.score)
                row["late_submission_penalty"] = _number(penalty)
                row["score"] = _number(max(0.0, sub.score - penalty))
            why = why_not_graded(root, student.id, assignment.name) if root is not None else None
            if why and row["status"] != "not graded":
                row["note"] = f"the newest submission was not graded ({why}); the score is an earlier one's"
            elif why:
                row["note"] = why
            out.append(row)
    return out


def _read_stamp(path: Path) -> str:
    from nbgrader.utils import parse_utc

    try:
        return _utc(parse_utc(path.read_text().strip()))
    except (OSError, ValueError, OverflowError):
        return ""


class RegistrarExport(ExportPlugin):
    """nbgrader's export plugin for this course: see the module docstring."""

    def export(self, gradebook: Gradebook) -> None:
        dest = Path(self.to or settings.GRADES_CSV)
        coursedir = getattr(self.parent, "coursedir", None)
        root = Path(coursedir.root) if coursedir is not None else None
        found = rows(gradebook, root, [str(a) for a in self.assignment], [str(s) for s in self.student])
        partial = dest.with_name(f".{dest.name}.partial")
        with open(partial, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(found)
        partial.replace(dest)  # a reader never sees half a file
        counts: dict[str, int] = {}
        for row in found:
            counts[row["status"]] = counts.get(row["status"], 0) + 1
        chapters = len({r["assignment"] for r in found})
        learners = len({r["student_id"] for r in found})
        summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "no rows"
        self.log.info("Exported %d chapter(s) x %d learner(s) to %s: %s", chapters, learners, dest, summary)
