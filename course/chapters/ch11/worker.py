"""The batching counter process that chapter 11 kills (``python -m course.chapters.ch11.worker CFG``).

It counts views of one item as fast as it can through :class:`course.counters.BatchedCounter`
(a flush every ``max_views`` views and on a ticker), and writes how many views it has accepted
into a small memory-mapped file, which survives the process's death, as it takes each one in. SIGTERM
stops the ticker, which flushes; SIGKILL leaves no chance to flush anything.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import struct
import sys

from psycopg_pool import AsyncConnectionPool

from course import counters


async def run(cfg: dict) -> None:
    parent = os.getppid()
    with open(cfg["accepted_file"], "r+b") as f:
        accepted = mmap.mmap(f.fileno(), 16)
    pool = AsyncConnectionPool(
        cfg["database_url"], min_size=1, max_size=2, open=False, kwargs={"autocommit": True}
    )
    await pool.open()
    counter = counters.BatchedCounter(pool, max_views=cfg["max_views"])
    stop = asyncio.Event()
    counters.flush_on_sigterm(asyncio.get_running_loop(), stop)
    ticker = asyncio.create_task(counters.run_ticker(counter, cfg["interval"], stop))
    n = 0
    try:
        while not stop.is_set():
            for _ in range(25):
                # taken in, then counted: the view that fills the buffer commits inside view(), and a
                # kill right after that commit must not find the view missing from the accepted count
                n += 1
                accepted[0:16] = struct.pack("<qq", n, 1)
                await counter.view(cfg["item"])
            await asyncio.sleep(0.002)  # a steady stream of views, not a busy loop
            if os.getppid() != parent:  # the notebook's kernel is gone: stop
                stop.set()
        await ticker  # its last tick flushes what the loop left in the buffer
    finally:
        await counter.close()  # the event loop's shutdown: flush whatever is left
        await pool.close()


def main(argv: list[str]) -> None:
    asyncio.run(run(json.loads(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
