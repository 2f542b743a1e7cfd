"""The instructor's path on one shared machine, step by step as docs/INSTRUCTORS.md tells it.

The machine: the instructor's course directory, laid out like the repository (its
``nbgrader_config.py`` is the repository's, its ``autograder`` the repository's own); one
exchange folder outside it, made as the docs say; learner accounts, each with a home, an
own ``~/.jupyter/nbgrader_config.py`` naming the exchange, and a copy of the workbook
unpacked from the hand-out the docs make (``git archive`` without ``solutions/``). Run as
root, the learners are real accounts (``useradd``, removed afterwards) whose commands run
under their own uid; otherwise separate homes and ``--student`` stand in for them.

Chapter 01 goes through the exchange: released, fetched, submitted (ada with every answer;
bob with one, a test cell edited and another deleted), collected, graded by ``course grade``
on two "nodes" (shards into one cache) and recorded in one run, feedback released and
fetched. dee hands chapter 01 in by hand (no ``submission_secret.txt``: her feedback cannot
go through the exchange). Chapter 03 goes by hand: notebooks and ``timestamp.txt`` put into
``submitted/``, graded by ``nbgrader autograde``; bob's answer prints the paths of the
course's code and a traceback through it, and edits a locked cell; dee's is chapter 01's
notebook, not graded, and her feedback says why. cyd is on the roster and hands in nothing.
Chapter 00 is in ``solutions/`` but never assigned.

What learners push on (real accounts only): bob plants a folder in the exchange that claims
to be ada's, and another of his own with a time before anyone's in its name; eve, who is not
on the roster, hands in by hand into the exchange; bob makes cyd's runtime folder in /tmp
before cyd first runs. None of it changes a grade, each is named in one line, and cyd's
``course check`` works.

Every step's output is asserted: nothing an instructor would have to learn to ignore in a
normal run, one line per changed cell or left-out folder, no path of the grading machine in
any feedback, and an export of the two assigned chapters with cyd missing, dee's chapter 03
not graded with the reason, and a time per submission that no learner chose.
"""

from __future__ import annotations

import contextlib
import csv
import html
import json
import os
import pwd
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from autograder import settings
from tests.helpers import account_python, clear_runtime_folder, make_handout

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
CH00, CH01, CH03 = "00_setup_and_tour", "01_timeouts_and_retries", "03_idempotency"
#: what the instructor's course directory holds before any step (git-tracked in the real one)
SOURCES = {".gitignore", "nbgrader_config.py", "autograder", "solutions", "notebooks"}
ACCOUNT = re.compile(r"^rbp(\d+)-(ada|bob|cyd|dee|eve)$")
LEARNERS = ("ada", "bob", "cyd", "dee", "eve")

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- notebooks


def _nb(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _meta(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def _src(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def solutions(chapter: str) -> dict[str, str]:
    """grade_id -> the reference answer as a learner would type it (markers removed)."""
    out = {}
    for cell in _nb(REPO / "solutions" / chapter / f"{chapter}.ipynb")["cells"]:
        if cell["cell_type"] == "code" and _meta(cell).get("solution"):
            lines = _src(cell).splitlines()
            out[_meta(cell)["grade_id"]] = "\n".join(
                line for line in lines if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION")
            )
    return out


def points(chapter: str) -> dict[str, float]:
    """task -> points, from the grading manifest."""
    cells = json.loads((REPO / "autograder" / "manifests" / f"{chapter}.json").read_text())["cells"]
    return {c["task"]: float(c["points"]) for c in cells if c["kind"] == "test"}


def work(released: dict, answers: dict[str, str], *, edit=None, delete=()) -> dict:
    """The released notebook with ``answers`` typed in; ``edit``: {grade_id: (old, new)} text replacements."""
    nb = json.loads(json.dumps(released))
    cells = []
    for cell in nb["cells"]:
        gid = _meta(cell).get("grade_id")
        if gid in delete:
            continue
        if gid in answers:
            cell["source"] = answers[gid]
        if edit and gid in edit:
            old, new = edit[gid]
            assert old in _src(cell), f"{gid} has no {old!r}"
            cell["source"] = _src(cell).replace(old, new)
        cells.append(cell)
    nb["cells"] = cells
    return nb


#: chapter 03, bob: an unfinished answer that shows where the course's code lives and a traceback through it
SNOOP = """import os, sys, traceback
import course.kit.stats as stats
print("course code at", stats.__file__)
print("working in", os.getcwd(), "with", sys.executable)
try:
    stats.percentile(["a", 1], 50)
except TypeError:
    traceback.print_exc(file=sys.stdout)


async def create_order(pool, idempotency_key: str, body: dict, charge) -> dict:
    raise NotImplementedError("not done yet")
"""


# ----------------------------------------------------------------------------- output

#: what a normal run must not print: warnings, errors, tracebacks, a config that failed to load
NOISE = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|Warning:|SAWarning|Exception while loading|[Dd]eprecat")


def noise(output: str, allowed: tuple[str, ...] = ()) -> list[str]:
    lines = [line for part in output.splitlines() for line in part.split("\r")]
    return [line for line in lines if NOISE.search(line) and not any(a in line for a in allowed)]


def assert_clean(step: str, output: str, allowed: tuple[str, ...] = ()) -> None:
    found = noise(output, allowed)
    assert not found, f"`{step}` printed what an instructor would learn to ignore:\n" + "\n".join(found)


def feedback_text(path: Path) -> str:
    text = re.sub(r"<[^>]+>", " ", path.read_text(encoding="utf-8"))
    return " ".join(html.unescape(text).split())


# ----------------------------------------------------------------------------- the machine


@dataclass
class Account:
    """Someone on the machine: their own home, environment and (as root) uid."""

    name: str  # the login, which nbgrader takes as the student id
    home: Path
    env: dict[str, str]
    uid: int | None = None
    gid: int | None = None
    python: str = sys.executable
    log: list[str] = field(default_factory=list)
    seconds: list[tuple[str, float]] = field(default_factory=list)

    def run(self, *args: str, cwd: Path, ok: bool = True, timeout: float = 300) -> str:
        as_user = {"user": self.uid, "group": self.gid, "extra_groups": []} if self.uid is not None else {}
        started = time.perf_counter()
        proc = subprocess.run(
            list(args), cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout, **as_user
        )
        words = [a for a in args if not a.startswith("-")]
        words = words[2:] if words[1:2] == ["-m"] or Path(words[0]).name.startswith("python") else words
        self.seconds.append((" ".join(w for w in words[:3] if "/" not in w), time.perf_counter() - started))
        out = proc.stdout + proc.stderr
        self.log.append(f"$ {' '.join(args)}  (in {cwd}, exit {proc.returncode})\n{out}")
        if ok:
            assert proc.returncode == 0, (
                f"{self.name}: `{' '.join(args)}` exited with {proc.returncode}:\n{out[-4000:]}"
            )
        return out if ok else (proc.returncode, out)

    def nbgrader(self, *args: str, cwd: Path) -> str:
        return self.run(self.python, "-m", "nbgrader", *args, cwd=cwd)

    def give(self, path: Path) -> None:
        """Make ``path`` (written by the test) theirs, as if they had written it."""
        if self.uid is not None:
            for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
                os.chown(p, self.uid, self.gid, follow_symlinks=False)


def _jupyter_config(home: Path, exchange: Path) -> None:
    """``~/.jupyter/nbgrader_config.py`` as the docs tell every account to write it."""
    (home / ".jupyter").mkdir(parents=True, exist_ok=True)
    (home / ".jupyter" / "nbgrader_config.py").write_text(f'c = get_config()\nc.Exchange.root = "{exchange}"\n')


def _base_env(home: Path, user: str) -> dict[str, str]:
    env = {"HOME": str(home), "USER": user, "LOGNAME": user, "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"}
    env["TMPDIR"] = tempfile.gettempdir()
    return env


def _remove_stale_accounts() -> None:
    """Accounts an earlier run left behind (killed before its cleanup) whose process is gone."""
    for entry in pwd.getpwall():
        found = ACCOUNT.match(entry.pw_name)
        if found and not Path(f"/proc/{found.group(1)}").exists():
            subprocess.run(["userdel", entry.pw_name], capture_output=True)


@dataclass
class Machine:
    base: Path
    course: Path
    exchange: Path
    handout: Path
    instructor: Account
    learners: dict[str, Account]
    real_accounts: bool
    planted: list[Path] = field(default_factory=list)  # made outside ``base`` by a learner: removed afterwards

    def teach(self, *args: str, ok: bool = True):
        """The instructor, in the course directory with the venv active."""
        return self.instructor.run(*args, cwd=self.course, ok=ok)

    def copy(self, who: str) -> Path:
        return self.learners[who].home / "workbook"

    def student(self, who: str) -> str:
        return self.learners[who].name

    def as_learner(self, who: str, *args: str) -> str:
        """nbgrader as the learner, in their copy; simulated accounts name themselves with --student."""
        learner = self.learners[who]
        flag = [] if self.real_accounts or args[0] == "fetch_assignment" else [f"--student={learner.name}"]
        return learner.nbgrader(*args, *flag, cwd=self.copy(who))


def _course_dir(course: Path) -> None:
    """The instructor's repository, as far as nbgrader and the grader see it."""
    course.mkdir(parents=True)
    shutil.copy(REPO / "nbgrader_config.py", course / "nbgrader_config.py")
    shutil.copy(REPO / ".gitignore", course / ".gitignore")
    (course / "autograder").symlink_to(REPO / "autograder")
    for chapter in (CH00, CH01, CH03):
        for folder in ("solutions", "notebooks"):
            shutil.copytree(REPO / folder / chapter, course / folder / chapter, ignore=shutil.ignore_patterns(".*"))


def _learners(base: Path, exchange: Path, handout: Path, created: list[str] | None) -> dict[str, Account] | None:
    """ada, bob and cyd with their homes, configs and copies: real accounts when ``created`` is a list
    (None when no Python those accounts can run is found), simulated otherwise."""
    learners, found = {}, None
    for who in LEARNERS:
        home = base / "home" / who
        home.mkdir(parents=True)
        name, uid, gid = who, None, None
        if created is not None:
            name = f"rbp{os.getpid()}-{who}"
            subprocess.run(
                ["useradd", "--home-dir", str(home), "--no-create-home", "--shell", "/usr/sbin/nologin"]
                + ["--user-group", name],
                check=True,
                capture_output=True,
            )
            created.append(name)
            entry = pwd.getpwnam(name)
            uid, gid = entry.pw_uid, entry.pw_gid
            clear_runtime_folder(uid)  # left by an earlier test's account with this uid
        env = _base_env(home, name)
        learner = Account(name, home, env, uid, gid)
        _jupyter_config(home, exchange)
        learner.give(home)
        if created is not None:
            home.chmod(0o700)
            found = found or account_python(uid, gid, env, "nbgrader.apps")
            if found is None:
                return None
            learner.python, extra = found
            env.update(extra)
        # the docs: mkdir ~/workbook && tar -xf /srv/nbgrader/workbook.tar -C ~/workbook
        learner.run("mkdir", str(home / "workbook"), cwd=home)
        learner.run("tar", "-xf", str(handout), "-C", str(home / "workbook"), cwd=home)
        learners[who] = learner
    return learners


@pytest.fixture(scope="module")
def machine():
    from course.kit import backends

    base = Path(tempfile.mkdtemp(prefix="rbp-machine-"))
    base.chmod(0o755)
    real = os.geteuid() == 0 and shutil.which("useradd") is not None
    created: list[str] = []
    try:
        exchange = base / "srv" / "exchange"
        exchange.parent.mkdir()
        subprocess.run(["install", "-d", "-m", "1777", str(exchange)], check=True)  # as the docs say
        ihome = base / "instructor"
        ihome.mkdir(mode=0o755)
        _jupyter_config(ihome, exchange)
        ienv = _base_env(ihome, pwd.getpwuid(os.getuid()).pw_name)
        ienv["PATH"] = f"{VENV_BIN}:{ienv['PATH']}"  # `source .venv/bin/activate`
        ienv.update(backends.servers().as_env(), COURSE_BACKEND="env", MPLBACKEND="Agg")  # `course up --export`
        course = ihome / "workbook"
        _course_dir(course)
        handout = make_handout(base / "srv" / "workbook.tar")

        learners = None
        if real:
            _remove_stale_accounts()
            learners = _learners(base, exchange, handout, created)
            if learners is None:  # no Python those accounts may run: the same flow, accounts simulated
                for name in created:
                    subprocess.run(["userdel", name], capture_output=True)
                created.clear()
                shutil.rmtree(base / "home")
                real = False
        learners = learners or _learners(base, exchange, handout, None)
        m = Machine(base, course, exchange, handout, Account("instructor", ihome, ienv), learners, real)
        yield m
    finally:
        for name in created:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)  # a server a failed step left
            with contextlib.suppress(KeyError):
                clear_runtime_folder(pwd.getpwnam(name).pw_uid)
            subprocess.run(["userdel", name], capture_output=True)
        for path in m.planted if "m" in locals() else []:
            shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def _cpu() -> float:
    """CPU seconds of this process and of every child it waited for (the steps' commands and their graders)."""
    import resource

    return sum(
        u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    )


def _world_writable(root: Path) -> list[str]:
    return [
        str(p.relative_to(root))
        for p in [root, *root.rglob("*")]
        if not p.is_symlink() and p.stat().st_mode & stat.S_IWOTH
    ]


def _gradebook_scores(course: Path, chapter: str) -> dict[str, float]:
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course}/gradebook.db") as gb:
        return {s.student.id: s.score for s in gb.assignment_submissions(chapter)}


# ----------------------------------------------------------------------------- the test


@pytest.mark.xdist_group("instructor-flow")  # real accounts as root: on a worker of its own under `make test`
def test_a_class_on_one_shared_machine(machine: Machine):
    m = machine
    mode = f"real accounts running {m.learners['ada'].python}" if m.real_accounts else "simulated accounts"
    cpu, started = _cpu(), time.perf_counter()
    try:
        _the_class(m, *(m.student(w) for w in LEARNERS))
    except BaseException:
        print("\n\n".join(m.instructor.log + [line for a in m.learners.values() for line in a.log]))
        raise
    finally:
        steps = [
            (f"{a.name if a is not m.instructor else ''} {what}".strip(), t)
            for a in (m.instructor, *m.learners.values())
            for what, t in a.seconds
        ]
        print(
            f"\nlearners: {mode}; {time.perf_counter() - started:.1f} s, {_cpu() - cpu:.1f} s of CPU; "
            + ", ".join(f"{what} {t:.1f} s" for what, t in steps)
        )


def _name_time(moment: float) -> str:
    """A time as ``nbgrader submit`` writes it into a submission folder's name."""
    return time.strftime("%Y-%m-%d %H:%M:%S.000000 UTC", time.gmtime(moment))


def _plant(m: Machine, who: str, folder: str, content: Path, stamp: str) -> Path:
    """``who`` makes ``inbound/<folder>`` by hand, as any account can: a copy of ``content``, its
    ``timestamp.txt`` saying ``stamp``, closed to everyone else (mode 700)."""
    dest = m.exchange / settings.COURSE_ID / "inbound" / folder
    learner = m.learners[who]
    learner.run("cp", "-r", str(content), str(dest), cwd=learner.home)
    learner.run(
        "sh", "-c", f"printf '%s' '{stamp}' > '{dest}/timestamp.txt' && chmod -R go-rwx '{dest}'", cwd=learner.home
    )
    return dest


def _the_class(m: Machine, ada: str, bob: str, cyd: str, dee: str, eve: str) -> None:
    # the hand-out holds no solution, and a learner's copy is theirs
    for who in m.learners:
        assert not (m.copy(who) / "solutions").exists(), "the learners' copy holds solutions/"
        assert (m.copy(who) / "notebooks" / CH01 / f"{CH01}.ipynb").exists()

    # a learner makes another's runtime folder before that one first runs (any account can write /tmp)
    squatted = Path(m.learners["cyd"].env["TMPDIR"]) / f"resilient-course-{m.learners['cyd'].uid}"
    if m.real_accounts:
        m.planted.append(squatted)
        m.learners["bob"].run("mkdir", "-m", "777", str(squatted), cwd=m.learners["bob"].home)

    # 1. the roster (so that who hands in nothing is listed), then the chapters handed out
    roster = m.instructor.home / "roster.csv"
    roster.write_text(
        "id,first_name,last_name,email\n"
        f"{ada},Ada,Lovelace,ada@example.org\n{bob},Bob,Kahn,bob@example.org\n{cyd},Cyd,Charisse,cyd@example.org\n"
        f"{dee},Dee,Hock,dee@example.org\n"
    )
    assert_clean("nbgrader db student import", m.teach("nbgrader", "db", "student", "import", str(roster)))
    out = m.teach("course", "assign", CH01, CH03, "--due", "2030-01-15 17:00:00 UTC")
    assert_clean("course assign", out)
    assert f"{CH01}: recorded in the gradebook (3 graded cells, 10 points, due 2030-01-15 17:00 UTC)" in out, out

    # 2. release through the exchange, which lives outside the repository
    out = m.teach("nbgrader", "release_assignment", CH01)
    assert_clean("nbgrader release_assignment", out)
    assert f"Released as: {settings.COURSE_ID} {CH01}" in out, out
    assert (m.exchange / settings.COURSE_ID / "outbound" / CH01 / f"{CH01}.ipynb").exists()
    inbound = m.exchange / settings.COURSE_ID / "inbound"
    assert inbound.stat().st_mode & stat.S_ISVTX, "inbound/ is not sticky: a learner could move another's folder"
    assert not (m.course / ".exchange").exists(), "the exchange was made inside the repository"
    assert not _world_writable(m.course), f"world-writable in the repository: {_world_writable(m.course)}"

    # another account may load the instructor's config (a learner in the instructor's folder): no crash, no write
    before = sorted(p.name for p in m.course.iterdir())
    load = (
        "from traitlets.config.loader import PyFileConfigLoader as L; c = L('nbgrader_config.py', path='.').load_config();"
        "print(c.CourseDirectory.course_id, 'Exchange' in c)"
    )
    code, out = m.learners["cyd"].run(m.learners["cyd"].python, "-c", load, cwd=m.course, ok=False)
    assert (code, out.strip()) == (0, f"{settings.COURSE_ID} False"), out  # loaded whole; cyd's exchange kept
    assert sorted(p.name for p in m.course.iterdir()) == before

    # 3. learners fetch from their own copy, with only their own ~/.jupyter config naming the exchange
    released = _nb(m.course / "notebooks" / CH01 / f"{CH01}.ipynb")
    answers = solutions(CH01)
    handed_in = {
        "ada": work(released, answers),
        "bob": work(
            released,
            {"is_retryable": answers["is_retryable"]},
            edit={"check_with_retry": ('public("with_retry")', 'print("all good")')},
            delete=("check_retry_test",),
        ),
    }
    for who, nb in handed_in.items():
        out = m.as_learner(who, "fetch_assignment", CH01)
        assert_clean(f"{who}: nbgrader fetch_assignment", out)
        assert f"Fetched as: {settings.COURSE_ID} {CH01}" in out, out
        fetched = m.copy(who) / CH01 / f"{CH01}.ipynb"
        assert _nb(fetched)["cells"] == released["cells"]
        fetched.write_text(json.dumps(nb, indent=1))
        m.learners[who].give(fetched)
        out = m.as_learner(who, "submit", CH01)
        assert_clean(f"{who}: nbgrader submit", out)
        assert f"Submitted as: {settings.COURSE_ID} {CH01}" in out, out

    # 3b. what an account can do in the exchange by hand: a folder claiming to be ada's (later than
    # hers, with bob's unfinished notebook), one of bob's own named before anyone's, and one of eve's,
    # who is not on the roster; a learner cannot move another's folder (inbound/ is sticky)
    impostors = []
    if m.real_accounts:
        genuine = {p.name.split("+")[0]: p for p in inbound.iterdir()}
        # bob's copy of what he submitted, as nbgrader keeps it for him (its submission secret included)
        (bob_cached,) = (m.learners["bob"].home / ".local/share/jupyter/nbgrader_cache" / settings.COURSE_ID).iterdir()
        later = _name_time(time.time() + 3600)
        impostors = [
            _plant(m, "bob", f"{ada}+{CH01}+{later}+planted", m.copy("bob") / "notebooks" / CH01, later),
            _plant(
                m,
                "bob",
                f"{bob}+{CH01}+2020-01-01 00:00:00.000000 UTC+early",
                bob_cached,
                "2020-01-01 00:00:00.000000 UTC",
            ),
            _plant(m, "eve", f"{eve}+{CH01}+{later}+offroster", m.copy("eve") / "notebooks" / CH01, later),
        ]
        code, out = m.learners["bob"].run("mv", str(genuine[ada]), str(inbound / "moved"), cwd=m.copy("bob"), ok=False)
        assert code != 0 and genuine[ada].exists(), out

    # 4. collect: each learner's own newest folder; the others named, one line each, and left out
    out = m.teach("nbgrader", "collect", CH01)
    if m.real_accounts:
        assert_clean("nbgrader collect", out, allowed=("[CollectApp | WARNING] ",))
        warned = [line.split("] ", 1)[1] for line in out.splitlines() if "[CollectApp | WARNING]" in line]
        made = warned[1].rsplit(" at ", 1)[-1] if len(warned) > 1 else "?"  # when bob made his "early" folder
        assert warned == [
            f"left out: inbound/{impostors[0].name} claims to be {ada}'s but belongs to {bob}",
            f"inbound/{impostors[1].name}: its name says 2020-01-01 00:00:00 UTC but it was made or last changed "
            f"at {made}: collected as handed in at {made}",
            f"left out: inbound/{impostors[2].name} (owner {eve}) names {eve}, who is not on the roster",
            "left out: 2 folder(s) above; each learner's own newest submission is collected "
            "(docs/INSTRUCTORS.md, section 4, says how to take a planted folder out of the exchange)",
        ], out
        assert "cheating attempt?" not in out and not (m.course / "submitted" / eve).exists()
        stamp = (m.course / "submitted" / bob / CH01 / "timestamp.txt").read_text()
        assert not stamp.startswith("2020") and stamp.startswith(time.strftime("%Y-", time.gmtime())), stamp
    else:  # nbgrader checks who owns a submission: simulated learners are the instructor's own uid
        assert_clean("nbgrader collect", out, allowed=("[CollectApp | WARNING] ",))
        assert out.count("claims to be") == 2 and "left out" in out, out
        out = m.teach("nbgrader", "collect", CH01, "--CollectApp.check_owner=False")
        assert_clean("nbgrader collect --CollectApp.check_owner=False", out)
    for student in (ada, bob):
        assert (m.course / "submitted" / student / CH01 / "timestamp.txt").exists()
    assert _nb(m.course / "submitted" / ada / CH01 / f"{CH01}.ipynb")["cells"] == handed_in["ada"]["cells"]

    # dee hands chapter 01 in by hand (by e-mail): her notebook and when it came, no submission secret
    folder = m.course / "submitted" / dee / CH01
    folder.mkdir(parents=True)
    (folder / f"{CH01}.ipynb").write_text(json.dumps(work(released, answers), indent=1))
    m.instructor.run("sh", "-c", f"date -u '+%Y-%m-%d %H:%M:%S UTC' > {folder / 'timestamp.txt'}", cwd=m.course)

    # 5. grade the class with `course grade`: two nodes' shares into one cache, then one run records it
    cache = m.base / "shared-cache"
    shares = {"1/2": 2, "2/2": 1}  # ada and dee, then bob (learners in order, every other one)
    for shard, count in shares.items():
        out = m.teach("course", "grade", CH01, f"--shard={shard}", f"--cache={cache}", "--no-record")
        assert_clean(f"course grade --shard {shard}", out)
        assert f"{CH01}: {count} graded into the cache (not recorded yet), 0 failed to run" in out, out
    assert len(list((cache / CH01).glob("*.json"))) == 2  # ada's and dee's answers are the same: graded once
    out = m.teach("course", "grade", CH01, f"--cache={cache}")
    assert len(list((cache / CH01).glob("*.json"))) == 2, "the recording run graded again instead of using the cache"
    assert_clean("course grade", out)
    assert f"{CH01}: 3 graded, 0 failed to run, 1 tampered" in out and "no timestamp.txt" not in out, out
    tampered = [line.strip() for line in out.splitlines() if "tampered: " in line]
    assert tampered == [
        f"tampered: {bob}: test cell check_with_retry edited "
        "(line 3 'public(\"with_retry\")' became 'print(\"all good\")'); graded as given",
        f"tampered: {bob}: test cell check_retry_test deleted; put back and graded",
    ], out
    task_points = points(CH01)
    full = sum(task_points.values())
    assert _gradebook_scores(m.course, CH01) == {ada: full, bob: task_points["is_retryable"], dee: full}

    # 6. chapter 03 by hand: notebooks and their time stamps put into submitted/
    released3 = _nb(m.course / "notebooks" / CH03 / f"{CH03}.ipynb")
    answers3 = solutions(CH03)
    by_hand = {
        ada: work(released3, answers3),
        bob: work(
            released3,
            {"create_order": SNOOP},
            edit={"setup_create_order": ("import Jsonb", "import Json as Jsonb")},
        ),
        dee: work(released, answers),  # chapter 01's notebook, in chapter 03's place
    }
    for student, nb in by_hand.items():
        folder = m.course / "submitted" / student / CH03
        folder.mkdir(parents=True)
        (folder / f"{CH03}.ipynb").write_text(json.dumps(nb, indent=1))
        # the docs: date -u '+%Y-%m-%d %H:%M:%S UTC' > submitted/<student>/<chapter>/timestamp.txt
        m.instructor.run("sh", "-c", f"date -u '+%Y-%m-%d %H:%M:%S UTC' > {folder / 'timestamp.txt'}", cwd=m.course)
    code, out = m.teach("nbgrader", "autograde", CH03, ok=False)
    assert code == 1, out  # one learner not graded: the command says so in its exit code
    wrong = (
        f"[AutogradeApp | ERROR] submitted/{dee}/{CH03}/{CH03}.ipynb: this is chapter 01's notebook, handed in as "
        f"{CH03}: not graded; the earlier grade, its time stamp and the autograded copy are kept"
    )
    assert_clean(
        "nbgrader autograde", out, allowed=("changed by the learner:", wrong, "not graded (see the lines above")
    )
    assert wrong in out.splitlines() and "Traceback" not in out, out
    changed = [line for line in out.splitlines() if "changed by the learner:" in line]
    assert changed == [
        f"[AutogradeApp | WARNING] changed by the learner: {bob}: locked cell setup_create_order edited "
        "(line 1 'from psycopg.types.json import Jsonb' became 'from psycopg.types.json import Json as Jsonb'); "
        "graded as given"
    ], out
    assert _gradebook_scores(m.course, CH03) == {ada: sum(points(CH03).values()), bob: 0.0}

    # 7. feedback: generated for everyone, holding no path of this machine, returned through the exchange
    assert_clean("nbgrader generate_feedback", m.teach("nbgrader", "generate_feedback", CH01))
    out = m.teach("nbgrader", "generate_feedback", CH03)
    listed = f"not graded, so their feedback says why: {dee} ({CH03}.ipynb: this is chapter 01's notebook, handed in as {CH03})"
    assert_clean("nbgrader generate_feedback", out, allowed=(listed,))
    assert f"[GenerateFeedbackApp | WARNING] {listed}" in out.splitlines(), out
    why = feedback_text(m.course / "feedback" / dee / CH03 / f"{CH03}.html")
    assert f"{CH03}: not graded" in why and "this is chapter 01's notebook, handed in as 03_idempotency" in why, why
    host = [str(REPO), str(m.base), str(Path(sys.prefix).resolve()), os.path.expanduser("~"), "/tmp/course-grade"]
    for page in (m.course / "feedback").rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        leaked = [path for path in host if path in text]
        assert not leaked, f"{page.relative_to(m.course)} shows {leaked}"
    snooped = feedback_text(m.course / "feedback" / bob / CH03 / f"{CH03}.html")
    assert "course code at course/kit/stats.py" in snooped, snooped[:3000]
    assert 'File "course/kit/stats.py", line' in snooped, "the traceback through the course's code is gone"

    for chapter, by_exchange in ((CH01, [ada, bob]), (CH03, [])):
        out = m.teach("nbgrader", "release_feedback", chapter)
        by_hand = sorted({ada, bob, dee} - set(by_exchange))
        listed = ", ".join(f"{s} (feedback/{s}/{chapter}/)" for s in by_hand)
        line = (
            "[ReleaseFeedbackApp | WARNING] not released (handed in by hand, not through the exchange, so there is "
            f"nothing of theirs to release it to; send them the file): {listed}"
        )
        assert_clean(f"nbgrader release_feedback {chapter}", out, allowed=(line,))
        assert line in out.splitlines() and out.count("Feedback released to:") == len(by_exchange), out
    for who, score in (("ada", 10.0), ("bob", task_points["is_retryable"])):
        out = m.as_learner(who, "fetch_feedback", CH01)
        assert_clean(f"{who}: nbgrader fetch_feedback", out)
        returned = list((m.copy(who) / CH01 / "feedback").glob(f"*/{CH01}.html"))
        assert len(returned) == 1, out
        assert f"{CH01} (Score: {score:.1f} / 10.0)" in feedback_text(returned[0])
    out = m.as_learner("cyd", "fetch_feedback", CH01)  # never submitted: nothing fetched, and no error
    assert_clean("cyd: nbgrader fetch_feedback", out)
    assert "Source: " in out and "Destination: " in out and not (m.copy("cyd") / CH01).exists(), out

    # 8. the export: assigned chapters only, a status and a time per submission, missing is not zero
    out = m.teach("nbgrader", "export")
    assert_clean("nbgrader export", out)
    assert "Exported 2 chapter(s) x 4 learner(s) to grades.csv: 5 graded, 2 missing, 1 not graded" in out, out
    with open(m.course / "grades.csv", newline="") as fh:
        rows = {(r["assignment"], r["student_id"]): r for r in csv.DictReader(fh)}
    assert {a for a, _ in rows} == {CH01, CH03}, f"{CH00} was never assigned, yet it is exported"
    assert set(rows) == {(a, s) for a in (CH01, CH03) for s in (ada, bob, cyd, dee)}, "eve is on no roster"
    for chapter in (CH01, CH03):
        missing = rows[(chapter, cyd)]
        assert (missing["status"], missing["score"], missing["timestamp"]) == ("missing", "", ""), missing
        assert missing["last_name"] == "Charisse" and missing["max_score"] == "10"
        for student in (ada, bob, dee):
            row = rows[(chapter, student)]
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row["timestamp"]), row
            assert row["duedate"] == "2030-01-15T17:00:00Z" and row["seconds_late"] in ("0", ""), row
            if (chapter, student) != (CH03, dee):
                assert row["status"] == "graded" and row["note"] == "", row
    assert rows[(CH01, ada)]["score"] == "10" and rows[(CH03, bob)]["score"] == "0"
    not_graded = rows[(CH03, dee)]
    assert (not_graded["status"], not_graded["score"]) == ("not graded", ""), not_graded
    assert not_graded["note"] == f"{CH03}.ipynb: this is chapter 01's notebook, handed in as {CH03}", not_graded
    assert not rows[(CH01, bob)]["timestamp"].startswith("2020"), "bob's forged time was exported"

    # 9. cyd, whose runtime folder bob made first, checks a chapter: one line names the folder, no traceback
    if m.real_accounts:
        notebook = m.copy("cyd") / "notebooks" / CH00 / f"{CH00}.ipynb"
        code, out = m.learners["cyd"].run(
            m.learners["cyd"].python, "-m", "course.kit.cli", "check", str(notebook), cwd=m.copy("cyd"), ok=False
        )
        assert code == 1 and "total: 0/2" in out and "Traceback" not in out, out  # the unfinished chapter: 0 points
        named = [line for line in out.splitlines() if str(squatted) in line]
        assert len(named) == 1 and f"belongs to uid {m.learners['bob'].uid}" in named[0], out
        assert "another account made it first" in named[0] and "sudo rm -r" in named[0], out
        assert not list(squatted.iterdir()), "cyd's servers used the folder bob made"

    # 10. nothing the class made would be committed
    subprocess.run(["git", "init", "-q", str(m.course)], check=True)
    status = subprocess.run(
        ["git", "-C", str(m.course), "status", "--porcelain", "--untracked-files=normal"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    untracked = {line[3:].strip().rstrip("/") for line in status.splitlines()}
    assert untracked == SOURCES, f"not git-ignored: {sorted(untracked - SOURCES)}"


# ----------------------------------------------------------------------------- configuration


def test_the_repository_config_leaves_an_accounts_exchange_alone(tmp_path, monkeypatch):
    """An account with no setting gets /srv/nbgrader/exchange; one with its own keeps it; nothing is written."""
    from traitlets.config.loader import PyFileConfigLoader

    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # the config puts the interpreter's bin first: undo after
    monkeypatch.delenv("JUPYTER_CONFIG_PATH", raising=False)
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "nothing-set"))
    before = sorted(p.name for p in REPO.iterdir())
    cfg = PyFileConfigLoader("nbgrader_config.py", path=str(REPO)).load_config()
    assert cfg.Exchange.root == settings.EXCHANGE == "/srv/nbgrader/exchange"
    cd = cfg.CourseDirectory
    assert (cd.root, cd.source_directory, cd.release_directory) == (str(REPO), "solutions", "notebooks")
    assert cd.course_id == settings.COURSE_ID
    assert cfg.OverwriteCells.add_missing_cells is True, "a deleted test cell would go ungraded"
    assert "autograder.nbgrader_plugin.RestoreLockedCells" in cfg.Autograde.sanitize_preprocessors
    assert cfg.ExportApp.plugin_class == "autograder.export.RegistrarExport"

    learner = tmp_path / "learner"
    _jupyter_config(learner, Path("/somewhere/else"))
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(learner / ".jupyter"))
    cfg = PyFileConfigLoader("nbgrader_config.py", path=str(REPO)).load_config()
    assert "root" not in cfg.get("Exchange", {}), "the repository's config overrides the learner's exchange"
    assert sorted(p.name for p in REPO.iterdir()) == before, "loading the config wrote into the repository"


def test_a_submission_cannot_bring_its_own_autograder(tmp_path):
    """autograde copies every other file of a submission next to the notebook, so an ``autograder/``
    package handed in beside a stub notebook could be imported instead of the course's. The config
    keeps such files out; this asks nbgrader's own file walk (the one autograde uses) what it would copy."""
    from nbgrader.utils import find_all_files
    from traitlets.config import Config

    cfg = Config()
    settings.apply(cfg, str(tmp_path))
    handed_in = tmp_path / "submitted" / "learner" / CH00
    for name in ("autograder/__init__.py", "course.py", "harness.cpython-311-x86_64-linux-gnu.so", "a.ipynb"):
        (handed_in / name).parent.mkdir(parents=True, exist_ok=True)
        (handed_in / name).write_text("def grade(*args): pass\n")
    copied = find_all_files(str(handed_in), list(cfg.CourseDirectory.ignore) + ["*.ipynb"])
    importable = [Path(f).relative_to(handed_in).as_posix() for f in copied if f.endswith((".py", ".so"))]
    assert not importable, f"autograde would copy {importable} next to the learner's notebook"


# ----------------------------------------------------------------------------- a failed step


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (the gradebook by its content, which SQLite may lay out anew)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink() or p.is_dir():
            continue
        rel = p.relative_to(root).as_posix()
        if p.name == "gradebook.db":
            with sqlite3.connect(p) as conn:
                out[rel] = "\n".join(conn.iterdump()).encode()
        else:
            out[rel] = p.read_bytes()
    return out


def _break(notebook: Path) -> None:
    """A source notebook mid-edit: a hidden-tests region opened and never closed."""
    nb = _nb(notebook)
    cell = next(c for c in nb["cells"] if _meta(c).get("grade"))
    cell["source"] = _src(cell).replace("### END HIDDEN TESTS", "")
    notebook.write_text(json.dumps(nb, indent=1))


def test_a_failed_step_leaves_the_course_as_it_was(tmp_path, monkeypatch):
    """Steps run without the venv active (only the command's own path), on a chapter mid-edit: each
    fails whole, says what to do, and leaves notebooks/ and gradebook.db as they were."""
    course = tmp_path / "workbook"
    _course_dir(course)
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": tempfile.gettempdir()}

    def run(*args: str) -> tuple[int, str]:
        proc = subprocess.run([str(VENV_BIN / args[0]), *args[1:]], cwd=course, env=env, capture_output=True, text=True)
        return proc.returncode, proc.stdout + proc.stderr

    source01 = course / "solutions" / CH01 / f"{CH01}.ipynb"
    kept = source01.read_bytes()
    _break(source01)
    untouched = _tree(course)

    code, out = run("course", "assign", CH01)
    assert code == 1 and f"run `course assign {CH01}` again" in out, out
    assert "(RuntimeError: No end hidden tests statement found). Nothing was changed" in out, out
    assert "Traceback" not in out, out
    assert _tree(course) == untouched and not (course / "gradebook.db").exists()

    code, out = run("course", "grade", CH01)
    assert code == 2 and f"run `course assign {CH01}` first" in out, out
    assert _tree(course) == untouched

    # the gradebook made by a command run without the venv active is whole (alembic found)
    code, out = run("course", "assign", CH03)
    assert code == 0, out
    monkeypatch.setenv("PATH", os.environ.get("PATH", ""))  # course assign puts the venv's bin on PATH: undo after
    with sqlite3.connect(course / "gradebook.db") as conn:
        assert conn.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)

    # autograde that cannot grade (no servers) takes back the submission it recorded
    from nbgrader.api import Gradebook

    from autograder import export

    with Gradebook(f"sqlite:///{course}/gradebook.db", settings.COURSE_ID) as gb:
        gb.add_student("ada")
    (course / "submitted" / "ada" / CH03).mkdir(parents=True)
    shutil.copy(course / "notebooks" / CH03 / f"{CH03}.ipynb", course / "submitted" / "ada" / CH03)
    recorded = _tree(course)
    env["COURSE_BACKEND"] = "env"  # and no REDIS_URL, DATABASE_URL
    code, out = run("nbgrader", "autograde", CH03)
    del env["COURSE_BACKEND"]
    assert code != 0 and "no live servers to grade with" in out and "course up --export" in out, out
    assert _tree(course) == recorded, "a failed autograde left a submission without grades"
    with Gradebook(f"sqlite:///{course}/gradebook.db", settings.COURSE_ID) as gb:
        assert [r["status"] for r in export.rows(gb, course) if r["student_id"] == "ada"] == ["not graded"]

    # the same command in this process from here on (no process start): nbgrader has written to the
    # gradebook by the time it fails, and the gradebook is put back
    from autograder import assign

    with pytest.raises(assign.AssignError, match="Nothing was changed"):
        assign.assign(course, [CH01])
    assert _tree(course) == recorded, "a failed `course assign` changed the course"

    source01.write_bytes(kept)
    stale = course / "notebooks" / CH01 / f"{CH01}.ipynb"
    stale.write_text(stale.read_text().replace("not done yet", "not done"))
    recorded = _tree(course)
    with pytest.raises(assign.AssignError, match=r"run `make release`, review `git diff notebooks/`"):
        assign.assign(course, [CH01])
    assert _tree(course) == recorded


def test_a_failed_release_writes_nothing(tmp_path, capsys):
    """``make release`` generates every chapter before it writes a file: one chapter mid-edit, nothing written."""
    from autograder import release

    root = tmp_path / "repo"
    for chapter in (CH03, CH01):
        shutil.copytree(REPO / "solutions" / chapter, root / "solutions" / chapter)
        shutil.copytree(REPO / "notebooks" / chapter, root / "notebooks" / chapter)
    shutil.copytree(REPO / "autograder" / "manifests", root / "autograder" / "manifests")
    (root / "autograder" / "manifests" / f"{CH03}.json").write_text("{}\n")  # out of date: must stay so
    _break(root / "solutions" / CH01 / f"{CH01}.ipynb")
    untouched = _tree(root)

    assert release.main([CH03, CH01], root=root) == 1
    err = capsys.readouterr().err
    assert f"could not generate {CH01} (RuntimeError: No end hidden tests statement found)" in err, err
    assert "Nothing was written" in err and "run `make release` again" in err, err
    assert _tree(root) == untouched
