"""Answers a program cannot judge, flagged for a human: escape and introspection primitives, read statically.

Before grading, every answer cell is parsed (the ``ast`` module, nothing is run) and searched
for what forging a grade or leaving the answer's own folder needs: frames and tracers
(``sys._getframe``, ``f_back``, ``tb_frame``, ``settrace``), the garbage collector and raw
memory (``gc``, ``ctypes``), the import machinery and the builtins (``importlib``,
``__import__``, ``builtins``, ``sys.modules``), other functions' insides (``__closure__``,
``cell_contents``, ``__globals__``, ``__code__``, ``__subclasses__``), attribute access by a
computed name, rebinding a module's attribute, signals and ending the process, spawning
processes, and files outside the answer's folder. Such a submission is graded as usual and
**flagged**: nbgrader's gradebook marks it (formgrader shows the flag), its feedback says the
instructor will read it, ``course grade`` and ``course check`` list it. A false positive costs
a human a minute; the list is kept so that ordinary code (asyncio, psycopg, redis, json,
random, math, collections, dataclasses, time, typing, functools, itertools, hashlib, hmac,
base64, uuid, struct, bisect, heapq, contextlib, logging) is never flagged
(tests/test_00_forging.py checks every solution and every kept correct answer).
"""

from __future__ import annotations

import ast

#: Modules whose import alone is worth a human's look, and why.
MODULES = {
    "ctypes": "ctypes (raw memory)",
    "_ctypes": "ctypes (raw memory)",
    "gc": "gc (walking live objects)",
    "inspect": "inspect (frames and other functions' insides)",
    "importlib": "importlib (the import machinery)",
    "builtins": "builtins (rebinding the builtins)",
    "signal": "signal (handlers receive the interrupted frame)",
    "_signal": "signal (handlers receive the interrupted frame)",
    "subprocess": "subprocess (spawning processes)",
    "multiprocessing": "multiprocessing (spawning processes)",
    "pty": "pty (spawning processes)",
    "_posixsubprocess": "spawning processes",
    "code": "code (an interpreter inside the answer)",
    "codeop": "codeop (compiling code)",
    "marshal": "marshal (building code objects)",
    "faulthandler": "faulthandler",
    "_thread": "_thread (low-level threads)",
    "pdb": "pdb (a tracer)",
    "bdb": "bdb (a tracer)",
    "dis": "dis (reading bytecode)",
    "tracemalloc": "tracemalloc",
    "posix": "posix (the raw OS interface)",
    "autograder": "autograder (the grader itself)",
    "_testcapi": "_testcapi",
    "sysconfig": "sysconfig",
}

#: Attributes worth a human's look wherever they appear.
ATTRS = {
    "_getframe": "sys._getframe (frames)",
    "_getframemodulename": "sys._getframemodulename (frames)",
    "_current_frames": "sys._current_frames (every thread's frames)",
    "currentframe": "currentframe (frames)",
    "f_back": "f_back (walking frames)",
    "f_globals": "f_globals (a frame's globals)",
    "f_locals": "f_locals (a frame's locals)",
    "f_code": "f_code (a frame's code)",
    "f_builtins": "f_builtins (a frame's builtins)",
    "tb_frame": "tb_frame (a traceback's frame)",
    "gi_frame": "gi_frame (a generator's frame)",
    "cr_frame": "cr_frame (a coroutine's frame)",
    "ag_frame": "ag_frame (an async generator's frame)",
    "__closure__": "__closure__ (another function's variables)",
    "cell_contents": "cell_contents (another function's variables)",
    "__globals__": "__globals__ (another function's globals)",
    "__code__": "__code__ (a function's code)",
    "__subclasses__": "__subclasses__ (walking classes)",
    "__builtins__": "__builtins__ (the builtins)",
    "__import__": "__import__ (the import machinery)",
    "__loader__": "__loader__ (the import machinery)",
    "settrace": "settrace (a tracer receives frames)",
    "setprofile": "setprofile (a profiler receives frames)",
    "settrace_all_threads": "settrace (a tracer receives frames)",
    "setprofile_all_threads": "setprofile (a profiler receives frames)",
    "get_referrers": "gc.get_referrers (walking live objects)",
    "get_referents": "gc.get_referents (walking live objects)",
    "get_objects": "gc.get_objects (walking live objects)",
    "addaudithook": "sys.addaudithook",
    "monitoring": "sys.monitoring (a tracer)",
    "_exit": "os._exit (ending the process)",
    "pthread_kill": "signal.pthread_kill",
    "pythonapi": "ctypes.pythonapi (raw memory)",
    "meta_path": "sys.meta_path (the import machinery)",
    "path_hooks": "sys.path_hooks (the import machinery)",
    "remote_exec": "sys.remote_exec",
}

#: Attributes worth a look on one module only: ``{module: {attr: why}}``.
MODULE_ATTRS = {
    "sys": {"modules": "sys.modules (the loaded modules)"},
    "os": {
        "system": "os.system (spawning processes)",
        "popen": "os.popen (spawning processes)",
        "fork": "os.fork (spawning processes)",
        "forkpty": "os.forkpty (spawning processes)",
        "kill": "os.kill (signals)",
        "killpg": "os.killpg (signals)",
        "posix_spawn": "os.posix_spawn (spawning processes)",
        "posix_spawnp": "os.posix_spawnp (spawning processes)",
        "open": "os.open (raw file descriptors)",
        "write": "os.write (raw file descriptors)",
        "dup2": "os.dup2 (raw file descriptors)",
        "fdopen": "os.fdopen (raw file descriptors)",
    },
}

#: Builtins worth a look when called.
CALLS = {
    "exec": "exec (running code built at run time)",
    "eval": "eval (running code built at run time)",
    "compile": "compile (building code at run time)",
    "__import__": "__import__ (the import machinery)",
    "globals": "globals() (the namespace as a dict)",
    "breakpoint": "breakpoint (a tracer)",
}

_DYNAMIC = {"getattr", "setattr", "delattr"}


def _module_of(alias: ast.alias) -> str:
    return alias.name.split(".")[0]


class _Scan(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[str] = []
        self.modules: dict[str, str] = {}  # local name -> module it is bound to

    def add(self, node: ast.AST, why: str) -> None:
        line = f"line {getattr(node, 'lineno', '?')}: {why}"
        if line not in self.found:
            self.found.append(line)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = _module_of(alias)
            self.modules[alias.asname or top] = alias.name if alias.asname else top
            if top in MODULES:
                self.add(node, f"imports {MODULES[top]}")
            elif alias.name.startswith("os.") or alias.name == "os.path":
                pass
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        top = (node.module or "").split(".")[0]
        if node.level:
            self.add(node, "a relative import")
        elif top in MODULES:
            self.add(node, f"imports {MODULES[top]}")
        for alias in node.names:
            if alias.name in ATTRS:
                self.add(node, f"imports {ATTRS[alias.name]}")
            why = MODULE_ATTRS.get(top, {}).get(alias.name)
            if why:
                self.add(node, f"imports {why}")
            if alias.name == "*":
                self.add(node, f"imports * from {node.module}")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in ATTRS:
            self.add(node, f"uses {ATTRS[node.attr]}")
        if isinstance(node.value, ast.Name):
            module = self.modules.get(node.value.id, node.value.id if node.value.id in MODULE_ATTRS else None)
            why = MODULE_ATTRS.get(module or "", {}).get(node.attr)
            if why:
                self.add(node, f"uses {why}")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in ("__builtins__", "__loader__", "__spec__"):
            self.add(node, f"uses {node.id}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in CALLS:
                self.add(node, f"calls {CALLS[func.id]}")
            elif func.id in _DYNAMIC and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                self.add(node, f"calls {func.id} with a computed attribute name")
            elif func.id in _DYNAMIC and len(node.args) >= 2 and self._is_module(node.args[0]) and func.id != "getattr":
                self.add(node, f"calls {func.id} on a module (rebinding a module's attribute)")
            elif func.id == "open" and node.args:
                self._path(node, node.args[0])
            elif func.id == "vars" and not node.args:
                self.add(node, "calls vars() (the namespace as a dict)")
        elif isinstance(func, ast.Attribute) and func.attr in ("open", "read_text", "read_bytes", "write_text"):
            if (
                isinstance(func.value, ast.Call)
                and isinstance(func.value.func, ast.Name)
                and func.value.func.id == "Path"
            ):
                if func.value.args:
                    self._path(node, func.value.args[0])
        self.generic_visit(node)

    def _is_module(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self.modules

    def _path(self, node: ast.Call, arg: ast.AST) -> None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            path = arg.value
            if path.startswith(("/", "~")) or ".." in path.replace("\\", "/").split("/"):
                self.add(node, f"opens {path!r} (a file outside the answer's folder)")
        elif isinstance(arg, ast.Constant) and isinstance(arg.value, int):
            self.add(node, "opens a file descriptor by number")
        elif not isinstance(arg, ast.JoinedStr):
            self.add(node, "opens a file whose path is computed at run time")

    def _target(self, target: ast.AST) -> None:
        if isinstance(target, ast.Attribute) and self._is_module(target.value):
            self.add(target, f"rebinds {target.value.id}.{target.attr} (changing a module for everyone)")
        elif isinstance(target, (ast.Tuple, ast.List)):
            for item in target.elts:
                self._target(item)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._target(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)


def scan(source: str) -> list[str]:
    """``["line 3: uses sys._getframe (frames)", ...]``: what in ``source`` a human should read."""
    import re

    text = re.sub(r"^(\s*)[%!].*$", r"\1pass", source, flags=re.MULTILINE)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []  # a cell that does not parse does not run either
    scanner = _Scan()
    # Imports first, so an alias is known wherever it is used.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = _module_of(alias)
                scanner.modules[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if alias.name != "*":
                    scanner.modules.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")
    # A name imported from a module is a module only when it is one; functions and classes
    # imported by name are rebound by learners all the time (and that is no monkeypatch).
    scanner.modules = {k: v for k, v in scanner.modules.items() if _looks_like_module(v)}
    scanner.visit(tree)
    return scanner.found


def _looks_like_module(dotted: str) -> bool:
    """Whether ``dotted`` (``os``, ``course.messaging``, ``collections.abc``) names a module.

    Looked up without importing anything but the parents of the course's own and the
    standard library's modules.
    """
    import importlib.util
    import sys

    top = dotted.split(".")[0]
    if "." not in dotted:
        return True  # ``import x`` binds a module
    if top not in sys.stdlib_module_names and top not in ("course", "autograder"):
        return False
    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def scan_answers(job: dict) -> dict[str, list[str]]:
    """answer cell id -> what to flag in it (cells with nothing to flag are left out)."""
    found = {}
    for cell in job.get("cells", []):
        if cell.get("kind") == "answer":
            lines = scan(cell.get("source", ""))
            if lines:
                found[cell["id"]] = lines
    return found
