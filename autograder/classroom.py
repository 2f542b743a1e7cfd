"""``course grade ASSIGNMENT``: autograde a whole class's submissions of a chapter, using every core.

Run from the course directory (the repository root), after ``nbgrader collect`` (or after
putting submissions in ``submitted/<student>/<assignment>/`` by hand):

    course grade 03_idempotency            # all collected submissions
    course grade 03_idempotency --jobs 8 --student ada --student bob
    course grade 03_idempotency --shard 2/4 --cache /shared/grades --no-record   # one node's share

The chapter must be in the gradebook first (``course assign``); nothing is written otherwise.

Two phases, so the gradebook stays consistent:

1. **Grade in parallel.** Every submission is graded by :func:`autograder.grading.grade`
   in its own sandboxed process (its own PostgreSQL database and Redis namespace, so runs
   never see each other), ``--jobs`` at a time, with a progress bar. Results are kept in
   a cache keyed by the submission's answers and the grader's code.
2. **Record in order.** nbgrader's own autograde then runs once per student, one after
   another, as ``nbgrader autograde`` would: its grading step finds each result in the
   cache instead of grading again, and only this phase writes the gradebook (one writer:
   no lost or doubled grades when two submissions finish at once).

Prints a summary: graded, failed to run, tampered (who, and what was changed: the grader
patched at run time, or a locked or test cell edited), submissions without a time stamp, time.

Spread over several machines (the nodes of a JupyterHub or a batch system): each node grades
its ``--shard K/N`` with ``--no-record`` into a ``--cache`` folder they all see, then one
run with the same ``--cache`` records the class, every grade found in the cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from autograder import gradecache, grading, intake


@dataclass
class Summary:
    assignment: str
    graded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # student -> why
    tampered: dict[str, list[str]] = field(default_factory=dict)  # student -> "task: what"
    scores: dict[str, tuple[float, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    unstamped: list[str] = field(default_factory=list)  # submissions without timestamp.txt
    flagged: dict[str, list[str]] = field(default_factory=dict)  # student -> "task: line N: what" to read
    recorded: bool = True

    def text(self) -> str:
        total = sum(self.seconds.values())
        done = "graded" if self.recorded else "graded into the cache (not recorded yet)"
        lines = [
            f"{self.assignment}: {len(self.graded)} {done}, {len(self.failed)} failed to run, "
            f"{len(self.tampered)} tampered, {len(self.flagged)} flagged, in {total:.1f} s "
            f"(grading {self.seconds.get('grade', 0):.1f} s, recording {self.seconds.get('record', 0):.1f} s)"
        ]
        for student, why in sorted(self.failed.items()):
            lines.append(f"  failed to run: {student}: {why}")
        for student, changes in sorted(self.tampered.items()):
            lines.extend(f"  tampered: {student}: {what}" for what in changes)
        for student, what in sorted(self.flagged.items()):
            shown = what[:3] + ([f"and {len(what) - 3} more"] if len(what) > 3 else [])
            lines.extend(f"  flagged (read it; graded as usual): {student}: {item}" for item in shown)
        if self.unstamped:
            lines.append(f"  no timestamp.txt (the export shows no time for them): {', '.join(sorted(self.unstamped))}")
        return "\n".join(lines)


def submissions(
    root: Path, assignment: str, students: list[str] | None = None, shard: tuple[int, int] | None = None
) -> dict[str, Path]:
    """student -> submitted notebook of ``assignment``; ``shard`` (k, n): the k-th of n shares (1-based)."""
    found = {}
    for nb in sorted((root / "submitted").glob(f"*/{assignment}/{assignment}.ipynb")):
        student = nb.parent.parent.name
        if students is None or student in students:
            found[student] = nb
    if shard:
        k, n = shard
        found = {s: nb for i, (s, nb) in enumerate(sorted(found.items())) if i % n == k - 1}
    return found


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> (2, 4)."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise grading.GradingError(f"--shard {text!r}: expected K/N, such as 2/4") from None
    if not 1 <= k <= n:
        raise grading.GradingError(f"--shard {text!r}: K must be between 1 and N")
    return k, n


def cache_dir(root: Path, assignment: str, shared: Path | None = None) -> Path:
    """Where grades wait to be recorded: ``shared/<assignment>`` or the grading account's own state folder.

    Either way the folder and its parent must belong to the grading account and be closed
    to others (:func:`autograder.grading.private_dir`); entries are authenticated.
    """
    import hashlib

    if shared is not None:
        return Path(shared).resolve() / assignment
    tag = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return gradecache.grader_state_dir() / "grade-cache" / f"{assignment}-{tag}"


def _db_path(root: Path) -> Path | None:
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
    url = config.CourseDirectory.get("db_url", f"sqlite:///{root}/gradebook.db")
    return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None


def check_assigned(root: Path, assignment: str) -> None:
    """Stop before grading anything when the gradebook does not know ``assignment``."""
    import contextlib
    import sqlite3

    if not (root / "nbgrader_config.py").exists():
        raise grading.GradingError(f"no nbgrader_config.py in {root}: run `course grade` from the repository root")
    db = _db_path(root)
    if db is None:
        return  # a gradebook on a database server: nbgrader says it if the chapter is missing
    hint = f"run `course assign {assignment}` first (it records the chapter in the gradebook)"
    if not db.exists():
        raise grading.GradingError(f"no gradebook at {db}: {hint}")
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            known = conn.execute("SELECT 1 FROM assignment WHERE name = ?", (assignment,)).fetchone()
    except sqlite3.Error as err:
        raise grading.GradingError(f"{db} cannot be read as a gradebook ({err})") from None
    if not known:
        raise grading.GradingError(f"{assignment} is not in the gradebook: {hint}")


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
    shard: tuple[int, int] | None = None,
    shared_cache: Path | None = None,
) -> Summary:
    """Grade every submission of ``assignment`` under ``root`` (see the module docstring)."""
    from autograder import settings

    root = Path(root).resolve()
    sandbox = sandbox or settings.SANDBOX
    summary = Summary(assignment, recorded=record)
    if record:
        check_assigned(root, assignment)
    found = submissions(root, assignment, students, shard)
    if not found:
        raise grading.GradingError(
            f"no submissions of {assignment} under {root / 'submitted'}"
            + (f" in shard {shard[0]}/{shard[1]}" if shard else "")
            + f": run `nbgrader collect {assignment}` first, or put notebooks there by hand"
        )
    summary.unstamped = [s for s, nb in found.items() if not (nb.parent / "timestamp.txt").is_file()]
    trusted = grading.read_manifest(assignment)
    grading.check_servers()  # servers that do not answer grade nobody: stop before the first submission
    cache = cache_dir(root, assignment, shared_cache)
    jobs = jobs or os.cpu_count() or 1

    started = time.perf_counter()
    results: dict[str, grading.Graded] = {}

    broken = {s: why for s in sorted(found) if (why := intake.refusal(found[s], assignment))}
    for student, why in broken.items():  # named, and never handed to nbgrader (which would drop the old grade)
        summary.failed[student] = f"{why.replace(str(root) + '/', '')}: {grading.KEPT}"
        del found[student]

    def one(student: str) -> tuple[str, grading.Graded]:
        nb = json.loads(found[student].read_text(encoding="utf-8"))
        return student, gradecache.cached_grade(cache, assignment, trusted, nb, sandbox=sandbox)

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
    for student, graded in list(results.items()):
        if not graded.complete:  # the servers stopped answering: not graded, not cached, not recorded
            summary.failed[student] = f"not graded: {graded.not_graded}"
            del results[student]
    for student, graded in results.items():
        summary.scores[student] = (graded.score, graded.max_score)
        if graded.tampered:
            summary.tampered[student] = [f"{t.id}: {t.tampered}" for t in graded.tampered]
        if graded.flagged:
            summary.flagged[student] = graded.flagged

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

    from autograder.nbgrader_plugin import CHANGED

    previous = os.getcwd()
    os.environ["COURSE_GRADE_CACHE"] = str(cache)
    try:
        os.chdir(root)
        config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
        api = NbGraderAPI(config=Config(config))
        for student in _progress(students, len(students), "recording in the gradebook"):
            result = api.autograde(assignment, student, force=force, create=True)
            for line in (result.get("log") or "").splitlines():
                _, marker, what = line.partition(CHANGED)
                if marker:
                    who, _, change = what.strip().partition(": ")
                    summary.tampered.setdefault(who, []).append(change)
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
    parser.add_argument("--shard", metavar="K/N", help="grade only the K-th of N equal shares of the class")
    parser.add_argument("--cache", metavar="DIR", help="keep results in DIR (shared by nodes) instead of locally")
    parser.add_argument("--no-record", action="store_true", help="grade into the cache only; record in a later run")
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
            record=not args.no_record,
            shard=parse_shard(args.shard) if args.shard else None,
            shared_cache=Path(args.cache) if args.cache else None,
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
