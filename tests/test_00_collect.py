"""What ``nbgrader collect`` takes from the exchange (autograder/collect.py), in this process.

Each folder here belongs to the account running the tests, which names itself: the owner
check with other accounts runs in tests/test_instructor_flow.py, with real ones.
"""

from __future__ import annotations

import getpass
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from autograder import collect

CH01 = "01_timeouts_and_retries"
ME = getpass.getuser()


def _app(tmp_path: Path, roster: list[str], *, before_duedate=False, duedate=None) -> SimpleNamespace:
    """nbgrader's collect as far as :func:`collect.trusted_records` reads it (the roster is the
    gradebook's students: tests/test_instructor_flow.py reads a real one)."""
    from nbgrader.exchange.default.collect import ExchangeCollect

    app = SimpleNamespace(
        inbound_path=str(tmp_path / "inbound"),
        coursedir=SimpleNamespace(student_id="*", assignment_id=CH01),
        check_owner=True,
        before_duedate=before_duedate,
        duedate=duedate,
        roster=set(roster),
    )
    app._path_to_record = lambda path: ExchangeCollect._path_to_record(app, path)
    return app


@pytest.fixture(autouse=True)
def _roster_of_the_app(monkeypatch):
    monkeypatch.setattr(collect, "_roster", lambda app: app.roster)


def _hand_in(tmp_path: Path, named: str) -> Path:
    folder = tmp_path / "inbound" / f"{ME}+{CH01}+{named}+abc"
    folder.mkdir(parents=True)
    (folder / f"{CH01}.ipynb").write_text("{}")
    return folder


def _now(offset: float = 0.0) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S.000000 UTC", time.gmtime(time.time() + offset))


def test_a_folder_whose_name_agrees_with_the_kernel_keeps_its_time(tmp_path):
    named = _now(-1)
    _hand_in(tmp_path, named)
    (record,), lines = collect.trusted_records(_app(tmp_path, [ME]))
    assert lines == [] and record["timestamp"] == datetime.strptime(named, "%Y-%m-%d %H:%M:%S.%f UTC")


def test_a_time_before_or_after_the_folder_was_made_is_replaced_by_the_kernels(tmp_path):
    for named in ("2020-01-01 00:00:00.000000 UTC", _now(+3600)):
        folder = _hand_in(tmp_path, named)
        (record,), lines = collect.trusted_records(_app(tmp_path, [ME]))
        made = collect.changed_at(folder)
        assert record["timestamp"] == made and abs((datetime.now(UTC).replace(tzinfo=None) - made).total_seconds()) < 60
        assert lines == [
            f"inbound/{folder.name}: its name says {named[:19]} UTC but it was made or last changed at "
            f"{made:%Y-%m-%d %H:%M:%S} UTC: collected as handed in at {made:%Y-%m-%d %H:%M:%S} UTC"
        ]
        folder.rename(tmp_path / folder.name)


def test_without_a_roster_nothing_is_collected_and_the_line_says_why(tmp_path):
    folder = _hand_in(tmp_path, _now(-1))
    records, lines = collect.trusted_records(_app(tmp_path, []))
    assert records == []
    assert lines[0] == f"left out: inbound/{folder.name} (owner {ME}) names {ME}, who is not on the roster"
    assert lines[1].startswith("the gradebook holds no roster") and "nbgrader db student import" in lines[1]


def test_the_newest_of_a_learners_folders_is_collected_or_the_last_before_the_due_date(tmp_path):
    older, newer = _now(-30), _now(-1)
    _hand_in(tmp_path, older), _hand_in(tmp_path, newer)
    (record,), _ = collect.trusted_records(_app(tmp_path, [ME]))
    assert record["filename"].split("+")[2] == newer
    due = datetime.strptime(older, "%Y-%m-%d %H:%M:%S.%f UTC")
    (record,), _ = collect.trusted_records(_app(tmp_path, [ME], before_duedate=True, duedate=due))
    assert record["filename"].split("+")[2] == older
