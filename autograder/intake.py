"""What a handed-in notebook must be before it is graded: the chapter it is handed in as, each graded cell once.

``course check``, ``course grade``, ``nbgrader autograde`` and ``nbgrader submit`` ask
:func:`problem` before anything is graded, deleted or recorded, and name what it finds in one
line. A notebook that fails here is **not graded** (never scored): the learner's earlier grade,
its time stamp and their autograded copy stay as they were, and their feedback says why
(:mod:`autograder.feedback`).

- **Another chapter's notebook** (the chapter is told by the answer and test cells it holds,
  whose ``grade_id`` names are unique across chapters): ``this is chapter 03's notebook, handed
  in as 10_contention_and_money``. Graded as it is, it would be graded as the chapter it was
  handed in as, every answer missing.
- **A graded cell without its** ``grade_id`` (metadata edited by hand): nbgrader cannot tell
  which cell it is (``KeyError: 'grade_id'``).
- **An answer or test cell twice** (a copied cell keeps its nbgrader metadata): nbgrader keeps
  the last copy and ``course check`` the first, so the two would grade different answers.
"""

from __future__ import annotations

import json
from pathlib import Path

from autograder import grading, health


def _kinds(chapter: str) -> dict[str, str]:
    """grade_id -> "answer" | "test" | "manual" for ``chapter``'s graded cells (from its manifest)."""
    return {c["id"]: c["kind"] for c in grading.read_manifest(chapter) if c["kind"] in ("answer", "test", "manual")}


def _marked(cell: dict) -> bool:
    meta = grading._nbgrader(cell)
    return bool(meta.get("solution") or meta.get("grade") or meta.get("locked"))


def _ids(nb: dict) -> set[str]:
    return {grading._grade_id(c) for c in nb.get("cells", []) if isinstance(c, dict) and _marked(c)} - {None}


def chapter_of(nb: dict) -> str | None:
    """The chapter whose graded cells ``nb`` holds most of; else the chapter its metadata names."""
    ids = _ids(nb)
    counts = {ch: len(ids & set(_kinds(ch))) for ch in grading.known_chapters()}
    best = max(counts, key=counts.get, default=None)
    if best is not None and counts[best]:
        return best
    meta = nb.get("metadata")
    course = meta.get("course") if isinstance(meta, dict) else None
    tagged = course.get("chapter") if isinstance(course, dict) else None
    return tagged if tagged in counts else None


def problem(nb: dict, chapter: str) -> str | None:
    """Why ``nb``, handed in as ``chapter``, cannot be graded as it; None when it can.

    ``nb`` is a notebook as JSON with a list of cells (:func:`autograder.health.broken_submission`
    first); ``chapter`` a chapter with a manifest.
    """
    kinds = _kinds(chapter)
    ids = _ids(nb)
    if kinds:
        found = chapter_of(nb)
        own = len(ids & set(kinds))
        if found not in (None, chapter) and len(ids & set(_kinds(found))) > own:
            return f"this is chapter {found[:2]}'s notebook, handed in as {chapter}"
        if not own:
            return (
                f"this notebook holds none of {chapter}'s answer or test cells (their nbgrader "
                f"metadata is gone): it is not the notebook handed out as {chapter}"
            )
    cells = nb.get("cells", [])
    for index, cell in enumerate(cells, 1):
        if isinstance(cell, dict) and _marked(cell) and not grading._grade_id(cell):
            return (
                f"cell {index} is marked for grading but has no grade_id (its nbgrader metadata was "
                "edited): nobody can tell which of the chapter's cells it is"
            )
    where: dict[str, list[int]] = {}
    for index, cell in enumerate(cells, 1):
        meta = grading._nbgrader(cell) if isinstance(cell, dict) else {}
        gid = grading._grade_id(cell) if isinstance(cell, dict) else None
        if gid and (meta.get("solution") or meta.get("grade")):
            where.setdefault(gid, []).append(index)
    for gid, indexes in where.items():
        if len(indexes) > 1:
            kind = {"test": "test cell", "manual": "answer cell"}.get(kinds.get(gid, ""), "answer cell")
            shown = ", ".join(map(str, indexes[:-1])) + f" and {indexes[-1]}"
            return (
                f"the {kind} {gid} is there {len(indexes)} times (cells {shown}): a copied cell keeps its "
                "grading metadata; delete the copies, keeping the one with your answer"
            )
    return None


def handed_in_as(path: Path) -> str | None:
    """The chapter a file's name says it is (``NN_slug.ipynb``, or in a ``NN_slug/`` folder), if any."""
    known = set(grading.known_chapters())
    path = Path(path)
    for name in (path.stem, path.parent.name):
        if name in known:
            return name
    return None


def refusal(path: Path, chapter: str) -> str | None:
    """Why the file at ``path``, handed in as ``chapter``, is not graded (one line naming it), or None.

    Not a notebook at all (:func:`autograder.health.broken_submission`), or one that
    :func:`problem` refuses.
    """
    why = health.broken_submission(path)
    if why:
        return why
    found = problem(json.loads(Path(path).read_text(encoding="utf-8")), chapter)
    return f"{path}: {found}" if found else None
