"""Chapter 08's limiters (course.ratelimit) on the live Redis, on injected time."""

from __future__ import annotations

import httpx
import pytest

from course import ratelimit as rl
from course.chapters import ch08

T = 1_800_000_000.0  # a whole minute


async def _hits(limiter, times, client="c"):
    return [await limiter.hit(client, now=t) for t in times]


async def test_08_fixed_window_lets_twice_its_limit_through_at_the_boundary(ans):
    limiter = rl.FixedWindow(ans.redis(), 10, 60)
    got = await _hits(limiter, [T + 59.5] * 11 + [T + 60.5] * 11)
    assert [d.allowed for d in got] == [True] * 10 + [False] + [True] * 10 + [False]
    assert got[10].retry_after == pytest.approx(0.5)


async def test_08_sliding_log_is_exact_and_says_when_the_oldest_entry_leaves(ans):
    limiter = rl.SlidingLog(ans.redis(), 3, 10)
    got = await _hits(limiter, [T + 1, T + 2, T + 3, T + 4, T + 10.5, T + 11])
    assert [d.allowed for d in got] == [True, True, True, False, False, True]
    assert got[3].retry_after == pytest.approx(7.0)  # T+1 leaves at T+11
    assert got[4].retry_after == pytest.approx(0.5)


async def test_08_sliding_counter_weights_the_previous_window(ans):
    limiter = rl.SlidingCounter(ans.redis(), 10, 60)
    await _hits(limiter, [T + 59] * 10)
    at_half = await _hits(limiter, [T + 90] * 6)  # estimate 10 x 0.5 = 5: five more fit
    assert [d.allowed for d in at_half] == [True] * 5 + [False]
    assert at_half[-1].retry_after == pytest.approx(6.0)  # 10 x (1 - e/60) + 5 <= 9 at e = 36


async def test_08_token_bucket_bursts_then_refills_at_its_rate(ans):
    bucket = rl.TokenBucket(ans.redis(), 4, 2.0)
    got = await _hits(bucket, [T] * 5 + [T + 0.25, T + 0.5])
    assert [d.allowed for d in got] == [True] * 4 + [False, False, True]
    assert [got[4].retry_after, got[5].retry_after] == [pytest.approx(0.5), pytest.approx(0.25)]


async def test_08_token_bucket_key_expires_when_the_bucket_would_be_full(ans):
    redis = ans.redis()
    bucket = rl.TokenBucket(redis, 10, 2.0)
    await _hits(bucket, [T] * 10)
    assert 4_900 <= await redis.pttl(bucket.key("c")) <= 5_000


async def test_08_token_bucket_uses_the_server_clock_without_now(ans):
    bucket = rl.TokenBucket(ans.redis(), 2, 0.01)
    got = [await bucket.hit("live") for _ in range(3)]
    assert [d.allowed for d in got] == [True, True, False]
    assert 99 < got[2].retry_after <= 100.001


async def test_08_leaky_meter_decides_like_the_token_bucket(ans):
    redis = ans.redis()
    times = [T] * 6 + [T + 0.2, T + 0.5, T + 0.5, T + 3]
    a = await _hits(rl.TokenBucket(redis, 5, 2.0), times)
    b = await _hits(rl.LeakyMeter(redis, 5, 2.0), times)
    assert [(d.allowed, d.retry_after) for d in a] == [(d.allowed, d.retry_after) for d in b]


async def test_08_leaky_queue_spaces_slots_and_refuses_when_full(ans):
    queue = rl.LeakyQueue(ans.redis(), 10.0, 3)
    got = await _hits(queue, [T] * 4)
    assert [d.allowed for d in got] == [True, True, True, False]
    assert [d.delay for d in got[:3]] == [0.0, pytest.approx(0.1), pytest.approx(0.2)]


class _Down:
    limit, policy = 10, (10, 1.0)

    async def hit(self, client, cost=1, now=None):
        raise ConnectionError("redis is down")


@pytest.mark.parametrize(("mode", "admitted"), [("bounded", 2), ("open", 5), ("closed", 0)])
async def test_08_fallback_decides_by_mode_when_redis_fails(mode, admitted):
    clock = lambda: 0.0  # noqa: E731 - a frozen clock: no refill
    limiter = rl.FallbackLimiter(_Down(), rl.LocalTokenBucket(2, 1.0, clock=clock), mode=mode)
    got = [await limiter.hit("c") for _ in range(5)]
    assert sum(d.allowed for d in got) == admitted
    assert limiter.breaker.state == "open"  # after a few failures Redis is not even tried


def test_08_parse_retry_after_reads_seconds_and_dates():
    assert rl.parse_retry_after("3") == 3.0
    assert rl.parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470) == 10.0
    assert rl.parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490) == 0.0
    assert rl.parse_retry_after("soon") is None and rl.parse_retry_after(None) is None


async def test_08_middleware_answers_429_with_retry_after_and_ratelimit_fields(ans):
    app = ch08.make_app(ans.redis_url, capacity=2, rate=0.5)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        codes = [(await http.get("/hello")) for _ in range(3)]
        sleeps: list[float] = []

        async def sleep(seconds):
            sleeps.append(seconds)

        last = await rl.get_honouring_retry_after(http, "/hello", attempts=2, sleep=sleep)
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert codes[2].headers["retry-after"] == "2"
    assert codes[0].headers["ratelimit-policy"] == '"default";q=2;w=4'
    assert codes[0].headers["ratelimit"].startswith('"default";r=1;t=')
    assert len(sleeps) == 1 and 2.0 <= sleeps[0] <= 2.2  # what it was told, plus at most 10% jitter
    assert last.status_code == 429  # waited (virtually), still refused


def test_08_limits_uri_speaks_unix_sockets():
    assert ch08.limits_uri("unix:///tmp/r.sock?db=3") == "redis+unix:///tmp/r.sock?db=3"
    assert ch08.limits_uri("redis://h:6379/2") == "redis://h:6379/2"


def test_08_most_in_counts_the_densest_span():
    v = ch08.Verdicts("x", [0.0, 0.5, 1.0, 1.9, 5.0], [True, True, False, True, True])
    assert v.most_in(2.0) == 3 and v.most_in(0.6) == 2


def _scope(peer: str, **headers: str) -> dict:
    return {"client": (peer, 5000), "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_08_made_up_api_keys_share_their_address_bucket():
    """Keyed on the raw header, every invented X-API-Key got a fresh bucket."""
    keys = {"real-key": "acct-7"}
    key = rl.ClientKey(authenticate=keys.get)
    fakes = {key(_scope("203.0.113.9", x_api_key=f"fake-{i}")) for i in range(20)}
    assert fakes == {key(_scope("203.0.113.9"))}
    assert key(_scope("203.0.113.9", x_api_key="real-key")) == key(_scope("198.51.100.1", x_api_key="real-key"))
    assert key(_scope("203.0.113.9", x_api_key="real-key")).startswith("acct:")
    assert "fake" not in rl.client_key(_scope("203.0.113.9", x_api_key="fake-1"))  # hashed, and unknown keys ignored


def test_08_behind_a_trusted_proxy_clients_are_told_apart_and_spoofing_does_not_help():
    key = rl.ClientKey(trusted_proxies=["10.0.0.0/8"])
    a = key(_scope("10.0.0.5", x_forwarded_for="198.51.100.1"))
    b = key(_scope("10.0.0.5", x_forwarded_for="198.51.100.2"))
    assert a != b  # without a trusted proxy list, both were the balancer's one bucket
    spoofed = key(_scope("10.0.0.5", x_forwarded_for="1.2.3.4, 198.51.100.1"))  # the client wrote 1.2.3.4
    assert spoofed == a
    assert key(_scope("198.51.100.1", x_forwarded_for="1.2.3.4")) == key(_scope("198.51.100.1"))  # untrusted peer


def test_08_ipv6_clients_are_limited_per_64():
    key = rl.ClientKey()
    assert key(_scope("2001:db8:1:2::1")) == key(_scope("2001:db8:1:2:ffff::9"))
    assert key(_scope("2001:db8:1:2::1")) != key(_scope("2001:db8:1:3::1"))


async def test_08_the_local_bucket_forgets_the_least_recently_seen_client_not_the_busiest():
    bucket = rl.LocalTokenBucket(3, 0.001, clock=lambda: 0.0, max_clients=3)  # no time passes
    for _ in range(3):
        await bucket.hit("abuser")  # seen first, and again and again: its bucket is empty
    for i in range(10):
        await bucket.hit(f"passer-by-{i}")
        await bucket.hit("abuser")
    assert not (await bucket.hit("abuser")).allowed  # evicted by insertion order, it got 3 fresh tokens


class _Refusing:
    """An httpx client stand-in that answers 429 with ``Retry-After: 1``, then 200."""

    def __init__(self) -> None:
        self.calls = 0

    async def get(self, url, **kwargs):
        self.calls += 1
        return httpx.Response(429 if self.calls == 1 else 200, headers={"retry-after": "1"})


async def test_08_a_fleet_honouring_retry_after_spreads_its_retries_and_never_comes_back_early():
    """The drill promises jitter: without it, every client refused at one moment retries at one moment."""
    import random

    rand = random.Random(8).random
    waits: list[float] = []

    async def sleep(seconds):
        pass

    for _ in range(50):
        await rl.get_honouring_retry_after(_Refusing(), "/x", sleep=sleep, waits=waits, rand=rand)
    assert min(waits) >= 1.0 and max(waits) <= 1.1
    assert max(waits) - min(waits) > 0.05  # spread over the range, not in lockstep


async def test_08_gcra_decides_like_the_token_bucket_and_keeps_one_number(ans):
    import random

    redis = ans.redis()
    rnd = random.Random(8)
    times, t = [], T
    for _ in range(200):
        t += rnd.expovariate(5.0)
        times.append(round(t, 3))
    bucket = await _hits(rl.TokenBucket(redis, 10, 3.0), times)
    gcra = rl.GCRA(redis, 10, 3.0)
    got = await _hits(gcra, times)
    assert [d.allowed for d in got] == [d.allowed for d in bucket]
    # both round the wait up to the millisecond, from sums that differ in the last bits
    assert all(abs(a.retry_after - b.retry_after) <= 0.0015 for a, b in zip(got, bucket, strict=True))
    assert await redis.type(gcra.key("c")) == "string"


class _Counting:
    """A shared limiter stand-in that admits everything and counts the calls it got."""

    limit, policy = 10, (10, 1.0)

    def __init__(self) -> None:
        self.calls = 0

    async def hit(self, client, cost=1, now=None):
        self.calls += 1
        return rl.Decision(True)


async def test_08_a_local_bucket_in_front_refuses_without_a_round_trip_and_spares_a_polite_client():
    shared = _Counting()
    limiter = rl.LocalThenShared(rl.LocalTokenBucket(5, 1.0), shared)
    scraper = [await limiter.hit("scraper", now=0.0) for _ in range(50)]
    polite = [await limiter.hit("polite", now=float(i)) for i in range(10)]  # one a second: within the limit
    assert sum(d.allowed for d in scraper) == 5 and all(d.source == "local" for d in scraper[5:])
    assert all(d.allowed for d in polite)
    assert shared.calls == 5 + 10


class _Outage:
    """A shared limiter stand-in that fails while ``down`` is true."""

    limit, policy = 10, (10, 1.0)
    down = True

    async def hit(self, client, cost=1, now=None):
        if self.down:
            raise ConnectionError("redis is down")
        return rl.Decision(True)


async def test_08_the_fallback_returns_to_redis_within_one_cooldown_once_it_answers_again():
    """A probe that lands inside the outage restarts the cooldown; the next one finds Redis."""
    now = [0.0]
    shared = _Outage()
    limiter = rl.FallbackLimiter(
        shared, rl.LocalTokenBucket(100, 100.0), breaker=rl.redis_breaker(0.2, clock=lambda: now[0])
    )
    sources = []
    for step in range(100):  # a request every 10 ms; Redis is back at 0.5 s
        now[0] = step * 0.01
        shared.down = now[0] < 0.5
        sources.append((now[0], (await limiter.hit("c")).source))
    back = next(t for t, source in sources if t >= 0.5 and source == "redis")
    assert 0.5 <= back <= 0.5 + 0.2 + 0.01
    assert all(source == "redis" for t, source in sources if t > back)


async def test_08_a_rate_limit_does_not_bound_requests_in_flight_and_a_bulkhead_does():
    alone = await ch08.rate_is_not_concurrency(rate=20.0, slow=1.0)
    capped = await ch08.rate_is_not_concurrency(rate=20.0, slow=1.0, concurrency=5)
    assert alone.most_in_flight(after=False) <= 2 and alone.most_in_flight(after=True) >= 18
    assert capped.most_in_flight(after=True) == 5 and capped.refused["bulkhead"] > 0
    assert alone.admitted_per_second(after=True, end=4.0) == pytest.approx(20.0, abs=1.0)


def test_08_an_outage_run_says_when_its_mode_decided_on_redis_again():
    run = ch08.OutageRun("bounded", (0.3, 0.9), 30.0, 0.2, 0.02)
    run.decisions = [(0.1, "redis", True), (0.4, "local", True), (0.95, "redis", False), (1.0, "local", True)]
    run.decisions += [(1.02, "redis", True), (1.03, "redis", True)]
    assert run.back_at == 0.95 and run.all_back_at == 1.02  # one replica back first, the others later
    assert run.in_outage == 1 and run.total == 5
    assert run.admitted("local") == {4: 1, 10: 1} and run.paths == {"redis": 4, "local": 2}
    assert all(len(line) <= 110 for line in run.lines())


def test_08_the_return_to_redis_is_said_from_the_run_not_as_one_cooldown():
    """The chapter said "about one cooldown" where a run measured 0.09 s, and a busy run can take
    three: the sentence is computed from the run, and says "more than one cooldown" only when it was."""

    def run(last: float) -> ch08.OutageRun:
        r = ch08.OutageRun("bounded", (0.3, 0.8), 30.0, 0.2, 0.02)
        r.decisions = [(0.5, "local", True), (0.82, "redis", True), (0.8 + last - 0.01, "local", True)]
        r.decisions += [(0.8 + last, "redis", True), (1.3, "redis", True)]
        return r

    soon = " ".join(ch08.return_to_redis([run(0.09), run(0.05)]).split())
    assert soon.startswith("back on Redis 0.02 s after it answered again, every replica 0.09 s after"), soon
    assert "within one cooldown (0.2 s)" in soon and "more than" not in soon, soon
    late = " ".join(ch08.return_to_redis([run(0.09), run(0.45)]).split())
    assert "every replica 0.45 s after: more than one cooldown (0.2 s)" in late and "within" not in late, late
    assert "still on the fallback" in ch08.return_to_redis([ch08.OutageRun("open", (0.3, 0.8), 30.0, 0.2, 0.02)])
    assert max(map(len, ch08.return_to_redis([run(0.45)]).splitlines())) <= 104
    assert "0.02 s later, on every replica 0.09 s later" in run(0.09).lines()[2]


async def test_08_replay_in_one_pipeline_decides_as_requests_sent_one_by_one(ans):
    redis = ans.redis()
    times = ch08.edge_traffic(10, 60.0, start=T)
    for limiter in ch08.make_limiters(redis, limit=10, window=60.0):
        piped = await ch08.replay(limiter, times)
        await redis.delete(limiter.key("edge"))
        one_by_one = [(await limiter.hit("edge", now=t)).allowed for t in times]
        assert piped.allowed == one_by_one, type(limiter).__name__
