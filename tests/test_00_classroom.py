"""`course grade`: a class graded in parallel gets exactly the grades of one-at-a-time grading.

Six submissions of chapter 00 (full marks twice, the stub, a lost-update bug, a tampered
grader, a correct variant) are graded all at once with `course grade` into a real nbgrader
gradebook. The two kinds whose grade depends on concurrency (the lost update, the pipelined
variant) are also graded one at a time with `course check`; every score must match the
one-at-a-time grade of its kind (the others' grades are fixed: 2, 0 and 0), each student
appears once in the gradebook, and the tampered one is named in the summary.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import check, classroom, settings

REPO = Path(__file__).resolve().parent.parent
CHAPTER = "00_setup_and_tour"

LOST_UPDATE = """
async def count_visit(redis, pool, page: str) -> int:
    count = int(await redis.get(f"visits:{page}") or 0) + 1
    await redis.set(f"visits:{page}", count)
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return count
"""
TAMPERED = """
import autograder.harness as _h
_h.Report.expect = lambda self, cond, *a, **k: True
async def count_visit(redis, pool, page: str) -> int:
    return 1
"""
CORRECT_PIPELINE = """
async def count_visit(redis, pool, page: str) -> int:
    async with redis.pipeline(transaction=True) as pipe:
        count, _ = await pipe.incr(f"visits:{page}").expire(f"visits:{page}", 3600).execute()
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return int(count)
"""
KINDS = {"full": None, "stub": "STUB", "lost": LOST_UPDATE, "tamper": TAMPERED, "pipeline": CORRECT_PIPELINE}


def _notebook(kind: str) -> dict:
    folder = "notebooks" if kind == "stub" else "solutions"
    nb = json.loads((REPO / folder / CHAPTER / f"{CHAPTER}.ipynb").read_text())
    if KINDS[kind] not in (None, "STUB"):
        for cell in nb["cells"]:
            if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "count_visit":
                cell["source"] = KINDS[kind]
    return nb


@pytest.fixture(scope="module")
def course_root(tmp_path_factory):
    """A throwaway course: the chapter's source, its gradebook, and six submissions."""
    root = tmp_path_factory.mktemp("class")
    settings.write_config(root)
    shutil.copytree(REPO / "solutions" / CHAPTER, root / "solutions" / CHAPTER)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(
        [sys.executable, "-m", "nbgrader", "generate_assignment", CHAPTER, "--force"],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
    )
    for i, kind in enumerate([*KINDS, "full"]):
        folder = root / "submitted" / f"learner{i:02d}-{kind}" / CHAPTER
        folder.mkdir(parents=True)
        (folder / f"{CHAPTER}.ipynb").write_text(json.dumps(_notebook(kind)))
    return root


@pytest.mark.slow
def test_parallel_grading_matches_one_at_a_time(course_root):
    found = classroom.submissions(course_root, CHAPTER)
    assert len(found) == 6
    one_each = {student.split("-")[1]: path for student, path in sorted(found.items())}
    by_kind = {"full": 2, "stub": 0, "tamper": 0} | {k: check.check(one_each[k]).score for k in ("lost", "pipeline")}
    sequential = {student: by_kind[student.split("-")[1]] for student in found}

    summary = classroom.grade_all(course_root, CHAPTER, jobs=2)
    assert not summary.failed, summary.text()
    assert sorted(summary.graded) == sorted(found)

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course_root}/gradebook.db") as gb:
        recorded = {s.student.id: s.score for s in gb.assignment_submissions(CHAPTER)}
    assert recorded == sequential, summary.text()
    expected = {"full": 2, "stub": 0, "lost": 0, "tamper": 0, "pipeline": 2}
    assert all(score == expected[student.split("-")[1]] for student, score in recorded.items()), recorded
    # the learner's code runs in a process of its own: replacing Report.expect there changes nothing the
    # grader reads (0 points, as its code deserves), and the import of the grader is flagged for a reader
    assert not summary.tampered, summary.text()
    assert sorted(summary.flagged) == sorted(s for s in found if s.endswith("tamper")), summary.text()
    assert "imports autograder (the grader itself)" in summary.text()
