"""The deck: every chapter's interview drills and typical mistakes, read out of the notebooks (chapter 14).

**One deck, one source.** The cards are read out of the chapter notebooks themselves, never
copied: every ``<details><summary>question</summary> answer </details>`` under a heading
that names a drill, and every numbered item under a "Typical mistakes" heading. Editing a
chapter's drill changes its card. The notebooks come from ``solutions/`` where it exists,
else from ``notebooks/`` (a learner's copy has no ``solutions/``; the drill markdown is the
same in both).

    section heading (any level)        kind       a card is
    "... Interview drill(s)"           drill      each <details> block
    "Typical mistakes ..."             mistake    each numbered item; front = its bold words
    "... wrong with this code ..."     code       each <details> block, with the code above it
    "Estimation drills ..."            estimate   each <details> block
    "... design prompts ..."           design     each <details> block, with the prompt above it

A block's *context* is the markdown directly above its ``<details>`` line (no blank line
between): a code snippet, or a design prompt's requirements.

**Stable ids.** Each card carries its id in its own source, an HTML comment no reader sees:
``<!-- card: 03-drill-f393af063e7d -->`` on a line of its own inside the ``<details>`` block or
the numbered item. Rewording a question keeps the id, so the learner's history stays with the
card and Anki updates its note in place. An item that repeats a card of another place says so
instead, ``<!-- card: see 01-drill-07fcb9204689 -->``: the chapter keeps its text and the deck
keeps one card (its ``also`` names the other chapters). A card without an id, an id used twice
and a ``see`` of no card are :class:`DeckError`; ``python -m course.drill ids`` prints an id for
every card that lacks one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import json
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

#: Section headings, in the order they are tried, and the kind of card they hold.
SECTION_KINDS = [
    (re.compile(r"estimation drills?", re.I), "estimate"),
    (re.compile(r"design prompts?", re.I), "design"),
    (re.compile(r"wrong with this code", re.I), "code"),
    (re.compile(r"interview (drills?|questions?)", re.I), "drill"),
    (re.compile(r"^(\d+\.\s*)?typical mistakes", re.I), "mistake"),
]
#: What a learner is asked, per kind, above the card's own words.
PROMPTS = {
    "drill": "Interview question",
    "mistake": "Typical mistake: why is it wrong, and what do you do instead?",
    "code": "What is wrong with this code?",
    "estimate": "Estimate (back of the envelope)",
    "design": "Timed design prompt (35 minutes)",
}
KIND_NAMES = {
    "drill": "interview drill",
    "mistake": "typical mistake",
    "code": "wrong code",
    "estimate": "estimate",
    "design": "design prompt",
}

_DETAILS = re.compile(r"<details>\s*<summary>(?P<summary>.*?)</summary>(?P<body>.*?)</details>", re.S | re.I)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
#: ``<!-- card: ID -->`` or ``<!-- card: see ID -->``, and the line it stands on.
CARD_ID = re.compile(
    r"[ \t]*<!--\s*card:\s*(?P<see>see\s+)?(?P<id>[0-9]{2}-[a-z]+-[0-9a-z-]+)\s*-->[ \t]*\n?"
)
_ID_SHAPE = re.compile(r"^[0-9]{2}-[a-z]+-[0-9a-z-]+$")
#: A web address: a host with a dot, then anything but spaces, quotes, braces and closing marks.
_URL = r"https?://[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+(?::\d+)?(?:/[^\s)>\]\"'`{}<]*)?"
_LINK = re.compile(rf"\[(?P<title>[^\]]+)\]\((?P<url>{_URL})\)|(?<![(<\w])(?P<bare>{_URL})")
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


class DeckError(Exception):
    """A chapter's drill markup cannot be read: the message says where and how to fix it."""


@dataclass(frozen=True)
class Card:
    id: str
    chapter: str  # "03"
    chapter_title: str  # "Idempotency"
    kind: str  # a key of PROMPTS
    number: int  # its place in its section, from 1
    front: str  # the question (markdown)
    back: str  # the model answer (markdown)
    context: str = ""  # markdown shown with the question: a snippet, a prompt's requirements
    section: str = ""  # the heading it sits under
    notebook: str = ""  # where it was read, relative to the repository
    links: tuple[tuple[str, str], ...] = field(default=())  # (title, url) the card cites
    also: tuple[str, ...] = field(default=())  # other chapters whose text points at this card

    @property
    def source(self) -> str:
        also = (
            f" (also in chapter{'s' if len(self.also) > 1 else ''} {', '.join(self.also)})"
            if self.also
            else ""
        )
        return f"chapter {self.chapter} ({self.chapter_title}), {self.section}, #{self.number}{also}"

    @property
    def fsrs_id(self) -> int:
        """An integer for ``fsrs.Card(card_id=...)``: from the id's hex tail, else a hash of the id."""
        tail = self.id.rsplit("-", 1)[-1]
        if re.fullmatch(r"[0-9a-f]{12}", tail):
            return int(tail, 16)
        return int(hashlib.sha1(self.id.encode()).hexdigest()[:12], 16)


def new_id(chapter: str, kind: str, front: str) -> str:
    """The id a new card is given once (then written into its source and never recomputed)."""
    digest = hashlib.sha1(f"{chapter}|{kind}|{' '.join(front.lower().split())}".encode()).hexdigest()
    return f"{chapter}-{kind}-{digest[:12]}"


# ----------------------------------------------------------------------------- reading


def chapter_notebooks(root: Path = REPO) -> dict[str, Path]:
    """ "NN_slug" -> its notebook: from solutions/ when the chapter is there, else notebooks/."""
    found: dict[str, Path] = {}
    for folder in ("notebooks", "solutions"):  # solutions/ last, so it wins
        for nb in sorted((root / folder).glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb")):
            if nb.stem == nb.parent.name:
                found[nb.stem] = nb
    return dict(sorted(found.items()))


def _markdown_cells(notebook: Path) -> list[str]:
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def _title(cells: list[str], fallback: str) -> str:
    h1 = next((m.group(2) for text in cells for m in _HEADING.finditer(text) if m.group(1) == "#"), fallback)
    return re.sub(r"^\d\d\s*[·:.-]\s*", "", h1)


def chapter_titles(root: Path = REPO) -> dict[str, str]:
    """ "03" -> "Idempotency", for every chapter notebook, with drills or without (chapter 00)."""
    return {name[:2]: _title(_markdown_cells(nb), name) for name, nb in chapter_notebooks(root).items()}


def _plain(text: str) -> str:
    """Summary markup to text: tags gone, entities decoded, whitespace folded."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", text)).split())


def _links(*texts: str) -> tuple[tuple[str, str], ...]:
    """(title, url) of every web address the texts cite, outside code (a URL built in code,
    ``f"http://{service}{path}"``, is no link)."""
    seen: dict[str, str] = {}
    for text in texts:
        for m in _LINK.finditer(_CODE.sub(" ", text)):
            url = (m.group("url") or m.group("bare")).rstrip(".,;:")
            seen.setdefault(url, m.group("title") or url)
    return tuple((title, url) for url, title in seen.items())


def section_spans(cells: list[str]) -> Iterable[tuple[str, str, int, int, int]]:
    """(kind, heading, cell index, start, end) of every drill section's text, cell by cell; a
    section runs across markdown cells until a heading of the same or a higher level."""
    current: tuple[str, str, int] | None = None
    for index, text in enumerate(cells):
        pieces, last = [], 0
        fences = [m.span() for m in _FENCE.finditer(text)]
        for m in _HEADING.finditer(text):
            if any(a <= m.start() < b for a, b in fences):  # a comment in a code block
                continue
            pieces.append((last, m.start(), None))
            pieces.append((m.start(), m.end(), m))
            last = m.end()
        pieces.append((last, len(text), None))
        for start, end, heading in pieces:
            if heading is not None:
                level, title = len(heading.group(1)), heading.group(2)
                if current and level <= current[2]:
                    current = None
                kind = next((k for pattern, k in SECTION_KINDS if pattern.search(title)), None)
                if kind and (kind != "mistake" or SECTION_KINDS[-1][0].match(title)):
                    current = (kind, re.sub(r"^\d+\.\s*", "", title), level)
            elif current and text[start:end].strip():
                yield current[0], current[1], index, start, end


def _sections(cells: list[str]) -> Iterable[tuple[str, str, str]]:
    """(kind, heading, text) of every drill section."""
    for kind, heading, index, start, end in section_spans(cells):
        yield kind, heading, cells[index][start:end]


def _mistakes(text: str) -> Iterable[str]:
    """The numbered items of a markdown list (continuation lines are indented)."""
    item: list[str] | None = None
    for line in text.splitlines():
        if re.match(r"^\d+\.\s", line):
            if item:
                yield "\n".join(item)
            item = [re.sub(r"^\d+\.\s+", "", line)]
        elif item is not None and (line.startswith((" ", "\t")) or not line.strip()):
            item.append(line.strip())
        elif item is not None:
            yield "\n".join(item)
            item = None
    if item:
        yield "\n".join(item)


def _context(before: str) -> str:
    """The markdown block directly above a ``<details>`` line (no blank line between)."""
    lines = before.rstrip(" ").split("\n")
    if len(lines) < 2 or not lines[-2].strip():
        return ""
    block = before.rstrip().rsplit("\n\n", 1)[-1]
    if block.count("```") % 2:  # a fence with a blank line inside: take the whole fence
        start = before.rstrip().rfind("```", 0, before.rstrip().rfind("```"))
        block = before[start:].strip()
    return block.strip()


def _card_id(text: str) -> tuple[str | None, bool, str]:
    """(id or None, whether it is a ``see`` reference, the text without the comment)."""
    found = list(CARD_ID.finditer(text))
    if len(found) > 1:
        raise DeckError(f"two card ids in one card: {[m.group('id') for m in found]}")
    if not found:
        return None, False, text
    m = found[0]
    return m.group("id"), bool(m.group("see")), text[: m.start()] + text[m.end() :]


def read_chapter(
    notebook: Path, root: Path = REPO, *, refs: dict[str, list[str]] | None = None, strict: bool = True
) -> list[Card]:
    """Every card of one chapter notebook, in page order. ``refs``, when given, collects the
    ``see`` references (target id -> the chapters that point at it). A card without an id is a
    :class:`DeckError` when ``strict``, else a warning and the id computed from its question."""
    cells = _markdown_cells(notebook)
    chapter = notebook.stem[:2]
    title = _title(cells, notebook.stem)
    where = str(notebook.relative_to(root)) if notebook.is_relative_to(root) else str(notebook)
    cards: list[Card] = []
    numbers: dict[str, int] = {}

    def add(kind: str, section: str, front: str, back: str, context: str = "") -> None:
        card_id, see, back = _card_id(back)
        if not front or not back.strip():
            raise DeckError(f"{where}: a card in '{section}' has an empty question or answer")
        if front.lower().rstrip(".:") in ("model answer", "answer", "show answer"):
            raise DeckError(
                f"{where}: '{section}' hides its question outside <summary> ('{front}'): write "
                "<details><summary><b>N. The question?</b></summary> ... </details>"
            )
        front = re.sub(r"^\d+\.\s*", "", front)
        if card_id is None:
            missing = (
                f"{where}: the card '{front[:60]}' in '{section}' has no id: add the line "
                f"<!-- card: {new_id(chapter, kind, front)} --> inside it "
                "(python -m course.drill ids --write)"
            )
            if strict:
                raise DeckError(missing)
            warnings.warn(
                missing, stacklevel=3
            )  # a learner's older copy: the id it had before ids were written
            card_id = new_id(chapter, kind, front)
        if not card_id.startswith(f"{chapter}-") and not see:
            raise DeckError(f"{where}: card id {card_id} does not start with its chapter ({chapter}-)")
        if see:
            if refs is not None:
                refs.setdefault(card_id, []).append(chapter)
            return
        key = f"{section}|{kind}"
        numbers[key] = numbers.get(key, 0) + 1
        cards.append(
            Card(
                card_id,
                chapter,
                title,
                kind,
                numbers[key],
                front,
                back.strip(),
                context,
                section,
                where,
                _links(front, back, context),
            )
        )

    for kind, section, text in _sections(cells):
        if kind == "mistake":
            for item in _mistakes(text):
                bold = re.match(r"\*\*(.+?)\*\*", item, re.S)
                front = bold.group(1) if bold else re.split(r"(?<=[.:])\s", item, maxsplit=1)[0]
                add(kind, section, " ".join(front.split()).rstrip(".:"), item)
            continue
        last = 0
        for m in _DETAILS.finditer(text):
            add(kind, section, _plain(m.group("summary")), m.group("body"), _context(text[last : m.start()]))
            last = m.end()
    ids = [c.id for c in cards]
    if len(ids) != len(set(ids)):
        raise DeckError(f"{where}: card ids used twice: {sorted({i for i in ids if ids.count(i) > 1})}")
    return cards


def load_deck(
    root: Path = REPO, chapters: Iterable[str] | None = None, *, strict: bool = False
) -> list[Card]:
    """The whole deck, chapter by chapter (``chapters``: "03" or "03_idempotency" to keep).

    A chapter whose drill markup cannot be read raises :class:`DeckError` when ``strict`` (the
    tests); otherwise it is left out with a warning, so one chapter's typo never stops a learner's
    session (the tests still fail on it). Ids are checked across the whole deck."""
    wanted = {c[:2] for c in chapters} if chapters else None
    deck: list[Card] = []
    refs: dict[str, list[str]] = {}
    for name, nb in chapter_notebooks(root).items():
        try:
            cards = read_chapter(nb, root, refs=refs, strict=strict)
        except DeckError as err:
            if strict:
                raise
            warnings.warn(f"{err} (chapter {name[:2]} left out of the deck)", stacklevel=2)
            continue
        deck += cards
    seen: dict[str, Card] = {}
    for card in deck:
        if card.id in seen:
            raise DeckError(f"card id {card.id} is used twice: {seen[card.id].source} and {card.source}")
        seen[card.id] = card
    unknown = sorted(set(refs) - set(seen))
    if unknown and strict:
        raise DeckError(f"'see' references to no card: {unknown}")
    deck = [
        dataclasses.replace(c, also=tuple(sorted(set(refs[c.id]) - {c.chapter}))) if c.id in refs else c
        for c in deck
    ]
    return [c for c in deck if wanted is None or c.chapter in wanted]
