"""Interview drills with spaced repetition: one deck from the chapters, scheduled by FSRS (chapter 14).

- :mod:`course.drill.deck`: the cards, read out of the chapter notebooks, each with a stable id
  written beside it in its chapter's source;
- :mod:`course.drill.schedule`: the session: FSRS counted in the learner's days (Anki's rule: a
  card is due on a day, and a day starts at 4 am local time), fuzz, design prompts in days,
  leeches, suspend, bury and undo;
- :mod:`course.drill.anki`: the deck and the review history as an Anki package;
- :mod:`course.drill.terminal`: ``course drill`` and ``course progress``;
- :mod:`course.drill.authoring`: ``python -m course.drill ids --write`` gives new cards their ids.

The state (card states, every review, suspended cards) is :mod:`course.progress`'s one SQLite file.
"""

from course.drill.anki import export_apkg
from course.drill.deck import (
    KIND_NAMES,
    PROMPTS,
    REPO,
    Card,
    DeckError,
    chapter_notebooks,
    chapter_titles,
    load_deck,
    new_id,
    read_chapter,
)
from course.drill.schedule import (
    DESIGN_MINUTES,
    DESIGN_STEPS,
    LEECH_LAPSES,
    Session,
    fuzzed_days,
    scheduler,
    when,
)
from course.drill.terminal import main, progress_main, show_progress, terminal_session

__all__ = [
    "DESIGN_MINUTES",
    "DESIGN_STEPS",
    "KIND_NAMES",
    "LEECH_LAPSES",
    "PROMPTS",
    "REPO",
    "Card",
    "DeckError",
    "Session",
    "chapter_notebooks",
    "chapter_titles",
    "export_apkg",
    "fuzzed_days",
    "load_deck",
    "main",
    "new_id",
    "progress_main",
    "read_chapter",
    "scheduler",
    "show_progress",
    "terminal_session",
    "when",
]
