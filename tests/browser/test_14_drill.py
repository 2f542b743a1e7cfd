"""Chapter 14's drill session in JupyterLab: one review driven by clicks in the chapter's own notebook,
the design prompt's timer, and the kernel's plots while that timer runs.

Run All on the solution (quick mode, so the kernel's state file is a throwaway one), then in the
first drill widget: Show answer, then Good; the status line says when the card comes back, the
counter of cards left moves, and the review is in the state file the notebook printed. The design
widget's timer started when it was shown, counts whole minutes, and sends nothing to the kernel:
a plot drawn by the kernel while it runs comes out whole, every time.
"""

from __future__ import annotations

import base64
import io
import re
import sqlite3
import time
from pathlib import Path

from .jlab import Notebook, screenshot

NOTEBOOK = "solutions/14_interview_drills/14_interview_drills.ipynb"
SIMULATION_CELL = 8  # the code cell that simulates a month and plots it (c015)


def _plot_is_whole(cell) -> bool:
    """The cell's last PNG output decodes and is not blank (a figure with bars and lines)."""
    import matplotlib.image as mpimg

    src = cell.locator(".jp-OutputArea-output img").last.get_attribute("src") or ""
    if not src.startswith("data:image/png;base64,"):
        return False
    pixels = mpimg.imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")
    return pixels.shape[0] > 100 and pixels.shape[1] > 300 and float(pixels[..., :3].std()) > 0.05


def test_14_one_review_by_clicks_in_jupyterlab(learner_lab, browser):
    notebook = Notebook(browser, learner_lab, NOTEBOOK)
    notebook.settle(notebook.start("runmenu:run-all"), timeout=240)
    panel = notebook.panel
    widget = panel.locator(".course-drill").first
    widget.wait_for(timeout=30_000)
    where = widget.locator(".course-drill-where").inner_text()
    assert "new" in where, where
    left_before = widget.locator(".course-drill-left").inner_text()

    widget.get_by_role("button", name="Show answer").click()
    widget.locator(".course-drill-answer").wait_for(timeout=15_000)
    good = widget.get_by_role("button", name=re.compile(r"^Good \(in "))
    good.wait_for(timeout=15_000)
    assert good.is_enabled()
    good.click()
    status = widget.locator(".course-drill-status")
    status.wait_for(timeout=15_000)
    assert re.match(r"Good: next review in \d+ minutes", status.inner_text()), status.inner_text()
    assert widget.get_by_role("button", name="Show answer").is_enabled()  # the next card is up
    left_after = widget.locator(".course-drill-left").inner_text()
    new_before, new_after = (int(re.match(r"(\d+) new", s).group(1)) for s in (left_before, left_after))
    assert new_after == new_before - 1 and "1 learning" in left_after, (left_before, left_after)

    printed = panel.locator(".jp-OutputArea-output").first.inner_text()
    state = Path(re.search(r"your state file: (\S+)", printed).group(1))
    with sqlite3.connect(state) as db:
        assert db.execute("SELECT rating FROM reviews").fetchall() == [(3,)]
    print(f"screenshot {screenshot(notebook.page, '14-drill-review')}")

    # the wrong-code cards render as a snippet above a closed <details> each
    section = panel.locator(".jp-RenderedMarkdown", has=notebook.page.locator("h2", has_text="What is wrong"))
    section.scroll_into_view_if_needed()
    assert section.locator("details").count() == 6 + 9  # six snippets, nine estimates in the same cell
    assert section.locator("pre").count() == 6
    assert not section.locator("details[open]").count()
    print(f"screenshot {screenshot(notebook.page, '14-wrong-code')}")

    # the design prompt's timer: started when shown, counting whole minutes, drawn by the browser
    design = panel.locator(".course-drill").nth(1)
    elapsed = design.locator(".course-drill-elapsed")
    elapsed.scroll_into_view_if_needed()
    first = elapsed.evaluate("e => e.getAnimations()[0].currentTime")
    time.sleep(1.5)
    later = elapsed.evaluate("e => e.getAnimations()[0].currentTime")
    assert later > first > 0, (first, later)  # running since it was shown, without a click
    minutes = elapsed.evaluate(
        "e => { e.getAnimations()[0].currentTime = 12.5 * 60 * 1000;"
        " return getComputedStyle(e).getPropertyValue('--course-drill-minutes').trim(); }"
    )
    assert minutes == "12", minutes  # 12 whole minutes after 12.5
    print(f"screenshot {screenshot(notebook.page, '14-design-timer')}")

    # while it runs, the kernel's own plots come out whole (the timer sends the kernel nothing)
    simulation = panel.locator(".jp-CodeCell").nth(SIMULATION_CELL)
    for _ in range(3):
        notebook.select(SIMULATION_CELL)
        notebook.settle(notebook.start("notebook:run-cell"), timeout=120)
        assert _plot_is_whole(simulation)
    assert elapsed.evaluate("e => e.getAnimations()[0].playState") == "running"
