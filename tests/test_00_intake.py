"""What a handed-in notebook must be before it is graded (autograder/intake.py): read, nothing run."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from autograder import grading, intake

REPO = Path(__file__).resolve().parent.parent
CH03, CH10 = "03_idempotency", "10_contention_and_money"


def _nb(folder: str, chapter: str) -> dict:
    return json.loads((REPO / folder / chapter / f"{chapter}.ipynb").read_text())


def _cell(nb: dict, grade_id: str) -> dict:
    return next(c for c in nb["cells"] if grading._grade_id(c) == grade_id)


@pytest.mark.parametrize("folder", ["solutions", "notebooks"])
def test_every_chapter_as_handed_out_and_as_solved_is_taken(folder):
    for chapter in grading.known_chapters():
        assert intake.problem(_nb(folder, chapter), chapter) is None, chapter


def test_another_chapters_notebook_is_named_with_the_chapter_it_is():
    why = intake.problem(_nb("notebooks", CH03), CH10)
    assert why == "this is chapter 03's notebook, handed in as 10_contention_and_money"


def test_a_notebook_with_one_cell_pasted_from_another_chapter_is_still_its_own():
    nb = _nb("solutions", CH03)
    nb["cells"].append(copy.deepcopy(_cell(_nb("solutions", CH10), "buy")))
    assert intake.problem(nb, CH03) is None


def test_a_notebook_without_the_chapters_graded_cells_is_not_graded():
    nb = _nb("solutions", CH03)
    for cell in nb["cells"]:
        cell["metadata"].pop("nbgrader", None)
    assert "holds none of 03_idempotency's answer or test cells" in intake.problem(nb, CH03)


def test_a_graded_cell_without_its_grade_id_is_named_by_its_place():
    nb = _nb("notebooks", CH03)
    del _cell(nb, "check_create_order")["metadata"]["nbgrader"]["grade_id"]
    place = next(i for i, c in enumerate(nb["cells"], 1) if c["metadata"].get("nbgrader", {}).get("grade") is True)
    why = intake.problem(nb, CH03)
    assert why.startswith(f"cell {place} is marked for grading but has no grade_id"), why


@pytest.mark.parametrize("grade_id, kind", [("create_order", "answer cell"), ("check_create_order", "test cell")])
def test_an_answer_or_test_cell_there_twice_is_named_with_both_places(grade_id, kind):
    nb = _nb("solutions", CH03)
    nb["cells"].append(copy.deepcopy(_cell(nb, grade_id)))
    places = [i for i, c in enumerate(nb["cells"], 1) if grading._grade_id(c) == grade_id]
    why = intake.problem(nb, CH03)
    assert why.startswith(f"the {kind} {grade_id} is there 2 times (cells {places[0]} and {places[1]})"), why


def test_a_locked_cell_there_twice_is_graded_as_usual():
    """Grading takes setup cells from the chapter's manifest, never from the notebook: a copied
    locked cell changes nothing (nbgrader strips the earlier copy's metadata and puts the source back)."""
    nb = _nb("solutions", CH03)
    nb["cells"].append(copy.deepcopy(_cell(nb, "setup")))
    assert intake.problem(nb, CH03) is None


def test_the_chapter_a_file_is_handed_in_as_comes_from_its_name_or_folder(tmp_path):
    assert intake.handed_in_as(tmp_path / CH10 / "copy.ipynb") == CH10
    assert intake.handed_in_as(tmp_path / f"{CH03}.ipynb") == CH03
    assert intake.handed_in_as(tmp_path / "mine.ipynb") is None


def test_refusal_names_the_file(tmp_path):
    path = tmp_path / f"{CH10}.ipynb"
    path.write_text(json.dumps(_nb("notebooks", CH03)))
    assert intake.refusal(path, CH10) == f"{path}: this is chapter 03's notebook, handed in as {CH10}"
    path.write_text('{"cells": [')
    assert "is not a notebook (broken JSON" in intake.refusal(path, CH10)
