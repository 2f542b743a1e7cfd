"""Processes the course starts or records, through psutil: who is alive, waiting, stopping.

A pid alone is not an identity: once a process exits, the kernel may hand its pid to an
unrelated process. Every owner the course records is therefore ``{"pid", "started"}``
(the process's start time), and a recorded owner is alive only when a process with that
pid exists *and* started at that time. A reused pid never keeps an orphaned server alive,
and a stale pid file never gets an unrelated process signalled.
"""

from __future__ import annotations

import os
import signal
import time

import psutil

#: How far two readings of one process's start time may differ (they are rounded).
START_SLACK = 1.0


def started(pid: int | None = None) -> float:
    """The start time (seconds since the epoch) of ``pid`` (default: this process)."""
    return psutil.Process(pid or os.getpid()).create_time()


def identity(pid: int | None = None) -> dict:
    """``{"pid", "started"}`` of ``pid`` (default: this process), to record as an owner."""
    pid = pid or os.getpid()
    return {"pid": pid, "started": started(pid)}


def _process(pid: int, started_at: float | None) -> psutil.Process | None:
    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        if started_at is not None and abs(proc.create_time() - float(started_at)) > START_SLACK:
            return None  # the pid now belongs to someone else
        return proc
    except (psutil.NoSuchProcess, ValueError, TypeError):
        return None
    except psutil.AccessDenied:
        return None


def alive(owner: dict | int) -> bool:
    """Is this recorded owner (``{"pid", "started"}``, or a bare pid) still running?

    A bare pid cannot be told apart from a reused one; records without a start time are
    taken at their word only if the process started no later than they claim ``created``.
    """
    if isinstance(owner, int):
        return _process(owner, None) is not None
    pid = owner.get("pid")
    if pid is None:
        return False
    if "started" in owner:
        return _process(pid, owner["started"]) is not None
    proc = _process(pid, None)
    if proc is None:
        return False
    created = owner.get("created")
    return created is None or proc.create_time() <= float(created) + START_SLACK


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``pid`` to exit; True when it is gone."""
    if pid <= 0:
        return True
    try:
        psutil.Process(pid).wait(timeout)
        return True
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    except psutil.AccessDenied:  # not ours: poll instead
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not psutil.pid_exists(pid):
                return True
            time.sleep(0.05)
        return False


def stop(
    pid: int,
    *,
    sig: int = signal.SIGTERM,
    grace: float = 5.0,
    name: str | None = None,
    not_before: float | None = None,
) -> bool:
    """Signal ``pid``, wait ``grace`` seconds, then SIGKILL it; True when it is gone.

    ``name`` (a substring of the process name, such as ``"postgres"``) and ``not_before``
    (a start time the process cannot precede) guard against a reused pid: a process that
    does not match is left alone. A pid that is not positive (PostgreSQL writes its pid
    negated in ``postmaster.pid`` while in single-user mode) is left alone too.
    """
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if name is not None and name not in proc.name() and name not in " ".join(proc.cmdline()[:1]):
            return False
        if not_before is not None and proc.create_time() + START_SLACK < not_before:
            return False
        proc.send_signal(sig)
        try:
            proc.wait(grace)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(grace)
        return True
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        return True
    except psutil.AccessDenied:
        return False


def catches(pid: int, sig: int) -> bool | None:
    """Whether ``pid`` has a handler of its own for ``sig`` (None: cannot tell, or no such process).

    A parent that stops catching a signal is one that received it: GNU make, sent SIGINT, sets it
    back to its default before it waits for its children and then dies by it (``course lab`` reads
    that, :func:`course.kit.cli._stop_with_parent`). Linux's ``/proc``, else ``ps -o caught=``.
    """
    mask = None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            mask = next((int(line.split()[1], 16) for line in status if line.startswith("SigCgt:")), None)
    except (OSError, ValueError, IndexError):
        import subprocess

        try:
            out = subprocess.run(
                ["ps", "-o", "caught=", "-p", str(pid)], capture_output=True, text=True, timeout=5
            )
            mask = int(out.stdout.strip(), 16) if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, ValueError, subprocess.SubprocessError):
            mask = None
    return None if mask is None else bool(mask >> (int(sig) - 1) & 1)
