"""A class hand-out carries no working answer to a graded task (`course handout`, issue 40)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import servers_env

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def handout(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("handout") / "class"
    done = subprocess.run(
        [sys.executable, "-m", "course.kit.cli", "handout", str(dest)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "left out: solutions/, tests/" in done.stdout and "course/retry.py" in done.stdout, done.stdout
    return dest


def _run(handout: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(handout)}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=handout, env=env, capture_output=True, text=True, timeout=120
    )


def test_it_leaves_out_the_solutions_the_tests_and_the_model_answers(handout):
    for gone in ("solutions", "tests", "benchmarks", "docs/answers", "docs/rubrics"):
        assert not (handout / gone).exists(), gone
    for kept in ("notebooks/03_idempotency/03_idempotency.ipynb", "autograder/checks", "README.md", "HANDOUT.txt"):
        assert (handout / kept).exists(), kept


def test_the_courses_answers_raise_and_the_rest_of_their_modules_works(handout):
    done = _run(
        handout,
        "import course.retry as r, course.leaderboard as lb\n"
        "print(r.__file__)\n"
        "try:\n    r.is_retryable(TimeoutError())\nexcept RuntimeError as e:\n    print('RAISED', e)\n"
        "print('POLICY', r.RetryPolicy().max_attempts)\n",
    )
    assert done.returncode == 0, done.stderr
    assert str(handout) in done.stdout.splitlines()[0], done.stdout  # the hand-out's module, not the course's
    assert "RAISED course.retry.is_retryable is the course's own answer" in done.stdout
    assert "POLICY 5" in done.stdout


@pytest.mark.slow
def test_a_learners_course_check_in_the_handout_says_which_checks_it_leaves_to_the_instructor(handout, tmp_path):
    """Chapter 07's append and projection checks build their event streams with the course's own append: in a
    hand-out they are not graded there, and say so; the search indexer grades as usual."""
    nb = json.loads(
        (REPO / "solutions" / "07_cqrs_and_event_sourcing" / "07_cqrs_and_event_sourcing.ipynb").read_text()
    )
    path = tmp_path / "07_cqrs_and_event_sourcing.ipynb"
    path.write_text(json.dumps(nb))
    env = {**servers_env(), "PYTHONPATH": str(handout), "COURSE_NO_PROGRESS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "autograder.check", str(path), "--json"],
        cwd=handout, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    tasks = {t["id"]: t for t in json.loads(done.stdout)["tasks"]}
    assert tasks["search_indexer"]["passed"], tasks
    for task in ("append_events", "account_projection"):
        assert "which this copy of the course leaves out" in tasks[task]["feedback"], tasks[task]
