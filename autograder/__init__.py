"""The grading side of the workbook: nbgrader configuration, the hidden checks, ``course check``."""

from autograder.harness import grade, public, selfcheck

__all__ = ["grade", "public", "selfcheck"]
