"""Grades cannot be faked: answer cells that tamper with the grader earn nothing for their task.

Each case is a chapter 00 answer cell a dishonest learner might hand in: the stub left in
place (or a wrong answer) plus a patch of the grader. Graded the way `course check` and
nbgrader's autograde grade (autograder.grading.grade), every one scores zero and the
feedback names what was patched; the honest answer keeps full marks, and patches made
outside answer cells (in the learner's kernel) never reach the grade.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autograder import grading, settings

REPO = Path(__file__).resolve().parent.parent
CHAPTER = "00_setup_and_tour"
STUB = '\nasync def count_visit(redis, pool, page: str) -> int:\n    raise NotImplementedError("not done yet")\n'
WRONG = "\nasync def count_visit(redis, pool, page: str) -> int:\n    return 1\n"

CHEATS = {
    "the issue's own example: grade and public replaced": (
        "import autograder, autograder.harness as _h\n"
        'def _ok(*a, **k): print("public checks passed; hidden checks run at grading")\n'
        "autograder.grade = _ok; autograder.public = _ok; _h.grade = _ok; _h.public = _ok\n" + STUB,
        "autograder.harness.grade was replaced",
    ),
    "the harness's run_task replaced": (
        "import autograder.harness as h\n"
        "_real = h.run_task\n"
        "def run_task(t, ns, **kw):\n"
        "    res = _real(t, ns, **kw)\n"
        "    res.points = res.max_points\n"
        "    return res\n"
        "h.run_task = run_task\n" + WRONG,
        "autograder.harness.run_task was replaced",
    ),
    "Report.expect made to pass everything": (
        "from autograder.harness import Report\nReport.expect = lambda self, cond, *a, **k: True\n" + WRONG,
        "Report.expect was replaced",
    ),
    "Report.fail made harmless": (
        "import autograder.harness as h\nh.Report.fail = lambda self, *a, **k: None\n" + WRONG,
        "Report.fail was replaced",
    ),
    "a method's code swapped": (
        "import autograder.harness as h\n"
        "def _quiet(self, msg, *, stop=True): self.lines.append(msg)\n"
        "h.Report.fail.__code__ = _quiet.__code__\n" + WRONG,
        "Report.fail.__code__ was replaced",
    ),
    "the harness module swapped in sys.modules": (
        "import sys, types\nfake = types.ModuleType('autograder.harness')\n"
        "sys.modules['autograder.harness'] = fake\n" + WRONG,
        "sys.modules['autograder.harness'] was replaced",
    ),
    "a builtin replaced": (
        "import builtins\nbuiltins.sorted = lambda xs, **k: list(range(2, 21))\n" + WRONG,
        "builtins.sorted was replaced",
    ),
    "the chapter's check replaced": (
        "import autograder.checks.ch00 as c\n"
        "async def fine(r, count_visit):\n    r.ok('all good')\n"
        "c.check_count_visit = fine\n"
        "import autograder.harness as h\n"
        "h.REGISTRY['count_visit'].check = fine\n" + WRONG,
        "check_count_visit was replaced",
    ),
    "the virtual clock replaced": (
        "import course.kit.faults as f\nclass VirtualClock(f.VirtualClock):\n    pass\nf.VirtualClock = VirtualClock\n"
        + WRONG,
        "course.kit.faults.VirtualClock was replaced",
    ),
    "the random source replaced": (
        "import random\nclass Rigged(random.Random):\n    def random(self): return 0.0\nrandom.Random = Rigged\n"
        + WRONG,
        "random.Random was replaced",
    ),
    "a harness class gains a method": (
        "import autograder.harness as h\n"
        "def __getattribute__(self, name):\n    return object.__getattribute__(self, name)\n"
        "h.Report.__getattribute__ = __getattribute__\n" + WRONG,
        "Report gained __getattribute__",
    ),
}


def _grade(answer: str | None, extra_cells: list[dict] | None = None) -> grading.Graded:
    nb = json.loads((REPO / "solutions" / CHAPTER / f"{CHAPTER}.ipynb").read_text())
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "count_visit" and answer is not None:
            cell["source"] = answer
    nb["cells"] = (extra_cells or []) + nb["cells"]
    return grading.grade(CHAPTER, grading.read_manifest(CHAPTER), nb)


@pytest.fixture(scope="module")
def cheat_runs() -> dict[str, dict]:
    """Every cheat as an answer cell of one grading process, one after another (each is undone)."""
    trusted = grading.read_manifest(CHAPTER)
    setup = [c for c in trusted if c["kind"] == "setup"]
    cells = [{"kind": "setup", "id": c["id"], "source": c["source"]} for c in setup]
    cells += [{"kind": "answer", "id": name, "source": source} for name, (source, _) in CHEATS.items()]
    job = {"chapter": "00", "cells": cells, "tasks": [], "cell_timeout": 30}
    run = grading._run_once(job, settings.SANDBOX, 120)
    return {e["id"]: e for e in run.events if e["event"] == "cell" and e["kind"] == "answer"}


@pytest.mark.parametrize("name", list(CHEATS))
def test_every_kind_of_patch_is_found_and_named(cheat_runs, name):
    assert name in cheat_runs, f"the grading process never got to {name!r}"
    assert CHEATS[name][1] in (cheat_runs[name]["tampered"] or ""), cheat_runs[name]


@pytest.mark.parametrize(
    "name",
    [
        "the issue's own example: grade and public replaced",
        "Report.expect made to pass everything",
        "a builtin replaced",
    ],
)
def test_a_tampering_answer_scores_zero_and_is_named(name):
    source, named = CHEATS[name]
    graded = _grade(source)
    (task,) = graded.tasks
    assert task.points == 0 and task.status == "tampered", task.text()
    assert named in task.tampered, task.tampered
    assert "tampering" in task.text()


def test_the_honest_answer_keeps_full_marks():
    graded = _grade(None)
    assert graded.score == graded.max_score == 2, graded.tasks[0].text()
    assert not graded.tampered


def test_patches_outside_answer_cells_never_reach_the_grade():
    """A learner's own cell that rigs the grader in their kernel is simply not run while grading."""
    cheat = {
        "cell_type": "code",
        "metadata": {},
        "outputs": [],
        "execution_count": None,
        "source": CHEATS["the issue's own example: grade and public replaced"][0].replace(STUB, ""),
    }
    graded = _grade(WRONG, extra_cells=[cheat])
    assert graded.score == 0 and graded.tasks[0].status == "failed", graded.tasks[0].text()


def test_each_patch_is_undone_before_the_next_answer_runs(cheat_runs):
    """Every cheat ran after the ones before it were undone: each names only its own patch."""
    for name, event in cheat_runs.items():
        assert event["tampered"].count("was replaced") + event["tampered"].count("gained") <= 4, (name, event)
        others = [CHEATS[o][1] for o in CHEATS if o != name and CHEATS[o][1] not in CHEATS[name][1]]
        assert not any(other in event["tampered"] for other in others), (name, event["tampered"])
