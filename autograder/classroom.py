"""``course grade ASSIGNMENT``: autograde a whole class's submissions of a chapter, using every core.

Run from the course directory (the repository root), after ``nbgrader collect`` (or after
putting submissions in ``submitted/<student>/<assignment>/`` by hand):

    course grade 03_idempotency            # all collected submissions
    course grade 03_idempotency --jobs 8 --student ada --student bob

Two phases, so the gradebook stays consistent:

1. **Grade in parallel.** Every submission is graded by :func:`autograder.grading.grade`
   in its own sandboxed process (its own PostgreSQL database and Redis namespace, so runs
   never see each other), ``--jobs`` at a time, with a progress bar. Results are kept in
   a cache keyed by the submission's answers and the grader's code.
2. **Record in order.** nbgrader's own autograde then runs once per student, one after
   another, as ``nbgrader autograde`` would: its grading step finds each result in the
   cache instead of grading again, and only this phase writes the gradebook (one writer:
   no lost or doubled grades when two submissions finish at once).

Prints a summary: graded, failed to run, tampered (who, and what was changed), time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from autograder import grading


@dataclass
class Summary:
    assignment: str
    graded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # student -> why
    tampered: dict[str, list[str]] = field(default_factory=dict)  # student -> "task: what"
    scores: dict[str, tuple[float, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds

    def text(self) -> str:
        total = sum(self.seconds.values())
        lines = [
            f"{self.assignment}: {len(self.graded)} graded, {len(self.failed)} failed to run, "
            f"{len(self.tampered)} tampered, in {total:.1f} s "
            f"(grading {self.seconds.get('grade', 0):.1f} s, recording {self.seconds.get('record', 0):.1f} s)"
        ]
        for student, why in sorted(self.failed.items()):
            lines.append(f"  failed to run: {student}: {why}")
        for student, what in sorted(self.tampered.items()):
            lines.append(f"  tampered: {student}: {'; '.join(what)}")
        return "\n".join(lines)


def submissions(root: Path, assignment: str, students: list[str] | None = None) -> dict[str, Path]:
    """student -> submitted notebook of ``assignment``."""
    found = {}
    for nb in sorted((root / "submitted").glob(f"*/{assignment}/{assignment}.ipynb")):
        student = nb.parent.parent.name
        if students is None or student in students:
            found[student] = nb
    return found


def cache_dir(root: Path, assignment: str) -> Path:
    import hashlib

    from course.kit.backends import state_dir

    tag = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return state_dir() / "grade-cache" / f"{assignment}-{tag}"


def _progress(iterable, total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency; plain counts otherwise
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="nb", file=sys.stderr, dynamic_ncols=True)


def grade_all(
    root: Path,
    assignment: str,
    *,
    jobs: int | None = None,
    students: list[str] | None = None,
    sandbox: str | None = None,
    force: bool = True,
    record: bool = True,
) -> Summary:
    """Grade every submission of ``assignment`` under ``root`` (see the module docstring)."""
    from autograder import settings

    root = Path(root).resolve()
    sandbox = sandbox or settings.SANDBOX
    summary = Summary(assignment)
    found = submissions(root, assignment, students)
    if not found:
        raise grading.GradingError(
            f"no submissions of {assignment} under {root / 'submitted'}: run `nbgrader collect {assignment}` first"
        )
    trusted = grading.read_manifest(assignment)
    cache = cache_dir(root, assignment)
    jobs = jobs or os.cpu_count() or 1

    started = time.perf_counter()
    results: dict[str, grading.Graded] = {}

    def one(student: str) -> tuple[str, grading.Graded]:
        nb = json.loads(found[student].read_text(encoding="utf-8"))
        return student, grading.cached_grade(cache, assignment, trusted, nb, sandbox=sandbox)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one, s): s for s in found}
        for fut in _progress(as_completed(futures), len(futures), f"grading {assignment} ({jobs} at once)"):
            student = futures[fut]
            try:
                results[student] = fut.result()[1]
            except grading.GradingError:
                raise
            except Exception as err:  # noqa: BLE001 - one broken submission must not stop the class
                summary.failed[student] = f"{type(err).__name__}: {err}"
    summary.seconds["grade"] = time.perf_counter() - started
    for student, graded in results.items():
        summary.scores[student] = (graded.score, graded.max_score)
        if graded.tampered:
            summary.tampered[student] = [f"{t.id}: {t.tampered}" for t in graded.tampered]

    if record:
        started = time.perf_counter()
        _record(root, assignment, list(results), cache, summary, force=force)
        summary.seconds["record"] = time.perf_counter() - started
    else:
        summary.graded = sorted(results)
    return summary


def _record(root: Path, assignment: str, students: list[str], cache: Path, summary: Summary, *, force: bool) -> None:
    """nbgrader's own autograde, one student at a time; grading itself comes from the cache."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    previous = os.getcwd()
    os.environ["COURSE_GRADE_CACHE"] = str(cache)
    try:
        os.chdir(root)
        config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
        api = NbGraderAPI(config=Config(config))
        for student in _progress(students, len(students), "recording in the gradebook"):
            result = api.autograde(assignment, student, force=force, create=True)
            if result.get("success"):
                summary.graded.append(student)
            else:
                error = (result.get("error") or result.get("log") or "nbgrader autograde failed").strip()
                summary.failed[student] = error.splitlines()[-1][:300]
    finally:
        os.chdir(previous)
        os.environ.pop("COURSE_GRADE_CACHE", None)


def main(argv: list[str] | None = None) -> int:
    """``course grade ASSIGNMENT [--jobs N] [--student ID ...] [--no-sandbox]``, run in the course directory."""
    import argparse

    parser = argparse.ArgumentParser(prog="course grade", description=__doc__.splitlines()[0])
    parser.add_argument("assignment", help="the chapter, as nbgrader names it (03_idempotency)")
    parser.add_argument("--jobs", type=int, default=None, help="submissions graded at once (default: one per core)")
    parser.add_argument("--student", action="append", help="only this student (repeatable)")
    parser.add_argument("--no-sandbox", action="store_true", help="grade without the sandbox (not recommended)")
    args = parser.parse_args(argv)
    if args.no_sandbox:
        print("course grade: grading WITHOUT a sandbox: learners' code runs with your rights", file=sys.stderr)
    try:
        summary = grade_all(
            Path.cwd(),
            args.assignment,
            jobs=args.jobs,
            students=args.student or None,
            sandbox="off" if args.no_sandbox else None,
        )
    except grading.GradingError as err:
        print(f"course grade: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(summary.text())
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
