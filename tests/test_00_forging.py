"""Grades no learner can forge (issues 26 and 40): the boundary, the servers, the reference answers.

Learner code runs in a sandboxed process of its own that holds nothing of the grader's (no check,
no job, no key, no privileged credential); the checks run in the grader's process and call it
across a socket (autograder/wire.py). Each attempt here is an answer cell a determined learner,
who has read the grader's source, might hand in: it looks for the grader's objects in its own
process, patches them, lies on the wire, or uses the servers it is given to run as the instructor
(superuser file access and shells in PostgreSQL, CONFIG/SAVE/MODULE in Redis) or to reach another
learner's run. Each earns what its answer earns (nothing for a wrong one), changes no other grade,
and leaves nothing behind on the grading machine. The attempts go through `course check`, the
grading function behind `course grade` and `nbgrader autograde`, and a class graded by nbgrader.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from autograder import flags, gradecache, grading, settings
from tests.helpers import notebook_with_answers, servers_env

REPO = Path(__file__).resolve().parent.parent
CH00 = "00_setup_and_tour"

GOOD = """
async def count_visit(redis, pool, page):
    count = await redis.incr(f"visits:{page}")
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return count
"""
WRONG = """
async def count_visit(redis, pool, page):
    count = int(await redis.get(f"visits:{page}") or 0) + 1
    await redis.set(f"visits:{page}", count)
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return count
"""


def _grade00(answer: str) -> grading.Graded:
    nb = json.loads((REPO / "solutions" / CH00 / f"{CH00}.ipynb").read_text())
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "count_visit":
            cell["source"] = answer
    return grading.grade(CH00, grading.read_manifest(CH00), nb, sandbox=settings.SANDBOX)


def _course_check(path: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "autograder.check", str(path), "--json"],
        capture_output=True,
        text=True,
        env=servers_env(),
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


# ----------------------------------------------------------------------------- nothing of the grader's

#: What a forger who read the grader's source looks for in its own process, and prints.
SEARCH = """
import gc, os, sys, threading
_found = []
for _o in gc.get_objects():
    try:
        _t = type(_o)
        if _t.__name__ in ("Report", "Task", "Session", "GraderPolicy", "RunPrivileges", "Gate") and "autograder" in _t.__module__:
            _found.append(_t.__name__)
        if isinstance(_o, dict) and "key" in _o and "cells" in _o and "chapter" in _o:
            _found.append("the job")
    except Exception:
        pass
for _name, _mod in list(sys.modules.items()):
    if _name.startswith("autograder.checks"):
        _found.append(_name)
try:
    import autograder.checks.ch00
    _found.append("the hidden checks import")
except ImportError:
    pass
from autograder import harness as _h
if _h.REGISTRY:
    _found.append("a registry of checks")
for _k, _v in os.environ.items():
    if "postgres@" in _v or "user=postgres" in _v or "password=postgres" in _v:
        _found.append("a superuser URL in " + _k)
for _pid in os.listdir("/proc"):
    if _pid.isdigit() and int(_pid) not in (os.getpid(), os.getppid()) and int(_pid) > 3:
        try:
            _cmd = open(f"/proc/{_pid}/cmdline", "rb").read()
            if b"autograder.runner" in _cmd or b"course" in _cmd and b"check" in _cmd:
                _found.append("the grading process " + _pid)
        except OSError:
            pass
print("FOUND", sorted(set(_found)))
"""


@pytest.mark.slow
def test_the_learners_process_holds_nothing_of_the_graders():
    graded = _grade00(GOOD + SEARCH)
    stdout = graded.cells["count_visit"].stdout
    assert "FOUND []" in stdout, stdout
    assert graded.tasks[0].passed, graded.tasks[0].text()  # an honest answer that looks around keeps its points


#: Attempts that change the grader in the learner's own process, with a wrong answer: it must stay wrong.
PATCHES = {
    "a check swapped in the registry": (
        "from autograder import harness\n"
        "harness.REGISTRY['count_visit'] = harness.Task('count_visit', '00', 2, lambda r, f: None, ('count_visit',), '')\n"
    ),
    "the report's expect made to pass": "import autograder.harness as _h\n_h.Report.expect = lambda self, c, *a, **k: True\n",
    "the harness patched, put back by a finalizer": (
        "import autograder.harness as _h\n_real = _h.Report.fail\n_h.Report.fail = lambda self, *a, **k: None\n"
        "class _Back:\n    def __del__(self):\n        _h.Report.fail = _real\n_b = _Back()\n_b.me = _b\n"
    ),
    "the check's own Stop raised": (
        "import autograder.harness as _h\n_real_cv = count_visit\n"
        "async def count_visit(redis, pool, page):\n    raise _h.Stop('nothing to see')\n"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PATCHES))
def test_patching_the_grader_in_the_learners_process_changes_nothing(name):
    task = _grade00(WRONG + PATCHES[name]).tasks[0]
    assert task.points == 0 and "[FAIL]" in task.text(), task.text()


@pytest.mark.slow
def test_garbage_on_the_wire_earns_nothing_and_breaks_no_grader():
    """The learner's end of the socket is its own: what it writes there is a broken protocol, no grade."""
    answer = GOOD + (
        "import os, sys, struct\n"
        "_fd = int(sys.argv[1])\n"
        '_msg = b\'{"op": "reply", "id": 1, "ok": 2}\'\n'
        "os.write(_fd, struct.pack('>I', len(_msg)) + _msg + b'not a frame at all')\n"
    )
    graded = _grade00(answer)
    task = graded.tasks[0]
    assert task.points == 0, task.text()
    assert "ended or stopped answering" in task.text() or "ended its process" in task.text(), task.text()


# ----------------------------------------------------------------------------- the servers

ESCAPES = """
import os
async def _try(pool, redis):
    out = []
    async with pool.connection() as conn:
        for sql in ("SELECT pg_read_file('/etc/hostname')",
                    "COPY (SELECT 1) TO PROGRAM 'touch {marker}-pg'",
                    "SELECT lo_export(lo_create(0), '{marker}-lo')",
                    "SET ROLE postgres"):
            try:
                await conn.execute(sql)
                out.append("PG ALLOWED " + sql)
            except Exception as e:
                out.append("PG REFUSED " + type(e).__name__)
    for cmd in (("CONFIG", "SET", "dir", "{folder}"), ("SAVE",), ("MODULE", "LOAD", "{marker}.so"),
                ("AUTH", "default", "x"), ("FLUSHALL",), ("SELECT", "0")):
        try:
            await redis.execute_command(*cmd)
            out.append("REDIS ALLOWED " + cmd[0])
        except Exception as e:
            out.append("REDIS REFUSED " + cmd[0])
    return out
import asyncio
for _line in await _try(pool, redis):
    print(_line)
"""


@pytest.mark.slow
def test_the_servers_give_learner_code_nothing_to_escape_with(tmp_path):
    marker = tmp_path / "owned"
    graded = _grade00(GOOD + ESCAPES.format(marker=marker, folder=tmp_path))
    stdout = graded.cells["count_visit"].stdout
    assert "ALLOWED" not in stdout and stdout.count("REFUSED") == 10, stdout
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written on the grading machine


@pytest.mark.slow
def test_a_learner_cannot_reach_another_learners_run():
    """Two runs at once: the second learner lists the databases and Redis logical databases, and tries
    the first one's; every door is shut, and the first learner's grade is its own."""
    reach = GOOD + (
        "import psycopg, os\n"
        "_found = []\n"
        "async with pool.connection() as _c:\n"
        "    _names = [r[0] for r in await (await _c.execute(\"SELECT datname FROM pg_database WHERE datname LIKE 'course_grade%'\")).fetchall()]\n"
        "_url = os.environ['DATABASE_URL']\n"
        "for _n in _names:\n"
        "    try:\n"
        "        await (await psycopg.AsyncConnection.connect(_url.replace(_url.split('@/')[1].split('?')[0], _n))).close()\n"
        "        _found.append(_n)\n"
        "    except Exception:\n"
        "        pass\n"
        "for _db in range(1, 64):\n"
        "    try:\n"
        "        await redis.execute_command('SELECT', _db)\n"
        "        _found.append(_db)\n"
        "    except Exception:\n"
        "        pass\n"
        "print('REACHED', len(_found))\n"
    )
    results = {}

    def one(name, answer):
        results[name] = _grade00(answer)

    threads = [threading.Thread(target=one, args=("honest", GOOD)), threading.Thread(target=one, args=("reach", reach))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    honest = results["honest"]
    assert honest.tasks[0].passed, (honest.tasks[0].text(), honest.notes, {k: c.error for k, c in honest.cells.items()})
    # its own database and its own logical database only (the one it is on, asked for again)
    assert "REACHED 2" in results["reach"].cells["count_visit"].stdout, results["reach"].cells["count_visit"].stdout


@pytest.mark.slow
def test_nothing_learner_code_starts_outlives_its_grading(tmp_path):
    marker = tmp_path / "still-here"
    answer = GOOD + (
        "import subprocess\n"
        f"subprocess.Popen(['sh', '-c', 'sleep 3; touch {marker}'], start_new_session=True)\n"
        f"open('{REPO}/planted.txt', 'w').write('x') if False else None\n"
    )
    graded = _grade00(answer)
    assert graded.tasks[0].passed, graded.tasks[0].text()
    import time

    time.sleep(4)
    assert not marker.exists(), "a process the answer started outlived its sandbox"
    out = subprocess.run(["pgrep", "-f", f"touch {marker}"], capture_output=True, text=True).stdout
    assert not out.strip(), out


@pytest.mark.parametrize(
    "damage",
    [
        lambda nb, cell: cell.__setitem__("metadata", {"nbgrader": "x"}),
        lambda nb, cell: cell.__setitem__("metadata", []),
        lambda nb, cell: cell.__setitem__("source", [1, 2]),
        lambda nb, cell: cell["metadata"]["nbgrader"].__setitem__("grade_id", ["count_visit"]),
        lambda nb, cell: nb["cells"].insert(0, "a cell that is a string"),
        lambda nb, cell: nb.__setitem__("metadata", []),
    ],
    ids=[
        "nbgrader metadata a string",
        "metadata a list",
        "source of numbers",
        "grade_id a list",
        "a string cell",
        "metadata of the notebook a list",
    ],
)
def test_a_hand_edited_notebook_is_graded_without_a_grader_traceback(damage, tmp_path):
    from autograder import check

    nb = json.loads((REPO / "notebooks" / CH00 / f"{CH00}.ipynb").read_text())
    answer = next(c for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "count_visit")
    damage(nb, answer)
    job = grading.build_job(CH00, grading.read_manifest(CH00), nb)
    assert [c["kind"] for c in job["cells"]].count("answer") == 1, job
    assert check.identify(tmp_path / f"{CH00}.ipynb", nb) == CH00
    grading.stale_setup(grading.read_manifest(CH00), nb)


# ----------------------------------------------------------------------------- the reference answer


def _grade_one(chapter: str, task_id: str, answer: str) -> grading.TaskGrade:
    """Grade one task of ``chapter`` (its setup cells, that answer, that test) with ``answer``."""
    trusted = [c for c in grading.read_manifest(chapter) if c["kind"] == "setup" or task_id in (c["id"], c.get("task"))]
    nb = json.loads((REPO / "solutions" / chapter / f"{chapter}.ipynb").read_text())
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == task_id:
            cell["source"] = answer
    (task,) = grading.grade(chapter, trusted, nb, sandbox=settings.SANDBOX).tasks
    return task


@pytest.mark.slow
@pytest.mark.parametrize(
    "answer",
    [
        "from course.leaderboard import top_and_rank\n",
        "from course.leaderboard import top_and_rank as _ref\n"
        "async def top_and_rank(r, n, player):\n    return await _ref(r, n, player)\n",
        "import course.leaderboard as lb\nasync def top_and_rank(r, n, player):\n    return await lb.top_and_rank(r, n, player)\n",
        "import importlib\n_impl = {}\n"
        "async def top_and_rank(r, n, player):\n"
        "    f = _impl.setdefault('f', getattr(importlib.import_module('course.leaderboard'), 'top_' + 'and_rank'))\n"
        "    return await f(r, n, player)\n",
        "import asyncio\nfrom course.leaderboard import top_and_rank as _ref\n"
        "async def top_and_rank(r, n, player):\n    return await asyncio.ensure_future(_ref(r, n, player))\n",
        "import asyncio\nfrom course.leaderboard import top_and_rank as _ref\n"
        "async def top_and_rank(r, n, player):\n    return (await asyncio.gather(_ref(r, n, player)))[0]\n",
        "import types\nfrom course.leaderboard import top_and_rank as _ref\n"
        "top_and_rank = types.FunctionType(_ref.__code__, _ref.__globals__)\n",
        "import inspect, course.leaderboard as lb\n_src = inspect.getsource(lb.top_and_rank)\nexec(_src)\n",
    ],
    ids=[
        "re-exported",
        "a two-line wrapper",
        "through the module",
        "hidden behind a computed name",
        "through the event loop",
        "through gather",
        "a copy of its code object",
        "its source, read and run",
    ],
)
def test_the_courses_reference_answer_is_not_there_to_call(answer):
    task = _grade_one("13_leaderboard", "top_and_rank", answer)
    assert task.points == 0, task.text()
    if "__code__" not in answer:  # a copy of the stub's code has lost its defaults: it fails before it raises
        assert "course.leaderboard.top_and_rank is the course's own answer" in task.text(), task.text()


@pytest.mark.slow
def test_another_course_module_that_calls_the_reference_does_not_reach_it():
    """Chapter 09's demo module calls chapter 09's reference paginator; in the sandbox that raises too."""
    answer = (
        "from course.chapters.ch09 import pages as _pages\n"
        "async def keyset_page(pool, cursor, limit):\n"
        "    return await _pages.posts_page(pool, cursor, limit, CURSOR_SECRET)\n"
    )
    task = _grade_one("09_data_access", "keyset_page", answer)
    # chapter 09's check also reads the cell and names the call; either way, no points and the reason
    assert task.points == 0 and "the course's own" in task.text(), task.text()


@pytest.mark.slow
def test_a_later_chapter_that_imports_an_earlier_pattern_keeps_its_points():
    """Chapter 12's resolve drives the course's CircuitBreaker (chapter 02's reference): that is no copying."""
    nb = json.loads((REPO / "solutions" / "12_url_shortener" / "12_url_shortener.ipynb").read_text())
    answer = next(
        "".join(c["source"])
        for c in nb["cells"]
        if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "resolve"
    )
    task = _grade_one("12_url_shortener", "resolve", answer)
    assert task.passed, task.text()


# ----------------------------------------------------------------------------- the cache


def _graded(points: float) -> grading.Graded:
    return grading.Graded("00_setup_and_tour", tasks=[grading.TaskGrade("count_visit", points, 2.0, status="passed")])


def test_a_planted_cache_entry_is_never_read_as_a_grade(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(grading, "grade", lambda *a, **k: calls.append(1) or _graded(0.0))
    nb = json.loads((REPO / "notebooks" / CH00 / f"{CH00}.ipynb").read_text())
    trusted = grading.read_manifest(CH00)
    cache = tmp_path / "state" / "grade-cache"
    key = gradecache.cache_key(grading.build_job(CH00, trusted, nb))
    gradecache.private_dir(cache.parent)
    gradecache.private_dir(cache)
    (cache / f"{key}.json").write_text(json.dumps({"key": key, "graded": _graded(15.0).to_json(), "mac": "0" * 64}))
    assert gradecache.cached_grade(cache, CH00, trusted, nb).score == 0 and calls == [1]
    assert gradecache.cached_grade(cache, CH00, trusted, nb).score == 0 and calls == [1], "the real entry is reused"
    entry = json.loads((cache / f"{key}.json").read_text())
    entry["graded"]["tasks"][0]["points"] = 2.0  # edited by hand: the HMAC no longer matches
    (cache / f"{key}.json").write_text(json.dumps(entry))
    assert gradecache.cached_grade(cache, CH00, trusted, nb).score == 0 and calls == [1, 1]
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700"
    assert oct(os.stat(cache / f"{key}.json").st_mode & 0o777) == "0o600"


def test_a_state_folder_open_to_others_is_refused(tmp_path):
    folder = tmp_path / "planted"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(grading.GradingError, match="open to other accounts"):
        gradecache.private_dir(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a folder of another account")
def test_a_state_folder_of_another_account_is_refused(tmp_path):
    folder = tmp_path / "planted"
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)
    with pytest.raises(grading.GradingError, match="belongs to"):
        gradecache.private_dir(folder)


def test_the_state_folder_is_the_grading_accounts_own(tmp_path, monkeypatch):
    monkeypatch.delenv("COURSE_GRADER_STATE", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    path = gradecache.grader_state_dir()
    assert path == tmp_path / "xdg" / "resilient-course" / "grader"
    assert os.stat(path).st_mode & 0o777 == 0o700 and not str(path).startswith("/tmp/resilient-course")


# ----------------------------------------------------------------------------- flags


def _answer_cells() -> list[tuple[str, str]]:
    found = []
    for nb_path in sorted((REPO / "solutions").glob("[0-9][0-9]_*/*.ipynb")):
        for cell in json.loads(nb_path.read_text())["cells"]:
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if cell["cell_type"] == "code" and meta.get("solution") and not meta.get("grade"):
                found.append((f"{nb_path.parent.name}:{meta['grade_id']}", "".join(cell["source"])))
    return found


def _accepted_sources() -> list[tuple[str, str]]:
    """Every kept correct answer in tests/test_NN_grading.py (CORRECT, or passed to assert_accepted)."""
    found = []
    for path in sorted((REPO / "tests").glob("test_[0-9][0-9]_grading.py")):
        tree = ast.parse(path.read_text())
        constants = {}
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants[target.id] = node.value.value
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "assert_accepted" and len(node.args) > 1:
                arg = node.args[1]
                if isinstance(arg, ast.Name) and arg.id in constants:
                    found.append((f"{path.name}:{arg.id}", constants[arg.id]))
                elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((f"{path.name}:{node.lineno}", arg.value))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CORRECT" for t in node.targets):
                try:
                    table = ast.literal_eval(node.value)
                except ValueError:
                    continue
                for task, variants in table.items():
                    for name, source in variants.items():
                        found.append((f"{path.name}:CORRECT[{task}][{name}]", source))
    return found


def test_ordinary_answers_are_never_flagged():
    sources = _answer_cells() + _accepted_sources()
    assert len(sources) > 30, len(sources)
    flagged = {name: flags.scan(src) for name, src in sources if flags.scan(src)}
    assert not flagged, flagged


def test_ordinary_modules_are_never_flagged():
    ordinary = (
        "asyncio psycopg redis json random math collections dataclasses time typing functools itertools "
        "hashlib hmac base64 uuid struct bisect heapq contextlib logging"
    ).split()
    source = "\n".join(f"import {m}" for m in ordinary) + "\nfrom collections import defaultdict\n"
    source += "log = logging.getLogger(__name__)\nlog.info('x')\nx = json.dumps({})\n"
    assert flags.scan(source) == []


@pytest.mark.parametrize(
    "source, phrase",
    [
        ("import sys\nf = sys._getframe()\n", "sys._getframe"),
        ("def f(): pass\nf.__closure__[0].cell_contents\n", "cell_contents"),
        ("import importlib\nimportlib.import_module('x')\n", "importlib"),
        ("import builtins\nbuiltins.print = None\n", "builtins"),
        ("getattr(obj, name)\n", "computed attribute name"),
        ("object.__subclasses__()\n", "__subclasses__"),
        ("fn.__globals__['x']\n", "__globals__"),
        ("open('/etc/passwd')\n", "outside the answer's folder"),
        ("open('../x')\n", "outside the answer's folder"),
        ("import subprocess\n", "spawning processes"),
        ("import os\nos.system('ls')\n", "os.system"),
        ("import traceback\ntraceback.FrameSummary = object\n", "rebinds traceback.FrameSummary"),
        ("exec('1')\n", "exec"),
    ],
)
def test_escape_and_introspection_primitives_are_flagged(source, phrase):
    found = flags.scan(source)
    assert any(phrase in line for line in found), found


# ----------------------------------------------------------------------------- nbgrader and course grade


FLAGGED_BUT_HONEST = GOOD + "import inspect\n_unused = inspect.isfunction\n"
SUPERUSER_READER = WRONG + (
    "try:\n"
    "    async with pool.connection() as _c:\n"
    "        await _c.execute(\"COPY (SELECT 1) TO PROGRAM 'id'\")\n"
    "except Exception as _e:\n"
    "    print('refused:', type(_e).__name__)\n"
)


@pytest.mark.slow
def test_forgers_and_flagged_answers_through_course_grade_and_nbgrader(tmp_path, monkeypatch):
    """`course grade` records through nbgrader's autograde: the forgers earn what their answers earn, the
    honest learners keep theirs, and the flagged answer keeps its points and is flagged in the gradebook."""
    from autograder import classroom

    monkeypatch.setenv("COURSE_GRADER_STATE", str(tmp_path / "state"))
    root = tmp_path / "class"
    root.mkdir()
    settings.write_config(root)
    shutil.copytree(REPO / "solutions" / CH00, root / "solutions" / CH00)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(
        [sys.executable, "-m", "nbgrader", "generate_assignment", CH00, "--force"],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
    )
    answers = {
        "patcher": WRONG + PATCHES["the report's expect made to pass"],
        "superuser": SUPERUSER_READER,
        "flagged": FLAGGED_BUT_HONEST,
        "honest": GOOD,
    }
    for student, answer in answers.items():
        folder = root / "submitted" / student / CH00
        folder.mkdir(parents=True)
        notebook_with_answers(CH00, {"count_visit": answer}, folder)
    summary = classroom.grade_all(root, CH00, jobs=1)
    assert not summary.failed, summary.text()

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{root}/gradebook.db") as gb:
        scores = {s.student.id: s.score for s in gb.assignment_submissions(CH00)}
        flagged = {s.student.id: s.notebooks[0].flagged for s in gb.assignment_submissions(CH00)}
    assert scores == {"patcher": 0, "superuser": 0, "flagged": 2, "honest": 2}, summary.text()
    assert flagged["flagged"] and flagged["patcher"] and not flagged["honest"], flagged
    assert "2 flagged" in summary.text() or "3 flagged" in summary.text(), summary.text()
