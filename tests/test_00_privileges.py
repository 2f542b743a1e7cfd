"""What learner code under grading can reach on the servers: a role and an ACL user with no privilege.

Learner code connects as the grading run's own PostgreSQL role and Redis ACL user, through the
run's gateways (autograder/privileges.py, autograder/gateways.py). Each test here connects the
way a learner's process does and tries one thing the issue names (a superuser's file access or
shell, a Redis command that reaches outside its keys); each is refused with a clear error.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import psycopg
import pytest
import redis

from autograder import gateways, privileges
from autograder.session import _pg_target, _redis_target
from course.kit import backends, lab


@pytest.fixture(scope="module")
def run():
    """A run's privileges, one granted namespace, and the two gateways a learner's process would reach."""
    srv = backends.servers()
    priv = privileges.RunPrivileges(srv.database_url, srv.redis_url)
    ns = lab.create("privileges")
    other = lab.create("another_run")  # another learner's run, on the same servers
    priv.grant(ns.name, ns.key_prefix)
    loop = gateways.GatewayLoop()
    folder = Path(tempfile.mkdtemp(prefix="gw-"))
    target, port = _pg_target(srv.database_url)
    pg_gate = gateways.PostgresGate(loop, folder / "pg", port, target, priv.name)
    pg_gate.allow(ns.name)
    redis_gate = gateways.RedisGate(
        loop, folder / "redis.sock", _redis_target(srv.redis_url), priv.name, priv.password, {ns.redis_db}, ns.redis_db
    )
    with psycopg.connect(ns.database_url, autocommit=True) as admin:
        admin.execute("CREATE TABLE grader_table (id int PRIMARY KEY, v text)")
        admin.execute("CREATE FUNCTION grader_gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$")
        admin.execute("CREATE TRIGGER gate BEFORE INSERT ON grader_table FOR EACH ROW EXECUTE FUNCTION grader_gate()")
    with redis.Redis.from_url(other.redis_url) as admin:
        admin.set("secret", "another learner's")
    info = {
        "ns": ns,
        "other": other,
        "priv": priv,
        "pg": f"host={folder / 'pg'} port={port} user={priv.name} password={priv.password} dbname={ns.name}",
        "pg_host": str(folder / "pg"),
        "port": port,
        "redis": f"unix://{folder / 'redis.sock'}?db={ns.redis_db}",
        "pg_gate": pg_gate,
    }
    yield info
    pg_gate.close()
    redis_gate.close()
    loop.stop()
    lab._forget(ns)  # noqa: SLF001
    lab._forget(other)  # noqa: SLF001
    priv.drop()


@pytest.fixture
def learner_sql(run):
    with psycopg.connect(run["pg"], autocommit=True) as conn:
        yield conn


@pytest.fixture
def learner_redis(run):
    with redis.Redis.from_url(run["redis"], decode_responses=True) as client:
        yield client


# ----------------------------------------------------------------------------- PostgreSQL


def test_the_run_role_is_no_superuser_and_holds_no_dangerous_role(learner_sql, run):
    row = learner_sql.execute(
        "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls FROM pg_roles WHERE rolname = %s",
        (run["priv"].name,),
    ).fetchone()
    assert row == (False, False, False, False, False)
    for role in privileges.PG_DANGEROUS_ROLES:
        member = learner_sql.execute("SELECT pg_has_role(current_user, %s, 'MEMBER')", (role,)).fetchone()[0]
        assert not member, role


@pytest.mark.parametrize(
    ("what", "statement", "says"),
    [
        ("a server file", "SELECT pg_read_file('/etc/passwd')", "permission denied"),
        ("a server folder", "SELECT pg_ls_dir('.')", "permission denied"),
        ("a binary file", "SELECT pg_read_binary_file('/etc/passwd')", "permission denied"),
        ("a shell", "COPY (SELECT 1) TO PROGRAM 'id > /tmp/owned'", "permission denied"),
        ("a file written", "COPY (SELECT 1) TO '/tmp/owned'", "permission denied"),
        ("a file read", "COPY grader_table FROM '/etc/passwd'", "permission denied"),
        ("a large object exported", "SELECT lo_export(lo_create(0), '/tmp/owned')", "permission denied"),
        ("a large object imported", "SELECT lo_import('/etc/passwd')", "permission denied"),
        (
            "an untrusted language",
            "CREATE FUNCTION f() RETURNS int LANGUAGE c AS 'libc', 'getpid'",
            "permission denied",
        ),
        ("an extension", "CREATE EXTENSION IF NOT EXISTS vector", "permission denied"),
        ("a schema", "CREATE SCHEMA mine", "permission denied"),
        ("the server's settings", "ALTER SYSTEM SET max_connections = 5", "permission denied"),
        ("a superuser-only setting", "SET session_replication_role = replica", "permission denied"),
        ("the server's log", "SET log_min_messages = debug5", "permission denied"),
        ("another role", "SET ROLE postgres", "permission denied"),
        ("a superuser session", "SET SESSION AUTHORIZATION postgres", "permission denied"),
        ("a database", "CREATE DATABASE mine", "permission denied"),
        ("a role", "CREATE ROLE mine", "permission denied"),
        ("the grader's trigger", "DROP TRIGGER gate ON grader_table", "must be owner"),
        ("the grader's table", "ALTER TABLE grader_table ADD COLUMN x int", "must be owner"),
        (
            "a function in the grader's schema",
            "CREATE FUNCTION public.lower(varchar) RETURNS text LANGUAGE sql AS $$ SELECT 'x' $$",
            "permission denied",
        ),
    ],
)
def test_the_run_role_is_refused(learner_sql, what, statement, says):
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match=says):
        learner_sql.execute(statement)


def test_the_run_role_sets_only_the_settings_a_check_gives_it(learner_sql, run):
    """Chapter 10's check gives one pool ``-c deadlock_timeout=5s``; the role may set that and nothing
    else a superuser alone may (the grant is revoked with the role, or DROP ROLE would fail)."""
    learner_sql.execute("SET deadlock_timeout = '5s'")
    assert learner_sql.execute("SHOW deadlock_timeout").fetchone() == ("5s",)


def test_runs_made_and_dropped_at_once_each_get_their_settings():
    """Every run's grant of a setting changes one catalog row: runs that start and end together (a class
    graded in parallel) must not fail each other ("tuple concurrently updated")."""
    import threading

    srv = backends.servers()
    errors: list[BaseException] = []

    def one() -> None:
        try:
            for _ in range(3):
                privileges.RunPrivileges(srv.database_url, srv.redis_url).drop()
        except BaseException as err:  # noqa: BLE001 - collected, asserted below
            errors.append(err)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_the_run_role_reads_and_writes_the_runs_tables(learner_sql):
    learner_sql.execute("INSERT INTO grader_table (id, v) VALUES (1, 'ok') ON CONFLICT DO NOTHING")
    assert learner_sql.execute("SELECT v FROM grader_table WHERE id = 1").fetchone() == ("ok",)
    learner_sql.execute("CREATE TABLE IF NOT EXISTS mine (id int)")  # in its own schema, never the grader's
    assert learner_sql.execute("SELECT to_regclass('learner.mine') IS NOT NULL").fetchone() == (True,)


def test_the_gateway_lets_in_only_the_run_role_on_the_runs_databases(run):
    as_superuser = f"host={run['pg_host']} port={run['port']} user=postgres dbname={run['ns'].name}"
    with pytest.raises(psycopg.OperationalError, match="connects as role"):
        psycopg.connect(as_superuser)
    elsewhere = f"host={run['pg_host']} port={run['port']} user={run['priv'].name} dbname={run['other'].name}"
    with pytest.raises(psycopg.OperationalError, match="not one of this grading run's"):
        psycopg.connect(elsewhere)


# ----------------------------------------------------------------------------- Redis


@pytest.mark.parametrize(
    "command",
    [
        ("CONFIG", "SET", "dir", "/tmp"),
        ("CONFIG", "GET", "dir"),
        ("MODULE", "LOAD", "/tmp/x.so"),
        ("SAVE",),
        ("BGSAVE",),
        ("BGREWRITEAOF",),
        ("DEBUG", "SLEEP", "0"),
        ("SHUTDOWN",),
        ("REPLICAOF", "127.0.0.1", "1"),
        ("SLAVEOF", "127.0.0.1", "1"),
        ("MIGRATE", "127.0.0.1", "1", "k", "0", "10"),
        ("ACL", "SETUSER", "default", "on"),
        ("CLIENT", "KILL", "ID", "1"),
        ("CLIENT", "LIST"),
        ("FLUSHALL",),
        ("SWAPDB", "0", "1"),
        ("MOVE", "k", "0"),
        ("COPY", "k", "k2", "DB", "0"),
        ("MONITOR",),
        ("INFO",),
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_the_run_user_is_refused(learner_redis, command):
    with pytest.raises(redis.ResponseError, match="no permissions"):
        learner_redis.execute_command(*command)


def test_the_run_user_cannot_leave_its_database(learner_redis, run):
    with pytest.raises(redis.ResponseError, match="not one of this grading run's"):
        learner_redis.execute_command("SELECT", run["other"].redis_db)
    with pytest.raises(redis.ResponseError, match="can't run this command"):
        learner_redis.eval(f"return redis.call('SELECT', '{run['other'].redis_db}')", 0)
    assert learner_redis.get("secret") is None


@pytest.mark.parametrize("command", [("AUTH", "default", "x"), ("AUTH", "x"), ("HELLO", "3", "AUTH", "default", "x")])
def test_the_run_user_cannot_switch_users(learner_redis, command):
    with pytest.raises(redis.ResponseError, match="cannot switch Redis users"):
        learner_redis.execute_command(*command)


def test_the_run_user_publishes_only_on_the_runs_channels(learner_redis, run):
    assert learner_redis.publish(f"{run['ns'].key_prefix}news", "hi") == 0
    with pytest.raises(redis.ResponseError, match="no permissions"):
        learner_redis.publish(f"{run['other'].key_prefix}news", "hi")


def test_the_run_user_does_what_answers_do(learner_redis):
    assert learner_redis.incr("visits:home") == 1
    assert learner_redis.keys("visits:*") == ["visits:home"]
    assert learner_redis.eval("return redis.call('INCR', KEYS[1])", 1, "visits:home") == 2
    with learner_redis.pipeline() as pipe:
        assert pipe.incr("visits:home").get("visits:home").execute() == [3, "3"]
    assert learner_redis.flushdb() is True
