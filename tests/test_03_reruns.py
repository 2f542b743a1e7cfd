"""Chapter 03 in a learner's kernel: Run All three times holds the connection count steady, and the
unfinished student notebook reaches its end with one-line "not done yet" answers."""

from __future__ import annotations

import re

import pytest

from tests.kernel_runs import notebook_path, run_in_one_kernel

CHAPTER = "03_idempotency"
TASKS = ("create_order", "consume_payment_event")


@pytest.mark.slow
def test_03_solution_runs_three_times_in_one_kernel_without_growing_its_connections():
    runs, _ = run_in_one_kernel(notebook_path("solutions", CHAPTER), 3)
    for n, run in enumerate(runs, 1):
        assert not run.errors(), f"run {n}: {run.errors()}"
    assert runs[2].connections == runs[0].connections, [r.connections for r in runs]


@pytest.mark.slow
def test_03_unfinished_student_notebook_runs_to_the_end_saying_not_done_yet_in_one_line():
    (run,), nb = run_in_one_kernel(notebook_path("notebooks", CHAPTER), 1)
    assert not run.errors(), run.errors()
    uses = re.compile(r"(?<![\w.])(" + "|".join(TASKS) + r")\b")  # the learner's own name, not idem.create_order
    seen = 0
    for i in run.outputs:
        text = run.text(i)
        assert "Traceback" not in text, f"cell {i} shows a traceback:\n{text}"
        meta = nb.cells[i].metadata.get("nbgrader", {})
        calls = uses.search(nb.cells[i].source) and not meta.get("solution")
        if calls or meta.get("grade"):
            lines = [line for line in text.splitlines() if line.strip()]
            assert len(lines) == 1 and "not done yet" in lines[0], f"cell {i} says:\n{text}"
            seen += 1
    assert seen >= 2 * len(TASKS)  # a try-it cell and a test cell per task
