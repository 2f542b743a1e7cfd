"""The course's own answers to a chapter's graded tasks, out of the learner's reach while it is graded.

Each check module lists its task's references in ``REFERENCES`` (``"course.retry:with_retry"``).
The learner's sandbox sees, at those modules' paths, copies in which each reference raises
:data:`MESSAGE` instead of running (:func:`stubs`): there is nothing to call, wrap, re-export,
subclass or copy the code object of, from any module or through any event loop. Everything
else in those modules stays as it is. Unsandboxed grading (no bubblewrap) replaces the same
names in the learner's process instead (:func:`apply`), where code with the grader's rights
could still read the files: only a sandbox keeps them out of reach.

:func:`handout_stub` is the same transformation, for a class hand-out (``course handout``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import types
from pathlib import Path

MESSAGE = "{name} is the course's own answer to a graded task, left out here: write your own"
#: What marks the error a left-out answer raises (the checks tell it apart from a learner's own error).
MARK = "is the course's own answer to a graded task, left out here"


def left_out(err: BaseException) -> bool:
    """Did ``err`` come from calling an answer this copy of the course leaves out?"""
    return isinstance(err, RuntimeError) and MARK in str(err)


CHECKS = Path(__file__).resolve().parent / "checks"


def declared(chapter: str, name: str, default=None):
    """The literal value of ``name`` (``REFERENCES``, ``PROCESSES``) in chapter ``chapter``'s check modules,
    read from their source without importing them (a grading run needs it before anything else)."""
    package = CHECKS / f"ch{chapter[:2]}"
    files = sorted(package.glob("*.py")) if package.is_dir() else [CHECKS / f"ch{chapter[:2]}.py"]
    for path in files:
        if not path.exists():
            continue
        for node in ast.parse(path.read_text()).body:
            target = (
                node.target
                if isinstance(node, ast.AnnAssign)
                else (node.targets[0] if isinstance(node, ast.Assign) else None)
            )
            if isinstance(target, ast.Name) and target.id == name and node.value is not None:
                return ast.literal_eval(node.value)
    return default


def specs(chapter: str) -> list[str]:
    """``["course.retry:with_retry", ...]``: every reference of every task of ``chapter``."""
    found: list[str] = []
    for names in (declared(chapter, "REFERENCES") or {}).values():
        for spec in names:
            if spec not in found:
                found.append(spec)
    return found


def _raise(name: str) -> list[ast.stmt]:
    text = MESSAGE.format(name=name)
    return ast.parse(f"raise RuntimeError({text!r})").body


def _strip(fn: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> None:
    doc = ast.get_docstring(fn, clean=False)
    fn.body = ([ast.Expr(ast.Constant(doc))] if doc else []) + _raise(name)


def stub_source(source: str, module: str, qualnames: list[str]) -> str:
    """``source`` with each of ``qualnames`` (``f``, ``Class`` or ``Class.method``) made to raise."""
    tree = ast.parse(source)
    marks: list[ast.stmt] = []  # a re-exported stub says whose it is (harness._checks_own_use)
    for qualname in qualnames:
        top, _, method = qualname.partition(".")
        full = f"{module}.{qualname}"
        for node in tree.body:
            if getattr(node, "name", None) != top:
                continue
            if not method:
                marks += ast.parse(
                    f"try:\n    {top}.__course_reference__ = {full!r}\nexcept (AttributeError, TypeError):\n    pass"
                ).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not method:
                _strip(node, full)
            elif isinstance(node, ast.ClassDef) and method:
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method:
                        _strip(item, full)
            elif isinstance(node, ast.ClassDef):
                doc = ast.get_docstring(node, clean=False)
                init = ast.parse("def __init__(self, *args, **kwargs):\n    pass").body[0]
                init.body = _raise(full)
                node.body = ([ast.Expr(ast.Constant(doc))] if doc else []) + [init]
                node.decorator_list = []
                node.keywords = []
    tree.body += marks
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


def _grouped(spec_list: list[str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for spec in spec_list:
        module, _, qualname = spec.partition(":")
        grouped.setdefault(module, []).append(qualname)
    return grouped


def stubs(chapter: str, folder: Path) -> tuple[dict[Path, Path], list[str]]:
    """(real file -> stubbed copy in ``folder``, the specs): what the sandbox shows instead."""
    spec_list = specs(chapter)
    overlays: dict[Path, Path] = {}
    for module, qualnames in _grouped(spec_list).items():
        found = importlib.util.find_spec(module)
        if found is None or not found.origin:
            continue
        real = Path(found.origin).resolve()
        stub = folder / (module.replace(".", "_") + ".py")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text(stub_source(real.read_text(), module, qualnames))
        overlays[real] = stub
    return overlays, spec_list


def _stub(full: str, original):
    def refused(*args, **kwargs):
        raise RuntimeError(MESSAGE.format(name=full))

    if isinstance(original, type):
        body = {"__init__": refused, "__doc__": MESSAGE.format(name=full), "__course_reference__": full}
        return type(original.__name__, (), body)
    refused.__course_reference__ = full  # an answer that is this stub (re-exported) is the learner's own doing
    return refused


def apply(spec_list: list[str]) -> None:
    """In this process, replace each reference by one that raises (an unsandboxed learner's process)."""
    for module_name, qualnames in _grouped(spec_list).items():
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001, S112 - a module that does not import here is out of reach anyway
            continue
        for qualname in qualnames:
            owner, _, last = qualname.rpartition(".")
            target = module
            for part in owner.split(".") if owner else []:
                target = getattr(target, part, None)
            if target is not None and hasattr(target, last):
                setattr(target, last, _stub(f"{module_name}.{qualname}", getattr(target, last)))


class _LiveCopy(types.ModuleType):
    """A module that holds only its stubs and reads every other name from the real module, as it is now
    (a check that sets ``course.shortener.CODE_KEY`` for a replica is seen by a cell that imports it)."""

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_LiveCopy__real"], name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.__dict__["_LiveCopy__real"])) | set(self.__dict__))


def stubbed_module(module_name: str, qualnames: list[str]) -> types.ModuleType:
    """A copy of ``module_name`` whose references raise (the real module is untouched)."""
    real = importlib.import_module(module_name)
    copy = _LiveCopy(module_name, real.__doc__)
    copy.__dict__.update(
        {k: v for k, v in vars(real).items() if k.startswith("__") and k not in ("__name__", "__doc__")}
    )
    copy.__dict__["_LiveCopy__real"] = real
    for qualname in qualnames:
        top, _, method = qualname.partition(".")
        full = f"{module_name}.{qualname}"
        original = getattr(real, top, None)
        if original is None:
            continue
        if method and isinstance(original, type):  # a class whose method is the answer: a subclass without it
            setattr(copy, top, type(original.__name__, (original,), {method: _stub(full, None)}))
        else:
            setattr(copy, top, _stub(full, original))
    return copy


def learner_builtins(chapter: str) -> dict:
    """Builtins for an answer cell run in this process (the tests' kept answers): its imports of the
    chapter's reference modules give copies in which the references raise, as the sandbox's files do.
    The checks, and everything else in the process, keep the real modules."""
    import builtins

    grouped = _grouped(specs(chapter))
    copies: dict[str, types.ModuleType] = {}
    real_import = builtins.__import__

    def copy_of(name: str) -> types.ModuleType:
        if name not in copies:
            copies[name] = stubbed_module(name, grouped[name])
        return copies[name]

    def package_view(package: str) -> types.ModuleType:
        """``package`` with its stubbed submodules in place, at any depth (``import course.x as y``)."""
        real = importlib.import_module(package)
        view = types.ModuleType(package, real.__doc__)
        view.__dict__.update(vars(real))
        for name in grouped:
            if name.startswith(package + "."):
                child = name[len(package) + 1 :].split(".")[0]
                full = f"{package}.{child}"
                setattr(view, child, copy_of(full) if full == name else package_view(full))
        return view

    def learner_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 - the builtin's signature
        module = real_import(name, globals, locals, fromlist, level)
        if level != 0:
            return module
        if fromlist:
            if name in grouped:
                return copy_of(name)  # from course.eventstore import append
            if any(g.startswith(name + ".") for g in grouped):
                return package_view(name)  # from course import eventstore
            return module
        top = name.split(".")[0]
        return package_view(top) if any(g.startswith(top + ".") for g in grouped) else module

    found = dict(vars(builtins))
    found["__import__"] = learner_import
    return found


def handout_stub(source: str, module: str, qualnames: list[str]) -> str:
    """The module as a class hand-out carries it: the references raise (see ``course handout``)."""
    return stub_source(source, module, qualnames)
