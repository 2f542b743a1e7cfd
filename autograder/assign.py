"""``course assign CHAPTER ... [--due DATE]``: record chapters in the gradebook as you hand them out.

Run in the course directory (the repository root). nbgrader grades only the chapters its
gradebook knows, and ``nbgrader export`` lists exactly those: a chapter is *assigned* once
this command has recorded it.

nbgrader's own ``generate_assignment --force`` would do the recording, but it first deletes
``notebooks/NN/`` and, when it fails (a source notebook being edited, ``alembic`` not on
``PATH``), leaves that folder gone and ``gradebook.db`` half made. Here a failure leaves
nothing behind:

- nbgrader generates the chapter in a scratch folder; ``notebooks/`` is compared with what
  it made, never written (after editing ``solutions/``, ``make release`` rewrites it);
- ``gradebook.db`` is created whole (in a temporary file, then renamed into place) and
  copied before nbgrader writes to it; on any failure it is put back as it was, or removed
  when this command created it;
- the message says what failed and what to do.

    course assign 01_timeouts_and_retries --due "2026-12-15 17:00:00 UTC"
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path


class AssignError(Exception):
    """The chapter could not be recorded; nothing was changed. The message says what to do."""


def _config(root: Path):
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    from autograder import settings

    settings.prepare_process()
    if not (root / "nbgrader_config.py").exists():
        raise AssignError(f"no nbgrader_config.py in {root}: run `course assign` from the repository root")
    return Config(PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config())


def _sqlite_path(db_url: str) -> Path | None:
    return Path(db_url.removeprefix("sqlite:///")) if db_url.startswith("sqlite:///") else None


def _copy_db(src: Path, dest: Path) -> None:
    """A consistent copy of an SQLite database, made through SQLite (another process may have it open)."""
    with contextlib.closing(sqlite3.connect(src)) as a, contextlib.closing(sqlite3.connect(dest)) as b:
        a.backup(b)


def _create_db(db: Path, db_url_of, course_id: str) -> None:
    """Create ``db`` whole: build it beside, then link it into place (atomic; never over an existing one)."""
    from nbgrader.api import Gradebook

    partial = db.with_name(f".{db.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    try:
        Gradebook(db_url_of(partial), course_id).close()
        with contextlib.suppress(FileExistsError):
            os.link(partial, db)
    finally:
        partial.unlink(missing_ok=True)


def reason(result: dict) -> str:
    """The one line that says why an nbgrader API call failed (its log ends in "see the above traceback")."""
    import re

    text = f"{result.get('log') or ''}\n{result.get('error') or ''}"
    errors = [
        m.group(1).rsplit(".", 1)[-1] + ": " + m.group(3).strip()
        for m in re.finditer(r"^\s*([\w.]*(Error|Exception)): (.+)$", text, re.MULTILINE)
        if "NbGraderException" not in m.group(1)
    ]
    if errors:
        return errors[-1][:300]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no reason given"


def _normalized(path: Path) -> dict:
    nb = json.loads(path.read_text(encoding="utf-8"))
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def _drifted(generated: Path, committed: Path) -> list[str]:
    names = {p.name for p in generated.glob("*.ipynb")} | {p.name for p in committed.glob("*.ipynb")}
    return sorted(
        n
        for n in names
        if not (generated / n).exists()
        or not (committed / n).exists()
        or _normalized(generated / n) != _normalized(committed / n)
    )


def assign(root: Path, chapters: list[str], due: str | None = None) -> list[str]:
    """Record ``chapters`` in the gradebook of the course at ``root``; return one line per chapter."""
    from nbgrader.api import Gradebook
    from nbgrader.apps import NbGraderAPI

    root = Path(root).resolve()
    config = _config(root)
    cd = config.CourseDirectory
    source = root / cd.get("source_directory", "source")
    release = root / cd.get("release_directory", "release")
    for name in chapters:
        if not (source / name / f"{name}.ipynb").is_file():
            known = ", ".join(sorted(p.name for p in source.glob("[0-9][0-9]_*") if p.is_dir())) or "none"
            raise AssignError(f"no chapter {name!r} in {source.name}/ (chapters: {known})")
        if not (release / name).is_dir():
            raise AssignError(f"{release.name}/{name} is missing: run `make release` first")
    db_url = cd.get("db_url", f"sqlite:///{root}/gradebook.db")
    course_id = cd.get("course_id", "")
    db = _sqlite_path(db_url)

    scratch = Path(tempfile.mkdtemp(prefix="course-assign-"))
    created = False
    snapshot = scratch / "gradebook.before"
    lines = []
    previous = os.getcwd()
    try:
        for name in chapters:
            shutil.copytree(
                source / name, scratch / "source" / name, ignore=shutil.ignore_patterns(".*", "__pycache__")
            )
        if db is not None:
            if db.exists():
                _copy_db(db, snapshot)
            else:
                _create_db(db, lambda p: f"sqlite:///{p}", course_id)
                created = True
        config.CourseDirectory.root = str(scratch)
        config.CourseDirectory.source_directory = "source"
        config.CourseDirectory.release_directory = "release"
        config.CourseDirectory.db_url = db_url
        os.chdir(scratch)
        api = NbGraderAPI(config=config)
        for name in chapters:
            result = api.generate_assignment(name, force=True)
            if not result.get("success"):
                raise AssignError(
                    f"{name}: nbgrader could not generate it from {source.name}/{name} ({reason(result)}). "
                    f"Nothing was changed: fix {source.name}/{name}, then run `course assign {name}` again"
                )
            drift = _drifted(scratch / "release" / name, release / name)
            if drift:
                raise AssignError(
                    f"{release.name}/{name} is not what {source.name}/{name} generates ({', '.join(drift)}): "
                    f"learners would be graded on a notebook they were not given. Nothing was changed: "
                    f"run `make release`, review `git diff {release.name}/`, then `course assign {name}` again"
                )
        with Gradebook(db_url, course_id) as gb:
            for name in chapters:
                if due:
                    gb.update_or_create_assignment(name, duedate=due)
                a = gb.find_assignment(name)
                tasks = sum(len(nb.grade_cells) for nb in a.notebooks)
                when = f", due {a.duedate:%Y-%m-%d %H:%M} UTC" if a.duedate else ""
                lines.append(f"{name}: recorded in the gradebook ({tasks} graded cells, {a.max_score:g} points{when})")
    except BaseException as err:
        os.chdir(previous)
        if db is not None and created:
            db.unlink(missing_ok=True)
        elif db is not None and snapshot.exists():
            _copy_db(snapshot, db)
        if isinstance(err, (AssignError, KeyboardInterrupt)):
            raise
        raise AssignError(
            f"{', '.join(chapters)}: {type(err).__name__}: {err}. Nothing was changed; run `course assign` again "
            "once that is fixed"
        ) from err
    finally:
        os.chdir(previous)
        shutil.rmtree(scratch, ignore_errors=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    """``course assign CHAPTER ... [--due DATE]``, run in the course directory."""
    import argparse
    import warnings

    parser = argparse.ArgumentParser(prog="course assign", description=__doc__.splitlines()[0])
    parser.add_argument("chapters", nargs="+", metavar="CHAPTER", help="as nbgrader names it (01_timeouts_and_retries)")
    parser.add_argument("--due", help='due date, e.g. "2026-12-15 17:00:00 UTC" (shown in the export, lateness)')
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        for line in assign(Path.cwd(), args.chapters, args.due):
            print(line)
    except AssignError as err:
        print(f"course assign: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("course assign: interrupted; nothing was changed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
