"""Feedback for every learner (autograder/feedback.py), on a course folder made by hand: nothing graded here.

nbgrader's own commands run these in tests/test_instructor_flow.py; here, the cases that flow
does not reach: a learner graded before whose newest submission was not, a page left from a
run before the learner was graded, and a chapter in which nobody could be graded.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from autograder import feedback

REPO = Path(__file__).resolve().parent.parent
CH03 = "03_idempotency"
OTHER = (REPO / "notebooks" / "01_timeouts_and_retries" / "01_timeouts_and_retries.ipynb").read_text()
OWN = (REPO / "notebooks" / CH03 / f"{CH03}.ipynb").read_text()


def _hand_in(root: Path, student: str, text: str, stamp: str, *, graded_stamp: str | None = None) -> None:
    folder = root / "submitted" / student / CH03
    folder.mkdir(parents=True)
    (folder / f"{CH03}.ipynb").write_text(text)
    (folder / "timestamp.txt").write_text(stamp)
    (folder / "submission_secret.txt").write_text("s3cret")
    if graded_stamp:
        graded = root / "autograded" / student / CH03
        graded.mkdir(parents=True)
        (graded / f"{CH03}.ipynb").write_text(OWN)
        (graded / "timestamp.txt").write_text(graded_stamp)


def _converter(root: Path, **coursedir) -> SimpleNamespace:
    settings = {"root": str(root), "assignment_id": CH03, "student_id": "*", "student_id_exclude": ""} | coursedir
    return SimpleNamespace(coursedir=SimpleNamespace(**settings), log=logging.getLogger("test_00_feedback"))


def test_a_learner_never_graded_gets_a_page_that_says_why_and_can_have_it_released(tmp_path):
    _hand_in(tmp_path, "dee", OTHER, "2026-12-10 16:00:00 UTC")
    assert feedback.write_not_graded(_converter(tmp_path)) == [
        ("dee", f"{CH03}.ipynb: this is chapter 01's notebook, handed in as {CH03}")
    ]
    out = tmp_path / "feedback" / "dee" / CH03
    page = (out / f"{CH03}.html").read_text()
    assert (
        "this is chapter 01&#x27;s notebook, handed in as 03_idempotency" in page and "handed in at 2026-12-10" in page
    )
    assert str(tmp_path) not in page
    assert (out / "submission_secret.txt").read_text() == "s3cret" and (out / "timestamp.txt").is_file()


def test_a_learner_graded_before_keeps_that_feedback_with_a_note_on_the_newest(tmp_path):
    _hand_in(tmp_path, "ada", '{"cells": [', "2026-12-11 09:00:00 UTC", graded_stamp="2026-12-10 16:00:00 UTC")
    page = tmp_path / "feedback" / "ada" / CH03 / f"{CH03}.html"
    page.parent.mkdir(parents=True)
    page.write_text("<html><head></head><body><h1>03_idempotency (Score: 7.0 / 10.0)</h1></body></html>")
    for _ in range(2):  # a second run replaces its note
        (listed,) = feedback.write_not_graded(_converter(tmp_path))
    assert listed[0] == "ada" and "is not a notebook (broken JSON" in listed[1]
    text = page.read_text()
    assert text.count(feedback.NOTE) == 1 and "Score: 7.0 / 10.0" in text
    assert "Your newest submission (handed in at 2026-12-11 09:00:00 UTC) was not graded" in text
    assert "This feedback is on the one handed in at 2026-12-10 16:00:00 UTC." in text


def test_a_learner_graded_since_gets_nbgraders_feedback_again(tmp_path):
    _hand_in(tmp_path, "dee", OWN, "2026-12-10 16:00:00 UTC")
    converter = _converter(tmp_path)
    feedback.write_not_graded(converter)
    assert feedback.why_not_graded(tmp_path, "dee", CH03).startswith("it has not been graded yet")
    graded = tmp_path / "autograded" / "dee" / CH03
    graded.mkdir(parents=True)
    (graded / f"{CH03}.ipynb").write_text(OWN)
    (graded / "timestamp.txt").write_text("2026-12-10 16:00:00 UTC")
    assert feedback.why_not_graded(tmp_path, "dee", CH03) is None
    feedback._remove_stale(converter)  # nbgrader would otherwise skip a feedback folder that exists
    assert not (tmp_path / "feedback" / "dee" / CH03).exists()


def test_a_chapter_nobody_could_be_graded_in_still_gets_its_pages(tmp_path, caplog):
    from nbgrader.converters.base import NbGraderException

    _hand_in(tmp_path, "dee", OTHER, "2026-12-10 16:00:00 UTC")

    def nothing_autograded(self):
        raise NbGraderException(f"No notebooks were matched by 'autograded/*/{CH03}'")

    converter = _converter(tmp_path)
    with caplog.at_level(logging.WARNING, logger="test_00_feedback"):
        feedback._guarded_generate(nothing_autograded)(converter)  # no error: every learner has feedback
    assert (tmp_path / "feedback" / "dee" / CH03 / f"{CH03}.html").is_file()
    assert caplog.messages == [
        f"not graded, so their feedback says why: dee ({CH03}.ipynb: this is chapter 01's notebook, handed in as {CH03})"
    ]

    def broken(self):
        raise NbGraderException("Please see the the above traceback")

    with pytest.raises(NbGraderException):  # nbgrader's own failures still fail the command
        feedback._guarded_generate(broken)(converter)
