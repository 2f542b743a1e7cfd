"""Chapter 14's sessions: FSRS counted in the learner's days, the daily limit, fuzz, design prompts,
two sessions on one state file, undo, leeches, suspend; the terminal in a pseudo-terminal; the Anki
export, imported by the real Anki (the ``anki`` package) with its review history."""

from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
import sys
import threading
import time
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import fsrs
import pytest

from course import drill, progress
from course.chapters import ch14

REPO = Path(__file__).resolve().parent.parent
DECK = drill.load_deck()
DAY = progress.LearnerDay(tz=UTC)  # Anki's rule on a fixed calendar: a day runs from 04:00 to 04:00 UTC


def _session(deck, store, clock, **kwargs):
    kwargs.setdefault("day", DAY)
    kwargs.setdefault("fuzz", False)
    return drill.Session(deck, store, clock=clock, **kwargs)


def _store(tmp_path, name="state.sqlite3"):
    return progress.Store(tmp_path / name)


# ----------------------------------------------------------------------------- days, as Anki counts them


def test_a_scripted_week_gives_fsrs_due_dates_with_elapsed_time_counted_in_days(tmp_path):
    """Seven mornings at 08:00 with 11 minutes per card: every due date is fsrs.Scheduler's for
    the same ratings, the time since the last review counted in the learner's days (Anki's rule),
    and each morning's queue holds exactly the cards due that day, then new ones."""
    deck = [c for c in DECK if c.chapter == "03"][:6]
    store = _store(tmp_path)
    clock = ch14.Clock(datetime(2026, 3, 2, 8, 0, tzinfo=UTC))
    ratings = iter([3, 1, 3, 2, 4, 3, 3, 1, 2, 3, 4, 3] * 20)
    reference = fsrs.Scheduler(enable_fuzzing=False)
    plain: dict[str, fsrs.Card] = {}
    for _day in range(7):
        session = _session(deck, store, clock, new_per_day=2)
        today = DAY.of(clock())
        days = {cid: round((c.due - c.last_review) / timedelta(days=1)) for cid, c in plain.items()}
        due_today = {cid for cid, c in plain.items() if DAY.of(c.last_review) + timedelta(days=days[cid]) <= today}
        assert {c.id for c in session.reviews} == due_today
        assert all(c.id not in plain for c in session.new)
        while (card := session.next()) is not None:
            rating = next(ratings)
            due = session.rate(card, rating)
            state = plain.get(card.id) or fsrs.Card(card_id=card.fsrs_id, due=clock())
            if state.last_review is not None and (days := (today - DAY.of(state.last_review)).days) > 0:
                state.last_review = clock() - timedelta(days=days)  # days, not hours, since the last review
            plain[card.id], _ = reference.review_card(state, fsrs.Rating(rating), clock())
            assert due == plain[card.id].due, (card.id, rating, clock())
            clock.advance(minutes=11)  # past the 10-minute learning step
        clock.now = clock.now.replace(hour=8, minute=0) + timedelta(days=1)
    assert len(plain) == 6  # two new cards a day: all six seen by day 3
    assert len(store.reviews()) >= 14


def test_a_card_reviewed_at_0810_is_due_from_the_first_minute_of_its_day(tmp_path):
    store = _store(tmp_path)
    clock = ch14.Clock(datetime(2026, 3, 2, 8, 10, tzinfo=UTC))
    card = DECK[0]
    session = _session([card], store, clock)
    due = session.rate(card, 4)  # Easy: a review card, days away
    days = round((due - clock()) / timedelta(days=1))
    clock.now = datetime(2026, 3, 2, 8, 0, tzinfo=UTC) + timedelta(days=days)  # 08:00, ten minutes "early"
    assert [c.id for c in _session([card], store, clock).reviews] == [card.id]
    clock.now -= timedelta(hours=4, minutes=1)  # 03:59: still the day before (the day starts at 4 am)
    assert _session([card], store, clock).reviews == []


def test_the_new_card_day_starts_at_4_am_local_time_not_at_utc_midnight(tmp_path):
    """New York, 20 new cards a day: 19:30 (00:30 UTC) and 23:50 are one day; 04:10 is the next."""
    store = _store(tmp_path)
    ny = progress.LearnerDay(tz=ZoneInfo("America/New_York"))
    clock = ch14.Clock(datetime(2026, 3, 3, 0, 30, tzinfo=UTC))  # 19:30 in New York, March 2
    first = _session(DECK, store, clock, day=ny, new_per_day=3)
    while first.new:
        first.rate(first.new[0], 4)
    clock.now = datetime(2026, 3, 3, 4, 50, tzinfo=UTC)  # 23:50 in New York: the same day
    assert _session(DECK, store, clock, day=ny, new_per_day=3).counts["new"] == 0
    clock.now = datetime(2026, 3, 3, 9, 10, tzinfo=UTC)  # 04:10 in New York: a new day
    assert _session(DECK, store, clock, day=ny, new_per_day=3).counts["new"] == 3


def test_the_daily_new_card_limit_is_one_for_the_whole_course_whatever_the_chapter_filter(tmp_path):
    store = _store(tmp_path)
    clock = ch14.Clock()
    first = _session([c for c in DECK if c.chapter == "03"], store, clock, new_per_day=3)
    for _ in range(2):
        first.rate(first.new[0], 4)
    clock.advance(hours=2)
    other = _session([c for c in DECK if c.chapter == "04"], store, clock, new_per_day=3)
    assert other.counts == {"due": 0, "new": 1}


def test_fuzz_spreads_cards_learned_together_and_each_button_says_what_it_gives(tmp_path):
    deck = [c for c in DECK if c.kind == "drill"][:20]
    store = _store(tmp_path)
    clock = ch14.Clock()
    session = _session(deck, store, clock, fuzz=True, new_per_day=20)
    for card in deck:
        session.rate(card, 4)  # Easy: all of them graduate on the same morning
    clock.advance(days=20)
    session = _session(deck, store, clock, fuzz=True)
    dues = set()
    for card in list(session.reviews):
        label = session.preview(card)[3]
        due = session.rate(card, 3)
        assert drill.when(due, clock()) == label
        dues.add(due.date())
    assert len(dues) >= 3, dues  # without fuzz: one day for all twenty
    unfuzzed = {_session(deck, _store(tmp_path, "b.sqlite3"), clock).preview(card)[3] for card in deck}
    assert len(unfuzzed) == 1


def test_a_design_prompt_is_scheduled_in_days_and_never_comes_back_in_the_same_session(tmp_path):
    design = [c for c in DECK if c.kind == "design"][:2]
    store = _store(tmp_path)
    clock = ch14.Clock()
    session = _session(design, store, clock)
    labels = session.preview(design[0])
    assert all(label.endswith(("day", "days")) for label in labels.values()), labels
    session.rate(design[0], 2)  # Hard
    clock.advance(minutes=40)
    assert session.next() is design[1]
    session.rate(design[1], 1)  # Again: tomorrow, not in ten minutes
    assert session.next() is None and session.later() is None


def test_a_card_rated_hard_waits_for_its_step_while_other_cards_are_left(tmp_path):
    deck = [c for c in DECK if c.chapter == "05"][:3]
    store = _store(tmp_path)
    clock = ch14.Clock()
    session = _session(deck, store, clock)
    first = session.next()
    session.rate(first, 2)  # Hard on a new card: a few minutes
    assert session.next() is not first
    assert session.left() == {"new": 2, "learning": 1, "review": 0}
    session.rate(session.next(), 4)  # Easy: out of the session
    assert session.left() == {"new": 1, "learning": 1, "review": 0}


# ----------------------------------------------------------------------------- one state file, two sessions


def test_two_sessions_on_one_state_file_keep_every_review(tmp_path):
    """A terminal and the notebook, both opened before either rated: the second rating of the same
    card builds on the first (the lost update of chapter 10, which the rating's transaction prevents)."""
    card = [c for c in DECK if c.chapter == "03"][0]
    clock = ch14.Clock()
    terminal = _session([card], _store(tmp_path), clock)
    notebook = _session([card], _store(tmp_path), clock)
    terminal.rate(card, 3)
    clock.advance(minutes=11)
    notebook.rate(card, 3)  # its memory still says "new": the stored state says otherwise
    first, second = _store(tmp_path).reviews()
    assert first["state_before"] is None and second["state_before"] == int(fsrs.State.Learning)
    expected, _ = fsrs.Scheduler(enable_fuzzing=False).review_card(
        fsrs.Card.from_json(second["fsrs_before"]), fsrs.Rating.Good, clock()
    )
    assert fsrs.Card.from_json(_store(tmp_path).card_state(card.id)).due == expected.due


def test_two_sessions_rating_at_once_in_threads_lose_no_review(tmp_path):
    card = [c for c in DECK if c.chapter == "04"][0]
    start = threading.Barrier(2)
    errors = []

    def drill_it(clock_start):
        try:
            clock = ch14.Clock(clock_start)
            session = _session([card], _store(tmp_path), clock)
            start.wait()
            for _ in range(15):
                session.rate(card, 3)
                clock.advance(minutes=1)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=drill_it, args=(datetime(2026, 1, 5, 8, i, tzinfo=UTC),)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    store = _store(tmp_path)
    reviews = store.reviews(card.id)
    assert len(reviews) == 30
    version = store._db().execute("SELECT version FROM cards WHERE card_id = ?", (card.id,)).fetchone()[0]
    assert version == 30  # every rating applied to the state the one before it left
    assert [r["fsrs_before"] is None for r in reviews].count(True) == 1  # one "new card" review, not two


def test_undo_restores_the_card_and_refuses_once_another_session_reviewed_it(tmp_path):
    deck = [c for c in DECK if c.chapter == "06"][:2]
    store = _store(tmp_path)
    clock = ch14.Clock()
    session = _session(deck, store, clock)
    card = session.next()
    session.rate(card, 4)
    assert session.undo() is card and session.next() is card and session.is_new(card)
    assert store.reviews() == [] and store.card_state(card.id) is None
    session.rate(card, 3)
    other = _session(deck, _store(tmp_path), clock)
    other.rate(card, 3)
    assert session.undo() is None  # the other session's review came after: nothing is taken back
    assert len(store.reviews()) == 2


def test_a_card_forgotten_eight_times_is_a_leech_and_is_suspended(tmp_path):
    card = DECK[0]
    store = _store(tmp_path)
    clock = ch14.Clock()
    session = _session([card], store, clock)
    session.rate(card, 4)
    for lapse in range(1, 9):
        clock.advance(days=60)
        session = _session([card], store, clock)
        assert session.next() is card
        session.rate(card, 1)  # a lapse
        clock.advance(minutes=11)
        if lapse < 8:
            session.rate(card, 4)
    assert card.id in session.leeches and session.lapses[card.id] == 8
    assert store.flags()[card.id][0] and _session([card], store, clock.advance(days=90) and clock).next() is None


def test_suspend_and_bury_take_a_card_out_for_good_and_for_the_day(tmp_path):
    deck = [c for c in DECK if c.chapter == "07"][:2]
    store = _store(tmp_path)
    clock = ch14.Clock()
    session = _session(deck, store, clock)
    session.suspend(deck[0])
    session.bury(deck[1])
    assert session.next() is None
    assert _session(deck, store, clock.advance(days=1) and clock).queue == [deck[1]]


def test_state_persists_across_a_restart(tmp_path):
    path = tmp_path / "state.sqlite3"
    clock = ch14.Clock()
    with progress.Store(path) as store:
        session = _session(DECK[:3], store, clock)
        card = session.next()
        due = session.rate(card, 4)  # Easy: out of learning, days away
    clock.advance(hours=1)
    again = _session(DECK[:3], progress.Store(path), clock)  # a new process would do the same
    assert card.id not in {c.id for c in again.queue} and not again.is_new(card)
    assert again.states[card.id].due == due
    assert again.counts == {"due": 0, "new": 2}


def test_an_older_state_file_gains_the_new_columns_and_keeps_its_reviews(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE cards (card_id TEXT PRIMARY KEY, chapter TEXT NOT NULL, fsrs TEXT NOT NULL,"
            " due TEXT NOT NULL, interval_days REAL NOT NULL DEFAULT 0, added_at TEXT NOT NULL);"
            "CREATE TABLE reviews (id INTEGER PRIMARY KEY, card_id TEXT NOT NULL, chapter TEXT NOT NULL,"
            " rating INTEGER NOT NULL, state_before INTEGER, recall_p REAL, reviewed_at TEXT NOT NULL,"
            " due_after TEXT NOT NULL, answer TEXT NOT NULL DEFAULT '');"
            "INSERT INTO reviews (card_id, chapter, rating, reviewed_at, due_after)"
            " VALUES ('03-drill-x', '03', 3, '2026-01-05T08:00:00+00:00', '2026-01-05T08:10:00+00:00');"
        )
    (review,) = progress.Store(path).reviews()
    assert review["rating"] == 3 and review["fsrs_before"] is None


# ----------------------------------------------------------------------------- the terminal


def _spawn(state: Path, *args: str):
    pexpect = pytest.importorskip("pexpect")
    return pexpect.spawn(
        sys.executable,
        ["-m", "course.kit.cli", "drill", "--state", str(state), *args],
        cwd=str(REPO),
        encoding="utf-8",
        timeout=30,
        dimensions=(40, 120),
        env={"PATH": "/usr/bin:/bin", "HOME": str(state.parent), "TERM": "dumb", "TZ": "UTC"},
    )


def test_course_drill_takes_a_multi_line_answer_renders_markdown_and_shows_it_next_time(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    state = tmp_path / "state.sqlite3"
    child = _spawn(state, "--new", "1", "--chapter", "3")  # 3, not 03
    try:
        child.expect(r"0 due, 1 new")
        child.expect(r"Your answer \(end with a line holding only '\.'")
        for line in ("claim the key first,", "", "then charge", "."):  # a blank line inside is kept
            child.sendline(line)
        child.expect("model answer")
        child.expect(r"Rate: 1 again \(in 1 minute\)  2 hard .* 3 good \(in 10 minutes\)")
        shown = child.before
        child.sendline("7")
        child.expect("type 1, 2, 3 or 4")
        child.sendline("3")
        child.expect(r"next review in 10 minutes")
        child.expect(r"Your answer")
        child.sendline("")  # Enter alone: straight to the model answer
        child.expect(r"your notes from \d{4}-\d\d-\d\d:")
        child.expect("claim the key first")
        child.expect("Rate:")
        child.sendline("q")
        child.expect(r"reviewed 1 card")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert "**" not in shown and "<details>" not in shown and "<!--" not in shown, shown
    (review,) = progress.Store(state).reviews()
    assert review["rating"] == 3 and review["answer"] == "claim the key first,\n\nthen charge"


def test_course_drill_undoes_suspends_and_refuses_a_negative_limit_in_one_line(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    state = tmp_path / "state.sqlite3"
    bad = subprocess.run(
        [sys.executable, "-m", "course.kit.cli", "drill", "--state", str(state), "--new", "-3"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "--new" in bad.stderr and "-3" in bad.stderr
    child = _spawn(state, "--new", "2", "--chapter", "04")
    try:
        child.expect("Your answer")
        child.sendline("")
        child.expect("Rate:")
        child.sendline("4")
        child.expect("Your answer")
        child.sendline("u")
        child.expect("took back your rating of")
        child.expect("Your answer")
        child.sendline("")
        child.expect("Rate:")
        child.sendline("s")
        child.expect("suspended")
        child.expect("Your answer")
        child.sendline("q")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    store = progress.Store(state)
    assert store.reviews() == [] and sum(off for off, _ in store.flags().values()) == 1


# ----------------------------------------------------------------------------- Anki


def _reviews(tmp_path) -> tuple[progress.Store, list]:
    """A week of reviews of four cards (one suspended), for the exports below."""
    store = _store(tmp_path)
    clock = ch14.Clock(datetime(2026, 3, 2, 8, 0, tzinfo=UTC))
    deck = [c for c in DECK if c.chapter == "03"][:4]
    ratings = itertools.cycle([3, 4, 3, 1, 3, 2])
    for _day in range(7):
        session = _session(deck, store, clock, new_per_day=2)
        while (card := session.next()) is not None:
            session.rate(card, next(ratings))
            clock.advance(minutes=11)
        clock.now = clock.now.replace(hour=8, minute=0) + timedelta(days=1)
    store.suspend(deck[3].id)
    return store, deck


def test_the_anki_export_holds_every_card_and_the_review_log(tmp_path):
    store, reviewed = _reviews(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "course.kit.cli",
            "drill",
            "--state",
            str(store.path),
            "--export",
            str(tmp_path / "d.apkg"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    assert f"wrote {len(DECK)} cards and {len(store.reviews())} reviews" in out.stdout
    with zipfile.ZipFile(tmp_path / "d.apkg") as z:
        assert z.testzip() is None and "collection.anki2" in z.namelist()
        z.extract("collection.anki2", tmp_path)
    with sqlite3.connect(tmp_path / "collection.anki2") as col:
        assert col.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        notes = col.execute("SELECT guid, flds, tags FROM notes").fetchall()
        assert col.execute("SELECT count(*) FROM cards").fetchone()[0] == len(DECK)
        assert col.execute("SELECT count(*) FROM revlog").fetchone()[0] == len(store.reviews())
        assert col.execute("SELECT count(*) FROM cards WHERE queue = -1").fetchone()[0] == 1
    assert len(notes) == len(DECK) and len({g for g, _, _ in notes}) == len(DECK)
    assert "How do you make a payment endpoint safe to retry?" in "\n".join(f for _, f, _ in notes)
    assert any("ch14" in t.split() and "design" in t.split() for _, _, t in notes)


def test_the_export_imports_into_anki_with_its_history_and_a_reworded_card_updates_in_place(tmp_path):
    """The real Anki (the ``anki`` package): the cards keep their due days and the review log; a
    newer export with a question reworded updates that note instead of adding one."""
    anki_collection = pytest.importorskip("anki.collection")
    store, reviewed = _reviews(tmp_path)
    path = drill.export_apkg(DECK, tmp_path / "deck.apkg", store=store, day=DAY)
    (tmp_path / "anki").mkdir()
    col = anki_collection.Collection(str(tmp_path / "anki" / "collection.anki2"))
    try:
        options = anki_collection.ImportAnkiPackageOptions(with_scheduling=True)
        col.import_anki_package(anki_collection.ImportAnkiPackageRequest(package_path=str(path), options=options))
        assert col.note_count() == len(DECK)
        logged = col.db.list("SELECT ease FROM revlog ORDER BY id")
        assert logged == [r["rating"] for r in store.reviews()]  # every rating, as given
        today = DAY.of(datetime.now(UTC))
        for card in reviewed[:3]:  # due on the same day, counted from today, as in the course
            on = progress.due_day(json.loads(store.card_state(card.id)), DAY)
            note = col.find_notes(f'"Source:*#{card.number}*" tag:ch03 tag:mistake')
            due = col.db.scalar(f"SELECT due FROM cards WHERE nid = {note[0]}") - col.sched.today
            assert abs(due - (on - today).days) <= 1, (card.id, due, on)
        assert col.db.scalar("SELECT count(*) FROM cards WHERE queue = -1") == 1  # the suspended one
        assert col.db.scalar("SELECT count(*) FROM cards WHERE type = 2") >= 2  # review cards kept as such
        reworded = [
            c if c.id != reviewed[0].id else drill.Card(**{**c.__dict__, "front": "Reworded: " + c.front}) for c in DECK
        ]
        later = time.time() + 5  # a newer export: Anki updates a note only from a newer one (its default)
        again = drill.export_apkg(reworded, tmp_path / "again.apkg", store=store, day=DAY, timestamp=later)
        col.import_anki_package(anki_collection.ImportAnkiPackageRequest(package_path=str(again), options=options))
        assert col.note_count() == len(DECK)
        assert col.find_notes('"Question:*Reworded:*"')
    finally:
        col.close()


# ----------------------------------------------------------------------------- progress


def test_course_progress_lists_chapter_00_before_it_is_checked(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "course.kit.cli", "progress", "--state", str(tmp_path / "s.sqlite3")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    ).stdout
    assert any(line.startswith("00 Setup and tour") for line in out.splitlines()), out
    rows = json.loads(
        subprocess.run(
            [sys.executable, "-m", "course.drill", "progress", "--state", str(tmp_path / "s.sqlite3"), "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=True,
        ).stdout
    )["chapters"]
    assert rows[0]["chapter"] == "00" and rows[0]["cards"] == 0 and rows[0]["last_check"] is None
