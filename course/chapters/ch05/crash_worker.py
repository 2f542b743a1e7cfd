"""Chapter 05's killed consumer (run by :func:`course.chapters.ch05.kill_mid_message` as a file).

One entry at a time, acknowledged first or last; it hangs at a named point until the parent kills
it with SIGKILL. It imports only redis and psycopg, so the process starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import sys
import time

import psycopg


def _worker(cfg: dict) -> None:
    """The killed consumer (runs in a child process): one entry at a time, ack first or last."""
    import redis as redis_sync

    parent = os.getppid()
    r = redis_sync.Redis.from_url(cfg["redis_url"], decode_responses=True)
    stream, group, name = cfg["stream"], cfg["group"], cfg["consumer"]

    def hang() -> None:
        r.set(cfg["marker"], "hanging")
        for _ in range(600):  # the parent kills us; if it died itself, stop within 30 s
            time.sleep(0.05)
            if os.getppid() != parent:
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


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
