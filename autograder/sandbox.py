"""Run learner code in a sandbox: bubblewrap namespaces, cgroups and rlimits (standard library only).

Inside, a program sees its ``workdir`` (read-write), the ``readonly`` paths at their real
paths, the system directories a Python process needs, a private ``/proc``, ``/dev`` and
``/tmp``. It has no network but its own loopback: the course's servers appear as unix
sockets under ``/run/course`` (TCP servers through a forwarder in this process), with
``REDIS_URL`` / ``DATABASE_URL`` rewritten to them. Memory, processes, CPU time, file size
and open files are bounded: as root by cgroups (v2 when a delegated cgroup2 has memory and
pids, else v1) and rlimits, as a user by rlimits. docs/INSTRUCTORS.md section 9: what it guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit

INSIDE = Path("/run/course")  # where the course's servers appear inside the sandbox
HOME = "/tmp/home"
MB = 1024 * 1024
_BWRAP_OWN = 3  # bwrap's monitor and init processes, counted against the process limit
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "alternatives", "fonts")
_UNSANDBOXED = (
    "grading WITHOUT a sandbox: learner code runs with your rights and can read solutions/, "
    "the gradebook, other submissions and your home folder, and reach the network; only resource limits apply"
)
_INSTALL = (
    "Install bubblewrap (Debian/Ubuntu: sudo apt-get install bubblewrap), or grade without a "
    "sandbox by passing the explicit unsandboxed flag, knowing that learner code then runs with your rights"
)


class SandboxError(RuntimeError):
    """The sandbox could not be set up as asked; the message says why."""


class SandboxUnavailable(SandboxError):
    """bubblewrap is missing or does not work here; the message says what to do."""


@dataclass(frozen=True)
class Limits:
    """What one sandbox may use. ``wall_seconds`` kills the whole sandbox (None: no limit)."""

    memory_mb: int = 2048
    processes: int = 256
    cpu_seconds: int = 600
    file_mb: int = 64
    open_files: int = 512
    wall_seconds: float | None = 900.0


# --------------------------------------------------------------------------- availability


def _find_bwrap() -> str | None:
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None)


def _system_args() -> list[str]:
    """The system directories, /proc, /dev and /etc pieces every sandbox gets."""
    args: list[str] = []
    for path in (*_SYSTEM_DIRS, *(f"/etc/{name}" for name in _ETC)):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    # uid 0 needs no capability to write most of /proc/sys (kernel.core_pattern runs a host program)
    return [*args, "--proc", "/proc", "--remount-ro", "/proc", "--dev", "/dev"]


def _flags() -> list[str]:
    """Namespaces and privileges. Root sets up without a user namespace (so it can bind a server's
    socket from a folder another user owns, like embedded PostgreSQL's as root); the program
    itself then runs as uid 0 without any capability and with no_new_privs, as a user does."""
    user = [] if os.geteuid() == 0 else ["--unshare-user"]
    namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    return [*user, *namespaces, "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]


def _probe(exe: str | None) -> tuple[bool, str]:
    if not exe:
        return False, "bubblewrap (bwrap) is not installed on this machine"
    try:
        size = ["--size", str(MB)] if _sizes(exe) else []  # as in every run
        argv = [exe, *_flags(), *_system_args(), *size, "--tmpfs", "/tmp", "--remount-ro", "/", "--", "/bin/true"]
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        return False, f"bubblewrap ({exe}) is installed but could not be run here ({err})"
    if done.returncode != 0:
        detail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return False, f"bubblewrap ({exe}) is installed but cannot create a sandbox here ({detail})"
    return True, f"bubblewrap ({exe}) works here"


@functools.cache
def _sizes(exe: str) -> bool:
    """Can this bubblewrap bound a tmpfs (--size: 0.7 and later, not setuid)? Else /tmp is bounded by memory alone."""
    if os.stat(exe).st_mode & stat.S_ISUID and os.getuid() != 0:
        return False
    return "--size" in subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=20).stdout


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """Is bubblewrap present and able to create a sandbox here? ``(answer, why)``, probed once."""
    return _probe(_find_bwrap())


# --------------------------------------------------------------------------- servers


@dataclass
class _Route:
    """One server URL: how the sandbox reaches it (a host unix socket bound inside, or a bridge)."""

    key: str
    url: str  # the URL inside the sandbox
    inside: Path  # the socket's path inside
    socket: Path | None = None  # a unix socket of the host, bound at ``inside``
    tcp: tuple[str, int] | None = None  # or a TCP address, bridged


def _query(pairs: list[tuple[str, str]]) -> str:
    return "&".join(f"{quote(k)}={quote(v, safe='/')}" for k, v in pairs)


def _route(key: str, url: str) -> _Route:
    """Where ``url`` (a Redis or PostgreSQL URL) is reached from inside the sandbox."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    name = re.sub(r"[^a-z0-9]+", "-", key.lower().removesuffix("_url")) or "server"
    query = parse_qsl(parts.query, keep_blank_values=True)
    userinfo = parts.netloc.rpartition("@")[0] + "@" if "@" in parts.netloc else ""  # kept as written
    if scheme in ("redis", "unix"):
        inside = INSIDE / f"{name}.sock"
        db = (parts.path.strip("/") if scheme == "redis" else "") or dict(query).get("db") or "0"
        rest = [(k, v) for k, v in query if k != "db"] + [("db", db)]
        inside_url = f"unix://{userinfo}{inside}?{_query(rest)}"
        if scheme == "unix":
            return _Route(key, inside_url, inside, socket=Path(unquote(parts.path)))
        return _Route(key, inside_url, inside, tcp=(parts.hostname or "localhost", parts.port or 6379))
    if scheme in ("postgresql", "postgres"):
        q = dict(query)
        host = q.get("host") or unquote(parts.hostname or "")
        port = int(q.get("port") or parts.port or 5432)
        if not host or "," in host:
            raise SandboxError(f"{key}: the sandbox needs one explicit host in the URL, found {host or 'none'!r}")
        inside = INSIDE / name / f".s.PGSQL.{port}"
        rest = [(k, v) for k, v in query if k not in ("host", "hostaddr", "port")]
        rest += [("host", str(inside.parent)), ("port", str(port))]
        inside_url = f"{parts.scheme}://{userinfo}{parts.path or '/'}?{_query(rest)}"
        if host.startswith("/"):
            return _Route(key, inside_url, inside, socket=Path(host) / f".s.PGSQL.{port}")
        return _Route(key, inside_url, inside, tcp=(q.get("hostaddr") or host, port))
    raise SandboxError(f"{key}: only redis://, unix:// and postgresql:// URLs reach the sandbox, not {scheme or url!r}")


class _Bridge:
    """A unix socket in this process forwarding each connection to ``host:port`` (a thread with its own loop)."""

    def __init__(self, path: Path, host: str, port: int) -> None:
        self.path, self.host, self.port = path, host, port
        self.loop = asyncio.new_event_loop()
        self._error: OSError | None = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), name=f"sandbox-bridge-{port}", daemon=True)
        self.thread.start()
        ready.wait(10)
        if self._error is not None:
            raise SandboxError(f"could not open a bridge to {host}:{port} at {path}: {self._error}")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            server = self.loop.run_until_complete(asyncio.start_unix_server(self._serve, path=str(self.path)))
        except OSError as err:
            self._error = err
            return
        finally:
            ready.set()
        try:
            self.loop.run_forever()
        finally:
            server.close()
            for task in (tasks := asyncio.all_tasks(self.loop)):
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers = [writer]
        try:  # a refused or lost server closes the learner's connection, as it would without the bridge
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
            writers.append(up_writer)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except OSError:
            pass
        finally:
            for w in writers:
                w.close()

    def stop(self) -> None:
        if self.thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
        if dst.can_write_eof():
            dst.write_eof()
    except (OSError, RuntimeError):
        dst.close()


# --------------------------------------------------------------------------- cgroups


def _mounts() -> tuple[tuple[str, str] | None, dict[str, tuple[str, str]]]:
    """(cgroup2 (root, mountpoint) or None, {v1 controller: (root, mountpoint)})."""
    v2, v1 = None, {}
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            if tail[0] == "cgroup2" and v2 is None:
                v2 = (fields[3], fields[4])
            elif tail[0] == "cgroup":
                for controller in ("memory", "pids"):
                    if controller in tail[2].split(",") and controller not in v1:
                        v1[controller] = (fields[3], fields[4])
    return v2, v1


def _own_cgroup(controller: str) -> str | None:
    """This process's cgroup path for a v1 controller, or the v2 path for ``""``."""
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
            if (controller and controller in controllers.split(",")) or (not controller and hierarchy == "0"):
                return path
    return None


def _under(mount: tuple[str, str], path: str) -> Path:
    root, point = mount
    if root != "/" and path.startswith(root):
        path = path[len(root) :]
    return Path(point) / path.lstrip("/")


def _read(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text()
    return ""


def _count(text: str, key: str) -> int:
    """The first number after ``key`` at the start of a line ("oom_kill 3", "Threads:\t4"), else 0."""
    m = re.search(rf"^{key}:?\s+(\d+)", text, re.M)
    return int(m.group(1)) if m else 0


class _Cgroups:
    """The sandbox's cgroups (root only): limits, who is inside, what was hit, kill."""

    def __init__(self, limits: Limits) -> None:
        self.limits, self.version, self.dirs = limits, 0, {}
        self.name = f"{_prefix()}{secrets.token_hex(4)}"
        v2, v1 = _mounts()
        if v2 is not None and self._v2(v2):
            return
        self._v1(v1)

    def _v2(self, mount: tuple[str, str]) -> bool:
        own = _own_cgroup("")
        parent = _under(mount, own or "/")
        if own is None or not {"memory", "pids"} <= set(_read(parent / "cgroup.controllers").split()):
            return False
        if not {"memory", "pids"} <= set(_read(parent / "cgroup.subtree_control").split()):
            with contextlib.suppress(OSError):  # refused where the parent holds processes itself
                (parent / "cgroup.subtree_control").write_text("+memory +pids")
        memory, pids = self.limits.memory_mb * MB, self.limits.processes + _BWRAP_OWN
        child = _make(parent, self.name, {"memory.max": memory, "memory.swap.max": 0, "pids.max": pids}, "pids.max")
        if child is not None:
            self.version, self.dirs = 2, {"memory": child, "pids": child}
        return child is not None

    def _v1(self, mounts: dict[str, tuple[str, str]]) -> None:
        memory, pids = self.limits.memory_mb * MB, self.limits.processes + _BWRAP_OWN
        wanted = {
            "memory": {"memory.limit_in_bytes": memory, "memory.memsw.limit_in_bytes": memory},
            "pids": {"pids.max": pids},
        }
        for controller, files in wanted.items():
            own = _own_cgroup(controller)
            if controller in mounts and own is not None:
                child = _make(_under(mounts[controller], own), self.name, files, next(iter(files)))
                if child is not None:
                    self.dirs[controller] = child
        self.version = 1 if self.dirs else 0

    def procs_files(self) -> list[str]:
        """The files a process writes "0" to to join the sandbox's cgroups."""
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def members(self) -> set[int]:
        return {int(p) for d in set(self.dirs.values()) for p in _read(d / "cgroup.procs").split()}

    def hit(self, controller: str) -> bool:
        """Did the kernel refuse a fork ("pids") or kill for memory ("memory") in this sandbox?"""
        name, key = {"pids": ("pids.events", "max"), "memory": ("memory.oom_control", "oom_kill")}[controller]
        if self.version == 2 and controller == "memory":
            name = "memory.events"
        d = self.dirs.get(controller)
        return d is not None and _count(_read(d / name), key) > 0

    def kill(self, grace: float = 5.0) -> None:
        if self.version == 2 and (self.dirs["pids"] / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                (self.dirs["pids"] / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + grace
        while (pids := self.members()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill()
        for d in set(self.dirs.values()):
            deadline = time.monotonic() + 2  # busy until its last process is gone
            while d.exists() and time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    d.rmdir()
                    break
                time.sleep(0.02)
        self.dirs = {}


def _make(parent: Path, name: str, files: dict[str, int], required: str) -> Path | None:
    """A new cgroup ``parent/name`` with ``files`` written (those that exist); None if refused."""
    child = parent / name
    try:
        _reap(parent)
        child.mkdir()
        if not (child / required).exists():
            raise OSError(f"{child} has no {required}")
        for filename, value in files.items():
            if (child / filename).exists():
                (child / filename).write_text(str(value))
        return child
    except OSError:
        with contextlib.suppress(OSError):
            child.rmdir()
        return None


def _prefix() -> str:
    """Names of this process's cgroups and temporary folders: the pid namespace, then the pid."""
    return f"course-sandbox-{os.readlink('/proc/self/ns/pid').strip('pid:[]')}-{os.getpid()}-"


def _left_behind(folder: Path) -> list[Path]:
    """Sandbox cgroups or temporary folders in ``folder`` whose process (of this pid namespace) is dead."""
    mine = _prefix().split("-")
    found = [(d, d.name.split("-")) for d in folder.glob(f"course-sandbox-{mine[2]}-*")]
    return [
        d for d, name in found if name[3].isdigit() and name[3] != mine[3] and not Path(f"/proc/{name[3]}").exists()
    ]


def _reap(parent: Path) -> None:
    """Remove sandbox cgroups left behind by processes killed outright."""
    for d in _left_behind(parent):
        for p in _read(d / "cgroup.procs").split():
            with contextlib.suppress(OSError):
                os.kill(int(p), signal.SIGKILL)
        with contextlib.suppress(OSError):
            d.rmdir()


# --------------------------------------------------------------------------- rlimits


def _tasks_of(uid: int) -> int:
    """How many tasks (threads count, as for RLIMIT_NPROC) the user ``uid`` runs now."""
    statuses = (_read(Path(e.path, "status")) for e in os.scandir("/proc") if e.name.isdigit())
    return sum(_count(s, "Threads") for s in statuses if s and _count(s, "Uid") == uid)


def _clamped(which: int, value: int) -> tuple[int, int]:
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    return value, value


def _limit_child(cgroup_procs: list[str], rlimits: list[tuple[str, int, tuple[int, int]]]) -> None:
    """Runs in the child between fork and exec (after setsid): system calls only."""
    for path in cgroup_procs:
        fd = os.open(path, os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)
    for _, which, value in rlimits:
        resource.setrlimit(which, value)


# --------------------------------------------------------------------------- the sandbox


class Sandbox:
    """A sandbox for one grading run; every process it starts is ended by :meth:`kill` / :meth:`close`.

    ``servers`` maps variable names to server URLs (``Servers.as_env()``); :meth:`env`
    gives them rewritten to sockets inside. With ``unsandboxed=True`` nothing is isolated
    (only rlimits, cgroups as root and a process group apply) and :attr:`warning` says so.
    """

    def __init__(
        self,
        *,
        workdir: Path,
        readonly: list[Path] | tuple[Path, ...] = (),
        servers: dict[str, str] | None = None,
        limits: Limits | None = None,
        unsandboxed: bool = False,
        hidden: list[Path] | tuple[Path, ...] = (),
        overlays: dict[Path, Path] | None = None,
    ) -> None:
        self.limits, self.unsandboxed = limits or Limits(), unsandboxed
        self.hidden, self.overlays = [Path(p) for p in hidden], dict(overlays or {})  # see _bwrap_argv
        self.workdir = Path(workdir).resolve()
        if not self.workdir.is_dir():
            raise SandboxError(f"the sandbox's workdir {workdir} is not a folder")
        if missing := [str(p) for p in readonly if not Path(p).exists()]:
            raise SandboxError(f"cannot show {', '.join(missing)} to the sandbox: not found")
        self.readonly = [Path(p).resolve() for p in readonly]
        self.servers = dict(servers or {})
        ok, why = available()
        if not unsandboxed and not ok:
            raise SandboxUnavailable(f"{why}. {_INSTALL}.")
        self._bwrap = None if unsandboxed else _find_bwrap()
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._timers: list[threading.Timer] = []
        self._bridges: list[_Bridge] = []
        self._expired: float | None = None
        self._closed = False
        self._cgroups: _Cgroups | None = None
        for d in _left_behind(Path("/tmp")):
            shutil.rmtree(d, ignore_errors=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=_prefix(), dir="/tmp"))  # short: unix socket paths live here
        try:
            self._routes = [] if unsandboxed else [_route(k, v) for k, v in self.servers.items()]
            self._cgroups = _Cgroups(self.limits) if os.geteuid() == 0 else None
            self._start_bridges()
            self._write_etc()
        except BaseException:
            self.close()
            raise
        self.warning = _UNSANDBOXED if unsandboxed else ""
        if os.geteuid() == 0 and not (self._cgroups and "pids" in self._cgroups.dirs):
            self.warning += "; " * bool(self.warning) + "the process limit is not enforced: root without a pids cgroup"

    # ---------------------------------------------------------------- what it is

    @property
    def enforcement(self) -> str:
        """How the limits are enforced here, in one line (for logs and reports)."""
        parts = ["no sandbox" if self.unsandboxed else "bubblewrap"]
        if self._cgroups and self._cgroups.dirs:
            parts.append(f"cgroup v{self._cgroups.version} ({', '.join(sorted(self._cgroups.dirs))})")
        return "; ".join([*parts, "rlimits (" + ", ".join(name for name, _, _ in self._rlimits()) + ")"])

    def env(self) -> dict[str, str]:
        """The whole environment of a program in the sandbox (nothing is inherited from this process)."""
        tmp = str(self._tmp / "tmp") if self.unsandboxed else "/tmp"
        home = str(self._tmp / "home") if self.unsandboxed else HOME
        env = {
            "PATH": f"{Path(sys.prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin",
            "HOME": home,
            "TMPDIR": tmp,
            "MPLCONFIGDIR": f"{tmp}/matplotlib",
            "MPLBACKEND": "Agg",
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MB of address space per arena and thread otherwise
            "COURSE_STATE_DIR": f"{tmp}/course",
            "COURSE_SANDBOX": "none" if self.unsandboxed else "bubblewrap",
        }
        if sys.prefix != sys.base_prefix:
            env["VIRTUAL_ENV"] = sys.prefix
        if self.servers:
            env["COURSE_BACKEND"] = "env"
            env.update(self.servers if self.unsandboxed else {r.key: r.url for r in self._routes})
        return env

    # ---------------------------------------------------------------- setup

    def _start_bridges(self) -> None:
        for i, r in enumerate(self._routes):
            if r.tcp is not None:
                r.socket = self._tmp / f"bridge-{i}.sock"
                self._bridges.append(_Bridge(r.socket, *r.tcp))
            elif r.socket is None or not r.socket.exists() or not stat.S_ISSOCK(r.socket.stat().st_mode):
                raise SandboxError(f"{r.key} points at {r.socket}, which is not a unix socket")

    def _write_etc(self) -> None:
        (etc := self._tmp / "etc").mkdir()
        uid, gid = os.getuid(), os.getgid()
        users = {0: "root", uid: "learner" if uid else "root", 65534: "nobody"}
        groups = {0: "root", gid: "learner" if gid else "root", 65534: "nogroup"}
        (etc / "passwd").write_text("".join(f"{n}:x:{u}:{u}:{n}:{HOME}:/bin/sh\n" for u, n in users.items()))
        (etc / "group").write_text("".join(f"{n}:x:{g}:\n" for g, n in groups.items()))
        (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost ip6-loopback\n")
        for d in ("tmp", "home"):
            (self._tmp / d).mkdir()

    def _bwrap_argv(self, argv: list[str], cwd: Path) -> list[str]:
        size = lambda mb: ["--size", str(mb * MB)] if _sizes(self._bwrap) else []  # noqa: E731
        args = [self._bwrap, *_flags(), *_system_args()]
        args += [*size(max(64, 4 * self.limits.file_mb)), "--tmpfs", "/tmp", *size(64), "--tmpfs", "/dev/shm"]
        args += ["--dir", HOME]
        for name in ("passwd", "group", "hosts"):
            args += ["--ro-bind", str(self._tmp / "etc" / name), f"/etc/{name}"]
        binds = [("--ro-bind", p) for p in self.readonly] + [("--bind", self.workdir)]
        # a bind deep under /tmp would get its parents made in the writable /tmp: give them a read-only tmpfs
        skeletons = sorted({Path(*p.parts[:3]) for _, p in binds if p.parts[1:2] == ("tmp",) and len(p.parts) > 3})
        args += [a for d in skeletons for a in ("--tmpfs", str(d))]
        for flag, p in sorted(binds, key=lambda b: len(b[1].parts)):
            args += [flag, str(p), str(p)]
        for r in self._routes:
            args += ["--bind", str(r.socket), str(r.inside)]
        # folders shown empty inside (the hidden checks); files shown over real ones (the references' stubs)
        args += [a for d in self.hidden for a in ("--tmpfs", str(d), "--remount-ro", str(d))]
        args += [a for real, shown in sorted(self.overlays.items()) for a in ("--ro-bind", str(shown), str(real))]
        args += [a for d in [*skeletons, "/"] for a in ("--remount-ro", str(d))]
        return [*args, "--chdir", str(cwd), "--", *argv]

    # ---------------------------------------------------------------- running

    def _rlimits(self) -> list[tuple[str, int, tuple[int, int]]]:
        lim, r = self.limits, resource
        cg = self._cgroups.dirs if self._cgroups else {}
        soft, hard = _clamped(r.RLIMIT_CPU, lim.cpu_seconds)
        cpu = (soft, hard + 2 if r.getrlimit(r.RLIMIT_CPU)[1] == r.RLIM_INFINITY else hard)  # SIGXCPU, then SIGKILL
        out = [
            ("cpu", r.RLIMIT_CPU, cpu),
            ("file size", r.RLIMIT_FSIZE, _clamped(r.RLIMIT_FSIZE, lim.file_mb * MB)),
            ("open files", r.RLIMIT_NOFILE, _clamped(r.RLIMIT_NOFILE, lim.open_files)),
            ("core", r.RLIMIT_CORE, (0, 0)),
        ]
        if "memory" not in cg:
            out.append(("address space", r.RLIMIT_AS, _clamped(r.RLIMIT_AS, lim.memory_mb * MB)))
        if "pids" not in cg and os.geteuid() != 0:  # the kernel never applies RLIMIT_NPROC to root
            total = _tasks_of(os.getuid()) + lim.processes + _BWRAP_OWN
            out.append(("processes", r.RLIMIT_NPROC, _clamped(r.RLIMIT_NPROC, total)))
        return out

    def popen(
        self, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start ``argv`` in the sandbox; ``subprocess.Popen`` keywords (``pass_fds``, ``stdout``, ...) apply.

        ``env`` adds to :meth:`env`; ``cwd`` defaults to the workdir. The Popen's return code
        is bubblewrap's: the program's, or 128 + N when a signal N ended it (:meth:`reason`
        explains it). bubblewrap dies with the *thread* that started it: call this from a
        thread that outlives the run.
        """
        for banned in ("preexec_fn", "start_new_session", "process_group"):
            if banned in kwargs:
                raise TypeError(f"Sandbox.popen sets {banned} itself")
        with self._lock:
            if self._closed:
                raise SandboxError("this sandbox is closed")
            cwd = Path(cwd).resolve() if cwd else self.workdir
            full_env = {**self.env(), **(env or {})}
            command = list(argv) if self.unsandboxed else self._bwrap_argv(list(argv), cwd)
            limit = functools.partial(
                _limit_child, self._cgroups.procs_files() if self._cgroups else [], self._rlimits()
            )
            proc = subprocess.Popen(
                command,
                env=full_env,
                cwd=cwd if self.unsandboxed else None,
                start_new_session=True,
                preexec_fn=limit,
                **kwargs,
            )
            self._procs.append(proc)
            if self.limits.wall_seconds is not None:
                timer = threading.Timer(self.limits.wall_seconds, self._expire, args=(proc,))
                timer.daemon = True
                timer.start()
                self._timers.append(timer)
            return proc

    def _expire(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            self._expired = self.limits.wall_seconds
            self.kill()

    def reason(self, returncode: int | None = None, stderr: str | bytes = "") -> str | None:
        """Why the run failed, as one line for the learner's feedback; None if it succeeded or no limit explains it.
        ``stderr`` (if captured) is where, without cgroups, a memory or process limit shows (best effort)."""
        lim = self.limits
        text = stderr.decode("utf-8", "replace") if isinstance(stderr, bytes) else stderr
        memory = f"the sandbox's memory limit ({lim.memory_mb} MB) was reached"
        processes = f"the sandbox's process limit ({lim.processes} processes) was reached"
        if self._expired is not None:
            return f"killed after {self._expired:g} s (the sandbox's time limit)"
        if returncode == 0:
            return None
        if self._cgroups and self._cgroups.hit("memory"):
            return memory
        if self._cgroups and self._cgroups.hit("pids"):
            return processes
        if not returncode:
            return None
        sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 and not self.unsandboxed else 0
        if sig == signal.SIGXCPU:
            return f"the sandbox's CPU time limit ({lim.cpu_seconds} s of CPU) was reached"
        for pattern, line in (
            (r"^bwrap: ", "the sandbox could not start the program (bubblewrap's message is in the grader's log)"),
            (r"File too large", f"the sandbox's file size limit ({lim.file_mb} MB) was reached"),
            (r"MemoryError|Cannot allocate memory", memory),
            (
                r"can't start new thread|fork[\s\S]*Resource temporarily unavailable|^BlockingIOError: \[Errno 11\]",
                processes,
            ),
            (r"Too many open files", f"the sandbox's open files limit ({lim.open_files}) was reached"),
        ):
            if re.search(pattern, text, re.M):
                return line
        with contextlib.suppress(ValueError):
            return f"the program was killed by {signal.Signals(sig).name}" if sig else None
        return None

    # ---------------------------------------------------------------- ending

    def kill(self) -> None:
        """End every process of the sandbox (idempotent)."""
        with self._lock:
            procs = list(self._procs)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)  # bubblewrap's death takes its pid namespace along
        if self._cgroups is not None:
            self._cgroups.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)

    def close(self) -> None:
        """Kill everything, stop the bridges, remove the cgroups and temporary files (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            timers, self._timers = self._timers, []
        for t in timers:
            t.cancel()
        self.kill()
        for b in self._bridges:
            b.stop()
        if self._cgroups is not None:
            self._cgroups.remove()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
