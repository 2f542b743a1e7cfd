"""course.kit.backends: which servers are chosen, and that the ones the course starts always stop."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from course.kit import backends


def test_env_urls_win(monkeypatch):
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    monkeypatch.setenv("DATABASE_URL", "postgresql://example/db")
    assert backends.choose()[0] == "env"


def test_one_url_alone_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("COURSE_BACKEND", raising=False)
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    monkeypatch.delenv("DATABASE_URL", raising=False)
    with pytest.raises(backends.BackendError, match="set DATABASE_URL too"):
        backends.choose()


def test_docker_is_next_when_an_engine_answers(monkeypatch):
    for var in ("COURSE_BACKEND", "REDIS_URL", "DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(backends, "docker_available", lambda: (True, "an engine answers"))
    assert backends.choose() == ("docker", "an engine answers")


def test_embedded_without_urls_or_docker(monkeypatch):
    for var in ("COURSE_BACKEND", "REDIS_URL", "DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(backends, "docker_available", lambda: (False, "no Docker engine answers"))
    kind, reason = backends.choose()
    assert kind == "embedded" and "no Docker engine" in reason


def test_course_backend_forces_a_kind(monkeypatch):
    monkeypatch.setenv("COURSE_BACKEND", "embedded")
    monkeypatch.setenv("REDIS_URL", "redis://example:6379/0")
    monkeypatch.setenv("DATABASE_URL", "postgresql://example/db")
    assert backends.choose()[0] == "embedded"
    monkeypatch.setenv("COURSE_BACKEND", "cloud")
    with pytest.raises(backends.BackendError, match="env, docker, embedded"):
        backends.choose()


# ----------------------------------------------------------------------------- cleanup

OWNER = textwrap.dedent(
    """
    import os, sys, time
    from course.kit import lab
    ns = lab.current("owner")
    print("READY", flush=True)
    mode = sys.argv[1]
    if mode == "exception":
        raise RuntimeError("the owner crashed")
    if mode in ("sigterm", "sigkill"):
        time.sleep(60)
    """
)


def _server_pids(state: str) -> dict[str, int]:
    """The pids of the run's redis-server, postgres and watchdog, read from their pid files."""
    from pathlib import Path

    (run,) = Path(state).glob("run-*")
    pids = {
        "redis": int((run / "redis" / "redis.pid").read_text().split()[0]),
        "postgres": int((run / "pg" / "postmaster.pid").read_text().split()[0]),
    }
    for proc in psutil.process_iter(attrs=("cmdline",)):
        if "course.kit.watchdog" in " ".join(proc.info.get("cmdline") or []) and str(run) in proc.info["cmdline"]:
            pids["watchdog"] = proc.pid
    return pids


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("mode", ["normal", "exception", "sigterm", "sigkill"])
def test_servers_stop_when_their_owner_exits(tmp_path, mode):
    state = str(tmp_path / "state")
    env = dict(os.environ, COURSE_STATE_DIR=state, COURSE_BACKEND="embedded")
    env.pop("REDIS_URL", None)
    env.pop("DATABASE_URL", None)
    log = open(tmp_path / "owner.log", "w+")  # noqa: SIM115 - read back on failure
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, mode], env=env, stdout=subprocess.PIPE, stderr=log, text=True
    )
    ready = owner.stdout.readline().strip()
    log.seek(0)
    assert ready == "READY", log.read()[-2000:]
    pids = _server_pids(state)
    assert set(pids) == {"redis", "postgres", "watchdog"} and all(map(_running, pids.values())), pids
    if mode == "sigterm":
        owner.send_signal(signal.SIGTERM)
    elif mode == "sigkill":
        owner.send_signal(signal.SIGKILL)
    owner.wait(30)
    deadline = time.monotonic() + 15  # the watchdog polls twice a second
    while time.monotonic() < deadline and any(map(_running, pids.values())):
        time.sleep(0.2)
    left = {name: pid for name, pid in pids.items() if _running(pid)}
    assert not left, f"left running after a {mode} exit: {left}"


def _set_then_sleep(event) -> None:
    event.set()
    time.sleep(60)


def test_a_forked_child_that_is_terminated_leaves_its_parents_servers_running():
    """multiprocessing's terminate() sends SIGTERM to a forked child, which inherits the handler that
    stops this process's servers: the child must not stop (or delete) what its parent still uses."""
    import multiprocessing

    import psycopg
    import redis

    servers = backends.servers()
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    child = ctx.Process(target=_set_then_sleep, args=(started,))
    child.start()
    assert started.wait(30)  # a SIGTERM that lands while the child is still forking is dropped by CPython
    child.terminate()
    child.join(10)
    assert child.exitcode is not None
    with redis.Redis.from_url(servers.redis_url) as r:
        assert r.ping()
    with psycopg.connect(servers.database_url, connect_timeout=5) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
