"""``make release``: the student notebooks in ``notebooks/`` and the grading manifests, from ``solutions/``.

The manifests (``autograder/manifests/<chapter>.json``) hold what grading trusts of each
chapter (its setup cells, the ids of its answer cells, its tasks and points), so a class
copy of the workbook without ``solutions/`` grades exactly as the instructor does.

Generation happens in a throwaway course directory (nbgrader's own generate_assignment),
so the repository never holds a gradebook. Nothing is written until every chapter has been
generated: a failure (a source notebook being edited, a broken cell) leaves ``notebooks/``
and the manifests as they were and says which chapter failed. Each file is then replaced
whole. ``tests/test_00_notebooks.py`` runs the same generation and fails when
``notebooks/`` has drifted from ``solutions/``.

    python -m autograder.release [ASSIGNMENT ...]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from autograder.check import REPO


class ReleaseError(Exception):
    """A chapter could not be generated; nothing was written."""


def _chapters(root: Path) -> list[str]:
    return [
        nb.parent.name for nb in sorted((root / "solutions").glob("[0-9][0-9]_*/*.ipynb")) if nb.stem == nb.parent.name
    ]


def generate(assignments: list[str] | None = None, *, root: Path = REPO) -> dict[str, Path]:
    """Generate the release of each assignment; return {assignment: folder} in a temp dir.

    Raises :class:`ReleaseError` (a ``SystemExit``'s message for the command line) and removes
    the temp dir when a chapter cannot be generated.
    """
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config

    from autograder import settings
    from autograder.assign import reason

    names = assignments or _chapters(root)
    scratch = Path(tempfile.mkdtemp(prefix="course-release-"))
    config = Config()
    settings.prepare_process()  # nbgrader runs `alembic` from PATH to make its gradebook
    settings.apply(config, str(scratch))
    config.CourseDirectory.source_directory = "source"
    config.CourseDirectory.release_directory = "release"
    cwd = os.getcwd()
    try:
        for name in names:
            src = root / "solutions" / name
            if not src.is_dir():
                raise ReleaseError(f"no such chapter {name!r} in solutions/")
            shutil.copytree(src, scratch / "source" / name, ignore=shutil.ignore_patterns(".*", "__pycache__"))
        os.chdir(scratch)
        api = NbGraderAPI(config=config)
        for name in names:
            result = api.generate_assignment(name, force=True)
            if not result.get("success"):
                raise ReleaseError(
                    f"nbgrader could not generate {name} ({reason(result)}). Nothing was written: "
                    f"fix solutions/{name}, then run `make release` again"
                )
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        os.chdir(cwd)
    return {name: scratch / "release" / name for name in names}


def normalized(path: Path) -> dict:
    """A notebook's JSON without the parts that may legitimately differ between runs."""
    nb = json.loads(path.read_text())
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` whole: a reader (or a crash) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def write_manifests(assignments: list[str] | None = None, *, root: Path = REPO) -> list[Path]:
    """``autograder/manifests/<chapter>.json`` from each chapter's source notebook."""
    from autograder import grading

    written = []
    for name in assignments or _chapters(root):
        source = json.loads((root / "solutions" / name / f"{name}.ipynb").read_text())
        path = root / "autograder" / "manifests" / f"{name}.json"
        _replace(path, grading.manifest_text(name, source).encode())
        written.append(path)
    return written


def release(assignments: list[str] | None = None, *, root: Path = REPO) -> list[Path]:
    """Generate every chapter first, then write the manifests and ``notebooks/``; return what was written."""
    released = generate(assignments, root=root)
    scratch = next(iter(released.values())).parent.parent if released else None
    try:
        written = write_manifests(list(released), root=root)
        for name, folder in released.items():
            for nb in sorted(folder.glob("*.ipynb")):
                dest = root / "notebooks" / name / nb.name
                _replace(dest, nb.read_bytes())
                written.append(dest)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return written


def main(argv: list[str], *, root: Path = REPO) -> int:
    warnings.simplefilter("ignore")
    try:
        written = release(argv or None, root=root)
    except ReleaseError as err:
        print(f"release: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(path.relative_to(root))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
