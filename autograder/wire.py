"""The wire between the grader's process and a learner's process (issue 40): calls across a socket.

The checks run in the grader's process; the learner's cells run in a sandboxed process of
their own that holds no object of the grader's. A check still reads as a call::

    got = await answer(pool, "home")          # the learner's function, in the learner's process
    ring = HashRing(["a", "b"]); ring.node_for("k")   # a class, an instance, a method

Each side exports objects as *handles* and sees the other side's objects as proxies
(:class:`Proxy`); what is done to a proxy (a call, an attribute, ``await``, ``async with``,
iteration) becomes a request to the owner. Arguments the checks pass in (a virtual clock, a
flaky dependency, a callable to retry) are served back from the grader's process when the
learner's code uses them, and the grader answers only the attributes it exposes
(:class:`Policy`). Values cross as data (:mod:`autograder.values`), never pickled.

Why not an RPC library: Pyro5 and RPyC are thread-based and synchronous, and a check needs
``await`` across the line in both directions, a call that blocks its caller while the callee
calls back (``rand()`` inside a synchronous method), cancellation that reaches the callee, and
a way to know when *both* processes have nothing left to run (virtual time moves only then:
:meth:`Conn.settled`). That is a small explicit protocol, over one stream socket: a frame is a
4-byte length and a JSON object.

Routing: a request carries ``chain``, the request its sender was serving when it sent it. A
thread blocked in a synchronous call serves the requests chained to it (the callee calling
back); anything else runs on the event loop of the thread that exported the target.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import json
import queue
import socket
import struct
import threading
import types
import weakref
from dataclasses import dataclass, field

from autograder import values
from autograder.callers import _caller, _conns, _raised, _task_number
from autograder.proxies import (  # noqa: F401 - the wire's names: checks and tests use them as wire.*
    BoundMethod,
    Policy,
    Proxy,
    Refused,
    WireError,
    describe,
    each,
    params_of,
    proxy_class,
)

MAX_FRAME = 32 << 20
_MISSING = object()
ROOT = 0  # the handle of each side's root object, known to both without a message

_serving: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("serving", default=None)
#: The event loop whose objects these are, for objects made in a thread without one (a check's
#: ``asyncio.to_thread``): set where a check starts (:meth:`autograder.session.RemoteNamespace.bind`).
home_loop: contextvars.ContextVar[asyncio.AbstractEventLoop | None] = contextvars.ContextVar("home_loop", default=None)
# ----------------------------------------------------------------------------- the connection


@dataclass
class _Export:
    obj: object
    loop: asyncio.AbstractEventLoop | None
    thread: int


@dataclass
class _Waiter:
    thread: int
    queue: queue.SimpleQueue | None = None  # a thread blocked in a synchronous call
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None
    # the caller's context variables: a callback the callee makes runs in them, as it would in one process
    context: contextvars.Context = field(default_factory=contextvars.copy_context)


class Conn:
    """One end of the wire. ``sock`` is a connected stream socket; ``root`` this side's root object."""

    def __init__(self, sock: socket.socket, root, policy: Policy, *, name: str = "wire") -> None:
        self.sock = sock
        self.policy = policy
        self.name = name
        self.alive = True
        self.error: str | None = None
        self.sent = 0
        self.received = 0
        self._ids = itertools.count(1)
        self._hids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._exports: dict[int, _Export] = {}
        self._by_id: dict[int, int] = {}
        self._proxies: weakref.WeakValueDictionary[int, Proxy] = weakref.WeakValueDictionary()
        self._pending: dict[int, _Waiter] = {}
        self._blocked: dict[int, queue.SimpleQueue] = {}  # thread ident -> its queue, while it waits
        self._tasks: dict[int, asyncio.Task] = {}
        self._where: dict[int, asyncio.AbstractEventLoop] = {}  # the loop each request in progress runs on
        self._cancelled: set[int] = set()
        self._kept: dict[int, object] = {}  # what chained calls returned that was not their owner (WATCH mode)
        self._failed: dict[int, BaseException] = {}  # handle -> what a chained call on it raised, for its next call
        self._pongs: dict[int, _Waiter] = {}
        self._fallback: queue.SimpleQueue | None = None
        self._metas: dict[type, dict] = {}
        self._bare: dict[object, queue.SimpleQueue] = {}
        self.on_ping = None  # the learner's side answers pings (see learner.py)
        try:  # objects made off any event loop are served on the loop this side was set up on
            self.default_loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.default_loop = None
        self.default_thread = threading.get_ident()
        _conns[id(self)] = self
        self._export(root, ROOT)
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-reader", daemon=True)
        self._reader.start()

    # ---------------------------------------------------------------- frames

    def _send(self, msg: dict) -> None:
        data = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
        if len(data) > MAX_FRAME:
            raise values.WireValueError(f"a message of {len(data) >> 20} MB is over the wire's limit")
        with self._send_lock:
            if not self.alive:
                raise WireError(self.error or "the other process is gone")
            try:
                self.sock.sendall(struct.pack(">I", len(data)) + data)
            except OSError as err:
                self._die(f"the other process is gone ({err.strerror or err})")
                raise WireError(self.error) from None
            self.sent += 1

    def _recv_exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(min(n - got, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _read_loop(self) -> None:
        try:
            while True:
                (size,) = struct.unpack(">I", self._recv_exact(4))
                if size > MAX_FRAME:
                    raise WireError(f"a frame of {size} bytes is over the limit")
                msg = json.loads(self._recv_exact(size))
                if not isinstance(msg, dict):
                    raise WireError("a frame that is not an object")
                self.received += 1
                self._dispatch(msg)
        except (EOFError, OSError):
            self._die(self.error or "the other process closed the connection")
        except Exception as err:  # noqa: BLE001 - a broken protocol ends this connection, nothing else
            self._die(f"the other process broke the protocol ({type(err).__name__}: {str(err)[:120]})")

    def _die(self, why: str) -> None:
        with self._lock:
            if not self.alive:
                return
            self.alive = False
            self.error = why
            pending = list(self._pending.values()) + list(self._pongs.values())
            self._pending.clear()
            self._pongs.clear()
        for waiter in pending:
            self._deliver(waiter, {"op": "dead"})
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self._die("closed")
        try:
            self.sock.close()
        except OSError:
            pass

    # ---------------------------------------------------------------- routing

    def _deliver(self, waiter: _Waiter, msg: dict) -> None:
        if waiter.queue is not None:
            waiter.queue.put(msg)
        elif waiter.loop is not None and not waiter.loop.is_closed():
            try:
                waiter.loop.call_soon_threadsafe(_resolve, waiter.future, msg)
            except RuntimeError:
                pass

    def _dispatch(self, msg: dict) -> None:
        op = msg.get("op")
        if op in ("reply", "pong"):
            with self._lock:
                waiter = (self._pending if op == "reply" else self._pongs).pop(msg.get("id"), None)
            if waiter is not None:
                self._deliver(waiter, msg)
            return
        if op == "ping":
            if self.on_ping is None:
                self._send({"op": "pong", "id": msg.get("id"), "sent": self.sent, "received": self.received})
            else:
                self.on_ping(msg)
            return
        if op == "cancel":  # on the loop that serves it, after that request's own callback (FIFO)
            loop = self._where.get(msg.get("id"))
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._cancel_now, msg.get("id"))
                except RuntimeError:
                    pass
            return
        if op not in ("call", "method", "getattr", "setattr", "delattr", "await", "map", "later"):
            raise WireError(f"unknown operation {op!r}")
        with self._lock:
            chained = self._pending.get(msg.get("chain"))
            export = self._exports.get(msg.get("h"))
        if chained is not None:
            msg["context"] = chained.context
        if chained is not None and chained.queue is not None and not msg.get("async"):
            chained.queue.put(msg)  # the thread waiting on that call serves its callee's callback
            return
        if export is None:
            self._reply_error(msg, WireError("that object was released"))
            return
        blocked = self._blocked.get(export.thread)
        if blocked is not None and not msg.get("async"):
            blocked.put(msg)
            return
        if msg.get("bare"):  # the caller ran it off its event loop: so does this side (asyncio.run() works there)
            self._bare_queue(msg["bare"]).put(msg)
            return
        loop = export.loop
        if loop is not None and not loop.is_closed():
            try:
                self._where[msg["id"]] = loop
                loop.call_soon_threadsafe(self._serve, msg)
                return
            except RuntimeError:
                self._where.pop(msg["id"], None)
        if msg.get("async"):
            self._reply_error(msg, WireError("that object's event loop is gone"))
            return
        self._fallback_serve(msg)

    def _bare_queue(self, thread) -> queue.SimpleQueue:
        """The thread (one per calling thread of the other side) that serves calls made off an event loop."""
        found = self._bare.get(thread)
        if found is None:
            found = self._bare[thread] = queue.SimpleQueue()
            threading.Thread(target=self._bare_loop, args=(found,), name=f"{self.name}-bare", daemon=True).start()
        return found

    def _bare_loop(self, work: queue.SimpleQueue) -> None:
        while self.alive:
            try:
                msg = work.get(timeout=1.0)
            except queue.Empty:
                continue
            self._serve(msg)

    def _fallback_serve(self, msg: dict) -> None:
        if self._fallback is None:
            self._fallback = queue.SimpleQueue()
            threading.Thread(target=self._fallback_loop, name=f"{self.name}-serve", daemon=True).start()
        self._fallback.put(msg)

    def _fallback_loop(self) -> None:
        while self.alive:
            self._serve(self._fallback.get())

    # ---------------------------------------------------------------- serving

    def _served(self, task: asyncio.Task, msg: dict) -> None:
        self._tasks.pop(msg["id"], None)
        self._where.pop(msg["id"], None)
        if not msg.get("replied"):  # cancelled before its first step: the caller still hears of it
            self._reply_error(msg, asyncio.CancelledError())

    def _cancel_now(self, rid) -> None:
        task = self._tasks.get(rid)
        if task is not None:
            task.cancel()
        else:
            self._cancelled.add(rid)  # cancelled before it started: it will not start

    def _serve(self, msg: dict) -> None:
        if msg.get("async"):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._reply_error(msg, RuntimeError("cannot await across the wire from synchronous code"))
                return
            context = msg.get("context")
            task = loop.create_task(self._serve_async(msg), context=context.copy() if context else None)
            self._tasks[msg["id"]] = task
            task.add_done_callback(lambda t, m=msg: self._served(t, m))
            if msg["id"] in self._cancelled:
                self._cancelled.discard(msg["id"])
                task.cancel()
            return
        self._where.pop(msg.get("id"), None)
        context = msg.get("context")
        if context is not None:
            context.copy().run(self._serve_sync, msg)
        else:
            self._serve_sync(msg)

    def _serve_sync(self, msg: dict) -> None:
        token = _serving.set((id(self), msg["id"]))
        by = _caller.set((id(self), msg["by"]) if msg.get("by") else None)
        if msg.get("nowait"):  # a chained call (Policy.chains): nobody waits for its answer
            try:
                self._keep(msg, self._execute(msg))
            except BaseException as err:  # noqa: BLE001 - raised with the owner's next call
                self._failed[msg.get("h")] = err
            finally:
                _caller.reset(by)
                _serving.reset(token)
            return
        try:
            self._reply(msg, self._execute(msg))  # an awaitable result crosses as a handle to await
        except BaseException as err:  # noqa: BLE001 - whatever the callee raised goes back
            self._reply_error(msg, err)
        finally:
            _caller.reset(by)
            _serving.reset(token)

    async def _serve_async(self, msg: dict) -> None:
        _serving.set((id(self), msg["id"]))
        _caller.set((id(self), msg["by"]) if msg.get("by") else None)
        try:
            result = self._execute(msg)
            if inspect.isawaitable(result):
                result = await result
            self._reply(msg, result)
        except BaseException as err:  # noqa: BLE001
            task = asyncio.current_task()
            if task is not None:
                _raised[task] = err
            self._reply_error(msg, err)
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                return

    def _keep(self, msg: dict, result) -> None:
        export = self._exports.get(msg.get("h"))
        if export is not None and result is export.obj:
            return  # the owner, as a chained call almost always returns
        self._kept[msg["id"]] = result
        while len(self._kept) > 10_000:  # never asked for: a coroutine, closed
            old = self._kept.pop(next(iter(self._kept)))
            if inspect.iscoroutine(old):
                old.close()

    def _execute(self, msg: dict):
        export = self._exports.get(msg.get("h"))
        if export is None:
            raise WireError("that object was released")
        failed = self._failed.pop(msg.get("h"), None)
        if failed is not None:
            raise failed
        obj, op, name = export.obj, msg["op"], msg.get("name")
        if name is not None and (not isinstance(name, str) or not self.policy.allowed(obj, name)):
            if isinstance(name, str) and inspect.getattr_static(obj, name, _MISSING) is _MISSING:
                # what one process would say (a learner's code may catch it, as hasattr() does)
                raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
            raise Refused(f"{type(obj).__name__}.{name} is not open to the other process")
        if op in ("call", "await") and not self.policy.allowed(obj, "__call__" if op == "call" else "__await__"):
            raise Refused(f"{type(obj).__name__} cannot be called from the other process")
        args = [self.decode(a) for a in msg.get("args", [])]
        kwargs = {str(k): self.decode(v) for k, v in (msg.get("kwargs") or {}).items()}
        if op == "later":  # what a chained call returned (its owner, unless it ran at once)
            return self._kept.pop(args[0] if args else 0, obj)
        if op == "call":
            return obj(*args, **kwargs)
        if op == "method":
            if name in ("__aexit__", "__exit__") and len(args) == 3:  # (type, error, traceback): ours, rebuilt
                args = [type(args[1]), args[1], None] if isinstance(args[1], BaseException) else [None, None, None]
            return getattr(obj, name)(*args, **kwargs)
        if op == "map":  # one call per argument list, in order, in one round trip (a check's loop over keys)
            fn = getattr(obj, name) if name is not None else obj
            return [fn(*one) for one in args[0]]
        if op == "getattr":
            return getattr(obj, name)
        if op == "setattr":
            setattr(obj, name, args[0])
            return None
        if op == "delattr":
            delattr(obj, name)
            return None
        return obj  # await: the coroutine itself, awaited by _serve_async

    def _reply(self, msg: dict, result) -> None:
        msg["replied"] = True
        try:
            encoded = self.encode(result)
        except Exception as err:  # noqa: BLE001 - a result that cannot cross is an error the caller sees
            self._reply_error(msg, err)
            return
        self._safe_send({"op": "reply", "id": msg["id"], "ok": encoded})

    def _reply_error(self, msg: dict, err: BaseException) -> None:
        msg["replied"] = True
        try:
            encoded = self._encode_error(err)
        except Exception:  # noqa: BLE001
            encoded = {"mro": [["builtins", "RuntimeError"]], "str": "an error that could not cross", "args": []}
        self._safe_send({"op": "reply", "id": msg.get("id"), "err": encoded})

    def _safe_send(self, msg: dict) -> None:
        try:
            self._send(msg)
        except (WireError, values.WireValueError):
            pass

    # ---------------------------------------------------------------- calling

    def _request(self, hid: int, op: str, name, args, kwargs, is_async: bool) -> tuple[int, dict]:
        rid = next(self._ids)
        current = _serving.get()
        chain = current[1] if current is not None and current[0] == id(self) else None
        msg = {"op": op, "id": rid, "h": hid, "chain": chain, "async": is_async, "by": _task_number()}
        if not is_async and not _loop_running():
            msg["bare"] = threading.get_ident()  # from a thread with no event loop (asyncio.to_thread): served alike
        if name is not None:
            msg["name"] = name
        if args:
            msg["args"] = [self.encode(a) for a in args]
        if kwargs:
            msg["kwargs"] = {str(k): self.encode(v) for k, v in kwargs.items()}
        return rid, msg

    def call_nowait(self, hid: int, op: str, name=None, args=(), kwargs=None) -> int:
        """Send a chained call (see :meth:`Policy.chains`) and go on; its id, to ask for its answer."""
        rid, msg = self._request(hid, op, name, args, kwargs, False)
        msg["nowait"] = True
        self._send(msg)
        return rid

    def call_sync(self, hid: int, op: str, name=None, args=(), kwargs=None):
        rid, msg = self._request(hid, op, name, args, kwargs, False)
        me = threading.get_ident()
        waiter = _Waiter(me, queue=queue.SimpleQueue())
        outer = self._blocked.get(me)
        with self._lock:
            self._pending[rid] = waiter
        self._blocked[me] = waiter.queue
        try:
            self._send(msg)
            while True:
                try:
                    got = waiter.queue.get(timeout=0.05)  # short waits: an interrupt can land between them
                except queue.Empty:
                    continue
                if got.get("op") in ("reply", "dead"):
                    return self._result(got)
                self._serve(got)
        finally:
            with self._lock:
                self._pending.pop(rid, None)
            if outer is None:
                self._blocked.pop(me, None)
            else:
                self._blocked[me] = outer

    async def call_async(self, hid: int, op: str, name=None, args=(), kwargs=None):
        rid, msg = self._request(hid, op, name, args, kwargs, True)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(threading.get_ident(), loop=loop, future=loop.create_future())
        with self._lock:
            self._pending[rid] = waiter
        try:
            self._send(msg)
            got = await asyncio.shield(waiter.future)
        except asyncio.CancelledError:
            if self.alive and not waiter.future.done():
                self._safe_send({"op": "cancel", "id": rid})
                try:
                    await waiter.future  # the callee's own cleanup runs before the caller goes on
                except BaseException:  # noqa: BLE001, S110
                    pass
            raise
        finally:
            with self._lock:
                self._pending.pop(rid, None)
        return self._result(got)

    def _result(self, msg: dict):
        if msg.get("op") == "dead":
            raise WireError(self.error or "the other process is gone")
        if "err" in msg:
            err = self._decode_error(msg["err"])
            raise err
        return self.decode(msg.get("ok"))

    # ---------------------------------------------------------------- settling

    async def ping(self) -> dict:
        """The other side's ``{"sent", "received"}`` once its event loop has nothing ready to run."""
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(threading.get_ident(), loop=loop, future=loop.create_future())
        with self._lock:
            self._pongs[rid] = waiter
        self._send({"op": "ping", "id": rid})
        got = await waiter.future
        if got.get("op") == "dead":
            raise WireError(self.error or "the other process is gone")
        return got

    def pong(self, msg: dict) -> None:
        self._safe_send({"op": "pong", "id": msg.get("id"), "sent": self.sent, "received": self.received})

    # ---------------------------------------------------------------- values

    def _export(self, obj, hid: int | None = None) -> int:
        with self._lock:
            found = self._by_id.get(id(obj))
            if found is not None and self._exports.get(found) is not None and self._exports[found].obj is obj:
                return found
            hid = next(self._hids) if hid is None else hid
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # made off any loop (a thread of asyncio.to_thread): the caller's home loop serves it
                loop = home_loop.get() or self.default_loop
            thread = threading.get_ident() if loop is not self.default_loop else self.default_thread
            self._exports[hid] = _Export(obj, loop, thread)
            self._by_id[id(obj)] = hid
            return hid

    def release_all(self) -> None:
        """Forget every export but the root (between tasks: what a check handed out is done with)."""
        with self._lock:
            root = self._exports.get(ROOT)
            self._exports = {ROOT: root} if root else {}
            self._by_id = {id(root.obj): ROOT} if root else {}

    def proxy(self, hid: int, meta: dict) -> Proxy:
        found = self._proxies.get(hid)
        if found is not None:
            return found
        cls = proxy_class(meta)
        made = object.__new__(cls)
        object.__setattr__(made, "_conn", self)
        object.__setattr__(made, "_hid", hid)
        object.__setattr__(made, "_meta", meta)
        self._proxies[hid] = made
        return made

    def root(self) -> Proxy:
        """The other side's root object."""
        return self.proxy(ROOT, {"k": "obj", "t": ["", "Root"], "m": {}, "d": []})

    def encode(self, value, depth: int = 0):
        if isinstance(value, Proxy) and value._conn is self:  # noqa: SLF001 - one of the other side's objects
            return ["h", value._hid]  # noqa: SLF001
        plain = values.encode_plain(value, depth, self.encode)
        if plain is not None or value is None:
            return plain
        if isinstance(value, types.TracebackType):
            return None  # a traceback's frames stay where they are (an error carries its lines as data)
        special = self.policy.encode_special(value, self.encode, depth)
        if special is not None:
            return special
        if isinstance(value, BaseException):
            return ["e", self._encode_error(value, depth)]
        spec = self.policy.resource(value)
        if spec is not None:
            return ["x", spec, self._export(value)]
        return ["r", self._export(value), self._describe(value)]

    def _describe(self, value) -> dict:
        if (
            inspect.isclass(value)
            or inspect.isroutine(value)
            or inspect.iscoroutine(value)
            or isinstance(value, asyncio.Future)
        ):
            return describe(value, self.policy)
        # an instance (an awaitable one too: a redis-py client): what it offers is its class's, and a call
        # is checked against the policy again when it comes (describing a client is 20 ms: 500 names)
        cached = self._metas.get(type(value))
        if cached is None:
            cached = self._metas[type(value)] = describe(value, self.policy)
        return cached

    def decode(self, value):
        if not isinstance(value, list):
            if isinstance(value, dict):
                raise WireError("an untagged object")
            return value
        if not value or not isinstance(value[0], str):
            raise WireError("an untagged list")
        tag = value[0]
        if tag == "h":
            export = self._exports.get(value[1])
            if export is None:
                raise WireError("that object was released")
            return export.obj
        if tag == "r":
            meta = value[2] if isinstance(value[2], dict) else {}
            return self.proxy(int(value[1]), meta)
        if tag == "e":
            return self._decode_error(value[1])
        if tag == "x":
            return self.policy.materialize({**value[1], "hid": value[2]})
        try:
            return values.decode_plain(value, self.decode)
        except KeyError:
            return self.policy.decode_special(tag, value, self.decode)

    def _encode_error(self, err: BaseException, depth: int = 0) -> dict:
        data = values.exception_data(err, self.encode, depth, self._encode_error)
        owner = getattr(err, "__wire_hid__", None)
        if isinstance(owner, tuple) and owner[0] == id(self):
            data["ours"] = owner[1]  # it came from the other side: it goes back as their own object
        else:
            data["hid"] = self._export(err)
        return data

    def _decode_error(self, data: dict) -> BaseException:
        if not isinstance(data, dict):
            return WireError("a malformed error")
        hid = data.get("ours")
        if isinstance(hid, int):
            export = self._exports.get(hid)
            if export is not None and isinstance(export.obj, BaseException):
                return export.obj
        err = values.rebuild_exception(data, self.decode, self._decode_error)
        if isinstance(data.get("hid"), int):
            try:
                err.__wire_hid__ = (id(self), data["hid"])  # sent back, it is the sender's object again
            except Exception:  # noqa: BLE001, S110
                pass
        return err


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _resolve(future: asyncio.Future, msg: dict) -> None:
    if not future.done():
        future.set_result(msg)
