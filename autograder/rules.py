"""Rule tables: every requirement a task's text states, and the check that enforces it.

Each chapter's check module (``autograder/checks/chNN``) defines

- ``RULES: dict[str, list[Rule]]``: task id -> one :class:`Rule` per requirement sentence of
  the task's text (its markdown from the ``## Graded task N: `task_id``` heading down to the
  answer cell), with the check that enforces it and the kept wrong solution
  (``WRONG[task][name]`` in ``tests/test_NN_grading.py``) that breaks only that rule;
- ``REFERENCES: dict[str, list[str]]``: task id -> the course's own implementations of the
  task as ``"module:qualname"``, so the grader can tell an answer that only calls them.

``tests/test_00_rules.py`` holds every chapter to its tables: each rule quotes one sentence
of the text, names a kept wrong solution (or says the text marks it not graded), and every
sentence that reads like a rule (:func:`is_rule_like`) is quoted by some rule. The heuristic
is a reminder, not a proof: a sentence it misses is still a requirement.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"


@dataclass(frozen=True)
class Rule:
    text: str  # a verbatim fragment (>= 4 words) of ONE requirement sentence of the task's text
    check: str  # where it is enforced: "check_function_name: what the check does to catch it"
    wrong: str | None = None  # key in WRONG[task] of the kept wrong solution that breaks ONLY this rule
    not_graded: bool = False  # the task text itself says this requirement is not graded


# ----------------------------------------------------------------------------- task texts


def notebook_path(chapter: str) -> Path:
    """``solutions/NN_slug/NN_slug.ipynb`` of chapter ``NN``."""
    found = sorted(SOLUTIONS.glob(f"{chapter}_*/{chapter}_*.ipynb"))
    if not found:
        raise FileNotFoundError(f"no solution notebook for chapter {chapter} under {SOLUTIONS}")
    return found[0]


def _heading_task(line: str) -> str | None:
    """The task id of a ``## Graded task N: `task_id` ...`` heading line, else None."""
    match = re.match(r"#{2,3}\s+Graded task \d+\s*:\s*`(\w+)`", line.strip())
    return match.group(1) if match else None


@cache
def task_texts(chapter: str) -> dict[str, str]:
    """Task id -> the markdown of its text: from its ``## Graded task N: `task_id``` heading
    down to its answer cell (the code cell whose nbgrader grade_id is the task id).

    A heading that names one function and grades another cell (chapter 01's ``retry_test``
    grades ``test_survives_...``) is found through the answer cell that follows it."""
    cells = json.loads(notebook_path(chapter).read_text())["cells"]
    texts: dict[str, str] = {}
    current: list[str] | None = None
    for cell in cells:
        source = "".join(cell["source"])
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell["cell_type"] == "markdown":
            lines = source.splitlines()
            for n, line in enumerate(lines):
                if _heading_task(line):
                    current = ["\n".join(lines[n:])]
                    break
            else:
                if current is not None:
                    current.append(source)
        elif meta.get("solution") and meta.get("grade_id") and current is not None:
            texts[meta["grade_id"]] = "\n\n".join(current)
            current = None
    return texts


def task_text(task_id: str, chapter: str) -> str:
    texts = task_texts(chapter)
    if task_id not in texts:
        raise KeyError(
            f"chapter {chapter} has no text for task {task_id!r}: expected a markdown heading "
            f"'## Graded task N: `{task_id}`' above its answer cell (found {sorted(texts)})"
        )
    return texts[task_id]


# ----------------------------------------------------------------------------- sentences


def plain(markdown: str) -> str:
    """``markdown`` without its marks (code spans, emphasis, links, headings, tags), whitespace
    collapsed: the form a rule's text is compared in. What a code span holds stays as it is."""
    spans: list[str] = []

    def keep(match: re.Match) -> str:
        spans.append(match.group(1))
        return f"\x01{len(spans) - 1}\x02"

    text = re.sub(r"`+([^`]*)`+", keep, markdown)
    text = re.sub(r"</?(details|summary|b|i|em|strong|br|sup|sub|p|div|span|code)\b[^>]*>", " ", text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # [text](url) -> text
    text = re.sub(r"(\*\*|__)(.+?)\1", r"\2", text)
    text = re.sub(r"(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])", r"\1", text)
    text = re.sub(r"(?m)^\s*#+\s*", "", text)
    text = re.sub("\x01(\\d+)\x02", lambda m: spans[int(m.group(1))], text)
    return " ".join(text.split())


_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.")


def sentences(markdown: str) -> list[str]:
    """The sentences of a task's text, in :func:`plain` form.

    Blocks are split first (paragraphs, list items, table rows; fenced code is left out),
    then each block at a ``.``, ``!`` or ``?`` followed by a space and a capital, a digit or
    a code span; ``e.g.`` and its kind do not end a sentence."""
    out: list[str] = []
    blocks: list[str] = []
    current: list[str] = []
    fenced = False

    def flush() -> None:
        if current:
            blocks.append(" ".join(current))
            current.clear()

    for raw in markdown.splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        stripped = line.strip()
        if not stripped:
            flush()
        elif re.match(r"^(#+\s|[-*+]\s|\d+[.)]\s|\|)", stripped):
            flush()
            if re.fullmatch(r"\|?[\s:|-]+\|?", stripped):  # a table's |---|---| line
                continue
            current.append(stripped.strip("|").replace("|", " | ") if stripped.startswith("|") else stripped)
            if stripped.startswith("|") or stripped.startswith("#"):
                flush()
        else:
            current.append(stripped)
    flush()

    for block in blocks:
        text = plain(re.sub(r"^([-*+]|\d+[.)])\s+", "", block))
        guarded = text
        for abbr in _ABBREVIATIONS:
            guarded = guarded.replace(abbr, abbr.replace(".", "\0"))
        for piece in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9(\"'])", guarded):
            piece = piece.replace("\0", ".").strip()
            if piece:
                out.append(piece)
    return out


#: words that make a sentence read like a requirement: ``must``, ``never``, ``exactly one``, ...
RULE_WORDS = re.compile(
    r"\b(must|never|always|only|exactly|at most|at least|every|each|refuses?|raises?|rejects?|"
    r"returns?|within|once|no|not|unchanged|without|share|fails?|store|record|insert|release|keep|credit)\b",
    re.IGNORECASE,
)

#: sentences that talk about the course, not the answer (where helpers go, how grading runs,
#: what is merely allowed), or that say what an argument is (``pool is a ...``)
_NOT_A_RULE = re.compile(
    r"(answer cell|helpers? (you write|functions)|grading runs|run(s)? the first code cell|"
    r"public checks|selfcheck|test cell|is fine|are (all )?fine|works here|is welcome|is nice|"
    r"^\w+ is (a|an) )",
    re.IGNORECASE,
)

#: SQL in a schema line is not a rule word
_SQL = re.compile(r"\b(NOT NULL|PRIMARY KEY|DEFAULT|ON CONFLICT DO NOTHING)\b")


def is_rule_like(sentence: str) -> bool:
    """A reminder heuristic: the sentence states something the answer must or must not do."""
    if len(sentence.split()) < 4 or _NOT_A_RULE.search(sentence):
        return False
    return bool(RULE_WORDS.search(_SQL.sub(" ", sentence)))


def rule_like(markdown: str) -> list[str]:
    """The sentences of a task's text that read like rules (see :func:`is_rule_like`)."""
    return [s for s in sentences(markdown) if is_rule_like(s)]


def sentences_quoting(fragment: str, markdown: str) -> list[str]:
    """The sentences of ``markdown`` that contain ``fragment`` (both compared in plain form)."""
    needle = plain(fragment)
    return [s for s in sentences(markdown) if needle in s]


def uncovered(markdown: str, rules: list[Rule]) -> list[str]:
    """The rule-like sentences of ``markdown`` that no rule in ``rules`` quotes."""
    needles = [plain(rule.text) for rule in rules]
    return [s for s in rule_like(markdown) if not any(n in s for n in needles)]
