"""Interview drills with spaced repetition: one deck from the chapters, scheduled by FSRS (chapter 14).

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

**Scheduling** is FSRS (Free Spaced Repetition Scheduler, the algorithm Anki adopted in
23.10) through the ``fsrs`` package, fuzzing off so the same ratings give the same dates.
State lives in :mod:`course.progress`.

    python -m course.drill [--state PATH] [--new N] [--chapter NN] [--export deck.apkg]
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from course.progress import Store, progress_text, utcnow

REPO = Path(__file__).resolve().parent.parent

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
#: The structure a timed design answer fills, in order.
DESIGN_STEPS = ["requirements", "estimates", "API", "data model", "high-level design", "bottlenecks"]
DESIGN_MINUTES = 35

_DETAILS = re.compile(r"<details>\s*<summary>(?P<summary>.*?)</summary>(?P<body>.*?)</details>", re.S | re.I)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"\[([^\]]+)\]\((https?://[^)\s]+)\)|(?<![(<])(https?://[^\s)>,]+)")


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

    @property
    def source(self) -> str:
        return f"chapter {self.chapter} ({self.chapter_title}), {self.section}, #{self.number}"

    @property
    def fsrs_id(self) -> int:
        return int(self.id.rsplit("-", 1)[-1], 16)


# ----------------------------------------------------------------------------- the deck


def chapter_notebooks(root: Path = REPO) -> dict[str, Path]:
    """ "NN_slug" -> its notebook: from solutions/ when the chapter is there, else notebooks/."""
    found: dict[str, Path] = {}
    for folder in ("notebooks", "solutions"):  # solutions/ last, so it wins
        for nb in sorted((root / folder).glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb")):
            if nb.stem == nb.parent.name:
                found[nb.stem] = nb
    return dict(sorted(found.items()))


def _plain(text: str) -> str:
    """Summary markup to text: tags gone, entities decoded, whitespace folded."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", text)).split())


def _card_id(chapter: str, kind: str, front: str) -> str:
    digest = hashlib.sha1(f"{chapter}|{kind}|{' '.join(front.lower().split())}".encode()).hexdigest()
    return f"{chapter}-{kind}-{digest[:12]}"


def _links(*texts: str) -> tuple[tuple[str, str], ...]:
    seen: dict[str, str] = {}
    for text in texts:
        for m in _LINK.finditer(text):
            title, url = (m.group(1), m.group(2)) if m.group(2) else (m.group(3), m.group(3))
            seen.setdefault(url.rstrip(".;"), title)
    return tuple((title, url) for url, title in seen.items())


def _sections(cells: list[str]) -> Iterable[tuple[str, str, str]]:
    """(kind, heading, text) of every drill section; a section runs across markdown cells
    until a heading of the same or a higher level."""
    current: tuple[str, str, int] | None = None
    for text in cells:
        pieces, last = [], 0
        fences = [m.span() for m in _FENCE.finditer(text)]
        for m in _HEADING.finditer(text):
            if any(a <= m.start() < b for a, b in fences):  # a comment in a code block
                continue
            pieces.append((text[last : m.start()], None))
            pieces.append(("", m))
            last = m.end()
        pieces.append((text[last:], None))
        for body, heading in pieces:
            if heading is not None:
                level, title = len(heading.group(1)), heading.group(2)
                if current and level <= current[2]:
                    current = None
                kind = next((k for pattern, k in SECTION_KINDS if pattern.search(title)), None)
                if kind and (kind != "mistake" or SECTION_KINDS[-1][0].match(title)):
                    current = (kind, re.sub(r"^\d+\.\s*", "", title), level)
            elif current and body.strip():
                yield current[0], current[1], body


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


def read_chapter(notebook: Path, root: Path = REPO) -> list[Card]:
    """Every card of one chapter notebook, in page order."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    chapter = notebook.stem[:2]
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    h1 = next(
        (m.group(2) for text in cells for m in _HEADING.finditer(text) if m.group(1) == "#"), notebook.stem
    )
    title = re.sub(r"^\d\d\s*[·:.-]\s*", "", h1)
    where = str(notebook.relative_to(root)) if notebook.is_relative_to(root) else str(notebook)
    cards: list[Card] = []
    numbers: dict[str, int] = {}

    def add(kind: str, section: str, front: str, back: str, context: str = "") -> None:
        if not front or not back:
            raise DeckError(f"{where}: a card in '{section}' has an empty question or answer")
        if front.lower().rstrip(".:") in ("model answer", "answer", "show answer"):
            raise DeckError(
                f"{where}: '{section}' hides its question outside <summary> ('{front}'): write "
                "<details><summary><b>N. The question?</b></summary> ... </details>"
            )
        key = f"{section}|{kind}"
        numbers[key] = numbers.get(key, 0) + 1
        front = re.sub(r"^\d+\.\s*", "", front)
        cards.append(
            Card(
                _card_id(chapter, kind, front),
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
        dup = sorted({c.front for c in cards if ids.count(c.id) > 1})
        raise DeckError(f"{where}: two cards ask the same question: {dup}")
    return cards


def load_deck(
    root: Path = REPO, chapters: Iterable[str] | None = None, *, strict: bool = False
) -> list[Card]:
    """The whole deck, chapter by chapter (``chapters``: "03" or "03_idempotency" to keep).

    A chapter whose drill markup cannot be read raises :class:`DeckError` when ``strict`` (the
    tests); otherwise it is left out with a warning, so one chapter's typo never stops a learner's
    session (the tests still fail on it)."""
    import warnings

    wanted = {c[:2] for c in chapters} if chapters else None
    deck: list[Card] = []
    for name, nb in chapter_notebooks(root).items():
        if wanted is None or name[:2] in wanted:
            try:
                deck += read_chapter(nb, root)
            except DeckError as err:
                if strict:
                    raise
                warnings.warn(f"{err} (chapter {name[:2]} left out of the deck)", stacklevel=2)
    return deck


# ----------------------------------------------------------------------------- scheduling


def scheduler():
    """The FSRS scheduler every session uses: the package's defaults (90% desired retention,
    learning steps 1 and 10 minutes), without fuzz, so a week of ratings is reproducible."""
    import fsrs

    return fsrs.Scheduler(enable_fuzzing=False)


class Session:
    """A review session over ``deck``: due cards first (oldest due first), then new cards up to
    ``new_per_day`` a day; a card rated into a step shorter than ``learn_ahead`` comes back at
    the end of the session, as in Anki. ``clock`` returns an aware UTC datetime (inject one)."""

    def __init__(
        self,
        deck: list[Card],
        store: Store | None = None,
        *,
        clock: Callable[[], datetime] = utcnow,
        new_per_day: int = 20,
        learn_ahead: timedelta = timedelta(minutes=20),
    ) -> None:
        import fsrs

        self.deck, self.store, self.clock = deck, store or Store(), clock
        self.learn_ahead = learn_ahead
        self.scheduler = scheduler()
        now = clock()
        self.states = {cid: fsrs.Card.from_json(text) for cid, text in self.store.card_states().items()}
        day_start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        seen_today = self.store.new_cards_seen(day_start) & {c.id for c in deck}  # this deck's new cards
        budget = max(0, new_per_day - len(seen_today))
        due = sorted(
            (c for c in deck if c.id in self.states and self.states[c.id].due <= now),
            key=lambda c: self.states[c.id].due,
        )
        order = list(PROMPTS)  # new cards take turns across chapters and kinds: #1 of each section first
        new = sorted(
            (c for c in deck if c.id not in self.states), key=lambda c: (c.number, order.index(c.kind))
        )
        new = new[:budget]
        self.queue: list[Card] = due + new
        self.counts = {"due": len(due), "new": len(new)}
        self.done = 0

    def next(self) -> Card | None:
        return self.queue[0] if self.queue else None

    def is_new(self, card: Card) -> bool:
        return card.id not in self.states

    def preview(self, card: Card) -> dict[int, str]:
        """rating -> when each rating would bring the card back ("in 10 minutes"): the buttons' labels."""
        import fsrs

        now = self.clock()
        state = self.states.get(card.id) or fsrs.Card(card_id=card.fsrs_id, due=now)
        return {int(r): when(self.scheduler.review_card(state, r, now)[0].due, now) for r in fsrs.Rating}

    def rate(self, card: Card, rating: int, *, answer: str = "") -> datetime:
        """Record ``rating`` (1 Again, 2 Hard, 3 Good, 4 Easy) for ``card``; return its next due date."""
        import fsrs

        now = self.clock()
        before = self.states.get(card.id)
        state = before or fsrs.Card(card_id=card.fsrs_id, due=now)
        recall = self.scheduler.get_card_retrievability(state, now) if before else None
        after, _log = self.scheduler.review_card(state, fsrs.Rating(int(rating)), now)
        self.store.save_review(
            card.id,
            card.chapter,
            after.to_json(),
            rating=int(rating),
            state_before=int(before.state) if before else None,
            recall_p=recall,
            reviewed_at=now,
            answer=answer,
        )
        self.states[card.id] = after
        if self.queue and self.queue[0].id == card.id:
            self.queue.pop(0)
        if after.due <= now + self.learn_ahead:
            self.queue.append(card)
        self.done += 1
        return after.due


def when(due: datetime, now: datetime) -> str:
    """'in 10 minutes', 'in 3 days' (what a learner reads after rating)."""
    seconds = (due - now).total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = round(seconds / size)
            return f"in {n} {unit}{'s' if n != 1 else ''}"
    return "now"


# ----------------------------------------------------------------------------- Anki export


def export_apkg(deck: list[Card], path: str | Path, *, timestamp: float | None = None) -> Path:
    """Write ``deck`` as an Anki package (``.apkg``: a zip holding a SQLite collection).

    Each card's note has a stable guid from its id, so importing an updated export updates the
    notes in Anki instead of duplicating them; tags name the chapter and the kind."""
    import genanki
    import mistune

    model = genanki.Model(
        1_614_032_714,
        "Resilient Backend Patterns drill",
        fields=[{"name": n} for n in ("Question", "Context", "Answer", "Source")],
        templates=[
            {
                "name": "Card 1",
                "qfmt": "<div class=kind>{{Source}}</div>{{Question}}{{#Context}}<div>{{Context}}</div>{{/Context}}",
                "afmt": "{{FrontSide}}<hr id=answer>{{Answer}}",
            }
        ],
        css=".card{font-family:sans-serif;text-align:left;max-width:46em;margin:auto}"
        ".kind{color:#7f8c8d;font-size:small}pre{background:#f6f6f6;padding:.5em}",
    )
    root = genanki.Deck(1_614_032_715, "Resilient Backend Patterns")
    for card in deck:
        question = f"<p><i>{html.escape(PROMPTS[card.kind])}</i></p>{mistune.html(card.front)}"
        fields = [
            question,
            mistune.html(card.context) if card.context else "",
            mistune.html(card.back),
            html.escape(card.source),
        ]
        root.add_note(
            genanki.Note(
                model=model,
                fields=fields,
                guid=genanki.guid_for(card.id),
                tags=[f"ch{card.chapter}", card.kind],
            )
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    genanki.Package(root).write_to_file(str(path), timestamp=timestamp)
    return path


# ----------------------------------------------------------------------------- the terminal


def _ask(prompt: str) -> str:
    try:
        return input(prompt)
    except EOFError:
        return "q"


def _show_card(card: Card, index: int, total: int, out) -> None:
    print(
        f"\n[{index}/{total}] chapter {card.chapter} {card.chapter_title} | {KIND_NAMES[card.kind]}", file=out
    )
    print(PROMPTS[card.kind], file=out)
    print(f"\n  {card.front}\n", file=out)
    if card.context:
        print(card.context + "\n", file=out)
    if card.kind == "design":
        print(f"Fill in, in {DESIGN_MINUTES} minutes: " + ", ".join(DESIGN_STEPS), file=out)


def terminal_session(session: Session, *, out=sys.stdout) -> int:
    """Review until the queue is empty or the learner types q; return the number reviewed."""
    total = len(session.queue)
    print(f"{session.counts['due']} due, {session.counts['new']} new (state: {session.store.path})", file=out)
    if not total:
        print("nothing due now; come back later, or raise --new", file=out)
    while (card := session.next()) is not None:
        _show_card(card, session.done + 1, max(total, session.done + len(session.queue)), out)
        started = session.clock()
        notes = _ask("Answer aloud or type notes, then Enter for the model answer (q quits): ")
        if notes.strip().lower() == "q":
            break
        if card.kind == "design":
            took = (session.clock() - started).total_seconds() / 60
            print(f"time: {took:.0f} of {DESIGN_MINUTES} minutes", file=out)
        print("\n--- model answer ---", file=out)
        print(card.back, file=out)
        print(f"--- {card.source}", file=out)
        for title, url in card.links:
            print(f"    {title}: {url}", file=out)
        preview = session.preview(card)
        choices = "  ".join(
            f"{n} {name} ({preview[n]})" for n, name in ((1, "again"), (2, "hard"), (3, "good"), (4, "easy"))
        )
        while True:
            answer = _ask(f"Rate: {choices}, q quits > ").strip().lower()
            if answer in ("1", "2", "3", "4", "q"):
                break
            print("type 1, 2, 3 or 4 (or q)", file=out)
        if answer == "q":
            break
        due = session.rate(card, int(answer), answer=notes)
        print(f"next review {when(due, session.clock())} ({due:%Y-%m-%d %H:%M} UTC)", file=out)
    print(f"\nreviewed {session.done} card(s); `course progress` shows where you stand", file=out)
    return session.done


def show_progress(state: str | Path | None = None) -> None:
    """Print what ``course progress`` prints (chapter 00's and 14's progress cells)."""
    with Store(state) as store:
        print(progress_text(store, load_deck()))


def progress_main(argv: list[str]) -> int:
    """``course progress [--state PATH] [--json]``: per chapter, the last graded score and the cards."""
    import argparse

    from course.progress import summary

    parser = argparse.ArgumentParser(prog="course progress", description="your progress across the course")
    parser.add_argument(
        "--state", help="the state file (default: $COURSE_STATE or ~/.local/share/resilient-course/)"
    )
    parser.add_argument("--json", action="store_true", help="print it as JSON")
    args = parser.parse_args(argv)
    store = Store(args.state)
    try:
        deck = load_deck()
    except DeckError as err:
        print(f"course progress: {err}", file=sys.stderr)
        deck = []
    if args.json:
        rows = []
        for r in summary(store, deck):
            check = r.check and {
                "score": r.check.score,
                "max_score": r.check.max_score,
                "via": r.check.via,
                "at": r.check.at.isoformat(),
            }
            rows.append(
                {
                    "chapter": r.chapter,
                    "title": r.title,
                    "cards": r.cards,
                    "seen": r.seen,
                    "due": r.due,
                    "mastered": r.mastered,
                    "last_check": check,
                }
            )
        print(json.dumps({"state": str(store.path), "chapters": rows}, indent=2))
    else:
        print(progress_text(store, deck))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``course drill``: a review session in the terminal, or ``--export deck.apkg`` for Anki."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["progress"]:
        return progress_main(argv[1:])

    parser = argparse.ArgumentParser(
        prog="course drill", description="interview drills with spaced repetition"
    )
    parser.add_argument(
        "--state", help="the state file (default: $COURSE_STATE or ~/.local/share/resilient-course/)"
    )
    parser.add_argument("--new", type=int, default=20, help="new cards a day (default 20)")
    parser.add_argument(
        "--chapter", action="append", help="only this chapter (repeatable): 03 or 03_idempotency"
    )
    parser.add_argument("--export", metavar="PATH", help="write the deck as an Anki package (.apkg) and stop")
    args = parser.parse_args(argv)
    try:
        deck = load_deck(chapters=args.chapter)
    except DeckError as err:
        print(f"course drill: {err}", file=sys.stderr)
        return 2
    if not deck:
        print("course drill: no cards (no chapter notebooks found, or none of --chapter)", file=sys.stderr)
        return 2
    if args.export:
        path = export_apkg(deck, args.export)
        print(f"wrote {len(deck)} cards to {path}; in Anki: File > Import")
        return 0
    try:
        terminal_session(Session(deck, Store(args.state), new_per_day=args.new))
    except KeyboardInterrupt:
        print("\nstopped; every rating so far is saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
