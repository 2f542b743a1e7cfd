"""The learner's progress across the course, in one SQLite file under their home (chapter 14).

One file holds everything a learner does outside the notebooks' own cells: each drill card's
FSRS memory state, every review, and every ``course check`` / ``selfcheck`` result. It lives
at ``$COURSE_STATE`` when set, else ``$XDG_DATA_HOME/resilient-course/state.sqlite3``
(``~/.local/share/...`` without XDG), never in the repository: a new checkout, a
``git clean`` or a fresh clone of the workbook keeps the learner's history.

    store = Store()                       # the default path, created on first use
    store.record_check("03", 10, 10, via="course check")
    print(progress_text(store, deck))     # per chapter: last score, cards due and mastered

The scheduling itself is :mod:`course.drill` (FSRS); this module only stores.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

#: Environment variable naming the state file (``course drill --state PATH`` overrides it too).
ENV = "COURSE_STATE"
#: A card counts as mastered once the scheduler puts its next review this far out (Anki's "mature").
MASTERED = timedelta(days=21)

SCHEMA = """
CREATE TABLE IF NOT EXISTS cards (
    card_id   TEXT PRIMARY KEY,
    chapter   TEXT NOT NULL,
    fsrs      TEXT NOT NULL,          -- fsrs.Card.to_json(): state, step, stability, difficulty, due
    due       TEXT NOT NULL,          -- ISO 8601, UTC (copied out of fsrs for queries)
    interval_days REAL NOT NULL DEFAULT 0,
    added_at  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS reviews (
    id           INTEGER PRIMARY KEY,
    card_id      TEXT NOT NULL,
    chapter      TEXT NOT NULL,
    rating       INTEGER NOT NULL,    -- 1 Again, 2 Hard, 3 Good, 4 Easy
    state_before INTEGER,             -- fsrs.State before the review (NULL: a new card)
    recall_p     REAL,                -- the scheduler's predicted recall at review time
    reviewed_at  TEXT NOT NULL,
    due_after    TEXT NOT NULL,
    answer       TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS checks (
    id        INTEGER PRIMARY KEY,
    chapter   TEXT NOT NULL,
    score     REAL NOT NULL,
    max_score REAL NOT NULL,
    via       TEXT NOT NULL,          -- "course check" or "selfcheck"
    at        TEXT NOT NULL
);
"""


def default_path() -> Path:
    """Where the state lives: ``$COURSE_STATE``, else the XDG data folder, never the repository."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "resilient-course" / "state.sqlite3"


def utcnow() -> datetime:
    return datetime.now(UTC)


def _iso(when: datetime) -> str:
    return when.astimezone(UTC).isoformat(timespec="seconds")


def _parse(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


@dataclass(frozen=True)
class CheckRecord:
    chapter: str
    score: float
    max_score: float
    via: str
    at: datetime


class Store:
    """The state file, opened on first use and kept open (WAL mode: a notebook's kernel and
    ``course drill`` in a terminal may use the same file at the same time)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path).expanduser() if path else default_path()
        self._conn: sqlite3.Connection | None = None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=10, check_same_thread=False)
            # WAL with synchronous=NORMAL: a crash never corrupts the file (it may lose the last
            # rating); opening, committing and closing per rating waited 20 ms on the disk
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            self._conn = db
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- cards and reviews (written by course.drill) --------------------------------------

    def card_states(self) -> dict[str, str]:
        """card id -> its stored ``fsrs.Card`` JSON."""
        db = self._db()
        return dict(db.execute("SELECT card_id, fsrs FROM cards"))

    def save_review(
        self,
        card_id: str,
        chapter: str,
        fsrs_json: str,
        *,
        rating: int,
        state_before: int | None,
        recall_p: float | None,
        reviewed_at: datetime,
        answer: str = "",
    ) -> None:
        """The card's new state and the review that produced it, in one transaction."""
        state = json.loads(fsrs_json)
        due, last = _parse(state["due"]), state.get("last_review")
        interval = (due - _parse(last)).total_seconds() / 86400 if last else 0.0
        with self._db() as db:
            db.execute(
                "INSERT INTO cards (card_id, chapter, fsrs, due, interval_days, added_at) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (card_id) DO UPDATE SET fsrs = excluded.fsrs, due = excluded.due, "
                "interval_days = excluded.interval_days",
                (card_id, chapter, fsrs_json, _iso(due), interval, _iso(reviewed_at)),
            )
            db.execute(
                "INSERT INTO reviews (card_id, chapter, rating, state_before, recall_p, reviewed_at, due_after, answer) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (card_id, chapter, rating, state_before, recall_p, _iso(reviewed_at), _iso(due), answer),
            )

    def reviews(self) -> list[dict]:
        """Every review, oldest first."""
        cur = self._db().cursor()
        cur.row_factory = sqlite3.Row
        rows = cur.execute("SELECT * FROM reviews ORDER BY reviewed_at, id").fetchall()
        return [
            {**dict(r), "reviewed_at": _parse(r["reviewed_at"]), "due_after": _parse(r["due_after"])}
            for r in rows
        ]

    def new_cards_seen(self, since: datetime) -> set[str]:
        """The cards first reviewed at or after ``since`` (the daily limit counts these)."""
        db = self._db()
        return {r[0] for r in db.execute("SELECT card_id FROM cards WHERE added_at >= ?", (_iso(since),))}

    # -- grading results (written by course check and selfcheck) --------------------------

    def record_check(
        self, chapter: str, score: float, max_score: float, *, via: str, at: datetime | None = None
    ):
        with self._db() as db:
            db.execute(
                "INSERT INTO checks (chapter, score, max_score, via, at) VALUES (?, ?, ?, ?, ?)",
                (chapter[:2], score, max_score, via, _iso(at or utcnow())),
            )

    def last_checks(self) -> dict[str, CheckRecord]:
        """chapter -> its most recent result, whichever tool produced it."""
        db = self._db()
        rows = db.execute("SELECT chapter, score, max_score, via, at FROM checks ORDER BY at, id").fetchall()
        return {r[0]: CheckRecord(r[0], r[1], r[2], r[3], _parse(r[4])) for r in rows}


def record_check(chapter: str, score: float, max_score: float, *, via: str) -> str | None:
    """What ``course check`` and ``selfcheck`` call. Never raises: a state file that cannot be
    written costs the record, never the grade. Returns the reason when nothing was recorded."""
    if os.environ.get("COURSE_NO_PROGRESS"):
        return "COURSE_NO_PROGRESS is set"
    try:
        with Store() as store:
            store.record_check(chapter, score, max_score, via=via)
    except Exception as err:  # noqa: BLE001 (the grade matters more than the record)
        return f"{type(err).__name__}: {err}"
    return None


# ----------------------------------------------------------------------------- the summary


@dataclass
class ChapterProgress:
    chapter: str
    title: str
    cards: int = 0
    seen: int = 0
    due: int = 0
    mastered: int = 0
    check: CheckRecord | None = None


def summary(store: Store, deck: Iterable, *, now: datetime | None = None) -> list[ChapterProgress]:
    """Per chapter of ``deck`` (cards with ``.id``, ``.chapter``, ``.chapter_title``): cards,
    seen, due now, mastered, and the last graded result."""
    now = now or utcnow()
    stored = {
        r[0]: (_parse(r[1]), r[2])
        for r in store._db().execute("SELECT card_id, due, interval_days FROM cards")
    }
    checks = store.last_checks()
    rows: dict[str, ChapterProgress] = {}
    for card in deck:
        row = rows.setdefault(card.chapter, ChapterProgress(card.chapter, card.chapter_title))
        row.cards += 1
        if card.id in stored:
            due, interval = stored[card.id]
            row.seen += 1
            row.due += due <= now
            row.mastered += interval >= MASTERED.total_seconds() / 86400
    for chapter, record in checks.items():
        rows.setdefault(chapter, ChapterProgress(chapter, "")).check = record
    return [rows[ch] for ch in sorted(rows)]


def _ago(when: datetime, now: datetime) -> str:
    seconds = max(0, (now - when).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return "just now"


def progress_text(store: Store, deck: Iterable, *, now: datetime | None = None) -> str:
    """The table ``course progress`` prints (lines under 100 characters)."""
    now = now or utcnow()
    rows = summary(store, deck, now=now)
    lines = [f"{'chapter':<40} {'last check':<26} {'cards':>5} {'seen':>5} {'due':>4} {'mastered':>8}"]
    for r in rows:
        check = "-"
        if r.check:
            check = f"{r.check.score:g}/{r.check.max_score:g} {_ago(r.check.at, now)}"
        title = f"{r.chapter} {r.title}"[:40]
        lines.append(f"{title:<40} {check:<26} {r.cards:>5} {r.seen:>5} {r.due:>4} {r.mastered:>8}")
    total = [sum(getattr(r, k) for r in rows) for k in ("cards", "seen", "due", "mastered")]
    lines.append(f"{'all chapters':<40} {'':<26} {total[0]:>5} {total[1]:>5} {total[2]:>4} {total[3]:>8}")
    lines.append(f"state: {store.path}")
    return "\n".join(lines)
