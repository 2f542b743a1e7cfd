"""Chapter 14 (interview drills) has no graded tasks (see ``autograder/checks/ch14.py``): its
rule table is empty, so there are no kept wrong or correct solutions. This module exists so
``tests/test_00_rules.py`` finds the chapter's ``WRONG`` and ``CORRECT``; the drills' own tests
are ``tests/test_14_drill.py``."""

from __future__ import annotations

WRONG: dict[str, dict[str, tuple[str, str]]] = {}
CORRECT: dict[str, dict[str, str]] = {}
