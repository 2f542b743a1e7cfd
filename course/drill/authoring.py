"""For authors: give every new drill card its stable id, written into the chapter's source (chapter 14).

A card's id is written once, when the card is new, and never recomputed: rewording the question
keeps it. ``python -m course.drill ids`` lists the cards that have none; ``--write`` adds the
``<!-- card: ... -->`` line to each of them in ``solutions/`` (the only hand-edited notebooks;
``make release`` carries it to ``notebooks/``). The new id is :func:`course.drill.deck.new_id` of
the card as it reads today.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from course.drill.deck import _DETAILS, CARD_ID, REPO, _plain, chapter_notebooks, new_id, section_spans


def _item_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, first line) of each numbered item of a markdown list in ``text``."""
    spans, start, first, last_end, pos = [], None, "", 0, 0
    for line in text.splitlines(keepends=True):
        if re.match(r"^\d+\.\s", line):
            if start is not None:
                spans.append((start, last_end, first))
            start, first = pos, line
        elif start is not None and line.strip() and not line.startswith((" ", "\t")):
            spans.append((start, last_end, first))
            start = None
        if line.strip():
            last_end = pos + len(line)
        pos += len(line)
    if start is not None:
        spans.append((start, last_end, first))
    return spans


def _missing_in_cell(chapter: str, kind: str, text: str) -> list[tuple[int, str]]:
    """(offset, line to insert) for every card in this section text without an id."""
    inserts = []
    if kind == "mistake":
        for start, end, first in _item_spans(text):
            if CARD_ID.search(text[start:end]):
                continue
            item = re.sub(r"^\d+\.\s+", "", text[start:end])
            bold = re.match(r"\*\*(.+?)\*\*", item, re.S)
            front = bold.group(1) if bold else re.split(r"(?<=[.:])\s", item, maxsplit=1)[0]
            front = " ".join(front.split()).rstrip(".:")
            indent = " " * len(re.match(r"^\d+\.\s+", first).group(0))
            nl = "" if text[:end].endswith("\n") else "\n"
            inserts.append((end, f"{nl}{indent}<!-- card: {new_id(chapter, kind, front)} -->\n"))
        return inserts
    for m in _DETAILS.finditer(text):
        if CARD_ID.search(m.group(0)):
            continue
        front = re.sub(r"^\d+\.\s*", "", _plain(m.group("summary")))
        at = m.end("body")
        nl = "" if text[:at].endswith("\n") else "\n"
        inserts.append((at, f"{nl}<!-- card: {new_id(chapter, kind, front)} -->\n"))
    return inserts


def add_missing_ids(notebook: Path, *, write: bool = False) -> list[str]:
    """The id lines ``notebook`` lacks; with ``write``, added to its cells."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    markdown = [c for c in nb["cells"] if c["cell_type"] == "markdown"]
    texts = ["".join(c["source"]) for c in markdown]
    chapter = notebook.stem[:2]
    per_cell: dict[int, list[tuple[int, str]]] = {}
    for kind, _heading, index, start, end in section_spans(texts):
        for offset, line in _missing_in_cell(chapter, kind, texts[index][start:end]):
            per_cell.setdefault(index, []).append((start + offset, line))
    added = [line.strip() for inserts in per_cell.values() for _, line in inserts]
    if write and per_cell:
        for index, inserts in per_cell.items():
            text = texts[index]
            for offset, line in sorted(inserts, reverse=True):
                text = text[:offset] + line + text[offset:]
            if not texts[index].endswith("\n"):  # a cell's last line keeps having no newline
                text = text.removesuffix("\n")
            markdown[index]["source"] = text.splitlines(keepends=True)
        notebook.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return added


def main(argv: list[str]) -> int:
    write = "--write" in argv
    total = 0
    for name, nb in chapter_notebooks(REPO).items():
        if not nb.is_relative_to(REPO / "solutions"):
            continue
        added = add_missing_ids(nb, write=write)
        total += len(added)
        for line in added:
            print(f"{name}: {line}")
    verb = "added" if write else "missing (--write adds them)"
    print(f"{total} card id(s) {verb}")
    return 0
