"""Chapter 05's failover demos: what breaks when a consumer is replaced, killed or overwhelmed.

- :func:`failover_runs`: a replacement consumer started while the old one still holds an older
  entry of the key, without an owner lease (it reads ``>`` and overtakes it), then with one:
  the old owner slow, the old owner dead (the lease runs out, the new owner takes its whole
  pending list first), the old owner paused past its lease (its next write is refused);
- :func:`killer_restarts`: a message that kills its consumer on every delivery, restarted by a
  supervisor, with and without ``max_deliveries``;
- :func:`outage_runs`: the dependency down for two minutes (virtual time), without and with the
  consumer's outage breaker;
- :func:`read_ahead`: how much of a backlog one consumer holds while one lane is stuck.

The patterns are in :mod:`course.messaging`; the chapter's tables and helpers in
:mod:`course.chapters.ch05`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

from course import messaging as mq
from course.backoff import FullJitter
from course.chapters.ch05 import applied, fresh_stream, publish, recorder
from course.kit.faults import DependencyError, VirtualClock
from course.retry import RetryPolicy

GROUP = "workers"


def _gated(record, stuck: str, inside: asyncio.Event, release: asyncio.Event):
    """``record``, but the handler of ``stuck`` waits (its transaction open) until ``release``."""

    async def handle(conn, fields) -> None:
        if fields["id"] == stuck:
            inside.set()
            await release.wait()
        await record(conn, fields)

    return handle


async def _killed(run) -> Counter | None:
    """The run's counts, or None if it died with ConsumerKilled (its TaskGroup wraps it in a group)."""
    counts = None
    try:
        counts = await run
    except* mq.ConsumerKilled:
        pass
    return counts


async def _idle_ms(redis, stream: str) -> dict[str, int]:
    rows = await redis.xpending_range(stream, GROUP, "-", "+", 10)
    return {row["consumer"]: row["time_since_delivered"] for row in rows}


async def _replacement_overtakes(pool, redis, stream: str, *, lease_ms: int | None) -> dict:
    """a holds K-1 (slow), K-2 and K-3 arrive, b starts: without a lease b reads them with ``>``."""
    stream, dlq = await fresh_stream(pool, redis, stream)
    await publish(redis, stream, [("K", 1)])
    inside, release = asyncio.Event(), asyncio.Event()
    record = recorder(stream)
    run = dict(stream=stream, group=GROUP, dlq=dlq, lease_ms=lease_ms)
    a = asyncio.create_task(
        mq.ordered_consumer(pool, redis, _gated(record, "K-1", inside, release), consumer="a", **run)
    )
    await asyncio.wait_for(inside.wait(), 10)
    await publish(redis, stream, [("K", 2), ("K", 3)])
    idle = await _idle_ms(redis, stream)
    b = await mq.ordered_consumer(pool, redis, record, consumer="b", **run)
    release.set()
    await a
    return {"applied": await applied(pool, stream), "b": dict(b), "idle_at_b": idle}


async def _owner_dies(pool, redis, stream: str, *, lease_ms: int) -> dict:
    """a dies inside K-1 (its lease stays until it expires); K-2 arrives; b tries until it owns the stream."""
    stream, dlq = await fresh_stream(pool, redis, stream)
    await publish(redis, stream, [("K", 1)])
    record = recorder(stream)

    async def dies_on_k1(conn, fields) -> None:
        if fields["id"] == "K-1":
            raise mq.ConsumerKilled("kill -9 inside K-1")
        await record(conn, fields)

    run = dict(stream=stream, group=GROUP, dlq=dlq, lease_ms=lease_ms)
    await _killed(mq.ordered_consumer(pool, redis, dies_on_k1, consumer="a", **run))
    await publish(redis, stream, [("K", 2)])
    t0, tries = time.perf_counter(), 0
    while True:
        tries += 1
        b = await mq.ordered_consumer(pool, redis, record, consumer="b", **run)
        if not b["not owner"]:
            break
        await asyncio.sleep(lease_ms / 5000)  # a supervisor's retry
    waited = time.perf_counter() - t0
    return {"applied": await applied(pool, stream), "b": dict(b), "tries": tries, "waited_s": waited}


async def _owner_paused(pool, redis, stream: str) -> dict:
    """a froze in its backoff for K-1 past its lease; b took over and applied K-1, K-2; then a wakes."""
    stream, dlq = await fresh_stream(pool, redis, stream)
    await publish(redis, stream, [("K", 1), ("K", 2)])
    paused, resume = asyncio.Event(), asyncio.Event()

    async def frozen(delay: float) -> None:
        paused.set()
        await resume.wait()

    policy = RetryPolicy(2, None, FullJitter(0.01, 0.02), mq.is_transient)
    unreachable = recorder(stream, fail={"K-1": 99})  # a's network to the dependency is down
    a = asyncio.create_task(
        mq.ordered_consumer(
            pool,
            redis,
            unreachable,
            stream=stream,
            group=GROUP,
            consumer="a",
            dlq=dlq,
            policy=policy,
            sleep=frozen,
        )
    )
    await asyncio.wait_for(paused.wait(), 10)
    await redis.delete(
        mq.lease_key(stream, GROUP)
    )  # what Redis does when a's lease runs out during the pause
    b = await mq.ordered_consumer(
        pool, redis, recorder(stream), stream=stream, group=GROUP, consumer="b", dlq=dlq
    )
    resume.set()
    old = await a
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT owner, token FROM mq_fence WHERE stream = %s", (stream,))
        owner, token = await cur.fetchone()
    seen = await mq.metrics(pool, redis, stream=stream, group=GROUP, dlq=dlq)
    return {
        "applied": await applied(pool, stream),
        "a": dict(old),
        "b": dict(b),
        "fence": (owner, token),
        "dead letters": seen["dlq"],
        "blocked keys": seen["blocked_keys"],
    }


async def failover_runs(pool, redis, stream: str, *, lease_ms: int = 400) -> dict[str, dict]:
    """The four failover runs on one key K; ``lease_ms`` is the lease of the run where a dies."""
    return {
        "no lease, a slow": await _replacement_overtakes(pool, redis, stream, lease_ms=None),
        "lease, a slow": await _replacement_overtakes(pool, redis, stream, lease_ms=mq.LEASE_MS),
        "lease, a dies": await _owner_dies(pool, redis, stream, lease_ms=lease_ms),
        "lease, a paused": await _owner_paused(pool, redis, stream),
    }


async def killer_restarts(pool, redis, stream: str, *, max_deliveries: int | None, restarts: int = 8) -> dict:
    """P-1 kills its consumer on every delivery; a supervisor restarts it (once the lease ran out) up
    to ``restarts`` times. How often it died, what Redis counted, where P-1 ended."""
    stream, dlq = await fresh_stream(pool, redis, stream)
    await publish(redis, stream, [("P", 1), ("G", 1), ("P", 2)])
    record = recorder(stream)
    g_done = asyncio.Event()

    async def killer(conn, fields) -> None:
        if fields["id"] == "P-1":
            # the crash comes once G-1 (another key, in flight beside it) has committed: a message
            # still in flight when the process dies is redelivered and counted again too
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(g_done.wait(), 10)
            raise mq.ConsumerKilled("P-1 crashes the process")
        await record(conn, fields)
        if fields["id"] == "G-1":
            g_done.set()

    kills, delivered = 0, []
    for _ in range(restarts):
        await redis.delete(mq.lease_key(stream, GROUP))  # the dead process's lease has run out
        run = mq.ordered_consumer(
            pool,
            redis,
            killer,
            stream=stream,
            group=GROUP,
            consumer="c",
            dlq=dlq,
            max_deliveries=max_deliveries,
        )
        if await _killed(run) is not None:
            break
        kills += 1
        rows = await redis.xpending_range(stream, GROUP, "-", "+", 1)
        delivered.append(rows[0]["times_delivered"] if rows else 0)
    dead = [(f["id"], f["reason"], f["attempts"]) for _, f in await redis.xrange(dlq)]
    seen = await mq.metrics(pool, redis, stream=stream, group=GROUP, dlq=dlq)
    return {"kills": kills, "times_delivered": delivered, "dead": dead, "applied": await applied(pool, stream),
            "pending": seen["pending"], "parked": seen["parked"], "blocked_keys": seen["blocked_keys"]}  # fmt: skip


async def outage_runs(pool, redis, stream: str, *, keys: int = 8, outage_s: float = 120.0) -> dict[str, dict]:
    """Every handler call fails with a 503 for ``outage_s`` virtual seconds (the inventory service is
    down); ``keys`` keys of two messages each. Without the outage breaker, then with it."""
    out = {}
    for name, breaker in (("no breaker", None), ("outage breaker", mq.outage_breaker)):
        stream_, dlq = await fresh_stream(pool, redis, f"{stream}:{name.replace(' ', '-')}")
        await publish(redis, stream_, [(f"K{k}", s) for s in (1, 2) for k in range(keys)])
        clock = VirtualClock(0.0)
        record = recorder(stream_)
        calls = Counter()

        async def down(conn, fields, clock=clock, record=record, calls=calls) -> None:
            if clock() < outage_s:
                calls["during"] += 1
                raise DependencyError(503)
            calls["after"] += 1
            await record(conn, fields)

        counts = await mq.ordered_consumer(
            pool, redis, down, stream=stream_, group=GROUP, consumer="c", dlq=dlq, sleep=clock.sleep, clock=clock,
            breaker=breaker,
        )  # fmt: skip
        seen = await mq.metrics(pool, redis, stream=stream_, group=GROUP, dlq=dlq)
        out[name] = {
            "counts": dict(counts),
            "calls during": calls["during"],
            "dead letters": seen["dlq"],
            "blocked keys": seen["blocked_keys"],
            "applied": len(await applied(pool, stream_)),
            "ended at s": clock(),
        }
    return out


async def read_ahead(pool, redis, stream: str, *, backlog: int = 120, cap: int = 20) -> dict[str, int]:
    """``backlog`` entries of one key S, S-1 stuck in its handler: how many entries the consumer holds
    (read, pending at it, in memory) once it stops reading, with no real cap, then ``max_in_flight=cap``.
    The consumer is stopped once that is measured (what it left pending goes with the stream)."""
    out = {}
    for name, limit in (("unbounded", 10**9), (f"max_in_flight={cap}", cap)):
        stream_, dlq = await fresh_stream(pool, redis, f"{stream}:{limit}")
        await publish(redis, stream_, [("S", s) for s in range(1, backlog + 1)])
        seen = Counter()
        enough, measured = asyncio.Event(), asyncio.Event()

        def log(event: dict, seen=seen, enough=enough) -> None:
            seen[event["event"]] += 1
            if seen["at capacity"] or seen["delivered"] == backlog:  # it stopped reading, or read it all
                enough.set()

        async def stuck(conn, fields, stream_=stream_, seen=seen, enough=enough, measured=measured) -> None:
            if fields["id"] == "S-1":
                await enough.wait()
                seen["held"] = (await redis.xpending(stream_, GROUP))["pending"]
                measured.set()
                await asyncio.Event().wait()  # until the consumer is stopped

        run = asyncio.create_task(
            mq.ordered_consumer(
                pool, redis, stuck, stream=stream_, group=GROUP, consumer="c", dlq=dlq, log=log, batch=10,
                max_in_flight=limit,
            )
        )  # fmt: skip
        await asyncio.wait_for(measured.wait(), 30)
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        out[name] = seen["held"]
    return out
