"""Shared fixtures: every test process gets live servers on first use and stops them at exit."""

from __future__ import annotations

import fnmatch
import os
import tempfile

import pytest
import pytest_asyncio

os.environ.setdefault("MPLBACKEND", "Agg")
# course check and selfcheck record results in the learner's progress file (course.progress):
# the tests' results go to a file of their own, never to the home of whoever runs them.
os.environ.setdefault("COURSE_STATE", os.path.join(tempfile.mkdtemp(prefix="course-state-"), "state.sqlite3"))

# The browser tests drive JupyterLab in Chromium and need their own setup: `make test-browser`.
# The hub tier starts JupyterHub with real accounts, as root: `make test-hub`.
collect_ignore = [
    *([] if os.environ.get("COURSE_BROWSER_TESTS") else ["browser"]),
    *([] if os.environ.get("COURSE_HUB_TESTS") else ["hub"]),
]


@pytest.fixture
def ns():
    """A fresh, isolated namespace (database + Redis logical database) for one sync test."""
    from course.kit import lab

    with lab.scratch_sync("test") as namespace:
        yield namespace


@pytest_asyncio.fixture
async def ans():
    """The same for an async test; pools and clients it hands out are closed afterwards."""
    from course.kit import lab

    async with lab.scratch("test") as namespace:
        yield namespace


#: The longest tests, measured (seconds on 2 cores under `make test`), start first, so that no
#: worker is still running a long one at the end while the others sit idle.
LONGEST = {
    "test_instructor_flow.py::test_a_class_on_one_shared_machine*": 125,
    "test_00_classroom.py::test_parallel_grading_matches_one_at_a_time*": 90,
    "test_00_shared_machine.py::test_nbgrader_autograde_and_submit_refuse*": 78,
    "test_00_notebook_runs.py::test_the_student_notebook_then_the_solution*[13_*": 75,
    "test_00_notebook_runs.py::test_the_student_notebook_then_the_solution*[12_*": 70,
    "test_00_notebook_runs.py::test_the_student_notebook_then_the_solution*[01_*": 70,
    "test_00_notebook_runs.py::test_the_student_notebook_then_the_solution*[08_*": 65,
    "test_00_notebook_runs.py::test_the_student_notebook_then_the_solution*[06_*": 60,
    "test_00_notebook_runs.py::test_the_student_notebook_then_the_solution*[04_*": 55,
    "test_00_forging.py::test_forgers_and_flagged_answers_through_course_grade_and_nbgrader*": 55,
    "test_00_notebook_runs.py::test_the_student_notebook_then_the_solution*": 45,
    "test_00_check.py::test_a_cell_that_swallows_the_interrupt*": 30,
    "test_instructor_flow.py*": 29,
    "test_00_course_lab.py*": 25,
    "test_contract.py*": 15,
}


def pytest_collection_modifyitems(config, items):
    def weight(item) -> int:
        node = item.nodeid.removeprefix("tests/")
        return -max((w for pattern, w in LONGEST.items() if fnmatch.fnmatchcase(node, pattern)), default=0)

    items.sort(key=weight)  # stable: the rest keep their order
