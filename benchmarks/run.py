"""Measured, not asserted: what a chapter costs the learner, the instructor and the test suite.

    make bench                         # everything below (about 15 minutes on 2 cores)
    python benchmarks/run.py --only grading --chapters 03 05

Parts (``--only`` picks some):

- ``servers``: cold starts of the embedded Redis and PostgreSQL;
- ``grading``: per chapter, ``selfcheck`` (every hidden check on the solution's answers,
  in-process, as in the learner's kernel) and ``course check`` of the solution (servers up);
- ``class``: a class of 20 submissions of one chapter graded one after another and all at
  once (one per core), as notebooks per minute and their ratio, from one run;
- ``notebooks``: each solution notebook top to bottom, full size (nbclient);
- ``suite``: ``make test``'s tests, timed from pytest's JUnit report and summed per group
  (the toolkit and grader, each chapter, the instructor's flow), so a new chapter's cost shows;
- ``versus`` (only when asked, with ``--baseline PATH``): ``course check`` of each solution with this
  checkout and another (an earlier version, made with ``git worktree add``, with servers its own
  ``course up`` starts), alternating, and where one run's time goes (interpreter starts, sandboxes,
  databases, each cell and each task's checks);
- ``determinism`` (only when asked, ``--only determinism``): every kept wrong solution
  (``WRONG`` in ``tests/test_NN_grading.py``) graded ``--runs`` times in one process
  (``COURSE_DETERMINISM_RUNS``, default 20); prints each one whose points, verdict or
  feedback lines changed between runs, and the time one round of all of them takes.

Prints tables and writes ``artifacts/benchmarks.json``. Targets (2 cores): servers under 3 s;
selfcheck under 5 s; course check under 8 s; a notebook under 60 s (90 s for 12 and 13);
``make test`` under 8 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("MPLBACKEND", "Agg")
# The benchmark's `course check` runs are measurements, not a learner's attempts: they must not
# enter the progress file of whoever runs `make bench` (course progress, chapter 14).
os.environ.setdefault("COURSE_NO_PROGRESS", "1")
PARTS = ("servers", "grading", "class", "notebooks", "suite")
EXTRA_PARTS = ("determinism", "versus")  # run only when named: long, or needing a second checkout


def _chapters(wanted: list[str] | None) -> list[str]:
    from autograder import grading

    return [c for c in grading.known_chapters() if not wanted or c[:2] in wanted]


def servers(repeat: int) -> dict[str, float]:
    from course.chapters import ch00

    runs: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeat):
        for name, seconds in ch00.cold_start().items():
            runs[name].append(seconds)
    return {name: statistics.median(values) for name, values in runs.items()}


def _solution(chapter: str) -> dict:
    return json.loads((REPO / "solutions" / chapter / f"{chapter}.ipynb").read_text())


def selfcheck_seconds(chapter: str) -> float:
    """The solution's setup and answer cells in a fresh process, then ``selfcheck`` timed there."""
    from autograder import grading

    job = grading.build_job(chapter, grading.read_manifest(chapter), _solution(chapter))
    code = (
        "import ast, asyncio, json, sys, time\n"
        "from autograder.harness import selfcheck\n"
        "job = json.load(sys.stdin)\n"
        "loop = asyncio.new_event_loop(); asyncio.set_event_loop(loop)\n"
        "ns = {'__name__': '__main__'}\n"
        "for c in job['cells']:\n"
        "    if c['kind'] != 'test':\n"
        "        src = '\\n'.join('pass' if l.lstrip()[:1] in '%!' and l.strip() else l for l in c['source'].splitlines())\n"
        "        code = compile(src, f\"<{c['kind']} cell {c['id']}>\", 'exec', flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)\n"
        "        result = eval(code, ns)\n"
        "        if asyncio.iscoroutine(result):\n"
        "            loop.run_until_complete(result)\n"
        "t0 = time.perf_counter(); selfcheck(job['chapter'], ns)\n"
        "print('SELFCHECK', time.perf_counter() - t0)\n"
    )
    env = dict(os.environ, NBGRADER_EXECUTION="", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True, env=env, timeout=600
    ).stdout
    match = re.search(r"SELFCHECK ([0-9.]+)", out)
    return float(match.group(1)) if match else float("nan")


def grading_times(chapters: list[str]) -> dict[str, dict]:
    from autograder import check

    out = {}
    for chapter in chapters:
        t0 = time.perf_counter()
        res = check.check(REPO / "solutions" / chapter / f"{chapter}.ipynb")
        out[chapter] = {
            "course_check_s": time.perf_counter() - t0,
            "score": f"{res.score:g}/{res.max_score:g}",
            "selfcheck_s": selfcheck_seconds(chapter),
        }
    return out


def _course_check(repo: Path, chapter: str, env: dict) -> float:
    """Seconds of ``course check`` of ``chapter``'s solution, run from the checkout at ``repo``."""
    python = repo / ".venv" / "bin" / "python"
    t0 = time.perf_counter()
    done = subprocess.run(
        [str(python), "-m", "autograder.check", str(repo / "solutions" / chapter / f"{chapter}.ipynb")],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.perf_counter() - t0
    return seconds if done.returncode == 0 else float("nan")


def versus(chapters: list[str], baseline: Path, repeat: int) -> dict:
    """``course check`` of each solution with this checkout and with ``baseline`` (another checkout, its
    own venv, its own servers of the same kind), alternating, so both meet the same machine; plus where
    one run of this checkout's grading spends its time (the runner's phases)."""
    from course.kit import backends

    env = {**os.environ, **backends.servers().as_env(), "COURSE_NO_PROGRESS": "1"}
    with _own_servers(baseline) as urls:
        their_env = {**env, **urls}
        out = _versus(chapters, baseline, repeat, env, their_env)
    return out


@contextlib.contextmanager
def _own_servers(checkout: Path):
    """Servers started by ``checkout``'s own ``course up`` in a runtime folder of their own (an earlier
    version's sandbox may not reach servers this one started, which run as an account of their own)."""
    runtime = Path(tempfile.mkdtemp(prefix="bench-baseline-"))
    env = {**os.environ, "TMPDIR": str(runtime)}
    for name in ("REDIS_URL", "DATABASE_URL", "COURSE_BACKEND"):  # the embedded servers, whatever main() chose
        env.pop(name, None)
    course = str(checkout / ".venv" / "bin" / "course")
    up = subprocess.run([course, "up"], cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    urls = dict(re.findall(r"^(REDIS_URL|DATABASE_URL)=(\S+)$", up.stdout, re.M))
    if len(urls) != 2:
        raise SystemExit(f"the baseline's course up printed no server URLs:\n{up.stdout}{up.stderr}")
    try:
        yield urls
    finally:
        subprocess.run([course, "down"], cwd=checkout, env=env, capture_output=True, timeout=120)
        shutil.rmtree(runtime, ignore_errors=True)


def _versus(chapters: list[str], baseline: Path, repeat: int, env: dict, their_env: dict) -> dict:
    from autograder import grading

    out = {}
    for chapter in chapters:
        ours, theirs = [], []
        for _ in range(repeat):
            theirs.append(_course_check(baseline, chapter, their_env))
            ours.append(_course_check(REPO, chapter, env))
        job = grading.build_job(chapter, grading.read_manifest(chapter), _solution(chapter))
        t0 = time.perf_counter()
        run = grading._run_once({**job, "sandbox": grading._sandbox_mode("auto")}, 600)  # noqa: SLF001
        total = time.perf_counter() - t0
        phases = next((e["seconds"] for e in run.events if e["event"] == "phases"), {})
        inside = sum(v for k, v in phases.items() if k != "session in all") if phases else 0.0
        out[chapter] = {
            "baseline_s": statistics.median(theirs),
            "this_s": statistics.median(ours),
            "phases": {"grading process start (interpreter, imports)": max(0.0, total - inside), **phases},
        }
    return out


def class_run(chapter: str, size: int = 20) -> dict:
    """``size`` submissions (the solution and the unfinished stub, alternating) graded both ways."""
    from autograder import grading

    trusted = grading.read_manifest(chapter)
    solution = _solution(chapter)
    student = json.loads((REPO / "notebooks" / chapter / f"{chapter}.ipynb").read_text())
    subs = [solution if i % 2 == 0 else student for i in range(size)]
    t0 = time.perf_counter()
    sequential = [grading.grade(chapter, trusted, nb).score for nb in subs]
    t1 = time.perf_counter()
    jobs = os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        parallel = list(pool.map(lambda nb: grading.grade(chapter, trusted, nb).score, subs))
    t2 = time.perf_counter()
    seq_rate, par_rate = size / (t1 - t0) * 60, size / (t2 - t1) * 60
    return {
        "chapter": chapter,
        "submissions": size,
        "jobs": jobs,
        "sequential_per_min": seq_rate,
        "parallel_per_min": par_rate,
        "ratio": par_rate / seq_rate,
        "same_scores": sequential == parallel,
    }


def notebook_times(chapters: list[str]) -> dict[str, float]:
    import nbformat

    from course.kit.headless import HeadlessClient

    out = {}
    for chapter in chapters:
        path = REPO / "solutions" / chapter / f"{chapter}.ipynb"
        nb = nbformat.read(path, as_version=4)
        t0 = time.perf_counter()
        HeadlessClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
        ).execute()
        out[chapter] = time.perf_counter() - t0
    return out


def _group(test_file: str, name: str) -> str:
    """``chapter 03`` for test_03_*.py and chapter-parametrized tests of 03; else the area."""
    chapter = re.search(r"\[(\d\d)_", name)
    if chapter:
        return f"chapter {chapter.group(1)}"
    match = re.match(r"tests/test_(\d\d)_", test_file)
    if match and match.group(1) != "00":
        return f"chapter {match.group(1)}"
    if "instructor" in test_file or "classroom" in test_file:
        return "instructor flow"
    return "toolkit and grader"


def suite() -> dict:
    report = REPO / "artifacts" / "junit.xml"
    report.parent.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "3", "--dist", "loadgroup", "-q", f"--junitxml={report}"],
        cwd=REPO,
        env=dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"),
    )
    wall = time.perf_counter() - t0
    groups: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for case in ET.parse(report).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        test_file = re.sub(r"/(Test\w+)$", "", path) + ".py"
        group = _group(test_file, case.get("name", ""))
        groups[group] += float(case.get("time", 0))
        counts[group] += 1
    return {"wall_s": wall, "groups": dict(groups), "tests": dict(counts)}


def determinism(chapters: list[str], runs: int) -> dict:
    """Every kept wrong solution of ``chapters`` graded ``runs`` times in this process."""
    import importlib

    from tests.helpers import outcome_of, run_source

    rows, flips, started = [], [], time.perf_counter()
    for chapter in chapters:
        number = chapter[:2]
        if not (REPO / "tests" / f"test_{number}_grading.py").exists():
            continue
        wrong = getattr(importlib.import_module(f"tests.test_{number}_grading"), "WRONG", {})
        for task_id, entries in sorted(wrong.items()):
            for name, (source, _mentions) in sorted(entries.items()):
                t0 = time.perf_counter()
                outcomes = [outcome_of(run_source(task_id, source)) for _ in range(runs)]
                distinct = sorted(set(outcomes), key=outcomes.index)
                row = {
                    "task": task_id,
                    "solution": name,
                    "runs": runs,
                    "outcomes": len(distinct),
                    "points": sorted({o[0] for o in outcomes}),
                    "seconds_per_run": (time.perf_counter() - t0) / runs,
                }
                rows.append(row)
                if len(distinct) > 1:
                    flips.append(row | {"first": list(distinct[0][2]), "other": list(distinct[1][2])})
    return {
        "runs": runs,
        "solutions": len(rows),
        "round_s": sum(r["seconds_per_run"] for r in rows),
        "wall_s": time.perf_counter() - started,
        "flips": flips,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", choices=PARTS + EXTRA_PARTS, default=list(PARTS))
    parser.add_argument("--chapters", nargs="*", help="chapter numbers (default: all)")
    parser.add_argument("--class-chapter", default="03", help="the chapter the class of 20 hands in")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="versus: another checkout with its own .venv (git worktree add)")
    parser.add_argument(
        "--runs",
        type=int,
        default=int(os.environ.get("COURSE_DETERMINISM_RUNS", "20")),
        help="determinism: gradings of each kept wrong solution",
    )
    args = parser.parse_args()

    from course.kit import backends

    srv = backends.servers()  # everything below shares these servers
    os.environ.update(srv.as_env(), COURSE_BACKEND="env")
    chapters = _chapters(args.chapters)
    results: dict = {"measured": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count()}
    load = os.getloadavg()[0]

    if "servers" in args.only:
        results["cold_start_s"] = servers(args.repeat)
        for name, seconds in results["cold_start_s"].items():
            print(f"cold start {name:32} {seconds:6.2f} s   (target < 3 s)")
    if "grading" in args.only:
        results["grading"] = grading_times(chapters)
        print(f"\n{'chapter':36} {'selfcheck':>10} {'course check':>13}   score")
        for chapter, row in results["grading"].items():
            print(f"{chapter:36} {row['selfcheck_s']:9.1f}s {row['course_check_s']:12.1f}s   {row['score']}")
        print("targets: selfcheck < 5 s, course check < 8 s (servers up)")
    if "class" in args.only:
        chapter = _chapters([args.class_chapter])[0]
        row = results["class"] = class_run(chapter)
        print(
            f"\nclass of {row['submissions']} ({chapter}): {row['sequential_per_min']:.1f} notebooks/min one at a time, "
            f"{row['parallel_per_min']:.1f}/min with {row['jobs']} at once: x{row['ratio']:.2f}; "
            f"same scores: {row['same_scores']}"
        )
    if "notebooks" in args.only:
        results["notebook_s"] = notebook_times(chapters)
        print()
        for chapter, seconds in results["notebook_s"].items():
            target = 90 if chapter[:2] in ("12", "13") else 60
            print(f"notebook {chapter:36} {seconds:6.1f} s   (target < {target} s)")
    if "suite" in args.only:
        results["suite"] = suite()
        print(f"\nmake test's tests: {results['suite']['wall_s']:.0f} s wall (target < 480 s); worker time per group:")
        for group, seconds in sorted(results["suite"]["groups"].items()):
            print(f"  {group:24} {seconds:7.1f} s  ({results['suite']['tests'][group]} tests)")
    if "versus" in args.only:
        if args.baseline is None:
            parser.error("--only versus needs --baseline PATH (a checkout of the version to compare with)")
        results["versus"] = versus(chapters, args.baseline.resolve(), args.repeat)
        print(f"\n{'chapter':36} {'baseline':>9} {'this':>9}   (course check of the solution, median of {args.repeat})")
        for chapter, row in results["versus"].items():
            print(f"{chapter:36} {row['baseline_s']:8.1f}s {row['this_s']:8.1f}s")
        first = next(iter(results["versus"].values()), None)
        if first:
            print(f"\nwhere one run of {next(iter(results['versus']))} goes (seconds):")
            for name, seconds in first["phases"].items():
                print(f"  {name:48} {seconds:6.2f}")
    if "determinism" in args.only:
        row = results["determinism"] = determinism(chapters, args.runs)
        print(
            f"\ndeterminism: {row['solutions']} kept wrong solutions x {row['runs']} runs in {row['wall_s']:.0f} s "
            f"(one round {row['round_s']:.1f} s); {len(row['flips'])} changed between runs"
        )
        for flip in row["flips"]:
            print(f"  {flip['task']} / {flip['solution']}: {flip['outcomes']} outcomes, points {flip['points']}")
            changed = [(a, b) for a, b in zip(flip["first"], flip["other"], strict=False) if a != b][:1]
            for a, b in changed:
                print(f"    {a.strip()}\n    {b.strip()}")
    results["load_average_at_start"] = load
    out = REPO / "artifacts" / "benchmarks.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten to {out.relative_to(REPO)} (load average {load:.1f} when it started)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
