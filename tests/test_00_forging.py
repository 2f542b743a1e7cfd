"""Grades no learner can forge (issue 26): forging attempts, a planted cache, the reference answer.

Each attempt is an answer cell a determined learner might hand in: a correct answer (or the
stub) plus code that reaches for the grader's own objects, to sign full marks for itself. The
in-process guard (autograder/guard.py) refuses what that needs; the task earns nothing and its
feedback names the primitive. One grading process runs most attempts, one after another, each
in an answer cell of its own; the two variants of the issue (a frame walk, the garbage
collector) also go through `course check`, and a class with a forger and a flagged answer goes
through `course grade`, nbgrader's autograde and its gradebook.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
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

#: What a forger does with a frame: find the grader's emitter in some frame's locals, sign
#: full marks for every task of the chapter, end the process before the real checks report.
FORGE = """
import os as _os

def _forge(frame):
    while frame is not None:
        for name in ("emit", "put"):
            fn = frame.f_locals.get(name)
            if callable(fn):
                for task in ("count_visit", "create_order", "consume_payment_event"):
                    fn({"event": "task-start", "id": task})
                    fn({"event": "task", "id": task, "points": 10.0, "max_points": 10.0, "lines": ["  [ok] forged"],
                        "not_done": False, "seconds": 0.1, "tampered": None})
                fn({"event": "done"})
                _os._exit(0)
        frame = frame.f_back
"""

#: name -> (what the cell does after FORGE, the phrase its refusal names)
ATTEMPTS = {
    "a frame walk from sys._getframe": ("import sys\n_forge(sys._getframe())\n", "sys._getframe"),
    "the garbage collector": (
        "import gc\nfor o in gc.get_objects():\n    if getattr(o, '__name__', '') == 'emit': o({'event': 'done'})\n",
        "gc.get_objects",
    ),
    "gc.get_referrers": ("import gc\ngc.get_referrers(_forge)\n", "gc.get_referrers"),
    "every thread's frames": (
        "import sys\nfor f in sys._current_frames().values():\n    _forge(f)\n",
        "sys._current_frames",
    ),
    "a traceback's tb_frame": (
        "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    _forge(e.__traceback__.tb_frame)\n",
        ".tb_frame",
    ),
    "a running coroutine's cr_frame": (
        "import asyncio\nasync def _p():\n    return asyncio.current_task().get_coro().cr_frame\n_forge(await _p())\n",
        ".cr_frame",
    ),
    "a generator's gi_frame": ("def _g():\n    yield 1\n_forge(_g().gi_frame)\n", ".gi_frame"),
    "a frame taken by a C trampoline (no learner frame on the stack)": (
        "import asyncio, sys\n_out = []\nasyncio.get_running_loop().call_soon(_out.extend, map(sys._getframe, [0]))\n"
        "await asyncio.sleep(0)\nif _out:\n    _forge(_out[0])\n",
        "sys._getframe",
    ),
    "logging's frame helper called directly": ("import logging\n_forge(logging.currentframe())\n", "sys._getframe"),
    "traceback.walk_stack": (
        "import traceback\nfor f, _ in traceback.walk_stack(None):\n    _forge(f)\n",
        "sys._getframe",
    ),
    "a signal handler (it receives the interrupted frame)": (
        "import signal\nsignal.signal(signal.SIGALRM, lambda s, f: _forge(f))\nsignal.setitimer(signal.ITIMER_REAL, 0.01)\n",
        "signal.signal",
    ),
    "a profiler (it receives every frame)": (
        "import sys\nsys.setprofile(lambda f, e, a: _forge(f))\n",
        "sys.setprofile",
    ),
    "a tracer through threading": (
        "import threading\nthreading.settrace(lambda f, e, a: _forge(f))\n_t = threading.Thread(target=print)\n_t.start()\n_t.join()\n",
        "sys.settrace",
    ),
    "a second audit hook": ("import sys\nsys.addaudithook(lambda e, a: None)\n", "sys.addaudithook"),
    "ctypes": ("import ctypes\nctypes.string_at(id(_forge), 8)\n", "ctypes"),
    "/proc/self/mem": ("open('/proc/self/mem', 'rb')\n", "/proc/self/mem"),
    "the results descriptor opened by number": ("import sys\nopen(int(sys.argv[1]), 'w')\n", "results descriptor"),
    "code.replace": ("_forge.__code__.replace(co_filename='/x.py')\n", "code object"),
    "compile under a real file's name": ("compile('x = 1', '/course/kit/lab.py', 'exec')\n", "compiling code"),
    "a function built around logging's frame code": (
        "import logging, types\ntypes.FunctionType(logging.Logger.findCaller.__code__, {})\n",
        "a function built around",
    ),
    "os.kill of the grading process": ("import os, signal as _s\nos.kill(os.getpid(), _s.SIGTERM)\n", "os.kill"),
    # A fifth audit: the guard switched off from the module that holds it, then a frame walk.
    "the guard's own class patched, then a frame walk": (
        "import sys\nfrom autograder import guard as _g\n_g.Guard._judge = lambda *a: None\n_forge(sys._getframe())\n",
        "sys._getframe",
    ),
    "the guard's function code replaced": (
        "from autograder import guard as _g\n_g._proc_path.__code__ = (lambda p: False).__code__\n",
        "changing the grading guard",
    ),
    "the guard's lists emptied, then a frame walk": (
        "import sys\nfrom autograder import guard as _g\n_g._WATCHED = frozenset()\n_g.FRAME_ATTRS = frozenset()\n"
        "_forge(sys._getframe())\n",
        "sys._getframe",
    ),
    "the guard's state switched off, then a frame walk": (
        "import sys\nfrom autograder import guard as _g\n_s = vars(_g).get('_INSTALLED')\n"
        "if hasattr(_s, 'active'):\n    _s.active = False\n_forge(sys._getframe())\n",
        "sys._getframe",
    ),
    "/proc/self/mem through /proc/self/root": (
        "open('/proc/self/root/proc/self/mem', 'rb')\n",
        "memory or descriptors",
    ),
    "a symbolic link to /proc/self/mem": (
        "import os\nos.symlink('/proc/self/mem', 'mem-link')\nopen('mem-link', 'rb')\n",
        "a symbolic link to /proc/self/mem",
    ),
    "mem opened relative to a descriptor of /proc/self": (
        "import os\n_d = os.open('/proc/self', os.O_RDONLY)\nos.open('mem', os.O_RDONLY, dir_fd=_d)\n",
        "opening /proc/self",
    ),
    "mem opened relative to a descriptor of /": (
        "import os\n_d = os.open('/', os.O_RDONLY)\nos.open('proc/self/mem', os.O_RDONLY, dir_fd=_d)\n",
        "opening proc/self/mem",
    ),
}


def _attempt_cell(body: str) -> str:
    """The attempt as a learner writes it: errors swallowed, so only the guard's record tells."""
    indented = "\n".join("    " + line for line in body.splitlines())
    return FORGE + "try:\n" + indented + "\nexcept BaseException as _e:\n    print('caught', type(_e).__name__)\n"


@pytest.fixture(scope="module")
def attempt_runs() -> dict[str, dict]:
    """Every attempt as an answer cell of one grading process (chapter 00's setup first)."""
    trusted = grading.read_manifest(CH00)
    cells = [{"kind": "setup", "id": c["id"], "source": c["source"]} for c in trusted if c["kind"] == "setup"]
    cells += [{"kind": "answer", "id": name, "source": _attempt_cell(body)} for name, (body, _) in ATTEMPTS.items()]
    job = {"chapter": "00", "cells": cells, "tasks": [], "cell_timeout": 30}
    run = grading._run_once(job, settings.SANDBOX, 300)
    assert not any(e["event"] == "forged" for e in run.events), run.output
    assert any(e["event"] == "done" for e in run.events), (run.why, run.output[-2000:])
    return {e["id"]: e for e in run.events if e["event"] == "cell" and e["kind"] == "answer"}


@pytest.mark.parametrize("name", list(ATTEMPTS))
def test_every_forging_primitive_is_refused_and_named(attempt_runs, name):
    assert name in attempt_runs, f"the grading process never got to {name!r}"
    event = attempt_runs[name]
    assert ATTEMPTS[name][1] in (event["refused"] or ""), event


def _course_check(path: Path) -> dict:
    env = servers_env()
    proc = subprocess.run(
        [sys.executable, "-m", "autograder.check", str(path), "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_the_issues_frame_walk_earns_nothing_through_course_check(tmp_path):
    """The issue's attack on chapter 03: the stub left in place, full marks signed for every task."""
    nb = json.loads((REPO / "notebooks" / "03_idempotency" / "03_idempotency.ipynb").read_text())
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "create_order":
            cell["source"] = "".join(cell["source"]) + FORGE + "import sys\n_forge(sys._getframe())\n"
    path = tmp_path / "03_idempotency.ipynb"
    path.write_text(json.dumps(nb))
    result = _course_check(path)
    assert result["score"] == 0, result
    create = next(t for t in result["tasks"] if t["id"] == "create_order")
    assert "forging" in create["feedback"] and "sys._getframe" in create["feedback"], create
    assert "[FLAG] your instructor will read this answer" in create["feedback"], create


@pytest.mark.slow
def test_the_issues_gc_variant_earns_nothing_through_course_check(tmp_path):
    cell = GOOD + FORGE + "import gc\nfor o in gc.get_objects():\n    pass\n"
    result = _course_check(notebook_with_answers(CH00, {"count_visit": cell}, tmp_path))
    (task,) = result["tasks"]
    assert task["points"] == 0 and "gc.get_objects" in task["feedback"], task


def _grade00(answer: str) -> grading.TaskGrade:
    nb = json.loads((REPO / "solutions" / CH00 / f"{CH00}.ipynb").read_text())
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "count_visit":
            cell["source"] = answer
    (task,) = grading.grade(CH00, grading.read_manifest(CH00), nb).tasks
    return task


@pytest.mark.slow
def test_a_finalizer_that_forges_after_the_checks_earns_nothing():
    finalizer = (
        "import sys\nclass _Later:\n    def __init__(self):\n        self.me = self\n"
        "    def __del__(self):\n        _forge(sys._getframe())\n_Later()\n"
    )
    task = _grade00(GOOD + FORGE + finalizer)
    assert task.points == 0 and "sys._getframe" in task.text(), task.text()


@pytest.mark.slow
def test_writing_to_the_results_descriptor_then_exiting_earns_nothing():
    line = '{"body": {"event": "task", "id": "count_visit", "points": 2}, "mac": "0"}'
    task = _grade00(GOOD + f"import os, sys\nos.write(int(sys.argv[1]), b'{line}\\n')\nos._exit(0)\n")
    assert task.points == 0 and "something other than the grader wrote grading results" in task.text(), task.text()


@pytest.mark.slow
def test_rebinding_a_registered_check_changes_nothing():
    """The runner grades with its own copies of the tasks, taken before learner code runs."""
    task = _grade00(
        "from autograder import harness\nharness.REGISTRY['count_visit'].check = lambda r, f: None\n"
        "async def count_visit(redis, pool, page):\n    return 1\n"
    )
    assert task.points == 0 and "[FAIL]" in task.text(), task.text()  # the real check ran, and failed it
    assert task.flags and "autograder" in task.flags[0], task.flags


#: The harness's own Stop, found without importing the grader (nothing here is flagged).
STOP = """
def _find(name, module):
    todo, seen = [BaseException], set()
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            if c.__name__ == name and c.__module__ == module:
                return c
            todo.extend(vars(type)["__subclasses__"](c))

async def count_visit(redis, pool, page):
    raise _find("Stop", "autograder.harness")("nothing to see")
"""


@pytest.mark.slow
def test_raising_the_checks_own_stop_earns_nothing():
    """A Stop that no failed expectation raised once ended the checks as passed: 2/2, unflagged."""
    task = _grade00(STOP)
    assert task.points == 0 and "your code raised Stop" in task.text(), task.text()


#: A child process has no audit hook: it reads the grading process's memory for the key.
CHILD_READS_PARENT = """
import os, subprocess, sys
_child = "import sys\\ntry:\\n    open(f'/proc/{sys.argv[1]}/mem', 'rb').close()\\n    print('OPENED')\\nexcept OSError as e:\\n    print('DENIED', e)\\n"
print(subprocess.run([sys.executable, '-c', _child, str(os.getpid())], capture_output=True, text=True).stdout)
"""


@pytest.mark.slow
def test_a_child_process_cannot_read_the_grading_process_memory():
    nb = json.loads((REPO / "solutions" / CH00 / f"{CH00}.ipynb").read_text())
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "count_visit":
            cell["source"] = GOOD + CHILD_READS_PARENT
    graded = grading.grade(CH00, grading.read_manifest(CH00), nb)
    stdout = graded.cells["count_visit"].stdout
    assert "DENIED" in stdout and "OPENED" not in stdout, stdout
    assert graded.tasks[0].passed and graded.tasks[0].flags, graded.tasks[0].text()  # honest, but flagged


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
    (task,) = grading.grade(chapter, trusted, nb).tasks
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
    ],
    ids=["re-exported", "a two-line wrapper", "through the module", "hidden behind a computed name"],
)
def test_the_courses_reference_answer_earns_nothing(answer):
    task = _grade_one("13_leaderboard", "top_and_rank", answer)
    assert task.points == 0, task.text()
    assert "course.leaderboard.top_and_rank" in task.text(), task.text()


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


# ----------------------------------------------------------------------------- the run protocol


def _job() -> dict:
    return {
        "cells": [
            {"kind": "setup", "id": "s"},
            {"kind": "answer", "id": "a"},
            {"kind": "test", "id": "check_a", "task": "a"},
            {"kind": "answer", "id": "b"},
            {"kind": "test", "id": "check_b", "task": "b"},
        ]
    }


def _events(*items: tuple) -> list[dict]:
    out = []
    for kind, ident in items:
        key = "cell" if kind == "start" else "id"
        out.append({"event": kind, key: ident} if kind != "done" else {"event": "done"})
    return out


HONEST = [
    ("start", "s"),
    ("cell", "s"),
    ("start", "a"),
    ("cell", "a"),
    ("task-start", "a"),
    ("task", "a"),
    ("start", "b"),
    ("cell", "b"),
    ("task-start", "b"),
    ("task", "b"),
    ("done", ""),
]


def test_results_in_the_jobs_order_are_accepted():
    assert grading.protocol_errors(_job(), _events(*HONEST)) == {}
    cut = [e for e in HONEST if e != ("task", "a")]  # a task cut by an earlier run has no result
    assert grading.protocol_errors(_job(), _events(*cut)) == {}


@pytest.mark.parametrize(
    "events, broken, why",
    [
        (HONEST[:6] + [("task", "a")] + HONEST[6:], {"a", "b"}, "a second result for a"),
        (HONEST[:4] + [("task", "b")] + HONEST[4:], {"a", "b"}, "before its checks started"),
        (HONEST[:3] + [("task-start", "a"), ("task", "a")], {"a", "b"}, "out of the job's order"),
        (HONEST[:6] + [("done", ""), ("task-start", "b"), ("task", "b")], {"b"}, "out of the job's order"),
    ],
    ids=["a duplicate", "a result whose checks never started", "a task before its answer cell", "done too early"],
)
def test_results_out_of_protocol_earn_nothing(events, broken, why):
    found = grading.protocol_errors(_job(), _events(*events))
    assert set(found) == broken, found
    assert any(why in v for v in found.values()), found


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


@pytest.mark.slow
def test_forgers_and_flagged_answers_through_course_grade_and_nbgrader(tmp_path, monkeypatch):
    """`course grade` records through nbgrader's autograde: the forger earns nothing, the flagged
    answer keeps its points and is flagged in the gradebook (what formgrader shows) and the summary."""
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
        "forger": GOOD + FORGE + "import sys\ntry:\n    _forge(sys._getframe())\nexcept PermissionError:\n    pass\n",
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
    assert scores == {"forger": 0, "flagged": 2, "honest": 2}, summary.text()
    assert flagged == {"forger": True, "flagged": True, "honest": False}, flagged
    text = summary.text()
    assert "flagged (read it; graded as usual): flagged: count_visit: line" in text, text
    assert "tampered: forger: count_visit: refused: sys._getframe" in text, text
    assert "2 flagged" in text, text
