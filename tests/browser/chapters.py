"""Every chapter's notebooks in the learner's JupyterLab, several tabs at once, one browser.

A :class:`Job` is one notebook in one tab with its own kernel:

- ``student``: the released notebook (every answer a stub), Run All once; when a cell stops
  the run, "Run Selected Cell and All Below" from the first cell that did not run, as a
  learner would, so every cell's output is seen;
- ``solution``: the source notebook, Run All once; the notebook is saved (its outputs read
  back from disk) and the connections its kernel holds are counted by the servers (reported).

A student job with ``rerun`` set then runs the chapter twice more, at once, as a learner does who
comes back to it: **Kernel > Restart Kernel and Run All Cells** in its tab (the old kernel's
namespaces, services and server-side state left behind by a kernel that was stopped, not closed
cleanly by the notebook), and **Run All** of a copy of the notebook in a second tab, a second
kernel, while the first kernel is still open (what Validate does: it runs the chapter in a kernel
of its own). Each must reach the last cell as the first run did (:attr:`Job.reruns`).

When a job's runs are over it looks at the page (plots drawn, widgets rendered, a slider
moved where there is one), keeps a screenshot, then closes the tab, which shuts its kernel
down. :class:`Runs` drives up to ``parallel`` jobs at a time from one thread (playwright's
sync API) by polling each tab; the tests only read what the jobs recorded.
"""

from __future__ import annotations

import json
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .jlab import AFTER_CLOSE, OPEN_PAGES, REPO, Notebook, menu, prompt_number, screenshot, steady_connections

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
RUN_TIMEOUT = 300  # one Run All of one notebook, seconds


def chapters() -> list[str]:
    """``NN_slug`` of every chapter whose source notebook is in solutions/ (a chapter being written is not)."""
    return sorted(p.name for p in (REPO / "solutions").glob("[0-9][0-9]_*") if (p / f"{p.name}.ipynb").is_file())


#: What only a browser shows: a widget (a slider redrawing a plot) or a page embedded in the notebook.
INTERACTIVE = re.compile(r"\bipywidgets\b|\bwidgets\.|\bIFrame\(")


def interactive(chapter: str) -> bool:
    """Whether the chapter's solution shows a widget or an embedded page (see :data:`INTERACTIVE`)."""
    nb = read(REPO / "solutions" / chapter / f"{chapter}.ipynb")
    return any(c["cell_type"] == "code" and INTERACTIVE.search("".join(c["source"])) for c in nb["cells"])


def meta(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def code_cells(nb: dict) -> list[tuple[int, dict]]:
    """``(index in the notebook, cell)`` of every code cell."""
    return [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def output_text(out: dict) -> str:
    if out["output_type"] == "stream":
        return "".join(out["text"])
    if out["output_type"] == "error":
        return "\n".join(out.get("traceback") or [f"{out['ename']}: {out['evalue']}"])
    return "".join(out.get("data", {}).get("text/plain", ""))


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def plain(text: str) -> str:
    return ANSI.sub("", text)


@dataclass
class Run:
    """One Run All (and, for a student notebook, the runs below each stop that followed it)."""

    seconds: float
    prompts: list[str]
    runs: int = 1  # clicks it took to reach the last cell
    stopped_at: list[int] = field(default_factory=list)  # code cells (1-based) after which a click stopped
    saved: dict | None = None
    connections: dict[str, int] | None = None


class Job:
    """One notebook in one tab: open it, run it, look at it, close it."""

    def __init__(self, runs: Runs, chapter: str, kind: str):
        self.runs, self.chapter, self.kind = runs, chapter, kind
        folder = "notebooks" if kind == "student" else "solutions"
        self.path = f"{folder}/{chapter}/{chapter}.ipynb"
        self.done: list[Run] = []
        self.state = "waiting"
        self.error: str | None = None
        self.pid: int | None = None
        self.page_problems: list[str] = []  # what the page showed wrong (plots, widgets, slider)
        self.notes: list[str] = []
        self.started = self.finished_at = None
        self.nb: Notebook | None = None
        self.widget_cells: list[int] = []
        self.slider: int | None = None
        self.slider_problem: str | None = None
        self.screenshot: Path | None = None
        self.kernel_cpu: float | None = None  # CPU seconds its kernel (and the kernel's children) used
        self.quick: bool | None = None  # its kernel ran with NBGRADER_EXECUTION=autograde
        self.rerun = False  # a student job: Restart Kernel and Run All, and Run All in a second kernel
        self.reruns: dict[str, Run] = {}  # "restart" and "second kernel": how each ended
        self.rerun_error: str | None = None
        # timeouts count only the time this job was watched: between two tests the tabs are polled, during
        # a long test (a Validate of 100 s) they are not, and a run that ended then must not count as late
        self.watched, self._polled, self._since = 0.0, None, 0.0
        self.second: Notebook | None = None

    @property
    def label(self) -> str:
        return f"{self.chapter} {self.kind}"

    @property
    def over(self) -> bool:
        return self.state in ("done", "failed")

    # the steps ------------------------------------------------------------------------------

    def open(self) -> None:
        self.started = time.perf_counter()
        self.nb = Notebook(self.runs.browser, self.runs.server, self.path, wait=False)
        # this job closes its own tab: a test's clean-up must not close the tabs of other chapters
        OPEN_PAGES.remove(self.nb.page)
        AFTER_CLOSE.pop(self.nb.page, None)
        self.state = "opening"
        self._mark()

    def _mark(self) -> None:
        self._since = self.watched

    def _overdue(self, seconds: float) -> bool:
        return self.watched - self._since > seconds

    def step(self) -> None:
        """Move on if the tab is ready for the next step; never waits for a run to finish."""
        now = time.monotonic()
        self.watched += min(now - self._polled, 2.0) if self._polled is not None else 0.0
        self._polled = now
        try:
            self._step()
        except Exception as err:  # noqa: BLE001 - one tab's trouble must not stop the others
            why = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"
            if self.state in ("second-opening", "restarting", "rerunning"):
                self.rerun_error = why  # the first run stands: only the rerun tests fail
                self._screenshots("FAILED-")
                self.close()
                self.state = "done"
            else:
                self.fail(why)

    def _step(self) -> None:
        nb = self.nb
        if self._dialog():
            return
        if self.state == "opening":
            if not nb.connected():
                if self._overdue(120):
                    raise AssertionError(f"{self.path}: the notebook and its kernel were not ready within 120 s")
                return
            nb.ready()
            self._begin("runmenu:run-all")
        elif self.state == "running":
            prompts = nb.finished()
            if prompts is None:
                if self._overdue(RUN_TIMEOUT):
                    raise AssertionError(f"{self.path}: a run did not finish within {RUN_TIMEOUT} s: {nb.prompts()}")
                return
            self._after_click(prompts)
        elif self.state in ("second-opening", "restarting", "rerunning"):
            self._rerun_step()

    def _dialog(self) -> bool:
        """A dialog over a notebook of this job: a dead kernel fails the job; any other is dismissed.

        "Select Kernel" comes when a click reached a notebook whose kernel was not connected
        yet; answering it would start another kernel. Dismissed, the click ran nothing, and
        :meth:`_after_click` clicks again once the kernel is connected.
        """
        for nb in filter(None, (self.nb, self.second)):
            dialog = nb.page.locator(".jp-Dialog")
            if dialog.count() == 0:
                continue
            text = " ".join(dialog.first.inner_text().split())
            if "died" in text or "dead" in text.lower():
                raise AssertionError(f"{nb.path}: JupyterLab says: {text}")
            self.notes.append(f"{nb.path}: JupyterLab asked {text[:80]!r}; dismissed")
            nb.page.keyboard.press("Escape")
            return True
        return False

    def _begin(self, command: str) -> None:
        self.nb.begin(command)
        self.run_started = time.perf_counter()
        self._mark()
        self.command = command
        if command == "runmenu:run-all":
            self.current = Run(0.0, [])
            self.run_began = self.run_started
            self.highest = self.nb.highest_before  # the numbers of the runs before, for every click of this run
            self.retries = 0
        self.state = "running"

    def _after_click(self, prompts: list[str]) -> None:
        run = self.current
        if not any(prompt_number(p) > self.nb.highest_before for p in prompts):
            # nothing ran: the click met a kernel that was not there yet (see _dialog)
            self.retries += 1
            if self.retries > 3:
                raise AssertionError(f"{self.path}: {self.command} ran no cell, four times: {prompts}")
            self.notes.append(f"{self.path}: {self.command} ran no cell; clicked again")
            self.nb.ready()
            self.nb.begin(self.command)
            self.run_started = time.perf_counter()
            self._mark()
            return
        run.prompts = prompts
        if self.nb.stuck:
            self.notes.append(
                f"{self.path}: JupyterLab kept showing [*] on code cell(s) {[i + 1 for i in self.nb.stuck]} "
                "though the kernel had run every cell and was idle (its reply never reached the page)"
            )
        # a cell the run did not reach keeps its number from an earlier run, or none
        not_run = [i for i, p in enumerate(prompts) if prompt_number(p) <= self.highest and i not in self.nb.stuck]
        if not_run and self.kind == "student" and run.runs <= len(prompts):
            run.stopped_at.append(not_run[0])  # code cell not_run[0] (1-based: the one before it stopped)
            run.runs += 1
            self.nb.select(not_run[0])
            last = not_run[0] == len(prompts) - 1
            self._begin("notebook:run-cell" if last else "notebook:run-all-below")
            return
        if not_run:
            run.stopped_at.append(not_run[0])
        run.seconds = time.perf_counter() - self.run_began
        run.saved = self.nb.saved()
        if self.quick is None:
            self.quick = self.runs.server.kernel_env(self.path).get("NBGRADER_EXECUTION") == "autograde"
        if self.kind == "solution":
            self.pid = self.pid or self.runs.server.kernel_pid(self.path)
            if self.pid:
                run.connections = steady_connections(self.runs.servers, self.pid)
        self.done.append(run)  # one Run All; re-runs in one kernel: tests/test_00_notebook_runs.py
        self.look()
        if self.rerun:
            self._open_second()
            return
        self.close()
        self.state = "done"

    # restart and run all; a second kernel --------------------------------------------------

    @property
    def second_path(self) -> str:
        return f"notebooks/{self.chapter}/{self.chapter}-second-kernel.ipynb"

    def _open_second(self) -> None:
        """A clean copy of the student notebook beside it (same folder, another file: another kernel)."""
        source = REPO / "notebooks" / self.chapter / f"{self.chapter}.ipynb"
        (self.runs.server.root / self.second_path).write_bytes(source.read_bytes())
        self.second = Notebook(self.runs.browser, self.runs.server, self.second_path, wait=False)
        OPEN_PAGES.remove(self.second.page)
        AFTER_CLOSE.pop(self.second.page, None)
        self.state = "second-opening"
        self._mark()

    def _rerun_step(self) -> None:
        nb, second = self.nb, self.second
        if self.state == "second-opening":
            if not second.connected():
                if self._overdue(120):
                    raise AssertionError(f"{self.second_path}: the copy and its kernel were not ready within 120 s")
                return
            second.ready()
            self.rerun_started = time.perf_counter()
            # outputs and numbers cleared first, so that a cell the restarted run never reaches shows
            # "[ ]", not its number from the first run
            menu(nb.page, "Edit", "editmenu:clear-all")
            deadline = time.monotonic() + 15
            while any(re.search(r"\d", p) for p in nb.prompts()):
                assert time.monotonic() < deadline, f"{self.path}: Clear Outputs of All Cells left {nb.prompts()}"
                time.sleep(0.1)
            self._restart_before = nb.prompts()
            second.begin("runmenu:run-all")  # the first kernel is open and idle, with all it started
            menu(nb.page, "Kernel", "runmenu:restart-and-run-all")
            nb.page.locator(".jp-Dialog .jp-mod-accept").click(timeout=15_000)  # "Restart Kernel?"
            self._mark()
            self.state = "restarting"
        elif self.state == "restarting":
            # the restart stops the old kernel (its clean-ups run) before the cells are queued again
            if nb.prompts() == self._restart_before:
                if self._overdue(120):
                    raise AssertionError(f"{self.path}: Restart Kernel and Run All ran no cell within 120 s")
                return
            # over once the prompts differ from the cleared ones, the kernel is idle and no cell shows [*]
            # (a run that ended while no one looked, during a long test, is over at once)
            nb._before, nb.highest_before, nb._last, nb._stuck_since, nb.stuck = self._restart_before, 0, None, None, []
            nb._began = time.perf_counter()
            self._mark()
            self.state = "rerunning"
        elif self.state == "rerunning":
            for name, tab in (("restart", nb), ("second kernel", second)):
                if name in self.reruns:
                    continue
                prompts = tab.finished()
                if prompts is None:
                    if self._overdue(RUN_TIMEOUT):
                        raise AssertionError(f"{tab.path}: {name}: the run did not finish within {RUN_TIMEOUT} s")
                    continue
                not_run = [i for i, p in enumerate(prompts) if not re.search(r"\d", p) and i not in tab.stuck]
                self.reruns[name] = Run(
                    time.perf_counter() - self.rerun_started, prompts, stopped_at=not_run[:1], saved=tab.saved()
                )
                if tab.stuck:
                    self.notes.append(
                        f"{tab.path}: {name}: JupyterLab kept showing [*] on code cell(s) "
                        f"{[i + 1 for i in tab.stuck]} though the kernel was idle"
                    )
            if len(self.reruns) == 2:
                self._screenshots()
                self.close()
                self.state = "done"

    def _screenshots(self, prefix: str = "") -> None:
        for tab, name in ((self.nb, "restarted"), (self.second, "second-kernel")):
            try:
                if tab is not None:
                    self.notes.append(f"screenshot {screenshot(tab.page, f'{prefix}{self.chapter}-student-{name}')}")
            except Exception:  # noqa: BLE001 - a screenshot must not hide what happened
                pass

    def fail(self, why: str) -> None:
        self.error = why
        try:
            if self.nb is not None:
                name = f"FAILED-{self.chapter}-{self.kind}"
                self.notes.append(f"screenshot {screenshot(self.nb.page, name).relative_to(REPO)}")
        except Exception:  # noqa: BLE001 - the screenshot must not hide the failure
            pass
        self.close()
        self.state = "failed"

    def close(self) -> None:
        self.finished_at = time.perf_counter()
        if self.second is not None:
            page, self.second = self.second.page, None
            try:
                page.close()
            finally:
                try:
                    self.runs.server.shutdown_kernels(self.second_path)
                except Exception:  # noqa: BLE001 - the server goes at the end of the session anyway
                    pass
        if self.nb is None:
            return
        self.kernel_cpu = kernel_cpu(self.pid or self.runs.server.kernel_pid(self.path))
        page, self.nb = self.nb.page, None
        try:
            page.close()
        finally:
            try:
                self.runs.server.shutdown_kernels(self.path)
            except Exception:  # noqa: BLE001 - the server goes at the end of the session anyway
                pass

    # the page after the runs ----------------------------------------------------------------

    def look(self) -> None:
        """Plots drawn, widgets rendered, a slider next to a plot redraws it; then a screenshot."""
        nb, saved = self.nb, self.done[-1].saved
        code = code_cells(saved)
        for i, cell in code:
            want = sum("image/png" in o.get("data", {}) for o in cell["outputs"])
            if want:
                drawn = (
                    nb.cell(i)
                    .locator(".jp-RenderedImage img")
                    .evaluate_all("els => els.filter(e => e.complete && e.naturalWidth > 0).length")
                )
                if drawn < want:
                    self.page_problems.append(f"code cell {self.number(i)} has {want} plots, {drawn} drawn in the page")
        self.widget_cells = [i for i, c in code if any(WIDGET_MIME in o.get("data", {}) for o in c["outputs"])]
        for i in self.widget_cells:
            cell = nb.cell(i)
            if cell.locator(".jupyter-widgets").count() == 0:
                self.page_problems.append(f"the widget of code cell {self.number(i)} did not render")
            text = cell.locator(".jp-OutputArea").first.inner_text()
            if "Error displaying widget" in text:
                self.page_problems.append(f"code cell {self.number(i)}: {text[:300]}")
        shown = nb.panel.inner_text()
        if "Traceback (most recent call last)" in shown:
            self.page_problems.append("the page shows 'Traceback (most recent call last)'")
        if self.kind == "solution" and self.widget_cells:
            try:
                self.slider = move_a_slider(nb, self.widget_cells)
            except AssertionError as err:
                self.slider_problem = str(err)
        focus = self.focus(saved)
        if focus is not None:
            nb.cell(focus).scroll_into_view_if_needed()
        self.screenshot = screenshot(nb.page, f"{self.chapter}-{self.kind}")

    def focus(self, saved: dict) -> int | None:
        """The cell to show: the slider, else the first plot (solution); the first task's test cell (student)."""
        if self.kind == "solution":
            if self.slider is not None:
                return self.slider
            plots = [i for i, c in code_cells(saved) if any("image/png" in o.get("data", {}) for o in c["outputs"])]
            return plots[0] if plots else None
        tests = [i for i, c in enumerate(saved["cells"]) if meta(c).get("grade_id", "").startswith("check_")]
        return tests[0] if tests else None

    def number(self, index: int) -> int:
        """The 1-based code cell number (what JupyterLab's prompts count) of notebook cell ``index``."""
        saved = self.done[-1].saved if self.done else None
        if saved is None:
            return index + 1
        return [i for i, _ in code_cells(saved)].index(index) + 1


def kernel_cpu(pid: int | None) -> float | None:
    """CPU seconds used by the kernel ``pid`` and its living children (a load generator, say)."""
    import psutil

    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        total = 0.0
        for p in [proc, *proc.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        return total
    except psutil.Error:
        return None


def image_sources(cell) -> list[str]:
    return cell.locator(".jp-RenderedImage img").evaluate_all("els => els.map(e => e.src)")


def move_a_slider(nb: Notebook, widget_cells: list[int]) -> int | None:
    """Click the track of the first slider whose cell draws a plot; wait for the new plot.

    Returns the cell's index, None when no widget cell has a slider next to a plot.
    """
    for index in widget_cells:
        cell = nb.cell(index)
        if cell.locator(".widget-slider").count() == 0 or cell.locator(".jp-RenderedImage img").count() == 0:
            continue
        before = image_sources(cell)
        handle = cell.locator(".widget-slider .noUi-handle").first
        track = cell.locator(".widget-slider .noUi-base").first
        handle.evaluate("e => e.scrollIntoView({block: 'center'})")
        value_before = handle.get_attribute("aria-valuenow")
        # a click on the track moves the handle there: one change, one redraw (a drag redraws at every step)
        box, bar = handle.bounding_box(), track.bounding_box()
        fraction = (box["x"] + box["width"] / 2 - bar["x"]) / bar["width"]
        track.click(position={"x": bar["width"] * (0.15 if fraction > 0.6 else 0.9), "y": bar["height"] / 2})
        value_after = handle.get_attribute("aria-valuenow")
        assert value_after != value_before, f"clicking the slider's track in cell {index + 1} left it at {value_before}"
        deadline, last, steady = time.monotonic() + 60, None, 0
        while time.monotonic() < deadline:
            now = image_sources(cell)
            steady = steady + 1 if (now and now != before and now == last and nb.status() == "idle") else 0
            if steady >= 4:
                return index
            last = now
            time.sleep(0.25)
        raise AssertionError(
            f"moved the slider in cell {index + 1} from {value_before} to {value_after}; "
            "its plot did not change within 60 s"
        )
    return None


class Runs:
    """The jobs of a session, run ``parallel`` at a time; :meth:`wait` drives them all until one is over."""

    def __init__(self, browser, server, servers, wanted: list[tuple[str, str]], parallel: int):
        self.browser, self.server, self.servers, self.parallel = browser, server, servers, parallel
        # longest first, so that no long job starts last while the other tabs sit idle: the solutions
        # before the students, the later (design) chapters before the earlier ones
        reruns = {chapter for chapter, kind in wanted if kind == "rerun"}
        wanted = [*wanted, *((chapter, "student") for chapter in reruns)]
        order = sorted(
            dict.fromkeys(w for w in wanted if w[1] != "rerun"),
            key=lambda w: (w[1] != "solution", [-ord(c) for c in w[0]]),
        )
        self.jobs = {(chapter, kind): Job(self, chapter, kind) for chapter, kind in order}
        for chapter in reruns:
            self.jobs[(chapter, "student")].rerun = True
        self.started = time.perf_counter()
        self.ended: float | None = None

    def wait(self, chapter: str, kind: str) -> Job:
        """The job once what ``kind`` reads is recorded: its first run ("student", "solution"), or its
        reruns ("rerun": the student job over)."""
        job = self.jobs[(chapter, "student" if kind == "rerun" else kind)]
        while not (job.over or (kind != "rerun" and job.done)):
            self.tick()
            time.sleep(0.5)
        return job

    def tick(self) -> None:
        active = [j for j in self.jobs.values() if j.state not in ("waiting", "done", "failed")]
        for job in self.jobs.values():
            if len(active) >= self.parallel:
                break
            if job.state == "waiting":
                try:
                    job.open()
                except Exception as err:  # noqa: BLE001
                    job.fail(f"could not open {job.path}: {err}")
                    continue
                active.append(job)
        for job in active:
            job.step()
        if all(j.over for j in self.jobs.values()) and self.ended is None:
            self.ended = time.perf_counter()

    def table(self) -> list[str]:
        """Wall time and kernel CPU of each chapter's notebooks, and the connections, for the terminal summary."""
        lines = [
            f"{'chapter':34} {'student s (cpu)':>16} {'solution s (cpu)':>17} {'postgres':>9} {'redis':>6}"
            f" {'restart / 2nd kernel s':>23}"
        ]
        for chapter in sorted({c for c, _ in self.jobs}):
            student, solution = self.jobs.get((chapter, "student")), self.jobs.get((chapter, "solution"))
            s = f"{student.done[0].seconds:.1f} ({_cpu(student)})" if student and student.done else "-"
            runs = (
                "/".join(f"{r.seconds:.1f}" for r in solution.done) + f" ({_cpu(solution)})"
                if solution and solution.done
                else "-"
            )
            pg = rd = "-"
            if solution and solution.done and solution.done[-1].connections:
                held = solution.done[-1].connections
                pg, rd = str(held["postgres"]), str(held["redis"])
            again = "-"
            if student and student.reruns:
                again = " / ".join(
                    f"{student.reruns[k].seconds:.1f}" for k in ("restart", "second kernel") if k in student.reruns
                )
            lines.append(f"{chapter:34} {s:>16} {runs:>17} {pg:>9} {rd:>6} {again:>23}")
        if self.ended is not None:
            cpu = sum(j.kernel_cpu or 0 for j in self.jobs.values())
            lines.append(
                f"all notebooks, {self.parallel} tabs at a time: {self.ended - self.started:.1f} s "
                f"(their kernels used {cpu:.0f} s of CPU)"
            )
        return lines


def _cpu(job: Job) -> str:
    return f"{job.kernel_cpu:.0f}" if job.kernel_cpu is not None else "?"


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))
