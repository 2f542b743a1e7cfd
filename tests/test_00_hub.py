"""``course hub`` (autograder/hub.py) before JupyterHub starts: what it refuses, reads and writes.

The hub itself, with real accounts and a browser, is ``make test-hub`` (tests/hub/).
"""

from __future__ import annotations

import os
import pwd
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from autograder import hub

REPO = Path(__file__).resolve().parent.parent


def _gradebook(course: Path, students: list[str]) -> None:
    with sqlite3.connect(course / "gradebook.db") as conn:
        conn.execute("CREATE TABLE student (id VARCHAR(128) PRIMARY KEY)")
        conn.executemany("INSERT INTO student VALUES (?)", [(s,) for s in students])


def test_course_hub_refuses_to_start_without_root_and_says_why():
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        run = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
    else:
        run = {}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from course.kit import cli; sys.exit(cli.main(['hub', '--no-start']))"],
        capture_output=True,
        text=True,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/nonexistent"},
        **run,
    )
    if proc.returncode != 2 and "No module named" in proc.stderr:
        pytest.skip("this venv is not one other accounts can run (a venv under /root)")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "course hub: JupyterHub starts as root here" in proc.stderr, proc.stderr


def test_the_roster_is_read_from_the_gradebook_and_a_course_without_one_has_none(tmp_path):
    assert hub.roster(tmp_path) == []
    _gradebook(tmp_path, ["bob", "ada"])
    assert hub.roster(tmp_path) == ["ada", "bob"]


def test_a_folder_that_is_not_the_course_directory_is_refused_with_the_fix(tmp_path):
    me = pwd.getpwuid(os.geteuid()).pw_name
    with pytest.raises(hub.HubError, match="is not the course directory"):
        hub.check_course(tmp_path, [me])
    (tmp_path / "nbgrader_config.py").write_text("")
    (tmp_path / "solutions").mkdir()
    hub.check_course(tmp_path, [me])
    with pytest.raises(hub.HubError, match="no account 'no-such-login-here'"):
        hub.check_course(tmp_path, ["no-such-login-here"])


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_course_directory_the_instructor_does_not_own_is_refused(tmp_path):
    (tmp_path / "nbgrader_config.py").write_text("")
    (tmp_path / "solutions").mkdir()
    with pytest.raises(hub.HubError, match="formgrader runs as the instructor"):
        hub.check_course(tmp_path, ["nobody"])


def test_login_is_allowed_to_the_instructors_and_to_whoever_the_roster_names_when_they_log_in(tmp_path):
    _gradebook(tmp_path, ["ada"])
    base = type("Base", (), {})
    allowed = hub.roster_authenticator(base, {"instructors": ["teach"], "course": str(tmp_path)})()
    assert allowed.check_allowed("teach") and allowed.check_allowed("ada")
    assert not allowed.check_allowed("eve")
    with sqlite3.connect(tmp_path / "gradebook.db") as conn:  # `nbgrader db student import` while the hub runs
        conn.execute("INSERT INTO student VALUES ('eve')")
    assert allowed.check_allowed("eve")


def _spawner(name: str, groups=()):
    user = SimpleNamespace(name=name, groups=[SimpleNamespace(name=g) for g in groups])
    return SimpleNamespace(user=user, environment={"KEEP": "1"}, notebook_dir="", args=[], cmd=[])


def test_an_instructors_server_runs_the_hubs_python_in_the_course_and_a_learners_the_class_python_at_home(tmp_path):
    settings = {
        "instructors": ["teach"],
        "course": str(tmp_path),
        "state": str(tmp_path / "state"),
        "python": {"python": "/opt/class/.venv/bin/python"},
        "instructor_python": {"python": sys.executable},
    }
    for spawner in (_spawner("teach"), _spawner("helper", groups=[hub.GROUP])):
        hub._per_account(spawner, settings)
        assert spawner.notebook_dir == str(tmp_path) and spawner.args == [f"--cd={tmp_path}"]
        assert spawner.cmd == [sys.executable, "-m", "autograder.hub", "singleuser"]  # formgrader grades with it
        assert str(hub.LEARNER_CONFIG) not in spawner.environment["JUPYTER_CONFIG_PATH"]
    learner = _spawner("ada")
    hub._per_account(learner, settings)
    assert learner.notebook_dir == "~" and learner.args == []
    config_path = learner.environment["JUPYTER_CONFIG_PATH"].split(os.pathsep)
    assert config_path == [str(tmp_path / "state" / "jupyter"), str(hub.LEARNER_CONFIG)]
    assert learner.environment["KEEP"] == "1"
    assert learner.cmd == ["/opt/class/.venv/bin/python", "-m", "autograder.hub", "singleuser"]
    assert learner.environment["PATH"].startswith("/opt/class/.venv/bin:")


def test_the_hubs_files_are_closed_and_the_class_configuration_open(tmp_path):
    settings = {"state": str(tmp_path / "state"), "exchange": "/srv/x/exchange", "port": 8000}
    config = hub.write_state(settings)
    assert config == tmp_path / "state" / "hub" / "jupyterhub_config.py"
    assert (tmp_path / "state" / "hub").stat().st_mode & 0o777 == 0o700
    assert config.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state" / "hub" / "proxy_auth_token").stat().st_mode & 0o777 == 0o600
    shared = tmp_path / "state" / "jupyter" / "nbgrader_config.py"
    assert shared.stat().st_mode & 0o777 == 0o644
    assert "c.Exchange.root = '/srv/x/exchange'" in shared.read_text()
    token = (tmp_path / "state" / "hub" / "proxy_auth_token").read_text()
    hub.write_state(settings)  # run again: the proxy's token stays, so a running proxy is not orphaned
    assert (tmp_path / "state" / "hub" / "proxy_auth_token").read_text() == token
