"""``nbgrader collect`` that trusts the file system, not a folder's name.

In nbgrader's exchange every learner writes into one folder (``inbound/``), and a submission
is a folder named ``<student>+<chapter>+<time>+<random>``: any account can make one that names
another learner, or a time before the due date, with a notebook of its choosing. nbgrader's
collect warned about the first ("claims to be submitted by ... cheating attempt?") and
collected it anyway, and took the second at its word. Installed into nbgrader's own collect
(:func:`autograder.nbgrader_plugin.install_guards`), so ``nbgrader collect`` and formgrader's
Collect button both:

- **collect a folder only when its owner is the account of the learner it names, and that
  learner is on the roster** (the gradebook's students, ``nbgrader db student import``).
  Anything else is left out and named in one line (the folder, the name it claims, its owner);
  the learner's own newest submission is collected, never the planted one.
- **time a submission by what the kernel recorded**: the last inode change (``ctime``) of the
  folder and of everything in it, which no learner can set back. The name's time is kept when
  it agrees (it is taken a moment before the folder is made); a name more than a minute
  earlier, or later, than that is named in one line and the kernel's time is used. That time
  goes into ``submitted/<student>/<chapter>/timestamp.txt``, which the gradebook and the
  export read (the ``timestamp.txt`` inside the folder is the learner's to write).
- **leave out a folder it cannot read** (made by hand, closed to you) with one line, instead
  of stopping the whole collect half way.

``CollectApp.check_owner = False`` (nbgrader's own switch, for exchanges where every learner's
files belong to one account, as on a JupyterHub whose containers all run as ``jovyan``) turns
the owner check off.
"""

from __future__ import annotations

import glob
import os
import stat
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path

#: How much later than its name's time a folder may have been made (the copy that ``nbgrader submit``
#: makes after it takes the time) before the two are said to disagree.
AGREE = timedelta(seconds=60)
#: How ``submitted/.../timestamp.txt`` is written (nbgrader's own format, in UTC).
FORMAT = "%Y-%m-%d %H:%M:%S.%f UTC"


def _owner(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def changed_at(folder: Path) -> datetime | None:
    """The last inode change of ``folder`` and of everything in it (naive UTC, as nbgrader keeps
    times); None when some of it cannot be read by this account."""
    latest = os.lstat(folder).st_ctime
    stack = [folder]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            return None
        for entry in entries:
            latest = max(latest, entry.stat(follow_symlinks=False).st_ctime)
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False) and not os.access(entry.path, os.R_OK):
                return None
    return datetime.fromtimestamp(latest, UTC).replace(tzinfo=None)


def _shown(when: datetime) -> str:
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def _roster(app) -> set[str]:
    from nbgrader.api import Gradebook

    with Gradebook(app.coursedir.db_url, app.coursedir.course_id) as gb:
        return {student.id for student in gb.students}


def trusted_records(app) -> tuple[list[dict], list[str]]:
    """(one record per learner to collect, the lines naming what was left out or retimed).

    ``app`` is nbgrader's collect after its own ``init_src`` (which checked the exchange and
    read the due date). Each record is nbgrader's (``username``, ``filename``, ``timestamp``),
    its ``timestamp`` the trusted time.
    """
    pattern = os.path.join(app.inbound_path, f"{app.coursedir.student_id or '*'}+{app.coursedir.assignment_id}+*")
    roster = _roster(app)
    kept: dict[str, list[dict]] = defaultdict(list)
    lines: list[str] = []
    for path in sorted(glob.glob(pattern)):
        record = app._path_to_record(path)
        shown, claimed = f"inbound/{record['filename']}", record["username"]
        owner = _owner(os.lstat(path).st_uid)
        if os.path.islink(path) or not os.path.isdir(path):
            lines.append(f"left out: {shown} (owner {owner}) is not a folder")
        elif app.check_owner and owner != claimed:
            lines.append(f"left out: {shown} claims to be {claimed}'s but belongs to {owner}")
        elif claimed not in roster:
            lines.append(f"left out: {shown} (owner {owner}) names {claimed}, who is not on the roster")
        elif (made := changed_at(Path(path))) is None:
            lines.append(f"left out: {shown} (owner {owner}) cannot be read by you: ask its owner to open it")
        else:
            named = record["timestamp"]
            if not timedelta(0) <= made - named <= AGREE:
                lines.append(
                    f"{shown}: its name says {_shown(named)} but it was made or last changed at {_shown(made)}: "
                    f"collected as handed in at {_shown(made)}"
                )
                record["timestamp"] = made
            kept[claimed].append(record)
    if not roster and lines:
        lines.append(
            "the gradebook holds no roster, so nobody is on it: import it (`nbgrader db student import`, "
            "docs/INSTRUCTORS.md section 1), then collect again"
        )
    chosen = []
    for records in kept.values():
        records.sort(key=lambda r: r["timestamp"], reverse=True)
        due = getattr(app, "duedate", None)
        before = [r for r in records if due is not None and r["timestamp"] <= due]
        chosen.append(before[0] if app.before_duedate and before else records[0])
    return chosen, lines


def _guarded_init_src(original):
    def init_src(self) -> None:
        original(self)
        self.src_records, lines = trusted_records(self)
        self._course_times = {
            os.path.normpath(os.path.join(self.inbound_path, r["filename"])): r["timestamp"] for r in self.src_records
        }
        for line in lines:
            self.log.warning("%s", line)
        if any(line.startswith("left out:") for line in lines):
            self.log.warning(
                "left out: %d folder(s) above; each learner's own newest submission is collected "
                "(docs/INSTRUCTORS.md, section 4, says how to take a planted folder out of the exchange)",
                sum(line.startswith("left out:") for line in lines),
            )

    init_src._course_guard = True
    return init_src


def _guarded_do_copy(original):
    def do_copy(self, src, dest, log=None) -> None:
        original(self, src, dest)
        when = getattr(self, "_course_times", {}).get(os.path.normpath(src))
        if when is not None:  # the trusted time, over the one the learner wrote into the folder
            Path(dest, "timestamp.txt").write_text(when.strftime(FORMAT))

    do_copy._course_guard = True
    return do_copy


def _guarded_release_init_dest(original):
    """``release_assignment`` makes ``inbound/`` sticky: no learner can rename or delete another's
    folder there, and the instructor, its owner, still can (section 4)."""

    def init_dest(self) -> None:
        original(self)
        inbound = Path(self.inbound_path)
        info = inbound.stat()
        if info.st_uid == os.geteuid() and not info.st_mode & stat.S_ISVTX:
            inbound.chmod(stat.S_IMODE(info.st_mode) | stat.S_ISVTX)

    init_dest._course_guard = True
    return init_dest


def install() -> None:
    """Put the checks above into nbgrader's collect and release_assignment (idempotent)."""
    from nbgrader.exchange.default.collect import ExchangeCollect
    from nbgrader.exchange.default.release_assignment import ExchangeReleaseAssignment

    if not getattr(ExchangeCollect.init_src, "_course_guard", False):
        ExchangeCollect.init_src = _guarded_init_src(ExchangeCollect.init_src)
    if not getattr(ExchangeCollect.do_copy, "_course_guard", False):
        ExchangeCollect.do_copy = _guarded_do_copy(ExchangeCollect.do_copy)
    if not getattr(ExchangeReleaseAssignment.init_dest, "_course_guard", False):
        ExchangeReleaseAssignment.init_dest = _guarded_release_init_dest(ExchangeReleaseAssignment.init_dest)
