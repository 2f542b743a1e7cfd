"""A class on a real JupyterHub, started by ``course hub``, driven by headless Chromium (``make test-hub``).

As root only: the instructor and two learners are real accounts (``useradd``, removed
afterwards) with passwords, so the hub's PAM login, its spawner (each server as its own
account) and collect's owner check run as they do on a class's server. The instructor's course
directory is laid out as the instructor-flow test lays it (chapter 00, the repository's
``nbgrader_config.py`` and ``autograder``), with the roster imported and chapter 00 assigned by
the instructor's own ``course assign``, as docs/INSTRUCTORS.md says. The class's Python is made as
section 13, step 3 makes it: the hand-out (``git archive`` without ``solutions/``) unpacked and
``deploy/image/build.sh`` run on it, and given to the learners' servers (``--python``); the hub,
and the instructor's server, run the course directory's own venv (the checkout's). The
exchange, the class's Python and the hub's own files are in a temporary folder. Screenshots go to
``artifacts/hub/``.
"""

from __future__ import annotations

import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.helpers import make_handout

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SHOTS = REPO / "artifacts" / "hub"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CH00 = "00_setup_and_tour"
ACCOUNT = re.compile(r"^rbh(\d+)-(teach|ada|bob)$")


@dataclass
class Person:
    login: str
    password: str
    home: Path
    uid: int
    gid: int

    def run(self, *args: str, cwd: Path, timeout: float = 300) -> str:
        """A command as this account, with the course's venv first on PATH (``source .venv/bin/activate``)."""
        env = {"HOME": str(self.home), "USER": self.login, "LOGNAME": self.login, "LANG": "C.UTF-8"}
        env["PATH"] = f"{VENV_BIN}:/usr/bin:/bin"
        proc = subprocess.run(
            list(args), cwd=cwd, env=env, user=self.uid, group=self.gid, extra_groups=[],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{self.login}: `{' '.join(args)}` exited with {proc.returncode}:\n{out[-3000:]}"
        return out


@dataclass
class Hub:
    url: str
    base: Path
    course: Path
    exchange: Path
    instructor: Person
    learners: dict[str, Person]
    proc: subprocess.Popen
    log: Path
    said: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    def log_tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def _free_ports() -> int:
    """A port p with p, p+1 and p+2 free (the hub takes the next two for its API and the proxy's)."""
    for _ in range(100):
        port = random.randrange(20000, 40000)
        try:
            for p in (port, port + 1, port + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no three free ports in a row")


def _remove_stale_accounts() -> None:
    for entry in pwd.getpwall():
        found = ACCOUNT.match(entry.pw_name)
        if found and not Path(f"/proc/{found.group(1)}").exists():
            subprocess.run(["pkill", "-KILL", "-u", entry.pw_name], capture_output=True)
            subprocess.run(["userdel", entry.pw_name], capture_output=True)


def _person(base: Path, who: str, created: list[str]) -> Person:
    login = f"rbh{os.getpid()}-{who}"
    home = base / "home" / login
    subprocess.run(
        ["useradd", "--home-dir", str(home), "--create-home", "--shell", "/bin/bash", "--user-group", login],
        check=True,
        capture_output=True,
    )
    created.append(login)
    password = f"pw-{who}-{random.randrange(10**8)}"
    subprocess.run(["chpasswd"], input=f"{login}:{password}\n", text=True, check=True)
    home.chmod(0o700)  # docs/INSTRUCTORS.md, section 12: homes closed to other accounts
    entry = pwd.getpwnam(login)
    return Person(login, password, home, entry.pw_uid, entry.pw_gid)


def _course_dir(course: Path, owner: Person) -> None:
    course.mkdir(parents=True)
    shutil.copy(REPO / "nbgrader_config.py", course / "nbgrader_config.py")
    (course / "autograder").symlink_to(REPO / "autograder")
    for folder in ("solutions", "notebooks"):
        shutil.copytree(REPO / folder / CH00, course / folder / CH00, ignore=shutil.ignore_patterns(".*"))
    subprocess.run(["chown", "-R", f"{owner.uid}:{owner.gid}", str(course)], check=True)
    course.chmod(0o700)


def _can_run() -> str | None:
    if os.geteuid() != 0 or not shutil.which("useradd"):
        return "the hub tier needs root: real accounts (useradd), PAM login, servers spawned as each account"
    if not Path(CHROMIUM).exists():
        return f"no Chromium at {CHROMIUM} (bash tests/browser/setup.sh installs it)"
    try:
        import jupyterhub  # noqa: F401
        import playwright  # noqa: F401
    except ImportError as err:
        return f"{err.name} is not installed (make test-hub installs the hub and browser extras)"
    return None


@pytest.fixture(scope="module")
def hub():
    why = _can_run()
    if why:
        pytest.skip(why)
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):
        old.unlink()
    _remove_stale_accounts()
    base = Path(tempfile.mkdtemp(prefix="rbp-hub-"))
    base.chmod(0o755)
    created: list[str] = []
    proc = None
    try:
        teach = _person(base, "teach", created)
        learners = {who: _person(base, who, created) for who in ("ada", "bob")}
        course = teach.home / "workbook"
        _course_dir(course, teach)
        roster = base / "roster.csv"
        roster.write_text(
            "id,first_name,last_name,email\n"
            + "".join(f"{p.login},{who.title()},Learner,{who}@example.org\n" for who, p in learners.items())
        )
        roster.chmod(0o644)
        started = time.perf_counter()
        teach.run(str(VENV_BIN / "nbgrader"), "db", "student", "import", str(roster), cwd=course)
        teach.run(str(VENV_BIN / "course"), "assign", CH00, cwd=course)
        seconds = {"roster and course assign": time.perf_counter() - started}

        started = time.perf_counter()
        opt = base / "opt" / "resilient-course"  # section 13, step 3: the class's Python, from the hand-out
        opt.mkdir(parents=True)
        for folder in (opt.parent, opt):
            folder.chmod(0o755)
        subprocess.run(["tar", "-xf", str(make_handout(base / "workbook.tar")), "-C", str(opt)], check=True)
        built = subprocess.run(
            ["bash", str(opt / "deploy" / "image" / "build.sh"), str(opt)], capture_output=True, text=True, timeout=900
        )
        assert built.returncode == 0, f"build.sh failed:\n{(built.stdout + built.stderr)[-4000:]}"
        seconds["the class's Python (build.sh)"] = time.perf_counter() - started
        python = opt / ".venv" / "bin"

        port = _free_ports()
        exchange = base / "exchange"
        log = base / "hub.log"
        # as the docs run it: the course directory's venv (here the checkout's), the class's Python for learners
        cmd = [str(VENV_BIN / "course"), "hub", "--course", str(course), "--instructor", teach.login]
        cmd += ["--python", str(python / "python")]
        cmd += ["--ip", "127.0.0.1", "--port", str(port), "--state", str(base / "state"), "--exchange", str(exchange)]
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            cwd=course,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"},
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"course hub exited with {proc.returncode}:\n{log.read_text()[-6000:]}")
            try:
                if httpx.get(f"{url}/hub/api/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the hub did not answer within 180 s:\n{log.read_text()[-6000:]}")
            time.sleep(0.5)
        seconds["course hub until the hub answers"] = time.perf_counter() - started
        said = "\n".join(line for line in log.read_text().splitlines() if line.startswith("course hub:"))
        yield Hub(url, base, course, exchange, teach, learners, proc, log, said, seconds)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # JupyterHub stops every server it started, then the proxy
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        uids = []
        for login in created:
            uids.append(pwd.getpwnam(login).pw_uid)
            subprocess.run(["pkill", "-KILL", "-u", login], capture_output=True)
        time.sleep(0.5)
        for login in created:
            subprocess.run(["userdel", login], capture_output=True)
        # the accounts' runtime folders (their servers' parent folder, left when the servers stop): a later
        # account given the same uid must find none (the shared-machine tests plant one there)
        for uid in uids:
            shutil.rmtree(f"/tmp/resilient-course-{uid}", ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    from tests.browser.jlab import CHROMIUM_FLAGS

    pw = sync_playwright().start()
    chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
    yield chromium
    chromium.close()
    pw.stop()


def notebook_cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]
