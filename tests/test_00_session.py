"""A grading run's processes get ready while the grader does (autograder/session.py, issue 40's time).

What a run does ahead, so `course check` is no slower than before the boundary: each learner process
imports what the setup cells import as it starts; the course's own objects leave the collector's reach
once the setup cell ran, before any learner cell; the processes a check will ask for with another
PYTHONHASHSEED (``FRESH_PROCESSES``) start once the setup cells ran; and the run's database is made
while the processes start. None of it may change what a learner cell sees.
"""

from __future__ import annotations

from autograder import grading
from autograder.session import Session, import_lines

CHAPTER = "09_data_access"


def test_import_lines_are_the_top_level_absolute_imports_once_each():
    cells = [
        "%matplotlib inline\nimport asyncio\nfrom course.kit import lab\nns = lab.current()\n",
        "import asyncio\nfrom . import nearby\ndef f():\n    import json\nimport hashlib, hmac\n",
        "this is not python (",
    ]
    assert import_lines(cells) == ["import asyncio", "from course.kit import lab", "import hashlib, hmac"]


def _setup_cells() -> list[dict]:
    return [c for c in grading.read_manifest(CHAPTER) if c["kind"] == "setup"]


def _printed(session: Session, cell_id: str, source: str) -> str:
    got = session.run_cell("answer", cell_id, source)
    assert got["ok"], got
    return got["stdout"].strip()


def test_a_run_gets_its_processes_ready_without_changing_what_a_cell_sees():
    setup = _setup_cells()
    with Session(CHAPTER, unsandboxed=True) as session:
        session.start([c["source"] for c in setup], ["keyset_page", "hash_ring"])
        session.wait_namespace()
        assert session.namespace.name in session.databases  # made, and the run's role may use it
        for cell in setup:
            session.run_cell("setup", cell["id"], cell["source"])

        # the setup cell's imports were there before it ran; its objects are out of the collector's reach
        frozen = int(_printed(session, "probe", "import gc, sys\nprint(gc.get_freeze_count())"))
        assert frozen > 10_000
        assert _printed(session, "probe2", "print('course.chapters.ch09' in sys.modules)") == "True"

        # a setup cell after a learner's cell freezes nothing more: the learner's objects stay collectable
        session.run_cell("setup", "late", "made_by_setup = [object() for _ in range(50_000)]")
        assert int(_printed(session, "probe3", "print(gc.get_freeze_count())")) <= frozen  # none of the 50,000

        # the processes of another hash seed hash_ring's check asks for were started after the setup cells,
        # and one asked for is one of them, brought up to date with every cell so far
        assert sorted(x.env["hashseed"] for x in session.ready) == [1, 2]
        started = {id(x) for x in session.ready}
        session.run_cell("answer", "seed", "import os\ndef hashseed():\n    return os.environ['PYTHONHASHSEED']")
        fresh = session.learner(900, {"hashseed": 1})
        assert id(fresh) in started and fresh.index == 900 and len(session.ready) == 1
        assert fresh.root.has("made_by_setup") and fresh.root.has("QUICK")
        assert fresh.root.get("hashseed")() == "1"
        assert session.learner(0).root.get("hashseed")() == "0"


def test_a_run_starts_no_extra_process_for_a_task_it_does_not_grade():
    with Session(CHAPTER, unsandboxed=True) as session:
        session.run_cell("answer", "keyset_page", "x = 1")  # grading keyset_page alone (the tests' grade_source)
        assert session.ready == [] and set(session.fresh_envs) == {"hash_ring"}
        session.run_cell("answer", "hash_ring", "y = 2")
        assert sorted(x.env["hashseed"] for x in session.ready) == [1, 2] and session.fresh_envs == {}
