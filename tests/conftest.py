"""Shared fixtures: every test process gets live servers on first use and stops them at exit."""

from __future__ import annotations

import os
import tempfile

import pytest
import pytest_asyncio

os.environ.setdefault("MPLBACKEND", "Agg")
# course check and selfcheck record results in the learner's progress file (course.progress):
# the tests' results go to a file of their own, never to the home of whoever runs them.
os.environ.setdefault("COURSE_STATE", os.path.join(tempfile.mkdtemp(prefix="course-state-"), "state.sqlite3"))

# The browser tests drive JupyterLab in Chromium and need their own setup: `make test-browser`.
if not os.environ.get("COURSE_BROWSER_TESTS"):
    collect_ignore = ["browser"]


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
