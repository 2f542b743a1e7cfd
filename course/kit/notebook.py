"""The learner's kernel: an unfinished task reads as one line, not as a broken course.

A student notebook's answer cells are stubs that raise ``NotImplementedError("not done
yet")``. Anything that calls one (a try-it cell, a service wrapping the function, a
chapter's demo) would otherwise end in a long traceback through ``course/`` and httpx.

- :func:`install` (called by :func:`course.kit.lab.current` inside Jupyter) shows any
  error caused by a stub as ``not done yet: create_order (write your answer in its cell,
  run it, then run this cell again)``; every other error keeps its normal traceback.
- :func:`try_it` wraps a try-it cell so that an unfinished task prints that line and
  Run All goes on to the next cell.
- :func:`show` puts the source of a pattern from ``course/`` on the page (every chapter uses it).
- :func:`not_done` finds the stub behind an error: in its cause and context chain, in an
  ``ExceptionGroup``, or in an HTTP 501 answer whose body says ``not done yet`` (what
  :mod:`course.kit.serve` answers when a handler hits a stub).
"""

from __future__ import annotations

import contextlib

NOT_DONE = "not done yet"


def _stub_function(err: BaseException) -> str:
    """The name of the function whose stub raised ``err`` (the innermost frame), with its
    class for a method: ``CircuitBreaker.__init__``, not a bare ``__init__``."""
    tb = err.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return getattr(code, "co_qualname", code.co_name).rpartition("<locals>.")[2]  # not the enclosing function


def not_done(err: BaseException | None, _seen: set | None = None) -> str | None:
    """``"create_order"`` (or ``""``) when ``err`` comes from an unfinished answer, else None."""
    seen = _seen if _seen is not None else set()
    if err is None or id(err) in seen:
        return None
    seen.add(id(err))
    if isinstance(err, NotImplementedError):
        return _stub_function(err)
    response = getattr(err, "response", None)
    if response is not None and getattr(response, "status_code", None) == 501:
        try:
            text = response.text
        except Exception:  # noqa: BLE001 - a streamed body that was never read
            text = ""
        if NOT_DONE in text:
            return text.split(NOT_DONE, 1)[1].strip(" :\"'}\n") or ""
    for inner in getattr(err, "exceptions", ()) or ():  # ExceptionGroup, TaskGroup
        found = not_done(inner, seen)
        if found is not None:
            return found
    return not_done(err.__cause__, seen) or not_done(err.__context__, seen)


def message(where: str) -> str:
    name = f": {where}" if where and not where.startswith("<") else ""
    return f"{NOT_DONE}{name} (write your answer in its cell, run it, then run this cell again)"


@contextlib.contextmanager
def try_it():
    """Run a try-it cell's body; an unfinished task prints one line instead of raising."""
    try:
        yield
    except BaseException as err:
        where = not_done(err)
        if where is None:
            raise
        print(message(where))


def _handler(shell, etype, value, tb, tb_offset=None):
    # IPython calls a custom handler instead of showing the error and drops what it returns
    # (``run_code``: ``self.CustomTB(etype, value, tb)``), so the handler shows it itself.
    where = not_done(value)
    if where is None:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return []
    stb = [message(where)]  # the error output shows this one line
    shell._showtraceback(etype, value, stb)
    return stb


_installed = False


def install() -> bool:
    """Show errors that come from unfinished answers as one line in this Jupyter kernel."""
    global _installed
    if _installed:
        return True
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or not hasattr(shell, "set_custom_exc"):
        return False
    shell.set_custom_exc((Exception,), _handler)
    _installed = True
    return True


def show(obj) -> None:
    """Put a pattern's code on the page, straight from ``course/`` and highlighted: the
    function or class a chapter teaches, never a copy of it that could drift. A method is
    shown dedented; a string is shown as it is (a snippet the chapter composes)."""
    import inspect
    import textwrap

    from IPython.display import Code, display

    source = obj if isinstance(obj, str) else textwrap.dedent(inspect.getsource(obj))
    display(Code(source, language="python"))
