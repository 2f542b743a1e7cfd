"""Chapter 02: bounded buffers (course.chapters.ch02.backpressure) and availability math (course.availability)."""

from __future__ import annotations

import asyncio

import pytest

from course import availability as av
from course.chapters.ch02 import simulate_replicas, simulate_serial
from course.chapters.ch02.backpressure import MODES, run_pipeline


@pytest.fixture(scope="module")
def pipes():
    return {mode: asyncio.run(run_pipeline(mode, duration=2.0, payload=1024)) for mode in MODES}


def test_an_unbounded_buffer_grows_for_as_long_as_the_overload_lasts(pipes):
    run = pipes["unbounded"]
    assert run.peak_depth > 2500  # 2000/s offered, 500/s handled, for 2 s
    assert run.peak_mb > 5 * pipes["block"].peak_mb
    assert run.rejected == {"payment": 0, "analytics": 0}


def test_blocking_keeps_the_queue_bounded_and_slows_the_producer(pipes):
    run = pipes["block"]
    assert run.peak_depth <= 200
    assert run.rejected == {"payment": 0, "analytics": 0}
    assert run.producer_finished_at > 6.0


def test_rejecting_at_the_edge_turns_work_away_of_every_kind(pipes):
    run = pipes["reject"]
    assert run.peak_depth <= 200
    assert run.rejected["payment"] > 0 and run.rejected["analytics"] > 0


def test_shedding_turns_away_analytics_before_payments(pipes):
    run = pipes["shed"]
    assert run.rejected["payment"] == 0
    assert run.rejected["analytics"] > 0


def test_the_pipeline_is_deterministic():
    a = asyncio.run(run_pipeline("shed", duration=1.0))
    b = asyncio.run(run_pipeline("shed", duration=1.0))
    assert (a.accepted, a.processed, a.peak_depth) == (b.accepted, b.processed, b.peak_depth)


def test_serial_dependencies_multiply():
    assert av.serial(*[0.999] * 4) == pytest.approx(0.996, abs=5e-4)
    assert av.downtime(av.serial(*[0.999] * 4)) == pytest.approx(2.9, abs=0.05)
    assert av.serial(*[0.999] * 10) == pytest.approx(0.99, abs=5e-4)


def test_independent_replicas_add_nines_and_a_shared_part_caps_them():
    assert av.parallel(0.99, 0.99) == pytest.approx(0.9999)
    assert av.with_shared(0.99, 2, 0.999) == pytest.approx(0.999 * 0.9999)
    assert av.nines(0.999) == pytest.approx(3)


def test_the_monte_carlo_agrees_with_the_formulas():
    assert simulate_replicas(0.99, 2, minutes=1_000_000) == pytest.approx(0.9999, abs=5e-5)
    assert simulate_replicas(0.99, 2, shared=0.999, minutes=1_000_000) == pytest.approx(0.9989, abs=2e-4)
    assert simulate_serial(*[0.999] * 4, minutes=500_000) == pytest.approx(0.996, abs=5e-4)


async def test_offer_blocks_between_stages_rejects_at_the_edge_and_sheds_low_value_work():
    from course.bulkhead import offer

    q: asyncio.Queue = asyncio.Queue(4)
    assert all([await offer(q, i, mode="reject") for i in range(4)])
    assert await offer(q, "one too many", mode="reject") is False
    waiting = asyncio.ensure_future(offer(q, "later", mode="block"))
    await asyncio.sleep(0)
    assert not waiting.done()  # the producer waits for room
    q.get_nowait()
    assert await waiting is True

    q = asyncio.Queue(4)
    assert await offer(q, "a", mode="shed", low_value=True) and await offer(q, "b", mode="shed", low_value=True)
    assert await offer(q, "c", mode="shed", low_value=True) is False  # half full: low-value work goes first
    assert await offer(q, "payment", mode="shed") is True
    with pytest.raises(ValueError):
        await offer(asyncio.Queue(), "x", mode="reject")  # unbounded: not backpressure
