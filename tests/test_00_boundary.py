"""The learner's own kernel and the grading boundary give one answer the same grade and feedback.

``selfcheck``, the visible test cells and Validate run the checks in the learner's kernel
(``autograder.harness.run_task`` on the kernel's names); ``course check``, ``course grade`` and
``nbgrader autograde`` run the answer in a sandboxed process of its own and the checks across the
wire (autograder/session.py). For one kept wrong answer of every task (``WRONG`` in
``tests/test_NN_grading.py``, the first one), both paths must print the same lines and the same
points. ``make test-determinism`` grades every kept wrong answer across the boundary, run after run,
and asks for one outcome.
"""

from __future__ import annotations

import textwrap

import pytest

from autograder.session import grade_source
from tests.helpers import kept_wrong_solutions, outcome_of, run_source


def first_wrong_answers() -> list[tuple[str, str, str]]:
    """The first kept wrong answer of each task (by name) whose own output is not random by design."""
    found, seen = [], set()
    for task_id, name, source, random_by_design in kept_wrong_solutions():
        if task_id not in seen and not random_by_design:
            seen.add(task_id)
            found.append((task_id, name, source))
    return found


CASES = first_wrong_answers()


@pytest.mark.slow
@pytest.mark.parametrize(("task_id", "name", "source"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_the_kernel_and_the_boundary_agree(task_id, name, source):
    here = outcome_of(run_source(task_id, source))
    there = outcome_of(grade_source(task_id, textwrap.dedent(source)))
    assert there == here, (
        f"{task_id}, wrong answer {name!r}: in the kernel {here[0]:g} points, across the boundary {there[0]:g}\n"
        + "\n".join(f"  kernel:   {a}\n  boundary: {b}" for a, b in zip(here[2], there[2], strict=False) if a != b)
    )
