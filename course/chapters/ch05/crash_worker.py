"""Chapter 05's killed consumers (run as a file by :func:`course.chapters.ch05.kill_runs`).

``python crash_worker.py CFG [CFG ...]``: this process imports redis and psycopg once, then forks
one consumer per configuration, one after the other. Each reads its stream one entry at a time,
acknowledges first or last, and hangs at a named point after writing its pid to a Redis key;
the notebook's process kills it there with SIGKILL, and the next one is forked. A fork starts in
milliseconds, where a fresh interpreter spends a second importing the two clients.
"""

from __future__ import annotations

import json
import os
import sys
import time

import psycopg
import redis as redis_sync


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _worker(cfg: dict) -> None:
    """One killed consumer (a forked child): one entry at a time, ack first or last."""
    parent = os.getppid()
    r = redis_sync.Redis.from_url(cfg["redis_url"], decode_responses=True)
    stream, group, name = cfg["stream"], cfg["group"], cfg["consumer"]

    def hang() -> None:
        r.set(cfg["marker"], str(os.getpid()))
        for _ in range(600):  # the notebook kills us; if it (or our parent) died, stop within 30 s
            time.sleep(0.05)
            if os.getppid() != parent or not _alive(cfg["owner"]):
                os._exit(1)
        os._exit(1)

    with psycopg.connect(cfg["database_url"], autocommit=True) as conn:
        while reply := r.xreadgroup(group, name, {stream: ">"}, count=1):
            entry_id, fields = reply[0][1][0]
            if cfg["ack"] == "first":
                r.xack(stream, group, entry_id)
            with conn.transaction():
                cur = conn.execute(
                    "INSERT INTO mq_processed (message_id, stream, entry_id) VALUES (%s, %s, %s) "
                    "ON CONFLICT DO NOTHING RETURNING 1",
                    (fields["id"], stream, entry_id),
                )
                if cur.fetchone():
                    conn.execute(
                        "INSERT INTO ch05_applied (stream, message_id, key, seq, consumer) VALUES (%s, %s, %s, %s, %s)",
                        (stream, fields["id"], fields["key"], int(fields["seq"]), name),
                    )
                if fields["id"] == cfg["hang_on"] and cfg["hang_at"] == "before commit":
                    hang()
            if fields["id"] == cfg["hang_on"] and cfg["hang_at"] == "after commit":
                hang()
            if cfg["ack"] == "last":
                r.xack(stream, group, entry_id)


def main(configs: list[dict]) -> None:
    for cfg in configs:
        pid = os.fork()
        if pid == 0:
            try:
                _worker(cfg)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)  # until the notebook has killed it


if __name__ == "__main__":
    main([json.loads(arg) for arg in sys.argv[1:]])
