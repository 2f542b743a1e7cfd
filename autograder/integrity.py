"""Tamper evidence for the grading process: what learner code changed in the grader, and undo it.

The grading process (:mod:`autograder.runner`) runs learner code and the hidden checks in
one interpreter: checks call the learner's functions with live pools, clients and callbacks,
which no process boundary could carry. So before any learner code runs, the runner takes
a :class:`Snapshot` of everything a grade depends on: the functions and classes of the
grader (``autograder.*``), of the course (``course.*``), of the standard library modules
the checks use (``random``, ``time``, ``asyncio``, ``builtins``, ...) and of the database
and HTTP clients; which module object each of those names maps to in ``sys.modules``; and
the code, defaults and globals of every such function. After each answer cell and after
each task's checks it compares (:meth:`Snapshot.changes`): a replaced ``grade``, a patched
``Report.expect``, a swapped ``VirtualClock``, a fake ``random.Random``, a new builtin,
an entry of ``sys.modules`` pointing elsewhere, a function whose ``__code__`` was swapped.
Any change costs the task whose code made it all its points, is named in the feedback in
one line, and is undone (:meth:`Snapshot.restore`) so the other tasks are graded by the real
checks.

Plain data that changes at run time (counters, caches, ``os.environ``) is not compared:
only what is called (functions, methods, classes, modules). See docs/INSTRUCTORS.md for
what this does not cover.
"""

from __future__ import annotations

import builtins
import sys
import types
from dataclasses import dataclass, field

#: Modules whose callables a grade depends on (a name, or a package and everything under it).
PROTECTED = (
    "autograder",
    "course",
    "builtins",
    "random",
    "time",
    "asyncio",
    "threading",
    "contextvars",
    "contextlib",
    "functools",
    "inspect",
    "json",
    "traceback",
    "linecache",
    "dataclasses",
    "collections",
    "itertools",
    "heapq",
    "math",
    "os",
    "sys",
    "types",
    "hmac",
    "hashlib",
    "psycopg",
    "psycopg_pool",
    "redis",
    "httpx",
)

#: Packages whose modules must also not gain new names (the grader's and the course's own).
SEALED = ("autograder", "course")

_MISSING = object()


def protected(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PROTECTED)


def _sealed(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in SEALED)


def _watched(value) -> bool:
    """Values whose identity matters: what code calls or looks things up in."""
    if isinstance(value, (types.ModuleType, type)):
        return True
    if isinstance(value, (staticmethod, classmethod, property)):
        return True
    return callable(value)


def _function_parts(fn) -> dict:
    return {
        "__code__": fn.__code__,
        "__defaults__": fn.__defaults__,
        "__kwdefaults__": fn.__kwdefaults__,
        "__globals__": fn.__globals__,
    }


@dataclass
class Snapshot:
    """Who is who in the grader, taken before learner code runs."""

    modules: dict[str, types.ModuleType] = field(default_factory=dict)
    attrs: dict[tuple[int, str], tuple[object, str, object]] = field(default_factory=dict)
    keys: dict[int, tuple[object, frozenset]] = field(default_factory=dict)
    functions: dict[int, tuple[types.FunctionType, dict]] = field(default_factory=dict)

    @classmethod
    def take(cls) -> Snapshot:
        snap = cls()
        for name, module in list(sys.modules.items()):
            if module is None or not protected(name):
                continue
            snap.modules[name] = module
            snap._holder(module, module.__dict__, seal=_sealed(name), owner=name)
        return snap

    def _holder(self, holder, namespace, *, seal: bool, owner: str) -> None:
        if seal:
            self.keys[id(holder)] = (holder, frozenset(namespace))
        for attr, value in list(namespace.items()):
            if not _watched(value):
                continue
            self.attrs[(id(holder), attr)] = (holder, attr, value)
            if isinstance(value, types.FunctionType):
                self.functions.setdefault(id(value), (value, _function_parts(value)))
            elif isinstance(value, type) and id(value) not in self.keys and getattr(value, "__module__", "") == owner:
                self._holder(value, value.__dict__, seal=True, owner=owner)

    # ------------------------------------------------------------------ comparing

    # The builtins used below are bound when this module is imported (as default values), so
    # a learner who replaces ``sorted`` or ``vars`` cannot blind the comparison itself.
    def changes(self, _vars=vars, _set=set, _sorted=sorted, _getattr=getattr, _modules=sys.modules) -> list[str]:
        """What differs from the snapshot, one short phrase each (empty when nothing does)."""
        found = []
        for name, module in self.modules.items():
            now = _modules.get(name, _MISSING)
            if now is not module:
                found.append(f"sys.modules[{name!r}] was {'removed' if now is _MISSING else 'replaced'}")
        for holder, attr, value in self.attrs.values():
            now = _vars(holder).get(attr, _MISSING)
            if now is not value:
                what = "deleted" if now is _MISSING else "replaced"
                found.append(f"{_name(holder)}.{attr} was {what}")
        for holder, before in self.keys.values():
            current = _vars(holder)
            added = [a for a in _sorted(_set(current) - before) if not _harmless(holder, a, current[a])]
            if added:
                found.append(f"{_name(holder)} gained {', '.join(added[:3])}")
        for fn, parts in self.functions.values():
            for part, value in parts.items():
                if _getattr(fn, part) is not value:
                    found.append(f"{_name(fn)}.{part} was replaced")
        return found

    def restore(self) -> None:
        """Put back everything :meth:`changes` reports (best effort; never raises)."""
        for name, module in self.modules.items():
            sys.modules[name] = module
        for holder, before in self.keys.values():
            for attr in set(vars(holder)) - before:
                if _harmless(holder, attr, vars(holder)[attr]):
                    continue
                try:
                    delattr(holder, attr)
                except (AttributeError, TypeError):
                    pass
        for holder, attr, value in self.attrs.values():
            if vars(holder).get(attr, _MISSING) is not value:
                try:
                    setattr(holder, attr, value)
                except (AttributeError, TypeError):
                    pass
        for fn, parts in self.functions.values():
            for part, value in parts.items():
                if getattr(fn, part) is not value and part != "__globals__":
                    try:
                        setattr(fn, part, value)
                    except (AttributeError, TypeError, ValueError):
                        pass


#: Dunder names Python itself adds to modules and classes at run time.
_HARMLESS = frozenset({"__warningregistry__", "__annotations__", "__abstractmethods__", "_abc_impl"})


def _harmless(holder, attr: str, value, _isinstance=isinstance, _modules=sys.modules) -> bool:
    """Additions Python makes by itself: a package gains each submodule imported later."""
    if attr in _HARMLESS:
        return True
    if _isinstance(holder, types.ModuleType) and _isinstance(value, types.ModuleType):
        return _modules.get(f"{holder.__name__}.{attr}") is value and value.__name__ == f"{holder.__name__}.{attr}"
    return False


def _name(obj) -> str:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if obj is builtins:
        return "builtins"
    module = getattr(obj, "__module__", "") or ""
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", repr(obj))
    return f"{module}.{qual}" if module and module != "builtins" else qual


def summary(changes: list[str], limit: int = 3) -> str:
    """``"autograder.harness.grade was replaced, random.Random was replaced (+2 more)"``."""
    shown = ", ".join(changes[:limit])
    more = f" (+{len(changes) - limit} more)" if len(changes) > limit else ""
    return shown + more
