"""A class's copy of the course that carries no working answer to a graded task (issue 40).

    python -m autograder.handout DEST [--chapters 01 02 ...] [--release 02 ...]
    course handout DEST ...                           # the same

Writes the repository's files into ``DEST`` (a folder, or ``DEST.tar.gz``) without what would
answer the graded tasks: ``solutions/``, the tests (they keep correct answers to every task),
``benchmarks/`` (they run the solutions), the model answers of hand-graded tasks
(``docs/answers/``, ``docs/rubrics/``) and the CI scripts; and with the course's own answer to
every graded task of ``--chapters`` (default: every graded chapter) replaced by code that raises,
as the grading sandbox shows them (:mod:`autograder.references`). ``--release NN`` keeps chapter
NN's answers (after its deadline: a later chapter's demo may use an earlier chapter's pattern,
and the command says which). The learner's notebooks, the checks (``selfcheck`` and
``course check`` need them) and everything else are copied as they are.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEFT_OUT = ("solutions/", "tests/", "benchmarks/", "docs/answers/", "docs/rubrics/", ".ci/", "artifacts/")


def tracked_files(repo: Path = REPO) -> list[str]:
    """The repository's files as git tracks them (every file under it, where it is no git checkout)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        return sorted(p for p in out.split("\0") if p)
    except (OSError, subprocess.SubprocessError):
        skip = re.compile(r"(^|/)(\.git|\.venv[^/]*|__pycache__|\.pytest_cache|\.ruff_cache)(/|$)")
        return sorted(
            str(p.relative_to(repo))
            for p in repo.rglob("*")
            if p.is_file() and not skip.search(str(p.relative_to(repo)))
        )


def uses_of_answers(chapters: list[str]) -> list[str]:
    """``"course/chapters/ch04/outages.py uses chapter 02's course.breaker.CircuitBreaker"``: demos of other
    chapters that call an answer this hand-out leaves out (they raise until that chapter is released)."""
    from autograder import references

    found = []
    for chapter in chapters:
        for spec in references.specs(chapter):
            module, _, qualname = spec.partition(":")
            short, name = module.rsplit(".", 1)[-1], qualname.split(".")[0]
            pattern = re.compile(rf"\b{re.escape(short)}\.{re.escape(name)}\b|\bimport\b[^\n]*\b{re.escape(name)}\b")
            for path in sorted((REPO / "course").rglob("*.py")) + sorted((REPO / "notebooks").rglob("*.ipynb")):
                rel = str(path.relative_to(REPO))
                owner = re.search(r"(?:chapters/ch|notebooks/)(\d\d)", rel)
                if owner and owner.group(1) != chapter and rel != module.replace(".", "/") + ".py":
                    if pattern.search(path.read_text(errors="replace")):
                        found.append(f"{rel} uses chapter {chapter}'s {module}.{qualname}")
    return found


def build(dest: Path, chapters: list[str], release: list[str]) -> dict:
    """Write the hand-out; returns what was left out, replaced and which demos need a released chapter."""
    import importlib.util

    from autograder import harness, references

    stubbed_chapters = [c for c in chapters if c not in release]
    replace: dict[str, str] = {}
    for chapter in stubbed_chapters:
        for module, qualnames in references._grouped(references.specs(chapter)).items():  # noqa: SLF001
            spec = importlib.util.find_spec(module)
            rel = str(Path(spec.origin).resolve().relative_to(REPO))
            source = replace.get(rel) or (REPO / rel).read_text()
            replace[rel] = references.handout_stub(source, module, qualnames)
    files = [f for f in tracked_files() if not f.startswith(LEFT_OUT)]
    tarball = dest.name.endswith((".tar.gz", ".tgz"))
    if tarball:
        dest.parent.mkdir(parents=True, exist_ok=True)
        archive = tarfile.open(dest, "w:gz")
    else:
        dest.mkdir(parents=True, exist_ok=True)
    note = (
        "This is a class hand-out of Resilient Backend Patterns. It has no solutions/, no tests and no model\n"
        "answers, and the course's own answers to the graded tasks of chapters "
        f"{', '.join(stubbed_chapters) or 'none'} raise instead of running:\n"
        "write your own. `make lab`, `selfcheck` and `course check` work as the README says, except the few\n"
        "checks that build their scenario with one of those answers: they say so and your instructor runs them.\n"
    )
    for rel in [*files, "HANDOUT.txt"]:
        data = note.encode() if rel == "HANDOUT.txt" else (replace[rel].encode() if rel in replace else None)
        source = REPO / rel
        if data is None and not source.is_file():
            continue
        if tarball:
            info = tarfile.TarInfo(f"{dest.name.split('.tar')[0].split('.tgz')[0]}/{rel}")
            payload = data if data is not None else source.read_bytes()
            info.size, info.mode = len(payload), (0o755 if data is None and source.stat().st_mode & 0o111 else 0o644)
            archive.addfile(info, io.BytesIO(payload))
        else:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data if data is not None else source.read_bytes())
            if data is None:
                target.chmod(source.stat().st_mode & 0o777)
    if tarball:
        archive.close()
    return {
        "files": len(files) + 1,
        "left_out": [p for p in LEFT_OUT if any(f.startswith(p) for f in tracked_files())],
        "replaced": sorted(replace),
        "needs_release": uses_of_answers(stubbed_chapters),
        "graded_chapters": harness.chapters(),
    }


def main(argv: list[str] | None = None) -> int:
    from autograder import harness

    parser = argparse.ArgumentParser(prog="course handout", description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="a folder to write, or a .tar.gz")
    parser.add_argument(
        "--chapters", nargs="+", metavar="NN", help="chapters whose answers to leave out (default: all)"
    )
    parser.add_argument("--release", nargs="+", default=[], metavar="NN", help="chapters whose answers to keep")
    args = parser.parse_args(argv)
    known = [c for c in harness.chapters() if references_of(c)]
    wanted = [c.zfill(2)[:2] for c in args.chapters] if args.chapters else known
    release = [c.zfill(2)[:2] for c in args.release]
    unknown = sorted(set(wanted + release) - set(harness.chapters()))
    if unknown:
        print(
            f"course handout: no chapter {', '.join(unknown)} (known: {', '.join(harness.chapters())})", file=sys.stderr
        )
        return 2
    if args.dest.exists() and (args.dest.is_file() or any(args.dest.iterdir())):
        print(f"course handout: {args.dest} exists and is not empty: choose a new place", file=sys.stderr)
        return 2
    done = build(args.dest, wanted, release)
    print(f"wrote {done['files']} files to {args.dest}")
    print(f"left out: {', '.join(done['left_out'])}")
    print(f"answers replaced by code that raises, in: {', '.join(done['replaced']) or 'nothing'}")
    for line in done["needs_release"]:
        print(f"  note: {line}; that demo raises until you hand it out again with --release")
    return 0


def references_of(chapter: str) -> list[str]:
    from autograder import references

    return references.specs(chapter)


if __name__ == "__main__":
    sys.exit(main())
