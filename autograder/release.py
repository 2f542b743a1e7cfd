"""``make release``: the student notebooks in ``notebooks/`` and the grading manifests, from ``solutions/``.

The manifests (``autograder/manifests/<chapter>.json``) hold what grading trusts of each
chapter (its setup cells, the ids of its answer cells, its tasks and points), so a class
copy of the workbook without ``solutions/`` grades exactly as the instructor does.

Generation happens in a throwaway course directory (nbgrader's own generate_assignment),
and only the released notebooks are copied back, so the repository never holds a
gradebook. ``tests/test_00_release.py`` runs the same generation and fails when
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

from autograder.check import REPO, chapters


def generate(assignments: list[str] | None = None) -> dict[str, Path]:
    """Generate the release of each assignment; return {assignment: folder} in a temp dir."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config import Config

    from autograder import settings

    names = assignments or list(chapters())
    root = Path(tempfile.mkdtemp(prefix="course-release-"))
    config = Config()
    settings.apply(config, str(root))
    config.CourseDirectory.source_directory = "source"
    config.CourseDirectory.release_directory = "release"
    for name in names:
        src = REPO / "solutions" / name
        if not src.is_dir():
            raise SystemExit(f"release: no such chapter {name!r} in solutions/")
        shutil.copytree(src, root / "source" / name, ignore=shutil.ignore_patterns(".*", "__pycache__"))
    cwd = os.getcwd()
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        os.chdir(root)
        api = NbGraderAPI(config=config)
        for name in names:
            result = api.generate_assignment(name, force=True)
            if not result.get("success"):
                raise SystemExit(f"release: nbgrader could not generate {name}:\n{result.get('error')}")
    finally:
        os.chdir(cwd)
    return {name: root / "release" / name for name in names}


def normalized(path: Path) -> dict:
    """A notebook's JSON without the parts that may legitimately differ between runs."""
    nb = json.loads(path.read_text())
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def write_manifests(assignments: list[str] | None = None) -> list[Path]:
    """``autograder/manifests/<chapter>.json`` from each chapter's source notebook."""
    from autograder import grading

    written = []
    for name in assignments or list(chapters()):
        source = json.loads((REPO / "solutions" / name / f"{name}.ipynb").read_text())
        written.append(grading.write_manifest(name, source))
    return written


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    for path in write_manifests(argv or None):
        print(path.relative_to(REPO))
    released = generate(argv or None)
    for name, folder in released.items():
        dest = REPO / "notebooks" / name
        dest.mkdir(parents=True, exist_ok=True)
        for nb in folder.glob("*.ipynb"):
            shutil.copy2(nb, dest / nb.name)
            print(f"notebooks/{name}/{nb.name}")
    shutil.rmtree(next(iter(released.values())).parent.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
