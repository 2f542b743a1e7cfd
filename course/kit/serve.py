"""Serve a chapter's ASGI application (Starlette) with uvicorn on a local port, like the servers.

    from course.kit.serve import Service
    svc = Service(app, name="shortener").start()   # http://127.0.0.1:PORT, ready when it returns
    ...
    svc.stop()                                       # or: with Service(app) as svc: ...

A service runs in a thread of the process that started it (the notebook's kernel), on its
own event loop, and stops when that process exits, like the course's Redis and
PostgreSQL. Starting the same cell again stops the previous service of that name first,
so re-running a notebook never leaves a port or its connections behind.

:func:`not_done_handler` answers 501 ``not done yet: <function>`` when a request reaches a
learner's unfinished answer (see :mod:`course.kit.notebook`); :func:`app` installs it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import socket
import threading
import time

#: Running services by name: a second start of the same name stops the first.
_running: dict[str, Service] = {}
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def not_done_handler(request, exc: NotImplementedError):
    """Starlette exception handler: an unfinished answer is a 501 with one line, not a 500."""
    from starlette.responses import JSONResponse

    from course.kit.notebook import NOT_DONE, _stub_function

    where = _stub_function(exc)
    return JSONResponse({"error": f"{NOT_DONE}: {where}" if where else NOT_DONE}, status_code=501)


def app(routes, **kwargs):
    """A ``Starlette`` app with the course's not-done handler installed."""
    from starlette.applications import Starlette

    handlers = dict(kwargs.pop("exception_handlers", {}) or {})
    handlers.setdefault(NotImplementedError, not_done_handler)
    return Starlette(routes=routes, exception_handlers=handlers, **kwargs)


class Service:
    """An ASGI app served by uvicorn on ``127.0.0.1`` in a background thread."""

    def __init__(
        self, asgi_app, *, name: str = "service", host: str = "127.0.0.1", port: int = 0, **config
    ) -> None:
        self.app = asgi_app
        self.name = name
        self.host = host
        self.port = port or free_port(host)
        self.config = {"log_level": "warning", "access_log": False, "lifespan": "auto", **config}
        self._server = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> Service:
        import uvicorn

        with _lock:
            previous = _running.get(self.name)
        if previous is not None and previous is not self:
            previous.stop()
        config = uvicorn.Config(self.app, host=self.host, port=self.port, **self.config)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # not the main thread: leave signals alone

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._server.serve())
                if self._server.force_exit and self._server.started:
                    # a forced exit skips the app's lifespan shutdown: its pools and clients
                    # would stay open, holding connections, until the kernel exits
                    with contextlib.suppress(Exception):
                        self._loop.run_until_complete(asyncio.wait_for(self._server.lifespan.shutdown(), 5))
            finally:
                # requests a forced exit left running end here, not in a closed loop later
                left = asyncio.all_tasks(self._loop)
                for task in left:
                    task.cancel()
                if left:
                    self._loop.run_until_complete(asyncio.wait(left, timeout=2))
                self._loop.close()

        self._thread = threading.Thread(target=run, name=f"serve-{self.name}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"{self.name} did not start on {self.url} (is the port taken?)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start within {timeout:g} s")
            time.sleep(0.01)
        with _lock:
            _running[self.name] = self
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(timeout)
        with _lock:
            if _running.get(self.name) is self:
                del _running[self.name]

    @property
    def running(self) -> bool:
        return bool(self._thread and self._thread.is_alive() and self._server and self._server.started)

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Service({self.name!r}, {self.url}, {'running' if self.running else 'stopped'})"


def stop_all() -> None:
    """Stop every service this process started (at exit)."""
    with _lock:
        services = list(_running.values())
    for svc in services:
        svc.stop()


atexit.register(stop_all)
