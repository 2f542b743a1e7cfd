"""The in-process guard of the grading process: what forging a grade needs, refused to learner code.

The grading process (:mod:`autograder.runner`) runs a learner's answer cells and the hidden
checks in one interpreter. A grade is forged from inside that interpreter by reaching the
grader's own objects: a frame of the grader (``sys._getframe``, a traceback's ``tb_frame``, a
coroutine's ``cr_frame``, a thread's frames, a signal handler's frame argument, a tracer's or
profiler's frame argument), then its locals (the function that signs result lines, the
check's report); or the same objects through the garbage collector, raw memory (``ctypes``,
``/proc/self/mem``) or a second audit hook. This module installs a PEP 578 audit hook before
the first answer cell runs and, from then on, refuses those primitives:

- **frames**: ``sys._getframe``, ``sys._current_frames`` and the ``tb_frame`` / ``gi_frame`` /
  ``cr_frame`` / ``ag_frame`` attributes are refused to *every* caller except an allow-list of
  call sites in the standard library that use a frame and hand none back
  (``collections.namedtuple``, ``typing``, ``enum``, ``logging``'s ``findCaller``,
  ``traceback``'s formatting, ``asyncio``'s task repr, ...). Checking the call site rather than
  "is learner code on the stack" matters: ``loop.call_soon(out.extend, map(sys._getframe,
  [0]))`` has no learner frame on the stack when the frame is taken;
- ``gc.get_objects`` / ``get_referrers`` / ``get_referents``, ``sys.addaudithook``,
  ``sys.settrace`` / ``sys.setprofile`` (a tracer receives frames), every ``ctypes`` event,
  ``signal.pthread_kill``, ``os.kill`` of this process or its group, opening ``/proc/*/mem``,
  ``/proc/*/fd`` or ``/dev/fd`` or the inherited results descriptor by number;
- ``signal.signal`` and ``signal.set_wakeup_fd`` (a handler receives the interrupted frame of
  the main thread, where the signing key lives) are replaced by versions that refuse; learner
  code runs in a worker thread, where CPython refuses them anyway;
- ``compile`` of learner code under the file name of a real file, and ``code.__new__`` /
  ``code.replace`` from learner code (a learner function dressed as the grader's).

Every refusal raises ``PermissionError`` in the code that asked and is recorded against the
cell or task being run (:attr:`Guard.refused`): the runner zeroes that task and names the
primitive in its feedback, whether or not the learner's code caught the error.

What this does **not** stop (PEP 578 says it plainly: audit hooks are not a sandbox): a
learner's code can still read any object it is handed or that a module exposes
(``fn.__globals__``, a closure's ``cell_contents``, ``sys.modules``), and a C extension or a
bug in CPython can go around the hook. Those uses are flagged for a human
(:mod:`autograder.flags`), the grader's functions and classes are compared before and after
(:mod:`autograder.integrity`), and the signing key never leaves the main thread, which runs
no learner code. docs/INSTRUCTORS.md has the threat model.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import types

#: Attributes whose read hands out a frame (audited as ``object.__getattr__`` on 3.11 to 3.13).
FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})

#: Events refused after learner code has started, whoever asks (except the guard itself).
ALWAYS = {
    "sys._current_frames": "sys._current_frames (every thread's frames)",
    "gc.get_objects": "gc.get_objects (walking the grader's objects)",
    "gc.get_referrers": "gc.get_referrers (walking the grader's objects)",
    "gc.get_referents": "gc.get_referents (walking the grader's objects)",
    "sys.addaudithook": "sys.addaudithook (a second audit hook)",
    "signal.pthread_kill": "signal.pthread_kill (signalling the grader's threads)",
    "sys.monitoring.register_callback": "sys.monitoring (a tracer)",
    "cpython.remote_debugger_script": "sys.remote_exec",
}

#: Call sites allowed to take a frame after learner code started: ``(module, qualname, parents)``.
#: ``parents`` None: the function hands no frame back, whoever calls it. Otherwise the site
#: is allowed only when the frame below it runs one of ``parents`` (a generator resumed by
#: the trusted consumer, ``logging.currentframe`` called by ``findCaller``).
SAFE_SITES = [
    ("collections", "namedtuple", None),
    ("typing", "_caller", None),
    ("typing", "_allow_reckless_class_checks", None),
    ("enum", "EnumType._create_", None),
    ("dataclasses", "make_dataclass", None),
    ("warnings", "warn", None),
    ("subprocess", "_text_encoding", None),
    ("logging", "Handler.handleError", None),
    ("logging", "<lambda>", ("Logger.findCaller",)),  # logging.currentframe
    ("traceback", "print_stack", None),
    ("traceback", "format_stack", None),
    ("traceback", "extract_stack", None),
    ("traceback", "clear_frames", None),
    ("traceback", "_compute_suggestion_error", None),
    (
        "traceback",
        "walk_tb",
        ("StackSummary.extract.<locals>.extended_frame_gen", "StackSummary._extract_from_extended_frame_gen"),
    ),
    (
        "traceback",
        "walk_stack",
        ("StackSummary.extract.<locals>.extended_frame_gen", "StackSummary._extract_from_extended_frame_gen"),
    ),
    ("traceback", "_walk_tb_with_full_positions", ("StackSummary._extract_from_extended_frame_gen",)),
    ("inspect", "getfile", None),
    ("inspect", "findsource", None),
    ("inspect", "getsourcelines", None),
    ("inspect", "getframeinfo", None),
    ("inspect", "_get_code_position_from_tb", None),
    ("inspect", "getgeneratorstate", None),
    ("inspect", "getcoroutinestate", None),
    ("inspect", "getasyncgenstate", None),
    ("asyncio.coroutines", "_format_coroutine", None),
    ("asyncio.events", "Handle.__init__", None),
    ("asyncio.events", "BaseDefaultEventLoopPolicy.get_event_loop", None),
    ("asyncio.futures", "Future.__init__", None),
    ("asyncio.format_helpers", "extract_stack", None),
    ("course.kit.notebook", "_stub_function", None),
    ("typing_extensions", "_caller", None),
    ("typing_extensions", "_has_generic_or_protocol_as_origin", None),
    ("attr._make", "make_class", None),
    ("anyio.abc._tasks", "get_coro_name", None),
]

_PROC = re.compile(r"^/(proc/(self|thread-self|\d+)/(task/\d+/)?(mem|fd(/|$)|map_files)|dev/fd(/|$))")
#: A process's own folder in /proc (or /proc itself), opened as a directory: the ``dir_fd`` of
#: ``os.open("mem", dir_fd=...)``, whose audit event names only "mem".
_PROC_DIR = re.compile(r"^/proc(/(self|thread-self|\d+)(/task(/\d+)?)?)?/?$")
#: The same files named relative to a directory descriptor (``self/mem``, ``proc/123/mem``).
_PROC_TAIL = re.compile(r"(^|/)(self|thread-self|\d+)/(task/\d+/)?(mem|fd|map_files)(/|$)")


def _resolve(path: str, _readlink=os.readlink, _getcwd=os.getcwd) -> str:
    """``path`` with every symbolic link followed (``/proc/self/root/...``, a planted link).

    Only string methods and the two C functions bound at import: learner code that patches
    ``os.path`` cannot blind it.
    """
    if not path.startswith("/"):
        try:
            path = _getcwd() + "/" + path
        except OSError:
            return path
    todo = path.split("/")
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = "/" + "/".join([*done, part])
        try:
            target = _readlink(here)
        except (OSError, ValueError):
            done.append(part)
            continue
        hops += 1
        if hops > 40:
            return here
        if target.startswith("/"):
            done = []
        todo = target.split("/") + todo
    return "/" + "/".join(done)


def _proc_path(path: str) -> bool:
    """Does opening ``path`` reach this process's memory or descriptors, however it is spelled?"""
    real = _resolve(path)
    if _PROC.match(real) or _PROC_DIR.match(real):
        return True
    return not path.startswith("/") and _PROC_TAIL.search(path) is not None


def _codes_of(obj) -> list[types.CodeType]:
    """Every code object in ``obj`` (a module or a function), nested ones included."""
    found, todo = [], []
    if isinstance(obj, types.ModuleType):
        for value in vars(obj).values():
            if isinstance(value, types.FunctionType):
                todo.append(value.__code__)
            elif isinstance(value, type):
                for member in vars(value).values():
                    member = getattr(member, "__func__", member)
                    if isinstance(member, types.FunctionType):
                        todo.append(member.__code__)
    elif isinstance(obj, types.FunctionType):
        todo.append(obj.__code__)
    elif isinstance(obj, types.CodeType):
        todo.append(obj)
    while todo:
        code = todo.pop()
        found.append(code)
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


def _site_codes(module: str, qualname: str) -> list[types.CodeType]:
    mod = sys.modules.get(module)
    if mod is None:
        try:
            import importlib

            mod = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - a module this Python lacks has no call site to allow
            return []
    return [c for c in _codes_of(mod) if getattr(c, "co_qualname", c.co_name) == qualname]


class Refused(PermissionError):
    """What the guard raises in code that asked for a refused primitive."""


class Guard:
    """The audit hook and its state. One per grading process (:func:`install`)."""

    def __init__(self, protected_fds=()) -> None:
        self.active = False  # learner code has started
        self.learner_files: set[str] = set()
        self.cell_of: dict[str, str] = {}  # learner file name -> "cell:<id>"
        self.protected_fds = set(protected_fds)
        self.scope: str | None = None  # "cell:<id>" or "task:<id>": what runs now
        self.refused: dict[str, list[str]] = {}  # scope -> what was refused there
        self.trusted: set[types.CodeType] = set()  # the guard's and the runner's own call sites
        self.safe: dict[types.CodeType, frozenset | None] = {}
        self.frame_code: set[types.CodeType] = set()  # the safe sites and the parents they trust
        self._busy: set[int] = set()
        self._get_ident = threading.get_ident
        self._getframe = sys._getframe
        self._pid = os.getpid()
        self.profiler = None  # a profiler of the grader's own, if it ever needs one
        self.bootstrap = frozenset({threading.Thread._bootstrap_inner.__code__})
        self.sealed: frozenset = frozenset()  # the guard's own classes and functions (set by install)
        for module, qualname, parents in SAFE_SITES:
            wanted = None
            if parents is not None:
                wanted = frozenset(code for p in parents for code in _site_codes(module, p))
            for code in _site_codes(module, qualname):
                self.safe[code] = wanted
            self.frame_code.update(wanted or ())
        self.frame_code.update(self.safe)
        self.trusted.update(_codes_of(sys.modules[__name__]))
        harness = sys.modules.get("autograder.harness")
        if harness is not None:
            self.trusted.update(_codes_of(harness._stop_thread))

    # ------------------------------------------------------------------ learner code

    def add_learner_cell(self, filename: str, cell_id: str) -> None:
        self.learner_files.add(filename)
        self.cell_of[filename] = f"cell:{cell_id}"

    def is_learner(self, code) -> bool:
        return code is not None and code.co_filename in self.learner_files

    def learner_on_stack(self, frame) -> bool:
        while frame is not None:
            if frame.f_code.co_filename in self.learner_files:
                return True
            frame = frame.f_back
        return False

    # ------------------------------------------------------------------ the hook

    def refuse(self, what: str) -> None:
        """Record ``what`` against the answer cell whose code asked (or what runs now) and raise."""
        scope = self.scope or "?"
        frame = self._getframe(1)
        while frame is not None:  # a finalizer or callback defined in a cell counts against that cell
            owner = self.cell_of.get(frame.f_code.co_filename)
            if owner is not None:
                scope = owner
                break
            frame = frame.f_back
        found = self.refused.setdefault(scope, [])
        if what not in found:
            found.append(what)
        raise Refused(f"refused while grading: {what}")

    def _judge(self, event: str, args: tuple) -> None:
        caller = self._getframe(2)  # 0: here, 1: hook, 2: the code that raised the event
        code = caller.f_code if caller is not None else None
        if code in self.trusted:
            return
        if event in ("sys._getframe", "object.__getattr__"):
            if code in self.safe:
                parents = self.safe[code]
                back = caller.f_back
                if parents is None or (back is not None and back.f_code in parents):
                    return
            what = "sys._getframe (the grader's frames)" if event == "sys._getframe" else f".{args[1]} (a frame)"
            if code is not None and not self.is_learner(code):
                what += f", asked by {code.co_filename.rsplit('/', 1)[-1]}:{getattr(code, 'co_qualname', code.co_name)}"
            self.refuse(what)
        if event in ALWAYS:
            self.refuse(ALWAYS[event])
        if event in ("sys.settrace", "sys.setprofile"):
            hook_attr = "_profile_hook" if event == "sys.setprofile" else "_trace_hook"
            own = self.profiler if event == "sys.setprofile" else None
            if code is not None and code in self.bootstrap:
                if getattr(_THREADING, hook_attr, None) in (None, own):
                    return
            self.refuse(f"{event} (a tracer receives the grader's frames)")
        if event.startswith("ctypes."):
            self.refuse("ctypes (raw memory)")
        if event == "os.kill":
            pid = args[0]
            if pid == self._pid or pid <= 0:
                self.refuse("os.kill of the grading process")
        if event == "open":
            path = args[0]
            if isinstance(path, int):
                if path in self.protected_fds:
                    self.refuse("opening the grader's results descriptor")
                return
            if isinstance(path, bytes):
                path = path.decode(errors="replace")
            if isinstance(path, str) and _proc_path(path):
                self.refuse(f"opening {path} (the grading process's memory or descriptors)")
        if event == "os.symlink":
            target = args[0]
            if isinstance(target, bytes):
                target = target.decode(errors="replace")
            if isinstance(target, str) and ("proc" in target.split("/") or _proc_path(target)):
                self.refuse(f"a symbolic link to {target} (the grading process's memory or descriptors)")
        if (
            event in ("object.__setattr__", "object.__delattr__")
            and isinstance(args[0], (type, types.FunctionType))
            and args[0] in self.sealed
        ):
            self.refuse(f"changing the grading guard ({getattr(args[0], '__name__', '?')}.{args[1]})")
        if event == "function.__new__" and (args[0] in self.frame_code or args[0] in self.trusted):
            self.refuse("a function built around the grader's or the standard library's frame-reading code")
        if event == "code.__new__" and self.is_learner(code):
            self.refuse("building a code object (code.replace / types.CodeType)")
        if event == "compile" and self.is_learner(code):
            filename = args[1] if len(args) > 1 else None
            if isinstance(filename, bytes):
                filename = filename.decode(errors="replace")
            if isinstance(filename, str) and filename.startswith("/"):
                self.refuse(f"compiling code under the name of a real file ({filename})")

    # ------------------------------------------------------------------ signals

    def _wrap_signals(self) -> None:
        import _signal
        import signal

        guard = self

        def make(original, name):
            def refusing(*args, **kwargs):
                if guard.active:
                    guard.refuse(f"signal.{name} (a handler receives the interrupted frame)")
                return original(*args, **kwargs)

            refusing.__name__ = refusing.__qualname__ = name
            refusing.__doc__ = original.__doc__
            return refusing

        for name in ("signal", "set_wakeup_fd", "siginterrupt"):
            original = getattr(_signal, name, None)
            if original is None:
                continue
            wrapped = make(original, name)
            self.trusted.add(wrapped.__code__)
            setattr(_signal, name, wrapped)
            setattr(signal, name, wrapped)


_WATCHED = frozenset(
    {
        "sys._getframe",
        "sys.settrace",
        "sys.setprofile",
        "os.kill",
        "open",
        "code.__new__",
        "function.__new__",
        "compile",
        "os.symlink",
        "object.__setattr__",
        "object.__delattr__",
        *ALWAYS,
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.dlsym/handle",
        "ctypes.cdata",
        "ctypes.cdata/buffer",
        "ctypes.addressof",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "ctypes.call_function",
        "ctypes.PyObj_FromPtr",
        "ctypes.create_string_buffer",
        "ctypes.create_unicode_buffer",
        "ctypes.set_errno",
        "ctypes.get_errno",
    }
)

_THREADING = threading
_INSTALLED = False


def install(protected_fds=()) -> Guard:
    """Install the guard's audit hook (once per process; inactive until ``active`` is set).

    The hook is a closure over private copies: the guard's methods rebuilt on a frozen copy
    of this module's globals and of the builtins, and, once learner code has started, the
    allow-lists frozen too. A learner who reaches this module (``guard.Guard._judge = ...``,
    ``guard._WATCHED = frozenset()``) or the returned object (``.active = False``) changes
    nothing the hook consults; the code and defaults of the guard's functions cannot be replaced.
    """
    global _INSTALLED
    if _INSTALLED:
        raise RuntimeError("the grading guard is installed once per process")
    guard = Guard(protected_fds)
    guard._wrap_signals()
    sys.addaudithook(_make_hook(guard))
    _undumpable()
    _INSTALLED = True
    return guard


def _undumpable() -> None:
    """Close this process's memory to other processes of the same account (``prctl(PR_SET_DUMPABLE, 0)``).

    The hook refuses ``/proc/self/mem`` in this process, but a child process it starts has no
    hook and could read ``/proc/<this pid>/mem``; a process that is not dumpable lets only a
    process holding CAP_SYS_PTRACE do that (the sandbox drops every capability).
    """
    try:
        libc = _ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):  # not Linux: nothing to close
        pass


def _make_hook(guard: Guard):
    import builtins

    pinned = dict(globals())
    pinned["__builtins__"] = dict(vars(builtins))

    def pin(fn):
        return types.FunctionType(fn.__code__, pinned, fn.__name__, fn.__defaults__, fn.__closure__)

    for name in ("_resolve", "_proc_path"):
        pinned[name] = pin(pinned[name])
    judge, refuse, is_learner = pin(Guard._judge), pin(Guard.refuse), pin(Guard.is_learner)
    live = guard

    class View:
        """What the hook reads: frozen at install, except where refusals are recorded."""

        __slots__ = ("trusted", "safe", "frame_code", "protected_fds", "bootstrap", "sealed", "profiler", "_pid")
        _getframe = staticmethod(sys._getframe)
        scope = property(lambda self: live.scope)
        learner_files = property(lambda self, _files=guard.learner_files: _files)
        cell_of = property(lambda self, _cells=guard.cell_of: _cells)
        refused = property(lambda self, _refused=guard.refused: _refused)

    View.refuse, View.is_learner = refuse, is_learner
    watched, frame_attrs, get_ident = _WATCHED, FRAME_ATTRS, threading.get_ident
    busy: set[int] = set()
    started: list[bool] = [False]  # once learner code has started, for good: nothing reachable turns it off
    sealed = {Guard, View, Refused, ReferenceWatch, refuse, is_learner, judge}
    for value in list(globals().values()):
        if isinstance(value, types.FunctionType) or (isinstance(value, type) and value.__module__ == __name__):
            sealed.add(value)
    for cls in (Guard, ReferenceWatch):
        sealed.update(v for v in vars(cls).values() if isinstance(v, types.FunctionType))
    view = View()
    view.safe = types.MappingProxyType(dict(live.safe))
    view.protected_fds, view.bootstrap = frozenset(live.protected_fds), live.bootstrap
    view.profiler, view._pid, view.frame_code = live.profiler, live._pid, frozenset(live.frame_code)
    view.sealed = frozenset(sealed)

    def hook(event: str, args: tuple) -> None:
        if event == "object.__getattr__":
            if args[1] not in frame_attrs:
                return
        elif event not in watched:
            return
        if not started[0]:
            if not live.active:
                return
            started[0] = True
        ident = get_ident()
        if ident in busy:
            return
        busy.add(ident)
        try:
            judge(view, event, args)
        finally:
            busy.discard(ident)

    live.trusted.add(hook.__code__)
    view.trusted = frozenset(live.trusted)
    return hook


# ----------------------------------------------------------------------------- reference answers


def resolve(spec: str):
    """``"course.messaging:replay_key"`` -> the object."""
    import importlib

    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def unwrap_all(value, _depth: int = 0):
    """``value`` and what it wraps: ``__wrapped__``, ``functools.partial``, bound methods, a class's bases."""
    import functools

    seen = [value]
    if _depth > 8:
        return seen
    inner = []
    if isinstance(value, functools.partial):
        inner.append(value.func)
    if isinstance(value, (types.MethodType, staticmethod, classmethod)):
        inner.append(value.__func__)
    wrapped = getattr(value, "__wrapped__", None) if not isinstance(value, type) else None
    if wrapped is not None and wrapped is not value:
        inner.append(wrapped)
    if isinstance(value, type):
        inner.extend(value.__mro__[1:])
    for item in inner:
        seen.extend(unwrap_all(item, _depth + 1))
    return seen


#: The name a trampoline looks up in the reference's module while its task is graded.
TRAP = "__course_reference_trap__"


def _trampoline(fn: types.FunctionType, index: int) -> types.CodeType | None:
    """Code with ``fn``'s free variables that hands every call to :data:`TRAP` (None if none fits)."""
    import inspect

    free = fn.__code__.co_freevars
    define = "".join(f"    {name} = None\n" for name in free)
    touch = "".join(f"        {name}\n" for name in free)
    if inspect.iscoroutinefunction(fn):
        body = f"    async def {fn.__name__}(*_course_a, **_course_k):\n{touch}        return await {TRAP}({index}, _course_a, _course_k)\n"
    else:
        body = f"    def {fn.__name__}(*_course_a, **_course_k):\n{touch}        return {TRAP}({index}, _course_a, _course_k)\n"
    source = f"def _outer():\n{define}{body}    return {fn.__name__}\n"
    namespace: dict = {}
    exec(compile(source, fn.__code__.co_filename, "exec"), namespace)  # noqa: S102 - our own template
    code = namespace["_outer"]().__code__.replace(co_name=fn.__code__.co_name, co_qualname=fn.__code__.co_qualname)
    return code if code.co_freevars == free else None


class ReferenceWatch:
    """Calls into the course's reference answers of one task, made from learner code.

    For the length of that task's checks, each reference function (a class's ``__init__``)
    runs a trampoline that looks at its caller and then calls the real code: a call counts
    when the calling frame runs learner code (a wrapper, a helper holding the reference in a
    dict, a class delegating to the course's class). The checks' own calls into the same code
    do not count. Nothing else is slowed down; the code is put back before the grader's
    integrity comparison.
    """

    def __init__(self, guard: Guard, references: dict[str, object]) -> None:
        self.guard = guard
        self.targets: list[tuple[types.FunctionType, str]] = []
        for spec, obj in references.items():
            if isinstance(obj, type):
                init = vars(obj).get("__init__")
                if isinstance(init, types.FunctionType):
                    self.targets.append((init, spec))
            elif isinstance(obj, types.FunctionType):
                self.targets.append((obj, spec))
        self.hits: list[str] = []
        self._copies: dict[int, tuple[types.FunctionType, str]] = {}
        self._saved: list[tuple[types.FunctionType, types.CodeType]] = []
        self._getframe = sys._getframe

    def _trap(self, index: int, args: tuple, kwargs: dict):
        real, spec = self._copies[index]
        caller = self._getframe(2)  # 0: here, 1: the trampoline, 2: whoever called the reference
        if caller is not None and caller.f_code.co_filename in self.guard.learner_files and spec not in self.hits:
            self.hits.append(spec)
        return real(*args, **kwargs)

    def __enter__(self) -> ReferenceWatch:
        for index, (fn, spec) in enumerate(self.targets):
            code = _trampoline(fn, index)
            if code is None:
                continue
            real = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
            real.__kwdefaults__ = fn.__kwdefaults__
            self._copies[index] = (real, spec)
            self._saved.append((fn, fn.__code__))
            fn.__globals__[TRAP] = self._trap
            fn.__code__ = code
        return self

    def __exit__(self, *exc) -> None:
        for fn, code in self._saved:
            fn.__code__ = code
            fn.__globals__.pop(TRAP, None)
        self._saved.clear()


# ----------------------------------------------------------------------------- timeouts

import ctypes as _ctypes  # noqa: E402 - resolved at import, before any learner code runs

_SET_ASYNC_EXC = _ctypes.pythonapi.PyThreadState_SetAsyncExc


def async_raise(ident: int, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in thread ``ident`` at its next bytecode (a cell past its limit)."""
    _SET_ASYNC_EXC(_ctypes.c_ulong(ident), _ctypes.py_object(exc_type))
