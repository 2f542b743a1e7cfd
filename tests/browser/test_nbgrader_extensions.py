"""nbgrader's JupyterLab extensions: the assignment list for learners, formgrader for the instructor."""

from __future__ import annotations

import shutil

from autograder.check import chapters

from .jlab import Notebook, chapter_name, menu, menu_labels, open_lab, screenshot


def test_learner_gets_the_assignment_list_and_no_formgrader(learner_lab, browser):
    page = open_lab(browser, learner_lab)
    labels = menu_labels(page, "Nbgrader")
    assert labels == ["Assignment List", "Course List"], (
        f"a learner's Nbgrader menu offers {labels}; formgrader and Create assignment should be hidden"
    )
    answer = learner_lab.api("GET", "/formgrader")
    assert answer.status_code == 404, f"/formgrader answers {answer.status_code} on the learner's server"

    released = chapter_name("00")
    menu(page, "Nbgrader", "nbgrader:open-assignment-list")
    listing = page.locator("#released_assignments_list")
    listing.get_by_text(released, exact=True).wait_for(timeout=30_000)
    assert listing.get_by_role("button", name="Fetch").count() >= 1, listing.inner_text()
    print(f"screenshot {screenshot(page, 'nbgrader-assignment-list')}")


def test_formgrader_lists_the_workbook_assignments(instructor_lab, browser):
    page = open_lab(browser, instructor_lab)
    labels = menu_labels(page, "Nbgrader")
    for wanted in ("Formgrader", "Assignment List", "Create assignment"):
        assert wanted in labels, f"the instructor's Nbgrader menu lacks {wanted!r}: {labels}"
    menu(page, "Nbgrader", "nbgrader:open-formgrader")
    frame = page.frame_locator("iframe[src*='formgrader']")
    table = frame.locator("table").first
    names = list(chapters())
    for name in names:
        table.get_by_text(name, exact=True).wait_for(timeout=60_000)
    rows = table.locator("tbody tr").all_inner_texts()
    listed = [r.split()[0] for r in rows if r.strip() and r.split()[0][:2].isdigit()]
    assert sorted(listed) == sorted(names), f"formgrader lists {listed}, the workbook has {names}"
    print(f"screenshot {screenshot(page, 'nbgrader-formgrader')}")


def _validate(page, name: str) -> str:
    """Click the notebook toolbar's Validate, as a learner does, and return the dialog's text."""
    page.locator(".validate-button:visible").first.click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for(timeout=240_000)
    text = dialog.inner_text()
    print(f"screenshot {screenshot(page, name)}")
    page.keyboard.press("Escape")
    return text


def test_validate_says_why_a_chapter_fails_and_passes_the_solution(learner_lab, browser):
    """nbgrader's Validate button must not say "Success!" to a notebook worth 0 points, and its dialog
    must say why: it shows the failing cell's source (the test cell, ``public("count_visit")``) and the
    error, not what the cell printed. A wrong answer whose public checks pass is the hard case: the
    error must name the hidden checks and the answer cell, and carry the [FAIL] line. (An unfinished
    answer's "not done yet" takes the same way: tests/test_00_harness.py.)"""
    import json

    from tests.test_00_grading import GET_THEN_SET

    first = chapter_name("00")
    # copies of their own: a notebook open in two tabs shares one kernel session in JupyterLab, and the
    # chapter runs (test_chapters.py) have these two open at the same time; closing this test's tab shut
    # their kernel down, and saving here raised "File Changed" over their save
    for kind, folder in (("wrong", "notebooks"), ("solution", "solutions")):
        copy = learner_lab.root / "validate" / kind / f"{first}.ipynb"
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(learner_lab.root / folder / first / f"{first}.ipynb", copy)
    wrong = learner_lab.root / "validate" / "wrong" / f"{first}.ipynb"
    nb = json.loads(wrong.read_text())
    (cell,) = [c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "count_visit"]
    cell["source"] = GET_THEN_SET.strip()  # reads, adds one, writes back: loses updates under concurrency
    wrong.write_text(json.dumps(nb, indent=1))
    student = Notebook(browser, learner_lab, f"validate/wrong/{first}.ipynb")
    said = _validate(student.page, "validate-wrong-00")
    words = " ".join(said.split())
    assert "Success" not in said and 'public("count_visit")' in said, said[-1500:]
    assert "count_visit: 0/2 points from the hidden checks" in words, said[-1500:]
    assert "the cell that defines `count_visit`" in words and "[FAIL]" in said and "lost updates" in words, said
    assert "see the lines above" not in said, said[-1500:]
    solution = Notebook(browser, learner_lab, f"validate/solution/{first}.ipynb")
    said = _validate(solution.page, "validate-solution-00")
    assert "Success! Your notebook passes all the tests." in said, said[-1500:]
