"""The child process behind ``course check``: nbgrader's own generate_assignment + autograde.

python -m autograder.nbgrader_job COURSE_ROOT ASSIGNMENT STUDENT
python -m autograder.nbgrader_job --probe NOTEBOOK CELL_TIMEOUT
"""

from __future__ import annotations

import json
import sys
import warnings


def grade(root: str, assignment: str, student: str) -> int:
    import os
    import shutil
    import time

    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    os.chdir(root)
    config = PyFileConfigLoader("nbgrader_config.py", path=root).load_config()
    api = NbGraderAPI(config=Config(config))
    t0 = time.perf_counter()
    if not os.path.exists("gradebook.db"):  # course check may bring a cached one
        made = api.generate_assignment(assignment, force=True)
        print(f"generate_assignment took {time.perf_counter() - t0:.1f} s")
        if not made.get("success"):
            print("generate_assignment failed:", made.get("error") or made.get("log"))
            return 1
        shutil.copy2("gradebook.db", "gradebook.generated.db")
    t0 = time.perf_counter()
    graded = api.autograde(assignment, student, force=True, create=True)
    print(f"autograde took {time.perf_counter() - t0:.1f} s")
    print(graded.get("log", ""))
    if not graded.get("success"):
        print("autograde failed:", graded.get("error"))
        return 1
    print("GRADED")
    return 0


def probe(path: str, cell_timeout: float) -> int:
    """Execute code cells one at a time; report cells that outlive an interrupt."""
    import nbformat
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(path, as_version=4)
    hanging = []
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(60)
    try:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            msg_id = kc.execute(cell.source, store_history=False)
            if _wait_reply(kc, msg_id, cell_timeout):
                continue
            km.interrupt_kernel()
            if _wait_reply(kc, msg_id, 5):
                continue
            hanging.append(index)
            kc.stop_channels()
            km.restart_kernel(now=True)
            kc = km.client()
            kc.start_channels()
            kc.wait_for_ready(60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    print("HANGING", json.dumps(hanging))
    return 0


def _wait_reply(kc, msg_id: str, timeout: float) -> bool:
    import queue
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            return False
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            return True
    return False


def main() -> int:
    warnings.simplefilter("ignore")
    if sys.argv[1] == "--probe":
        return probe(sys.argv[2], float(sys.argv[3]))
    return grade(sys.argv[1], sys.argv[2], sys.argv[3])


if __name__ == "__main__":
    sys.exit(main())
