"""Hidden checks of chapter 12 (the URL shortener): ``encode_code``, ``create_link``, ``resolve``.

- Codes are checked as a bijection (round trips both ways, on the edges and on thousands
  of seeded random ids and codes), for guessability (codes of consecutive ids must share
  almost no characters and their end characters must not predict each other) and across
  replicas (a code made by one copy of the answer decodes in another).
- ``create_link`` races for real: a trigger holds every insert into ``links`` until every
  concurrent caller is parked inside PostgreSQL (or backing off on a virtual clock), so a
  check-then-insert loses the race every time. The callers of one key are split over two
  replicas of the answer, so state kept in one process does not pass.
- ``resolve`` runs against a Redis client and a pool whose faults the check switches: a
  Redis that refuses connections and a PostgreSQL that does. Both count every command, so
  "no query" and "does not hammer Redis" are counts, not timings. The breaker it is given
  runs on a virtual clock.
"""

from __future__ import annotations

import json
import random

import psycopg
import redis.asyncio as aioredis
import redis.exceptions
from psycopg_pool import AsyncConnectionPool
from redis.asyncio.client import Pipeline

from autograder.harness import Report, error_line, task
from autograder.probes import SETTLE_LIMIT, Crowd, tally
from course import shortener
from course.breaker import CircuitBreaker
from course.chapters import ch12
from course.idempotency import IdempotencyKeyReused, RequestInProgress, retry_in_progress
from course.kit import lab
from course.kit.faults import VirtualClock
from course.retry import with_retry

ALPHABET = set(shortener.ALPHABET)
TOP = shortener.ID_SPACE


def _is_code(value) -> bool:
    return isinstance(value, str) and len(value) == shortener.CODE_LENGTH and set(value) <= ALPHABET


# ============================================================================ encode_code / decode_code


@task(
    "encode_code",
    points=3,
    title="7-character codes from a keyed shuffle of the id",
    needs=("encode_code", "decode_code"),
    timeout=60,
    seed=1212,
)
async def check_codes(r: Report, encode_code, decode_code) -> None:
    code = encode_code(1)
    r.expect(
        _is_code(code),
        f"encode_code(1) = {code!r}: 7 characters of 0-9, A-Z, a-z",
        f"encode_code(1) returned {code!r}; expected a str of 7 characters from 0-9, A-Z, a-z",
    )
    back = decode_code(code)
    r.expect(back == 1, f"decode_code({code!r}) = 1", f"decode_code({code!r}) returned {back!r}, expected 1")
    first = [encode_code(n) for n in range(1, 21)]
    shared, _ = ch12.consecutive_stats(first)
    r.expect(
        len(set(first)) == 20 and shared < 2,
        f"ids 1..20 give 20 different codes that share {shared:.2f} of 7 characters with the next on average",
        f"ids 1..20 give {first[:4]} ...: {len(set(first))} different codes; a code and the next share "
        f"{shared:.1f} of 7 characters on average. Consecutive ids must not give neighbouring codes: shuffle the id first",
    )
    if r.public:
        return

    # --- a bijection of [0, 62**7) ----------------------------------------------------------------
    edges = [0, 1, 2, 61, 62, 62**6, TOP // 2, TOP - 2, TOP - 1]
    ids = edges + [r.random.randrange(TOP) for _ in range(2000)]
    codes = [encode_code(n) for n in ids]
    bad = [(n, c) for n, c in zip(ids, codes, strict=True) if not _is_code(c)]
    r.expect(
        not bad,
        f"{len(ids)} ids (0, 62**7 - 1 and {len(ids) - len(edges)} random ones): every code is 7 base62 characters",
        f"encode_code({bad[0][0] if bad else ''}) returned {bad[0][1] if bad else ''!r}: every id in "
        "[0, 62**7) needs a code of exactly 7 characters of 0-9, A-Z, a-z (pad with the zero character)",
    )
    wrong = [(n, c, decode_code(c)) for n, c in zip(ids, codes, strict=True)]
    wrong = [w for w in wrong if w[2] != w[0]]
    r.expect(
        not wrong,
        "decode_code(encode_code(n)) == n for all of them",
        f"decode_code(encode_code({wrong[0][0] if wrong else ''})) = {wrong[0][2] if wrong else ''!r}: "
        "decode must undo encode for every id. (Shuffling 42 bits? A value at or above 62**7 must be permuted "
        "again until it lands below, cycle-walking; cutting it with % loses the way back)",
    )
    r.expect(
        len(set(codes)) == len(set(ids)),
        "no two ids share a code",
        f"{len(set(ids))} different ids gave only {len(set(codes))} different codes",
    )
    samples = ["".join(r.random.choice(shortener.ALPHABET) for _ in range(7)) for _ in range(2000)]
    misses = []
    for c in samples:
        try:
            n = decode_code(c)
            again = encode_code(n) if isinstance(n, int) and 0 <= n < TOP else None
        except ValueError as err:
            n, again = err, None
        if again != c:
            misses.append((c, n))
    r.expect(
        not misses,
        "2000 random 7-character codes: each decodes to an id in [0, 62**7) that encodes back to it (onto)",
        f"decode_code({misses[0][0] if misses else ''!r}) gave {misses[0][1] if misses else ''!r}, which does not "
        "encode back to that code: a bijection of [0, 62**7) maps every 7-character code to one id (a Feistel "
        "network on 42 bits needs cycle-walking to stay inside the range)",
    )
    refused = {}
    for label, call in (
        ("encode_code(62**7)", lambda: encode_code(TOP)),
        ("encode_code(-1)", lambda: encode_code(-1)),
        ("decode_code('abc')", lambda: decode_code("abc")),
        ("decode_code('abc!def')", lambda: decode_code("abc!def")),
    ):
        try:
            refused[label] = f"returned {call()!r}"
        except ValueError:
            refused[label] = "ValueError"
        except Exception as err:  # noqa: BLE001 - learner code may raise anything
            refused[label] = f"raised {error_line(err, 60)}"
    odd = {k: v for k, v in refused.items() if v != "ValueError"}
    r.expect(
        not odd,
        "out of range ids and malformed codes raise ValueError",
        "expected ValueError for ids outside [0, 62**7) and codes that are not 7 base62 characters: "
        + "; ".join(f"{k} {v}" for k, v in odd.items()),
    )

    # --- guessability ------------------------------------------------------------------------------
    runs = [1, r.random.randrange(10**6, 10**9), TOP - 1001]
    consecutive = []
    for start in runs:
        consecutive += [encode_code(n) for n in range(start, start + 1000)]
        consecutive.append("")  # no pair across two runs
    shared, end = ch12.consecutive_stats([c for c in consecutive if c])
    r.expect(
        shared < 1.0,
        f"3 x 1000 consecutive ids: neighbouring codes share {shared:.2f} of 7 characters on average (random: 0.11)",
        f"codes of consecutive ids share {shared:.2f} of 7 characters on average: anyone holding one code finds "
        "the others by changing a character or two. Shuffle the id with a keyed permutation before base62",
    )
    r.expect(
        end < 0.5,
        f"the end characters of one code do not predict the next code's ({end:.0%} of pairs follow the most "
        "common move; random: about 10%)",
        f"in {end:.0%} of consecutive pairs the first or last character of the next code is the one this code's "
        "leads to most often: the shuffle is a fixed step (multiplying or adding a constant), and two codes "
        "give away all the others. Use a keyed permutation (a Feistel network) instead",
    )

    # --- replicas ------------------------------------------------------------------------------------
    (enc_b,) = r.replicas("encode_code", 1)
    (dec_c,) = r.replicas("decode_code", 1)
    probe = [r.random.randrange(TOP) for _ in range(200)]
    same = sum(enc_b(n) == encode_code(n) for n in probe)
    across = sum(dec_c(encode_code(n)) == n for n in probe)
    r.expect(
        same == len(probe) and across == len(probe),
        "two more replicas of your cell give the same codes and decode each other's",
        f"a second replica of your cell gives the same code for {same} of {len(probe)} ids, and a third decodes "
        f"{across} of {len(probe)} of the first one's codes: the key or the shuffle is drawn when the cell runs, "
        "so each replica of the service makes codes the others cannot resolve. Use the configured CODE_KEY",
    )


# ============================================================================ create_link


async def _links(pool, **where) -> list[tuple]:
    ((column, value),) = where.items()
    async with pool.connection() as conn:
        cur = await conn.execute(f"SELECT code, url, custom FROM links WHERE {column} = %s ORDER BY id", (value,))
        return await cur.fetchall()


def _taken(err) -> bool:
    return isinstance(err, shortener.AliasTaken) or getattr(err, "status", None) == 409


@task("create_link", points=4, title="idempotent create, custom aliases decided by PostgreSQL", timeout=60, seed=1213)
async def check_create_link(r: Report, create_link) -> None:
    async with lab.scratch("ch12") as ns:
        pool = await ns.pool(max_size=16)
        await shortener.setup_schema(pool)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            await ch12.insert_gate(watcher)
            await _check_create_link(r, create_link, pool, watcher)
        finally:
            await watcher.close()


def _retrying(create_link, pool, url, *, key=None, alias=None, sleep, rand):
    """A client that retries RequestInProgress (409) with backoff, as chapter 03's did."""

    async def call():
        return await with_retry(
            lambda: create_link(pool, url, alias=alias, idempotency_key=key),
            retries=6,
            base_delay=0.1,
            max_delay=2.0,
            retryable=lambda err: isinstance(err, RequestInProgress) or retry_in_progress(err),
            sleep=sleep,
            rand=rand,
        )

    return call


async def _check_create_link(r: Report, create_link, pool, watcher) -> None:
    url = "https://example.com/one"
    link = await create_link(pool, url)
    code = link.get("code") if isinstance(link, dict) else None
    r.expect(
        isinstance(link, dict) and _is_code(code) and link.get("url") == url,
        f"create_link(pool, {url!r}) returned {link!r}",
        f"create_link(pool, {url!r}) returned {link!r}; expected a dict with 'code' (7 base62 characters) and 'url'",
    )
    rows = await _links(pool, code=code)
    r.expect(
        rows == [(code, url, False)] or [row[:2] for row in rows] == [(code, url)],
        f"links holds {code!r} -> {url!r}",
        f"links rows for code {code!r}: {rows}; expected one row with that url",
    )
    url = "https://example.com/two"
    first = await create_link(pool, url, idempotency_key="key-two")
    again = await create_link(pool, url, idempotency_key="key-two")
    rows = await _links(pool, url=url)
    r.expect(
        again == first and len(rows) == 1,
        f"the same call with idempotency_key='key-two' twice: the same response {first!r}, one link",
        f"the same call with idempotency_key='key-two' twice returned {first!r} then {again!r} and left "
        f"{len(rows)} link(s) for the url; expected the stored response and one link",
    )
    if r.public:
        return

    # --- the same key for another URL ---------------------------------------------------------------
    try:
        got = await create_link(pool, "https://example.com/other", idempotency_key="key-two")
        outcome, reused = f"returned {got!r}", False
    except Exception as err:  # noqa: BLE001 - any error is reported
        reused = isinstance(err, IdempotencyKeyReused) or getattr(err, "status", None) == 422
        outcome = f"raised {error_line(err, 100)}"
    others = await _links(pool, url="https://example.com/other")
    r.expect(
        reused and not others,
        f"the same key for another URL {outcome}, and made no link",
        f"the same key for another URL {outcome} and made {len(others)} link(s); expected IdempotencyKeyReused "
        "(422) and no link: compare request_hash of the body with the one stored for the key",
    )

    # --- ten concurrent calls with one key, over two replicas ---------------------------------------
    url = "https://example.com/race"
    replicas = r.replicas("create_link", 2)
    r.note(
        "10 concurrent calls with one key, 5 in each of two replicas of your cell; every insert into links is "
        "held until all callers wait inside PostgreSQL; RequestInProgress is retried with backoff (virtual clock)"
    )
    await ch12.close_gate(watcher)

    async def release() -> None:
        await ch12.open_gate(watcher)

    crowd = Crowd(10, watcher, on_settled=release)
    try:
        results = await crowd.run(
            lambda i: _retrying(replicas[i % 2], pool, url, key="key-race", sleep=crowd.sleep, rand=r.random.random)()
        )
    finally:
        await ch12.open_gate(watcher)
    if crowd.stalls:
        r.note(
            f"the callers did not all wait inside PostgreSQL within {SETTLE_LIMIT:g} s: something waits in the "
            "process (an asyncio.Lock?), which another replica does not see"
        )
    rows = await _links(pool, url=url)
    answers = [x for x in results if not isinstance(x, BaseException)]
    distinct = {json.dumps(a, sort_keys=True, default=str) for a in answers}
    why = ""
    if len(rows) == 2:
        why = ": one per replica, so the key was kept in one process's memory; claim it in PostgreSQL"
    elif len(rows) > 2:
        why = ": every caller found the key free and created a link; claim the key atomically first"
    r.expect(
        len(rows) == 1,
        "one link for the key",
        f"10 concurrent calls with one key created {len(rows)} links{why}",
    )
    r.expect(
        len(answers) == 10 and len(distinct) == 1,
        "all 10 callers got the same response",
        f"10 concurrent calls with one key ended with {tally(results, ok='a response')} and {len(distinct)} "
        "different responses; expected one stored response for all (a loser of the claim waits for the winner "
        "in PostgreSQL, or raises RequestInProgress and is retried)",
    )

    # --- distinct links at once ----------------------------------------------------------------------
    await ch12.close_gate(watcher)
    crowd = Crowd(12, watcher, on_settled=release)
    try:
        results = await crowd.run(lambda i: create_link(pool, f"https://example.com/bulk/{i}"))
    finally:
        await ch12.open_gate(watcher)
    made = [x for x in results if isinstance(x, dict)]
    codes = {x.get("code") for x in made}
    async with pool.connection() as conn:
        (count,) = await (
            await conn.execute("SELECT count(*) FROM links WHERE url LIKE 'https://example.com/bulk/%'")
        ).fetchone()
    r.expect(
        len(made) == 12 and len(codes) == 12 and count == 12,
        "12 different links created at once: 12 links with 12 different codes",
        f"12 different links created at once: {tally(results, ok='a link')}, {len(codes)} different codes, "
        f"{count} rows. Take ids from the sequence (nextval('link_ids')), never from max(id) + 1 or count(*)",
    )

    # --- custom aliases --------------------------------------------------------------------------------
    link = await create_link(pool, "https://example.com/sale", alias="spring-sale")
    rows = await _links(pool, code="spring-sale")
    r.expect(
        isinstance(link, dict) and link.get("code") == "spring-sale" and len(rows) == 1,
        "alias='spring-sale' makes the link with that code",
        f"create_link(..., alias='spring-sale') returned {link!r}, links rows {rows}; expected code 'spring-sale'",
    )
    try:
        got = await create_link(pool, "https://example.com/someone-else", alias="spring-sale")
        outcome, taken = f"returned {got!r}", False
    except Exception as err:  # noqa: BLE001
        outcome, taken = f"raised {error_line(err, 100)}", _taken(err)
    r.expect(
        taken,
        f"the alias again, for another URL: {outcome}",
        f"the alias again, for another URL, {outcome}; expected AliasTaken (409)",
    )

    r.note("10 concurrent creates of alias 'launch-day' for 10 different URLs, inserts held until all wait")
    await ch12.close_gate(watcher)
    crowd = Crowd(10, watcher, on_settled=release)
    try:
        results = await crowd.run(
            lambda i: _retrying(
                create_link,
                pool,
                f"https://example.com/launch/{i}",
                alias="launch-day",
                sleep=crowd.sleep,
                rand=r.random.random,
            )()
        )
    finally:
        await ch12.open_gate(watcher)
    wins = [x for x in results if not isinstance(x, BaseException)]
    taken = [x for x in results if isinstance(x, BaseException) and _taken(x)]
    other = [x for x in results if isinstance(x, BaseException) and not _taken(x)]
    rows = await _links(pool, code="launch-day")
    hint = ""
    if other:
        hint = (
            ": a lookup before the insert sees the alias free in every caller, then the unique index refuses "
            "all inserts but one; let the insert decide (ON CONFLICT (code) DO NOTHING RETURNING) and raise "
            "AliasTaken when it inserted nothing"
        )
    elif len(wins) > 1:
        hint = ": only one caller may get the alias; the others must hear AliasTaken, not someone else's link"
    r.expect(
        len(wins) == 1 and len(taken) == 9 and len(rows) == 1,
        "exactly one caller got the alias, 9 got AliasTaken",
        f"10 concurrent creates of one alias: {tally(results, ok='a link')}; links holds {len(rows)} row(s) for "
        f"it. Expected 1 link and 9 x AliasTaken{hint}",
    )


# ============================================================================ resolve


class _Switch:
    def __init__(self) -> None:
        self.calls = 0
        self.down = False


class _CheckPipeline(Pipeline):
    switch: _Switch

    async def execute(self, raise_on_error: bool = True):
        self.switch.calls += 1
        if self.switch.down:
            raise redis.exceptions.ConnectionError("Error 111 connecting to redis:6379. Connection refused.")
        return await super().execute(raise_on_error)


class _CheckRedis(aioredis.Redis):
    """A real client whose every command is counted and, while ``switch.down``, refused."""

    switch: _Switch

    async def execute_command(self, *args, **options):
        self.switch.calls += 1
        if self.switch.down:
            raise redis.exceptions.ConnectionError("Error 111 connecting to redis:6379. Connection refused.")
        return await super().execute_command(*args, **options)

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


@task("resolve", points=5, title="cache-aside redirects that survive a dead Redis", timeout=60, seed=1214)
async def check_resolve(r: Report, resolve) -> None:
    async with lab.scratch("ch12") as ns:
        plain = ns.redis()
        setup = await ns.pool(max_size=2)
        await shortener.setup_schema(setup)
        db = _Switch()
        pool = AsyncConnectionPool(
            ns.database_url,
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
        return CircuitBreaker(0.5, 4, 30.0, min_calls=4, clock=clock, is_failure=shortener.redis_failure, name="redis")

    rnd = random.Random(r.random.getrandbits(32))
    codes = [shortener.encode_code(rnd.randrange(1, TOP)) for _ in range(8)]
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
    r.expect(ttl > 0, f"the cached link expires ({ttl / 3_600_000:.1f} h)", "the cached link has no TTL (PTTL -1)")
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
        f"the miss is cached in Redis for {miss_ttl / 1000:.0f} s (short, shorter than a link's)",
        f"the cached miss: keys {sorted(miss_keys)[:2]}, PTTL {miss_ttl} ms; expected a key in Redis that expires "
        "within 5 minutes, sooner than a link's, so a link made later shows up soon",
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


#: The course's own reference implementation of each task (issue 26): while a task is graded,
#: a learner's answer that is, wraps or calls one of these earns nothing for it. The checks
#: themselves may still use them as rigs.
REFERENCES: dict[str, list[str]] = {
    "encode_code": ["course.shortener:encode_code", "course.shortener:decode_code"],
    "create_link": ["course.shortener:create_link"],
    "resolve": ["course.shortener:resolve"],
}
