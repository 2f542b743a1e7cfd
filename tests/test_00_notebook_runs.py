"""Every chapter's solution notebook runs top to bottom twice in one kernel, as a learner re-runs it.

Both runs must finish without an error output, and the second must not hold more
PostgreSQL or Redis connections than the first: a notebook that opens a pool in a cell and
never gives it back would run out of connections after a few Run Alls. The notebooks run in
quick mode (``NBGRADER_EXECUTION=autograde``: ``course.grading()`` shrinks every demo, never
its logic), so the whole set fits the suite's budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from autograder import check
from course.kit import backends

REPO = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(check.chapters())
PROBE = (
    "import json as _json\nfrom course.kit import lab as _lab\n_n = _lab.current()\n"
    "print(_json.dumps({'database': _n.name, 'redis_db': _n.redis_db}))"
)


def _errors(nb) -> list[str]:
    found = []
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                found.append(f"cell {index}: {out.get('ename')}: {out.get('evalue', '')[:200]}")
    return found


def _connections(namespace: dict) -> tuple[int, int]:
    """(PostgreSQL backends on the notebook's database, Redis clients on its logical database)."""
    import psycopg
    import redis

    srv = backends.servers()
    with psycopg.connect(srv.database_url, autocommit=True) as conn:
        pg = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (namespace["database"],))
        pg_count = pg.fetchone()[0]
    client = redis.Redis.from_url(srv.redis_url)
    try:
        rd = sum(1 for c in client.client_list() if int(c.get("db", -1)) == namespace["redis_db"])
    finally:
        client.close()
    return pg_count, rd


def _settled(namespace: dict, first: tuple[int, int] | None, wait: float = 3.0) -> tuple[int, int]:
    """The counts, read again for up to ``wait`` seconds while connections are still closing."""
    import time

    deadline = time.monotonic() + wait
    counts = _connections(namespace)
    while first is not None and (counts[0] > first[0] or counts[1] > first[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
        counts = _connections(namespace)
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_solution_runs_twice_in_one_kernel_without_holding_more_connections(chapter, monkeypatch):
    from nbclient import NotebookClient

    srv = backends.servers()
    for key, value in {**srv.as_env(), "COURSE_BACKEND": "env", "NBGRADER_EXECUTION": "autograde"}.items():
        monkeypatch.setenv(key, value)
    path = REPO / "solutions" / chapter / f"{chapter}.ipynb"
    nb = nbformat.read(path, as_version=4)
    cells = list(nb.cells)
    probe = nbformat.v4.new_code_cell(PROBE)
    nb.cells.append(probe)
    client = NotebookClient(
        nb, timeout=180, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(path.parent)}}
    )
    counts, errors = [], []
    with client.setup_kernel():
        for run in (1, 2):
            for index, cell in enumerate(cells):
                if cell.cell_type == "code":
                    cell.outputs = []
                    client.execute_cell(cell, index)
            errors += [f"run {run}: {e}" for e in _errors(nb)]
            probe.outputs = []
            client.execute_cell(probe, len(cells))
            namespace = json.loads("".join(o.get("text", "") for o in probe.outputs).strip().splitlines()[-1])
            counts.append(_settled(namespace, counts[0] if counts else None))
    assert not errors, "\n".join(errors)
    (pg1, rd1), (pg2, rd2) = counts
    assert pg2 <= pg1 and rd2 <= rd1, f"connections after run 1: {counts[0]}, after run 2: {counts[1]} (pg, redis)"
