"""Chapter 14 (interview drills) has no graded tasks: its drills are self-rated, scheduled by
FSRS (:mod:`course.drill`), and its tests are tests/test_14_drill.py and
tests/test_14_sessions.py. This module exists so the
tooling (``selfcheck("14")``, the manifests, the contract tests) knows the chapter."""

from __future__ import annotations

RULES: dict = {}
REFERENCES: dict[str, list[str]] = {}
