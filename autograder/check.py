"""``course check``: grade one notebook exactly as the instructor's ``nbgrader autograde`` does.

Both go through :func:`autograder.grading.grade`: the chapter's setup cells (from the
manifest that ships in ``autograder/manifests/``, so a class copy without ``solutions/``
can check itself), the learner's answer cells and the hidden checks, in a fresh sandboxed
process. What the learner's kernel did, and any demo cell, has no say in the grade.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autograder import grading, settings

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO / "solutions"


class BadInput(Exception):
    """The notebook cannot be graded: missing, not a notebook, or of no known chapter."""


@dataclass
class TaskResult:
    id: str
    points: float
    max_points: float
    passed: bool
    feedback: str


@dataclass
class CheckResult:
    notebook: str
    chapter: str
    score: float
    max_score: float
    tasks: list[TaskResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cell_errors: list[str] = field(default_factory=list)  # setup or answer cells that raised
    tampered: list[str] = field(default_factory=list)
    flagged: list[str] = field(default_factory=list)  # "task: line N: what", for the instructor to read
    seconds: float = 0.0
    sandboxed: bool = False
    not_graded: str | None = None  # the servers stopped answering while grading: why

    def as_json(self) -> dict:
        return {
            "notebook": self.notebook,
            "score": self.score,
            "max_score": self.max_score,
            "tasks": [asdict(t) for t in self.tasks],
        }


# ----------------------------------------------------------------------------- input


def chapters() -> dict[str, Path]:
    """Assignment name -> its source notebook in solutions/ (the instructor's copy only)."""
    found = {}
    for nb in sorted(SOLUTIONS.glob("[0-9][0-9]_*/*.ipynb")):
        if nb.stem == nb.parent.name:
            found[nb.parent.name] = nb
    return found


def read_notebook(path: Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise BadInput(f"{path}: no such file")
    if path.is_dir():
        raise BadInput(f"{path}: is a folder; give the path of a chapter notebook (.ipynb)")
    if path.suffix != ".ipynb":
        raise BadInput(f"{path}: not a notebook (expected a .ipynb file)")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not a notebook (not UTF-8 text)") from None
    except json.JSONDecodeError as err:
        raise BadInput(f"{path}: broken JSON at line {err.lineno}, column {err.colno}: {err.msg}") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise BadInput(f"{path}: not a notebook (no list of cells)")
    return nb


def _answer_ids(cells: list[dict]) -> set[str]:
    return {c["id"] for c in cells if c["kind"] == "answer"}


def identify(path: Path, nb: dict) -> str:
    """Which chapter a notebook belongs to: by its metadata, its answer cells or its name."""
    known = grading.known_chapters()
    meta = nb.get("metadata")
    course = meta.get("course") if isinstance(meta, dict) else None
    tagged = course.get("chapter") if isinstance(course, dict) else None
    if tagged in known:
        return tagged
    ids = {grading._grade_id(c) for c in nb["cells"]} - {None}
    if ids:
        overlap = {ch: len(ids & _answer_ids(grading.read_manifest(ch))) for ch in known}
        best = max(overlap, key=overlap.get, default=None)
        if best and overlap[best]:
            return best
    if Path(path).stem in known:
        return Path(path).stem
    raise BadInput(f"{path}: not a notebook of a known chapter ({', '.join(known) or 'none found'})")


# ----------------------------------------------------------------------------- grading


def self_study_sandbox(explicit_off: bool = False) -> tuple[str | None, str]:
    """The sandbox mode ``course check`` grades in, and the one line it prints about it ("" for none).

    A learner checking their own notebook runs their own code with their own rights anyway:
    where no sandbox works here (no bubblewrap: macOS, containers without user namespaces),
    the check grades unsandboxed and says so in one line. ``COURSE_SANDBOX`` set keeps its
    meaning (``required`` still refuses); the instructor's grading always runs sandboxed.
    """
    if explicit_off:
        return "off", "course check: grading WITHOUT a sandbox: the notebook's code runs with your own rights"
    if "COURSE_SANDBOX" in os.environ:
        return None, ""
    from autograder import sandbox as sb

    ok, why = sb.available()
    if ok:
        return None, ""
    return "off", (
        f"course check: no sandbox here ({why}): grading your own notebook with your own rights; "
        "your instructor's grading runs sandboxed"
    )


def check(path: str | Path, *, sandbox: str | None = None, timeout: float = settings.RUN_TIMEOUT) -> CheckResult:
    """Grade ``path``; raise :class:`BadInput` for what cannot be graded.

    A file named after a chapter (``10_contention_and_money.ipynb``, or in such a folder) is
    graded as that chapter, and refused when it is another's (:mod:`autograder.intake`).

    ``sandbox``: ``"required"`` (the default: stop when no sandbox works here), ``"auto"``
    or ``"off"``; see :func:`autograder.grading.grade`.
    """
    from autograder import intake

    sandbox = sandbox or settings.SANDBOX
    path = Path(path)
    nb = read_notebook(path)
    chapter = intake.handed_in_as(path) or identify(path, nb)
    why = intake.problem(nb, chapter)
    if why:
        raise BadInput(f"{path}: {why}: not graded")
    graded = grading.grade(chapter, grading.read_manifest(chapter), nb, sandbox=sandbox, run_timeout=timeout)
    result = CheckResult(str(path), chapter, graded.score, graded.max_score, seconds=graded.seconds)
    result.sandboxed = graded.sandboxed
    for t in graded.tasks:
        feedback = "\n".join(line[2:] if line.startswith("  ") else line for line in t.feedback).strip()
        result.tasks.append(TaskResult(t.id, t.points, t.max_points, t.passed, feedback or t.status))
        if t.tampered:
            result.tampered.append(f"{t.id}: {t.tampered}")
    result.flagged = list(graded.flagged)
    result.not_graded = graded.not_graded
    result.notes = [n for n in graded.notes if not (sandbox == "off" and n == grading.sandbox_warning("off"))]
    for m in graded.manual:
        result.notes.append(f"{m['id']} ({m['points']:g} points) is graded by your instructor, not by course check")
    for cell in graded.cells.values():
        if cell.kind == "setup" and not cell.ok:
            result.cell_errors.append(f"setup cell {cell.id}: {cell.error or cell.cut}")
        elif cell.kind == "answer" and cell.error and "NotImplementedError" not in cell.error:
            result.cell_errors.append(f"answer cell {cell.id}: {cell.error}")
    return result


def render(res: CheckResult) -> str:
    lines = [f"course check {res.notebook} (chapter {res.chapter})", ""]
    for t in res.tasks:
        mark = "[ok]  " if t.passed else "[FAIL]"
        lines.append(f"{mark} {t.id}: {t.points:g}/{t.max_points:g} points")
        lines.extend(f"    {line}" for line in t.feedback.splitlines())
        lines.append("")
    lines.extend(f"note: {n}" for n in res.notes)
    lines.extend(f"note: {e}" for e in res.cell_errors)
    lines.extend(f"tampering: {t}" for t in res.tampered)
    if res.flagged:
        lines.append("flagged: your instructor will read these answers by hand (the points stand as graded):")
        lines.extend(f"    {f}" for f in res.flagged)
    where = "sandboxed" if res.sandboxed else "NOT sandboxed"
    lines.append(f"total: {res.score:g}/{res.max_score:g} ({res.seconds:.1f} s, {where})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``course check PATH [--json]``: exit 0 at full marks, 1 when a task falls short, 2 on bad input.

    ``course check`` (:mod:`course.kit.cli`) runs this as ``python -m autograder.check``: the
    toolkit starts the grader as a program and never imports it.
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="course check", description="grade a chapter notebook as the instructor would"
    )
    parser.add_argument("path", help="a chapter notebook (.ipynb)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--no-sandbox",
        action="store_true",
        help="grade without the sandbox (where bubblewrap is missing): the code runs with your rights",
    )
    args = parser.parse_args(argv)
    mode, line = self_study_sandbox(args.no_sandbox)
    if line:
        print(line, file=sys.stderr)
    try:
        res = check(args.path, sandbox=mode)
    except (BadInput, grading.GradingError) as err:
        print(f"course check: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if not res.tasks and not _graded(res.chapter):
        print(
            json.dumps(res.as_json(), indent=2) if args.json else f"{res.chapter}: no graded tasks (self-rated drills)"
        )
        return 0
    _record_progress(res)
    if args.json:
        print(json.dumps(res.as_json(), indent=2))
    else:
        print(render(res))
    if res.not_graded:  # not the learner's doing: "grading cannot run", as for no servers at all
        print(f"course check: not graded: {res.not_graded}", file=sys.stderr)
        return 2
    return 0 if res.tasks and res.score >= res.max_score else 1


def _graded(chapter: str) -> bool:
    """Whether the chapter has graded tasks at all (chapter 14's drills are self-rated)."""
    return any(c["kind"] == "test" for c in grading.read_manifest(chapter))


def _record_progress(res: CheckResult) -> None:
    """The learner's progress (``course progress``, :mod:`course.progress`) notes the result;
    a failure to record never changes the grade or the exit code."""
    try:
        from course.progress import record_check

        if res.tasks:
            record_check(res.chapter, res.score, res.max_score, via="course check")
    except Exception:  # noqa: BLE001, S110
        pass


if __name__ == "__main__":
    sys.exit(main())
