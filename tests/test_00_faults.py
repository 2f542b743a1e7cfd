"""course.kit.faults: the fault tools behave exactly as chapters rely on."""

import asyncio
import threading
import time

import httpx
import pytest

from course.kit.faults import (
    DependencyError,
    FlakyDependency,
    FlakyService,
    Schedule,
    Step,
    VirtualClock,
    kill_postgres_backend,
    pause_redis,
)


async def test_virtual_sleep_takes_no_real_time_and_moves_the_clock():
    clock = VirtualClock()
    t0 = time.perf_counter()
    await clock.sleep(3600)
    assert clock() == 3600
    assert time.perf_counter() - t0 < 60  # an hour of virtual sleep is not a real hour (bound generous on purpose)


async def test_concurrent_sleepers_wake_in_deadline_order_at_their_deadlines():
    clock = VirtualClock()
    woke = []

    async def sleeper(name, seconds):
        await clock.sleep(seconds)
        woke.append((name, clock()))

    await asyncio.gather(sleeper("a", 3), sleeper("b", 1), sleeper("c", 2), sleeper("d", 1))
    assert woke == [("b", 1), ("d", 1), ("c", 2), ("a", 3)]


async def test_sleeps_are_recorded():
    clock = VirtualClock()
    for s in (0.1, 0.2, 0.4):
        await clock.sleep(s)
    assert clock.sleeps == [0.1, 0.2, 0.4]


async def test_manual_clock_moves_only_when_advanced():
    clock = VirtualClock(auto=False)
    task = asyncio.ensure_future(clock.sleep(10))
    await asyncio.sleep(0)
    clock.advance(9)
    await asyncio.sleep(0)
    assert not task.done()
    clock.advance(1)
    await asyncio.sleep(0)
    assert task.done() and clock() == 10


async def test_run_for_wakes_each_sleeper_at_its_own_time():
    clock = VirtualClock(auto=False)
    seen = []

    async def tick():
        while clock() < 5:
            await clock.sleep(1)
            seen.append(clock())

    task = asyncio.ensure_future(tick())
    await clock.run_for(5)
    await task
    assert seen == [1, 2, 3, 4, 5]


def test_negative_sleep_is_an_error():
    with pytest.raises(ValueError):
        asyncio.run(VirtualClock().sleep(-1))


def test_schedule_plays_its_steps_then_its_tail():
    s = Schedule("fail fail ok 429 ok")
    assert [str(s.next()) for _ in range(7)] == ["503", "503", "ok", "429", "ok", "ok", "ok"]


def test_schedule_can_repeat():
    s = Schedule("fail ok", then="repeat")
    assert [str(s.next()) for _ in range(5)] == ["503", "ok", "503", "ok", "503"]


def test_outage_schedule_fails_inside_its_window_only():
    s = Schedule.outage(1.0, 3.0)
    assert [s.next(t).failed for t in (0.5, 1.0, 2.9, 3.0)] == [False, True, True, False]


def test_unknown_step_is_rejected_with_the_valid_forms():
    with pytest.raises(ValueError, match="slow:SECONDS"):
        Step.parse("explode")


async def test_flaky_dependency_follows_its_schedule():
    dep = FlakyDependency("fail reset ok 404", clock=VirtualClock())
    outcomes = []
    for _ in range(4):
        try:
            outcomes.append(await dep())
        except DependencyError as err:
            outcomes.append(err.status)
        except ConnectionResetError:
            outcomes.append("reset")
    assert outcomes == [503, "reset", "ok", 404]
    assert dep.count == 4


async def test_flaky_dependency_slow_step_uses_the_virtual_clock():
    clock = VirtualClock()
    dep = FlakyDependency("slow:30", clock=clock)
    await dep()
    assert clock() == 30


async def test_flaky_dependency_hang_waits_until_cancelled():
    dep = FlakyDependency("hang")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(dep(), 0.05)
    assert dep.calls[0].outcome == "cancelled"


def test_flaky_service_answers_by_schedule_with_retry_after():
    with FlakyService("fail 404 ok", retry_after=2) as svc, httpx.Client() as client:
        first = client.get(svc.url + "/a")
        assert first.status_code == 503 and first.headers["retry-after"] == "2"
        assert client.get(svc.url + "/b").status_code == 404
        assert client.get(svc.url + "/c").json()["status"] == 200
    assert [r.path for r in svc.requests] == ["/a", "/b", "/c"]


def test_flaky_service_reset_and_hang_look_like_network_faults():
    with FlakyService("reset hang") as svc, httpx.Client(timeout=0.2) as client:
        with pytest.raises(httpx.TransportError):
            client.get(svc.url)
        with pytest.raises(httpx.ReadTimeout):
            client.get(svc.url)


async def test_flaky_service_serves_async_clients_concurrently():
    async with FlakyService(Schedule("hang", then="repeat")) as svc:
        async with httpx.AsyncClient(timeout=30) as client:
            calls = [asyncio.ensure_future(client.get(svc.url)) for _ in range(10)]
            for _ in range(3000):  # all ten reach the server while none has been answered
                if svc.count == 10:
                    break
                await asyncio.sleep(0.01)
            assert svc.count == 10 and not any(c.done() for c in calls)
            for c in calls:
                c.cancel()
            await asyncio.gather(*calls, return_exceptions=True)


def test_pause_redis_delays_commands_until_the_pause_ends(ns):
    client = ns.redis_sync()
    pause_redis(client, 0.3)
    t0 = time.perf_counter()
    client.get("x")
    assert time.perf_counter() - t0 >= 0.2


def test_kill_postgres_backend_breaks_that_connection_only(ns):
    import psycopg

    with ns.connect() as victim, ns.connect() as admin:
        assert kill_postgres_backend(admin, victim.info.backend_pid)
        with pytest.raises(psycopg.OperationalError):
            victim.execute("SELECT 1")
        assert admin.execute("SELECT 1").fetchone() == (1,)


async def test_two_clocks_on_one_loop_do_not_keep_each_other_busy():
    a, b = VirtualClock(), VirtualClock()
    t0 = time.perf_counter()
    for _ in range(20):
        await asyncio.gather(a.sleep(1), b.sleep(2))
    assert (a(), b()) == (20, 40)
    assert time.perf_counter() - t0 < 60  # before the fix: ~10,000 idle rounds per sleep and clock


def test_a_service_stopped_by_force_still_shuts_its_app_down():
    """A request that never ends forces the stop; the app's lifespan still closes what it opened."""
    import contextlib
    import socket

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from course.kit.serve import Service

    closed, arrived = threading.Event(), threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        closed.set()  # where a real app closes its pool and its Redis client

    async def forever(request):
        arrived.set()
        await asyncio.sleep(3600)  # never answers: only a forced exit ends the server
        return PlainTextResponse("late")

    svc = Service(Starlette(routes=[Route("/", forever)], lifespan=lifespan), timeout_graceful_shutdown=30).start()
    with socket.create_connection((svc.host, svc.port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert arrived.wait(5)
        svc.stop(timeout=2)  # forced after 2 s; then room for the shutdown, even under load
        assert svc._server.force_exit  # the stop was forced
    assert not svc.running
    assert closed.is_set()
