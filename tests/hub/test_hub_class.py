"""A class on JupyterHub, end to end in headless Chromium (docs/INSTRUCTORS.md, "A class on JupyterHub").

The instructor and two learners log in through the hub's login page (PAM, real accounts). The
instructor releases chapter 00 from formgrader; each learner fetches it from the Assignment List,
ada writes ``count_visit`` into its answer cell and bob leaves it unfinished, both Run All and
press Validate (ada: "Success!", bob: "not done yet"), save and submit. The instructor collects,
autogrades each submission and generates and releases feedback from formgrader; the learners fetch
their feedback and open it (ada full marks, bob 0). A learner's server has no formgrader, and a
learner cannot open the instructor's server or the other learner's. Every step keeps a screenshot in
``artifacts/hub/`` and the times are printed at the end.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.browser.jlab import STILL, menu, menu_labels

from .conftest import CH00, REPO, SHOTS, Hub, Person, notebook_cells

pytestmark = pytest.mark.slow

PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
TIMES: dict[str, float] = {}


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def solution(task: str) -> str:
    """The reference answer of ``task`` in chapter 00, as a learner would type it."""
    for cell in notebook_cells(REPO / "solutions" / CH00 / f"{CH00}.ipynb"):
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == task:
            lines = "".join(cell["source"]).splitlines()
            return "\n".join(x for x in lines if x.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
    raise KeyError(task)


def answer_index(task: str) -> int:
    for i, cell in enumerate(notebook_cells(REPO / "notebooks" / CH00 / f"{CH00}.ipynb")):
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == task:
            return i
    raise KeyError(task)


# ----------------------------------------------------------------------------- the hub's pages


def log_in(browser, hub: Hub, person: Person):
    """A fresh browser profile, the hub's login page, until JupyterLab shows: (page, seconds)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(60_000)
    context.add_init_script(STILL)
    page = context.new_page()
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", person.login)
    page.fill("#password_input", person.password)
    started = time.perf_counter()
    page.click("#login_submit")
    page.wait_for_url(re.compile(rf"/user/{re.escape(person.login)}/lab"), timeout=240_000)
    page.locator("#jp-main-dock-panel").wait_for(timeout=120_000)
    page.locator(".jp-Launcher, .jp-NotebookPanel, .jp-DirListing").first.wait_for(timeout=120_000)
    return page, time.perf_counter() - started


def formgrader(page, hub: Hub, path: str = "manage_assignments"):
    page.goto(f"{hub.url}/user/{hub.instructor.login}/formgrader/{path}")
    return page


def click_and_confirm(page, link, what: str, timeout: float = 300_000) -> str:
    """Click a formgrader button and read the dialog it opens; it must say success."""
    link.wait_for()
    link.click()
    modal = page.locator("#success-modal, #error-modal").first
    modal.wait_for(timeout=timeout)
    text = modal.inner_text()
    shot(page, f"instructor-{what}")
    assert modal.get_attribute("id") == "success-modal", f"formgrader's {what}: {text[-3000:]}"
    modal.locator("button").first.click()
    page.locator("#success-modal").wait_for(state="detached", timeout=30_000)
    return text


def assignment_list(page):
    menu(page, "Nbgrader", "nbgrader:open-assignment-list")
    page.locator("#released_assignments_list, #fetched_assignments_list").first.wait_for()
    return page


def open_notebook(page, hub: Hub, person: Person):
    page.goto(f"{hub.url}/user/{person.login}/lab/tree/{CH00}/{CH00}.ipynb")
    panel = page.locator(PANEL)
    panel.wait_for(timeout=120_000)
    page.locator(f"{PANEL} .jp-Notebook-ExecutionIndicator[data-status='idle']").wait_for(timeout=120_000)
    return panel


def output_of(panel, index: int) -> str:
    return panel.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea").inner_text()


# ----------------------------------------------------------------------------- the class


def test_a_class_on_jupyterhub(hub: Hub, browser):
    started = time.perf_counter()
    print(f"\n{hub.said}")
    try:
        _the_class(hub, browser)
    except BaseException:
        print(f"---- the hub's log ----\n{hub.log_tail()}")
        for n, page in enumerate(p for context in browser.contexts for p in context.pages):
            try:
                page.screenshot(path=str(SHOTS / f"FAILED-{n}.png"))
            except Exception:  # noqa: BLE001 - a screenshot must not hide the failure
                pass
        raise
    finally:
        TIMES["the whole class, logins to feedback"] = time.perf_counter() - started
        print("measured: " + "; ".join(f"{what} {t:.1f} s" for what, t in {**hub.seconds, **TIMES}.items()))
        print(f"screenshots: {', '.join(str(p.relative_to(REPO)) for p in sorted(SHOTS.glob('*.png')))}")


def _the_class(hub: Hub, browser) -> None:
    teach, ada, bob = hub.instructor, hub.learners["ada"], hub.learners["bob"]
    assert "course hub: the proxy:" in hub.said and "configuration:" in hub.said, hub.said
    assert "warning" not in hub.said, hub.said  # the class's Python holds no solutions/

    # ---- logins: PAM, each server spawned as its own account
    pages = {}
    for who, person in (("instructor", teach), ("ada", ada), ("bob", bob)):
        pages[who], TIMES[f"login to a ready JupyterLab ({who})"] = log_in(browser, hub, person)
        shot(pages[who], f"{who}-01-logged-in")
    instructor, lab = pages["instructor"], {"ada": pages["ada"], "bob": pages["bob"]}
    labels = menu_labels(instructor, "Nbgrader")
    assert "Formgrader" in labels and "Create assignment" in labels, labels
    for who in ("ada", "bob"):
        assert menu_labels(lab[who], "Nbgrader") == ["Assignment List", "Course List"], who

    # ---- a learner reaches neither formgrader nor another account's server
    spy = lab["ada"].context.new_page()
    answer = spy.goto(f"{hub.url}/user/{ada.login}/formgrader")
    assert answer.status == 404, f"formgrader on ada's own server answered {answer.status}"
    for other in (teach, bob):
        spy.goto(f"{hub.url}/user/{other.login}/lab")
        spy.wait_for_load_state("load")
        body = spy.locator("body").inner_text()
        assert spy.locator("#jp-main-dock-panel").count() == 0, f"ada opened {other.login}'s JupyterLab"
        assert "403" in body, f"ada at {other.login}'s server saw: {body[:500]}"
        shot(spy, f"ada-02-refused-{'instructor' if other is teach else 'bob'}")
    spy.close()

    # ---- the instructor releases chapter 00 from formgrader
    fg = instructor.context.new_page()
    formgrader(fg, hub)
    row = fg.locator("tr", has_text=CH00).first
    row.wait_for()
    click_and_confirm(fg, row.locator("td.release a"), "01-released")
    assert (hub.exchange / "resilient-backend-patterns" / "outbound" / CH00).is_dir()

    # ---- the learners fetch it from the Assignment List, run it, Validate, save and submit
    for who, person in (("ada", ada), ("bob", bob)):
        page = assignment_list(lab[who])
        released = page.locator("#released_assignments_list")
        released.get_by_text(CH00, exact=True).first.wait_for(timeout=60_000)
        shot(page, f"{who}-03-assignment-list")
        released.get_by_role("button", name="Fetch").first.click()
        page.locator("#fetched_assignments_list").get_by_text(CH00, exact=True).first.wait_for(timeout=60_000)
        fetched = person.home / CH00 / f"{CH00}.ipynb"
        assert fetched.exists() and fetched.stat().st_uid == person.uid, f"{who}: nothing fetched at {fetched}"

        panel = open_notebook(page, hub, person)
        task = answer_index("count_visit")
        answer = panel.locator(".jp-Notebook .jp-Cell").nth(task)
        answer.scroll_into_view_if_needed()
        if who == "ada":
            answer.locator(".cm-content").click()
            page.keyboard.press("Control+a")
            page.keyboard.insert_text(solution("count_visit"))
        else:
            answer.locator(".jp-InputPrompt").click()  # the notebook is the current document: Run All applies to it
        menu(page, "Run", "runmenu:run-all")
        expect = "public checks passed" if who == "ada" else "not done yet"
        deadline = time.monotonic() + 180
        while expect not in output_of(panel, task + 2):
            assert time.monotonic() < deadline, f"{who}: the check cell says {output_of(panel, task + 2)!r}"
            time.sleep(0.5)
        shot(page, f"{who}-04-ran-the-task")

        began = time.perf_counter()
        page.locator(".validate-button:visible").first.click()
        dialog = page.locator(".jp-Dialog")
        dialog.wait_for(timeout=300_000)
        said = dialog.inner_text()
        TIMES[f"Validate ({who})"] = time.perf_counter() - began
        shot(page, f"{who}-05-validated")
        page.keyboard.press("Escape")
        if who == "ada":
            assert "Success! Your notebook passes all the tests." in said, said[-1500:]
        else:
            assert "Success" not in said and "not done yet" in said, said[-1500:]

        before = fetched.stat().st_mtime_ns
        menu(page, "File", "docmanager:save")
        deadline = time.monotonic() + 30
        while fetched.stat().st_mtime_ns == before:
            assert time.monotonic() < deadline, f"{who}: saving did not write {fetched}"
            time.sleep(0.2)

        page = assignment_list(page)
        fetched_list = page.locator("#fetched_assignments_list")
        fetched_list.get_by_role("button", name="Submit").first.click()
        page.locator("#submitted_assignments_list").get_by_text(CH00).first.wait_for(timeout=60_000)
        shot(page, f"{who}-06-submitted")

    # ---- the instructor collects, autogrades each submission, generates and releases feedback
    formgrader(fg, hub)
    row = fg.locator("tr", has_text=CH00).first
    said = click_and_confirm(fg, row.locator("td.collect a"), "02-collected")
    assert "left out" not in said, said
    began = time.perf_counter()
    formgrader(fg, hub, f"manage_submissions/{CH00}")
    for person in (ada, bob):
        student = fg.locator("tr", has_text=person.login).first
        click_and_confirm(fg, student.locator("td.autograde a"), f"03-autograded-{person.login.rsplit('-', 1)[1]}")
    TIMES["autograde from formgrader, both submissions"] = time.perf_counter() - began
    fg.reload()
    fg.locator("tr", has_text=ada.login).first.wait_for()
    shot(fg, "instructor-04-submissions")
    scores = _scores(hub.course)
    assert scores[ada.login][0] == scores[ada.login][1] > 0 and scores[bob.login][0] == 0, scores
    formgrader(fg, hub)
    row = fg.locator("tr", has_text=CH00).first
    click_and_confirm(fg, row.locator("td.generate-feedback a"), "05-generated-feedback")
    click_and_confirm(fg, row.locator("td.release-feedback a"), "06-released-feedback")

    # ---- the learners fetch their feedback and see their score
    for who, person in (("ada", ada), ("bob", bob)):
        page = assignment_list(lab[who])
        submitted = page.locator("#submitted_assignments_list")
        submitted.get_by_role("button", name="Fetch Feedback").first.click()
        submitted.get_by_text("(view feedback)").first.wait_for(timeout=60_000)
        shot(page, f"{who}-07-feedback-fetched")
        pages_ = sorted((person.home / CH00 / "feedback").glob(f"*/{CH00}.html"))
        assert pages_, f"{who}: no feedback in {person.home / CH00 / 'feedback'}"
        relative = pages_[-1].relative_to(person.home)
        page.goto(f"{hub.url}/user/{person.login}/lab/tree/{relative}")
        frame = page.frame_locator(".jp-HTMLViewer iframe")
        score = frame.locator("body").get_by_text(re.compile(r"Score:")).first
        score.wait_for(timeout=60_000)
        got, most = scores[person.login]
        text = " ".join(frame.locator("body").inner_text().split())
        assert f"{got:g} / {most:g}" in text or f"{got} / {most}" in text, f"{who}: {text[:400]}"
        shot(page, f"{who}-08-feedback")

    # ---- the idle culler ran beside the hub and read its list of users
    log = hub.log.read_text(errors="replace")
    assert "Starting service 'idle-culler'" in log and "(idle-culler@127.0.0.1)" in log, "the idle culler never ran"


def _scores(course: Path) -> dict[str, tuple[float, float]]:
    """student -> (score, max score) of chapter 00, from the gradebook."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        return {s.student.id: (s.score, s.max_score) for s in gb.assignment_submissions(CH00)}
