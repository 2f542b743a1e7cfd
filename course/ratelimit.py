"""Rate limiting (chapter 08): five algorithms in Redis, a fallback for when Redis is not there,
and the HTTP edge (429, ``Retry-After``, ``RateLimit`` headers).

Every Redis limiter is one Lua script on one key, so its check and its update are one
atomic step for every replica, in one round trip. Each takes its time from ``now`` when
the caller injects it (checks and demos on virtual time) and otherwise from the Redis
server's own clock (``TIME``), so the clocks of the replicas never enter the decision.

- :class:`FixedWindow`: one counter per window; cheap, but lets ``2 x limit`` through
  around a window boundary.
- :class:`SlidingLog`: a sorted set of admitted requests; exact, memory grows with the limit.
- :class:`SlidingCounter`: this window's and the previous window's counts, the previous one
  weighted by how much of it still overlaps; two numbers, approximately right.
- :class:`TokenBucket`: ``capacity`` tokens refilled at ``rate`` per second; bursts up to the
  capacity, then the rate. :func:`token_bucket` is the reference answer to the graded task.
- :class:`LeakyMeter` (a leaky bucket used as a meter: the token bucket's mirror image) and
  :class:`LeakyQueue` (a leaky bucket used as a queue: every request gets a slot
  ``1 / rate`` after the previous one and waits for it; rejected when the queue is full).
- :class:`GCRA`: the generic cell rate algorithm, the token bucket's decisions kept in one
  number (the time the bucket would be full again).
- :func:`sliding_window` is the reference answer to the other graded task (a sliding log).
- :class:`LocalTokenBucket` and :class:`FallbackLimiter`: when Redis is slow or down, a short
  timeout, chapter 02's :class:`~course.breaker.CircuitBreaker`, and a bounded local limit
  (``limit / replicas``) instead of no limit at all.
- :class:`LocalThenShared`: a local bucket in front of the shared one, so a client far over
  its limit is refused without a round trip to Redis.
- :class:`RateLimitMiddleware` (ASGI): ``429`` with ``Retry-After`` and the ``RateLimit`` /
  ``RateLimit-Policy`` fields of draft-ietf-httpapi-ratelimit-headers; :func:`get_honouring_retry_after`
  for the client that reads them (with chapter 01's :func:`course.retry.parse_retry_after`), and
  adds jitter so a fleet refused at one moment does not come back at one moment.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import math
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from course.breaker import CircuitBreaker, CircuitOpenError
from course.retry import parse_retry_after  # chapter 01's reader of Retry-After, shared


@dataclass(frozen=True)
class Decision:
    """What a limiter said about one request."""

    allowed: bool
    retry_after: float = 0.0  # seconds until the same request would be admitted (0 when allowed)
    remaining: int = 0  # requests (tokens) left right now
    reset: float = 0.0  # seconds until the limiter is back to its full allowance
    limit: int = 0
    delay: float = 0.0  # LeakyQueue only: how long to wait for the request's slot
    source: str = "redis"  # "redis", or which fallback decided ("local", "open", "closed")


# ----------------------------------------------------------------------------- Lua

#: Shared head of every script: ``now`` from ARGV[1] when given, else the server's clock.
_NOW = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

FIXED_WINDOW_LUA = (
    _NOW
    + """
-- KEYS[1]: a hash {w = window number, n = admitted in it}; ARGV: now, limit, window, cost
local limit, window, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local w = math.floor(now / window)
local state = redis.call('HMGET', KEYS[1], 'w', 'n')
local n = 0
if tonumber(state[1]) == w then n = tonumber(state[2]) end
local ends = (w + 1) * window - now
if n + cost <= limit then
  n = n + cost
  redis.call('HSET', KEYS[1], 'w', w, 'n', n)
  redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil(ends * 1000)))
  return {1, 0, limit - n, math.ceil(ends * 1000)}
end
return {0, math.ceil(ends * 1000), limit - n, math.ceil(ends * 1000)}
"""
)

SLIDING_LOG_LUA = (
    _NOW
    + """
-- KEYS[1]: a sorted set of admitted requests (score = time); ARGV: now, limit, window, cost, member
local limit, window, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local n = redis.call('ZCARD', KEYS[1])
if n + cost <= limit then
  for i = 1, cost do
    redis.call('ZADD', KEYS[1], now, ARGV[5] .. ':' .. i)  -- unique members: many requests share one time
  end
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {1, 0, limit - n - cost, math.ceil((tonumber(oldest[2]) + window - now) * 1000)}
end
if cost > limit then return {0, -1, limit - n, math.ceil(window * 1000)} end
-- the (n - limit + cost)-th oldest entry has to leave the window first
local entry = redis.call('ZRANGE', KEYS[1], n - limit + cost - 1, n - limit + cost - 1, 'WITHSCORES')
local newest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
return {0, math.ceil((tonumber(entry[2]) + window - now) * 1000), limit - n,
        math.ceil((tonumber(newest[2]) + window - now) * 1000)}
"""
)

SLIDING_COUNTER_LUA = (
    _NOW
    + """
-- KEYS[1]: a hash {w = window number, curr = admitted in it, prev = admitted in the one before}
-- ARGV: now, limit, window, cost. Estimate = prev * (share of the previous window still inside) + curr.
local limit, window, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local w = math.floor(now / window)
local e = now - w * window
local state = redis.call('HMGET', KEYS[1], 'w', 'curr', 'prev')
local sw, curr, prev = tonumber(state[1]), tonumber(state[2]) or 0, tonumber(state[3]) or 0
if sw ~= w then
  if sw == w - 1 then prev = curr else prev = 0 end
  curr = 0
end
local estimate = prev * (window - e) / window + curr
if estimate + cost <= limit then
  curr = curr + cost
  redis.call('HSET', KEYS[1], 'w', w, 'curr', curr, 'prev', prev)
  redis.call('PEXPIRE', KEYS[1], math.ceil(2 * window * 1000))
  return {1, 0, math.floor(limit - estimate - cost), math.ceil((2 * window - e) * 1000)}
end
local wait
if curr + cost <= limit and prev > 0 then
  wait = window * (1 - (limit - curr - cost) / prev) - e      -- later in this window
else
  local later = 0                                              -- in the next window, where prev = curr
  if curr > 0 then later = math.max(0, window * (1 - (limit - cost) / curr)) end
  wait = window - e + later
end
return {0, math.ceil(wait * 1000), math.max(0, math.floor(limit - estimate)), math.ceil((2 * window - e) * 1000)}
"""
)

TOKEN_BUCKET_LUA = (
    _NOW
    + """
-- KEYS[1]: a hash {tokens, ts}; ARGV: now, capacity, rate (tokens per second), cost
local capacity, rate, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local allowed, wait = 0, 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
else
  wait = (cost - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
-- keep the key as long as the bucket is not full again; a missing key reads as a full bucket
local full_in = (capacity - tokens) / rate
redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil(full_in * 1000)))
return {allowed, math.ceil(wait * 1000), math.floor(tokens), math.ceil(full_in * 1000)}
"""
)

LEAKY_METER_LUA = (
    _NOW
    + """
-- KEYS[1]: a hash {level, ts}: water that leaks out at `rate` per second; ARGV: now, capacity, rate, cost
local capacity, rate, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(state[1]) or 0
local ts = tonumber(state[2]) or now
level = math.max(0, level - math.max(0, now - ts) * rate)
local allowed, wait = 0, 0
if level + cost <= capacity then
  level = level + cost
  allowed = 1
else
  wait = (level + cost - capacity) / rate
end
redis.call('HSET', KEYS[1], 'level', level, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil(level / rate * 1000)))
return {allowed, math.ceil(wait * 1000), math.floor(capacity - level), math.ceil(level / rate * 1000)}
"""
)

GCRA_LUA = (
    _NOW
    + """
-- KEYS[1]: one number, the theoretical arrival time (TAT): when the bucket would be full again.
-- ARGV: now, capacity (the burst), rate (per second), cost. GCRA (Brandur Leach, 2015): a request
-- fits when, once it is counted, the TAT is at most capacity / rate ahead of now.
local capacity, rate, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tat = math.max(tonumber(redis.call('GET', KEYS[1])) or now, now)
local new_tat = tat + cost / rate
local allow_at = new_tat - capacity / rate
if now >= allow_at then
  redis.call('SET', KEYS[1], string.format('%.6f', new_tat), 'PX', math.max(1, math.ceil((new_tat - now) * 1000)))
  return {1, 0, math.floor((now - allow_at) * rate), math.ceil((new_tat - now) * 1000)}
end
return {0, math.ceil((allow_at - now) * 1000), math.floor(capacity - (tat - now) * rate), math.ceil((tat - now) * 1000)}
"""
)

LEAKY_QUEUE_LUA = (
    _NOW
    + """
-- KEYS[1]: the time of the last slot handed out; ARGV: now, rate, max queue length
-- Each request gets the slot 1/rate after the previous one (or now, if the queue is empty)
-- and waits for it: the output is one request every 1/rate seconds, whatever the input.
local rate, max_queue = tonumber(ARGV[2]), tonumber(ARGV[3])
local last = tonumber(redis.call('GET', KEYS[1])) or (now - 1 / rate)
local slot = math.max(now, last + 1 / rate)
local queued = math.floor((slot - now) * rate + 0.5)
if queued >= max_queue then
  return {0, math.ceil((slot - now - (max_queue - 1) / rate) * 1000), 0, math.ceil((slot - now) * 1000)}
end
redis.call('SET', KEYS[1], tostring(slot), 'PX', math.ceil((slot - now) * 1000) + 1000)
return {1, 0, max_queue - queued - 1, math.ceil((slot - now) * 1000)}
"""
)


def _now_arg(now: float | None) -> str:
    return "" if now is None else repr(float(now))


class RedisLimiter:
    """Base of the Redis limiters: one Lua script, one key per client, one round trip per request."""

    lua: str = ""
    name: str = "limiter"

    def __init__(self, redis, limit: int, window: float, *, prefix: str = "rl") -> None:
        self.redis = redis
        self.limit = int(limit)
        self.window = float(window)
        self.prefix = prefix
        self._script = redis.register_script(self.lua)

    def key(self, client: str) -> str:
        return f"{self.prefix}:{self.name}:{client}"

    def _args(self, cost: int) -> list:
        return [self.limit, self.window, cost]

    async def hit(self, client: str, cost: int = 1, now: float | None = None) -> Decision:
        """Ask for ``cost`` units for ``client``; admitted or not, and how long to wait."""
        allowed, wait_ms, remaining, reset_ms = await self._script(
            keys=[self.key(client)], args=[_now_arg(now), *self._args(cost)]
        )
        return Decision(
            bool(allowed),
            max(0.0, wait_ms / 1000) if wait_ms >= 0 else math.inf,
            max(0, int(remaining)),
            reset_ms / 1000,
            self.limit,
            delay=reset_ms / 1000 if self.name == "leaky-queue" else 0.0,
        )

    @property
    def policy(self) -> tuple[int, float]:
        """(quota, window in seconds) for the ``RateLimit-Policy`` header."""
        return self.limit, self.window


class FixedWindow(RedisLimiter):
    """``limit`` per ``window`` seconds, counted in windows aligned to multiples of ``window``."""

    lua = FIXED_WINDOW_LUA
    name = "fixed"


class SlidingLog(RedisLimiter):
    """At most ``limit`` in any ``window`` seconds, exactly: a sorted set of admitted requests."""

    lua = SLIDING_LOG_LUA
    name = "log"

    def _args(self, cost: int) -> list:
        return [self.limit, self.window, cost, secrets.token_hex(8)]


class SlidingCounter(RedisLimiter):
    """About ``limit`` per ``window``: this window's count plus the previous one's, weighted."""

    lua = SLIDING_COUNTER_LUA
    name = "counter"


class TokenBucket(RedisLimiter):
    """Bursts up to ``capacity``, then ``rate`` per second. ``limit`` is the capacity; the
    window (for headers) is the time an empty bucket takes to fill."""

    lua = TOKEN_BUCKET_LUA
    name = "bucket"

    def __init__(self, redis, capacity: int, rate: float, *, prefix: str = "rl") -> None:
        self.rate = float(rate)
        super().__init__(redis, capacity, capacity / rate, prefix=prefix)

    def _args(self, cost: int) -> list:
        return [self.limit, self.rate, cost]


class LeakyMeter(TokenBucket):
    """A leaky bucket as a meter: ``level`` rises by each request and leaks at ``rate``."""

    lua = LEAKY_METER_LUA
    name = "meter"


class GCRA(TokenBucket):
    """The generic cell rate algorithm: the token bucket's decisions, stored as one number
    (the time at which the bucket would be full again) instead of two. redis-cell's
    ``CL.THROTTLE`` is this algorithm as a Redis module."""

    lua = GCRA_LUA
    name = "gcra"


class LeakyQueue(RedisLimiter):
    """A leaky bucket as a queue: admitted requests wait ``Decision.delay`` for their slot.

    The output is smooth (one request every ``1 / rate`` s) at the price of latency; a
    request that would find ``max_queue`` ahead of it is rejected.
    """

    lua = LEAKY_QUEUE_LUA
    name = "leaky-queue"

    def __init__(self, redis, rate: float, max_queue: int, *, prefix: str = "rl") -> None:
        self.rate = float(rate)
        super().__init__(redis, max_queue, max_queue / rate, prefix=prefix)

    def _args(self, cost: int) -> list:
        return [self.rate, self.limit]

    async def acquire(self, client: str, *, sleep: Callable[[float], Awaitable] = asyncio.sleep) -> Decision:
        """Take a slot and wait for it (admitted), or return the rejection at once."""
        decision = await self.hit(client)
        if decision.allowed and decision.delay > 0:
            await sleep(decision.delay)
        return decision


# ----------------------------------------------------------------------------- the graded tasks' references


async def token_bucket(redis, key: str, capacity: int, rate: float, cost: int = 1, now: float | None = None):
    """Reference answer to ``token_bucket``: ``(admitted, seconds to wait)``, in one Lua script."""
    script = redis.register_script(TOKEN_BUCKET_LUA)
    allowed, wait_ms, _, _ = await script(keys=[key], args=[_now_arg(now), capacity, rate, cost])
    return bool(allowed), wait_ms / 1000


async def sliding_window(redis, key: str, limit: int, window: float, now: float | None = None):
    """Reference answer to ``sliding_window``: a sliding log, ``(admitted, seconds to wait)``."""
    script = redis.register_script(SLIDING_LOG_LUA)
    allowed, wait_ms, _, _ = await script(
        keys=[key], args=[_now_arg(now), limit, window, 1, secrets.token_hex(8)]
    )
    return bool(allowed), wait_ms / 1000


# ----------------------------------------------------------------------------- when Redis is not there


class LocalTokenBucket:
    """An in-process token bucket per client (the fallback's limit: its share of the global one)."""

    def __init__(
        self,
        capacity: float,
        rate: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10_000,
    ) -> None:
        self.capacity = float(capacity)
        self.rate = float(rate)
        self.clock = clock
        self.max_clients = max_clients
        # Least recently used first. Evicting by first insertion instead forgot the busiest
        # client (seen first, seen constantly) and handed it a full bucket again.
        self._buckets: dict[str, tuple[float, float]] = {}

    async def hit(self, client: str, cost: int = 1, now: float | None = None) -> Decision:
        now = self.clock() if now is None else now
        tokens, ts = self._buckets.get(client, (self.capacity, now))
        tokens = min(self.capacity, tokens + max(0.0, now - ts) * self.rate)
        allowed = tokens >= cost
        if allowed:
            tokens -= cost
        self._buckets.pop(client, None)  # re-inserted last: the dict's order is recency of use
        self._buckets[client] = (tokens, now)
        if len(self._buckets) > self.max_clients:  # bounded: forget the least recently seen client
            self._buckets.pop(next(iter(self._buckets)))
        wait = 0.0 if allowed else (cost - tokens) / self.rate
        return Decision(
            allowed,
            wait,
            int(tokens),
            (self.capacity - tokens) / self.rate,
            int(self.capacity),
            source="local",
        )


def _redis_trouble(err: BaseException) -> bool:
    from redis.exceptions import RedisError

    return isinstance(err, (TimeoutError, asyncio.TimeoutError, OSError, RedisError))


def redis_breaker(cooldown: float = 0.5, *, clock: Callable[[], float] = time.monotonic) -> CircuitBreaker:
    """The fallback's breaker: opens after half of the last 10 calls (at least 3) failed on Redis
    trouble; after ``cooldown`` seconds one probe finds out whether Redis is back."""
    return CircuitBreaker(
        threshold=0.5,
        window_size=10,
        min_calls=3,
        cooldown=cooldown,
        clock=clock,
        is_failure=_redis_trouble,
        name="redis",
    )


@dataclass
class FallbackLimiter:
    """The shared limiter, with a short timeout; when Redis is slow or down, a local decision.

    ``mode``: ``"bounded"`` (fail open, but to ``local``: each replica admits its share of the
    limit), ``"open"`` (admit everything: no protection exactly when something is wrong) or
    ``"closed"`` (reject everything: a Redis outage becomes an API outage; right for login
    attempts and other abuse limits). A :class:`~course.breaker.CircuitBreaker` stops the
    replica from paying the timeout on every request while Redis is down.
    """

    shared: RedisLimiter
    local: LocalTokenBucket
    mode: str = "bounded"
    timeout: float = 0.02
    breaker: CircuitBreaker = field(default_factory=redis_breaker)
    counts: dict = field(default_factory=lambda: {"redis": 0, "local": 0, "open": 0, "closed": 0})

    async def hit(self, client: str, cost: int = 1) -> Decision:
        try:
            decision = await self.breaker.call(
                lambda: asyncio.wait_for(self.shared.hit(client, cost), self.timeout)
            )
        except Exception as err:
            if not (_redis_trouble(err) or isinstance(err, CircuitOpenError)):
                raise
            self.counts[self.mode if self.mode != "bounded" else "local"] += 1
            if self.mode == "open":
                return Decision(True, limit=self.shared.limit, source="open")
            if self.mode == "closed":
                return Decision(False, retry_after=1.0, limit=self.shared.limit, source="closed")
            return await self.local.hit(client, cost)
        self.counts["redis"] += 1
        return decision


@dataclass
class LocalThenShared:
    """A local bucket in front of the shared one: what the local bucket refuses costs no round trip.

    Give the local bucket the whole shared limit (one replica is never owed more than all of
    it): a client within its limit is then never refused locally, and a client far over it is
    refused by each replica on its own, without asking Redis. Envoy pairs its local and global
    rate limits the same way, "to reduce load on the global rate limit service".
    """

    local: LocalTokenBucket
    shared: RedisLimiter

    async def hit(self, client: str, cost: int = 1, now: float | None = None) -> Decision:
        first = await self.local.hit(client, cost, now)
        if not first.allowed:
            return first
        return await self.shared.hit(client, cost, now)

    @property
    def policy(self) -> tuple[int, float]:
        return self.shared.policy


# ----------------------------------------------------------------------------- the HTTP edge


def rate_limit_headers(
    decision: Decision, policy: tuple[int, float], name: str = "default"
) -> list[tuple[str, str]]:
    """``RateLimit-Policy`` and ``RateLimit`` as draft-ietf-httpapi-ratelimit-headers-10 spells
    them (``q`` quota, ``w`` window, ``r`` remaining, ``t`` seconds until reset), plus
    ``Retry-After`` (whole seconds, rounded up, at least 1) when the request was refused."""
    quota, window = policy
    headers = [
        ("RateLimit-Policy", f'"{name}";q={quota};w={max(1, math.ceil(window))}'),
        ("RateLimit", f'"{name}";r={decision.remaining};t={max(0, math.ceil(decision.reset))}'),
    ]
    if not decision.allowed:
        headers.append(("Retry-After", str(max(1, math.ceil(decision.retry_after)))))
    return headers


class ClientKey:
    """Whom to limit, decided only from what the server can trust.

    - An ``X-API-Key`` counts only once ``authenticate(key)`` maps it to an account: a
      limiter keyed on the raw header gives an attacker a fresh bucket per made-up key.
      Unknown keys are limited by address, like anonymous traffic.
    - The address is the TCP peer, unless the peer is one of ``trusted_proxies``: then the
      client is the right-most ``X-Forwarded-For`` entry that is not a trusted proxy (entries
      to its left were written by the client and prove nothing). Behind a load balancer
      without this, every client shares the balancer's one bucket.
    - IPv6 clients are limited per /64 (one host usually owns a whole /64 and can rotate
      through it); IPv4 per address.
    - Names are hashed before they become Redis keys: no raw header reaches a key name.
    """

    def __init__(
        self, *, trusted_proxies=(), authenticate: Callable[[str], str | None] | None = None
    ) -> None:
        self.trusted = [ipaddress.ip_network(p, strict=False) for p in trusted_proxies]
        self.authenticate = authenticate

    def _trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self.trusted)

    def address(self, scope) -> str:
        peer = str((scope.get("client") or ("unknown", 0))[0])
        if not self._trusted(peer):
            return peer
        forwarded = [
            part.strip()
            for name, value in scope.get("headers", [])
            if name == b"x-forwarded-for"
            for part in value.decode("latin-1").split(",")
        ]
        for hop in reversed(forwarded):  # right to left: the nearest hop first
            if not self._trusted(hop):
                return hop
        return peer

    @staticmethod
    def bucket(address: str) -> str:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return address
        if ip.version == 6:
            if ip.ipv4_mapped is not None:
                return str(ip.ipv4_mapped)
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
        return str(ip)

    def __call__(self, scope) -> str:
        if self.authenticate is not None:
            for name, value in scope.get("headers", []):
                if name == b"x-api-key":
                    account = self.authenticate(value.decode("latin-1"))
                    if account is not None:
                        return "acct:" + _digest(account)
                    break  # an unknown key is anonymous traffic
        return "ip:" + _digest(self.bucket(self.address(scope)))


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:24]


#: The default: no proxy trusted, no API keys known, so every client is limited by its address.
#: Configure your own: ``ClientKey(trusted_proxies=["10.0.0.0/8"], authenticate=accounts.get)``.
client_key = ClientKey()


class RateLimitMiddleware:
    """ASGI middleware: ask ``limiter`` before any work; 429 + ``Retry-After`` when refused.

    Admitted responses carry the ``RateLimit`` fields too, so a well-behaved client can slow
    down before it is refused. ``limiter`` is anything with ``async hit(client) -> Decision``
    and a ``policy``; a :class:`FallbackLimiter` works too (its ``shared.policy`` is used).
    """

    def __init__(self, app, limiter, *, key: Callable = client_key, name: str = "default") -> None:
        self.app = app
        self.limiter = limiter
        self.key = key
        self.name = name
        self.policy = getattr(limiter, "policy", None) or limiter.shared.policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        decision = await self.limiter.hit(self.key(scope))
        extra = [
            (k.lower().encode(), v.encode()) for k, v in rate_limit_headers(decision, self.policy, self.name)
        ]
        if not decision.allowed:
            body = json.dumps({"error": "rate_limited", "retry_after": decision.retry_after}).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ]
            await send({"type": "http.response.start", "status": 429, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def get_honouring_retry_after(
    http,
    url: str,
    *,
    attempts: int = 5,
    max_wait: float = 60.0,
    sleep: Callable[[float], Awaitable] = asyncio.sleep,
    waits: list | None = None,
    jitter: float = 0.1,
    rand: Callable[[], float] = random.random,
    **kwargs,
):
    """GET ``url`` with an ``httpx.AsyncClient``; on 429 or 503 wait what ``Retry-After`` says
    (up to ``max_wait``) and try again, at most ``attempts`` times. The last response is returned.

    A server that sends ``Retry-After`` knows when capacity comes back; a client that waits
    that long neither hammers it nor waits much longer than it must. Never less: the wait is
    ``Retry-After`` plus up to ``jitter`` of it (at least of one second), drawn from ``rand``,
    so a fleet refused at one moment does not come back at one moment. Without the header it
    falls back to chapter 01's capped exponential backoff with full jitter.
    """
    from course.backoff import FullJitter

    backoff = FullJitter(0.1, 2.0)
    response = None
    for attempt in range(attempts):
        response = await http.get(url, **kwargs)
        if response.status_code not in (429, 503) or attempt == attempts - 1:
            return response
        told = parse_retry_after(response.headers.get("retry-after"))
        if told is not None and told > max_wait:
            return response  # the server asks for longer than we are willing to wait: give up now
        if told is None:
            wait = backoff.delay(attempt, rand=rand)
        else:
            wait = told + rand() * jitter * max(told, 1.0)  # later than told, never earlier
        if waits is not None:
            waits.append(wait)
        await sleep(wait)
    return response
