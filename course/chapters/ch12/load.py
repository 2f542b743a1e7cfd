"""A small HTTP/1.1 load generator for chapter 12, run in a process of its own.

It works like ``wrk``: a fixed number of keep-alive connections, each sending its next
request as soon as the previous answer has arrived (a closed loop), for a schedule of
time slices. Each slice has a label and its own request headers, so one run can alternate
between "served from the cache" and "served from the database" every half second and both
get the same machine, the same noise, the same moment. It records every request: when it
started, how long it took, the status and the ``X-Cache`` header.

It is plain asyncio streams (no HTTP client library): an HTTP client in Python costs more
CPU per request than the service it measures, and then the client, not the service, is
what gets measured.

    python -m course.chapters.ch12.load '{"port": 8000, "paths": ["/abc"], "connections": 16,
                                          "slices": [{"label": "cache", "seconds": 0.5}]}'

prints ``READY <monotonic>`` when its connections are open and the first slice starts, then
one JSON document: ``{"start": ..., "records": [[start, ms, status, label, x_cache], ...]}``.
Times are ``time.monotonic()``, which on Linux is one clock for every process on the machine.
Every run is bounded: it stops after its slices, and requests time out after ``timeout`` s.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time


async def _request(reader, writer, head: bytes, timeout: float) -> tuple[int, str]:
    writer.write(head)
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = raw.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length, x_cache = 0, ""
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"x-cache":
            x_cache = value.strip().decode()
    if length:
        await asyncio.wait_for(reader.readexactly(length), timeout)
    return status, x_cache


async def run(spec: dict) -> dict:
    host = spec.get("host", "127.0.0.1")
    port = int(spec["port"])
    paths = spec["paths"]
    slices = spec["slices"]
    timeout = float(spec.get("timeout", 5.0))
    connections = int(spec.get("connections", 16))
    heads = []
    for sl in slices:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (sl.get("headers") or {}).items())
        heads.append([f"GET {p} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode() for p in paths])
    ends = []
    total = 0.0
    for sl in slices:
        total += float(sl["seconds"])
        ends.append(total)
    records: list[list] = []

    async def connect():
        return await asyncio.wait_for(asyncio.open_connection(host, port), timeout)

    opened = await asyncio.gather(*(connect() for _ in range(connections)), return_exceptions=True)
    start = time.monotonic()
    print(f"READY {start:.6f}", flush=True)

    def slice_at(t: float) -> int | None:
        for i, end in enumerate(ends):
            if t < end:
                return i
        return None

    async def worker(i: int, conn) -> None:
        rnd = random.Random(spec.get("seed", 0) * 1000 + i)
        reader = writer = None
        if not isinstance(conn, BaseException):
            reader, writer = conn
        try:
            while True:
                t = time.monotonic()
                k = slice_at(t - start)
                if k is None:
                    return
                if writer is None:
                    try:
                        reader, writer = await connect()
                    except (TimeoutError, OSError):
                        records.append([t, (time.monotonic() - t) * 1000, 0, slices[k]["label"], ""])
                        await asyncio.sleep(0.01)
                        continue
                head = heads[k][rnd.randrange(len(paths))]
                try:
                    status, x_cache = await _request(reader, writer, head, timeout)
                except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                    status, x_cache = 0, ""
                    writer.close()
                    reader = writer = None
                records.append([t, (time.monotonic() - t) * 1000, status, slices[k]["label"], x_cache])
        finally:
            if writer is not None:
                writer.close()

    await asyncio.gather(*(worker(i, c) for i, c in enumerate(opened)))
    return {"start": start, "seconds": total, "connections": connections, "records": records}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    result = asyncio.run(run(spec))
    print(json.dumps(result, separators=(",", ":")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
