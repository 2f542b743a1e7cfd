"""Chapter 14: the deck read from the chapters (stable ids, one card per idea, every card
self-contained), the state file, the progress record and the widget. Sessions, the terminal and
Anki are ``tests/test_14_sessions.py``."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

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
    """Every <details> block of a chapter (the course's markup for a model answer) is a card of it,
    except a block that says it repeats another card (``card: see ...``)."""
    summaries = [
        _fold(re.sub(r"^\s*\d+\.\s*", "", _fold(block.group(1))))
        for text in _markdown(NOTEBOOKS[chapter])
        for block in re.finditer(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", text, re.S)
        if "card: see" not in block.group(2)
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
            section = rest[: nxt.start() if nxt else None]
            for item in re.split(r"^(?=\d+\.\s)", section, flags=re.M):
                if re.match(r"\d+\.\s", item) and "card: see" not in item:
                    items.append(item.splitlines()[0])
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
            assert {"code", "estimate", "design", "drill"} <= kinds, kinds
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


def test_chapter_14_has_wrong_code_estimates_fundamentals_and_eleven_design_prompts():
    own = [c for c in DECK if c.chapter == "14"]
    kinds = sorted(c.kind for c in own)
    assert kinds == ["code"] * 6 + ["design"] * 11 + ["drill"] * 7 + ["estimate"] * 9, kinds
    for card in own:
        if card.kind == "code":
            assert card.context.startswith("```python") and card.context.endswith("```"), card.context


def test_every_design_prompt_has_a_rubric_a_model_answer_and_follow_ups():
    """At least six classic prompts beyond the first six, each in a chapter's drill section."""
    design = [c for c in DECK if c.kind == "design"]
    for card in design:
        assert card.context, card.id  # the prompt's requirements, above its answer
        assert all(part in card.back for part in ("**Rubric**", "**Model answer.**", "**Follow-ups.**")), card.id
    fronts = " ".join(c.front.lower() for c in design)
    for system in ("crawler", "key-value", "file sync", "video", "autocomplete", "ride-hailing", "id generator"):
        assert system in fronts, system
    assert {c.chapter for c in design} >= {"04", "05", "14"}


def test_the_fundamentals_interviews_ask_about_are_cards():
    text = " ".join(f"{c.front} {c.back}" for c in DECK).lower()
    for topic in (
        "dns",
        "cdn",
        "load balanc",
        "replication",
        "raft",
        "lsm-tree",
        "b-tree",
        "object storage",
        "main-memory reference",
    ):
        assert topic in text, topic


def test_a_learners_copy_without_solutions_gives_the_same_deck(tmp_path):
    for chapter in ("03_idempotency", "14_interview_drills"):
        shutil.copytree(REPO / "notebooks" / chapter, tmp_path / "notebooks" / chapter)
    copy = drill.load_deck(tmp_path)
    expected = [c for c in DECK if c.chapter in ("03", "14")]
    assert [(c.id, c.back) for c in copy] == [(c.id, c.back) for c in expected]


def _copy_chapter(tmp_path, chapter="03_idempotency") -> Path:
    folder = tmp_path / "solutions" / chapter
    shutil.copytree(REPO / "solutions" / chapter, folder)
    return folder / f"{chapter}.ipynb"


def test_rewording_a_question_keeps_its_id_and_a_hidden_question_is_refused(tmp_path):
    path = _copy_chapter(tmp_path)
    text = path.read_text()
    before = next(c for c in drill.load_deck(tmp_path) if c.front.startswith("Why not SELECT the key first"))
    path.write_text(text.replace("Why not SELECT the key first", "Why not read the key first"))
    after = next(c for c in drill.load_deck(tmp_path) if c.front.startswith("Why not read the key first"))
    assert after.id == before.id  # the history, and the Anki note, stay with the card
    path.write_text(
        text.replace(
            "<summary><b>2. Why not SELECT the key first and INSERT if it is absent?</b>", "<summary>Model answer"
        )
    )
    with pytest.raises(drill.DeckError, match="hides its question outside <summary>"):
        drill.load_deck(tmp_path, strict=True)
    with pytest.warns(UserWarning, match="chapter 03 left out of the deck"):
        assert drill.load_deck(tmp_path) == []


def test_every_card_has_an_id_written_beside_it_and_no_id_is_used_twice(tmp_path):
    deck = drill.load_deck(strict=True)  # raises on a card without an id, an id twice, a see of nothing
    assert len({c.id for c in deck}) == len(deck)
    path = _copy_chapter(tmp_path)
    text = path.read_text()
    card = next(c for c in deck if c.chapter == "03" and c.kind == "drill")
    path.write_text(text.replace(f"<!-- card: {card.id} -->\\n", "", 1))
    with pytest.raises(drill.DeckError, match=rf"has no id: add the line <!-- card: {card.id} -->"):
        drill.load_deck(tmp_path, strict=True)
    other = next(c for c in deck if c.chapter == "03" and c.kind == "mistake")
    path.write_text(text.replace(f"card: {other.id}", f"card: {card.id}"))
    with pytest.raises(drill.DeckError, match=f"card ids used twice: \\['{card.id}'\\]"):
        drill.load_deck(tmp_path, strict=True)
    path.write_text(text.replace(f"card: {other.id}", "card: see 99-drill-000000000000"))
    with pytest.raises(drill.DeckError, match="'see' references to no card"):
        drill.load_deck(tmp_path, strict=True)


def test_a_repeated_mistake_keeps_its_text_in_its_chapter_and_one_card_in_the_deck():
    """Chapter 05 lists "Retries without jitter" among its mistakes; the deck holds it once, as
    chapter 01's card, which names chapter 05 as another place it comes up."""
    text = "\n".join(_markdown(NOTEBOOKS["05_messaging"]))
    assert "**Retries without jitter.**" in text
    assert not [c for c in DECK if c.chapter == "05" and "jitter" in c.front.lower()]
    jitter = next(c for c in DECK if c.chapter == "01" and c.front == "Why add jitter to retries?")
    assert "05" in jitter.also and "also in" in jitter.source


def test_links_come_from_prose_never_from_code():
    breaker = next(c for c in DECK if c.kind == "code" and "circuit breaker" in c.front.lower())
    assert "http://{service}{path}" in breaker.context
    assert all("{" not in url and "}" not in url for c in DECK for _, url in c.links)
    assert all(url.startswith(("http://", "https://")) and "." in url.split("/")[2] for c in DECK for _, url in c.links)


# ----------------------------------------------------------------------------- what the cards say

#: Phrases that only make sense inside the notebook a card was read from.
NOT_SELF_CONTAINED = re.compile(
    r"\b(shown above|see above|the (?:\w+ ){1,2}above|above\)|above:|section \d|this section|that section|"
    r"the first figure|this chapter|the figure|the plot|the check in (?:that|this))\b",
    re.I,
)


def test_every_card_reads_on_its_own_outside_its_notebook():
    """A card is reviewed weeks later, in a terminal or in Anki: "shown above" or "section 5" point
    at nothing there."""
    found = [
        (c.id, m.group(0)) for c in DECK for m in NOT_SELF_CONTAINED.finditer("\n".join((c.front, c.back, c.context)))
    ]
    assert not found, found


def test_each_mistake_card_names_one_mistake():
    """A card whose question names one mistake holds one: a second bold mistake is a second card."""
    several = [(c.id, re.findall(r"\*\*(.+?)\*\*", c.back)) for c in DECK if c.kind == "mistake"]
    assert not [(cid, bold) for cid, bold in several if len(bold) > 1]


def test_zadd_throughput_is_stated_in_one_card_and_the_others_point_at_it():
    stated = [c.id for c in DECK if re.search(r"(ZADD|sorted.set).{0,120}\b(tens|hundreds) of thousands", c.back, re.S)]
    assert len(stated) <= 1, stated
    assert not [c.id for c in DECK if "tens of thousands" in c.back and "ZADD" in c.back]


def test_fsrs_is_described_as_opt_in_in_anki_where_sm2_is_the_default():
    pages = [(REPO / "README.md").read_text(), "\n".join(_markdown(NOTEBOOKS["14_interview_drills"]))]
    for text in pages:
        assert not re.search(r"replacing SM-2|FSRS is its scheduler|the one Anki uses|Anki adopted", text), text[:80]
    assert "SM-2" in pages[1] and re.search(r"opt-in|turn(ed)? on", pages[1])


def test_the_cards_agree_with_chapters_12_and_13():
    """The leaderboard rebuild merges into the live board (chapter 13: a RENAME of an aside copy
    loses the events recorded meanwhile); links are partitioned by id range if at all (chapter 12:
    a table partitioned by time cannot hold UNIQUE (code))."""
    everything = "\n".join(c.back for c in DECK)
    assert "into a fresh key and swaps it" not in everything
    assert "partitions by creation time" not in everything
    assert "ZADD\nGT` while the game keeps writing" in everything


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
    widget = ch14.DrillWidget([c for c in DECK if c.chapter == "14"], store, clock=ch14.Clock(), fuzz=False)
    assert all(b.disabled for b in widget.buttons) and "new" in widget.header.value
    widget.show.click()
    assert widget.back.value and widget.buttons[2].description == "Good (in 10 minutes)"
    widget.buttons[2].click()
    assert "Good: next review in 10 minutes" in widget.status.value
    (review,) = store.reviews()
    assert review["rating"] == 3
    design = ch14.DrillWidget([c for c in DECK if c.kind == "design"], store, clock=ch14.Clock())
    assert "course-drill-elapsed" in design.timer.value and design.notes.layout.display == "none"


def test_the_widgets_counter_counts_and_a_design_prompt_rated_hard_is_not_served_again(tmp_path):
    store = progress.Store(tmp_path / "s.sqlite3")
    clock = ch14.Clock()
    design = [c for c in DECK if c.kind == "design"][:2]
    widget = ch14.DrillWidget(design, store, clock=clock, new_per_day=2, fuzz=False)
    assert "2 new · 0 learning · 0 review left" in widget.header.value
    first = widget.current
    widget.show.click()
    widget.buttons[1].click()  # Hard
    assert widget.current is not first and "1 new · 0 learning · 0 review left" in widget.header.value
    clock.advance(minutes=36)
    widget.show.click()
    assert "time: 36 of 35 minutes" in widget.back.value  # measured by the kernel, from when it was shown
    widget.buttons[2].click()
    assert widget.current is None and "Done for now" in widget.header.value


def test_the_design_timer_is_drawn_by_the_browser_and_counts_whole_minutes():
    html_ = ch14.timer_html(35, token="t1")
    assert "<script" not in html_ and "2100s" in html_ and "steps(35" in html_
    assert 'content: counter(minutes) " of 35 minutes"' in html_


def test_the_history_keeps_days_without_reviews(tmp_path):
    store = progress.Store(tmp_path / "s.sqlite3")
    clock = ch14.Clock()
    card = DECK[0]
    drill.Session([card], store, clock=clock, day=ch14.DEMO_DAY, fuzz=False).rate(card, 4)
    clock.advance(days=4)
    drill.Session([card], store, clock=clock, day=ch14.DEMO_DAY, fuzz=False).rate(card, 3)
    rows = ch14.history(store, ch14.DEMO_DAY)
    assert [r["new"] + r["review"] + r["learning"] for r in rows] == [1, 0, 0, 0, 1]


def test_your_reviews_plot_redraws_when_the_session_runs_out_of_cards(tmp_path):
    store = progress.Store(tmp_path / "s.sqlite3")
    view = ch14.HistoryView(store)
    widget = ch14.DrillWidget(DECK[:1], store, clock=ch14.Clock(), fuzz=False)
    redrawn = []
    view.redraw = lambda: redrawn.append(len(store.reviews()))  # outside a kernel an Output records nothing
    view.watch(widget)
    widget.show.click()
    widget.buttons[3].click()  # Easy: days away, nothing left in this session
    assert redrawn == [1]


def test_the_design_practice_widget_has_its_own_new_card_allowance(tmp_path):
    store = progress.Store(tmp_path / "s.sqlite3")
    clock = ch14.Clock()
    session = drill.Session([c for c in DECK if c.kind == "drill"][:3], store, clock=clock, new_per_day=3)
    while session.new:
        session.rate(session.new[0], 4)
    design = [c for c in DECK if c.kind == "design"]
    assert ch14.DrillWidget(design, store, clock=clock, new_per_day=3).current is None  # the day's 3 are used
    practice = ch14.DrillWidget(design, store, clock=clock, new_per_day=1, new_limit_per="deck")
    assert practice.current is not None and practice.current.kind == "design"
