"""Helpers for writing chapter notebooks in nbgrader's source format.

``solutions/NN_slug/NN_slug.ipynb`` is the one hand-edited copy of a chapter. These
helpers make cells with the right nbgrader metadata, so a chapter author can start a
notebook from a script once and then edit the notebook itself (in JupyterLab or with
``nbformat``). Conventions the tests enforce:

- an answer cell is a solution cell whose grade_id is the task id (``with_retry``) and
  whose solution lies between ``### BEGIN SOLUTION`` and ``### END SOLUTION``;
- its graded test cell has grade_id ``check_<task>``, holds the points, shows a visible
  ``public("<task>")`` call and hides ``grade("<task>")`` between
  ``### BEGIN HIDDEN TESTS`` / ``### END HIDDEN TESTS``;
- the notebook's metadata says ``{"course": {"chapter": "NN_slug"}}``.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def _meta(grade_id: str, *, grade: bool, solution: bool, locked: bool, points: float | None = None) -> dict:
    meta = {
        "grade": grade,
        "grade_id": grade_id,
        "locked": locked,
        "schema_version": 3,
        "solution": solution,
        "task": False,
    }
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


def locked(grade_id: str, text: str, *, markdown: bool = False):
    """A cell learners cannot edit in nbgrader's tools (setup code, instructions)."""
    cell = md(text) if markdown else code(text)
    cell.metadata.update(_meta(grade_id, grade=False, solution=False, locked=True))
    return cell


def answer(task_id: str, text: str):
    """The learner's answer cell; the solution region is replaced by a stub on release."""
    if "### BEGIN SOLUTION" not in text:
        raise ValueError(f"answer cell {task_id!r} has no ### BEGIN SOLUTION region")
    cell = code(text)
    cell.metadata.update(_meta(task_id, grade=False, solution=True, locked=False))
    return cell


def tests(task_id: str, points: float, *, visible: bool = True):
    """The graded test cell of ``task_id``: a public check and the hidden grading call."""
    lines = ["from autograder import grade, public", ""]
    if visible:
        lines.append(f'public("{task_id}")')
    lines += ["### BEGIN HIDDEN TESTS", f'grade("{task_id}")', "### END HIDDEN TESTS"]
    cell = code("\n".join(lines))
    cell.metadata.update(_meta(f"check_{task_id}", grade=True, solution=False, locked=True, points=points))
    return cell


def notebook(chapter: str, cells: list) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata.update(
        {
            "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
            "course": {"chapter": chapter},
        }
    )
    return nb


def write(nb: nbformat.NotebookNode, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for index, cell in enumerate(nb.cells):
        cell["id"] = f"c{index:03d}"
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return path
