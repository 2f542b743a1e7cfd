"""A grading run's own PostgreSQL role and Redis ACL user: what learner code connects as (issue 40).

The learner's process never holds the course's superuser credentials. It connects to
PostgreSQL as ``course_run_<hex>``: no superuser, no CREATEDB, CREATEROLE, REPLICATION or
BYPASSRLS, no membership in ``pg_read_server_files``, ``pg_write_server_files`` or
``pg_execute_server_program``; it reads and writes the tables of the run's databases (the
grader's setup makes them) and creates its own objects only in a schema of its own,
``learner``, which the grader's sessions never search (a function there cannot stand in for
one the grader calls). Server-side file access (``pg_read_file``, ``COPY ... TO PROGRAM``,
``lo_export``) and untrusted languages are a superuser's, so they are refused.

It connects to Redis as an ACL user of the same name, with every ``@admin`` and ``@dangerous``
command refused (``CONFIG``, ``MODULE``, ``SAVE``, ``DEBUG``, ``SHUTDOWN``, ``REPLICAOF``,
``MIGRATE``, ``ACL``, ``CLIENT``, ``FLUSHALL``, ...), and ``SELECT``, ``SWAPDB``, ``MOVE`` and
``COPY`` too, so it stays on the logical database the grading proxy put it on
(:mod:`autograder.gateways`); pub/sub only on the run's own channel prefixes.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import time

import psycopg
import redis
from psycopg import sql

ROLE_PREFIX = "course_run_"
#: Superuser-only settings the run's role may set for its own sessions (PostgreSQL 15+): chapter 10's
#: check gives the second replica's pool ``-c deadlock_timeout=...`` so the same transfer loses every run.
SETTABLE = ("deadlock_timeout",)

#: What the run's Redis user may not run, beyond the ``@admin`` and ``@dangerous`` categories.
REDIS_REFUSED = ("select", "swapdb", "move", "copy", "migrate", "monitor", "sync", "psync", "failover", "client")
REDIS_ALLOWED = ("keys", "flushdb", "client|setname", "client|getname", "client|id")
#: PostgreSQL roles learner code must never be a member of (checked, and tested).
PG_DANGEROUS_ROLES = ("pg_read_server_files", "pg_write_server_files", "pg_execute_server_program")


#: An advisory lock key: every run's grants of :data:`SETTABLE` change one row of pg_parameter_acl, and two
#: at once fail ("tuple concurrently updated", or a unique violation when the row is first made)
PARAMETER_ACL_LOCK = 0x636F7572  # "cour"


@contextlib.contextmanager
def _parameter_acl(conn: psycopg.Connection):
    """A transaction holding the lock on the parameters' ACL row (one grant or revoke at a time, server-wide)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (PARAMETER_ACL_LOCK,))
        yield


class RunPrivileges:
    """The role and ACL user of one grading run; :meth:`drop` removes both."""

    def __init__(self, admin_database_url: str, admin_redis_url: str, owner: dict | None = None) -> None:
        self.admin_database_url = admin_database_url
        self.admin_redis_url = admin_redis_url
        self.name = f"{ROLE_PREFIX}{secrets.token_hex(6)}"
        self.password = secrets.token_urlsafe(24)
        self.channels: list[str] = []
        stamp = json.dumps({**(owner or {}), "host": socket.gethostname(), "created": time.time()})
        with psycopg.connect(admin_database_url, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "CREATE ROLE {} LOGIN PASSWORD {} NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION "
                    "NOBYPASSRLS NOINHERIT CONNECTION LIMIT 300"
                ).format(sql.Identifier(self.name), sql.Literal(self.password))
            )
            conn.execute(sql.SQL("COMMENT ON ROLE {} IS {}").format(sql.Identifier(self.name), sql.Literal(stamp)))
            conn.execute(sql.SQL("ALTER ROLE {} SET search_path = learner, public").format(sql.Identifier(self.name)))
            if conn.info.server_version >= 150000:  # a superuser-only setting a check gives one pool (chapter 10)
                with _parameter_acl(conn):
                    for name in SETTABLE:
                        conn.execute(
                            sql.SQL("GRANT SET ON PARAMETER {} TO {}").format(
                                sql.Identifier(name), sql.Identifier(self.name)
                            )
                        )
        rules = ["on", f">{self.password}", "~*", "resetchannels", "+@all", "-@admin", "-@dangerous"]
        rules += [f"+{c}" for c in REDIS_ALLOWED if "|" not in c] + [f"-{c}" for c in REDIS_REFUSED]
        rules += [f"+{c}" for c in REDIS_ALLOWED if "|" in c]
        with redis.Redis.from_url(admin_redis_url) as admin:
            admin.execute_command("ACL", "SETUSER", self.name, *rules)

    def url(self, database: str) -> str:
        """A URL for ``database`` as the run's role (the servers' own address: for the checks' side)."""
        return psycopg.conninfo.make_conninfo(
            self.admin_database_url, dbname=database, user=self.name, password=self.password
        )

    def grant(self, database: str, channel_prefix: str | None = None) -> None:
        """Let the run's role use ``database`` (made by the grader, as the course's superuser)."""
        url = psycopg.conninfo.make_conninfo(self.admin_database_url, dbname=database)
        role = sql.Identifier(self.name)
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in (
                "REVOKE ALL ON DATABASE {db} FROM PUBLIC",
                "GRANT CONNECT, TEMPORARY ON DATABASE {db} TO {role}",
                "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
                "GRANT USAGE ON SCHEMA public TO {role}",
                "CREATE SCHEMA IF NOT EXISTS learner AUTHORIZATION {role}",
                "GRANT USAGE ON SCHEMA learner TO PUBLIC",
                "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES ON ALL TABLES IN SCHEMA public TO {role}",
                "GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {role}",
                "ALTER DEFAULT PRIVILEGES IN SCHEMA public "
                "GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES ON TABLES TO {role}",
                "ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO {role}",
            ):
                conn.execute(sql.SQL(statement).format(db=sql.Identifier(database), role=role))
        if channel_prefix:
            self.channels.append(channel_prefix)
            with redis.Redis.from_url(self.admin_redis_url) as admin:
                admin.execute_command("ACL", "SETUSER", self.name, f"&{channel_prefix}*")

    def drop(self) -> None:
        """Remove the role and the ACL user (after the run's databases are gone); never raises."""
        try:
            with redis.Redis.from_url(self.admin_redis_url) as admin:
                admin.execute_command("ACL", "DELUSER", self.name)
        except redis.RedisError:
            pass
        drop_role(self.admin_database_url, self.name)


def drop_role(admin_database_url: str, name: str) -> bool:
    try:
        with psycopg.connect(admin_database_url, autocommit=True) as conn:
            if conn.info.server_version >= 150000:
                for setting in SETTABLE:
                    with contextlib.suppress(psycopg.Error), _parameter_acl(conn):
                        conn.execute(
                            sql.SQL("REVOKE ALL ON PARAMETER {} FROM {}").format(
                                sql.Identifier(setting), sql.Identifier(name)
                            )
                        )
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))
        return True
    except psycopg.Error:
        return False


def reap_roles(admin_database_url: str, older_than: float = 6 * 3600) -> list[str]:
    """Drop run roles left by grading runs that died (their databases are reaped first)."""
    dropped = []
    try:
        with psycopg.connect(admin_database_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT rolname, shobj_description(oid, 'pg_authid') FROM pg_roles WHERE rolname LIKE %s",
                (ROLE_PREFIX.replace("_", "\\_") + "%",),
            ).fetchall()
    except psycopg.Error:
        return dropped
    for name, comment in rows:
        try:
            created = float(json.loads(comment or "{}").get("created", 0))
        except (ValueError, AttributeError):
            created = 0.0
        if time.time() - created > older_than and drop_role(admin_database_url, name):
            dropped.append(name)
    return dropped
