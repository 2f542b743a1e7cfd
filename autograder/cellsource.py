"""Where a learner's object was defined: the cell's file name and source (standard library only).

The learner's process uses it to run a cell again for a replica (:mod:`autograder.learner`);
the in-kernel harness uses it the same way.
"""

from __future__ import annotations

import inspect
import re


def cell_source(obj) -> tuple[str, str] | None:
    """``(filename, source)`` of the cell (or file) that defined ``obj``, if it can be found.

    Works for answer cells run by the grader (registered in :mod:`linecache`), for cells
    run in a Jupyter kernel (IPython registers them too) and for plain modules.
    """
    import linecache

    target = inspect.unwrap(obj) if callable(obj) else obj
    code = getattr(target, "__code__", None)
    if code is None and callable(target) and not inspect.isclass(target) and not inspect.isroutine(target):
        target = type(target)  # a callable instance (``record = Recorder()``): the cell that defined its class
    if code is None and inspect.isclass(target):
        # a method written in the cell (not one ``@dataclass`` generated, which has no lines)
        for member in vars(target).values():
            member = getattr(member, "__func__", member)
            member = member.fget if isinstance(member, property) else member
            found = getattr(member, "__code__", None)
            own = found is not None and found.co_qualname.startswith(f"{target.__qualname__}.")
            if own and linecache.getlines(found.co_filename):
                code = found
                break
        if code is None:  # only generated methods: the last cell run that defines the class
            defines = re.compile(rf"^class\s+{re.escape(target.__name__)}\b", re.MULTILINE)
            for filename, entry in reversed(list(linecache.cache.items())):
                lines = entry[2] if len(entry) >= 3 else []
                if defines.search("".join(lines)):
                    return filename, "".join(lines)
    if code is None:
        return None
    lines = linecache.getlines(code.co_filename)
    return (code.co_filename, "".join(lines)) if lines else None


def unfinished(obj) -> bool:
    """Is ``obj`` a function still as it was handed out: its body (after a docstring) only ``raise
    NotImplementedError``? Nothing else is: a class, a wrapped function, anything whose source cannot be
    read goes to its check, which finds out by calling it. (A learner's process may say so of any answer:
    an answer said to be unfinished scores zero, so saying it gains nothing.)"""
    import ast
    import textwrap

    if not inspect.isfunction(obj) or hasattr(obj, "__wrapped__"):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError, ValueError):
        return False
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # its docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise):
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
