"""The grader's state: a folder only the grading account can write, and a cache no one can plant.

``course grade`` grades a class in parallel into a cache that nbgrader's autograde then reads
(:mod:`autograder.classroom`). A grade read from there is a grade recorded, so the folder
belongs to the grading account and is closed to others (:func:`private_dir` refuses anything
else, with a clear error), and every entry is bound to the exact answers, the checks' code and
the grader's version (:func:`cache_key`) and authenticated with an HMAC under a key kept in
that folder: a file someone else put there is graded again, never read as a grade.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import threading
from pathlib import Path

from autograder import grading

#: Bumped when what a cache entry means changes; part of every entry's key.
GRADER_VERSION = "2"


def grader_state_dir() -> Path:
    """The grading account's own folder for the grader's state: ``COURSE_GRADER_STATE``, or
    ``$XDG_STATE_HOME/resilient-course/grader`` (``~/.local/state/...``), made private.

    Never a shared, predictable path such as one under ``/tmp``: a folder another account
    made first could hold a planted grade.
    """
    configured = os.environ.get("COURSE_GRADER_STATE")
    if configured:
        path = Path(configured).expanduser()
    else:
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        path = Path(base) / "resilient-course" / "grader"
    return private_dir(path)


def private_dir(path: Path) -> Path:
    """``path``, created mode 700 if missing; :class:`GradingError` when it is not this account's alone."""
    import pwd
    import stat

    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    info = os.lstat(path)
    me = os.geteuid()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise grading.GradingError(
            f"the grader's state folder {path} is not a folder of its own (a link or a file): remove it"
        )
    if info.st_uid != me:
        try:
            owner = pwd.getpwuid(info.st_uid).pw_name
        except KeyError:
            owner = f"uid {info.st_uid}"
        raise grading.GradingError(
            f"the grader's state folder {path} belongs to {owner}, not to this account: grades kept there "
            "could have been written by someone else. Remove it, or set COURSE_GRADER_STATE to a folder of yours"
        )
    if info.st_mode & 0o077:
        raise grading.GradingError(
            f"the grader's state folder {path} is open to other accounts (mode {stat.S_IMODE(info.st_mode):o}): "
            f"run `chmod 700 {path}` (after checking what is in it), or set COURSE_GRADER_STATE to a private folder"
        )
    return path


def _secret(folder: Path) -> bytes:
    """The key that authenticates cache entries in ``folder`` (made on first use, readable by this account only)."""
    path = private_dir(folder) / "cache.key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_bytes(32))
    info = os.lstat(path)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077 or not os.path.isfile(path) or os.path.islink(path):
        raise grading.GradingError(f"the grader's cache key {path} is not this account's alone: remove it")
    key = path.read_bytes()
    if len(key) < 32:
        raise grading.GradingError(f"the grader's cache key {path} is damaged: remove it")
    return key


def _entry_mac(secret: bytes, key: str, graded: dict) -> str:
    import hmac

    text = key + "\n" + json.dumps(graded, sort_keys=True)
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def cache_key(job: dict) -> str:
    """The job's :func:`job_key` bound to the grader's version: the exact answers, the checks' code, the grader."""
    return hashlib.sha256(f"{GRADER_VERSION}:{grading.job_key(job)}".encode()).hexdigest()


def read_cached(cache: Path, key: str) -> grading.Graded | None:
    """The grade stored under ``key``, or None when there is none or it is not authentic."""
    import hmac

    path = Path(cache) / f"{key}.json"
    if not path.is_file():
        return None
    secret = _secret(Path(cache).parent)
    try:
        entry = json.loads(path.read_text())
        good = _entry_mac(secret, key, entry["graded"])
        if entry.get("key") != key or not hmac.compare_digest(good, str(entry.get("mac", ""))):
            return None
        return grading.Graded.from_json(entry["graded"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def write_cached(cache: Path, key: str, graded: grading.Graded) -> None:
    secret = _secret(Path(cache).parent)
    data = graded.to_json()
    entry = {"key": key, "version": GRADER_VERSION, "graded": data, "mac": _entry_mac(secret, key, data)}
    path = Path(cache) / f"{key}.json"
    partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(entry))
    os.replace(partial, path)  # atomic: a reader never sees half a file


def cached_grade(cache: Path | None, chapter: str, trusted: list[dict], submission: dict, **kwargs) -> grading.Graded:
    """:func:`grade`, remembered in ``cache`` (the class command fills it, nbgrader's autograde reads it).

    ``cache`` and its parent must be this account's alone (:func:`private_dir`); every entry
    is bound to the exact answers, the checks' code and the grader's version, and carries an
    HMAC under a key kept beside it, so a file someone else put there is graded again,
    never read as a grade.
    """
    if cache is None:
        return grading.grade(chapter, trusted, submission, **kwargs)
    cache = Path(cache)
    private_dir(cache.parent)
    private_dir(cache)
    key = cache_key(grading.build_job(chapter, trusted, submission))
    found = read_cached(cache, key)
    if found is not None and found.complete:
        return found
    graded = grading.grade(chapter, trusted, submission, **kwargs)
    if graded.complete:  # not graded (the servers stopped answering): never remembered
        write_cached(cache, key, graded)
    return graded
