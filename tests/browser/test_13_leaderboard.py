"""Chapter 13's live leaderboard in headless Chromium: the page connects over Server-Sent Events
and moves when score events arrive, without reloading, and when its "new game" button asks the
service for a burst of its own (on a board it clears first, and says so).

The service is the chapter's Starlette app (``course.chapters.ch13.make_app``) with the
reference ``record`` and ``top_and_rank``, on a scratch namespace of the live servers; score
events go in through its ``POST /scores``, as a game server would send them.
"""

from __future__ import annotations

import time

import httpx
import pytest

from course import leaderboard as lb
from course.chapters import ch13
from course.kit import lab

from .jlab import OPEN_PAGES, screenshot

ROWS = "rows => rows.map(r => [r.dataset.player, Number(r.dataset.points)])"


@pytest.fixture
def live_board():
    with lab.scratch_sync("ch13-browser") as ns:
        app = ch13.make_app(ns, top_and_rank=lb.top_and_rank, record_score=lb.record)
        svc = ch13.LiveService(app, name="browser-13").start()
        try:
            yield svc
        finally:
            svc.stop()


def test_13_the_live_board_moves_in_the_browser_as_scores_arrive(browser, live_board):
    page = browser.new_page()
    OPEN_PAGES.append(page)
    page.goto(live_board.url)
    page.locator("#status.live").wait_for(timeout=15_000)  # the EventSource is open

    sent = iter(range(1000))
    with httpx.Client(base_url=live_board.url, timeout=10) as http:

        def score(player: str, points: int) -> None:
            answer = http.post(
                "/scores", json={"event_id": f"browser-{next(sent)}", "player": player, "points": points}
            )
            assert answer.json() == {"applied": True}, answer.text

        for player, points in [("amy", 30), ("bo", 20), ("cy", 10), ("you", 5)]:
            score(player, points)
        page.wait_for_function("() => document.querySelectorAll('#board tr').length === 4", timeout=5_000)
        assert page.locator("#board tr").evaluate_all(ROWS) == [["amy", 30], ["bo", 20], ["cy", 10], ["you", 5]]
        assert page.locator("#follow").inner_text() == "you are #4"

        updates = int(page.locator("#updates").inner_text())
        started = time.monotonic()
        score("cy", 50)  # cy overtakes everyone; the page must show it without a reload
        page.wait_for_function("() => document.querySelector('#board tr')?.dataset.player === 'cy'", timeout=3_000)
        took = time.monotonic() - started

    rows = page.locator("#board tr").evaluate_all(ROWS)
    assert rows == [["cy", 60], ["amy", 30], ["bo", 20], ["you", 5]], rows
    assert int(page.locator("#updates").inner_text()) > updates
    assert page.locator("#board tr.up").count() == 1  # the changed row flashes
    assert page.locator("#problem").inner_text() == ""
    print(f"the board moved {took:.2f} s after the score event; screenshot {screenshot(page, '13-live-leaderboard')}")

    page.locator("#play").click()  # the server plays a burst itself: the board moves with no cell running
    page.wait_for_function(
        "() => [...document.querySelectorAll('#board tr')].some(r => r.dataset.player.startsWith('player'))",
        timeout=10_000,
    )
    assert page.locator("#problem").inner_text() == ""
    # the page says that it cleared the board: a board back at zero with no word of why reads as a bug
    page.wait_for_function("() => document.querySelector('#game').textContent.startsWith('a new game')", timeout=5_000)
    said = page.locator("#game").inner_text()
    assert said.startswith("a new game: the board starts from zero"), said
    assert "new game" in page.locator("#play").inner_text()


LIVE_CELLS = [
    """from IPython.display import IFrame, display
from course import leaderboard as lb
from course.chapters import ch13
from course.kit import lab

ns = lab.current("13")
pool = await ns.pool()
redis = ns.redis()
await lb.setup_schema(pool)
svc = ch13.LiveService(ch13.make_app(ns, top_and_rank=lb.top_and_rank, record_score=lb.record)).start()
display(IFrame(svc.url, width="100%", height=460))""",
    "await ch13.play(pool, redis, seconds=6.0)",
]


def test_13_the_live_board_moves_inside_jupyterlab(learner_lab, browser):
    """The notebook's way: the page in an IFrame output, moving while a cell generates score events."""
    import nbformat

    from .jlab import Notebook

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in LIVE_CELLS])
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    nbformat.write(nb, learner_lab.root / "13_live_board.ipynb")
    notebook = Notebook(browser, learner_lab, "13_live_board.ipynb")
    before = notebook.start("runmenu:run-all")
    frame = notebook.page.frame_locator(".jp-OutputArea iframe").first
    frame.locator("#status.live").wait_for(timeout=60_000)
    frame.locator("#board tr").first.wait_for(timeout=15_000)  # score events have reached the page
    seen = int(frame.locator("#updates").inner_text())
    deadline = time.monotonic() + 5  # the page is another origin: read it through the frame, not the DOM
    while int(frame.locator("#updates").inner_text()) <= seen:
        assert time.monotonic() < deadline, f"the board in the notebook's output stayed at update {seen} for 5 s"
        time.sleep(0.1)
    print(f"screenshot {screenshot(notebook.page, '13-live-leaderboard-in-jupyterlab')}")
    notebook.settle(before, timeout=120)
