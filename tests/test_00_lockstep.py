"""The lockstep that graded races stand on (autograder.lockstep): a read-then-write loses its
race on every run, an atomic step never does, and callers that queue on something in-process
do not hang it. A grade that depended on how the scheduler interleaved callers was once seen
to pass a count-then-add limiter on a loaded CI machine."""

from __future__ import annotations

import asyncio

from autograder.probes import gated_redis


async def _run(ans, n: int, step) -> tuple[list, object]:
    client = gated_redis(ans.redis_url, n)
    try:
        results = await client.gate.run([lambda: step(client) for _ in range(n)])
    finally:
        await client.aclose()
    return results, client.gate


async def test_a_get_then_set_loses_every_update_but_one_on_every_run(ans):
    async def bump(redis):
        value = int(await redis.get("counter") or 0)
        await redis.set("counter", value + 1)

    for run in range(3):
        await ans.redis().delete("counter")
        _, gate = await _run(ans, 10, bump)
        assert await ans.redis().get("counter") == "1", f"run {run}"
        assert gate.rounds == 2 and not gate.stalled


async def test_an_atomic_increment_keeps_every_update(ans):
    async def bump(redis):
        await redis.incr("counter")

    _, gate = await _run(ans, 10, bump)
    assert await ans.redis().get("counter") == "10"
    assert gate.rounds == 1


async def test_callers_queued_on_an_in_process_lock_go_through_one_at_a_time(ans):
    lock = asyncio.Lock()

    async def bump(redis):
        async with lock:
            value = int(await redis.get("counter") or 0)
            await redis.set("counter", value + 1)

    _, gate = await _run(ans, 5, bump)
    assert await ans.redis().get("counter") == "5"
    assert gate.stalled >= 8  # every round but the last caller's had callers that could not arrive


async def test_a_watch_multi_retry_stays_exact_through_the_lockstep(ans):
    from redis.exceptions import WatchError

    async def bump(redis):
        async with redis.pipeline() as pipe:
            while True:
                try:
                    await pipe.watch("counter")
                    value = int(await pipe.get("counter") or 0)
                    pipe.multi()
                    pipe.set("counter", value + 1)
                    await pipe.execute()
                    return
                except WatchError:
                    continue

    _, gate = await _run(ans, 6, bump)
    assert await ans.redis().get("counter") == "6"
    assert not gate.stalled
