"""Chapter 14's drill session in JupyterLab: one review driven by clicks in the chapter's own notebook.

Run All on the solution (quick mode, so the kernel's state file is a throwaway one), then in the
first drill widget: Show answer, then Good; the status line says when the card comes back, and
the review is in the state file the notebook printed.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from .jlab import Notebook, screenshot

NOTEBOOK = "solutions/14_interview_drills/14_interview_drills.ipynb"


def test_14_one_review_by_clicks_in_jupyterlab(learner_lab, browser):
    notebook = Notebook(browser, learner_lab, NOTEBOOK)
    notebook.settle(notebook.start("runmenu:run-all"), timeout=240)
    panel = notebook.panel
    widget = panel.locator(".course-drill").first
    widget.wait_for(timeout=30_000)
    where = widget.locator(".course-drill-where").inner_text()
    assert "new" in where, where

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
