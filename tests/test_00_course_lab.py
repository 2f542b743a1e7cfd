"""`course lab` (what `make lab` runs): starts as root too, and shows a learner a learner's JupyterLab."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from course.kit import backends, cli
from course.kit.serve import free_port

REPO = Path(__file__).resolve().parent.parent


def test_root_gets_allow_root_and_others_do_not():
    assert "--allow-root" in cli.lab_command([], root=True)[0]
    assert "--allow-root" not in cli.lab_command([], root=False)[0]


def test_the_instructor_keeps_formgrader_and_the_learner_does_not():
    assert "JUPYTER_CONFIG_PATH" in cli.lab_command([])[1]
    assert "JUPYTER_CONFIG_PATH" not in cli.lab_command([], instructor=True)[1]


def test_the_lab_finds_course_in_its_terminals_and_lands_on_chapter_00():
    cmd, env = cli.lab_command([])
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    settings = next(a for a in cmd if a.startswith("--ServerApp.terminado_settings="))
    assert "-l" not in json.loads(settings.split("=", 1)[1])["shell_command"]  # a login shell resets PATH
    assert "--LabApp.default_url=/lab/tree/notebooks/00_setup_and_tour/00_setup_and_tour.ipynb" in cmd


def test_a_parent_that_was_sent_sigint_is_seen_to_stop_catching_it():
    """What `course lab` watches in make: GNU make puts SIGINT back to its default once it got one."""
    from course.kit import procs

    code = "import signal, sys, time; signal.signal(signal.SIGINT, lambda *a: signal.signal(signal.SIGINT, signal.SIG_DFL)); print(1, flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        assert procs.catches(child.pid, signal.SIGINT) is True
        assert procs.catches(child.pid, signal.SIGUSR1) is False
        child.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while procs.catches(child.pid, signal.SIGINT) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.catches(child.pid, signal.SIGINT) is False
    finally:
        child.kill()
        child.wait()
    assert procs.catches(child.pid, signal.SIGINT) is None


def _lab_status(url: str, proc: subprocess.Popen, timeout: float = 90) -> int | None:
    """The status of JupyterLab's /api/status once it answers (None if ``proc`` ended or time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return httpx.get(f"{url}/api/status?token=t", timeout=2).status_code
        except httpx.HTTPError:
            time.sleep(0.3)
    return None


@pytest.mark.slow
def test_course_lab_serves_a_learners_jupyterlab_from_the_first_command(tmp_path):
    """Started exactly as `make lab` starts it (as root on CI): JupyterLab answers, formgrader does not."""
    port = free_port()
    env = dict(os.environ, **backends.servers().as_env(), COURSE_BACKEND="env", JUPYTER_RUNTIME_DIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "course.kit.cli", "lab", "--no-browser", f"--port={port}", "--IdentityProvider.token=t"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        status = _lab_status(url, proc)
        assert status == 200, f"JupyterLab did not answer (exit {proc.poll()})"
        assert httpx.get(f"{url}/formgrader?token=t", timeout=10).status_code == 404
        page = httpx.get(f"{url}/lab?token=t", timeout=10).text
        config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S).group(1))
        disabled = config.get("disabledExtensions", [])
        for plugin in ("@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment"):
            assert plugin in disabled, disabled
        assert "@jupyterlab/apputils-extension:announcements" in disabled, disabled
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    if os.geteuid() == 0:
        assert "--allow-root" in output, output[-2000:]


def _session_processes(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "sid=,pid=,args="], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.split(None, 1)[0] == str(sid) and "<defunct>" not in line]


async def _terminal_says(url: str, command: str) -> str:
    """Type ``command`` into a new JupyterLab terminal and return what the terminal printed."""
    import asyncio

    from tornado.websocket import websocket_connect

    async with httpx.AsyncClient() as client:
        name = (await client.post(f"{url}/api/terminals?token=t", timeout=10)).json()["name"]
    ws = await websocket_connect(f"{url.replace('http', 'ws')}/terminals/websocket/{name}?token=t")
    ws.write_message(json.dumps(["stdin", command + '; echo END-OF-""TEST\r']))  # the echo of the input differs
    seen = ""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while "END-OF-TEST" not in seen and loop.time() < deadline:
        message = await asyncio.wait_for(ws.read_message(), timeout=30)
        if message is None:
            break
        kind, *rest = json.loads(message)
        if kind == "stdout":
            seen += rest[0]
    ws.close()
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_make_lab_stopped_by_its_pid_leaves_nothing_and_its_terminal_finds_course(sig):
    """A supervisor stops `make lab` by make's pid: JupyterLab, the kernels and the servers go too.

    SIGINT is what a script's `kill -INT` and an IDE's stop button send: make passes it to no one
    (it takes it for a terminal's Ctrl-C, which its children got too) and waits for its children.
    """
    import asyncio

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "COURSE_BACKEND")}
    env["JUPYTER_RUNTIME_DIR"] = tempfile_dir = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"lab-test-{port}")
    make = subprocess.Popen(
        ["make", "--no-print-directory", "lab", f"LAB_ARGS=--no-browser --port={port} --IdentityProvider.token=t"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        status = _lab_status(url, make)
        assert status == 200, f"JupyterLab did not answer (make exited {make.poll()})"
        if sig == signal.SIGTERM:
            said = asyncio.run(_terminal_says(url, "command -v course"))
            assert str(REPO / ".venv" / "bin" / "course") in said or "/bin/course" in said, said[-1500:]
        before = _session_processes(make.pid)
        assert any("course lab" in p for p in before), before
        make.send_signal(sig)  # make's pid only, as `kill -TERM PID` or `kill -INT PID` would
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and _session_processes(make.pid):
            make.poll()
            time.sleep(0.5)
        left = _session_processes(make.pid)
        assert not left, "still running after make was stopped:\n" + "\n".join(left)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(make.pid, signal.SIGKILL)
        make.communicate(timeout=30)
        shutil.rmtree(tempfile_dir, ignore_errors=True)
