"""``course drill`` and ``course progress``: the drill session in a terminal (chapter 14).

    course drill [--state PATH] [--new N] [--chapter 4] [--leech N]
    course drill --export deck.apkg        the deck and your review history, for Anki
    course drill --unsuspend ID|all        bring suspended cards back
    course drill ids [--write]             for authors: cards without an id, and the line to add
    course progress [--state PATH] [--json]

A card's question, the model answer and your notes are rendered as markdown for the terminal
(``rich``): bold, code blocks and links as a terminal shows them, not raw ``**`` and fences. Your
answer may run over several lines (end it with a line holding only ``.``), and is shown beside
the model answer the next time the card comes up. At the rating prompt: ``1``-``4`` rate, ``s``
suspends the card, ``b`` buries it until tomorrow, ``u`` takes back the previous rating.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from datetime import datetime

from course.drill.deck import KIND_NAMES, PROMPTS, Card, DeckError, chapter_titles, load_deck
from course.drill.schedule import DESIGN_MINUTES, DESIGN_STEPS, LEECH_LAPSES, Session, when
from course.progress import LearnerDay, Store, progress_text, summary

END = "."
RATINGS = ((1, "again"), (2, "hard"), (3, "good"), (4, "easy"))


def _ask(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def read_answer(ask: Callable[[str], str | None] = _ask) -> tuple[str, str | None]:
    """(your answer, a command): Enter alone skips to the model answer; ``q`` quits, ``u`` undoes;
    anything else starts an answer that runs until a line holding only ``.`` (or end of input)."""
    first = ask(
        f"Your answer (end with a line holding only '{END}'; Enter alone: skip; q quits, u undoes) > "
    )
    if first is None or first.strip().lower() == "q":
        return "", "q"
    if first.strip().lower() == "u":
        return "", "u"
    if not first.strip():
        return "", None
    lines = [first]
    while (line := ask("")) is not None and line.strip() != END:
        lines.append(line)
    return "\n".join(lines).strip(), None


class Screen:
    """Markdown for a terminal, through rich (plain text when the output is not a terminal)."""

    def __init__(self, out) -> None:
        from rich.console import Console

        self.out = out
        self.console = Console(file=out, width=min(100, Console(file=out).width), highlight=False)

    def markdown(self, text: str) -> None:
        from rich.markdown import Markdown

        self.console.print(Markdown(text, hyperlinks=False))

    def line(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)


def _left(session: Session) -> str:
    left = session.left()
    return f"{left['new']} new · {left['learning']} learning · {left['review']} review"


def _show_card(screen: Screen, session: Session, card: Card) -> None:
    leech = (
        f" | leech: forgotten {session.lapses.get(card.id, 0)} times" if card.id in session.leeches else ""
    )
    screen.line(
        f"\n[{_left(session)}] chapter {card.chapter} {card.chapter_title} | {KIND_NAMES[card.kind]}{leech}"
    )
    screen.line(PROMPTS[card.kind])
    screen.markdown(card.front)
    if card.context:
        screen.markdown(card.context)
    if card.kind == "design":
        screen.line(f"Fill in, in {DESIGN_MINUTES} minutes: " + ", ".join(DESIGN_STEPS))


def _show_answer(screen: Screen, session: Session, card: Card, took: float) -> None:
    if card.kind == "design":
        screen.line(f"time: {took / 60:.0f} of {DESIGN_MINUTES} minutes")
    screen.line("\n--- model answer ---")
    screen.markdown(card.back)
    screen.line(f"--- {card.source}")
    for title, url in card.links:
        screen.line(f"    {title}: {url}" if title != url else f"    {url}")
    if (last := session.store.last_notes(card.id)) is not None:
        at, notes = last
        screen.line(f"--- your notes from {at.astimezone():%Y-%m-%d}:")
        screen.markdown(notes)


def terminal_session(session: Session, *, out=sys.stdout, ask: Callable[[str], str | None] = _ask) -> int:
    """Review until nothing is left or the learner types q; return the number reviewed."""
    screen = Screen(out)
    screen.line(f"{session.counts['due']} due, {session.counts['new']} new (state: {session.store.path})")
    if session.next() is None:
        screen.line("nothing due now; come back later, or raise --new")
    while (card := session.next()) is not None:
        _show_card(screen, session, card)
        started = session.clock()
        notes, command = read_answer(ask)
        if command == "q":
            break
        if command == "u":
            _undo(screen, session)
            continue
        _show_answer(screen, session, card, (session.clock() - started).total_seconds())
        preview = session.preview(card)
        choices = "  ".join(f"{n} {name} ({preview[n]})" for n, name in RATINGS)
        while True:
            answer = (ask(f"Rate: {choices}; s suspend, b bury, u undo, q quit > ") or "q").strip().lower()
            if answer in ("1", "2", "3", "4", "q", "s", "b", "u"):
                break
            screen.line("type 1, 2, 3 or 4 (or s, b, u, q)")
        if answer == "q":
            break
        if answer == "u":
            _undo(screen, session)
            continue
        if answer == "s":
            session.suspend(card)
            screen.line(f"suspended; `course drill --unsuspend {card.id}` brings it back")
            continue
        if answer == "b":
            session.bury(card)
            screen.line("buried until tomorrow")
            continue
        seconds = (session.clock() - started).total_seconds()
        due = session.rate(card, int(answer), answer=notes, seconds=seconds)
        screen.line(f"next review {when(due, session.clock())} ({due.astimezone():%Y-%m-%d %H:%M} your time)")
        if card.id in session.leeches:
            screen.line(
                f"leech: forgotten {session.lapses[card.id]} times once learned, so it is suspended (as Anki "
                f"does). Rewrite your notes for it, then `course drill --unsuspend {card.id}`."
            )
    if (later := session.later()) is not None and session.next() is None:
        screen.line(
            f"cards in a learning step come back {when(later, session.clock())}: run course drill then"
        )
    screen.line(f"\nreviewed {session.done} card(s); `course progress` shows where you stand")
    return session.done


def _undo(screen: Screen, session: Session) -> None:
    card = session.undo()
    if card is None:
        screen.line(
            "nothing to undo (no rating yet in this session, or the card was reviewed elsewhere since)"
        )
    else:
        screen.line(f"took back your rating of: {card.front}")


# ----------------------------------------------------------------------------- the commands


def chapter_arg(value: str, known: dict[str, str]) -> str:
    """``4``, ``04`` or ``04_caching`` -> ``04``; an unknown chapter is an error that lists the known."""
    m = re.match(r"^\s*(\d{1,2})(?:_.*)?\s*$", value)
    chapter = m.group(1).zfill(2) if m else value
    if chapter not in known:
        raise ValueError(f"no chapter {value!r}: the chapters are {', '.join(sorted(known))}")
    return chapter


def show_progress(state: str | None = None) -> None:
    """Print what ``course progress`` prints (chapter 00's and 14's progress cells)."""
    with Store(state) as store:
        print(progress_text(store, load_deck(), chapters=chapter_titles()))


def progress_main(argv: list[str]) -> int:
    """``course progress [--state PATH] [--json]``: per chapter, the last graded score and the cards."""
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
    titles = chapter_titles()
    if args.json:
        rows = []
        for r in summary(store, deck, chapters=titles):
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
        print(progress_text(store, deck, chapters=titles))
    return 0


def main(argv: list[str] | None = None, *, clock: Callable[[], datetime] | None = None) -> int:
    """``course drill``: a review session in the terminal, or ``--export deck.apkg`` for Anki."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["progress"]:
        return progress_main(argv[1:])
    if argv[:1] == ["ids"]:
        from course.drill.authoring import main as ids_main

        return ids_main(argv[1:])

    parser = argparse.ArgumentParser(
        prog="course drill", description="interview drills with spaced repetition"
    )
    parser.add_argument(
        "--state", help="the state file (default: $COURSE_STATE or ~/.local/share/resilient-course/)"
    )
    parser.add_argument(
        "--new", type=int, default=20, help="new cards a day, all chapters together (default 20)"
    )
    parser.add_argument(
        "--chapter", action="append", help="only this chapter (repeatable): 4, 04 or 04_caching"
    )
    parser.add_argument(
        "--leech",
        type=int,
        default=LEECH_LAPSES,
        help=f"suspend a card forgotten this often (default {LEECH_LAPSES})",
    )
    parser.add_argument(
        "--export", metavar="PATH", help="write the deck and your reviews as an Anki package (.apkg)"
    )
    parser.add_argument("--unsuspend", metavar="ID", help="bring back a suspended card (or all)")
    args = parser.parse_args(argv)
    for name in ("new", "leech"):
        if getattr(args, name) < (0 if name == "new" else 1):
            least = "0" if name == "new" else "1"
            print(
                f"course drill: --{name} takes a whole number, {least} or more (got {getattr(args, name)})",
                file=sys.stderr,
            )
            return 2
    titles = chapter_titles()
    try:
        chapters = [chapter_arg(c, titles) for c in args.chapter] if args.chapter else None
        deck = load_deck(chapters=chapters)
    except (ValueError, DeckError) as err:
        print(f"course drill: {err}", file=sys.stderr)
        return 2
    if not deck:
        print(f"course drill: chapter {', '.join(chapters or [])} has no drill cards", file=sys.stderr)
        return 2
    store = Store(args.state)
    if args.unsuspend:
        targets = [cid for cid, (off, _) in store.flags().items() if off and args.unsuspend in ("all", cid)]
        for cid in targets:
            store.suspend(cid, False)
        print(f"unsuspended {len(targets)} card(s)")
        return 0
    if args.export:
        from course.drill.anki import export_apkg

        path = export_apkg(deck, args.export, store=store)
        reviews = len(store.reviews())
        print(
            f"wrote {len(deck)} cards and {reviews} reviews to {path}; in Anki: File > Import, "
            "and tick 'Import any learning progress' to bring your reviews along"
        )
        return 0
    try:
        kwargs = {"clock": clock} if clock else {}
        terminal_session(
            Session(deck, store, new_per_day=args.new, leech_lapses=args.leech, day=LearnerDay(), **kwargs)
        )
    except KeyboardInterrupt:
        print("\nstopped; every rating so far is saved")
    return 0
