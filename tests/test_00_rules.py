"""Every rule a task's text states has a row in its chapter's rule table (``RULES``), and every
row quotes one sentence of the text and names the kept wrong solution rejected for it.

A chapter's check module (``autograder/checks/chNN``) holds ``RULES`` and ``REFERENCES``; its
``tests/test_NN_grading.py`` holds ``WRONG`` and ``CORRECT`` (see ``autograder/rules.py``).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from autograder import harness
from autograder.rules import Rule, plain, rule_like, sentences, sentences_quoting, task_text, uncovered

ROOT = Path(__file__).resolve().parent.parent

#: Chapters whose rule tables are being written on another branch this wave. Such a chapter
#: is skipped only while its check module has no ``RULES``; once it has them they are tested.
PENDING: set[str] = set()

CHAPTERS = harness.chapters()


def _module(chapter: str):
    return importlib.import_module(f"{harness.CHECKS_PACKAGE}.ch{chapter}")


def _tables(chapter: str) -> tuple[dict, dict]:
    """``(RULES, REFERENCES)`` of a chapter: fails when missing, skips a PENDING chapter."""
    module = _module(chapter)
    rules = getattr(module, "RULES", None)
    if rules is None:
        if chapter in PENDING:
            pytest.skip(f"chapter {chapter} has no RULES yet: {PENDING[chapter]}")
        pytest.fail(f"autograder/checks/ch{chapter} defines no RULES: every chapter needs its rule table")
    references = getattr(module, "REFERENCES", None)
    assert isinstance(references, dict), f"autograder/checks/ch{chapter} defines no REFERENCES dict"
    return rules, references


def _tasks(chapter: str) -> list[str]:
    return [t.id for t in harness.load_chapter(chapter)]


def _grading_module(chapter: str):
    path = ROOT / "tests" / f"test_{chapter}_grading.py"
    assert path.exists(), f"chapter {chapter} has rules but no tests/test_{chapter}_grading.py with WRONG"
    return importlib.import_module(f"tests.test_{chapter}_grading")


def _check_sources(chapter: str) -> str:
    base = ROOT / "autograder" / "checks"
    files = (
        [base / f"ch{chapter}.py"]
        if (base / f"ch{chapter}.py").exists()
        else sorted((base / f"ch{chapter}").glob("*.py"))
    )
    return "\n".join(f.read_text() for f in files)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_graded_task_has_rules_and_references(chapter):
    rules, references = _tables(chapter)
    for tid in _tasks(chapter):
        assert rules.get(tid), f"chapter {chapter}: task {tid} has no rules in RULES"
        assert all(isinstance(rule, Rule) for rule in rules[tid]), f"{tid}: RULES holds something that is not a Rule"
        assert tid in references, f"chapter {chapter}: task {tid} is missing from REFERENCES (use [] when none)"
    unknown = set(rules) - set(_tasks(chapter))
    assert not unknown, f"chapter {chapter}: RULES names tasks the chapter does not grade: {sorted(unknown)}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_reference_names_a_function_of_the_course(chapter):
    _, references = _tables(chapter)
    problems = []
    for tid, names in references.items():
        for name in names:
            module, _, qualname = name.partition(":")
            try:
                target = importlib.import_module(module)
                for part in qualname.split("."):
                    target = getattr(target, part)
            except (ImportError, AttributeError) as err:
                problems.append(f"{tid}: REFERENCES names {name!r}, which does not resolve ({err})")
                continue
            if not callable(target):
                problems.append(f"{tid}: REFERENCES names {name!r}, which is not callable")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_rule_quotes_one_sentence_of_its_task(chapter):
    rules, _ = _tables(chapter)
    problems = []
    for tid, table in rules.items():
        text = task_text(tid, chapter)
        for rule in table:
            if len(plain(rule.text).split()) < 4:
                problems.append(f"{tid}: rule text {rule.text!r} is shorter than 4 words")
                continue
            if not sentences_quoting(rule.text, text):
                problems.append(f"{tid}: rule text {rule.text!r} is not part of any one sentence of the task's text")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_rule_names_its_check_and_a_kept_wrong_solution(chapter):
    rules, _ = _tables(chapter)
    wrong = getattr(_grading_module(chapter), "WRONG", None)
    assert isinstance(wrong, dict), f"tests/test_{chapter}_grading.py defines no WRONG dict"
    checks = _check_sources(chapter)
    problems = []
    for tid, table in rules.items():
        for rule in table:
            name = rule.check.split(":", 1)[0].strip()
            if ":" not in rule.check or not re.search(rf"\bdef {re.escape(name)}\b", checks):
                problems.append(f"{tid}: check {rule.check!r} does not start with a function of the chapter's checks")
            if rule.not_graded:
                if rule.wrong is not None:
                    problems.append(f"{tid}: rule {rule.text!r} is not graded but names a wrong solution")
                if not any("not graded" in s for s in sentences_quoting(rule.text, task_text(tid, chapter))):
                    problems.append(f"{tid}: rule {rule.text!r} is marked not graded, but its sentence does not say so")
            elif rule.wrong is None:
                problems.append(
                    f"{tid}: rule {rule.text!r} names no kept wrong solution (wrong=) and is not not_graded"
                )
            elif rule.wrong not in wrong.get(tid, {}):
                problems.append(f"{tid}: rule {rule.text!r} names WRONG[{tid!r}][{rule.wrong!r}], which does not exist")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_rule_like_sentence_has_a_rule(chapter):
    rules, _ = _tables(chapter)
    missing = []
    for tid in _tasks(chapter):
        for sentence in uncovered(task_text(tid, chapter), rules.get(tid, [])):
            missing.append(f"{tid}: no rule quotes the sentence: {sentence}")
    assert not missing, (
        f"chapter {chapter}: sentences of a task's text that read like rules have no row in RULES "
        "(add a Rule with its check and wrong solution, or mark the sentence '(not graded)'):\n" + "\n".join(missing)
    )


# ----------------------------------------------------------------------------- the helpers themselves


SAMPLE = """## Graded task 1: `demo` (2 points)

Write `demo(x)`. It **must** return `x` unchanged, e.g. for `x = 1`.

- callers of the same key share one call;
- a hint about style.

| case | what |
|---|---|
| none | never raises |

```python
def demo(x): ...
```
"""


def test_sentences_split_blocks_and_sentences_and_strip_marks():
    got = sentences(SAMPLE)
    assert got == [
        "Graded task 1: demo (2 points)",
        "Write demo(x).",
        "It must return x unchanged, e.g. for x = 1.",
        "callers of the same key share one call;",
        "a hint about style.",
        "case | what",
        "none | never raises",
    ]


def test_rule_like_sentences_are_found_and_uncovered_ones_named():
    assert rule_like(SAMPLE) == [
        "It must return x unchanged, e.g. for x = 1.",
        "callers of the same key share one call;",
        "none | never raises",
    ]
    rules = [Rule("must return x unchanged", "check_demo: calls it"), Rule("never raises", "check_demo: ...")]
    assert uncovered(SAMPLE, rules) == ["callers of the same key share one call;"]
