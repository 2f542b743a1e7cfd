"""Resilient Backend Patterns, a live workbook: the package behind the notebooks.

Each module ``course/<pattern>.py`` holds one pattern's reference implementation and
names the chapter that teaches it; :mod:`course.chapters` holds what exists only to show
something in one chapter (``course.chapters.chNN``); :mod:`course.kit.backends` and
:mod:`course.kit.lab` give every run live, isolated Redis and PostgreSQL, and
:mod:`course.kit.faults` holds the fault tools. CONTRIBUTING.md says which goes where.
"""

__version__ = "0.1.0"


def grading() -> bool:
    """True while nbgrader grades a notebook: demos may shrink their sizes, never their logic."""
    import os

    return os.environ.get("NBGRADER_EXECUTION") in ("autograde", "validate")
