"""Isolated namespaces on the live servers: one per notebook kernel, test or grading run.

A namespace is a PostgreSQL database of its own (created, then dropped) and a Redis
logical database of its own (claimed, flushed, then released), so nothing leaks between
runs and two runs can go on at once on the same servers.

    from course.kit import lab
    ns = lab.current()                 # this process's namespace, made on first use
    pool = await ns.pool()             # psycopg AsyncConnectionPool on its database
    r = ns.redis()                     # redis.asyncio.Redis on its logical database

    async with lab.scratch() as ns2:   # a fresh, throwaway namespace (graders use this)
        ...
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg
import redis as redis_sync
from psycopg import sql

from course.kit import backends, procs

CLAIM_PREFIX = "course:namespace:"
#: Connections one shared Redis client of a namespace holds at most.
REDIS_MAX_CONNECTIONS = 64
#: Other sessions of this database waiting on a lock right now (the races' "held" count). Read
#: from the lock table, which marks a lock granted the moment it is released to a waiter; a
#: woken session's ``wait_event`` in pg_stat_activity says "Lock" until it runs again, which
#: once let a race move on while a writer was about to continue.
LOCK_WAITERS = (
    "SELECT count(DISTINCT l.pid) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE NOT l.granted AND a.datname = current_database() AND l.pid <> pg_backend_pid()"
)
CLAIM_TTL = 24 * 3600  # a claim whose owner vanished expires after a day at most
_HOST = socket.gethostname()


def _redis_url_with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        query = dict(parse_qsl(parts.query))
        query["db"] = str(db)
        return f"unix://{parts.path}?{urlencode(query)}"
    return urlunsplit(parts._replace(path=f"/{db}"))


def _database_url_with_name(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


#: A process that cannot see the host's processes (a grading sandbox has a pid namespace of
#: its own) records the owner it is given here and never judges another owner dead by pid.
OWNER_ENV = "COURSE_OWNER"


def _owner() -> dict:
    given = os.environ.get(OWNER_ENV)
    if given:
        return {**json.loads(given), "created": time.time()}
    return {"host": _HOST, **procs.identity(), "created": time.time()}


def _sees_host_processes() -> bool:
    return not os.environ.get(OWNER_ENV)


def _owner_dead(owner: dict) -> bool:
    """Is the process that claimed a namespace gone? Another host's claims age out instead,
    and so does every claim seen from a process that cannot see the host's processes."""
    if owner.get("host") != _HOST or not _sees_host_processes():
        return time.time() - owner.get("created", 0) > CLAIM_TTL
    if not owner.get("pid"):
        return False
    return not procs.alive(owner)


@dataclass
class Namespace:
    """One isolated database + Redis logical database on the live servers."""

    name: str
    database_url: str
    redis_url: str
    redis_db: int
    servers: backends.Servers
    _pools: list = field(default_factory=list, repr=False)
    _clients: list = field(default_factory=list, repr=False)
    _shared: dict = field(default_factory=dict, repr=False)  # (kind, loop, settings) -> pool or client
    closed: bool = False
    given: bool = False  # made by someone else (see GIVEN_ENV): never dropped here
    #: Where a pool that learner code will use connects: the same database as a role with a learner's
    #: rights when a grader says so (a grading run's own role), else the namespace's own URL.
    learner_database_url: str = ""

    def __post_init__(self) -> None:
        self.learner_database_url = self.learner_database_url or self.database_url

    @property
    def key_prefix(self) -> str:
        """Prefix for names Redis does not scope by database (pub/sub channels)."""
        return f"{self.name}:"

    # sync helpers -------------------------------------------------------------
    def connect(self, **kwargs) -> psycopg.Connection:
        """A plain psycopg connection (autocommit) to this namespace's database."""
        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.database_url, **kwargs)

    def redis_sync(self, **kwargs) -> redis_sync.Redis:
        kwargs.setdefault("decode_responses", True)
        return redis_sync.Redis.from_url(self.redis_url, **kwargs)

    # async helpers ------------------------------------------------------------
    #
    # A notebook cell that says ``pool = await ns.pool()`` runs again whenever the learner
    # re-runs the notebook. Pools and clients are therefore shared: the same settings on
    # the same event loop give back the same open pool, so the number of connections stays
    # the same however often a notebook runs. ``fresh=True`` gives a pool of its own,
    # which the code that asked for it closes (``async with await ns.pool(fresh=True) as p``).

    def _reuse(self, key):
        found = self._shared.get(key)
        if found is None:
            return None
        if getattr(found, "closed", False):
            del self._shared[key]
            return None
        return found

    def redis(self, *, fresh: bool = False, max_connections: int = REDIS_MAX_CONNECTIONS, **kwargs):
        """A ``redis.asyncio.Redis`` client on this namespace's logical database.

        Its connection pool is bounded (``max_connections``; a caller past it waits for a
        free connection), so a burst of concurrent calls, run again and again, never holds
        more than that many connections open.
        """
        import asyncio

        import redis.asyncio as aioredis

        kwargs.setdefault("decode_responses", True)
        key = ("redis", _loop_id(asyncio), max_connections, repr(sorted(kwargs.items())))
        if not fresh and (client := self._reuse(key)) is not None:
            return client
        pool = aioredis.BlockingConnectionPool.from_url(
            self.redis_url, max_connections=max_connections, timeout=30, **kwargs
        )
        client = aioredis.Redis.from_pool(pool)  # closing the client closes its pool
        self._clients.append(client)
        if not fresh:
            self._shared[key] = client
        return client

    async def pool(self, min_size: int = 1, max_size: int = 10, *, fresh: bool = False, **kwargs):
        """An opened ``psycopg_pool.AsyncConnectionPool`` on this namespace's database."""
        import asyncio

        from psycopg_pool import AsyncConnectionPool

        kwargs.setdefault("kwargs", {"autocommit": True})
        key = ("pool", _loop_id(asyncio), min_size, max_size, repr(sorted(kwargs.items())))
        if not fresh and (pool := self._reuse(key)) is not None:
            return pool
        pool = AsyncConnectionPool(
            self.database_url, min_size=min_size, max_size=max_size, open=False, **kwargs
        )
        await pool.open(wait=True)
        self._pools.append(pool)
        if not fresh:
            self._shared[key] = pool
        return pool

    async def aclose(self) -> None:
        """Close the pools and clients handed out (the namespace itself stays)."""
        self._shared.clear()
        while self._pools:
            await self._pools.pop().close()
        while self._clients:
            client = self._clients.pop()
            try:
                await client.aclose()
            except Exception:  # noqa: BLE001 - its loop may be gone already
                pass

    def drop(self) -> None:
        """Drop the database and flush and release the Redis logical database."""
        if self.given:
            self.closed = True
            return
        if self.closed:
            return
        self.closed = True
        _drop_database(self.servers.database_url, self.name)
        _release_redis_db(self.servers.redis_url, self.redis_db)


@asynccontextmanager
async def connection(pool_or_conn):
    """A connection from ``pool_or_conn``: a pool lends one for the block, a connection is itself.

    For setup functions that take either (``await setup_schema(pool)`` or inside a transaction
    with ``await setup_schema(conn)``).
    """
    if hasattr(pool_or_conn, "connection") and not hasattr(pool_or_conn, "execute"):
        async with pool_or_conn.connection() as conn:
            yield conn
    else:
        yield pool_or_conn


def _loop_id(asyncio) -> int | None:
    try:
        return id(asyncio.get_running_loop())
    except RuntimeError:
        return None


# ----------------------------------------------------------------------------- PostgreSQL


def _admin(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True, connect_timeout=10)


def _create_database(admin_url: str, name: str) -> None:
    with _admin(admin_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL("COMMENT ON DATABASE {} IS {}").format(
                sql.Identifier(name), sql.Literal(json.dumps(_owner()))
            )
        )


def _drop_database(admin_url: str, name: str) -> None:
    """Drop ``name``, ending its sessions first: ``DROP DATABASE ... WITH (FORCE)`` alone waits for the
    sessions it ends in 100 ms steps; ending them here and watching them go takes a few ms."""
    try:
        with _admin(admin_url) as conn:
            others = "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
            conn.execute(f"SELECT pg_terminate_backend(pid) FROM ({others}) AS s", (name,))
            for _ in range(200):  # up to 1 s; FORCE below ends whatever is left
                if conn.execute(others, (name,)).fetchone() is None:
                    break
                time.sleep(0.005)
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    except psycopg.Error:
        pass


def reap_databases(admin_url: str) -> list[str]:
    """Drop ``course_*`` databases whose owner process is gone (a killed kernel, say)."""
    dropped = []
    with _admin(admin_url) as conn:
        rows = conn.execute(
            "SELECT datname, shobj_description(oid, 'pg_database') FROM pg_database WHERE datname LIKE 'course\\_%'"
        ).fetchall()
    for name, comment in rows:
        try:
            owner = json.loads(comment or "{}")
        except ValueError:
            continue
        if owner and _owner_dead(owner):
            _drop_database(admin_url, name)
            dropped.append(name)
    return dropped


# ----------------------------------------------------------------------------- Redis


def _claim_redis_db(base_url: str) -> int:
    client = redis_sync.Redis.from_url(_redis_url_with_db(base_url, 0), decode_responses=True)
    try:
        try:
            available = int(client.config_get("databases").get("databases", 16))
        except redis_sync.ResponseError:
            available = 16
        for db in range(1, available):
            key = f"{CLAIM_PREFIX}{db}"
            current = client.get(key)
            if current is not None:
                try:
                    owner = json.loads(current)
                except ValueError:
                    owner = {}
                if not _owner_dead(owner):
                    continue
                client.delete(key)
            if client.set(key, json.dumps(_owner()), nx=True, ex=CLAIM_TTL):
                redis_sync.Redis.from_url(_redis_url_with_db(base_url, db)).flushdb()
                return db
        raise backends.BackendError(
            f"all {available - 1} Redis logical databases are claimed; stop other runs or raise 'databases'"
        )
    finally:
        client.close()


def _release_redis_db(base_url: str, db: int) -> None:
    try:
        with redis_sync.Redis.from_url(_redis_url_with_db(base_url, db)) as client:
            client.flushdb()
        with redis_sync.Redis.from_url(_redis_url_with_db(base_url, 0)) as client:
            client.delete(f"{CLAIM_PREFIX}{db}")
    except redis_sync.RedisError:
        pass


# ----------------------------------------------------------------------------- lifecycle

_lock = threading.Lock()
_current: Namespace | None = None
_open: list[Namespace] = []
_reaped = False


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")[:20] or "run"


#: Called with each namespace :func:`create` makes (a grader grants its sandboxed role access here).
created_hooks: list = []
#: A namespace made by someone else, given as JSON (``name``, ``database_url``, ``redis_url``,
#: ``redis_db``): a learner's process in grading cannot create databases, so the grader makes the
#: notebook's namespace and hands it over; :func:`current` returns it and never drops it.
GIVEN_ENV = "COURSE_NAMESPACE"


def _given() -> Namespace | None:
    raw = os.environ.get(GIVEN_ENV)
    if not raw:
        return None
    spec = json.loads(raw)
    ns = Namespace(
        spec["name"], spec["database_url"], spec["redis_url"], int(spec["redis_db"]), backends.servers()
    )
    ns.given = True
    return ns


def create(label: str = "run", *, announce: bool = True) -> Namespace:
    """Make a new namespace on the live servers (dropped at exit if you forget). ``announce=False``:
    no :data:`created_hooks` see it yet (a grading run's role has no access to it)."""
    ns = reserve(label)
    try:
        make_database(ns, hooks=announce)
    except BaseException:
        _forget(ns)
        raise
    return ns


def reserve(label: str = "run") -> Namespace:
    """A namespace's name and Redis database, claimed now; its PostgreSQL database is made by
    :func:`make_database` (a grading run starts its processes meanwhile). Dropped at exit if you forget."""
    global _reaped
    srv = backends.servers()
    if not _reaped and _sees_host_processes():
        _reaped = True
        try:
            reap_databases(srv.database_url)
        except psycopg.Error:
            pass
    name = f"course_{_slug(label)}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    db = _claim_redis_db(srv.redis_url)
    ns = Namespace(
        name=name,
        database_url=_database_url_with_name(srv.database_url, name),
        redis_url=_redis_url_with_db(srv.redis_url, db),
        redis_db=db,
        servers=srv,
    )
    with _lock:
        _open.append(ns)
    backends.before_shutdown(close_all)
    return ns


def make_database(ns: Namespace, *, hooks: bool = True) -> None:
    """The PostgreSQL database of a :func:`reserve` d namespace; then :data:`created_hooks` see it
    (unless ``hooks`` is False: :class:`Spares` shows a namespace to them when it hands it out)."""
    _create_database(ns.servers.database_url, ns.name)
    if hooks:
        _created(ns)


def _created(ns: Namespace) -> None:
    for hook in list(created_hooks):
        hook(ns)


def current(label: str | None = None) -> Namespace:
    """This process's namespace (a notebook kernel's), made on first use.

    Inside Jupyter it also makes errors from unfinished answers read as one line
    (:mod:`course.kit.notebook`).
    """
    global _current
    from course.kit import notebook

    notebook.install()
    with _lock:
        existing = _current
    if existing is not None and not existing.closed:
        return existing
    ns = _given() or create(label or os.environ.get("COURSE_LABEL", "kernel"))
    with _lock:
        _current = ns
    return ns


@asynccontextmanager
async def scratch(label: str = "scratch"):
    """A fresh namespace for one check or test, dropped afterwards."""
    import asyncio

    made = spares
    ns = await asyncio.to_thread(made.take) if made is not None else await asyncio.to_thread(create, label)
    try:
        yield ns
    finally:
        await ns.aclose()
        await asyncio.to_thread(_forget, ns)
        if made is not None:
            made.refill()


class Spares:
    """Scratch namespaces made ahead, on a thread of their own, between checks.

    A grading run puts one in place (:data:`spares`) for its checks' ``lab.scratch()``: the first is
    made while the run's setup cells run, each next one from the moment a check's scratch namespace is
    dropped, while the grader moves on to the next check, which finds it made (or waits for the rest)
    instead of waiting for all of CREATE DATABASE (0.1-0.3 s). None is made while a check's code runs
    against its namespace, so the servers are as busy then as without spares. A spare is shown to
    :data:`created_hooks` (a run's grant to its role) only when a check takes it: until then the
    learner's code cannot reach it, so it cannot prepare it. Set :attr:`ahead` to False before the
    last check, so none is made for nothing; :meth:`close` drops what was not taken.
    """

    def __init__(self, label: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.label = label
        self.ahead = True
        self._lock = threading.Lock()
        self._makes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lab-make")
        self._next = None

    def begin(self) -> None:
        """Start making the next one, unless one is made or being made (a run calls this once its own
        namespace is made; :func:`scratch` once its namespace is dropped)."""
        with self._lock:
            if self._next is None and self.ahead:
                try:
                    self._next = self._makes.submit(create, self.label, announce=False)
                except RuntimeError:  # closed: a check that overran ends after its run
                    pass

    refill = begin

    def take(self) -> Namespace:
        with self._lock:
            made, self._next = self._next, None
        if made is None:
            return create(self.label)
        ns = made.result()
        try:
            _created(ns)
        except BaseException:
            _forget(ns)
            raise
        return ns

    def close(self) -> None:
        with self._lock:
            left, self._next = self._next, None
        if left is not None and not left.cancel():
            try:
                _forget(left.result())
            except Exception:  # noqa: BLE001 - it was never made: nothing to drop
                pass
        self._makes.shutdown(wait=True)


#: Where :func:`scratch` takes its namespaces from in a grading run (see :class:`Spares`).
spares: Spares | None = None


@contextmanager
def scratch_sync(label: str = "scratch"):
    ns = create(label)
    try:
        yield ns
    finally:
        _forget(ns)


def _forget(ns: Namespace) -> None:
    ns.drop()
    with _lock:
        if ns in _open:
            _open.remove(ns)


def close_all() -> None:
    """Drop every namespace this process made (called at exit)."""
    global _current
    with _lock:
        pending = list(_open)
        _open.clear()
        _current = None
    for ns in pending:
        ns.drop()
