"""Chapters 00 and 01 in JupyterLab, in headless Chromium, the way a learner runs them.

The solution notebook runs top to bottom with no error output, draws its plots, renders its
widgets, and a slider moved with the mouse redraws its plot; its self-check gives full
marks. The student notebook shows NotImplementedError for every stub, and the self-check
run from inside the notebook reports every task as not done.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from .jlab import REPO, Notebook, chapter_name, screenshot

CHAPTERS = ["00", "01"]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _chapter(number: str) -> str:
    name = chapter_name(number)
    if name is None:
        pytest.skip(f"chapter {number} is not written yet: no solutions/{number}_*/{number}_*.ipynb")
    return name


def _meta(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def _tasks(name: str) -> list[str]:
    """The chapter's autograded tasks, from the test cells of its solution notebook."""
    nb = json.loads((REPO / "solutions" / name / f"{name}.ipynb").read_text())
    return [
        _meta(c)["grade_id"].removeprefix("check_")
        for c in nb["cells"]
        if c["cell_type"] == "code" and _meta(c).get("grade") and not _meta(c).get("solution")
    ]


def _text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append("".join(out["text"]))
        elif out["output_type"] == "error":
            parts.append(f"{out['ename']}: {out['evalue']}")
        else:
            parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def _code(nb: dict) -> list[tuple[int, dict]]:
    return [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def _image_sources(cell) -> list[str]:
    return cell.locator(".jp-RenderedImage img").evaluate_all("els => els.map(e => e.src)")


def _move_a_slider(nb: Notebook, widget_cells: list[int]) -> int:
    """Drag the first slider whose cell draws a plot; wait for the new plot. Returns the cell index."""
    for index in widget_cells:
        cell = nb.cell(index)
        if cell.locator(".widget-slider").count() == 0 or cell.locator(".jp-RenderedImage img").count() == 0:
            continue
        before = _image_sources(cell)
        handle = cell.locator(".widget-slider .noUi-handle").first
        track = cell.locator(".widget-slider .noUi-base").first
        handle.evaluate("e => e.scrollIntoView({block: 'center'})")
        value_before = handle.get_attribute("aria-valuenow")
        # a click on the track moves the handle there: one change, one redraw (a drag redraws at every step)
        box, bar = handle.bounding_box(), track.bounding_box()
        fraction = (box["x"] + box["width"] / 2 - bar["x"]) / bar["width"]
        track.click(position={"x": bar["width"] * (0.15 if fraction > 0.6 else 0.9), "y": bar["height"] / 2})
        value_after = handle.get_attribute("aria-valuenow")
        assert value_after != value_before, f"dragging the slider in cell {index + 1} left it at {value_before}"

        deadline, last, steady = time.monotonic() + 60, None, 0
        while time.monotonic() < deadline:
            now = _image_sources(cell)
            steady = steady + 1 if (now and now != before and now == last and nb.status() == "idle") else 0
            if steady >= 4:
                return index
            last = now
            time.sleep(0.25)
        raise AssertionError(
            f"moved the slider in cell {index + 1} from {value_before} to {value_after}; its plot did not change within 60 s"
        )
    nb.cell(widget_cells[0]).scroll_into_view_if_needed()
    raise AssertionError(f"{nb.path}: no slider next to a plot (widget cells: {[i + 1 for i in widget_cells]})")


def _check_solution(nb: Notebook, name: str) -> None:
    """After Run All: no error output, plots drawn, widgets rendered, a slider redraws its plot, full marks."""
    saved = nb.saved()
    code = _code(saved)

    not_run = [i + 1 for i, c in code if not c.get("execution_count")]
    assert not not_run, f"{nb.path}: cells {not_run} did not run"
    errors = [
        f"cell {i + 1}: {o['ename']}: {o['evalue']}"
        for i, c in code
        for o in c["outputs"]
        if o["output_type"] == "error"
    ]
    assert not errors, "error output in the solution notebook:\n" + "\n".join(errors)
    stderr = [
        f"cell {i + 1}: {''.join(o['text'])[:200]}"
        for i, c in code
        for o in c["outputs"]
        if o["output_type"] == "stream" and o["name"] == "stderr"
    ]
    if stderr:
        print("stderr output (shown to the learner in pink):\n" + "\n".join(stderr))

    # plots: every image output is drawn and loaded in the page
    plot_cells = [i for i, c in code if any("image/png" in o.get("data", {}) for o in c["outputs"])]
    assert plot_cells or any(WIDGET_MIME in o.get("data", {}) for _, c in code for o in c["outputs"]), "no plot"
    for i in plot_cells:
        want = sum("image/png" in o.get("data", {}) for o in saved["cells"][i]["outputs"])
        loaded = (
            nb.cell(i)
            .locator(".jp-RenderedImage img")
            .evaluate_all("els => els.filter(e => e.complete && e.naturalWidth > 0).length")
        )
        assert loaded >= want, f"cell {i + 1} has {want} plots, {loaded} drawn in the page"

    # widgets: every widget output renders, and a slider redraws its plot
    widget_cells = [i for i, c in code if any(WIDGET_MIME in o.get("data", {}) for o in c["outputs"])]
    assert widget_cells, f"{nb.path} shows no ipywidgets control"
    for i in widget_cells:
        cell = nb.cell(i)
        assert cell.locator(".jupyter-widgets").count() > 0, f"the widget of cell {i + 1} did not render"
        text = cell.locator(".jp-OutputArea").first.inner_text()
        assert "Error displaying widget" not in text, f"cell {i + 1}: {text[:300]}"
    moved = _move_a_slider(nb, widget_cells)
    nb.cell(moved).scroll_into_view_if_needed()
    print(f"{name}: screenshot {screenshot(nb.page, f'{name}-solution')}")

    # the self-check from inside the notebook gives full marks
    last = _text(saved["cells"][code[-1][0]])
    total = re.search(r"total: ([\d.]+)/([\d.]+)", last)
    assert total and total.group(1) == total.group(2), f"the solution's self-check says:\n{last[-800:]}"


def _check_student(nb: Notebook, name: str) -> None:
    """After running to the end: every stub showed NotImplementedError, the self-check says not done."""
    tasks = _tasks(name)
    saved = nb.saved()
    cells = saved["cells"]
    grade_ids = {_meta(c).get("grade_id"): i for i, c in enumerate(cells) if _meta(c).get("grade_id")}

    for task in tasks:
        answer, test = grade_ids.get(task), grade_ids.get(f"check_{task}")
        assert answer is not None and test is not None, f"{task}: answer or test cell missing"
        shown = "\n".join(_text(c) for c in cells[answer : test + 1])
        assert "NotImplementedError" in shown, (
            f"{task}: running the stub and its test cell showed no NotImplementedError:\n{shown[-600:]}\n"
            "prompts after each run:\n" + "\n".join(" ".join(p) for p in nb.runs)
        )
    assert "NotImplementedError" in nb.panel.inner_text(), "NotImplementedError is not visible in the page"

    last_index = _code(saved)[-1][0]
    assert "selfcheck" in "".join(cells[last_index]["source"]), "the last code cell is not the self-check"
    report = _text(cells[last_index])
    for task in tasks:
        assert re.search(rf"\[\.\.\]\s+{re.escape(task)}\s+0/[\d.]+\s+not done", report), (
            f"the self-check does not report {task} as not done:\n{report[-800:]}"
        )
    assert re.search(r"total: 0/[\d.]+", report), report[-400:]
    shown = nb.cell(last_index)
    shown.scroll_into_view_if_needed()
    assert "not done" in shown.inner_text()
    print(f"{name}: screenshot {screenshot(nb.page, f'{name}-student')}")


@pytest.mark.parametrize("number", CHAPTERS)
def test_chapter_in_jupyterlab(number, learner_lab, browser):
    """The solution and the student notebook of a chapter, each in its own tab and kernel.

    Run All starts in the solution's tab, the student notebook is run to the end in the other
    tab meanwhile (two kernels on two cores), then both are checked.
    """
    name = _chapter(number)
    solution = Notebook(browser, learner_lab, f"solutions/{name}/{name}.ipynb", wait=False)
    student = Notebook(browser, learner_lab, f"notebooks/{name}/{name}.ipynb", wait=False)
    solution.ready(), student.ready()
    started = time.perf_counter()
    before = solution.start("runmenu:run-all")

    runs = student.run_to_the_end()
    print(f"{name}: the student notebook ran to the end in {runs} runs, {time.perf_counter() - started:.1f} s")
    _check_student(student, name)

    solution.settle(before, timeout=300)
    print(f"{name}: the solution's Run All finished after {time.perf_counter() - started:.1f} s")
    _check_solution(solution, name)
