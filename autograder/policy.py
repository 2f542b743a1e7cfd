"""What learner code may do with the grader's objects, and what the grader hands over as a resource.

A learner's process gets, of the checks' objects, only what a task's text offers it: a virtual clock
is callable and has ``time`` and ``sleep`` (:data:`EXPOSED`); a Redis client, pipeline, script or lock
of the checks' (one that counts or holds round trips) offers what a redis-py client offers, and is
connected as the run's ACL user through the checks' gateway, so the server refuses what that user may
not do; a psycopg pool, connection or cursor of the checks' (one that counts queries) offers what
psycopg offers and is connected as the run's role; anything else may only be called. Plain pools and
clients cross as specs and are made anew in the learner's process (:meth:`GraderPolicy.resource`).
"""

from __future__ import annotations

import inspect
import re

from autograder import values, wire


def _exposed() -> list[tuple[type, frozenset[str]]]:
    """The checks' objects learner code may use, and what of each (the API its task's text names)."""
    from course.breaker import CircuitBreaker
    from course.kit.faults import FlakyDependency, VirtualClock

    return [
        (VirtualClock, frozenset({"__call__", "time", "sleep"})),
        (FlakyDependency, frozenset({"__call__"})),
        (CircuitBreaker, frozenset({"call", "state"})),
    ]


#: ``options`` a pool handed to a learner's process may carry: settings the run's role may set
#: (:data:`autograder.privileges.SETTABLE`), e.g. ``-c deadlock_timeout=2s``.
_SETTINGS = re.compile(r"(-c deadlock_timeout=[0-9]+(ms|s)?\s*)+")

_REDIS_DUNDERS = frozenset(
    {"__call__", "__await__", "__aenter__", "__aexit__", "__aiter__", "__anext__", "__enter__", "__exit__"}
)


def _pg_api(obj) -> bool:
    """A psycopg pool, connection, cursor or transaction (or a check's subclass of one)."""
    return any(c.__module__.split(".")[0] in ("psycopg", "psycopg_pool") for c in type(obj).__mro__[:-1])


def _context_manager(obj) -> bool:
    import contextlib

    return isinstance(obj, (contextlib._GeneratorContextManager, contextlib._AsyncGeneratorContextManager))  # noqa: SLF001


def _redis_api(obj) -> type | None:
    """The redis-py class whose API ``obj`` offers: a client, pipeline, script or pub/sub of the
    checks', or a check's wrapper of one (it keeps the client as ``_client``); None for anything else."""
    import redis
    import redis.asyncio
    from redis.asyncio.client import Pipeline, PubSub
    from redis.asyncio.lock import Lock
    from redis.commands.core import AsyncScript, Script
    from redis.lock import Lock as SyncLock

    for kind in (Pipeline, redis.client.Pipeline, PubSub, redis.client.PubSub, AsyncScript, Script, Lock, SyncLock):
        if isinstance(obj, kind):
            return kind
    if isinstance(obj, (redis.asyncio.Redis, redis.Redis)):
        return type(obj).__mro__[[c.__module__.startswith("redis") for c in type(obj).__mro__].index(True)]
    for attr in ("_client", "_pipe", "_redis"):  # a check's wrapper of one: it offers what the wrapped one does
        inner = getattr(obj, attr, None)
        if inner is not None and not isinstance(inner, (str, bytes, int)):
            found = _redis_api(inner)
            if found is not None:
                return found
    return None


class GraderPolicy(wire.Policy):
    """What learner code may do with the grader's objects: call what the checks handed in, no more.

    A virtual clock: call it, ``time``, ``sleep``. A Redis client of the checks' (one that counts or
    holds round trips): every public method, because it is connected as the run's ACL user
    (:meth:`Session._grant`), so the server refuses what the user may not do. A class of a check's
    may name what it offers in ``__learner_api__``. Anything else: only a call, if it is callable.
    """

    trusting = False

    def __init__(self) -> None:
        self._exposed_types: list[tuple[type, frozenset[str]]] | None = None
        self.stubbed: frozenset[str] = frozenset()  # the references kept from the learner: never by import
        self.redis_gate = ""  # the socket of the checks' Redis gate (set by the session)
        self.pg_role = ""  # the run's role (set by the session)

    @property
    def _exposed(self) -> list[tuple[type, frozenset[str]]]:
        """Read on first use: importing them (httpx, by course.retry) is 0.1 s a run needs only once the
        checks run, not before its learner processes start."""
        if self._exposed_types is None:
            self._exposed_types = _exposed()
        return self._exposed_types

    def allowed(self, obj, name: str) -> bool:
        for cls, names in self._exposed:
            if isinstance(obj, cls):
                return name in names
        api = getattr(type(obj), "__learner_api__", None)
        if api is not None:
            return name in api
        if _pg_api(obj):  # a pool of the checks' (one that counts queries), its connections, cursors
            return (not name.startswith("_") or name in _REDIS_DUNDERS) and self._as_run_role(obj)
        if _context_manager(obj):
            return name in _REDIS_DUNDERS
        api = _redis_api(obj)
        if api is not None:  # what a Redis client offers, no more (not a wrapper's own release())
            offered = name in _REDIS_DUNDERS or (not name.startswith("_") and hasattr(api, name))
            return offered and self._as_run_user(obj)
        if name == "__call__":
            return callable(obj) and not inspect.isclass(obj)
        if name == "__await__":
            return inspect.isawaitable(obj)
        return False

    def chains(self, obj, name: str, function) -> bool:
        import redis.asyncio.client
        import redis.client

        if not isinstance(obj, (redis.asyncio.client.Pipeline, redis.client.Pipeline)):
            return False
        module = getattr(function, "__module__", "") or ""
        return module.startswith("redis.commands") and name != "register_script"

    def returns_awaitable(self, obj, name: str, function) -> bool:
        import redis.asyncio
        from redis.asyncio.client import Pipeline

        client = obj if isinstance(obj, redis.asyncio.Redis) else getattr(obj, "_client", None)
        if not isinstance(client, redis.asyncio.Redis) or isinstance(client, Pipeline):
            return False  # a pipeline's commands return the pipeline (a Pipeline is a Redis too); a sync client's, the reply
        module = getattr(function, "__module__", "") or ""
        return (
            module.startswith("redis.commands")
            and name != "register_script"
            and not inspect.isasyncgenfunction(function)
        )

    def _as_run_user(self, obj) -> bool:
        """Does ``obj`` reach Redis through the checks' gate, as the run's ACL user? (Never the course's admin.)"""
        pool = getattr(obj, "connection_pool", None)
        for inner in ("_client", "registered_client", "client"):
            if pool is None and getattr(obj, inner, None) is not None:
                pool = getattr(getattr(obj, inner), "connection_pool", None)
        kwargs = getattr(pool, "connection_kwargs", None)
        if kwargs is None:
            return True  # a wrapper without a pool of its own (its calls reach a client checked the same way)
        if kwargs.get("path") != self.redis_gate:
            raise wire.Refused(
                "a Redis client of the grader's that bypasses the run's gate cannot be handed to learner code"
            )
        return True

    def _as_run_role(self, obj) -> bool:
        """Is ``obj`` connected as the run's role? (Never hand learner code the course's superuser.)"""
        from psycopg.conninfo import conninfo_to_dict

        user = None
        conninfo = getattr(obj, "conninfo", None)
        if isinstance(conninfo, str):
            user = conninfo_to_dict(conninfo).get("user")
        for attr in ("connection", None):
            conn = getattr(obj, attr) if attr else obj
            info = getattr(conn, "info", None)
            if user is None and info is not None and hasattr(info, "user"):
                user = info.user
        if user != self.pg_role:
            raise wire.Refused(
                "a PostgreSQL object of the grader's not connected as the run's role cannot be handed over"
            )
        return True

    def resource(self, value) -> dict | None:
        import psycopg_pool
        import redis
        import redis.asyncio

        from autograder.lockstep import GatedRedis

        if type(value) not in (
            psycopg_pool.AsyncConnectionPool,
            psycopg_pool.ConnectionPool,
            redis.asyncio.Redis,
            redis.Redis,
            GatedRedis,
        ):
            return None  # a subclass of a check's (it counts or holds round trips): handed over as itself
        if isinstance(value, (psycopg_pool.AsyncConnectionPool, psycopg_pool.ConnectionPool)):
            kwargs = dict(value.kwargs or {})
            if set(kwargs) - {"autocommit", "prepare_threshold", "options"} or value._configure or value._reset:  # noqa: SLF001
                return None  # a pool that counts or shapes what it runs: handed over as itself
            if "options" in kwargs and not _SETTINGS.fullmatch(str(kwargs["options"])):
                return None
            db = dict(_conninfo(value.conninfo)).get("dbname", "")
            return {
                "kind": "pg_pool",
                "async": isinstance(value, psycopg_pool.AsyncConnectionPool),
                "db": db,
                "min_size": value.min_size,
                "max_size": value.max_size,
                "kwargs": kwargs,
            }
        if isinstance(value, (redis.asyncio.Redis, redis.Redis)):
            kwargs = value.connection_pool.connection_kwargs
            keep = {k: kwargs[k] for k in ("decode_responses", "socket_timeout") if k in kwargs}
            return {
                "kind": "redis",
                "async": isinstance(value, redis.asyncio.Redis),
                "db": kwargs.get("db", 0),
                "kwargs": keep,
            }
        return None

    def encode_special(self, value, encode, depth: int) -> list | None:
        found = values.encode_course_value(value, encode, depth, imports=True, refused=self.stubbed)
        if found is not None:
            return found
        module = type(value).__module__
        if module.startswith("httpx"):
            import httpx

            if isinstance(value, httpx.Request):
                return ["httpx", value.method, str(value.url), None, None]
            if isinstance(value, httpx.Response):
                request = value.request
                return ["httpx", request.method, str(request.url), value.status_code, ["b", ""]]
        return None


def _conninfo(conninfo: str) -> list[tuple[str, str]]:
    from psycopg.conninfo import conninfo_to_dict

    return [(k, str(v)) for k, v in conninfo_to_dict(conninfo).items()]
