"""The `course` command: doctor, up and down."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest
import redis

REPO = Path(__file__).resolve().parent.parent


def course(*args, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "course.kit.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "COURSE_BACKEND")}
    env["COURSE_STATE_DIR"] = str(tmp_path / "state")
    env.update(extra)
    return env


def test_doctor_is_all_ok_here(tmp_path):
    proc = course("doctor", env=_env(tmp_path))
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(line.startswith("[OK]") for line in lines[:-1]), proc.stdout
    text = proc.stdout
    for needle in ("Python", "nbgrader", "backend: embedded", "Redis 6.2", "PostgreSQL 18", "round trip"):
        assert needle in text


def test_doctor_fails_with_exit_1_when_a_server_is_unreachable(tmp_path):
    env = _env(
        tmp_path,
        COURSE_BACKEND="env",
        REDIS_URL="redis://127.0.0.1:1/0",
        DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
    )
    proc = course("doctor", env=env)
    assert proc.returncode == 1
    assert "[FAIL] Redis at redis://127.0.0.1:1/0" in proc.stdout
    assert "[FAIL] PostgreSQL" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_up_prints_urls_of_live_servers_and_down_stops_them(tmp_path):
    env = _env(tmp_path)
    up = course("up", "--export", env=env)
    assert up.returncode == 0, up.stderr
    urls = dict(line.removeprefix("export ").replace("'", "").split("=", 1) for line in up.stdout.splitlines())
    assert redis.Redis.from_url(urls["REDIS_URL"]).ping()
    with psycopg.connect(urls["DATABASE_URL"]) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    again = course("up", env=env)
    assert urls["REDIS_URL"] in again.stdout  # a second `up` reuses the running servers
    down = course("down", env=env)
    assert down.returncode == 0 and "stopped" in down.stdout
    try:
        redis.Redis.from_url(urls["REDIS_URL"], socket_connect_timeout=1).ping()
        raise AssertionError("Redis still answers after `course down`")
    except (redis.ConnectionError, FileNotFoundError):
        pass


def test_course_doctor_checks_every_dependency_the_package_declares():
    """A dependency added to pyproject.toml and missing from `course doctor` is a broken install it cannot name."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    from course.kit import cli

    declared = {
        Requirement(r).name.lower()
        for r in md.requires("resilient-course") or []
        if not Requirement(r).marker or Requirement(r).marker.evaluate({"extra": ""})
    }
    checked = {dist.lower() for dist, _ in cli.REQUIREMENTS} | cli.NOT_IMPORTED
    assert declared <= checked, f"course doctor does not check {sorted(declared - checked)}"


def test_the_editable_install_is_a_plain_path_entry_so_pip_prints_no_build_warning():
    """`make lab` and `make doctor` install the repository with `pip install -e`. For a flat layout
    without a declared package folder, setuptools installs an import finder and warns about it
    (BuildBackendWarning: "Editable installation ... be careful with folders in your working
    directory"), which pip shows even with --quiet; with the root declared as the packages' folder
    it writes a plain .pth entry and says nothing. This is setuptools' own test of that layout."""
    import tomllib

    from setuptools import find_packages
    from setuptools.command.editable_wheel import _simple_layout

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = config["package-dir"]
    packages = find_packages(str(REPO), include=config["packages"]["find"]["include"])
    assert set(package_dir) == {""} and _simple_layout(packages, package_dir, REPO)


def _urls(export: str) -> dict[str, str]:
    return dict(line.removeprefix("export ").replace("'", "").split("=", 1) for line in export.splitlines())


def _answers(urls: dict[str, str]) -> bool:
    try:
        redis.Redis.from_url(urls["REDIS_URL"], socket_connect_timeout=2).ping()
        with psycopg.connect(urls["DATABASE_URL"], connect_timeout=2) as conn:
            conn.execute("SELECT 1")
    except Exception:  # noqa: BLE001
        return False
    return True


def test_up_restarts_servers_that_died_and_doctor_says_whose_they_were(tmp_path):
    """The guide's remedy after `course up`'s PostgreSQL died: `course doctor` names the servers as
    `course up`'s and says what restarts them; `eval "$(course up --export)"` (run in a shell
    that holds the dead URLs) restarts them and prints URLs that answer."""
    import signal

    env = _env(tmp_path)
    first = course("up", "--export", env=env)
    assert first.returncode == 0, first.stderr
    dead = _urls(first.stdout)
    (pidfile,) = (tmp_path / "state").glob("run-*/pg/postmaster.pid")
    os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
    try:
        shell = {**env, **dead}  # after eval "$(course up --export)"
        doctor = course("doctor", env=shell)
        assert doctor.returncode == 1, doctor.stdout
        assert "(REDIS_URL and DATABASE_URL are set: the servers of `course up`, pid" in doctor.stdout
        assert "[FAIL] PostgreSQL at " in doctor.stdout and "[OK] Redis" in doctor.stdout
        assert 'stopped answering: `eval "$(course up --export)"` restarts what stopped' in doctor.stdout

        again = course("up", "--export", env=shell)
        assert again.returncode == 0, again.stderr
        assert f"PostgreSQL at {dead['DATABASE_URL']} stopped answering: restarted the servers" in again.stderr
        assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr
        live = _urls(again.stdout)
        assert live != dead and _answers(live)
    finally:
        course("down", env=env)


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root's folder when /tmp's is taken is /run's (tests/test_00_shared_machine.py)"
)
def test_up_with_its_runtime_folder_taken_by_another_account_starts_elsewhere(tmp_path):
    """Any account can make /tmp/resilient-course-UID of another first. `course up --export`
    then says so in one line and serves from a folder of the account's own."""
    short = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # unix socket paths are short
    try:
        (short / f"resilient-course-{os.getuid()}").write_text("planted")
        env = {k: v for k, v in _env(tmp_path).items() if k not in ("COURSE_STATE_DIR", "XDG_RUNTIME_DIR")}
        env.update(TMPDIR=str(short), XDG_CACHE_HOME=str(short / "cache"))
        up = course("up", "--export", env=env)
        assert up.returncode == 0 and "Traceback" not in up.stderr, up.stderr
        assert len(up.stderr.strip().splitlines()) == 1 and "another account made it first" in up.stderr
        assert str(short / "cache") in up.stdout and _answers(_urls(up.stdout))
        assert course("down", env=env).stdout.startswith("servers stopped")
    finally:
        shutil.rmtree(short, ignore_errors=True)
