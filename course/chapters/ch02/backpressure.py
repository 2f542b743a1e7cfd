"""Backpressure (chapter 02's demo): the slow side makes the fast side slow down instead of buffering forever.

:func:`run_pipeline` runs a producer that offers work faster than a consumer can handle it,
with one of four buffers between them, on a :class:`~course.kit.faults.VirtualClock` (so the
run is instant and the same every time) while ``tracemalloc`` measures the real memory the
buffer holds:

- ``unbounded``: ``asyncio.Queue()``; nothing pushes back, memory and waiting time grow
  for as long as the overload lasts (in production, until the OOM killer ends it and
  everything in the buffer is lost);
- ``block``: ``asyncio.Queue(maxsize)`` with ``await put``: the producer waits, which is
  right *between* pipeline stages (the slowdown travels upstream);
- ``reject``: ``put_nowait`` and a 503 (or 429) when full: right at the *edge* of a
  service, where a blocked handler would still hold a connection while the client times out;
- ``shed``: like ``reject``, but once the queue is half full the least valuable work
  (analytics) is turned away first, so payments still get in.

The bounded modes go through :func:`course.bulkhead.offer`, the pattern itself.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from dataclasses import dataclass, field

from course.bulkhead import offer

MODES = ("unbounded", "block", "reject", "shed")


@dataclass
class PipelineRun:
    mode: str
    samples: list[tuple[float, int, float]] = field(default_factory=list)  # (t, queue depth, MB held)
    offered: dict[str, int] = field(default_factory=lambda: {"payment": 0, "analytics": 0})
    accepted: dict[str, int] = field(default_factory=lambda: {"payment": 0, "analytics": 0})
    processed: int = 0
    waits: list[float] = field(default_factory=list)  # seconds from offer to done, per processed item
    producer_finished_at: float = 0.0

    @property
    def rejected(self) -> dict[str, int]:
        return {k: self.offered[k] - self.accepted[k] for k in self.offered}

    @property
    def peak_mb(self) -> float:
        return max((mb for _, _, mb in self.samples), default=0.0)

    @property
    def peak_depth(self) -> int:
        return max((d for _, d, _ in self.samples), default=0)


async def run_pipeline(
    mode: str,
    *,
    rate: float = 2000.0,
    service_rate: float = 500.0,
    duration: float = 4.0,
    maxsize: int = 200,
    payload: int = 4096,
    payment_share: float = 0.1,
    tick: float = 0.01,
    seed: int = 2,
    clock=None,
) -> PipelineRun:
    """Offer ``rate`` items/s for ``duration`` s to a consumer that handles ``service_rate``/s.

    Each item carries ``payload`` bytes (an event body). Every ``payment_share`` of them is a
    payment, the rest analytics. Returns queue depth and traced memory over time, what was
    accepted and rejected per class, and how long accepted items waited.
    """
    import random

    from course.kit.faults import VirtualClock

    if mode not in MODES:
        raise ValueError(f"mode is one of {MODES}")
    clock = clock or VirtualClock()
    rng = random.Random(seed)
    run = PipelineRun(mode)
    queue: asyncio.Queue = asyncio.Queue() if mode == "unbounded" else asyncio.Queue(maxsize)
    per_tick = max(1, round(rate * tick))
    done_producing = asyncio.Event()

    async def producer() -> None:
        for _ in range(int(duration / tick)):
            for _ in range(per_tick):
                kind = "payment" if rng.random() < payment_share else "analytics"
                run.offered[kind] += 1
                item = (kind, clock(), bytearray(payload))
                if mode == "unbounded":
                    queue.put_nowait(item)  # never full, never says no
                elif not await offer(queue, item, mode=mode, low_value=kind == "analytics"):
                    continue  # at the edge this is a 503 with Retry-After
                run.accepted[kind] += 1
            await clock.sleep(tick)
        run.producer_finished_at = clock()
        done_producing.set()

    async def consumer() -> None:
        while True:
            kind, offered_at, _body = await queue.get()
            await clock.sleep(1 / service_rate)
            run.processed += 1
            run.waits.append(clock() - offered_at)
            queue.task_done()

    baseline = 0

    def sample() -> None:
        run.samples.append((clock(), queue.qsize(), (tracemalloc.get_traced_memory()[0] - baseline) / 1e6))

    async def sampler() -> None:
        while not done_producing.is_set():
            sample()
            await clock.sleep(0.05)

    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    try:
        workers = [asyncio.ensure_future(consumer()), asyncio.ensure_future(sampler())]
        await producer()
        sample()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return run
