"""Helpers for grading tests: run a task's hidden checks on a piece of learner code."""

from __future__ import annotations

import textwrap

from autograder.harness import Result, get_task, run_task


def run_source(task_id: str, source: str, extra: dict | None = None) -> Result:
    """Exec ``source`` (a learner's answer cell) in a fresh namespace and grade ``task_id``."""
    namespace: dict = {"__name__": "__learner__"}
    if extra:
        namespace.update(extra)
    exec(compile(textwrap.dedent(source), f"<answer {task_id}>", "exec"), namespace)
    return run_task(get_task(task_id), namespace)


def assert_rejected(task_id: str, source: str, *, mentions: str | None = None) -> Result:
    res = run_source(task_id, source)
    assert res.points < res.max_points, f"{task_id}: a wrong solution got full marks:\n{res.text()}"
    if mentions:
        assert mentions.lower() in res.text().lower(), f"feedback does not mention {mentions!r}:\n{res.text()}"
    return res


def assert_accepted(task_id: str, source: str) -> Result:
    res = run_source(task_id, source)
    assert res.passed, f"{task_id}: a correct solution was rejected:\n{res.text()}"
    return res
