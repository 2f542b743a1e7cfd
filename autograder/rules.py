"""Rule tables: every requirement a graded task's text states, and the check that enforces it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    text: str  # a verbatim fragment (>= 4 words) of ONE requirement sentence of the task's text
    check: str  # where it is enforced: "check_function_name: what the check does to catch it"
    wrong: str | None = (
        None  # key in WRONG[task] (tests/test_NN_grading.py) of the kept wrong solution that breaks ONLY this rule
    )
    not_graded: bool = False  # the task text itself says this requirement is not graded
