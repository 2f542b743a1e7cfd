"""Helpers for driving JupyterLab with headless Chromium (see conftest.py for the fixtures)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SCREENSHOTS = REPO / "artifacts" / "screenshots"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # chapters run in several tabs at once: a tab in the background must render as one in front
    "--disable-background-timer-throttling",
    "--disable-backgrounding-occluded-windows",
    "--disable-renderer-backgrounding",
]
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
#: no CSS animation or transition in the tested pages: a busy kernel's spinner repaints every frame in
#: every tab, which costs a core when several notebooks run at once. The one animation under test is
#: left alone: chapter 14's design timer, a CSS animation (it counts the minutes in the browser).
STILL = """
(() => {
  const keep = ":not(.course-drill-timer *)";
  const css = `*${keep}, *${keep}::before, *${keep}::after { animation: none !important; transition: none !important; }`;
  const add = () => { const s = document.createElement("style"); s.textContent = css; document.head.appendChild(s); };
  if (document.head) add(); else document.addEventListener("DOMContentLoaded", add);
})();
"""
#: pages a test opened: screenshot if it fails, then closed (with their kernels) after it
OPEN_PAGES: list = []
AFTER_CLOSE: dict = {}


def chapter_name(number: str) -> str | None:
    """``solutions/NN_slug/NN_slug.ipynb`` -> ``NN_slug``; None when the chapter is not written yet."""
    for folder in sorted(REPO.glob(f"solutions/{number}_*")):
        if (folder / f"{folder.name}.ipynb").exists():
            return folder.name
    return None


# ----------------------------------------------------------------------------- tools


def tool_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(VENV_BIN) + os.pathsep + env.get("PATH", "")
    env.pop("NBGRADER_EXECUTION", None)
    env.update(extra or {})
    return env


def run_tool(cmd: list[str], *, env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
    )
    return proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- JupyterLab servers


class LabServer:
    """One ``jupyter lab`` process on the workbook copy, with its own Jupyter folders."""

    def __init__(
        self, name: str, root: Path, home: Path, env: dict[str, str], *, kernel_env: dict[str, str] | None = None
    ):
        """``env`` is the server's (and so its kernels'); ``kernel_env`` only its kernels' (a kernelspec)."""
        self.name, self.root, self.home = name, root, home
        self.token = secrets.token_hex(16)
        self.config_dir = home / "config"
        self.config_dir.mkdir(parents=True, exist_ok=True)
        app_settings = home / "app-settings"
        app_settings.mkdir(exist_ok=True)
        shutil.copy(Path(__file__).with_name("overrides.json"), app_settings / "overrides.json")
        self.env = tool_env(
            {
                **env,
                "JUPYTER_CONFIG_DIR": str(self.config_dir),
                "JUPYTER_DATA_DIR": str(home / "data"),
                "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
                "JUPYTERLAB_SETTINGS_DIR": str(home / "user-settings"),
                "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
            }
        )
        # tests/conftest.py sets MPLBACKEND=Agg for nbclient runs; a learner's kernel has the inline backend
        self.env.pop("MPLBACKEND", None)
        self.app_settings = app_settings
        if kernel_env:
            self._kernelspec(kernel_env)
        self.proc: subprocess.Popen | None = None
        self.log = home / "server.log"

    def _kernelspec(self, env: dict[str, str]) -> None:
        """The notebooks' ``python3`` kernel, started with ``env``.

        In a virtualenv Jupyter looks in the venv before the user's data folder (JUPYTER_PREFER_ENV_PATH),
        so the venv's own ``python3`` would win over one in JUPYTER_DATA_DIR: this spec goes in a folder
        on JUPYTER_PATH, which comes before both.
        """
        spec = self.home / "path" / "kernels" / "python3"
        self.env["JUPYTER_PATH"] = os.pathsep.join(
            filter(None, [str(self.home / "path"), self.env.get("JUPYTER_PATH")])
        )
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "Python 3 (ipykernel)",
                    "language": "python",
                    "env": env,
                    "metadata": {"debugger": True},
                },
                indent=1,
            )
        )

    def kernel(self, path: str) -> dict | None:
        """The kernel model (``execution_state``, ``connections``, ...) of the session on ``path``."""
        for session in self.api("GET", "/api/sessions").json():
            if session.get("path") == path and session.get("kernel"):
                return session["kernel"]
        return None

    def kernel_env(self, path: str) -> dict[str, str]:
        """The environment of the kernel of the session on ``path`` (empty if it is not found)."""
        import psutil

        pid = self.kernel_pid(path)
        try:
            return psutil.Process(pid).environ() if pid else {}
        except psutil.Error:
            return {}

    def kernel_pid(self, path: str) -> int | None:
        """The process id of the kernel of the session on ``path`` (found by its connection file)."""
        import psutil

        ids = [s["kernel"]["id"] for s in self.api("GET", "/api/sessions").json() if s.get("path") == path]
        if not ids:
            return None
        wanted = f"kernel-{ids[0]}.json"
        for proc in psutil.process_iter(["cmdline"]):
            if any(arg.endswith(wanted) for arg in proc.info["cmdline"] or ()):
                return proc.pid
        return None

    def jupyter(self, *args: str) -> str:
        """Run a ``jupyter`` command against this server's config folder (as a user would)."""
        return run_tool([str(VENV_BIN / "jupyter"), *args], env=self.env, cwd=self.root)

    def start(self, timeout: float = 90) -> LabServer:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            f"--LabApp.app_settings_dir={self.app_settings}",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=self.env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url("/api/status"), timeout=2).status_code == 200:
                    self.ready_seconds = time.perf_counter() - started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"{self.name} JupyterLab did not answer within {timeout:g} s:\n{self.log_tail()}")

    def url(self, path: str) -> str:
        sep = "&" if "?" in path else "?"
        return f"http://127.0.0.1:{self.port}{path}{sep}token={self.token}"

    def api(self, method: str, path: str) -> httpx.Response:
        return httpx.request(
            method, f"http://127.0.0.1:{self.port}{path}", headers={"Authorization": f"token {self.token}"}, timeout=30
        )

    def shutdown_kernels(self, path: str | None = None) -> None:
        """Shut down the kernels of every session (or of the session on ``path``)."""
        for session in self.api("GET", "/api/sessions").json():
            if path is None or session.get("path") == path:
                self.api("DELETE", f"/api/sessions/{session['id']}")
        if path is None:
            for kernel in self.api("GET", "/api/kernels").json():
                self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.shutdown_kernels()
        except (httpx.HTTPError, ValueError):
            pass
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


# ----------------------------------------------------------------------------- what a kernel holds


def kernel_connections(servers, pid: int) -> dict[str, int]:
    """Connections the kernel ``pid`` holds to its namespaces on the live servers, counted by the servers,
    and how many namespaces (databases) it has.

    PostgreSQL: backends in ``pg_stat_activity`` on the kernel's databases (``lab`` names them
    ``course_<label>_<pid>_<hex>``). Redis: clients in ``CLIENT LIST`` on the logical databases
    the kernel has claimed (``course:namespace:<db>`` records its pid).
    """
    import psycopg
    import redis

    pattern = f"course\\_%\\_{pid}\\_%"
    with psycopg.connect(servers.database_url, autocommit=True, connect_timeout=10) as conn:
        (postgres,) = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND datname LIKE %s",
            (pattern,),
        ).fetchone()
        (databases,) = conn.execute("SELECT count(*) FROM pg_database WHERE datname LIKE %s", (pattern,)).fetchone()
    with redis.Redis.from_url(servers.redis_url, decode_responses=True) as client:
        dbs = set()
        for key in client.scan_iter(match="course:namespace:*", count=1000):
            try:
                if json.loads(client.get(key) or "{}").get("pid") == pid:
                    dbs.add(int(key.rsplit(":", 1)[1]))
            except ValueError:
                continue
        clients = sum(int(c.get("db", -1)) in dbs for c in client.client_list())
    return {"postgres": postgres, "redis": clients, "namespaces": databases}


def steady_connections(servers, pid: int, *, settle: float = 0.5, timeout: float = 10) -> dict[str, int]:
    """:func:`kernel_connections` once two readings ``settle`` s apart agree (a closed pool's backends exit late)."""
    deadline = time.monotonic() + timeout
    last = kernel_connections(servers, pid)
    while time.monotonic() < deadline:
        time.sleep(settle)
        now = kernel_connections(servers, pid)
        if now == last:
            return now
        last = now
    return last


# ----------------------------------------------------------------------------- pages


def open_lab(browser, server: LabServer, tree_path: str = "", *, wait: bool = True):
    """A page on a fresh workspace (a restored one would bring back hidden tabs)."""
    page = browser.new_page()
    OPEN_PAGES.append(page)
    workspace = f"t{time.time_ns()}"
    suffix = f"/tree/{tree_path}" if tree_path else ""
    page.goto(server.url(f"/lab/workspaces/{workspace}{suffix}?reset"), wait_until="load" if wait else "commit")
    if wait:
        page.locator("#jp-main-dock-panel").wait_for(timeout=60_000)
    return page


def menu(page, top: str, command: str, *, attempts: int = 3) -> None:
    """Click a main-menu entry by its JupyterLab command id.

    A click on the menu bar can land while a menu closed by Escape is still going away, and
    Lumino then toggles the menu shut again; so the menu is opened until the entry shows.
    """
    entry = page.locator(f'.lm-Menu-item[data-command="{command}"]:visible').first
    for attempt in range(attempts):
        page.get_by_role("menuitem", name=top, exact=True).click()
        try:
            entry.wait_for(state="visible", timeout=10_000)
        except Exception:
            if attempt == attempts - 1:
                raise
            page.keyboard.press("Escape")
            page.locator(".lm-Menu").first.wait_for(state="hidden", timeout=5_000)
            continue
        entry.click()
        return


def menu_labels(page, top: str) -> list[str]:
    page.get_by_role("menuitem", name=top, exact=True).click()
    page.locator(".lm-Menu").first.wait_for(state="visible")
    labels = page.locator(".lm-Menu .lm-Menu-itemLabel").all_inner_texts()
    page.keyboard.press("Escape")
    page.locator(".lm-Menu").first.wait_for(state="hidden", timeout=5_000)
    return [label.strip() for label in labels if label.strip()]


def screenshot(page, name: str) -> Path:
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


# ----------------------------------------------------------------------------- a notebook in the page


class Notebook:
    """A notebook open in JupyterLab; every selector is scoped to the visible notebook panel."""

    def __init__(self, browser, server: LabServer, path: str, *, wait: bool = True):
        """Open ``path``; with ``wait=False`` call :meth:`ready` later (two notebooks load at once)."""
        self.server, self.path = server, path
        self.page = open_lab(browser, server, path, wait=False)
        self.panel = self.page.locator(PANEL)
        AFTER_CLOSE[self.page] = lambda: server.shutdown_kernels(path)
        if wait:
            self.ready()

    def connected(self) -> bool:
        """Shown, and its kernel started, idle and connected to this page (the server counts the websocket).

        The page's execution indicator alone says "idle" before the kernel exists, and a Run All
        clicked then makes JupyterLab ask which kernel to start.
        """
        if self.panel.count() == 0 or self.status() != "idle":
            return False
        kernel = self.server.kernel(self.path)
        return bool(kernel and kernel.get("execution_state") == "idle" and kernel.get("connections", 0) >= 1)

    def ready(self, timeout: float = 120) -> Notebook:
        """Wait until :meth:`connected`, then close the left sidebar."""
        self.panel.wait_for(timeout=60_000)
        deadline = time.monotonic() + timeout
        while not self.connected():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.path}: its kernel was not idle and connected within {timeout:g} s "
                    f"(page: {self.status()}, server: {self.server.kernel(self.path)})"
                )
            time.sleep(0.3)
        # the file browser takes a third of the screenshots: close the left sidebar
        current = self.page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
        if current.count():
            current.first.click()
        return self

    # state -------------------------------------------------------------------------------

    def prompts(self) -> list[str]:
        # textContent, not innerText: polled every half second in several tabs, it must not force a layout
        texts = self.panel.locator(".jp-CodeCell .jp-InputPrompt").evaluate_all("els => els.map(e => e.textContent)")
        return [t.strip() for t in texts]

    def status(self) -> str | None:
        return self.panel.locator(".jp-Notebook-ExecutionIndicator").first.get_attribute("data-status")

    def settle(self, before: list[str], timeout: float) -> list[str]:
        """Wait until a run has started and finished: prompts changed, none ``[*]``, kernel idle.

        "idle and no ``[*]``" is already true before a run starts, so the prompts must also
        differ from ``before``, and the state must hold for two polls in a row.
        """
        deadline = time.monotonic() + timeout
        last = None
        prompts, status = before, self.status()
        while time.monotonic() < deadline:
            prompts, status = self.prompts(), self.status()
            done = prompts != before and status == "idle" and not any("*" in p for p in prompts)
            if done and prompts == last:
                return prompts
            last = prompts if done else None
            time.sleep(0.3)
        raise AssertionError(
            f"{self.path}: the run did not finish within {timeout:g} s (kernel {status}, prompts {prompts})"
        )

    # running -----------------------------------------------------------------------------

    def start(self, command: str) -> list[str]:
        """Click a Run-menu command and make sure the run started (a cell shows ``[*]`` or ran).

        A click that lands while JupyterLab is still wiring up the notebook is sometimes
        dropped; nothing has been queued then, so clicking again cannot run a cell twice.
        """
        before = self.prompts()
        for _ in range(3):
            menu(self.page, "Run", command)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                now = self.prompts()
                if now != before:
                    return before
                time.sleep(0.1)
        raise AssertionError(f"{self.path}: {command} was clicked three times and no cell started")

    def begin(self, command: str = "runmenu:run-all") -> None:
        """Start a run and return at once; :meth:`finished` tells when it is over."""
        self._before = self.start(command)
        #: the highest execution count before this click: a prompt above it ran in this run
        self.highest_before = max(map(prompt_number, self._before), default=0)
        self._last = None
        self._began = time.perf_counter()
        self._stuck_since = None
        self.stuck: list[int] = []

    #: How long a run may look over but for a cell still showing ``[*]`` before it counts as over.
    STUCK_AFTER = 20.0

    def finished(self) -> list[str] | None:
        """The prompts once the run :meth:`begin` started is over (as :meth:`settle` decides), else None.

        Now and then JupyterLab never receives a cell's reply: the kernel has run that cell and
        every one after it and is idle, the last cell has its number, yet the cell keeps showing
        ``[*]``. Unchanged for :data:`STUCK_AFTER` s, the run counts as over, and :attr:`stuck`
        lists those cells (0-based code cell numbers) for the report.
        """
        prompts, status = self.prompts(), self.status()
        busy = [i for i, p in enumerate(prompts) if "*" in p]
        done = prompts != self._before and status == "idle" and not busy
        if done and prompts == self._last:
            return prompts
        self._last = prompts if done else None
        looks_over = status == "idle" and busy and prompts and prompt_number(prompts[-1]) > self.highest_before
        if not looks_over:
            self._stuck_since = None
        elif self._stuck_since is None or prompts != self._stuck_prompts:
            self._stuck_since, self._stuck_prompts = time.monotonic(), prompts
        elif time.monotonic() - self._stuck_since > self.STUCK_AFTER:
            self.stuck = busy
            return prompts
        return None

    def run_all(self, timeout: float = 300) -> list[str]:
        return self.settle(self.start("runmenu:run-all"), timeout)

    def run_to_the_end(self, timeout: float = 300) -> int:
        """Run All, then carry on below each cell that stopped the run, as a learner would.

        An error stops Run All: the kernel drops the cells queued after it (under load a few
        may slip through and run anyway), so the next run starts at the first cell that has
        not run. Returns how many runs it took.
        """
        prompts = self.run_all(timeout)
        self.runs = [prompts]
        runs = 1
        while True:
            not_run = [i for i, p in enumerate(prompts) if not re.search(r"\d", p)]
            if not not_run:
                return runs
            following = not_run[0]
            self.select(following)
            # "Run Selected Cell and All Below" is disabled on the last cell: run that one alone
            last = following == len(prompts) - 1
            prompts = self.settle(self.start("notebook:run-cell" if last else "notebook:run-all-below"), timeout)
            self.runs.append(prompts)
            runs += 1
            assert runs <= len(prompts) + 1, f"{self.path}: cells keep stopping the run: {prompts}"

    def select(self, code_index: int) -> None:
        """Make the code_index-th code cell the active one (command mode)."""
        cell = self.panel.locator(".jp-CodeCell").nth(code_index)
        for _ in range(3):
            cell.locator(".jp-InputPrompt").click()
            if "jp-mod-active" in (cell.get_attribute("class") or ""):
                return
            time.sleep(0.2)
        raise AssertionError(f"{self.path}: could not select code cell {code_index + 1}: {cell.get_attribute('class')}")

    def saved(self, timeout: float = 30) -> dict:
        """Save the notebook (its outputs included) and read it back from disk. (Saves that never came
        were another tab of the same path: see the Validate test, which works on copies.)"""
        file = self.server.root / self.path
        before = file.stat().st_mtime_ns
        menu(self.page, "File", "docmanager:save")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if file.stat().st_mtime_ns != before:
                try:
                    return json.loads(file.read_text(encoding="utf-8"))
                except json.JSONDecodeError:  # caught mid-write
                    pass
            time.sleep(0.1)
        raise AssertionError(f"{self.path}: saving from JupyterLab did not write the file within {timeout:g} s")

    def cell(self, index: int):
        """The index-th cell (all cells are in the DOM: windowingMode none)."""
        return self.panel.locator(".jp-Notebook .jp-Cell").nth(index)


def prompt_number(prompt: str) -> int:
    """``[12]:`` -> 12; ``[ ]:`` and ``[*]:`` -> 0."""
    digits = re.sub(r"\D", "", prompt)
    return int(digits) if digits else 0
