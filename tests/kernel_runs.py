"""Run a chapter notebook top to bottom, several times, in one Jupyter kernel (as a learner's Run All).

Used by the chapters' re-run tests (``tests/test_NN_reruns.py``): a notebook must hold its
PostgreSQL connection count steady however often it runs in one kernel, and an unfinished
student notebook must reach its end with one-line "not done yet" answers and no traceback.
The kernel uses this test process's servers and the quick sizes of a graded run
(``NBGRADER_EXECUTION=autograde``), so the in-kernel selfcheck is skipped.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class NotebookRun:
    seconds: float
    connections: int  # to the notebook's own database, at the end of the run
    outputs: dict[int, list] = field(default_factory=dict)  # code cell index -> its outputs

    def errors(self) -> dict[int, str]:
        return {
            i: f"{o['ename']}: {o['evalue']}"
            for i, outs in self.outputs.items()
            for o in outs
            if o.output_type == "error"
        }

    def text(self, index: int) -> str:
        parts = []
        for o in self.outputs[index]:
            if o.output_type == "stream":
                parts.append(o.text)
            elif o.output_type == "error":
                parts.append("\n".join(o.traceback))
            elif "text/plain" in o.get("data", {}):
                parts.append(o.data["text/plain"])
        return "".join(parts)


def notebook_path(folder: str, chapter: str) -> Path:
    return REPO / folder / chapter / f"{chapter}.ipynb"


def run_in_one_kernel(path: Path, runs: int) -> tuple[list[NotebookRun], object]:
    """Execute every code cell of ``path`` ``runs`` times in one kernel; what each run left behind.

    Returns the runs and the notebook (its cells, for the caller to match outputs to sources).
    """
    import nbformat
    import psycopg
    from nbclient import NotebookClient

    from course.kit import backends

    srv = backends.servers()
    env = dict(
        os.environ,
        **srv.as_env(),
        COURSE_BACKEND="env",
        NBGRADER_EXECUTION="autograde",
        MPLBACKEND="module://matplotlib_inline.backend_inline",
    )
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(path.parent)}}
    )
    results: list[NotebookRun] = []
    database = None
    with client.setup_kernel(env=env):
        for _ in range(runs):
            t0 = time.perf_counter()
            outputs = {}
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                cell.outputs = []
                client.execute_cell(cell, i)
                outputs[i] = copy.deepcopy(cell.outputs)
            seconds = time.perf_counter() - t0
            if database is None:
                probe = nbformat.v4.new_code_cell("print(ns.name)")  # which database the notebook made
                nb.cells.append(probe)
                try:
                    client.execute_cell(probe, len(nb.cells) - 1)
                finally:
                    nb.cells.pop()
                database = "".join(o.get("text", "") for o in probe.outputs).strip()
            with psycopg.connect(srv.database_url, autocommit=True) as admin:
                (count,) = admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)
                ).fetchone()
            results.append(NotebookRun(seconds, count, outputs))
    return results, nb
