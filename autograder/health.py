"""What grading checks before it grades: a submission that is a notebook, servers that answer.

:mod:`autograder.grading` runs these before any submission is graded (and after a run in
which something fell short), so a grade is recorded only when it was really graded.
"""

from __future__ import annotations

import json
from pathlib import Path


def broken_submission(path: Path) -> str | None:
    """Why the submitted file at ``path`` cannot be graded (not UTF-8, broken JSON, no cells), or None.

    ``course grade`` and nbgrader's autograde both ask this first and, for a broken file,
    name it in one line and grade nothing: the earlier grade, its time stamp and the
    autograded folder stay as they were.
    """
    try:
        text = Path(path).read_bytes().decode("utf-8")
        nb = json.loads(text)
    except OSError as err:
        return f"{path} cannot be read ({err.strerror})"
    except UnicodeDecodeError:
        return f"{path} is not a notebook (not UTF-8 text)"
    except json.JSONDecodeError as err:
        return f"{path} is not a notebook (broken JSON at line {err.lineno}, column {err.colno}: {err.msg})"
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        return f"{path} is not a notebook (no list of cells)"
    return None


#: Appended to :func:`broken_submission`'s line where a grade is kept.
KEPT = "not graded; the earlier grade, its time stamp and the autograded copy are kept"


#: What to do when the servers do not answer, after the message saying what was seen.
NEXT_STEP = (
    'start them again (`docker compose up -d`, or `eval "$(course up --export)"`; or unset '
    "REDIS_URL, DATABASE_URL and COURSE_BACKEND so that grading starts its own), check with "
    "`course doctor`, then grade again. Nothing was graded or recorded"
)


def _unix_socket(kind: str, url: str) -> str | None:
    """The unix socket file a server URL names, or None for TCP."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(url)
    if kind == "redis":
        return parts.path or None if parts.scheme == "unix" else None
    host = (parse_qs(parts.query).get("host") or [parts.hostname or ""])[0]
    if host.startswith("/"):
        return f"{host.rstrip('/')}/.s.PGSQL.{parts.port or 5432}"
    return None


def _unreachable(name: str, url: str, err: BaseException) -> str:
    """One line: which server, what was seen, and the likely cause."""
    from urllib.parse import urlsplit

    sock = _unix_socket("redis" if name == "Redis" else "pg", url)
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    if sock and Path(sock).exists():
        why = (
            f"the socket file {sock} is there but no server listens on it: a stale socket, left by "
            "servers that stopped (a killed `course up` or lab, a reboot)"
        )
    elif sock:
        why = f"there is no socket file {sock}: the servers there are stopped"
    else:
        where = urlsplit(url)
        why = f"nothing answers at {where.hostname}:{where.port} ({type(err).__name__}: {first}): a stopped container or a wrong port?"
    return f"{name} at {url} does not answer: {why}"


def server_problem(env: dict[str, str], *, namespace: bool = False) -> str | None:
    """None when PostgreSQL and Redis at ``env`` answer; else what is wrong and the next step.

    ``namespace``: also make (and drop) a database and a Redis namespace with a table in it,
    as every grading run does (:mod:`course.kit.lab`): a server that answers but refuses to
    create databases cannot grade either.
    """
    import psycopg
    import redis as redis_sync

    problems = []
    try:
        client = redis_sync.Redis.from_url(env["REDIS_URL"], socket_connect_timeout=5, socket_timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as err:  # noqa: BLE001 - any failure means "does not answer"
        problems.append(_unreachable("Redis", env["REDIS_URL"], err))
    try:
        with psycopg.connect(env["DATABASE_URL"], connect_timeout=5) as conn:
            conn.execute("SELECT 1").fetchone()
    except Exception as err:  # noqa: BLE001
        problems.append(_unreachable("PostgreSQL", env["DATABASE_URL"], err))
    if not problems and namespace:
        try:
            from course.kit import lab

            with lab.scratch_sync("health") as ns:
                with ns.connect() as conn:
                    conn.execute("CREATE TABLE health (id int)")
                ns.redis_sync().set("health", 1)
        except Exception as err:  # noqa: BLE001
            problems.append(_no_namespace(err))
    if not problems:
        return None
    return "; ".join(problems) + ". " + NEXT_STEP


def _no_namespace(err: BaseException) -> str:
    return (
        f"the servers answer but a grading namespace cannot be made there ({type(err).__name__}: "
        f"{(str(err).strip().splitlines() or [''])[0][:200]}): does the account in DATABASE_URL "
        "have CREATEDB, and has Redis enough logical databases?"
    )


def namespace_problem(err: BaseException) -> str | None:
    """What to tell when a grading run could not make its namespace because of ``err``: None unless
    ``err`` is the servers' (a refusal or a lost connection), said as :func:`server_problem` says it."""
    import psycopg
    import redis as redis_sync

    from course.kit import backends

    if not isinstance(err, (psycopg.Error, redis_sync.RedisError, backends.BackendError, ConnectionError)):
        return None
    return _no_namespace(err) + ". " + NEXT_STEP
