"""The grading side of the workbook: nbgrader configuration, the hidden checks, ``course check``."""

import ast as _ast
import sys as _sys
import threading as _threading

if _sys.version_info < (3, 12):
    # CPython 3.11 keeps one counter for the AST objects being built; two parses building them at once
    # (the grader reads answer cells in one thread while a check starts a replica in another) raise
    # "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905). One at a time,
    # and with the collector off: a collection during a parse can run a finalizer that logs an error,
    # and formatting its traceback parses again in the same thread (3.11's caret anchors), inside the
    # first parse: a plain lock deadlocked there, a re-entrant one let the inner parse break the outer.
    import gc as _gc

    _parse, _parsing = _ast.parse, _threading.RLock()

    def _one_at_a_time(*args, **kwargs):
        with _parsing:
            collecting = _gc.isenabled()
            _gc.disable()
            try:
                return _parse(*args, **kwargs)
            finally:
                if collecting:
                    _gc.enable()

    _one_at_a_time.__doc__, _one_at_a_time.__wrapped__ = _parse.__doc__, _parse
    _ast.parse = _one_at_a_time

from autograder.harness import grade, public, selfcheck  # noqa: E402

__all__ = ["grade", "public", "selfcheck"]
