"""course.kit.notebook in a real Jupyter kernel: every error reaches the page, a stub's as one line.

IPython drops what a custom exception handler returns, so a handler that only returns the
traceback leaves a failing cell with no output at all (and Run All stops with nothing to
read). These run the handler where learners meet it: an ipykernel, messages read from iopub.
"""

from __future__ import annotations

import queue

import pytest


@pytest.fixture(scope="module")
def kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run(kc, code: str) -> tuple[str, list[dict]]:
    """Execute ``code``; the reply's status and the error outputs it sent."""
    msg_id = kc.execute(code)
    errors = []
    while True:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            errors.append(msg["content"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while True:
        try:
            reply = kc.get_shell_msg(timeout=10)
        except queue.Empty:
            return "no reply", errors
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]["status"], errors


def test_errors_show_in_the_learners_kernel(kernel):
    assert _run(kernel, "from course.kit import notebook\nnotebook.install()")[0] == "ok"

    status, errors = _run(kernel, "def place_order():\n    raise NotImplementedError('not done yet')\nplace_order()")
    assert status == "error"
    assert [e["traceback"] for e in errors] == [
        ["not done yet: place_order (write your answer in its cell, run it, then run this cell again)"]
    ]

    # any other error keeps its traceback, in a plain cell and in one that awaits
    for code in ("1 / 0", "import asyncio\nawait asyncio.sleep(0)\n1 / 0"):
        status, errors = _run(kernel, code)
        assert status == "error", code
        assert len(errors) == 1 and errors[0]["ename"] == "ZeroDivisionError", (code, errors)
        assert any("Traceback" in line for line in errors[0]["traceback"]), errors[0]["traceback"]

    status, errors = _run(kernel, "from autograder.harness import TaskFailed\nraise TaskFailed('t: 0/2 points')")
    assert status == "error" and [e["traceback"] for e in errors] == [["TaskFailed: t: 0/2 points"]]
