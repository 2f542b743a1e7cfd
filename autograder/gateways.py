"""The only server addresses a learner's process can reach while it is graded (issue 40).

:class:`PostgresGate` is a unix socket in the grader's process that passes a connection on to
PostgreSQL only when its startup message names the run's own role and one of the run's
databases; the role itself is no superuser and owns nothing else (:mod:`autograder.privileges`).

:class:`RedisGate` is a Redis proxy: each learner connection is relayed to Redis as the run's ACL
user, on the logical database it asked for if that database is the run's, and it refuses ``AUTH``
and ``HELLO ... AUTH`` (which would switch users) before Redis sees them. It also holds commands
for a lockstep (:mod:`autograder.lockstep`): while :meth:`RedisGate.hold` is on, each command
waits until the check lets a round go, whatever client the learner's code built.

Both run on one background thread with an event loop of their own (:class:`GatewayLoop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections.abc import Callable
from pathlib import Path

SSL_REQUEST, GSS_REQUEST, CANCEL_REQUEST = 80877103, 80877104, 80877102
BLOCKING = {b"blpop", b"brpop", b"brpoplpush", b"blmove", b"bzpopmin", b"bzpopmax", b"wait", b"blmpop", b"bzmpop"}


class GatewayLoop:
    """A thread running an event loop for the gateways; :meth:`run` calls into it from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateways", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(shutdown(), 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def _connect(target: tuple) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if target[0] == "unix":
        return await asyncio.open_unix_connection(target[1], limit=1 << 22)
    return await asyncio.open_connection(target[1], target[2], limit=1 << 22)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (OSError, RuntimeError, asyncio.IncompleteReadError):
        dst.close()


# ----------------------------------------------------------------------------- PostgreSQL


def _pg_error(message: str) -> bytes:
    fields = b"".join(
        k + v.encode() + b"\0" for k, v in ((b"S", "FATAL"), (b"V", "FATAL"), (b"C", "28000"), (b"M", message))
    )
    body = fields + b"\0"
    return b"E" + struct.pack(">I", len(body) + 4) + body


class PostgresGate:
    """``path`` (a folder): a socket ``.s.PGSQL.<port>`` there relays to ``target`` for ``user`` only."""

    def __init__(self, gateways: GatewayLoop, folder: Path, port: int, target: tuple, user: str) -> None:
        self.gateways, self.target, self.user = gateways, target, user
        self.databases: set[str] = set()
        self.refused: list[str] = []
        self.path = folder / f".s.PGSQL.{port}"
        folder.mkdir(parents=True, exist_ok=True)
        self.server = gateways.run(asyncio.start_unix_server(self._serve, path=str(self.path)))

    def allow(self, database: str) -> None:
        self.databases.add(database)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readexactly(8)
                length, code = struct.unpack(">II", head)
                if not 8 <= length <= 10_000:
                    return
                body = await reader.readexactly(length - 8)
                if code in (SSL_REQUEST, GSS_REQUEST):
                    writer.write(b"N")  # no encryption on a local socket
                    await writer.drain()
                    continue
                break
            if code == CANCEL_REQUEST:  # a cancel carries the backend's secret, known only to its own session
                up_reader, up_writer = await _connect(self.target)
                up_writer.write(head + body)
                await up_writer.drain()
                up_writer.close()
                return
            params = body.split(b"\0")
            pairs = dict(zip(params[0::2], params[1::2], strict=False))
            user = pairs.get(b"user", b"").decode(errors="replace")
            database = pairs.get(b"database", pairs.get(b"user", b"")).decode(errors="replace")
            problem = None
            if user != self.user:
                problem = f'the grading sandbox connects as role "{self.user}" only, not "{user}"'
            elif database not in self.databases:
                problem = f'database "{database}" is not one of this grading run\'s'
            elif b"replication" in pairs:
                problem = "replication connections are refused while grading"
            if problem:
                self.refused.append(problem)
                writer.write(_pg_error(problem))
                await writer.drain()
                return
            up_reader, up_writer = await _connect(self.target)
            up_writer.write(head + body)
            await up_writer.drain()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self.gateways.call(self.server.close)


# ----------------------------------------------------------------------------- Redis


class _Resp:
    """Counts complete RESP values in a byte stream (replies from Redis), RESP2 and RESP3."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.stack: list[int] = []  # items still due in the aggregates being read

    def feed(self, data: bytes) -> int:
        """How many top-level values ``data`` completed."""
        self.buf += data
        done, pos = 0, 0
        while True:
            end = self.buf.find(b"\r\n", pos)
            if end < 0:
                break
            kind, line = self.buf[pos : pos + 1], self.buf[pos + 1 : end]
            nxt = end + 2
            if kind in (b"$", b"=", b"!"):
                size = int(line)
                if size >= 0:
                    if len(self.buf) < nxt + size + 2:
                        break
                    nxt += size + 2
                items = 0
            elif kind in (b"*", b"~", b">"):
                items = max(int(line), 0)
            elif kind in (b"%", b"|"):
                items = max(int(line), 0) * 2
            else:
                items = 0
            pos = nxt
            if kind == b"|":  # attributes precede a value: the value is still due
                self.stack.append(items + 1)
                continue
            if items:
                self.stack.append(items)
                continue
            while True:  # one value done: close the aggregates it completes
                if not self.stack:
                    done += 1
                    break
                self.stack[-1] -= 1
                if self.stack[-1] > 0:
                    break
                self.stack.pop()
        del self.buf[:pos]
        return done


def _command(buf: bytearray) -> tuple[list[bytes], int] | None:
    """One RESP array command from the front of ``buf``: (its parts, bytes used), or None if incomplete."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    if buf[:1] != b"*":
        raise ValueError("only RESP arrays are accepted")
    count, pos, parts = int(buf[1:end]), end + 2, []
    for _ in range(count):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        if buf[pos : pos + 1] != b"$":
            raise ValueError("a command part that is not a bulk string")
        size = int(buf[pos + 1 : end])
        if len(buf) < end + 2 + size + 2:
            return None
        parts.append(bytes(buf[end + 2 : end + 2 + size]))
        pos = end + 2 + size + 2
    return parts, pos


def _error(text: str) -> bytes:
    return b"-" + text.replace("\r", " ").replace("\n", " ").encode() + b"\r\n"


class _Link:
    """One learner connection and its connection to Redis."""

    def __init__(self, gate: RedisGate, order: int, writer: asyncio.StreamWriter) -> None:
        self.gate, self.order, self.writer = gate, order, writer
        self.up_reader: asyncio.StreamReader | None = None
        self.up_writer: asyncio.StreamWriter | None = None
        self.db: int | None = None
        self.in_flight = 0
        self.subscribed = False
        self.multi = False
        self.hello: bytes | None = None
        self.pump: asyncio.Task | None = None
        self.busy = False  # between reading a command and holding or sending it
        self.buffered = 0  # bytes read but not yet a whole command

    def answer(self, data: bytes) -> None:
        """Write to the learner's side, counted: a reply it has yet to read wakes it up (see ``written``)."""
        self.gate.written += 1
        self.writer.write(data)

    def unread(self) -> int:
        """Bytes waiting in this connection's socket, and read but not yet parsed."""
        import fcntl
        import termios

        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return self.buffered
        try:
            got = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return self.buffered
        return int.from_bytes(got, "little") + self.buffered

    async def bind(self, db: int) -> None:
        """(Re)connect upstream as the run's user, on database ``db``."""
        if self.up_writer is not None:
            self.up_reader = None  # the old reply pump ends without closing the learner's side
            self.up_writer.close()
            if self.pump is not None:
                self.pump.cancel()
        reader, writer = await _connect(self.gate.target)
        hello = [[b"SELECT", str(db).encode()], [b"AUTH", self.gate.user.encode(), self.gate.password.encode()]]
        writer.write(b"".join(_encode(c) for c in hello))
        await writer.drain()
        for _ in hello:
            line = await reader.readline()
            if not line.startswith(b"+"):
                raise ConnectionError(f"Redis refused the grading proxy: {line.decode(errors='replace').strip()}")
        if self.hello is not None:  # the protocol the client chose (HELLO 3) holds on the new connection too
            writer.write(self.hello)
            await writer.drain()
            parser = _Resp()
            while not parser.feed(await reader.read(65536)):
                pass
        self.up_reader, self.up_writer, self.db = reader, writer, db
        self.pump = asyncio.get_running_loop().create_task(self._replies(reader))
        self.gate._tasks.add(self.pump)
        self.pump.add_done_callback(self.gate._tasks.discard)

    async def _replies(self, reader: asyncio.StreamReader) -> None:
        parser = _Resp()
        try:
            while data := await reader.read(65536):
                self.answer(data)
                if not self.subscribed:
                    self.in_flight = max(0, self.in_flight - parser.feed(data))
                await self.writer.drain()
        except (OSError, RuntimeError, ValueError):
            pass
        finally:
            if self.up_reader is reader:  # Redis went away (not a SELECT moving this link elsewhere)
                self.in_flight = 0
                self.gate.changed()
                self.writer.close()

    async def send(self, parts: list[bytes], raw: bytes) -> None:
        name = parts[0].lower() if parts else b""
        if name in BLOCKING or (name in (b"xread", b"xreadgroup") and b"block" in (p.lower() for p in parts)):
            pass  # a blocking command is parked at Redis, not in flight: it must not hold a round up
        elif not self.subscribed:
            self.in_flight += 1
        if name in (b"subscribe", b"psubscribe"):
            self.subscribed = True
        if name == b"hello":
            self.hello = raw
        self.up_writer.write(raw)
        await self.up_writer.drain()


def _encode(parts: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


class RedisGate:
    """A Redis proxy at ``path`` for one learner process (see the module docstring)."""

    def __init__(
        self, gateways: GatewayLoop, path: Path, target: tuple, user: str, password: str, dbs: set[int], default_db: int
    ) -> None:
        self.gateways, self.target, self.user, self.password = gateways, target, user, password
        self.dbs = dbs  # shared with the other gates of the run: a database the check makes is added there
        self.default_db = default_db  # a client that sends no SELECT (its URL says db 0) lands here
        self.path = path
        self.links: list[_Link] = []
        self.holding = False
        self.held: list[tuple[_Link, list[bytes], bytes]] = []
        self.refused: list[str] = []
        self.watchers: list[Callable[[], None]] = []
        self._order = 0
        self.pending = 0  # held commands released whose connection has not sent them on yet
        self.written = 0  # writes to the learner's side: one between two looks means the learner had news
        self._tasks: set[asyncio.Task] = set()
        self.server = gateways.run(asyncio.start_unix_server(self._serve, path=str(path), limit=1 << 22))

    # ---------------------------------------------------------------- what a check sees (any thread)

    def in_flight(self) -> int:
        """Commands released but not yet answered (a round is not over while one is)."""
        return self.pending + sum(link.in_flight for link in self.links)

    def drained(self) -> bool:
        """Has this gateway read and sorted every byte its learner process sent? (A command written just
        before that process said it was idle is in a socket buffer, not yet held: the round is not over.)"""

        async def look() -> bool:
            import select

            for _ in range(3):  # an accept and the first read of a new connection take a few turns of this loop
                await asyncio.sleep(0)
            listening = [sock.fileno() for sock in self.server.sockets]
            if select.select(listening, [], [], 0)[0]:
                return False  # a connection the learner's process opened, not yet accepted
            return all(link.unread() == 0 and not link.busy for link in self.links)

        try:
            return self.gateways.run(look(), 5)
        except Exception:  # noqa: BLE001 - a gateway that does not answer is not drained
            return False

    def changed(self) -> None:
        for watch in list(self.watchers):
            watch()

    def hold(self, on: bool) -> None:
        """Hold every learner command from now on (True), or let them all go (False)."""

        def switch() -> None:
            self.holding = on
            if not on:
                self._release()

        self.gateways.call(switch)

    def release(self) -> int:
        """Let every held command go, in the order they came (one round of a lockstep); how many."""
        return self.gateways.run(self._release_async(), 10)

    async def _release_async(self) -> int:
        return self._release()

    def _release(self) -> int:
        held, self.held = self.held, []
        per_link: dict[_Link, list] = {}
        for link, parts, raw in held:
            per_link.setdefault(link, []).append((parts, raw))
        for link in sorted(per_link, key=lambda x: x.order):  # connections in the order this process opened them
            self.pending += 1
            task = asyncio.get_running_loop().create_task(self._forward(link, per_link[link]))
            self._tasks.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(self._tasks.discard)
        return len(held)

    # ---------------------------------------------------------------- serving

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._order += 1
        link = _Link(self, self._order, writer)
        self.links.append(link)
        buf = bytearray()
        try:
            while data := await reader.read(65536):
                buf += data
                link.busy = True
                try:
                    while (found := _command(buf)) is not None:
                        parts, used = found
                        raw = bytes(buf[:used])
                        del buf[:used]
                        await self._command(link, parts, raw)
                finally:
                    link.busy, link.buffered = False, len(buf)
        except ValueError as err:
            writer.write(_error(f"ERR the grading proxy: {err}"))
        except (OSError, asyncio.IncompleteReadError, RuntimeError):
            pass
        finally:
            writer.close()
            if link.up_writer is not None:
                link.up_writer.close()
            with contextlib.suppress(ValueError):
                self.links.remove(link)
            self.changed()

    async def _command(self, link: _Link, parts: list[bytes], raw: bytes) -> None:
        name = parts[0].lower() if parts else b""
        if name == b"auth" or (name == b"hello" and any(p.lower() == b"auth" for p in parts[2:])):
            self.refused.append(name.decode().upper())
            link.answer(_error("NOPERM the grading sandbox cannot switch Redis users"))
            return
        if name == b"client" and len(parts) > 1 and parts[1].lower() == b"setinfo":
            link.answer(b"+OK\r\n")  # a client library's name and version: nothing to refuse, nothing to pass on
            return
        if name == b"select":
            try:
                db = int(parts[1])
            except (IndexError, ValueError):
                link.answer(_error("ERR invalid DB index"))
                return
            if db not in self.dbs:
                self.refused.append(f"SELECT {db}")
                link.answer(_error(f"NOPERM database {db} is not one of this grading run's"))
                return
            if link.multi:
                link.answer(_error("ERR SELECT inside MULTI is refused by the grading proxy"))
                return
            await self._select(link, db)  # connecting: never held (a client's handshake is no command of its caller)
            return
        if link.up_writer is None:
            await self._select(link, self.default_db, reply=False)
        if name == b"hello":  # the handshake of a new connection goes at once, as it does in one process
            await link.send(parts, raw)
            return
        if name == b"multi":
            link.multi = True
        elif name in (b"exec", b"discard"):
            link.multi = False
        if self.holding:
            self.held.append((link, parts, raw))
            self.changed()
            return
        await link.send(parts, raw)

    async def _select(self, link: _Link, db: int, reply: bool = True) -> None:
        if link.db != db:
            try:
                await link.bind(db)
            except (OSError, ConnectionError) as err:
                link.answer(_error(f"ERR the grading proxy could not reach Redis: {err}"))
                return
        if reply:
            link.answer(b"+OK\r\n")

    async def _forward(self, link: _Link, commands: list[tuple[list[bytes], bytes]]) -> None:
        """One connection's held commands, in the order it sent them."""
        try:
            for parts, raw in commands:
                if parts[0].lower() == b"select":
                    await self._select(link, int(parts[1]))
                    continue
                if link.up_writer is None:
                    await self._select(link, self.default_db, reply=False)
                await link.send(parts, raw)
        except (OSError, RuntimeError):
            pass
        finally:
            self.pending -= 1

    def close(self) -> None:
        def stop() -> None:
            self.server.close()
            for link in list(self.links):
                link.writer.close()
                if link.up_writer is not None:
                    link.up_writer.close()

        self.gateways.call(stop)
