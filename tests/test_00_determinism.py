"""The same answer gets the same grade on every run: every kept wrong solution of every
chapter (``WRONG`` in ``tests/test_NN_grading.py``) is graded ``COURSE_DETERMINISM_RUNS``
times (default 3), and its points, verdict and feedback lines must be the same each time.

It is graded as grading does: across the process boundary, the answer in a learner process
of its own behind the run's gateways (``autograder.session.grade_source``), where two
processes' timing could decide what one process's loop never let vary.
``COURSE_DETERMINISM_PATH=kernel`` grades in this process instead, as ``selfcheck`` does.

Not part of ``make test``: run it with ``make test-determinism`` (``RUNS=10 make
test-determinism`` for more), or grade with more repeats through ``make bench``
(``COURSE_DETERMINISM_RUNS``). The marker ``determinism`` selects it.
"""

from __future__ import annotations

import os

import pytest

from autograder.session import grade_source
from tests.helpers import kept_wrong_solutions, outcome_of, run_source

pytestmark = pytest.mark.determinism

RUNS_VARIABLE = "COURSE_DETERMINISM_RUNS"

if not os.environ.get(RUNS_VARIABLE):
    pytest.skip(f"repeated grading runs only with {RUNS_VARIABLE} set (make test-determinism)", allow_module_level=True)

RUNS = max(2, int(os.environ[RUNS_VARIABLE]))
KERNEL = os.environ.get("COURSE_DETERMINISM_PATH") == "kernel"


def _grade(task_id: str, source: str):
    if KERNEL:
        return run_source(task_id, source)
    import textwrap

    return grade_source(task_id, textwrap.dedent(source))


CASES = kept_wrong_solutions()


def _seen(outcome, random: bool):
    """All of an outcome; for an answer random by design, its points, verdict and failures only
    (an ``[ok]`` line may quote the values it drew)."""
    points, passed, lines = outcome
    return (points, passed, tuple(x for x in lines if "[FAIL]" in x)) if random else outcome


@pytest.mark.parametrize(("task_id", "name", "source", "random"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_wrong_solution_gets_one_verdict_on_every_run(task_id, name, source, random):
    first = _seen(outcome_of(_grade(task_id, source)), random)
    for run in range(2, RUNS + 1):
        again = _seen(outcome_of(_grade(task_id, source)), random)
        assert again == first, (
            f"{task_id}, wrong solution {name!r}: run 1 and run {run} of {RUNS} disagree\n"
            f"run 1: {first[0]:g} points, passed={first[1]}\n  " + "\n  ".join(first[2]) + "\n"
            f"run {run}: {again[0]:g} points, passed={again[1]}\n  " + "\n  ".join(again[2])
        )
