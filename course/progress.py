"""The learner's progress across the course, in one SQLite file under their home (chapter 14).

One file holds everything a learner does outside the notebooks' own cells: each drill card's
FSRS memory state, every review, and every ``course check`` / ``selfcheck`` result. It lives
at ``$COURSE_STATE`` when set, else ``$XDG_DATA_HOME/resilient-course/state.sqlite3``
(``~/.local/share/...`` without XDG), never in the repository: a new checkout, a
``git clean`` or a fresh clone of the workbook keeps the learner's history.

    store = Store()                       # the default path, created on first use
    store.record_check("03", 10, 10, via="course check")
    print(progress_text(store, deck))     # per chapter: last score, cards due and mastered

The scheduling itself is :mod:`course.drill` (FSRS); this module stores, and knows the learner's
calendar (:class:`LearnerDay`: which day an instant belongs to, and when a card falls due on it).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta, tzinfo
from pathlib import Path

#: Environment variable naming the state file (``course drill --state PATH`` overrides it too).
ENV = "COURSE_STATE"
#: A card counts as mastered once the scheduler puts its next review this far out (Anki's "mature").
MASTERED = timedelta(days=21)
#: Anki's default: a new day starts at 4 am local time, so a session after midnight still counts as
#: the evening's (Anki manual, Preferences, "Next day starts at").
ROLLOVER_HOUR = 4

SCHEMA = """
CREATE TABLE IF NOT EXISTS cards (
    card_id   TEXT PRIMARY KEY,
    chapter   TEXT NOT NULL,
    fsrs      TEXT NOT NULL,          -- fsrs.Card.to_json(): state, step, stability, difficulty, due
    due       TEXT NOT NULL,          -- ISO 8601, UTC (copied out of fsrs for queries)
    interval_days REAL NOT NULL DEFAULT 0,
    added_at  TEXT NOT NULL,
    version   INTEGER NOT NULL DEFAULT 0  -- reviews applied: a rating updates only the version it read
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
    answer       TEXT NOT NULL DEFAULT '',
    fsrs_before  TEXT,                -- the card's state before (NULL: a new card): what undo restores
    seconds      REAL                 -- time from showing the card to the rating
);
CREATE TABLE IF NOT EXISTS card_flags (
    card_id      TEXT PRIMARY KEY,
    suspended    INTEGER NOT NULL DEFAULT 0,
    buried_until TEXT                 -- a learner's day (YYYY-MM-DD): hidden until it is over
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
#: Columns added after the first release: a state file written by an older copy gains them on open.
MIGRATIONS = [
    ("cards", "version", "INTEGER NOT NULL DEFAULT 0"),
    ("reviews", "fsrs_before", "TEXT"),
    ("reviews", "seconds", "REAL"),
]


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
class LearnerDay:
    """The learner's calendar, as Anki counts it: a day runs from ``rollover`` o'clock local time to
    the next (4 am by default), in ``tz`` (None: this machine's local time, DST included).

    A review card is due on a *day*, not at an instant: reviewed at 08:10 with a 1-day interval, it
    is due all of the next day, from its first minute. The daily new-card limit counts per day too."""

    tz: tzinfo | None = None
    rollover: int = ROLLOVER_HOUR

    def _local(self, when: datetime) -> datetime:
        return when.astimezone(self.tz) if self.tz else when.astimezone()

    def of(self, when: datetime) -> date:
        """The learner's day that ``when`` belongs to (01:30 with a 4 am rollover: the day before)."""
        return (self._local(when) - timedelta(hours=self.rollover)).date()

    def start(self, when: datetime) -> datetime:
        """The instant (UTC) the learner's day of ``when`` began."""
        day = self.of(when)
        local = datetime(day.year, day.month, day.day, self.rollover)
        local = local.replace(tzinfo=self.tz) if self.tz else local.astimezone()
        return local.astimezone(UTC)


def due_day(fsrs_state: dict, day: LearnerDay) -> date | None:
    """The learner's day a card is due on, when its interval is a day or more (a review card);
    None for a card in a learning step of minutes, which is due at its instant."""
    due, last = _parse(fsrs_state["due"]), fsrs_state.get("last_review")
    if not last:
        return None
    interval = (due - _parse(last)).total_seconds() / 86400
    if interval < 1:
        return None
    return day.of(_parse(last)) + timedelta(days=round(interval))


def is_due(fsrs_state: dict, now: datetime, day: LearnerDay) -> bool:
    """A review card on or after its day; a learning card at or after its instant."""
    on = due_day(fsrs_state, day)
    return on <= day.of(now) if on else _parse(fsrs_state["due"]) <= now


@dataclass(frozen=True)
class CheckRecord:
    chapter: str
    score: float
    max_score: float
    via: str
    at: datetime


@dataclass(frozen=True)
class Review:
    """One stored review, as :meth:`Store.review` saved it."""

    id: int
    card_id: str
    fsrs_before: str | None
    fsrs_after: str
    lapses: int  # the card's lapses (Again on a card in review) after this review


class StaleState(Exception):
    """Another session changed the card between the read and the write (never raised inside
    :meth:`Store.review`, whose read and write share one transaction; kept as the guard)."""


class Store:
    """The state file, opened on first use and kept open (WAL mode: a notebook's kernel and
    ``course drill`` in a terminal may use the same file at the same time).

    Every rating is one ``BEGIN IMMEDIATE`` transaction that reads the card's stored state, computes
    the new one from it and writes it with the version it read: a second session rating the same
    card waits for the first and then builds on its result, so no review overwrites another."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path).expanduser() if path else default_path()
        self._conn: sqlite3.Connection | None = None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: transactions are ours (BEGIN IMMEDIATE below), not the module's
            db = sqlite3.connect(self.path, timeout=30, check_same_thread=False, isolation_level=None)
            # WAL with synchronous=NORMAL: a crash never corrupts the file (it may lose the last
            # rating); opening, committing and closing per rating waited 20 ms on the disk
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            for table, column, kind in MIGRATIONS:
                if column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})")}:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            self._conn = db
        return self._conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction that holds SQLite's write lock from its first statement."""
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

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
        return dict(self._db().execute("SELECT card_id, fsrs FROM cards"))

    def card_state(self, card_id: str) -> str | None:
        row = self._db().execute("SELECT fsrs FROM cards WHERE card_id = ?", (card_id,)).fetchone()
        return row[0] if row else None

    def review(
        self,
        card_id: str,
        chapter: str,
        decide: Callable[[str | None], tuple[str, dict]],
        *,
        rating: int,
        reviewed_at: datetime,
        answer: str = "",
        seconds: float | None = None,
    ) -> Review:
        """Apply a rating to the card's *stored* state, in one transaction.

        ``decide(fsrs_json_or_None)`` gets the state as stored now (None: never reviewed) and returns
        the new state's JSON and the review's columns (``state_before``, ``recall_p``). Another
        session's rating of the same card, committed in between, is the state ``decide`` builds on."""
        with self._write() as db:
            row = db.execute("SELECT fsrs, version FROM cards WHERE card_id = ?", (card_id,)).fetchone()
            before, version = (row[0], row[1]) if row else (None, None)
            after, extra = decide(before)
            state = json.loads(after)
            due, last = _parse(state["due"]), state.get("last_review")
            interval = (due - _parse(last)).total_seconds() / 86400 if last else 0.0
            if row is None:
                db.execute(
                    "INSERT INTO cards (card_id, chapter, fsrs, due, interval_days, added_at, version) "
                    "VALUES (?, ?, ?, ?, ?, ?, 1)",
                    (card_id, chapter, after, _iso(due), interval, _iso(reviewed_at)),
                )
            else:
                changed = db.execute(
                    "UPDATE cards SET fsrs = ?, due = ?, interval_days = ?, version = version + 1 "
                    "WHERE card_id = ? AND version = ?",
                    (after, _iso(due), interval, card_id, version),
                ).rowcount
                if changed != 1:
                    raise StaleState(card_id)
            cur = db.execute(
                "INSERT INTO reviews (card_id, chapter, rating, state_before, recall_p, reviewed_at, "
                "due_after, "
                "answer, fsrs_before, seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    card_id,
                    chapter,
                    rating,
                    extra.get("state_before"),
                    extra.get("recall_p"),
                    _iso(reviewed_at),
                    _iso(due),
                    answer,
                    before,
                    seconds,
                ),
            )
            lapses = db.execute(
                "SELECT count(*) FROM reviews WHERE card_id = ? AND rating = 1 AND state_before = 2",
                (card_id,),
            ).fetchone()[0]
        return Review(cur.lastrowid, card_id, before, after, lapses)

    def undo(self, review: Review) -> bool:
        """Take ``review`` back: the card returns to the state it had before it, the review is
        deleted. Refused (False) when another review of that card came after it."""
        with self._write() as db:
            last = db.execute("SELECT max(id) FROM reviews WHERE card_id = ?", (review.card_id,)).fetchone()[
                0
            ]
            if last != review.id:
                return False
            db.execute("DELETE FROM reviews WHERE id = ?", (review.id,))
            if review.fsrs_before is None:
                db.execute("DELETE FROM cards WHERE card_id = ?", (review.card_id,))
            else:
                state = json.loads(review.fsrs_before)
                due, last_review = _parse(state["due"]), state.get("last_review")
                interval = (due - _parse(last_review)).total_seconds() / 86400 if last_review else 0.0
                db.execute(
                    "UPDATE cards SET fsrs = ?, due = ?, interval_days = ?, version = version + 1 "
                    "WHERE card_id = ?",
                    (review.fsrs_before, _iso(due), interval, review.card_id),
                )
        return True

    def reviews(self, card_id: str | None = None) -> list[dict]:
        """Every review (of ``card_id``, or of every card), oldest first."""
        cur = self._db().cursor()
        cur.row_factory = sqlite3.Row
        where, args = ("WHERE card_id = ?", (card_id,)) if card_id else ("", ())
        rows = cur.execute(f"SELECT * FROM reviews {where} ORDER BY reviewed_at, id", args).fetchall()
        return [
            {**dict(r), "reviewed_at": _parse(r["reviewed_at"]), "due_after": _parse(r["due_after"])}
            for r in rows
        ]

    def lapses(self) -> dict[str, int]:
        """card id -> how often it was forgotten once learned (Again on a card in review)."""
        rows = self._db().execute(
            "SELECT card_id, count(*) FROM reviews WHERE rating = 1 AND state_before = 2 GROUP BY card_id"
        )
        return dict(rows)

    def last_notes(self, card_id: str) -> tuple[datetime, str] | None:
        """The learner's last written answer to the card, and when."""
        row = (
            self._db()
            .execute(
                "SELECT reviewed_at, answer FROM reviews WHERE card_id = ? AND answer != '' "
                "ORDER BY id DESC LIMIT 1",
                (card_id,),
            )
            .fetchone()
        )
        return (_parse(row[0]), row[1]) if row else None

    def new_cards_seen(self, since: datetime) -> set[str]:
        """The cards first reviewed at or after ``since``, whatever their chapter (the daily limit
        counts these: one limit a day, not one per ``--chapter`` filter)."""
        db = self._db()
        return {r[0] for r in db.execute("SELECT card_id FROM cards WHERE added_at >= ?", (_iso(since),))}

    # -- suspend and bury ------------------------------------------------------------------

    def flags(self) -> dict[str, tuple[bool, date | None]]:
        """card id -> (suspended, buried until the end of this learner's day or None)."""
        rows = self._db().execute("SELECT card_id, suspended, buried_until FROM card_flags")
        return {r[0]: (bool(r[1]), date.fromisoformat(r[2]) if r[2] else None) for r in rows}

    def suspend(self, card_id: str, suspended: bool = True) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO card_flags (card_id, suspended) VALUES (?, ?) "
                "ON CONFLICT (card_id) DO UPDATE SET suspended = excluded.suspended",
                (card_id, int(suspended)),
            )

    def bury(self, card_id: str, until: date) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO card_flags (card_id, buried_until) VALUES (?, ?) "
                "ON CONFLICT (card_id) DO UPDATE SET buried_until = excluded.buried_until",
                (card_id, until.isoformat()),
            )

    # -- grading results (written by course check and selfcheck) --------------------------

    def record_check(
        self, chapter: str, score: float, max_score: float, *, via: str, at: datetime | None = None
    ):
        with self._write() as db:
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


def summary(
    store: Store,
    deck: Iterable,
    *,
    now: datetime | None = None,
    chapters: dict[str, str] | None = None,
    day: LearnerDay | None = None,
) -> list[ChapterProgress]:
    """Per chapter of ``deck`` (cards with ``.id``, ``.chapter``, ``.chapter_title``): cards,
    seen, due today, mastered, and the last graded result. ``chapters`` ("00" -> its title) lists
    chapters to show even with no card and no result yet (chapter 00, the tour, has no drills)."""
    now, day = now or utcnow(), day or LearnerDay()
    stored = {
        r[0]: (json.loads(r[1]), r[2])
        for r in store._db().execute("SELECT card_id, fsrs, interval_days FROM cards")
    }
    suspended = {cid for cid, (off, _) in store.flags().items() if off}
    checks = store.last_checks()
    rows: dict[str, ChapterProgress] = {
        ch: ChapterProgress(ch, title) for ch, title in (chapters or {}).items()
    }
    for card in deck:
        row = rows.setdefault(card.chapter, ChapterProgress(card.chapter, card.chapter_title))
        row.cards += 1
        if card.id in stored:
            state, interval = stored[card.id]
            row.seen += 1
            row.due += card.id not in suspended and is_due(state, now, day)
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


def progress_text(
    store: Store,
    deck: Iterable,
    *,
    now: datetime | None = None,
    chapters: dict[str, str] | None = None,
    day: LearnerDay | None = None,
) -> str:
    """The table ``course progress`` prints (lines under 100 characters): every chapter of
    ``chapters`` and of ``deck``, checked or not."""
    now = now or utcnow()
    rows = summary(store, deck, now=now, chapters=chapters, day=day)
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
