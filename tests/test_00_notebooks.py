"""Every chapter notebook follows the source conventions, and notebooks/ has not drifted."""

import json
import re
from pathlib import Path

import pytest

from autograder import cellnames, check, harness, release

REPO = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(check.chapters())


def _cells(nb):
    for cell in nb["cells"]:
        yield cell, cell.get("metadata", {}).get("nbgrader", {})


def test_there_are_chapters():
    assert "00_setup_and_tour" in CHAPTERS


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_notebooks_are_committed_without_outputs(chapter):
    for folder in ("solutions", "notebooks"):
        nb = json.loads((REPO / folder / chapter / f"{chapter}.ipynb").read_text())
        for cell, _ in _cells(nb):
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{folder}/{chapter} has outputs"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_answer_cell_has_a_graded_test_cell_with_the_registered_points(chapter):
    nb = check.read_notebook(REPO / "solutions" / chapter / f"{chapter}.ipynb")
    assert nb["metadata"]["course"]["chapter"] == chapter
    answers = [m["grade_id"] for c, m in _cells(nb) if m.get("solution") and c["cell_type"] == "code"]
    tests = {m["grade_id"]: m for c, m in _cells(nb) if m.get("grade") and c["cell_type"] == "code"}
    registered = {t.id: t for t in harness.load_chapter(chapter[:2])}
    if not registered and not answers and not tests:  # self-rated: its checks module registers no task (14)
        return
    assert answers, f"{chapter} has no graded task"
    assert set(registered) == set(answers), f"answer cells {answers} vs checks {sorted(registered)}"
    for task_id in answers:
        assert f"check_{task_id}" in tests, f"{task_id} has no test cell check_{task_id}"
        assert tests[f"check_{task_id}"]["points"] == registered[task_id].points


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_hidden_tests_are_one_line_calls_into_autograder(chapter):
    nb = check.read_notebook(REPO / "solutions" / chapter / f"{chapter}.ipynb")
    for cell, meta in _cells(nb):
        if meta.get("grade") and cell["cell_type"] == "code":
            source = "".join(cell["source"])
            hidden = source.split("### BEGIN HIDDEN TESTS")[1].split("### END HIDDEN TESTS")[0].strip()
            assert hidden == f'grade("{meta["grade_id"].removeprefix("check_")}")', hidden


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_demo_cell_rebinds_a_name_that_grading_uses(chapter):
    """Grading runs only the locked, answer and test cells: a demo cell that rebinds one of
    their names (``from course.breaker import CircuitBreaker`` above the answer that defines
    ``CircuitBreaker``) makes the learner's kernel grade something else than the grader does."""
    nb = check.read_notebook(REPO / "solutions" / chapter / f"{chapter}.ipynb")
    graded_binds: dict[str, str] = {}
    graded_uses: set[str] = set()
    demos = []
    for index, (cell, meta) in enumerate(_cells(nb)):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        if meta.get("locked") or meta.get("solution") or meta.get("grade"):
            graded_binds.update(cellnames.bindings(source))
            graded_uses |= cellnames.used(source)
        else:
            demos.append((index, source))
    clashes = [
        f"cell {index} binds {name} ({origin}); grading has {graded_binds.get(name, 'it as a name it uses')}"
        for index, source in demos
        for name, origin in cellnames.bindings(source).items()
        if (name in graded_binds or name in graded_uses) and (origin == "cell" or graded_binds.get(name) != origin)
    ]
    assert not clashes, "\n".join(clashes)


#: Words that point at the course's private source documents, which the learner never has.
#: "seeded randomness" and "seed=5" are honest prose and code; these are not.
SOURCE_DOCUMENTS = re.compile(
    r"seed 00\d|the seeds\b|seed's|seed sketch|seed claims|"
    r"source material|the source this course|design cards?\b|practice task",
    re.IGNORECASE,
)


@pytest.mark.parametrize("chapter", CHAPTERS)
@pytest.mark.parametrize("folder", ["solutions", "notebooks"])
def test_no_cell_refers_to_the_source_documents(folder, chapter):
    """Learners never see the documents the course was written from: cite public sources instead."""
    nb = json.loads((REPO / folder / chapter / f"{chapter}.ipynb").read_text())
    found = []
    for index, cell in enumerate(nb["cells"]):
        text = " ".join("".join(cell["source"]).split())  # a phrase may wrap across source lines
        found += [
            f"cell {index}: ...{text[max(0, m.start() - 40) : m.end() + 40]}..."
            for m in SOURCE_DOCUMENTS.finditer(text)
        ]
    assert not found, f"{folder}/{chapter} refers to the source documents:\n" + "\n".join(found)


@pytest.mark.slow
def test_notebooks_match_what_nbgrader_generates_from_solutions():
    released = release.generate(CHAPTERS)
    drifted = []
    for chapter, folder in released.items():
        fresh = release.normalized(folder / f"{chapter}.ipynb")
        committed = release.normalized(REPO / "notebooks" / chapter / f"{chapter}.ipynb")
        if fresh != committed:
            drifted.append(chapter)
    assert not drifted, f"notebooks/ drifted from solutions/ for {drifted}: run `make release` and commit"


def test_the_code_a_chapter_shows_fits_the_page():
    """``show(x)`` puts course/ code on the page: no line past what JupyterLab shows at 1,400 px."""
    import inspect
    import textwrap

    too_long = []
    for path in sorted((REPO / "solutions").glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb")):
        code = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        names: dict = {}
        for line in (line for src in code for line in src.splitlines()):
            if re.match(r"(import|from) (course|[a-z])", line) and "autograder" not in line:
                exec(line, names)  # the notebook's own imports: what its show(...) calls name
        for expr in (e for src in code for e in re.findall(r"^show\(([\w.]+)\)", src, re.M)):
            source = textwrap.dedent(inspect.getsource(eval(expr, names)))
            too_long += [
                f"{path.stem}: show({expr}): {line.strip()[:60]}..." for line in source.splitlines() if len(line) > 110
            ]
    assert not too_long, "\n".join(too_long)
