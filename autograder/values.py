"""What crosses the wire between the grader and a learner's process, and what it becomes there.

Values cross as data, as JSON with a few tags; nothing from the learner's side is ever
unpickled or evaluated. Plain data (``None``, bools, numbers, strings, bytes, lists, tuples,
dicts, sets, dates and times, ``Decimal``, ``UUID``) is copied. Everything else crosses as a
*handle*: the receiver gets a proxy, and what it does to the proxy (a call, an attribute, an
``await``) goes back over the wire to the side that owns the object (:mod:`autograder.wire`).

Exceptions are rebuilt on the receiving side as instances of the first class in their MRO that
the receiver trusts (the standard library, psycopg, redis, httpx, the course's own modules), in a
subclass named as the sender's class was, with the sender's message, attributes that are data,
cause and context: ``except psycopg.errors.UniqueViolation`` and ``type(err).__name__`` read as
they would in one process. An exception that crossed once comes back as the very object it was
(``raise`` of an error the grader handed in is the grader's error again).

Resources (a psycopg pool, a Redis client) cross as a *spec* that the learner's side turns into
a resource of its own, with its own credentials (:mod:`autograder.learner`).
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import importlib
import sys
import sysconfig
import traceback
import uuid
from typing import Any

#: Modules whose exception classes a receiver rebuilds by name (their top-level package).
TRUSTED_MODULES = frozenset(
    {"builtins", "asyncio", "concurrent", "socket", "ssl", "json", "httpx", "httpcore", "psycopg", "psycopg_pool"}
    | {"redis", "course", "anyio", "h11", "uuid", "decimal", "zoneinfo", "sqlite3", "_queue", "queue"}
)
#: The standard library's folder: its frames are nobody's line to fix (``return fut.result()``).
_STDLIB = sysconfig.get_paths()["stdlib"] + "/"
MAX_DEPTH = 48
MAX_TEXT = 4000


class WireValueError(ValueError):
    """A value that cannot cross (too deep, or of a kind the wire does not carry)."""


class RemoteError(Exception):
    """An exception whose class the receiver does not trust: its name and message, rebuilt."""


_subclasses: dict[tuple[str, str, type], type] = {}


def _trusted(module: str) -> bool:
    return module.split(".")[0] in TRUSTED_MODULES


def _find_class(module: str, qualname: str) -> type | None:
    if not _trusted(module) or "<" in qualname:
        return None
    try:
        found: Any = sys.modules.get(module) or importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001 - not there on this side
        return None
    return found if isinstance(found, type) and issubclass(found, BaseException) else None


def _named(base: type, module: str, qualname: str) -> type:
    """A subclass of ``base`` that prints as the sender's class did (cached per name)."""
    key = (module, qualname, base)
    cls = _subclasses.get(key)
    if cls is None:
        name = qualname.rsplit(".", 1)[-1][:80] or "RemoteError"
        body = {
            "__module__": module[:80],
            "__qualname__": qualname[:120],
            "__remote__": True,
            "__str__": lambda self: self.__dict__.get("__remote_str__", ""),  # the sender's text, whatever the args
        }
        try:
            cls = type(name, (base,), body)
        except TypeError:  # a base that cannot be subclassed (bool-like finals): keep the base
            cls = base
        _subclasses[key] = cls
    return cls


def exception_data(err: BaseException, encode_attr, depth: int = 0, encode_link=None) -> dict:
    """An exception as data: its classes, message, data attributes, learner frames, cause, context."""
    mro = [[c.__module__, c.__qualname__] for c in type(err).__mro__ if issubclass(c, BaseException)]
    try:
        text = str(err)
    except Exception as inner:  # noqa: BLE001 - a __str__ that raises
        text = f"<str() raised {type(inner).__name__}>"
    attrs = {}
    for name, value in list(getattr(err, "__dict__", {}).items())[:20]:
        if name.startswith("_"):
            continue
        try:
            attrs[name] = encode_attr(value, depth + 1)
        except Exception:  # noqa: BLE001, S112 - an attribute that cannot cross stays behind
            continue
    args = []
    for value in err.args[:8]:
        try:
            args.append(encode_attr(value, depth + 1))
        except Exception:  # noqa: BLE001
            args.append(repr(value)[:200])
    frames = [  # the frames a report names a line from: not the grader's, not a library's
        [f.filename, f.lineno, (f.line or "")[:200]]
        for f in traceback.extract_tb(err.__traceback__)
        if "autograder" not in f.filename and "site-packages" not in f.filename and not f.filename.startswith(_STDLIB)
    ][-8:]
    frames = getattr(err, "__remote_frames__", None) or frames
    out = {"mro": mro, "str": text[:MAX_TEXT], "args": args, "attrs": attrs, "frames": frames}
    if isinstance(err, BaseExceptionGroup) and depth < 6:  # each member crosses as an error of its own
        out["group"] = [
            (encode_link or (lambda e, d: exception_data(e, encode_attr, d)))(e, depth + 1) for e in err.exceptions
        ]
        out["message"] = str(err.message)[:MAX_TEXT]
    info = getattr(err, "_info", None) if type(err).__module__.startswith("psycopg") else None
    if info is not None:  # a database error's diagnostics (constraint, detail, sqlstate) as psycopg pickles them
        from psycopg.errors import _info_to_dict

        out["pg"] = {int(k): v.decode("utf-8", "replace") for k, v in (_info_to_dict(info) or {}).items() if v}
    if depth < 4:
        for link in ("__cause__", "__context__"):
            inner = getattr(err, link)
            if inner is not None and inner is not err:
                out[link.strip("_")] = (encode_link or (lambda e, d: exception_data(e, encode_attr, d)))(
                    inner, depth + 1
                )
        out["suppress"] = bool(err.__suppress_context__)
    return out


def rebuild_exception(data: dict, decode_attr, decode_link=None) -> BaseException:
    """The receiver's instance for :func:`exception_data` (never runs the sender's code)."""
    mro = [m for m in data.get("mro", []) if isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m)]
    text = str(data.get("str", ""))[:MAX_TEXT]
    base: type = RemoteError
    for module, qualname in mro:
        found = _find_class(module, qualname)
        if found is not None:
            base = found
            break
    first = mro[0] if mro else ["builtins", "Exception"]
    exact = base.__module__ == first[0] and base.__qualname__ == first[1]
    args = tuple(decode_attr(a) for a in data.get("args", [])[:8])
    attrs = {
        k: decode_attr(v) for k, v in (data.get("attrs") or {}).items() if isinstance(k, str) and not k.startswith("_")
    }
    if issubclass(base, BaseExceptionGroup):
        members = [(decode_link or (lambda d: rebuild_exception(d, decode_attr)))(d) for d in data.get("group") or []]
        if not members or not all(isinstance(m, BaseException) for m in members):
            base = RemoteError
        else:
            if not all(isinstance(m, Exception) for m in members) and issubclass(base, Exception):
                base = BaseExceptionGroup
            args = (str(data.get("message", "")), members)
    cls = base
    if not exact or str_differs(_made(base, args, attrs, data), text):
        cls = _named(base, first[0], first[1])  # prints as the sender's did (a __str__ that reads attributes)
    err = _made(cls, args, attrs, data)
    err.__remote_str__ = text
    frames = data.get("frames") or []
    try:
        err.__remote_frames__ = [f for f in frames if isinstance(f, list) and len(f) == 3][:8]
    except Exception:  # noqa: BLE001
        pass
    for link in ("cause", "context"):
        if isinstance(data.get(link), dict):
            try:
                inner = (decode_link or (lambda d: rebuild_exception(d, decode_attr)))(data[link])
                setattr(err, f"__{link}__", inner)
            except Exception:  # noqa: BLE001
                pass
    err.__suppress_context__ = bool(data.get("suppress"))
    return err


def _made(cls: type, args: tuple, attrs: dict, data: dict) -> BaseException:
    if issubclass(cls, BaseExceptionGroup):
        err = cls.__new__(cls, *args)
        BaseException.__init__(err, *args)
        return err
    err = cls.__new__(cls)  # never a constructor: its arguments are not always its args (DependencyError)
    try:
        BaseException.__init__(err, *args)
    except Exception:  # noqa: BLE001
        pass
    if issubclass(cls, _psycopg_error()):
        from psycopg.pq import DiagnosticField

        fields = {DiagnosticField(int(k)): str(v).encode() for k, v in (data.get("pg") or {}).items()}
        err._info, err._encoding, err._pgconn = fields or None, "utf-8", None
    for name, value in attrs.items():
        try:
            object.__setattr__(err, name, value)
        except Exception:  # noqa: BLE001, S112 - a property without a setter
            continue
    return err


def _psycopg_error() -> type:
    module = sys.modules.get("psycopg")
    return module.Error if module is not None else _Never


class _Never(Exception):
    """Stands in for psycopg.Error where psycopg was never imported (no error of it can arrive then)."""


def str_differs(err: BaseException, text: str) -> bool:
    try:
        return str(err) != text
    except Exception:  # noqa: BLE001
        return True


def frames_of(err: BaseException) -> list[tuple[str, int, str]]:
    """The learner's frames of ``err``: from its traceback, or carried over the wire."""
    carried = getattr(err, "__remote_frames__", None)
    if carried:
        return [tuple(f) for f in carried]
    return [(f.filename, f.lineno or 0, f.line or "") for f in traceback.extract_tb(err.__traceback__)]


# ----------------------------------------------------------------------------- plain data


def encode_plain(value, depth: int, encode):
    """Plain data as JSON with tags; ``None`` when ``value`` is not plain data (a handle, then)."""
    if depth > MAX_DEPTH:
        raise WireValueError("a value nested deeper than the wire carries")
    t = type(value)
    if value is None or t in (bool, str):
        return value
    if t is int:
        return value if -(2**63) <= value < 2**63 else ["int", str(value)]
    if t is float:
        return value if value == value and value not in (float("inf"), float("-inf")) else ["float", repr(value)]
    if t in (bytes, bytearray, memoryview):
        return ["b", base64.b64encode(bytes(value)).decode()]
    if t is list:
        return ["l", [encode(v, depth + 1) for v in value]]
    if t is tuple:
        return ["t", [encode(v, depth + 1) for v in value]]
    if t is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    if t in (set, frozenset):
        return ["s" if t is set else "fs", [encode(v, depth + 1) for v in value]]
    if t is dt.datetime:
        return ["dt", value.isoformat()]
    if t is dt.date:
        return ["date", value.isoformat()]
    if t is dt.time:
        return ["time", value.isoformat()]
    if t is dt.timedelta:
        return ["td", value.days, value.seconds, value.microseconds]
    if t is decimal.Decimal:
        return ["dec", str(value)]
    if t is uuid.UUID:
        return ["uuid", str(value)]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple (a psycopg row): its values
        return ["t", [encode(v, depth + 1) for v in value]]
    for base in (bool, int, float, str, bytes):  # a subclass (an IntEnum, a str-based id): its plain value
        if isinstance(value, base):
            return encode_plain(base(value), depth, encode)
    return None


_DECODERS = {
    "int": lambda v, d: int(v[1]),
    "float": lambda v, d: float(v[1]),
    "b": lambda v, d: base64.b64decode(v[1]),
    "l": lambda v, d: [d(x) for x in v[1]],
    "t": lambda v, d: tuple(d(x) for x in v[1]),
    "d": lambda v, d: {d(k): d(x) for k, x in v[1]},
    "s": lambda v, d: {d(x) for x in v[1]},
    "fs": lambda v, d: frozenset(d(x) for x in v[1]),
    "dt": lambda v, d: dt.datetime.fromisoformat(v[1]),
    "date": lambda v, d: dt.date.fromisoformat(v[1]),
    "time": lambda v, d: dt.time.fromisoformat(v[1]),
    "td": lambda v, d: dt.timedelta(days=v[1], seconds=v[2], microseconds=v[3]),
    "dec": lambda v, d: decimal.Decimal(v[1]),
    "uuid": lambda v, d: uuid.UUID(v[1]),
}


def decode_plain(value, decode):
    """The inverse of :func:`encode_plain` for a tagged list whose tag it knows; raises KeyError otherwise."""
    return _DECODERS[value[0]](value, decode)


# ----------------------------------------------------------------------------- the course's own values


def _importable(value) -> tuple[str, str] | None:
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname or not _trusted(module):
        return None
    try:
        found: Any = sys.modules.get(module) or importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001
        return None
    return (module, qualname) if found is value else None


def encode_course_value(value, encode, depth: int, *, imports: bool = False, refused=frozenset()):
    """A value of a trusted module that crosses by value: an enum member, a frozen dataclass (a
    ``RetryPolicy``), and, from the grader (``imports``), a function or class by its import name."""
    import dataclasses
    import enum

    if isinstance(value, enum.Enum) and (found := _importable(type(value))):
        return ["enum", *found, value.name]
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and (found := _importable(type(value))):
        params = getattr(type(value), "__dataclass_params__", None)
        if params is not None and params.frozen:
            fields = [[f.name, encode(getattr(value, f.name), depth + 1)] for f in dataclasses.fields(value) if f.init]
            return ["dc", *found, fields]
    if isinstance(value, type) and issubclass(value, BaseException) and (found := _importable(value)):
        return ["imp", *found]  # an exception class of a trusted module (what ``except`` needs)
    if imports and (inspect_routine(value) or isinstance(value, type)) and (found := _importable(value)):
        if f"{found[0]}:{found[1]}" not in refused:
            return ["imp", *found]
    return None


def inspect_routine(value) -> bool:
    import inspect

    return inspect.isfunction(value) or inspect.isbuiltin(value)


def decode_course_value(tag: str, value: list, decode, *, trusting: bool):
    """The inverse of :func:`encode_course_value`. An untrusting side (the grader) imports only
    exception classes by name and builds only trusted dataclasses and enums, from data."""
    import dataclasses
    import enum

    module, qualname = str(value[1]), str(value[2])
    if not _trusted(module) or "<" in qualname:
        raise WireValueError(f"{module}.{qualname} is not a class this side builds")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if tag == "enum" and isinstance(found, type) and issubclass(found, enum.Enum):
        return found[str(value[3])]
    if tag == "dc" and dataclasses.is_dataclass(found) and isinstance(found, type):
        return found(**{str(k): decode(v) for k, v in value[3]})
    if tag == "imp" and (trusting or (isinstance(found, type) and issubclass(found, BaseException))):
        return found
    raise WireValueError(f"{module}.{qualname} cannot cross as {tag!r}")
