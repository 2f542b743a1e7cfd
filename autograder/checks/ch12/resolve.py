"""Hidden checks of ``resolve``: cache-aside behind a breaker, Redis and PostgreSQL down."""

from __future__ import annotations

import contextvars
import math
import random

import psycopg
import redis.asyncio as aioredis
import redis.exceptions
from psycopg_pool import AsyncConnectionPool
from redis.asyncio.client import Pipeline

from autograder.checks.ch12.codes import TOP
from autograder.harness import Report, error_line, task
from autograder.probes import seeded_random, tally
from course import shortener
from course.breaker import CircuitBreaker
from course.kit import lab
from course.kit.faults import VirtualClock
from course.shortener import (
    encode_code as course_encode,
)  # bound now: in the kernel the references raise while a check runs (autograder/references.py)

# ============================================================================ resolve

#: set while a breaker the check handed out runs a call: a Redis command sent without it went around the breaker
_IN_BREAKER: contextvars.ContextVar[bool] = contextvars.ContextVar("in_breaker", default=False)


class _Switch:
    def __init__(self) -> None:
        self.calls = 0
        self.down = False
        self.outside = 0  # Redis commands sent outside breaker.call
        self.expire_after_probe = False  # delete the key right after an EXISTS/TTL/PTTL that looked at it
        self.probed = False  # the expiry above happened


PROBES = {"EXISTS", "TTL", "PTTL", "TYPE"}  # commands that look at a key without reading its value


class _WatchedBreaker(CircuitBreaker):
    """The course's breaker; it marks the commands sent inside its calls."""

    async def call(self, fn):
        token = _IN_BREAKER.set(True)
        try:
            return await super().call(fn)
        finally:
            _IN_BREAKER.reset(token)


class _CheckPipeline(Pipeline):
    switch: _Switch

    async def execute(self, raise_on_error: bool = True):
        self.switch.calls += 1
        self.switch.outside += not _IN_BREAKER.get()
        if self.switch.down:
            raise redis.exceptions.ConnectionError("Error 111 connecting to redis:6379. Connection refused.")
        return await super().execute(raise_on_error)


class _CheckRedis(aioredis.Redis):
    """A real client whose every command is counted and, while ``switch.down``, refused."""

    switch: _Switch

    async def execute_command(self, *args, **options):
        self.switch.calls += 1
        self.switch.outside += not _IN_BREAKER.get()
        if self.switch.down:
            raise redis.exceptions.ConnectionError("Error 111 connecting to redis:6379. Connection refused.")
        result = await super().execute_command(*args, **options)
        if self.switch.expire_after_probe and args and str(args[0]).upper() in PROBES and len(args) > 1:
            # the key expires right after the look: what a TTL running out between two commands does
            self.switch.expire_after_probe, self.switch.probed = False, True
            await super().execute_command("DEL", *args[1:])
        return result

    def pipeline(self, transaction: bool = True, shard_hint=None):
        pipe = _CheckPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.switch = self.switch
        return pipe


def _cursor_class(switch: _Switch):
    class CheckCursor(psycopg.AsyncCursor):
        async def execute(self, query, params=None, **kwargs):
            if switch.down:
                raise psycopg.OperationalError("connection to server failed: Connection refused (PostgreSQL is down)")
            switch.calls += 1
            return await super().execute(query, params, **kwargs)

    return CheckCursor


def _roughly(ms: int) -> str:
    """A TTL as a person reads it, coarse enough that the seconds a busy machine takes between the write
    and the PTTL never change the text (a minute read 2 s late is still about a minute)."""
    if ms >= 3_600_000:
        return f"about {ms / 3_600_000:.0f} h"
    if ms >= 90_000:
        return f"about {ms / 60_000:.0f} min"
    if ms >= 45_000:
        return "about a minute"
    return f"about {ms / 1000:.0f} s"


@task("resolve", points=5, title="cache-aside redirects that survive a dead Redis", timeout=60, seed=1214)
async def check_resolve(r: Report, resolve) -> None:
    async with lab.scratch("ch12") as ns:
        plain = ns.redis()
        setup = await ns.pool(max_size=2)
        await shortener.setup_schema(setup)
        db = _Switch()
        pool = AsyncConnectionPool(  # it counts the queries: learner code uses it as it is, with a learner's rights
            ns.learner_database_url,
            min_size=1,
            max_size=6,
            open=False,
            kwargs={"autocommit": True, "cursor_factory": _cursor_class(db)},
        )
        await pool.open(wait=True)
        cache = _Switch()
        client = _CheckRedis.from_url(ns.redis_url, decode_responses=True)
        client.switch = cache
        try:
            with seeded_random(r):  # a jittered TTL draws the same values on every run
                await _check_resolve(r, resolve, client, cache, pool, db, setup, plain)
        finally:
            await client.aclose()
            await pool.close()


async def _add(pool, code: str, url: str) -> None:
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO links (code, url) VALUES (%s, %s)", (code, url))


async def _check_resolve(r: Report, resolve, redis, cache: _Switch, pool, db: _Switch, setup, plain) -> None:
    clock = VirtualClock()

    def breaker() -> CircuitBreaker:
        return _WatchedBreaker(0.5, 4, 30.0, min_calls=4, clock=clock, is_failure=shortener.redis_failure, name="redis")

    rnd = random.Random(r.random.getrandbits(32))
    codes = [course_encode(rnd.randrange(1, TOP)) for _ in range(8)]
    a, b, c, d, missing, late, other_missing, spare = codes
    urls = {code: f"https://example.com/{i}/{code}" for i, code in enumerate(codes)}
    for code in (a, b, c, d, spare):
        await _add(setup, code, urls[code])
    br = breaker()

    async def calls(code: str, n: int = 1, *, into=None):
        fn = into or resolve
        return [await fn(code, redis, pool, br) for _ in range(n)]

    before = set(await plain.keys("*"))
    q0 = db.calls
    (got,) = await calls(a)
    r.expect(got == urls[a], f"resolve({a!r}) = {got!r}", f"resolve({a!r}) returned {got!r}, expected {urls[a]!r}")
    hit_keys = set(await plain.keys("*")) - before
    q1 = db.calls
    got = await calls(a, 20)
    r.expect(
        db.calls == q1 and all(g == urls[a] for g in got),
        "20 more redirects of that code: no PostgreSQL query (served from Redis)",
        f"20 more redirects of that code made {db.calls - q1} PostgreSQL queries; expected none (cache-aside: read "
        "Redis first, fill it on a miss)",
    )
    (none,) = await calls(missing)
    r.expect(
        none is None,
        f"resolve({missing!r}), a code nobody made, = None",
        f"resolve of a missing code returned {none!r}",
    )
    if r.public:
        return
    r.note(f"the first lookup of {a!r} made {q1 - q0} PostgreSQL quer{'y' if q1 - q0 == 1 else 'ies'}")
    r.expect(
        bool(hit_keys),
        "it wrote a key to Redis",
        "looking up a link wrote nothing to Redis: cache it there (a cache in one process's memory is not shared "
        "by the service's other replicas, and nothing invalidates it)",
    )
    ttl = max([await plain.pttl(k) for k in hit_keys] or [-1])
    low, high = shortener.CACHE_TTL * 500, shortener.CACHE_TTL * 1500  # "about CACHE_TTL", in ms: within 50%
    r.expect(
        low <= ttl <= high,
        # no measured value on the line: a jittered TTL (which the course's own resolve uses) differs per write
        f"the cached link expires in about CACHE_TTL ({shortener.CACHE_TTL / 3600:g} h, within half of it either way)",
        "the cached link has no TTL (PTTL -1): cache it for about CACHE_TTL seconds"
        if ttl < 0
        else f"the cached link expires in {_roughly(ttl)}; expected about CACHE_TTL ({shortener.CACHE_TTL:g} s, "
        "within half of it either way). Likely causes: MISS_TTL (or another constant) used for a link, or a TTL "
        "given in the wrong unit (PX takes milliseconds, EX seconds)",
    )
    (twin,) = r.replicas("resolve", 1)
    q2 = db.calls
    got = await twin(a, redis, pool, breaker())
    r.expect(
        got == urls[a] and db.calls == q2,
        "a second replica of your cell finds the link in Redis without a query",
        f"a second replica of your cell resolved {a!r} to {got!r} with {db.calls - q2} PostgreSQL queries: the cache "
        "lives in one process's memory; keep it in Redis, which every replica shares",
    )

    # --- negative caching ---------------------------------------------------------------------------
    before = set(await plain.keys("*"))
    q3 = db.calls
    answers = await calls(other_missing, 50)
    miss_keys = set(await plain.keys("*")) - before
    queries = db.calls - q3
    r.expect(
        all(x is None for x in answers) and queries == 1,
        "50 redirects of a missing code: 1 PostgreSQL query, then the cached miss",
        f"50 redirects of a missing code made {queries} PostgreSQL queries and returned {tally(answers, top=2)}; "
        "expected 1 query: cache the miss too (negative caching), and read a cached miss as a hit (`is None`, not "
        "truthiness)",
    )
    miss_ttl = max([await plain.pttl(k) for k in miss_keys] or [-1])
    r.expect(
        bool(miss_keys) and 0 < miss_ttl <= 300_000 and miss_ttl < ttl,
        "the miss is cached in Redis for at most 5 minutes, shorter than a link",
        f"the cached miss: keys {sorted(miss_keys)[:2]}, "
        + ("no TTL (PTTL -1)" if miss_ttl < 0 else f"expiring in about {math.ceil(miss_ttl / 1000)} s")
        + "; expected a key in Redis that expires within 5 minutes, sooner than a link's, so a link made later "
        "shows up soon",
    )
    q4 = db.calls
    got = await twin(other_missing, redis, pool, breaker())
    r.expect(
        got is None and db.calls == q4,
        "the other replica sees the cached miss too",
        f"the other replica resolved the missing code to {got!r} with {db.calls - q4} queries: keep misses in Redis",
    )
    before = set(await plain.keys("*"))
    await calls(late)
    await _add(setup, late, urls[late])
    expired = set(await plain.keys("*")) - before
    if expired:
        await plain.delete(*expired)
    (got,) = await calls(late)
    r.expect(
        got == urls[late],
        "a code that was missing, created since and its cached miss expired: found",
        f"after the link {late!r} was created and its cached miss expired, resolve returned {got!r}",
    )

    # --- Redis down ------------------------------------------------------------------------------------
    # --- a cached link whose key expires between a look (EXISTS) and the read (GET) -----------------------
    cache.expire_after_probe = True
    (got,) = await calls(a)
    cache.expire_after_probe = False
    r.expect(
        got == urls[a],
        "a cached link whose key expires in the middle of a redirect still resolves",
        f"resolve({a!r}) returned {got!r} for a link that exists: the check deleted its key right after your "
        f"{'EXISTS (or TTL)' if cache.probed else 'first command'}, as a TTL running out between two commands "
        "does, and the next read found nothing. Likely cause: a look (EXISTS) then a read (GET); read once with "
        "GET and test what it returned with `is None`",
    )

    r.note("Redis now refuses every connection; the breaker you get opens at 2 failures in its last 4 calls, 30 s")
    cache.down = True
    c0 = cache.calls
    seen = []
    for code in [b] * 15 + [a] * 15:
        try:
            seen.append(await resolve(code, redis, pool, br))
        except Exception as err:  # noqa: BLE001
            seen.append(err)
    errors = [x for x in seen if isinstance(x, BaseException)]
    r.expect(
        not errors,
        "30 redirects while Redis is down: all answered from PostgreSQL",
        f"30 redirects while Redis is down: {tally(seen, ok='a URL', top=3)}. A dead cache must not fail the "
        "redirect: catch the Redis error (and CircuitOpenError) and read PostgreSQL",
    )
    r.expect(
        seen == [urls[b]] * 15 + [urls[a]] * 15,
        "each got its URL",
        f"while Redis was down the redirects returned {tally(seen, top=3)}",
    )
    sent = cache.calls - c0
    r.expect(
        sent <= 8 and br.state == "open",
        f"they sent {sent} commands to the dead Redis, then none: the breaker is open",
        f"30 redirects while Redis was down sent {sent} commands to it (breaker {br.state}): that hammers a "
        "server that is trying to come back. Send every Redis command through breaker.call(...), so an open "
        "breaker stops them",
    )
    (got,) = await calls(missing)
    r.expect(got is None, "a missing code while Redis is down: None", f"a missing code while Redis is down: {got!r}")

    clock.advance(31)
    cache.down = False
    c1, q6 = cache.calls, db.calls
    got = await calls(b, 10)
    r.expect(
        all(g == urls[b] for g in got) and db.calls - q6 <= 1 and cache.calls > c1,
        f"Redis is back and 31 s have passed: 10 redirects made {db.calls - q6} PostgreSQL query, the rest from Redis",
        f"Redis is back and the breaker's cooldown has passed: 10 redirects made {db.calls - q6} PostgreSQL queries "
        f"and {cache.calls - c1} Redis commands (breaker {br.state}); expected the cache to be used again",
    )

    # --- PostgreSQL down -----------------------------------------------------------------------------------
    db.down = True
    try:
        (got,) = await calls(a)
        outcome = got
    except Exception as err:  # noqa: BLE001
        outcome = err
    r.expect(
        outcome == urls[a],
        "PostgreSQL down: a cached link still redirects",
        f"PostgreSQL down: resolve of a cached link gave {outcome!r}; it is in Redis, serve it",
    )
    try:
        (got,) = await calls(c)
        outcome, raised = f"returned {got!r}", False
    except Exception as err:  # noqa: BLE001
        outcome, raised = f"raised {error_line(err, 80)}", True
    db.down = False
    (after,) = await calls(c)
    r.expect(
        raised and after == urls[c],
        f"PostgreSQL down: an uncached link {outcome} (the service answers 503), and no miss was cached",
        f"PostgreSQL down: resolve of a link that exists {outcome}; afterwards it returned {after!r}. Let the "
        "database error through (the service answers 503): a None is a 404 for a link that exists, and a cached "
        "miss keeps it broken after PostgreSQL is back",
    )
    db.down = cache.down = True
    try:
        (got,) = await calls(d)
        outcome, raised = f"returned {got!r}", False
    except Exception as err:  # noqa: BLE001
        outcome, raised = f"raised {error_line(err, 80)}", True
    db.down = cache.down = False
    r.expect(
        raised, f"both down: {outcome}", f"with Redis and PostgreSQL both down resolve {outcome}; expected an error"
    )
    r.expect(
        cache.outside == 0,
        "every Redis command went through breaker.call",
        f"{cache.outside} Redis command(s) were sent outside breaker.call (the redirects were right while Redis was "
        "up): the breaker neither counts their failures nor stops them when it is open, and one raised while Redis "
        "is down fails the redirect. Likely cause: a write to the cache (SET) made with redis directly; send every "
        "command as await breaker.call(lambda: redis...)",
    )
