"""The `course` command: doctor, up and down."""

import os
import subprocess
import sys
from pathlib import Path

import psycopg
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
