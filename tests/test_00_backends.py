"""course.backends: which servers are chosen, and that the ones the course starts always stop."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from course import backends


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
    from course import lab
    ns = lab.current("owner")
    print("READY", flush=True)
    mode = sys.argv[1]
    if mode == "exception":
        raise RuntimeError("the owner crashed")
    if mode in ("sigterm", "sigkill"):
        time.sleep(60)
    """
)


def _course_processes(state: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(attrs=("cmdline", "status")):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if state in cmd and proc.info.get("status") != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def _postgres_for(state: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(attrs=("name", "cmdline", "status")):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if proc.info.get("name") == "postgres" and state in cmd and proc.info.get("status") != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


@pytest.mark.parametrize("mode", ["normal", "exception", "sigterm", "sigkill"])
def test_servers_stop_when_their_owner_exits(tmp_path, mode):
    state = str(tmp_path / "state")
    env = dict(os.environ, COURSE_STATE_DIR=state, COURSE_BACKEND="embedded")
    env.pop("REDIS_URL", None)
    env.pop("DATABASE_URL", None)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, mode], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert owner.stdout.readline().strip() == "READY"
    assert _course_processes(state), "the embedded servers should be running while their owner lives"
    if mode == "sigterm":
        owner.send_signal(signal.SIGTERM)
    elif mode == "sigkill":
        owner.send_signal(signal.SIGKILL)
    owner.wait(30)
    deadline = time.monotonic() + 15  # the watchdog polls twice a second
    while time.monotonic() < deadline and (_course_processes(state) or _postgres_for(state)):
        time.sleep(0.2)
    left = [p.info.get("cmdline") for p in _course_processes(state) + _postgres_for(state)]
    assert not left, f"left running after a {mode} exit: {left}"
