"""`course check`: exit codes, bad input, and code that hangs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import notebook_with_answers, servers_env

REPO = Path(__file__).resolve().parent.parent
CH00 = REPO / "solutions" / "00_setup_and_tour" / "00_setup_and_tour.ipynb"


def course(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "course.kit.cli", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=600
    )


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.ipynb", None, "no such file"),
        ("notes.txt", "hello", "not a notebook"),
        ("broken.ipynb", '{"cells": [', "broken JSON at line 1"),
        ("list.ipynb", "[1, 2]", "not a notebook"),
        (
            "stranger.ipynb",
            json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}),
            "known chapter",
        ),
    ],
)
def test_bad_input_is_exit_2_with_one_line_and_no_traceback(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    proc = course("check", str(path))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_folder_is_bad_input(tmp_path):
    proc = course("check", str(tmp_path))
    assert proc.returncode == 2 and "is a folder" in proc.stderr


@pytest.mark.slow
def test_a_cell_that_swallows_the_interrupt_is_cut_and_graded_zero(tmp_path):
    hang = """
        import time
        async def count_visit(redis, pool, page):
            return 1

        while True:
            try:
                time.sleep(10)
            except:
                pass
    """
    path = notebook_with_answers("00_setup_and_tour", {"count_visit": hang}, tmp_path)
    env = servers_env(COURSE_CELL_TIMEOUT="2")
    proc = course("check", str(path), "--json", env=env)
    assert proc.returncode == 1, proc.stderr
    result = json.loads(proc.stdout)
    assert result["score"] == 0 and result["tasks"][0]["id"] == "count_visit"
    assert "not defined" in result["tasks"][0]["feedback"]


def _released(chapter: str) -> dict:
    return json.loads((REPO / "notebooks" / chapter / f"{chapter}.ipynb").read_text())


def test_a_notebook_of_another_chapter_is_named_and_not_graded(tmp_path):
    """A file named after chapter 10 that holds chapter 03 is not graded as either."""
    path = tmp_path / "10_contention_and_money" / "10_contention_and_money.ipynb"
    path.parent.mkdir()
    path.write_text(json.dumps(_released("03_idempotency")))
    proc = course("check", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"course check: {path}: this is chapter 03's notebook, handed in as 10_contention_and_money: not graded"
    )
    assert proc.stdout == ""


def test_an_answer_cell_there_twice_is_named_and_not_graded(tmp_path):
    nb = _released("00_setup_and_tour")
    answer = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "count_visit")
    nb["cells"].append(json.loads(json.dumps(answer)))
    path = tmp_path / "00_setup_and_tour.ipynb"
    path.write_text(json.dumps(nb))
    proc = course("check", str(path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the answer cell count_visit is there 2 times" in proc.stderr and "Traceback" not in proc.stderr
