"""The grading side of the workbook: nbgrader configuration, the hidden checks, ``course check``."""

import ast as _ast
import sys as _sys
import threading as _threading

if _sys.version_info < (3, 12):
    # CPython 3.11 keeps one counter for the AST objects being built; two threads building them at
    # once (the grader reads answer cells in one while a check starts a replica in another) can raise
    # "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905). One at a time.
    # Re-entrant: a parse can run a finalizer (garbage collection) that logs an error, and formatting
    # its traceback parses again in the same thread (3.11's caret anchors); a plain lock deadlocked there.
    _parse, _parsing = _ast.parse, _threading.RLock()

    def _one_at_a_time(*args, **kwargs):
        with _parsing:
            return _parse(*args, **kwargs)

    _one_at_a_time.__doc__, _one_at_a_time.__wrapped__ = _parse.__doc__, _parse
    _ast.parse = _one_at_a_time

from autograder.harness import grade, public, selfcheck  # noqa: E402

__all__ = ["grade", "public", "selfcheck"]
