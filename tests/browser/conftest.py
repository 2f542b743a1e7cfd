"""JupyterLab in a real browser: JupyterLab servers on a copy of the workbook, driven by headless Chromium.

`make test-browser` runs ``tests/browser/setup.sh`` first (Debian's chromium and the playwright
package, never a browser download), then these tests with ``pytest -p no:xdist``. Without
chromium (and no root to install it) or without playwright, every test here is skipped with
the reason.

Two JupyterLab servers share one temporary copy of the workbook (``solutions/``,
``notebooks/`` and an nbgrader config made by ``autograder.settings.apply``):

- the learner's, configured exactly as ``course lab`` configures it (``course.kit.cli.lab_command``:
  the learner's Jupyter config in ``course/kit/jupyter/learner/`` hides formgrader, the "Create
  assignment" toolbar and the news); the chapters run here, their kernels in **quick mode**:
  started with ``NBGRADER_EXECUTION=autograde`` (a kernelspec of this server), so
  ``course.grading()`` is true and every demo shrinks its sizes as it does under nbgrader, the
  hidden test cells of a solution grade it, and ``selfcheck`` says it is skipped;
- the instructor's: nbgrader's extensions as installed, for formgrader.

Each server gets its own Jupyter config, data, runtime, settings and workspace folders, the
settings override in ``overrides.json`` (no news, no autosave, every cell in the DOM), and the
live Redis and PostgreSQL of this test process in its kernels' environment. Servers and their
kernels are stopped at the end. Screenshots go to ``artifacts/screenshots/``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from autograder import settings

from .jlab import (
    AFTER_CLOSE,
    CHROMIUM,
    CHROMIUM_FLAGS,
    OPEN_PAGES,
    REPO,
    SCREENSHOTS,
    STILL,
    VENV_BIN,
    LabServer,
    chapter_name,
    run_tool,
    tool_env,
)

# ----------------------------------------------------------------------------- reporting


@pytest.fixture(scope="session", autouse=True)
def fresh_screenshots():
    """Only this run's screenshots in artifacts/screenshots/ (CI keeps the folder)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for old in SCREENSHOTS.glob("*.png"):
        old.unlink()


#: (chapter, "student" | "solution") of the selected tests, known once collection is over
WANTED = pytest.StashKey[list]()
#: the session's chapter runs, for the summary
RUNS: list = []


def pytest_configure(config):
    config.addinivalue_line("markers", "notebook(kind): the test reads the runs of a chapter's student or solution")


def pytest_collection_modifyitems(items):
    """The chapter tests last: their notebooks start with the session and run while the other tests do.

    A chapter test waits for its chapter's notebooks, which run with every other chapter's, longest
    first: the first one may wait for most of the sweep (with reruns, 20 minutes for all fifteen
    chapters on 2 cores). The jobs time out on their own (a notebook not ready in 120 s, a run not over
    in 300 s), so these tests are not cut by pytest's per-test limit."""
    items.sort(key=lambda item: item.get_closest_marker("notebook") is not None)
    for item in items:
        if item.get_closest_marker("notebook") is not None:
            item.add_marker(pytest.mark.timeout(3 * 3600))


def pytest_runtest_teardown(item):
    """Between tests, move the chapters' tabs on (a finished run starts the next one)."""
    for runs in RUNS:
        runs.tick()


@pytest.fixture(scope="session", autouse=True)
def start_the_chapters(request):
    """Open the first chapters' notebooks and click Run All before the first test, when chapter tests are selected."""
    if request.config.stash.get(WANTED, []):
        request.getfixturevalue("chapter_runs").tick()


def pytest_collection_finish(session):
    """Which notebooks to run: only those of the selected tests (``-k 05`` runs chapter 05's)."""
    wanted = []
    for item in session.items:
        marker = item.get_closest_marker("notebook")
        chapter = getattr(item, "callspec", None) and item.callspec.params.get("chapter")
        # an empty parametrization (no chapter selected for reruns) gives one skipped test whose param is NOTSET
        if marker and isinstance(chapter, str) and (chapter, marker.args[0]) not in wanted:
            wanted.append((chapter, marker.args[0]))
    session.config.stash[WANTED] = wanted


def pytest_terminal_summary(terminalreporter):
    for runs in RUNS:
        terminalreporter.write_sep("-", "chapters in JupyterLab (quick mode), measured")
        for line in runs.table():
            terminalreporter.write_line(line)
    shots = sorted(SCREENSHOTS.glob("*.png"))
    if shots:
        terminalreporter.write_sep("-", "browser screenshots")
        terminalreporter.write_line(f"{len(shots)} screenshots in {SCREENSHOTS}:")
        for shot in shots:
            terminalreporter.write_line(f"  {shot.relative_to(REPO)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """When a browser test fails, keep a screenshot of each page it left open."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when == "call":
        for n, page in enumerate(list(OPEN_PAGES)):
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.name)
            try:
                page.screenshot(path=str(SCREENSHOTS / f"FAILED-{name}-{n}.png"))
            except Exception:  # noqa: BLE001 - a screenshot must not hide the failure
                pass


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def close_pages():
    """Close the pages a test opened, after its failure screenshot; a notebook's kernel goes with it."""
    yield
    while OPEN_PAGES:
        page = OPEN_PAGES.pop()
        page.close()
        AFTER_CLOSE.pop(page, lambda: None)()


@pytest.fixture(scope="session")
def live_env() -> dict[str, str]:
    """The live servers of this process, for the kernels JupyterLab starts (as ``course lab`` does)."""
    from course.kit import backends

    return {**backends.servers().as_env(), "COURSE_BACKEND": "env"}


@pytest.fixture(scope="session")
def workbook(tmp_path_factory) -> Path:
    """A copy of the workbook laid out as the repository, with chapter 00 released to the exchange."""
    root = tmp_path_factory.mktemp("workbook")
    for folder in ("solutions", "notebooks"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns(".*", "__pycache__"))
    settings.write_config(root, f"c.Exchange.root = {str(root / '.exchange')!r}\n")
    (root / ".exchange").mkdir()
    first = chapter_name("00")
    if first:
        data = tmp_path_factory.mktemp("release-data")
        run_tool(
            [str(VENV_BIN / "nbgrader"), "release_assignment", first],
            env=tool_env({"JUPYTER_DATA_DIR": str(data)}),
            cwd=root,
        )
    return root


@pytest.fixture(scope="session")
def learner_lab(workbook, live_env, tmp_path_factory):
    """JupyterLab as ``course lab`` starts it for a learner, its kernels in quick mode (see above)."""
    from course.kit import cli

    _, learner = cli.lab_command([], instructor=False)  # JUPYTER_CONFIG_PATH: the learner's config
    server = LabServer(
        "learner",
        workbook,
        tmp_path_factory.mktemp("learner-lab"),
        {**live_env, **learner},
        kernel_env={"NBGRADER_EXECUTION": "autograde"},
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def instructor_lab(workbook, live_env, tmp_path_factory):
    """JupyterLab as the instructor runs it at the course root: nbgrader's extensions as installed."""
    server = LabServer("instructor", workbook, tmp_path_factory.mktemp("instructor-lab"), live_env).start()
    yield server
    server.stop()


# ----------------------------------------------------------------------------- the browser


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    """Headless Debian Chromium in a fresh profile, through playwright (never a downloaded browser)."""
    if not Path(CHROMIUM).exists():
        pytest.skip(
            f"no Chromium at {CHROMIUM} (install it: sudo apt-get install chromium, or set CHROMIUM); "
            "these tests never download a browser"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (bash tests/browser/setup.sh installs it)")

    pw = sync_playwright().start()
    context = pw.chromium.launch_persistent_context(
        str(tmp_path_factory.mktemp("chromium-profile")),
        executable_path=CHROMIUM,
        headless=True,
        args=CHROMIUM_FLAGS,
        viewport={"width": 1400, "height": 1000},
    )
    context.set_default_timeout(30_000)
    context.add_init_script(STILL)
    yield context
    context.close()
    pw.stop()


# ----------------------------------------------------------------------------- the chapters


@pytest.fixture(scope="session")
def chapter_runs(request, learner_lab, browser):
    """Every selected chapter's notebooks, run in tabs of one browser, ``BROWSER_TABS`` (default 4) at a time."""
    from course.kit import backends

    from .chapters import Runs

    runs = Runs(
        browser,
        learner_lab,
        backends.servers(),
        request.config.stash.get(WANTED, []),
        parallel=int(os.environ.get("BROWSER_TABS", "4")),
    )
    RUNS.append(runs)
    yield runs
    for job in runs.jobs.values():
        if not job.over:
            job.close()
