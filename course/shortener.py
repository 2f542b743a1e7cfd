"""A URL shortener's moving parts (chapter 12): codes, the links table, the redirect path, clicks.

- **Codes**: a link's id (from a PostgreSQL sequence) goes through a keyed, bijective
  shuffle of the id space ``[0, 62**7)`` (a 4-round Feistel network on 42 bits, cycle-walked
  back into the range) and is written in base62: 7 characters, one code per id, and
  the codes of consecutive ids look unrelated. :func:`encode_code` / :func:`decode_code`.
- **Links**: :func:`create_link` inserts a link (a generated code or a custom alias) in one
  transaction; an ``Idempotency-Key`` is claimed in chapter 03's ``idempotency_keys`` table
  (:mod:`course.idempotency`), and an alias conflict is decided by the unique index.
- **Redirects**: :func:`resolve` is cache-aside with negative caching (chapter 04) behind a
  circuit breaker on Redis (chapter 02): Redis down means straight to PostgreSQL; PostgreSQL
  down means an error (the service answers 503), never a cached "not found".
- **Clicks**: :class:`ClickRecorder` buffers click events in the process and ships them to
  a Redis stream off the request path (sampling 1 in N, weighted, under overload);
  :class:`ClickAggregator` reads the stream, counts clicks per link and minute, and flushes
  them to PostgreSQL together with the stream position, then acknowledges.

The HTTP service around these is :mod:`course.shortener_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import random
import re
import time
from collections import deque
from collections.abc import Callable

import redis.exceptions
from psycopg.types.json import Jsonb

from course.backoff import FullJitter, LoopErrors
from course.breaker import CircuitBreaker, CircuitOpenError
from course.caching import SingleFlight, jittered_ms
from course.idempotency import IdempotencyKeyReused, RequestInProgress, request_hash
from course.idempotency import setup_schema as setup_idempotency

# ============================================================================ codes

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
CODE_LENGTH = 7
ID_SPACE = len(ALPHABET) ** CODE_LENGTH  # 62**7 = 3,521,614,606,208 codes
#: The shuffle's key. In production a secret from configuration, the same in every replica
#: (a key drawn at start-up would give each replica its own codes).
CODE_KEY = b"chapter-12 url shortener: keep me secret"

_INDEX = {ch: i for i, ch in enumerate(ALPHABET)}
_HALF_BITS = 21  # 42 bits hold 62**7 (2**42 = 4.40e12 > 3.52e12)
_HALF_MASK = (1 << _HALF_BITS) - 1
_ROUNDS = 4


def base62(n: int, length: int = CODE_LENGTH) -> str:
    """``n`` in base62, most significant character first, padded to ``length`` characters."""
    if not 0 <= n < len(ALPHABET) ** length:
        raise ValueError(f"{n} does not fit in {length} base62 characters")
    chars = []
    for _ in range(length):
        n, digit = divmod(n, 62)
        chars.append(ALPHABET[digit])
    return "".join(reversed(chars))


def unbase62(text: str) -> int:
    """The number a base62 string stands for; ValueError for any other character."""
    n = 0
    for ch in text:
        if ch not in _INDEX:
            raise ValueError(f"{text!r} is not base62 ({ch!r} is not one of 0-9, A-Z, a-z)")
        n = n * 62 + _INDEX[ch]
    return n


def _round(key: bytes, i: int, half: int) -> int:
    """The Feistel round function: a keyed hash (BLAKE2b) of one half, cut to 21 bits."""
    digest = hashlib.blake2b(bytes([i]) + half.to_bytes(3, "big"), key=key, digest_size=3).digest()
    return int.from_bytes(digest, "big") & _HALF_MASK


def feistel(n: int, key: bytes = CODE_KEY) -> int:
    """A keyed permutation of the 42-bit numbers: 4 Feistel rounds, each (L, R) -> (R, L xor F(R))."""
    left, right = n >> _HALF_BITS, n & _HALF_MASK
    for i in range(_ROUNDS):
        left, right = right, left ^ _round(key, i, right)
    return (left << _HALF_BITS) | right


def unfeistel(n: int, key: bytes = CODE_KEY) -> int:
    """The inverse of :func:`feistel`: the rounds backwards, (L', R') -> (R' xor F(L'), L')."""
    left, right = n >> _HALF_BITS, n & _HALF_MASK
    for i in reversed(range(_ROUNDS)):
        left, right = right ^ _round(key, i, left), left
    return (left << _HALF_BITS) | right


def shuffle(n: int, key: bytes = CODE_KEY) -> int:
    """A keyed bijection of ``[0, ID_SPACE)``: the Feistel permutation of 42 bits, cycle-walked.

    A step that lands at or above ``ID_SPACE`` is permuted again until it lands inside
    (Black and Rogaway, 2002): on average 1.25 steps. The walk stays inside the cycle that
    ``n`` belongs to, so the result is a permutation of the smaller range.
    """
    if not 0 <= n < ID_SPACE:
        raise ValueError(f"id {n} is outside [0, 62**{CODE_LENGTH})")
    n = feistel(n, key)
    while n >= ID_SPACE:
        n = feistel(n, key)
    return n


def unshuffle(n: int, key: bytes = CODE_KEY) -> int:
    if not 0 <= n < ID_SPACE:
        raise ValueError(f"{n} is outside [0, 62**{CODE_LENGTH})")
    n = unfeistel(n, key)
    while n >= ID_SPACE:
        n = unfeistel(n, key)
    return n


def encode_code(link_id: int, key: bytes = CODE_KEY) -> str:
    """The 7-character code of a link id: base62 of the shuffled id."""
    return base62(shuffle(link_id, key))


def decode_code(code: str, key: bytes = CODE_KEY) -> int:
    """The link id behind a code; ValueError for anything that is not 7 base62 characters."""
    if not isinstance(code, str) or len(code) != CODE_LENGTH:
        raise ValueError(f"{code!r} is not a {CODE_LENGTH}-character code")
    return unshuffle(unbase62(code), key)


# ============================================================================ the links table

SCHEMA = """
CREATE SEQUENCE IF NOT EXISTS link_ids AS bigint MINVALUE 1 MAXVALUE 3521614606207;
CREATE TABLE IF NOT EXISTS links (
    id         bigint PRIMARY KEY DEFAULT nextval('link_ids'),
    code       text NOT NULL UNIQUE,
    url        text NOT NULL,
    custom     boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now()
);
-- clicks per link and minute, flushed by the aggregator
CREATE TABLE IF NOT EXISTS link_clicks (
    code   text NOT NULL,
    minute timestamptz NOT NULL,
    clicks bigint NOT NULL,
    PRIMARY KEY (code, minute)
);
-- how far the aggregator has counted each stream, committed with the counts
CREATE TABLE IF NOT EXISTS click_offsets (
    stream  text PRIMARY KEY,
    last_id text NOT NULL
);
"""


async def setup_schema(pool) -> None:
    """Create the links tables and chapter 03's ``idempotency_keys`` (idempotent; async)."""
    await setup_idempotency(pool)
    async with pool.connection() as conn:
        await conn.execute(SCHEMA)


class InvalidLink(ValueError):
    """400: not an http(s) URL, or not a usable alias."""

    status = 400


class AliasTaken(Exception):
    """409: the custom alias already names another link."""

    status = 409

    def __init__(self, alias: str) -> None:
        super().__init__(f"alias {alias!r} is taken")
        self.alias = alias


_URL = re.compile(r"https?://[^\s/$.?#][^\s]*", re.IGNORECASE)
_ALIAS = re.compile(r"[A-Za-z0-9_-]{3,32}")


def validate_url(url: str) -> str:
    if not isinstance(url, str) or len(url) > 2048 or not _URL.fullmatch(url):
        raise InvalidLink(f"not an http(s) URL: {url!r:.80}")
    return url


def validate_alias(alias: str) -> str:
    """3-32 characters of letters, digits, ``-`` and ``_``, and not shaped like a generated code.

    A 7-character base62 alias could be the code of a future id: the insert of that id
    would then fail. Refusing that shape keeps the two namespaces apart.
    """
    if not isinstance(alias, str) or not _ALIAS.fullmatch(alias):
        raise InvalidLink(f"an alias is 3-32 letters, digits, '-' or '_': {alias!r:.40}")
    if len(alias) == CODE_LENGTH and all(ch in _INDEX for ch in alias):
        raise InvalidLink(
            f"{alias!r} looks like a generated code (7 base62 characters); add a '-' or pick another length"
        )
    return alias


async def create_link(
    pool,
    url: str,
    *,
    alias: str | None = None,
    idempotency_key: str | None = None,
    encode: Callable[[int], str] = encode_code,
) -> dict:
    """Create a link and return ``{"code", "url"}``; one transaction does it all.

    With an ``idempotency_key`` the key is claimed first (``INSERT ... ON CONFLICT DO
    NOTHING``). A concurrent call with the same key waits on the unique index until this
    transaction ends, then reads the stored response (or raises
    :class:`IdempotencyKeyReused` when its body differs). Nothing here happens outside
    PostgreSQL, so holding the transaction is cheap, and a failure (an :class:`AliasTaken`)
    rolls the claim back with everything else.
    """
    validate_url(url)
    if alias is not None:
        validate_alias(alias)
    body = {"url": url, "alias": alias}
    req_hash = request_hash(body)
    async with pool.connection() as conn, conn.transaction():
        if idempotency_key is not None:
            cur = await conn.execute(
                "INSERT INTO idempotency_keys (key, request_hash, request) VALUES (%s, %s, %s) "
                "ON CONFLICT (key) DO NOTHING RETURNING key",
                (idempotency_key, req_hash, Jsonb(body)),
            )
            if await cur.fetchone() is None:
                cur = await conn.execute(
                    "SELECT request_hash, status, response FROM idempotency_keys WHERE key = %s",
                    (idempotency_key,),
                )
                stored_hash, status, response = await cur.fetchone()
                if stored_hash != req_hash:
                    raise IdempotencyKeyReused(
                        idempotency_key, f"key {idempotency_key!r} was used for another link"
                    )
                if status != "done":  # a pending claim left by another design (chapter 03's)
                    raise RequestInProgress(idempotency_key)
                return response
        if alias is None:
            (link_id,) = await (await conn.execute("SELECT nextval('link_ids')")).fetchone()
            code = encode(link_id)
            await conn.execute("INSERT INTO links (id, code, url) VALUES (%s, %s, %s)", (link_id, code, url))
        else:
            cur = await conn.execute(
                "INSERT INTO links (code, url, custom) VALUES (%s, %s, true) ON CONFLICT (code) DO NOTHING "
                "RETURNING id",
                (alias, url),
            )
            if await cur.fetchone() is None:
                raise AliasTaken(alias)
            code = alias
        response = {"code": code, "url": url}
        if idempotency_key is not None:
            cur = await conn.execute(
                "UPDATE idempotency_keys SET status = 'done', response = %s, updated_at = now() "
                "WHERE key = %s RETURNING response",
                (Jsonb(response), idempotency_key),
            )
            (response,) = await cur.fetchone()
    return response


async def find_link(pool, code: str) -> str | None:
    """The URL behind ``code`` from PostgreSQL (one index lookup), or None."""
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT url FROM links WHERE code = %s", (code,))).fetchone()
    return row[0] if row else None


# ============================================================================ the redirect path

CACHE_TTL = 24 * 3600.0  # a found link: a day (plus up to 20% jitter)
MISS_TTL = 60.0  # a code that does not exist: a minute, so a new alias shows up soon
MISS = ""  # what a cached miss holds (a URL is never empty)

#: Where the last :func:`resolve` in this task got its answer: "cache", "database" or "".
SERVED_FROM: contextvars.ContextVar[str] = contextvars.ContextVar("served_from", default="")


def cache_key(code: str) -> str:
    return f"link:{code}"


def redis_failure(err: BaseException) -> bool:
    """Does this error say Redis is sick? Its connection errors and timeouts do.

    Chapter 02's :func:`course.breaker.counts_as_failure` knows Python's and httpx's
    errors; redis-py raises its own (``redis.exceptions.ConnectionError`` is not a
    ``ConnectionError``), so a breaker on Redis needs this classifier.
    """
    return isinstance(
        err,
        (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            OSError,
            TimeoutError,
            asyncio.TimeoutError,
        ),
    )


def cache_breaker(*, cooldown: float = 2.0, clock: Callable[[], float] = time.monotonic) -> CircuitBreaker:
    """A breaker for the redirect path's Redis: opens at half of the last 20 calls failing."""
    return CircuitBreaker(
        0.5, 20, cooldown, min_calls=10, clock=clock, is_failure=redis_failure, name="redis"
    )


CACHE_DOWN = (CircuitOpenError, redis.exceptions.RedisError, OSError, TimeoutError, asyncio.TimeoutError)


async def resolve(
    code: str,
    redis,
    pool,
    breaker: CircuitBreaker,
    *,
    rand: Callable[[], float] = random.random,
    flight: SingleFlight | None = None,
):
    """The URL for ``code``, or None: Redis first, PostgreSQL on a miss, and misses cached too.

    Every Redis command goes through ``breaker``: while Redis is down the breaker opens
    and redirects go straight to PostgreSQL without touching Redis (degraded mode). A
    PostgreSQL error is raised, never turned into None: "not found" would be cached and
    answered as a 404 for a link that exists.

    With ``flight`` (chapter 04's :class:`~course.caching.SingleFlight`, one per process),
    concurrent misses of one code share a single database read and cache fill: after Redis
    restarts empty, a hot link costs PostgreSQL one query per process, not one per request.
    """
    key = cache_key(code)
    try:
        cached = await breaker.call(lambda: redis.get(key))
    except CACHE_DOWN:
        cache_up = False
    else:
        cache_up = True
        if cached is not None:
            SERVED_FROM.set("cache")
            return cached or None  # MISS ("") is a cached "no such link"

    async def load():
        url = await find_link(pool, code)
        if cache_up:
            ttl_ms = jittered_ms(CACHE_TTL, 0.2, rand) if url else int(MISS_TTL * 1000)
            with contextlib.suppress(*CACHE_DOWN):
                await breaker.call(lambda: redis.set(key, url or MISS, px=ttl_ms))
        return url

    url = await (flight.do(key, load) if flight is not None else load())
    SERVED_FROM.set("database")
    return url


async def forget(code: str, redis, breaker: CircuitBreaker) -> None:
    """Drop ``code`` from the cache (a new alias may have a cached miss); best effort."""
    with contextlib.suppress(*CACHE_DOWN):
        await breaker.call(lambda: redis.delete(cache_key(code)))


# ============================================================================ clicks


class ClickRecorder:
    """Click events buffered in the process and shipped to a Redis stream, off the request path.

    :meth:`record` only appends to a deque (no I/O). :meth:`flush` sends the buffer to the
    stream in pipelined ``XADD``s (through ``breaker``; on failure the events stay
    buffered). When the buffer holds ``high_water`` events the recorder is overloaded: it
    keeps 1 event in ``sample_every``, with weight ``sample_every``, so totals stay
    unbiased estimates; past ``limit`` the oldest events are dropped and counted in ``lost``.
    """

    def __init__(
        self,
        redis,
        stream: str,
        breaker: CircuitBreaker | None = None,
        *,
        high_water: int = 10_000,
        sample_every: int = 10,
        limit: int = 50_000,
        batch: int = 1_000,
        maxlen: int = 1_000_000,
        rand: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.breaker = breaker
        self.high_water = high_water
        self.sample_every = sample_every
        self.batch = batch
        self.maxlen = maxlen
        self.rand = rand
        self.clock = clock
        self.buffer: deque[tuple[str, int, int]] = deque(maxlen=limit)
        self.recorded = 0  # clicks seen (sampled-out ones included)
        self.sampled_out = 0
        self.shipped = 0  # clicks (sum of weights) now in the stream
        self.lost = 0  # clicks dropped off a full buffer

    def record(self, code: str) -> None:
        self.recorded += 1
        weight = 1
        if len(self.buffer) >= self.high_water:
            if self.rand() * self.sample_every >= 1:
                self.sampled_out += 1
                return
            weight = self.sample_every
        if len(self.buffer) == self.buffer.maxlen:
            self.lost += self.buffer[0][2]
        self.buffer.append((code, int(self.clock() * 1000), weight))

    @property
    def buffered(self) -> int:
        return sum(w for _, _, w in self.buffer)

    async def _xadd(self, events: list[tuple[str, int, int]]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for code, ms, weight in events:
                pipe.xadd(
                    self.stream, {"c": code, "t": ms, "w": weight}, maxlen=self.maxlen, approximate=True
                )
            await pipe.execute()

    async def flush(self) -> int:
        """Ship what is buffered; returns the clicks shipped. Raises if Redis is down."""
        shipped = 0
        while self.buffer:
            events = [self.buffer.popleft() for _ in range(min(self.batch, len(self.buffer)))]
            try:
                if self.breaker is not None:
                    await self.breaker.call(lambda events=events: self._xadd(events))
                else:
                    await self._xadd(events)
            except BaseException:
                self.buffer.extendleft(reversed(events))  # keep them for the next try
                raise
            weight = sum(w for _, _, w in events)
            shipped += weight
            self.shipped += weight
        return shipped

    async def run(self, every: float = 0.05) -> None:
        """Flush every ``every`` seconds until cancelled (a background task of the service)."""
        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(*CACHE_DOWN):
                await self.flush()

    def stats(self) -> dict:
        return {
            "recorded": self.recorded,
            "buffered": self.buffered,
            "shipped": self.shipped,
            "sampled_out": self.sampled_out,
            "lost": self.lost,
        }


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class ClickAggregator:
    """Counts the click stream per link and minute and flushes the counts to PostgreSQL.

    One consumer (in a consumer group, so unacknowledged entries are redelivered after a
    crash) per stream. :meth:`flush` upserts the counts **and** the id of the last entry
    counted in one transaction, then acknowledges the entries: a crash between the commit
    and the ``XACK`` redelivers entries that :meth:`poll` then recognises as counted.
    """

    def __init__(
        self, redis, pool, stream: str, *, group: str = "aggregator", consumer: str = "aggregator-1"
    ) -> None:
        self.redis = redis
        self.pool = pool
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.counts: dict[tuple[str, int], int] = {}
        self.unacked: dict[str, None] = {}  # entry ids read and not yet acknowledged, in order
        self.last_id: str | None = None  # the last entry counted (maybe not yet flushed)
        self.committed: tuple[int, int] = (0, 0)  # the last entry whose count PostgreSQL holds
        self.counted: tuple[int, int] = (0, 0)  # the last entry counted, flushed or not
        self.flushed = 0  # clicks written to PostgreSQL
        self.errors = LoopErrors(FullJitter(0.05, 2.0))  # what run() survived: count, streak, last
        self._started = False

    async def start(self) -> None:
        """Create the group if needed and load how far the counts already go."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
        async with self.pool.connection() as conn:
            row = await (
                await conn.execute("SELECT last_id FROM click_offsets WHERE stream = %s", (self.stream,))
            ).fetchone()
        self.committed = _stream_id(row[0]) if row else (0, 0)
        self.counted = max(self.counted, self.committed)
        self._started = True

    def _count(self, entries) -> int:
        n = 0
        for entry_id, fields in entries:
            self.unacked[entry_id] = None
            if _stream_id(entry_id) <= self.counted:
                continue  # counted already (before a crash, or read again from the pending list)
            weight = int(fields.get("w", 1))
            minute = int(fields["t"]) // 60_000 * 60
            key = (fields["c"], minute)
            self.counts[key] = self.counts.get(key, 0) + weight
            self.last_id = entry_id
            self.counted = _stream_id(entry_id)
            n += weight
        return n

    async def poll(self, *, count: int = 5_000, block_ms: int | None = None, pending: bool = False) -> int:
        """Read new entries (``pending=True``: this consumer's unacknowledged ones) and count them."""
        if not self._started:
            await self.start()
        try:
            reply = await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: "0" if pending else ">"}, count=count, block=block_ms
            )
        except redis.exceptions.ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            self._started = False  # Redis came back empty: make the group again next time
            return 0
        return sum(self._count(entries) for _, entries in reply or [])

    async def flush(self) -> int:
        """Write the counts and the stream position in one transaction, then acknowledge."""
        flushed = sum(self.counts.values())
        if self.counts:
            codes, minutes, clicks = zip(*((c, m, n) for (c, m), n in self.counts.items()), strict=True)
            async with self.pool.connection() as conn, conn.transaction():
                await conn.execute(
                    "INSERT INTO link_clicks (code, minute, clicks) SELECT c, to_timestamp(m), n "
                    "FROM unnest(%s::text[], %s::bigint[], %s::bigint[]) AS "
                    "u(c, m, n) ON CONFLICT (code, minute) DO UPDATE "
                    "SET clicks = link_clicks.clicks + EXCLUDED.clicks",
                    (list(codes), list(minutes), list(clicks)),
                )
                await conn.execute(
                    "INSERT INTO click_offsets (stream, last_id) VALUES (%s, %s) ON CONFLICT (stream) "
                    "DO UPDATE SET last_id = EXCLUDED.last_id",
                    (self.stream, self.last_id),
                )
            self.committed = _stream_id(self.last_id)
            self.counts.clear()
            self.flushed += flushed
        if self.unacked:
            await self.redis.xack(self.stream, self.group, *self.unacked)
            self.unacked.clear()
        return flushed

    async def drain(self) -> int:
        """Count everything the stream holds for this consumer, then flush (graceful shutdown)."""
        await self.poll(pending=True)
        while await self.poll(count=10_000):
            pass
        return await self.flush()

    async def run(self, every: float = 1.0) -> None:
        """Poll continuously and flush every ``every`` seconds until cancelled.

        Neither Redis nor PostgreSQL going away ends it (it used to die on the first
        PostgreSQL error, and clicks piled up unacknowledged while the service looked fine):
        every error is counted in ``self.errors`` and the loop backs off and goes on. Counts
        not yet flushed stay in memory and the entries stay unacknowledged, so nothing is lost.
        """
        last = time.monotonic()
        recovered = False
        while True:
            try:
                if not recovered:
                    await self.poll(pending=True)
                    recovered = True
                await self.poll(block_ms=int(every * 500))
                if time.monotonic() - last >= every:
                    await self.flush()
                    last = time.monotonic()
            except Exception as err:  # noqa: BLE001 - an aggregator that dies on its first error counts nothing
                recovered = False
                await asyncio.sleep(self.errors.failed(err))
                continue
            self.errors.succeeded()


async def link_stats(pool, code: str) -> dict | None:
    """Clicks of one link from PostgreSQL: the total and one row per minute."""
    async with pool.connection() as conn:
        link = await (
            await conn.execute("SELECT url, created_at FROM links WHERE code = %s", (code,))
        ).fetchone()
        if link is None:
            return None
        cur = await conn.execute(
            "SELECT minute, clicks FROM link_clicks WHERE code = %s ORDER BY minute", (code,)
        )
        rows = await cur.fetchall()
    return {
        "code": code,
        "url": link[0],
        "created_at": link[1].isoformat(),
        "clicks": sum(n for _, n in rows),
        "per_minute": [[m.isoformat(), n] for m, n in rows],
    }
