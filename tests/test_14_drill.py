"""Chapter 14: the deck read from the chapters, FSRS scheduling through an injected clock, the state
file, the terminal session in a pseudo-terminal, the Anki export, and the progress record."""

from __future__ import annotations

import html
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import fsrs
import pytest

from course import drill, progress
from course.chapters import ch14

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = drill.chapter_notebooks()  # discovered: every chapter in solutions/ (or notebooks/)
DECK = drill.load_deck()  # lenient: a chapter it cannot read fails the tests below, not the import


def _markdown(nb_path: Path) -> list[str]:
    nb = json.loads(nb_path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


def _fold(text: str) -> str:
    return " ".join(
        html.unescape(re.sub(r"</?[A-Za-z][^>]*>|\*\*|`", "", text)).split()
    )  # real tags only: SQL has < and >


# ----------------------------------------------------------------------------- the deck


@pytest.mark.parametrize("chapter", list(NOTEBOOKS))
def test_every_drill_answer_of_every_chapter_is_a_card(chapter):
    """Every <details> block of a chapter (the course's markup for a model answer) is a card of it."""
    summaries = [
        _fold(re.sub(r"^\s*\d+\.\s*", "", _fold(s)))
        for text in _markdown(NOTEBOOKS[chapter])
        for s in re.findall(r"<summary>(.*?)</summary>", text, re.S)
    ]
    fronts = {_fold(c.front) for c in DECK if c.chapter == chapter[:2]}
    missing = [s for s in summaries if s not in fronts]
    assert not missing, f"{chapter}: drills the deck does not hold (is the heading 'Interview drill'?): {missing}"


@pytest.mark.parametrize("chapter", list(NOTEBOOKS))
def test_every_typical_mistake_of_every_chapter_is_a_card(chapter):
    items = []
    for text in _markdown(NOTEBOOKS[chapter]):
        for m in re.finditer(r"^(#+)\s+(?:\d+\.\s*)?Typical mistakes.*$", text, re.M | re.I):
            rest = text[m.end() :]
            nxt = re.search(rf"^#{{1,{len(m.group(1))}}}\s", rest, re.M)
            items += re.findall(r"^\d+\.\s+(.*)$", rest[: nxt.start() if nxt else None], re.M)
    cards = [c for c in DECK if c.chapter == chapter[:2] and c.kind == "mistake"]
    assert len(cards) == len(items), f"{chapter}: {len(items)} typical mistakes, {len(cards)} cards"
    for item, card in zip(items, cards, strict=True):
        assert _fold(card.front) in _fold(item), (card.front, item)


def test_every_chapter_past_the_tour_has_drills_and_mistakes_in_the_deck():
    """Discovered, not listed: a new chapter (09, 10, 11, ...) whose drills the reader misses fails here."""
    for chapter in NOTEBOOKS:
        kinds = {c.kind for c in DECK if c.chapter == chapter[:2]}
        if chapter[:2] == "00":  # the tour has no drills
            continue
        if chapter[:2] == "14":  # the drill chapter's own cards
            assert {"code", "estimate", "design"} <= kinds, kinds
            continue
        assert {"drill", "mistake"} <= kinds, f"{chapter}: the deck holds only {kinds or 'nothing'} from it"


@pytest.mark.parametrize("chapter", list(NOTEBOOKS))
def test_every_chapter_notebook_reads_without_a_deck_error(chapter):
    drill.read_chapter(NOTEBOOKS[chapter])  # raises DeckError naming the file and the fix


def test_every_card_is_found_in_its_chapter():
    """The deck holds no card that no chapter has: each front and answer is in its notebook's text."""
    texts = {ch[:2]: _fold("\n".join(_markdown(nb))) for ch, nb in NOTEBOOKS.items()}
    for card in DECK:
        assert _fold(card.front) in texts[card.chapter], card.id
        assert _fold(card.back.splitlines()[0]) in texts[card.chapter], card.id
    assert len({c.id for c in DECK}) == len(DECK)


def test_chapter_14_has_six_wrong_code_cards_seven_estimates_and_six_design_prompts():
    own = [c for c in DECK if c.chapter == "14"]
    assert sorted(c.kind for c in own) == ["code"] * 6 + ["design"] * 6 + ["estimate"] * 7
    for card in own:
        if card.kind == "code":
            assert card.context.startswith("```python") and card.context.endswith("```"), card.context
        if card.kind == "design":
            assert "**Rubric**" in card.back and "**Model answer.**" in card.back and card.context


def test_a_learners_copy_without_solutions_gives_the_same_deck(tmp_path):
    for chapter in ("03_idempotency", "14_interview_drills"):
        shutil.copytree(REPO / "notebooks" / chapter, tmp_path / "notebooks" / chapter)
    copy = drill.load_deck(tmp_path)
    expected = [c for c in DECK if c.chapter in ("03", "14")]
    assert [(c.id, c.back) for c in copy] == [(c.id, c.back) for c in expected]


def test_editing_a_drill_changes_its_card_and_a_hidden_question_is_refused(tmp_path):
    folder = tmp_path / "solutions" / "03_idempotency"
    shutil.copytree(REPO / "solutions" / "03_idempotency", folder)
    path = folder / "03_idempotency.ipynb"
    text = path.read_text()
    path.write_text(text.replace("Why not SELECT the key first", "Why not read the key first"))
    fronts = [c.front for c in drill.load_deck(tmp_path) if c.kind == "drill"]
    assert any(f.startswith("Why not read the key first") for f in fronts)
    path.write_text(
        text.replace(
            "<summary><b>2. Why not SELECT the key first and INSERT if it is absent?</b>", "<summary>Model answer"
        )
    )
    with pytest.raises(drill.DeckError, match="hides its question outside <summary>"):
        drill.load_deck(tmp_path, strict=True)
    with pytest.warns(UserWarning, match="chapter 03 left out of the deck"):
        assert drill.load_deck(tmp_path) == []


# ----------------------------------------------------------------------------- scheduling


def test_a_scripted_week_of_reviews_gives_the_due_dates_fsrs_gives(tmp_path):
    """Seven simulated days through an injected clock: every due date is fsrs.Scheduler's for the
    same ratings at the same times, and each day's queue is exactly the due cards, then new ones."""
    deck = [c for c in DECK if c.chapter == "03"][:6]
    store = progress.Store(tmp_path / "state.sqlite3")
    clock = ch14.Clock(datetime(2026, 3, 2, 8, 0, tzinfo=UTC))
    ratings = iter([3, 1, 3, 2, 4, 3, 3, 1, 2, 3, 4, 3] * 20)
    reference = fsrs.Scheduler(enable_fuzzing=False)
    plain: dict[str, fsrs.Card] = {}
    for _day in range(7):
        session = drill.Session(deck, store, clock=clock, new_per_day=2)
        due_now = {cid for cid, c in plain.items() if c.due <= clock()}
        first = [c.id for c in session.queue[: len(due_now)]]
        assert set(first) == due_now and all(c.id not in plain for c in session.queue[len(due_now) :])
        while (card := session.next()) is not None:
            rating = next(ratings)
            due = session.rate(card, rating)
            state = plain.get(card.id) or fsrs.Card(card_id=card.fsrs_id, due=clock())
            plain[card.id], _ = reference.review_card(state, fsrs.Rating(rating), clock())
            assert due == plain[card.id].due, (card.id, rating, clock())
            clock.advance(minutes=11)  # past the 10-minute learning step
        clock.now = clock.now.replace(hour=8, minute=0) + timedelta(days=1)
    assert len(plain) == 6  # two new cards a day: all six seen by day 3
    assert len(store.reviews()) >= 14


def test_state_persists_across_a_restart(tmp_path):
    path = tmp_path / "state.sqlite3"
    clock = ch14.Clock()
    with progress.Store(path) as store:
        session = drill.Session(DECK[:3], store, clock=clock)
        card = session.next()
        due = session.rate(card, 4)  # Easy: out of learning, days away
    clock.advance(hours=1)
    again = drill.Session(DECK[:3], progress.Store(path), clock=clock)  # a new process would do the same
    assert card.id not in {c.id for c in again.queue} and not again.is_new(card)
    assert again.states[card.id].due == due
    assert again.counts == {"due": 0, "new": 2}
    out = subprocess.run(
        [sys.executable, "-m", "course.drill", "progress", "--state", str(path), "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=True,
    )
    rows = {r["chapter"]: r for r in json.loads(out.stdout)["chapters"]}
    assert rows[card.chapter]["seen"] == 1


def test_the_state_lives_under_the_learners_home_never_the_repository(monkeypatch, tmp_path):
    monkeypatch.delenv("COURSE_STATE", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert progress.default_path() == tmp_path / "xdg" / "resilient-course" / "state.sqlite3"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert progress.default_path() == tmp_path / "home" / ".local" / "share" / "resilient-course" / "state.sqlite3"
    monkeypatch.setenv("COURSE_STATE", str(tmp_path / "mine.db"))
    assert progress.default_path() == tmp_path / "mine.db"
    assert not progress.default_path().is_relative_to(REPO)


def test_the_daily_limit_counts_new_cards_already_seen_today(tmp_path):
    store = progress.Store(tmp_path / "s.sqlite3")
    clock = ch14.Clock()
    first = drill.Session(DECK[:10], store, clock=clock, new_per_day=3)
    for _ in range(2):
        first.rate(first.next(), 4)
    later = drill.Session(DECK[:10], store, clock=clock.advance(hours=2) and clock, new_per_day=3)
    assert later.counts == {"due": 0, "new": 1}


# ----------------------------------------------------------------------------- the terminal


def test_course_drill_runs_a_review_in_a_pseudo_terminal(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    state = tmp_path / "state.sqlite3"
    child = pexpect.spawn(
        sys.executable,
        ["-m", "course.kit.cli", "drill", "--state", str(state), "--new", "2", "--chapter", "03"],
        cwd=str(REPO),
        encoding="utf-8",
        timeout=30,
        dimensions=(40, 120),
    )
    try:
        child.expect(r"0 due, 2 new")
        child.expect(r"Answer aloud or type notes")
        child.sendline("claim the key first")
        child.expect("model answer")
        child.expect(r"Rate: 1 again \(in 1 minute\)  2 hard .* 3 good \(in 10 minutes\)")
        child.sendline("7")
        child.expect("type 1, 2, 3 or 4")
        child.sendline("3")
        child.expect(r"next review in 10 minutes")
        child.expect(r"Answer aloud or type notes")
        child.sendline("q")
        child.expect(r"reviewed 1 card")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    (review,) = progress.Store(state).reviews()
    assert review["rating"] == 3 and review["answer"] == "claim the key first" and review["chapter"] == "03"


# ----------------------------------------------------------------------------- Anki


def test_the_anki_export_is_a_zip_holding_a_valid_sqlite_with_every_card(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "course.kit.cli", "drill", "--export", str(tmp_path / "d.apkg")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    assert f"wrote {len(DECK)} cards" in out.stdout
    with zipfile.ZipFile(tmp_path / "d.apkg") as z:
        assert z.testzip() is None and "collection.anki2" in z.namelist()
        z.extract("collection.anki2", tmp_path)
    with sqlite3.connect(tmp_path / "collection.anki2") as col:
        assert col.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        notes = col.execute("SELECT guid, flds, tags FROM notes").fetchall()
        cards = col.execute("SELECT count(*) FROM cards").fetchone()[0]
    assert len(notes) == cards == len(DECK)
    assert len({g for g, _, _ in notes}) == len(DECK)
    fields = "\n".join(f for _, f, _ in notes)
    assert "How do you make a payment endpoint safe to retry?" in fields
    assert any("ch14" in t.split() and "design" in t.split() for _, _, t in notes)
    again = drill.export_apkg(DECK, tmp_path / "again.apkg")  # a newer export updates the same notes
    with zipfile.ZipFile(again) as z:
        z.extract("collection.anki2", tmp_path / "again")
    with sqlite3.connect(tmp_path / "again" / "collection.anki2") as col:
        assert {g for (g,) in col.execute("SELECT guid FROM notes")} == {g for g, _, _ in notes}


# ----------------------------------------------------------------------------- progress


def test_course_check_records_its_result_and_course_progress_shows_it(tmp_path, monkeypatch):
    """``course check``'s main records what it printed (grading itself is the contract tests' subject,
    which run it for every chapter: here it is replaced by its result)."""
    from autograder import check

    state = tmp_path / "state.sqlite3"
    monkeypatch.setenv("COURSE_STATE", str(state))
    graded = check.CheckResult(
        "00_setup_and_tour.ipynb", "00_setup_and_tour", 2, 2, tasks=[check.TaskResult("count_visit", 2, 2, True, "ok")]
    )
    monkeypatch.setattr(check, "check", lambda path, sandbox=None: graded)
    assert check.main(["00_setup_and_tour.ipynb", "--json"]) == 0
    (record,) = progress.Store(state).last_checks().values()
    assert (record.chapter, record.score, record.max_score, record.via) == ("00", 2, 2, "course check")
    out = subprocess.run(
        [sys.executable, "-m", "course.kit.cli", "progress", "--state", str(state)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("00 "))
    assert "2/2 just now" in line, out


def test_selfcheck_records_its_total(tmp_path, monkeypatch):
    from autograder import harness

    monkeypatch.setenv("COURSE_STATE", str(tmp_path / "s.sqlite3"))
    harness._record_progress("03", 6, 10)
    assert progress.Store(tmp_path / "s.sqlite3").last_checks()["03"].via == "selfcheck"


def test_a_state_file_that_cannot_be_written_never_breaks_grading(tmp_path, monkeypatch, capsys):
    from autograder import harness

    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("COURSE_STATE", str(tmp_path / "a-file" / "state.sqlite3"))
    assert "Error" in progress.record_check("03", 1, 2, via="selfcheck")
    harness._record_progress("03", 1, 2)  # says nothing, raises nothing
    assert capsys.readouterr().out == ""


def test_a_chapter_without_graded_tasks_says_so_in_selfcheck(capsys):
    from autograder import harness

    assert harness.selfcheck("14", {}) == []
    assert "no graded tasks" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the widget


def test_the_widget_reviews_a_card_by_its_buttons(tmp_path):
    store = progress.Store(tmp_path / "s.sqlite3")
    widget = ch14.DrillWidget([c for c in DECK if c.chapter == "14"], store, clock=ch14.Clock())
    assert all(b.disabled for b in widget.buttons) and "new" in widget.header.value
    widget.show.click()
    assert widget.back.value and widget.buttons[2].description == "Good (in 10 minutes)"
    widget.buttons[2].click()
    assert "Good: next review in 10 minutes" in widget.status.value
    (review,) = store.reviews()
    assert review["rating"] == 3
    design = ch14.DrillWidget([c for c in DECK if c.kind == "design"], store, clock=ch14.Clock())
    assert design.timer.playing and design.notes.layout.display == "none"
