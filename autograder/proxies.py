"""What each side of the wire (:mod:`autograder.wire`) sees of the other's objects: proxies.

:func:`describe` says what an object offers (its kind, its type's name, its methods and which are
coroutines, the protocols it speaks: ``len``, ``async with``, ``await``...), as far as the owner's
:class:`Policy` lets the other side use it. :func:`proxy_class` builds, from that, a class named as the
remote type with exactly those protocols, so ``type(x).__name__``, ``inspect.isawaitable`` and
``async with`` read as they would in one process.
"""

from __future__ import annotations

import asyncio
import inspect

from autograder import values


class WireError(ConnectionError):
    """The other process is gone, or broke the protocol."""


class Refused(AttributeError):
    """The grader does not expose that to learner code."""


# ----------------------------------------------------------------------------- policy


class Policy:
    """What one side lets the other do with its objects, and which values it turns into resources.

    The learner's side lets the grader do anything with learner objects. The grader's side
    (:class:`autograder.session.GraderPolicy`) answers only what it exposes.
    """

    trusting = True

    def allowed(self, obj, name: str) -> bool:
        return True

    def resource(self, value) -> dict | None:
        """A spec for a value the other side should make its own copy of (a pool), else None."""
        return None

    def returns_awaitable(self, obj, name: str, function) -> bool:
        """Whether ``obj.name()``, a plain function, returns an awaitable (an async redis-py client's
        commands do): the other side then awaits it in one round trip, its event loop never blocked."""
        return False

    def chains(self, obj, name: str, function) -> bool:
        """Whether ``obj.name()`` queues work and returns ``obj`` (a redis-py pipeline's commands): the
        other side sends it without waiting for the answer (a pipeline of 3,000 commands is one round trip
        at ``execute()``, not 3,000), and awaits the answer only if it asks for it (WATCH mode)."""
        return False

    def materialize(self, spec: dict):
        raise WireError(f"this side cannot make a {spec.get('kind')!r}")

    def encode_special(self, value, encode, depth: int) -> list | None:
        return values.encode_course_value(value, encode, depth)

    def decode_special(self, tag: str, value, decode):
        if tag in ("enum", "dc", "imp"):
            return values.decode_course_value(tag, value, decode, trusting=self.trusting)
        raise WireError(f"unknown value tag {tag!r}")


# ----------------------------------------------------------------------------- meta


_ASYNC_DUNDERS = {"__aenter__", "__aexit__", "__anext__"}
_DUNDERS = (
    "__call__ __len__ __iter__ __next__ __aiter__ __anext__ __enter__ __exit__ __aenter__ __aexit__ __getitem__ "
    "__setitem__ __delitem__ __contains__ __bool__ __eq__ __lt__ __le__ __gt__ __ge__ __hash__ __int__ __float__ "
    "__index__ __str__ __repr__"
).split()


def _is_async(fn) -> bool:
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        return True
    if inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isclass(fn):
        return False
    return inspect.iscoroutinefunction(inspect.getattr_static(type(fn), "__call__", None))


def _params(fn) -> list | None:
    """The parameters, as ``inspect.signature`` gives them: name, kind, and the default (as data) if any."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    out = []
    for p in sig.parameters.values():
        entry = [p.name, int(p.kind)]
        if p.default is not inspect.Parameter.empty:
            default = values.encode_plain(p.default, 0, lambda v, d: values.encode_plain(v, d, None))
            entry.append(default if default is not None or p.default is None else ["repr", repr(p.default)[:80]])
        out.append(entry)
    return out


def _signature(meta: dict) -> inspect.Signature:
    params = []
    for entry in meta.get("p") or []:
        name, kind = entry[0], inspect._ParameterKind(entry[1])  # noqa: SLF001
        default = inspect.Parameter.empty
        if len(entry) > 2:
            raw = entry[2]
            try:
                default = _Unknown(raw[1]) if isinstance(raw, list) and raw[:1] == ["repr"] else _plain(raw)
            except Exception:  # noqa: BLE001
                default = _Unknown("?")
        params.append(inspect.Parameter(name, kind, default=default))
    return inspect.Signature(params)


class _Unknown:
    """A default value that did not cross as data (shown as its repr)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _plain(raw):
    if not isinstance(raw, list):
        return raw
    return values.decode_plain(raw, _plain)


def describe(obj, policy: Policy) -> dict:
    """What the other side needs to build a proxy for ``obj``: kind, type, methods, async-ness."""
    if inspect.isclass(obj):
        kind, t = "class", obj
    elif inspect.iscoroutine(obj) or isinstance(obj, asyncio.Future):
        kind, t = "await", type(obj)
    elif inspect.isroutine(obj) or isinstance(obj, type(len)):
        kind, t = "fn", obj
    else:
        kind, t = "obj", type(obj)
    meta = {"k": kind, "t": [getattr(t, "__module__", "") or "", getattr(t, "__qualname__", type(obj).__name__)]}
    if kind == "await":
        return meta
    if callable(obj) and policy.allowed(obj, "__call__"):
        owner, function = getattr(obj, "__self__", None), getattr(obj, "__func__", None)
        meta["a"] = _is_async(obj) or (
            function is not None and owner is not None and policy.returns_awaitable(owner, obj.__name__, function)
        )
        meta["p"] = _params(obj)
    if kind in ("obj", "class"):
        holder = obj if kind == "class" else type(obj)
        methods, dunders, chained = {}, [], []
        for name in dir(holder):
            if name.startswith("__") and name.endswith("__"):
                if (
                    name in _DUNDERS
                    and name != "__call__"
                    and getattr(holder, name, None) is not getattr(object, name, None)
                ):
                    if policy.allowed(obj, name):
                        dunders.append(name)
                continue
            if name.startswith("_") or not policy.allowed(obj, name):
                continue
            try:
                attr = inspect.getattr_static(holder, name)
            except AttributeError:
                continue
            if kind == "obj" and isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if inspect.isfunction(attr) and kind == "obj":
                # an async generator function's call returns its iterator at once (``async for`` over it)
                methods[name] = inspect.iscoroutinefunction(attr) or policy.returns_awaitable(obj, name, attr)
                if policy.chains(obj, name, attr):
                    chained.append(name)
        meta["m"] = methods
        if chained:
            meta["c"] = chained
        meta["d"] = sorted(dunders)
        if kind == "obj" and inspect.isawaitable(obj) and policy.allowed(obj, "__await__"):
            meta["aw"] = True  # awaitable as well (a redis-py pipeline): ``await`` goes to the owner
    return meta


# ----------------------------------------------------------------------------- proxies


class Proxy:
    """An object of the other process. Built by :meth:`Conn.proxy`; see the module docstring."""

    __slots__ = ("_conn", "_hid", "_meta", "__weakref__")

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        methods = self._meta.get("m") or {}
        if name in methods:
            if name in (self._meta.get("c") or ()):
                return Chained(self, name)
            return BoundMethod(self, name, methods[name])
        return self._conn.call_sync(self._hid, "getattr", name)

    def __setattr__(self, name: str, value) -> None:
        if name in Proxy.__slots__:
            object.__setattr__(self, name, value)
        else:
            self._conn.call_sync(self._hid, "setattr", name, (value,))

    def __delattr__(self, name: str) -> None:
        self._conn.call_sync(self._hid, "delattr", name)

    @property
    def __dict__(self) -> dict:  # noqa: PLW3201 - what vars() reads: the owner's attributes, as data
        return self._conn.call_sync(self._hid, "getattr", "__dict__")

    @property
    def __signature__(self) -> inspect.Signature:  # noqa: PLW3201 - what inspect.signature reads
        if "p" not in self._meta or self._meta["p"] is None:
            raise ValueError("no signature found for this object of the learner's process")
        return _signature(self._meta)

    def __repr__(self) -> str:
        if "__repr__" in (self._meta.get("d") or ()) and self._conn.alive:
            try:
                return str(self._conn.call_sync(self._hid, "call", "__repr__"))
            except Exception:  # noqa: BLE001 - a repr never fails
                pass
        module, qualname = self._meta.get("t", ["", "?"])
        return f"<{qualname} object of the learner's process>"

    def __reduce__(self):
        raise TypeError("an object of another process cannot be pickled")


class BoundMethod:
    """``proxy.name`` for a method the owner's class defines: called without a round trip first."""

    __slots__ = ("_owner", "_name", "_async", "_is_coroutine", "__weakref__")

    def __init__(self, owner: Proxy, name: str, is_async: bool) -> None:
        self._owner, self._name, self._async = owner, name, is_async
        if is_async:
            self._is_coroutine = asyncio.coroutines._is_coroutine  # noqa: SLF001 - asyncio.iscoroutinefunction

    def __call__(self, *args, **kwargs):
        conn = self._owner._conn  # noqa: SLF001
        if self._async:
            return conn.call_async(self._owner._hid, "method", self._name, args, kwargs)  # noqa: SLF001
        return conn.call_sync(self._owner._hid, "method", self._name, args, kwargs)  # noqa: SLF001

    def __repr__(self) -> str:
        return f"<method {self._name} of {self._owner!r}>"

    @property
    def __name__(self) -> str:  # noqa: PLW3201
        return self._name


class Chained:
    """``proxy.name`` for a method that queues work on its owner and returns it (see
    :meth:`Policy.chains`): called, it is sent without a wait, and gives a :class:`Later`."""

    __slots__ = ("_owner", "_name")

    def __init__(self, owner: Proxy, name: str) -> None:
        self._owner, self._name = owner, name

    def __call__(self, *args, **kwargs):
        rid = self._owner._conn.call_nowait(self._owner._hid, "method", self._name, args, kwargs)  # noqa: SLF001
        return Later(self._owner, rid)

    @property
    def __name__(self) -> str:  # noqa: PLW3201
        return self._name


class Later:
    """What a chained call returned, not yet asked for: the owner itself, as it is almost always used
    (``pipe.zadd(...).zadd(...)``), or, awaited, the answer itself (a pipeline in WATCH mode runs the
    command at once). An error the call raised comes with the owner's next call."""

    __slots__ = ("_owner", "_rid")

    def __init__(self, owner: Proxy, rid: int) -> None:
        self._owner, self._rid = owner, rid

    def __getattr__(self, name: str):
        return getattr(self._owner, name)

    def __await__(self):
        return self._owner._conn.call_async(self._owner._hid, "later", None, (self._rid,), {}).__await__()  # noqa: SLF001

    def __len__(self) -> int:
        return len(self._owner)

    def __bool__(self) -> bool:
        return True

    async def __aenter__(self):
        return await self._owner.__aenter__()

    async def __aexit__(self, *exc):
        return await self._owner.__aexit__(*exc)

    def __enter__(self):
        return self._owner.__enter__()

    def __exit__(self, *exc):
        return self._owner.__exit__(*exc)

    def __repr__(self) -> str:
        return repr(self._owner)


def _dunder(name: str, is_async: bool):
    if is_async:

        async def forward(self, *args):
            return await self._conn.call_async(self._hid, "method", name, args, {})

    else:

        def forward(self, *args):
            return self._conn.call_sync(self._hid, "method", name, args, {})

    forward.__name__ = name
    return forward


def _await(self):
    return self._conn.call_async(self._hid, "await", None, (), {}).__await__()


def _call(self, *args, **kwargs):
    if self._meta.get("a"):
        return self._conn.call_async(self._hid, "call", None, args, kwargs)
    return self._conn.call_sync(self._hid, "call", None, args, kwargs)


_classes: dict[tuple, type] = {}


def proxy_class(meta: dict) -> type:
    """A Proxy subclass named as the remote type, with exactly the protocols the remote object has."""
    module, qualname = (meta.get("t") or ["", "Proxy"])[:2]
    dunders = tuple(meta.get("d") or ())
    key = (module, qualname, meta.get("k"), "a" in meta, bool(meta.get("a")), bool(meta.get("aw")), dunders)
    cls = _classes.get(key)
    if cls is not None:
        return cls
    body: dict = {"__slots__": (), "__module__": str(module)[:80], "__qualname__": str(qualname)[:120]}
    if "a" in meta:
        body["__call__"] = _call
        if meta.get("a"):
            body["_is_coroutine"] = asyncio.coroutines._is_coroutine  # noqa: SLF001
    if meta.get("k") == "await" or meta.get("aw"):
        body["__await__"] = _await
    for name in dunders:
        body[name] = _dunder(name, name in _ASYNC_DUNDERS)
    if "__eq__" in dunders and "__hash__" not in dunders:
        body["__hash__"] = None
    if "__aiter__" in dunders:
        body["__aiter__"] = lambda self: self._conn.call_sync(self._hid, "method", "__aiter__", (), {})
    name = str(qualname).rsplit(".", 1)[-1][:80] or "Proxy"
    cls = type(name, (Proxy,), body)
    _classes[key] = cls
    return cls


def each(fn, items) -> list:
    """``[fn(x) for x in items]``; in one round trip when ``fn`` is an object of the other process."""
    rows = [[x] for x in items]
    if isinstance(fn, BoundMethod):
        return fn._owner._conn.call_sync(fn._owner._hid, "map", fn._name, (rows,))  # noqa: SLF001
    if isinstance(fn, Proxy):
        return fn._conn.call_sync(fn._hid, "map", None, (rows,))  # noqa: SLF001
    return [fn(x) for x in items]


def params_of(obj) -> list | None:
    """``[[name, kind, has_default], ...]`` of a proxied callable (what ``inspect.signature`` would say)."""
    meta = getattr(obj, "_meta", None)
    return meta.get("p") if isinstance(meta, dict) else None
