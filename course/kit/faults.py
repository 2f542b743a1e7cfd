"""Fault tools: the harness settings that chapters apply, so learners never write fault code.

- :class:`VirtualClock`: time that moves only when the code sleeps (or you advance it);
  ``await clock.sleep(30)`` returns at once with ``clock()`` 30 s later. Deterministic.
- :class:`Schedule`: what a dependency does on each call ("fail fail ok fail ok") or
  during a time window (an outage from t=1 s to t=3 s).
- :class:`FlakyDependency`: an in-process async callable that follows a schedule.
- :class:`FlakyService`: a real HTTP server on 127.0.0.1 that follows a schedule
  (status codes, added latency, a hang, a connection reset), for httpx clients; built on
  :class:`LocalHTTPServer`, which chapter 03's fake payment provider shares.
- :func:`pause_redis` and :func:`kill_postgres_backend`: faults on the live servers.

Chapter 00 tours them; chapters 01-04 apply them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

# ----------------------------------------------------------------------------- clock


class VirtualClock:
    """A clock for asyncio code that never waits for real.

    Use it where code takes ``clock=`` (a function returning seconds) and ``sleep=``
    (an async sleep): ``clock`` itself is callable, ``clock.sleep`` is the sleep.

    With ``auto=True`` (the default) time jumps to the next sleeper's wake-up as soon as
    every task on the loop is waiting, so concurrent sleepers wake in deadline order
    (ties in the order they went to sleep). With ``auto=False`` time moves only through
    :meth:`advance`. Every requested sleep is recorded in :attr:`sleeps`.
    """

    def __init__(self, start: float = 0.0, *, auto: bool = True) -> None:
        self._now = float(start)
        self.auto = auto
        self.sleeps: list[float] = []
        self._heap: list[tuple[float, int, asyncio.Future]] = []
        self._seq = itertools.count()
        self._driver: asyncio.Task | None = None

    def __call__(self) -> float:
        return self._now

    def time(self) -> float:
        return self._now

    def __repr__(self) -> str:
        return f"VirtualClock(t={self._now:.6g}, sleepers={len(self._heap)})"

    async def sleep(self, seconds: float) -> None:
        seconds = float(seconds)
        if seconds < 0:
            raise ValueError(f"sleep length must be non-negative, got {seconds}")
        self.sleeps.append(seconds)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        heapq.heappush(self._heap, (self._now + seconds, next(self._seq), fut))
        if self.auto and (self._driver is None or self._driver.done()):
            self._driver = loop.create_task(self._drive())
        await fut

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` and wake every sleeper that is due."""
        if seconds < 0:
            raise ValueError("time only moves forward")
        target = self._now + seconds
        while self._heap and self._heap[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._heap)
            self._now = max(self._now, deadline)
            if not fut.done():
                fut.set_result(None)
        self._now = target

    async def run_for(self, seconds: float) -> None:
        """Advance ``seconds`` step by step, letting woken tasks run at each wake-up."""
        target = self._now + seconds
        while True:
            await _until_idle()
            if self._heap and self._heap[0][0] <= target:
                self.advance(self._heap[0][0] - self._now)
            else:
                self.advance(target - self._now)
                await _until_idle()
                return

    async def _drive(self) -> None:
        while True:
            await _until_idle()
            live = [entry for entry in self._heap if not entry[2].done()]
            if len(live) != len(self._heap):
                self._heap = live
                heapq.heapify(self._heap)
            if not self._heap:
                return
            self.advance(max(0.0, self._heap[0][0] - self._now))


_idlers: dict[int, int] = {}  # loop id -> clock drivers now inside _local_idle
#: loop id -> ``await settle(local_idle)``: waits until what this loop waits on *elsewhere* is idle
#: too (a grader's checks call code in another process: its loop must be idle as well before
#: virtual time moves). Set by whoever owns that other process; nothing here knows of it.
_beyond: dict[int, object] = {}


def settle_beyond(loop: asyncio.AbstractEventLoop, settle) -> None:
    """Make ``loop``'s idleness also wait on ``await settle(local_idle)`` (None to stop)."""
    if settle is None:
        _beyond.pop(id(loop), None)
    else:
        _beyond[id(loop)] = settle


async def _until_idle(max_rounds: int = 10_000) -> None:
    """Yield until nothing is ready to run on this loop (and, where set, beyond it: :func:`settle_beyond`)."""
    await _local_idle(max_rounds)
    settle = _beyond.get(id(asyncio.get_running_loop()))
    if settle is not None:
        await settle(_local_idle)


async def _local_idle(max_rounds: int = 10_000) -> None:
    """Yield until nothing but other clocks' drivers is ready to run on this loop.

    Several virtual clocks may drive one loop; each waiting driver keeps exactly one
    callback ready (its own ``sleep(0)``), so those are discounted.
    """
    loop = asyncio.get_running_loop()
    key = id(loop)
    _idlers[key] = _idlers.get(key, 0) + 1
    try:
        for _ in range(max_rounds):
            await asyncio.sleep(0)
            ready = getattr(loop, "_ready", None)
            if ready is None:  # an event loop without the attribute: a few rounds suffice
                for _ in range(20):
                    await asyncio.sleep(0)
                return
            if len(ready) <= _idlers[key] - 1:
                return
    finally:
        _idlers[key] -= 1
        if not _idlers[key]:
            del _idlers[key]


# ----------------------------------------------------------------------------- schedules


@dataclass(frozen=True)
class Step:
    """What a dependency does on one call.

    kind: ``ok``, ``status`` (an HTTP status, ``fail`` is 503), ``slow`` (respond after
    ``delay`` seconds), ``hang`` (never respond) or ``reset`` (drop the connection).
    """

    kind: str
    status: int = 200
    delay: float = 0.0

    @classmethod
    def parse(cls, token: str | int | Step) -> Step:
        if isinstance(token, Step):
            return token
        if isinstance(token, int):
            return cls("ok" if token < 400 else "status", status=token)
        text = token.strip().lower()
        if text == "ok":
            return cls("ok")
        if text == "fail":
            return cls("status", status=503)
        if text in ("hang", "reset"):
            return cls(text, status=0)
        if text.startswith("slow"):
            _, _, secs = text.partition(":")
            return cls("slow", delay=float(secs or 1.0))
        if text.isdigit():
            return cls.parse(int(text))
        raise ValueError(f"unknown step {token!r}: use ok, fail, a status code, slow:SECONDS, hang or reset")

    @property
    def failed(self) -> bool:
        return self.kind in ("status", "hang", "reset")

    def __str__(self) -> str:
        if self.kind == "status":
            return str(self.status)
        if self.kind == "slow":
            return f"slow:{self.delay:g}"
        return self.kind


class Schedule:
    """Which :class:`Step` the n-th call gets (n from 0), optionally by time instead.

    >>> s = Schedule("fail fail ok fail ok")
    >>> [str(s.next()) for _ in range(7)]
    ['503', '503', 'ok', '503', 'ok', 'ok', 'ok']

    ``then`` is what follows the listed steps (``"ok"`` by default, ``"repeat"`` to cycle).
    """

    def __init__(self, steps: str | Iterable = "ok", *, then: str | Step = "ok") -> None:
        tokens = steps.split() if isinstance(steps, str) else list(steps)
        if not tokens:
            raise ValueError("a schedule needs at least one step")
        self.steps = [Step.parse(t) for t in tokens]
        self.then = then if then == "repeat" else Step.parse(then)
        self.calls = 0
        self._lock = threading.Lock()
        self._by_time: Callable[[float], Step] | None = None

    @classmethod
    def outage(
        cls,
        start: float,
        end: float,
        *,
        during: str | int | Step = "fail",
        otherwise: str | int | Step = "ok",
    ) -> Schedule:
        """Fail with ``during`` while ``start <= t < end`` (seconds since the clock's zero)."""
        sched = cls("ok")
        bad, good = Step.parse(during), Step.parse(otherwise)
        sched._by_time = lambda t: bad if start <= t < end else good
        sched.description = f"outage {start:g}s-{end:g}s: {bad}, else {good}"
        return sched

    def step_at(self, index: int, t: float = 0.0) -> Step:
        if self._by_time is not None:
            return self._by_time(t)
        if index < len(self.steps):
            return self.steps[index]
        if self.then == "repeat":
            return self.steps[index % len(self.steps)]
        return self.then

    def next(self, t: float = 0.0) -> Step:
        with self._lock:
            index = self.calls
            self.calls += 1
        return self.step_at(index, t)

    def __repr__(self) -> str:
        if self._by_time is not None:
            return f"Schedule.{self.description}"
        return f"Schedule({' '.join(map(str, self.steps))!r}, then={str(self.then)!r})"


# ----------------------------------------------------------------------------- in-process dependency


class DependencyError(Exception):
    """The error a :class:`FlakyDependency` raises for a failing step (``status`` set)."""

    def __init__(self, status: int, message: str | None = None) -> None:
        super().__init__(message or f"dependency answered {status}")
        self.status = status


@dataclass
class Call:
    index: int
    at: float
    step: Step
    outcome: str = "pending"


class FlakyDependency:
    """An async callable that behaves as its schedule says; counts and records calls.

    A ``status`` step raises :class:`DependencyError` with that status, ``reset`` raises
    ``ConnectionResetError``, ``hang`` waits forever (until cancelled), ``slow`` sleeps
    on the clock first. ``ok`` returns ``value``.
    """

    def __init__(
        self,
        schedule: Schedule | str = "ok",
        *,
        clock: VirtualClock | None = None,
        value: object = "ok",
        name: str = "dependency",
    ) -> None:
        self.schedule = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
        self.clock = clock
        self.value = value
        self.name = name
        self.calls: list[Call] = []
        self.running = 0
        self.max_running = 0

    @property
    def count(self) -> int:
        return len(self.calls)

    def _now(self) -> float:
        return self.clock() if self.clock is not None else time.monotonic()

    async def __call__(self, *args, **kwargs):
        now = self._now()
        step = self.schedule.next(now)
        call = Call(len(self.calls), now, step)
        self.calls.append(call)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if step.kind == "slow":
                await (self.clock.sleep if self.clock else asyncio.sleep)(step.delay)
            elif step.kind == "hang":
                await asyncio.Event().wait()
            elif step.kind == "reset":
                call.outcome = "reset"
                raise ConnectionResetError(f"{self.name}: connection reset by peer")
            elif step.kind == "status":
                call.outcome = str(step.status)
                raise DependencyError(step.status, f"{self.name} answered {step.status}")
            call.outcome = "ok"
            return self.value
        except asyncio.CancelledError:
            call.outcome = "cancelled"
            raise
        finally:
            self.running -= 1


# ----------------------------------------------------------------------------- HTTP service


@dataclass
class HTTPRequest:
    """One request as a :class:`LocalHTTPServer` read it."""

    method: str
    path: str
    headers: dict
    body: bytes


@dataclass
class Reply:
    """What a :class:`LocalHTTPServer` does with a request: answer, ``reset`` or ``hang``."""

    status: int = 200
    body: object = None  # sent as JSON
    headers: dict = field(default_factory=dict)
    action: str = "answer"


class LocalHTTPServer:
    """A small HTTP/1.1 server on 127.0.0.1 with its own event loop in a daemon thread.

    Subclasses say how to answer in :meth:`respond`. It is hand-written on asyncio streams
    rather than served by an ASGI server because a hang and a connection reset need the
    raw socket, which ASGI hides. Sync and async code (and several notebooks' worth of
    clients) can call it.
    """

    name = "local"

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._started = 0.0
        self.port = 0

    async def respond(self, request: HTTPRequest) -> Reply:
        raise NotImplementedError

    # lifecycle ----------------------------------------------------------------
    def start(self):
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._open())
            except BaseException as err:  # noqa: BLE001 - reported to start()
                errors.append(err)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._close())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"{type(self).__name__}-{self.name}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        return self

    async def _open(self) -> None:
        self._stopping = asyncio.Event()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=512)
        self.port = self._server.sockets[0].getsockname()[1]
        self._started = time.monotonic()

    async def _close(self) -> None:
        assert self._stopping is not None and self._server is not None
        self._stopping.set()
        self._server.close()
        await asyncio.sleep(0)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self):
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def elapsed(self) -> float:
        """Seconds since the server started (or since :meth:`FlakyService.reset_clock`)."""
        return time.monotonic() - self._started

    # the wire -----------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = (lines[0].split(" ", 2) + ["", ""])[:3]
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", "0") or 0)
                body = await reader.readexactly(length) if length else b""
                reply = await self.respond(HTTPRequest(method, path, headers, body))
                if reply.action == "hang":
                    assert self._stopping is not None
                    await self._stopping.wait()
                    return
                if reply.action == "reset":
                    sock = writer.get_extra_info("socket")
                    if sock is not None:  # linger 0: close with a TCP RST, not a FIN
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                payload = json.dumps(reply.body).encode()
                out = f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Status')}\r\n"
                out += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                out += "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
                writer.write((out + "\r\n").encode() + payload)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            asyncio.LimitOverrunError,
            asyncio.CancelledError,
        ):
            pass
        finally:
            if not writer.transport.is_closing():
                writer.close()


@dataclass
class Request:
    index: int
    at: float  # seconds since the service started
    method: str
    path: str
    step: Step
    headers: dict = field(default_factory=dict)


class FlakyService(LocalHTTPServer):
    """A real HTTP/1.1 server on 127.0.0.1 that answers as its schedule says.

    Steps: ``ok`` (200 and a small JSON body), a status code (with ``Retry-After`` on
    429/503), ``slow:S`` (200 after S seconds), ``hang`` (read the request, never answer)
    and ``reset`` (close with a TCP RST).

        with FlakyService("fail fail ok") as svc:
            httpx.get(svc.url + "/pay")          # 503, 503, then 200
    """

    def __init__(
        self, schedule: Schedule | str = "ok", *, retry_after: float = 1.0, name: str = "flaky"
    ) -> None:
        super().__init__()
        self.schedule = schedule if isinstance(schedule, Schedule) else Schedule(schedule)
        self.retry_after = retry_after
        self.name = name
        self.requests: list[Request] = []

    def set_schedule(self, schedule: Schedule | str) -> None:
        self.schedule = schedule if isinstance(schedule, Schedule) else Schedule(schedule)

    def reset_clock(self) -> None:
        """Make t=0 now (for time-window schedules) and forget the request log."""
        self._started = time.monotonic()
        self.requests = []

    @property
    def count(self) -> int:
        return len(self.requests)

    async def respond(self, request: HTTPRequest) -> Reply:
        t = self.elapsed()
        step = self.schedule.next(t)
        req = Request(len(self.requests), t, request.method, request.path, step, request.headers)
        self.requests.append(req)
        if step.kind in ("hang", "reset"):
            return Reply(action=step.kind)
        if step.kind == "slow":
            await asyncio.sleep(step.delay)
        status = step.status if step.kind == "status" else 200
        extra = {"Retry-After": f"{self.retry_after:g}"} if status in (429, 503) else {}
        return Reply(status, {"request": req.index, "status": status, "service": self.name}, extra)


_REASONS = {
    200: "OK",
    201: "Created",
    400: "Bad Request",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


# ----------------------------------------------------------------------------- live servers


def pause_redis(client, seconds: float, *, mode: str = "ALL") -> None:
    """Make the Redis server stop answering clients for ``seconds`` (CLIENT PAUSE).

    ``client`` is a sync ``redis.Redis``. Commands sent meanwhile wait, then run.
    """
    client.execute_command("CLIENT", "PAUSE", int(seconds * 1000), mode)


@contextmanager
def paused_redis(client, seconds: float = 30.0):
    """Pause Redis inside the ``with`` block, unpause on the way out."""
    pause_redis(client, seconds)
    try:
        yield
    finally:
        client.execute_command("CLIENT", "UNPAUSE")


def kill_postgres_backend(conn, pid: int) -> bool:
    """Terminate the PostgreSQL backend serving connection ``pid`` (pg_terminate_backend).

    ``conn`` is any other sync psycopg connection to the same server. The victim's next
    statement fails with an ``OperationalError``, as after a crash or a failover.
    """
    row = conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
    return bool(row and row[0])


# ----------------------------------------------------------------------------- real errors

#: FlakyService steps, one call each in :func:`http_errors`: statuses, a reset, a hang.
HTTP_STEPS = (
    "200", "400", "401", "404", "408", "409", "422", "429", "500", "501", "502", "503", "504", "505", "reset", "hang"
)  # fmt: skip


async def http_errors(steps=HTTP_STEPS, *, timeout: float = 0.2) -> list[tuple[str, BaseException | None]]:
    """Call a live :class:`FlakyService` once per step, with httpx, and keep the exception each
    call raised (``raise_for_status`` for statuses; ``None`` for a 2xx): the real errors a
    client meets, for chapters that classify them (01: retry or not; 05: a message's fate)."""
    import httpx

    out: list[tuple[str, BaseException | None]] = []
    async with FlakyService(Schedule(" ".join(steps)), name="errors") as svc:
        async with httpx.AsyncClient(timeout=timeout) as client:
            for step in steps:
                try:
                    (await client.get(svc.url + "/item")).raise_for_status()
                    out.append((step, None))
                except Exception as err:  # noqa: BLE001 - collecting what each step raises
                    out.append((step, err))
    return out
