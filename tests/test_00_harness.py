"""autograder.harness: a check's verdict, its explanation, and its limits on learner code."""

import asyncio

import pytest

from autograder import harness
from autograder.harness import Report, TaskFailed, run_task, task


@task("_demo_add", chapter="zz", points=2, title="demo", needs=("add",), timeout=1.0)
async def check_demo_add(r: Report, add) -> None:
    r.expect(await add(1, 2) == 3, "add(1, 2) == 3")
    if r.public:
        return
    r.expect(await add(-1, 1) == 0, "add(-1, 1) == 0")


@task("_demo_partial", chapter="zz", points=4, title="demo", needs=("caught",), partial=True, timeout=1.0)
async def check_demo_partial(r: Report, caught) -> None:
    r.fraction = caught / 4


def _run(fn, task_id="_demo_add"):
    return run_task(harness.get_task(task_id), {"add": fn, "caught": fn})


def test_a_correct_answer_gets_full_points():
    async def add(a, b):
        return a + b

    res = _run(add)
    assert res.points == 2 and res.passed
    assert "[ok] add(1, 2) == 3" in res.text()


def test_a_wrong_answer_gets_zero_and_says_what_was_seen():
    async def add(a, b):
        return a + b if a > 0 else 99

    res = _run(add)
    assert res.points == 0
    assert "[FAIL] add(-1, 1) == 0" in res.text()


def test_a_stub_is_reported_as_not_done():
    async def add(a, b):
        raise NotImplementedError

    assert "not done yet" in _run(add).text()


def test_a_missing_name_asks_to_run_its_cell():
    res = run_task(harness.get_task("_demo_add"), {})
    assert res.points == 0 and "is not defined: run the cell" in res.text()


def test_an_exception_in_learner_code_is_one_line_without_grader_traceback():
    async def add(a, b):
        return {}[a]

    text = _run(add).text()
    assert "your code raised KeyError: 1" in text
    assert "Traceback" not in text and "harness.py" not in text


def test_a_busy_loop_that_swallows_interrupts_is_cut_and_only_fails_its_task():
    async def add(a, b):
        while True:
            try:
                pass
            except BaseException:
                pass

    res = _run(add)
    assert res.points == 0 and "cut after" in res.text()


def test_a_real_sleep_is_cut_by_the_time_limit():
    async def add(a, b):
        await asyncio.sleep(3600)

    res = _run(add)
    assert res.points == 0 and "cut after" in res.text()


def test_partial_credit_is_a_share_of_the_points():
    assert _run(3, "_demo_partial").points == 3.0
    assert _run(0, "_demo_partial").points == 0.0


def test_grade_raises_a_short_failure_and_returns_partial_points(capsys):
    async def add(a, b):
        return 0

    with pytest.raises(TaskFailed) as info:
        harness.grade("_demo_add", {"add": add})
    assert info.value._render_traceback_() == ["TaskFailed: _demo_add: 0/2 points (see the lines above)"]
    assert harness.grade("_demo_partial", {"caught": 2}) == 2.0
    assert "_demo_partial: 2/4 points" in capsys.readouterr().out


def test_public_says_hidden_checks_run_at_grading(capsys):
    async def add(a, b):
        return a + b

    harness.public("_demo_add", {"add": add})
    assert harness.PUBLIC_PASSED in capsys.readouterr().out


def test_nothing_reaches_stderr_from_a_check(capsys):
    import sys
    import warnings

    async def add(a, b):
        warnings.warn("noisy", UserWarning, stacklevel=1)
        print("oops", file=sys.stderr)
        return a + b

    _run(add)
    assert capsys.readouterr().err == ""


def test_every_chapter_task_is_registered_once():
    for chapter in harness.chapters():
        tasks = harness.load_chapter(chapter)
        assert len({t.id for t in tasks}) == len(tasks)


def test_a_cut_busy_loop_does_not_keep_spinning():
    import threading

    async def add(a, b):
        while True:
            try:
                pass
            except BaseException:
                pass

    _run(add)
    assert not [t for t in threading.enumerate() if t.name == "check-_demo_add" and t.is_alive()]


@task("_demo_seeded", chapter="zz", points=1, title="demo", needs=("add",), timeout=1.0, seed=77)
async def check_demo_seeded(r: Report, add) -> None:
    r.expect(await add(1, 2) == 3, "add(1, 2) == 3")


def test_the_seed_banner_is_one_line_after_the_verdict():
    async def add(a, b):
        return a - b

    res = run_task(harness.get_task("_demo_seeded"), {"add": add})
    assert res.lines[0].startswith("  [FAIL] add(1, 2) == 3"), res.lines
    assert res.lines[-1] == "  - random choices come from seed 77: the same code gets the same verdict on every run"
    assert sum("seed 77" in line for line in res.lines) == 1


def test_validate_fails_a_stub_and_a_wrong_answer_and_passes_a_right_one(monkeypatch, capsys):
    """nbgrader's Validate button: a notebook worth 0 points must not read "Success!"."""
    monkeypatch.setenv("NBGRADER_EXECUTION", "validate")

    async def stub(a, b):
        raise NotImplementedError("not done yet")

    async def wrong(a, b):  # passes the public check, not the hidden one
        return 3 if (a, b) == (1, 2) else 1

    async def right(a, b):
        return a + b

    with pytest.raises(TaskFailed, match="not done yet"):
        harness.public("_demo_add", {"add": stub})
    with pytest.raises(TaskFailed, match="1/2 points|0/2 points"):
        harness.public("_demo_add", {"add": wrong})
    capsys.readouterr()
    harness.public("_demo_add", {"add": right})
    assert "2/2 points" in capsys.readouterr().out


def test_validate_says_why_in_the_error_its_dialog_shows(monkeypatch, capsys):
    """Validate's dialog shows a failing cell's source (``public("...")``) and its error, not what the
    cell printed: the error names the hidden checks and the answer cell, and carries each [FAIL] line
    with what the check was doing, wrapped to the dialog's width."""
    monkeypatch.setenv("NBGRADER_EXECUTION", "validate")

    async def wrong(a, b):  # passes the public check, not the hidden one
        return 3 if (a, b) == (1, 2) else 1

    async def stub(a, b):
        raise NotImplementedError("not done yet")

    with pytest.raises(TaskFailed) as info:
        harness.public("_demo_add", {"add": wrong})
    (said,) = info.value._render_traceback_()
    words = " ".join(said.split())
    assert "[FAIL] add(-1, 1) == 0" in said and "[ok]" not in said, said
    assert "hidden checks" in words and "the cell that defines `add`" in words, said
    assert "see the lines above" not in said and "random choices" not in said, said
    assert max(map(len, said.splitlines())) <= harness.DIALOG_WIDTH, said
    with pytest.raises(TaskFailed) as info:
        harness.public("_demo_add", {"add": stub})
    (said,) = info.value._render_traceback_()
    assert "not done yet" in said and "the cell that defines `add`" in " ".join(said.split()), said
    assert max(map(len, said.splitlines())) <= harness.DIALOG_WIDTH, said
    assert capsys.readouterr().out == ""  # nothing printed that the dialog would not show


def test_validate_shows_what_the_check_was_doing_when_it_failed():
    t = harness.get_task("_demo_add")
    lines = ["  - one request", "  [ok] one", "  - 20 requests at once, in lockstep", "  [ok] all returned"]
    lines += ["  [FAIL] 2 admitted, expected 1", "  - seed"]
    said = harness.validate_message(t, harness.Result(t.id, 0, 2, lines, 0.1))
    assert "  - 20 requests at once, in lockstep\n  [FAIL] 2 admitted, expected 1" in said, said
    assert "one request" not in said and "[ok]" not in said and "seed" not in said, said


def test_an_unfinished_test_cell_names_the_answer_cell_not_the_cell_above(capsys):
    """The cell right above a test cell is a try-it cell: "the cell above" would send the learner there."""

    async def stub(a, b):
        raise NotImplementedError("not done yet")

    harness.public("_demo_add", {"add": stub})
    said = capsys.readouterr().out
    assert said.startswith("_demo_add: not done yet") and "\n" not in said.strip(), said
    assert "write `add` in the answer cell" in said and "cell above" not in said, said


def test_fit_keeps_one_item_one_item():
    """A wrapped line never starts with a lone "-" (a bullet of its own), and a message's second line
    (a PostgreSQL DETAIL) goes under its first, not flush left."""
    long = "  - " + "word " * 12 + "a - b " + "word " * 12
    for width in range(40, 90):
        wrapped = harness.fit(long, width).splitlines()
        assert [line for line in wrapped if line.lstrip().startswith("- ")] == [wrapped[0]], wrapped
        assert all(line.startswith("    ") for line in wrapped[1:]), wrapped
    two = harness.fit("  [FAIL] your code raised CheckViolation: no\nDETAIL:  Failing row contains (7)")
    assert two.splitlines()[1] == "         DETAIL:  Failing row contains (7)", two


@task("_demo_many", chapter="zz", points=1, title="demo", needs=("add",), timeout=1.0)
async def check_demo_many(r: Report, add) -> None:
    for n in range(40):
        r.expect(await add(n, 1) == n + 1, f"add({n}, 1) == {n + 1}")


@task("_demo_class", chapter="zz", points=1, title="demo", needs=("Adder",), timeout=1.0)
async def check_demo_class(r: Report, Adder) -> None:
    r.expect(Adder() is not None, "Adder() builds")


def test_selfcheck_at_full_marks_is_a_line_per_task_and_says_why_where_one_falls_short(capsys, monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    monkeypatch.setenv("COURSE_NO_PROGRESS", "1")
    tasks = [harness.get_task(t) for t in ("_demo_many", "_demo_add", "_demo_class")]
    monkeypatch.setattr(harness, "load_chapter", lambda chapter: tasks)

    async def add(a, b):
        return a + b if a >= 0 else 99

    harness.selfcheck("zz", {"add": add})
    out = capsys.readouterr().out
    assert "[ok]" not in out.split("_demo_add: 0/2 points")[0], out  # the passing task's 40 lines are left out
    assert "[FAIL] add(-1, 1) == 0" in out and "40 observations passed" in out, out
    assert "not started: Adder is not defined" in out and "started, 0 points" in out, out
    assert "every_line=True" in out, out
    harness.selfcheck("zz", {"add": add}, every_line=True)
    assert "[ok] add(39, 1) == 40" in capsys.readouterr().out


def test_selfcheck_says_not_done_only_for_a_stub():
    done = harness.Result("t", 2, 2, [], 0.1)
    stub = harness.Result("t", 0, 2, [], 0.1, not_done=True)
    short = harness.Result("t", 1, 2, [], 0.1)
    wrong = harness.Result("t", 0, 2, [], 0.1)
    assert harness._status(done) == "done"
    assert harness._status(stub) == "not done"
    assert "falls short" in harness._status(short)
    assert harness._status(wrong) != "not done"
    assert harness._status(wrong, ["Adder"]).startswith("not started"), "a class never defined was not started"


def test_selfcheck_says_where_it_can_be_fooled_and_what_grades(capsys, monkeypatch):
    """It runs in the learner's kernel: its total is a guide, `course check` is the grade."""
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    monkeypatch.setenv("COURSE_NO_PROGRESS", "1")
    harness.selfcheck("00", {})  # nothing defined: every task fails fast, no server needed
    out = capsys.readouterr().out
    assert "total: 0/" in out and "`course check` grades a saved" in out, out


def test_a_claim_says_whether_the_run_bore_it_out_and_travels_in_the_cell_output(capsys):
    from course.kit import claims

    held = claims.check("a beats b", measured="3 against 9", held=3 < 9, source="Brooker 2015", otherwise="x")
    missed = claims.check("c beats d", measured="9 against 3", held=9 < 3, otherwise="a loaded machine")
    text = capsys.readouterr().out
    assert "[held] a beats b\n    measured: 3 against 9 (Brooker 2015)" in text and "why a run" not in held.text()
    assert "[did not hold on this run] c beats d" in text and "why a run can miss it: a loaded machine" in text
    outputs = [{"output_type": "display_data", "data": {claims.MIME: vars(c)}} for c in (held, missed)]
    assert claims.found_in(outputs) == [held, missed]
    long = claims.check("word " * 60, measured="m", held=True)
    assert max(map(len, long.text().splitlines())) <= claims.WIDTH


def test_an_error_reads_the_same_on_every_run():
    """What PostgreSQL and Python put in an error that changes between runs (a deadlock's
    process numbers, a failing row's timestamp, an object's address) is masked in feedback."""
    deadlock = (
        "deadlock detected\nDETAIL:  Process 48213 waits for ShareLock on transaction 7731; "
        "blocked by process 48214.\nFailing row contains (7, 2026-12-05 12:31:07.118204+00)."
    )
    masked = harness.stable_text(deadlock + " <function f at 0x7f3a2c1b9e40>")
    assert "48213" not in masked and "7731" not in masked and "12:31" not in masked and "0x7f" not in masked
    assert masked == harness.stable_text(
        deadlock.replace("48213", "9").replace("07.118204", "59.000001") + " <function f at 0x55aa11>"
    )
    assert "deadlock detected" in masked and "(7, <timestamp>)" in masked


def test_a_dataclass_answer_runs_and_replicates_as_in_the_notebook():
    """A learner's cell is compiled on its own terms, not with the grader's ``from __future__
    import annotations`` (under which ``@dataclass`` in a module-less cell raises)."""
    namespace = {"__name__": "__learner__"}
    harness.run_cell(
        "from dataclasses import dataclass, field\n\n"
        "@dataclass\nclass Counter:\n    pending: dict = field(default_factory=dict)\n",
        namespace,
        "<answer dataclass>",
    )
    again = harness.replica(namespace, "Counter")
    assert again is not namespace["Counter"] and again().pending == {}


def test_an_answer_still_as_handed_out_is_not_done_without_running_its_check():
    """A function whose body is only ``raise NotImplementedError`` (after a docstring or comments) is the
    stub handed out: its task is "not done yet" before the check builds anything. Anything else runs."""
    from autograder.cellsource import unfinished
    from autograder.harness import run_cell

    source = '''
async def stub(a, b=1):
    """What it does."""
    # YOUR CODE HERE
    raise NotImplementedError()

def bare():
    raise NotImplementedError

def started():
    x = 1
    raise NotImplementedError

def other():
    raise ValueError("no")

import functools
@functools.lru_cache
def wrapped():
    raise NotImplementedError

class Stubbed:
    def go(self):
        raise NotImplementedError
'''
    namespace: dict = {"__name__": "__learner__"}
    run_cell(source, namespace, "<answer stubs>")
    assert unfinished(namespace["stub"]) and unfinished(namespace["bare"])
    for name in ("started", "other", "wrapped", "Stubbed"):
        assert not unfinished(namespace[name]), name
    assert not unfinished(len) and not unfinished(lambda: None)


def test_a_parse_that_parses_again_in_its_own_thread_goes_on():
    """On 3.11 the grader parses one AST at a time; a parse that runs a finalizer which logs a traceback
    parses again in the same thread (traceback's caret anchors): that must not wait for itself."""
    import ast
    import sys
    import threading

    import autograder

    if sys.version_info >= (3, 12):
        pytest.skip("the parse lock is 3.11's alone")
    done: list[int] = []

    def nested() -> None:
        with autograder._parsing:  # noqa: SLF001 - what a parse in progress holds
            ast.parse("x = 1")
            done.append(1)

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    worker.join(10)
    assert done, "a parse inside a parse in one thread waited for itself"


def test_no_collection_runs_inside_a_parse_so_no_finalizer_parses_inside_one(monkeypatch):
    """3.11: a finalizer that parses (a logged traceback's caret anchors), run by a collection in the
    middle of a parse, reset the counter the outer parse checks at its end: SystemError, AST constructor
    recursion depth mismatch (make test met it). The collector is off for the length of a parse, and on
    again after it, also when the parse fails."""
    import ast
    import gc
    import sys

    import autograder

    if sys.version_info >= (3, 12):
        pytest.skip("the parse lock is 3.11's alone")
    seen: list[bool] = []
    real = autograder._parse  # noqa: SLF001

    def parse(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(autograder, "_parse", parse)
    assert gc.isenabled()
    ast.parse("x = 1")
    with pytest.raises(SyntaxError):
        ast.parse("x = (")
    assert seen == [False, False] and gc.isenabled()
