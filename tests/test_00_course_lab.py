"""`course lab` (what `make lab` runs): starts as root too, and shows a learner a learner's JupyterLab."""

from __future__ import annotations

import json
import os
import re
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
    assert cli.lab_command([], instructor=True)[1] == {}


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
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"{url}/api/status?token=t", timeout=2).status_code
                break
            except httpx.HTTPError:
                time.sleep(0.3)
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
