"""Measured, not asserted: cold starts of the embedded servers, notebook run times, course check times.

    make bench            # or: python benchmarks/run.py [--repeat N] [--chapters 00 01]

Prints a table and writes artifacts/benchmarks.json. Targets on 2 cores: servers ready in
under 3 s; a solution notebook in under 60 s; `course check` of one chapter in under 20 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("MPLBACKEND", "Agg")


def cold_starts(repeat: int) -> dict[str, list[float]]:
    from course.chapters import ch00

    runs: dict[str, list[float]] = {}
    for _ in range(repeat):
        for name, seconds in ch00.cold_start().items():
            runs.setdefault(name, []).append(seconds)
    return runs


def run_notebook(path: Path) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--chapters", nargs="*")
    args = parser.parse_args()

    from autograder import check
    from course.kit import backends

    srv = backends.servers()  # notebooks and checks below share these servers
    os.environ.update(srv.as_env(), COURSE_BACKEND="env")
    results: dict = {"cold_start_s": cold_starts(args.repeat), "notebook_s": {}, "course_check_s": {}}
    chapters = [c for c in check.chapters() if not args.chapters or c[:2] in args.chapters]
    for chapter in chapters:
        solution = REPO / "solutions" / chapter / f"{chapter}.ipynb"
        results["notebook_s"][chapter] = run_notebook(solution)
        t0 = time.perf_counter()
        res = check.check(solution)
        results["course_check_s"][chapter] = time.perf_counter() - t0
        results.setdefault("course_check_score", {})[chapter] = f"{res.score:g}/{res.max_score:g}"

    print(f"{'measure':40} {'value':>10}   target")
    for name, runs in results["cold_start_s"].items():
        print(f"{'cold start: ' + name:40} {statistics.median(runs):>8.2f} s   < 3 s  (median of {len(runs)})")
    for chapter, seconds in results["notebook_s"].items():
        print(f"{'notebook: ' + chapter:40} {seconds:>8.1f} s   < 60 s")
    for chapter, seconds in results["course_check_s"].items():
        score = results["course_check_score"][chapter]
        print(f"{'course check: ' + chapter:40} {seconds:>8.1f} s   < 20 s  (scored {score})")
    out = REPO / "artifacts" / "benchmarks.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"written to {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
