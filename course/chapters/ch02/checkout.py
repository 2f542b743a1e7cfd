"""The checkout endpoint of chapter 02's live demo: a handler that charges a payments service.

The handler runs on a server with a fixed number of workers (a semaphore), calls the
payments service over real HTTP with an ``httpx`` timeout, and answers like a web
framework would: 200, 504 when payments timed out, 502 when it failed, and 503 with
``Retry-After`` when a :class:`~course.breaker.CircuitBreaker` rejects the call.
:func:`load` drives it at a steady rate and records every request's latency.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from course.breaker import CircuitBreaker, CircuitOpenError
from course.chapters.ch02 import Timeline


@dataclass
class Response:
    status: int
    headers: dict = field(default_factory=dict)
    body: dict = field(default_factory=dict)


class Checkout:
    """``POST /checkout``: charge the order through payments, optionally behind a breaker."""

    def __init__(
        self,
        payments_url: str,
        client: httpx.AsyncClient,
        *,
        breaker: CircuitBreaker | None = None,
        workers: int = 6,
    ) -> None:
        self.payments_url = payments_url
        self.client = client
        self.breaker = breaker
        self.workers = asyncio.Semaphore(workers)

    async def _charge(self, order: dict) -> dict:
        response = await self.client.post(f"{self.payments_url}/charge", json=order)
        response.raise_for_status()
        return response.json()

    async def handle(self, order: dict) -> Response:
        async with self.workers:  # a request holds a worker for as long as it waits on payments
            try:
                if self.breaker is not None:
                    receipt = await self.breaker.call(lambda: self._charge(order))
                else:
                    receipt = await self._charge(order)
                return Response(200, body={"paid": True, "receipt": receipt})
            except CircuitOpenError as err:
                return Response(
                    503, {"Retry-After": err.retry_after_header}, {"error": "payments_unavailable"}
                )
            except httpx.TimeoutException:
                return Response(504, body={"error": "payments_timeout"})
            except httpx.HTTPError:
                return Response(502, body={"error": "payment_failed"})


@dataclass
class Sample:
    start: float  # seconds since the load started
    seconds: float
    status: int
    retry_after: str | None = None


async def load(app: Checkout, *, rate: float = 40.0, duration: float = 3.0) -> list[Sample]:
    """Send ``rate`` checkouts a second for ``duration`` seconds (open loop); time each one."""
    t0 = time.monotonic()
    samples: list[Sample] = []

    async def one(i: int) -> None:
        start = time.monotonic()
        response = await app.handle({"order": i, "amount": 100})
        samples.append(
            Sample(start - t0, time.monotonic() - start, response.status, response.headers.get("Retry-After"))
        )

    tasks = []
    for i in range(int(rate * duration)):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(max(0.0, t0 + (i + 1) / rate - time.monotonic()))
    await asyncio.gather(*tasks)
    return sorted(samples, key=lambda s: s.start)


def as_timeline(samples: list[Sample], breaker: CircuitBreaker | None, t0: float, outage, duration: float):
    """Turn a load run into a :class:`~course.chapters.ch02.Timeline` for :func:`~course.chapters.ch02.plot_timeline`."""
    outcome = {200: "ok", 503: "rejected"}
    tl = Timeline(outage=outage, duration=duration)
    tl.requests = [(s.start, s.seconds, outcome.get(s.status, "failed")) for s in samples]
    if breaker is not None:
        tl.transitions = [(max(0.0, t - t0), state) for t, state in breaker.transitions]
    return tl
