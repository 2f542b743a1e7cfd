"""One shared machine (issue 27): the oldest Python, per-account servers, grades never silently wrong."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from course.kit import backends, cli

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", [(3, 11, 0), (3, 11, 2), (3, 12, 0), (3, 13, 0)])
def test_every_installed_pin_accepts_every_python_the_readme_claims(version):
    # CI's venv runs on one patch release; a pin whose Requires-Python needs a later patch
    # (soupsieve 3+ needs 3.11.5, Debian 12 ships 3.11.2) would still install there.
    refused, _ = cli.python_requirements(version)
    assert refused == []


def test_doctor_names_a_package_that_needs_a_newer_python():
    refused, floor = cli.python_requirements((3, 10, 0))
    assert refused and all("needs Python" in line for line in refused)
    assert floor.startswith("3.11")
