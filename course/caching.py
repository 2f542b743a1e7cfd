"""Caching, stampedes and invalidation (chapter 04).

The strategies (cache-aside, read-through, write-through, write-behind), the stampede
guards (single-flight, a Redis lock with a token, serve-stale, probabilistic early
expiration), versioned writes in Lua against the read-then-set race, jittered TTLs,
replicated hot keys and a bounded in-process cache invalidated through pub/sub, all
against live Redis and PostgreSQL. Chapter 12 (URL shortener) reuses :class:`CacheAside`
for its redirect path.

What chapter 04 measures with them (the stampede, penetration, the avalanche, the race
and the delayed double delete, a crash under write-behind) and the tables that count
the database's queries are in :mod:`course.chapters.ch04`.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

Loader = Callable[[], Awaitable[Any]]

# ============================================================================ TTLs


def jittered_ms(ttl: float, jitter: float = 0.2, rand: Callable[[], float] = random.random) -> int:
    """A TTL in milliseconds drawn uniformly from ``[ttl, ttl * (1 + jitter))`` seconds."""
    return max(1, int(ttl * 1000 * (1 + jitter * rand())))


def to_json(value: Any) -> str:
    """The cache's encoding of a value: compact JSON."""
    return json.dumps(value, separators=(",", ":"))


# ============================================================================ single-flight


class SingleFlight:
    """One load per key at a time in this process; every caller of that key shares its result or error.

    The load runs as a task of its own, so a caller that is cancelled does not cancel the
    load for the others; the entry is removed when the load ends, success or failure, so
    one error never poisons the key.
    """

    def __init__(self) -> None:
        self._calls: dict[str, asyncio.Task] = {}
        self.loads = 0

    def in_flight(self) -> int:
        return len(self._calls)

    def running(self, key: str) -> bool:
        return key in self._calls

    async def do(self, key: str, fn: Loader) -> Any:
        call = self._calls.get(key)
        if call is None:
            self.loads += 1
            call = asyncio.get_running_loop().create_task(fn())
            self._calls[key] = call
            call.add_done_callback(lambda done, key=key: self._forget(key, done))
        return await asyncio.shield(call)

    def _forget(self, key: str, done: asyncio.Task) -> None:
        if self._calls.get(key) is done:
            del self._calls[key]
        if not done.cancelled():
            done.exception()  # mark retrieved: the callers got it


# ============================================================================ the four strategies

MISSING = object()


class CacheAside:
    """Cache-aside with JSON values: read Redis, on a miss load and fill; the writer deletes after commit.

    - every key gets a TTL, jittered into ``[ttl, ttl * (1 + jitter))``;
    - ``miss_ttl``: cache a missing row (``None``) for that many seconds (negative caching);
      ``None`` leaves misses uncached;
    - ``single_flight``: concurrent misses of one key in this process share one load.
    """

    def __init__(
        self,
        redis,
        *,
        ttl: float = 300.0,
        jitter: float = 0.2,
        miss_ttl: float | None = None,
        single_flight: bool = True,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.redis = redis
        self.ttl = ttl
        self.jitter = jitter
        self.miss_ttl = miss_ttl
        self.flight = SingleFlight() if single_flight else None
        self.rand = rand
        self.hits = 0
        self.misses = 0

    async def _cached(self, key: str) -> Any:
        raw = await self.redis.get(key)
        return MISSING if raw is None else json.loads(raw)

    async def get(self, key: str, loader: Loader) -> Any:
        value = await self._cached(key)
        if value is not MISSING:
            self.hits += 1
            return value
        self.misses += 1
        if self.flight is None:
            return await self._fill(key, loader)
        return await self.flight.do(key, lambda: self._fill(key, loader, recheck=True))

    async def _fill(self, key: str, loader: Loader, *, recheck: bool = False) -> Any:
        if recheck:  # a load that finished between our GET and joining the flight already filled it
            value = await self._cached(key)
            if value is not MISSING:
                return value
        value = await loader()
        if value is None and self.miss_ttl is None:
            return None
        ttl = self.miss_ttl if value is None else self.ttl
        await self.redis.set(key, to_json(value), px=jittered_ms(ttl, self.jitter, self.rand))
        return value

    async def invalidate(self, key: str) -> None:
        """Call after the database commit, never before: a reader could refill from the old row."""
        await self.redis.delete(key)


class ReadThrough:
    """Read-through: the loader lives inside the cache; callers only ever ask the cache for an id."""

    def __init__(self, redis, load: Callable[[Any], Awaitable[Any]], *, prefix: str, **options) -> None:
        self.cache = CacheAside(redis, **options)
        self.load = load
        self.prefix = prefix

    async def get(self, item_id: Any) -> Any:
        return await self.cache.get(f"{self.prefix}:{item_id}", lambda: self.load(item_id))


class WriteThrough:
    """Write-through: every write goes to the database and then to the cache, on the writer's path.

    The next read is a hit, but every write now waits for Redis too (and fails with it).
    """

    def __init__(
        self, redis, write: Callable[[Any, Any], Awaitable[Any]], *, prefix: str, ttl: float = 300.0
    ) -> None:
        self.redis = redis
        self.write = write
        self.prefix = prefix
        self.ttl = ttl

    async def put(self, item_id: Any, value: Any) -> Any:
        stored = await self.write(item_id, value)  # commit first: the cache never shows an uncommitted row
        await self.redis.set(f"{self.prefix}:{item_id}", to_json(stored), px=jittered_ms(self.ttl))
        return stored

    async def get(self, item_id: Any) -> Any:
        raw = await self.redis.get(f"{self.prefix}:{item_id}")
        return None if raw is None else json.loads(raw)


class WriteBehind:
    """Write-behind (write-back): acknowledge once Redis has it, write the database later in batches.

    Fast writes, but a crash between the acknowledgement and the flush loses writes the
    client was told succeeded. Fine for view counters; never for orders or money.
    """

    def __init__(
        self,
        redis,
        flush: Callable[[dict], Awaitable[None]],
        *,
        prefix: str,
        batch: int = 10,
        ttl: float = 300.0,
    ) -> None:
        self.redis = redis
        self._flush = flush
        self.prefix = prefix
        self.batch = batch
        self.ttl = ttl
        self.pending: dict[str, Any] = {}
        self.flushed = 0

    async def put(self, item_id: str, value: Any) -> None:
        await self.redis.set(f"{self.prefix}:{item_id}", to_json(value), px=jittered_ms(self.ttl))
        self.pending[item_id] = value
        if len(self.pending) >= self.batch:
            await self.flush()

    async def flush(self) -> None:
        batch, self.pending = self.pending, {}
        if batch:
            await self._flush(batch)
            self.flushed += len(batch)


# ============================================================================ a lock in Redis

RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


ACQUIRE_FENCED_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return redis.call('INCR', KEYS[2])
end
return 0
"""


class RedisLock:
    """A lock across processes: ``SET name token NX PX ttl``, released only by its holder.

    The expiry means a holder that dies cannot block everyone forever; the random token
    and the compare-and-delete script mean a holder whose lock already expired (and was
    taken by someone else) cannot delete the new holder's lock.

    With ``fencing=True`` each acquisition also gets a **fencing token**, a number that
    grows with every acquisition (``INCR`` in the same script), in ``self.fence``. The
    lock alone cannot stop a holder that paused past its expiry from writing; the storage
    can, if it refuses a write whose token is older than the newest it has seen
    (Kleppmann, "How to do distributed locking", 2016).
    """

    def __init__(self, redis, name: str, ttl: float = 5.0, *, fencing: bool = False) -> None:
        self.redis = redis
        self.name = name
        self.ttl = ttl
        self.fencing = fencing
        self.token: str | None = None
        self.fence: int | None = None
        self._release = redis.register_script(RELEASE_LUA)
        self._acquire_fenced = redis.register_script(ACQUIRE_FENCED_LUA) if fencing else None

    async def acquire(self) -> bool:
        token = secrets.token_hex(16)
        ttl_ms = max(1, int(self.ttl * 1000))
        if self._acquire_fenced is not None:
            fence = int(
                await self._acquire_fenced(keys=[self.name, f"{self.name}:fence"], args=[token, ttl_ms])
            )
            if fence:
                self.token, self.fence = token, fence
                return True
            return False
        if await self.redis.set(self.name, token, nx=True, px=ttl_ms):
            self.token = token
            return True
        return False

    async def release(self) -> bool:
        if self.token is None:
            return False
        token, self.token = self.token, None
        return bool(await self._release(keys=[self.name], args=[token]))


async def get_with_lock(
    redis,
    key: str,
    ttl: float,
    loader: Loader,
    *,
    lock_ttl: float = 5.0,
    poll: float = 0.02,
    max_wait: float | None = None,
    jitter: float = 0.2,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Any:
    """Cache-aside where one process in the whole fleet loads a missing key; the others poll the cache.

    A loser waits ``poll`` seconds between looks. If the holder died, its lock expires after
    ``lock_ttl`` and the next caller takes over. Past ``max_wait`` (default: twice the lock
    TTL) a caller gives up waiting and loads by itself rather than fail the request.
    """
    limit = clock() + (2 * lock_ttl if max_wait is None else max_wait)
    lock = RedisLock(redis, f"lock:{key}", lock_ttl)
    while True:
        raw = await redis.get(key)
        if raw is not None:
            return json.loads(raw)
        if await lock.acquire():
            try:
                raw = await redis.get(key)  # filled while we raced for the lock
                if raw is not None:
                    return json.loads(raw)
                value = await loader()
                await redis.set(key, to_json(value), px=jittered_ms(ttl, jitter))
                return value
            finally:
                await lock.release()
        if clock() >= limit:
            return await loader()
        await sleep(poll)


# ============================================================================ serve stale, early expiration


class ServeStale:
    """Stale-while-revalidate, and stale-if-error: a stale value beats an error.

    Redis holds ``{"v": value, "fresh_until": t, "stale_until": t2}``. Past ``fresh`` seconds
    a hit still answers at once and starts a background refresh (single-flighted in this
    process, guarded by a Redis lock across processes); a refresh that fails leaves the
    old value in place. Past ``fresh + stale`` the caller waits for a load, but for another
    ``stale_if_error`` seconds the entry is kept, and a load that fails (the database is
    down, or its circuit breaker is open) answers with the old value instead of an error.
    HTTP caches name the same two behaviours ``stale-while-revalidate`` and
    ``stale-if-error`` (RFC 5861). Only a cold key makes a failed load reach the caller.
    """

    def __init__(
        self,
        redis,
        *,
        fresh: float = 60.0,
        stale: float = 600.0,
        stale_if_error: float = 0.0,
        lock_ttl: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.fresh = fresh
        self.stale = stale
        self.stale_if_error = stale_if_error
        self.lock_ttl = lock_ttl
        self.clock = clock
        self.flight = SingleFlight()
        self._refreshing: dict[str, asyncio.Task] = {}
        self.stale_hits = 0
        self.served_on_error = 0  # answers that were an old value because the load failed
        self.refresh_errors: list[BaseException] = []

    async def get(self, key: str, loader: Loader) -> Any:
        raw = await self.redis.get(key)
        if raw is None:
            return await self.flight.do(key, lambda: self._fill(key, loader))
        entry = json.loads(raw)
        now = self.clock()
        if now < entry["fresh_until"]:
            return entry["v"]
        if now < entry.get("stale_until", math.inf):
            self.stale_hits += 1
            self._refresh_later(key, loader)
            return entry["v"]
        try:  # too old to serve without trying, kept only in case the load fails
            return await self.flight.do(key, lambda: self._fill(key, loader))
        except Exception as err:  # noqa: BLE001 - stale-if-error: the old value beats an error
            self.served_on_error += 1
            self.refresh_errors.append(err)
            return entry["v"]

    async def _fill(self, key: str, loader: Loader) -> Any:
        value = await loader()
        now = self.clock()
        entry = {"v": value, "fresh_until": now + self.fresh, "stale_until": now + self.fresh + self.stale}
        await self.redis.set(
            key, to_json(entry), px=jittered_ms(self.fresh + self.stale + self.stale_if_error)
        )
        return value

    def _refresh_later(self, key: str, loader: Loader) -> None:
        if key in self._refreshing:
            return
        task = asyncio.get_running_loop().create_task(self._refresh(key, loader))
        self._refreshing[key] = task
        task.add_done_callback(lambda _t, key=key: self._refreshing.pop(key, None))

    async def _refresh(self, key: str, loader: Loader) -> None:
        lock = RedisLock(self.redis, f"refresh:{key}", self.lock_ttl)
        if not await lock.acquire():
            return  # another process is refreshing it
        try:
            await self._fill(key, loader)
        except Exception as err:  # noqa: BLE001 - keep serving the stale value; the next stale hit retries
            self.refresh_errors.append(err)
        finally:
            await lock.release()

    async def drain(self) -> None:
        """Wait for the background refreshes started so far (tests and demos)."""
        while self._refreshing:
            await asyncio.gather(*list(self._refreshing.values()), return_exceptions=True)

    async def mark_stale(self, key: str, *, past_stale: bool = False) -> None:
        """Demo helper: make a cached value stale now, as if ``fresh`` seconds had passed
        (``past_stale``: as if ``fresh + stale`` had passed, leaving only stale-if-error)."""
        raw = await self.redis.get(key)
        if raw is not None:
            entry = json.loads(raw)
            entry["fresh_until"] = self.clock() - 1
            if past_stale:
                entry["stale_until"] = self.clock() - 1
            await self.redis.set(key, to_json(entry), keepttl=True)


def early_refresh_probability(time_left: float, delta: float, beta: float = 1.0) -> float:
    """The chance that one read refreshes a value ``time_left`` seconds before it expires (XFetch).

    A read refreshes when ``now - delta * beta * ln(U) >= expiry`` with U uniform on (0, 1],
    which happens with probability ``exp(-time_left / (delta * beta))``.
    """
    if time_left <= 0:
        return 1.0
    return math.exp(-time_left / (delta * beta))


class EarlyExpiry:
    """Probabilistic early expiration (XFetch, Vattani et al., VLDB 2015).

    Redis holds ``{"v": value, "delta": seconds the last load took, "expiry": t}``. Each read
    may decide to recompute before the expiry, more likely the closer the expiry and the
    slower the load, so one reader refreshes a hot key ahead of time and nobody meets a miss.
    While that refresh runs, other readers of the process keep getting the cached value.
    """

    def __init__(
        self,
        redis,
        *,
        ttl: float = 60.0,
        beta: float = 1.0,
        clock: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.redis = redis
        self.ttl = ttl
        self.beta = beta
        self.clock = clock
        self.rand = rand
        self.flight = SingleFlight()
        self.early = 0  # reads that refreshed before the expiry
        self.waited = 0  # reads that waited for a load

    async def get(self, key: str, loader: Loader) -> Any:
        raw = await self.redis.get(key)
        if raw is not None:
            entry = json.loads(raw)
            gap = -entry["delta"] * self.beta * math.log(max(self.rand(), 1e-12))
            if self.clock() + gap < entry["expiry"] or self.flight.running(key):
                return entry["v"]  # not yet, or another reader of this process is already refreshing it
            self.early += 1
        self.waited += 1
        return await self.flight.do(key, lambda: self._recompute(key, loader))

    async def _recompute(self, key: str, loader: Loader) -> Any:
        started = self.clock()
        value = await loader()
        now = self.clock()
        entry = {"v": value, "delta": max(now - started, 1e-3), "expiry": now + self.ttl}
        await self.redis.set(key, to_json(entry), px=max(1, int(self.ttl * 1000)))
        return value


# ============================================================================ versioned writes

VERSIONED_SET_LUA = """
local current = redis.call('HGET', KEYS[1], 'version')
if current and tonumber(current) >= tonumber(ARGV[1]) then
    return 0
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'value', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""


async def versioned_set(redis, key: str, version: int, value: Any, ttl: float = 300.0) -> bool:
    """Store ``value`` only if ``version`` is newer than the cached one (atomically, in Lua)."""
    script = redis.register_script(VERSIONED_SET_LUA)
    return bool(await script(keys=[key], args=[version, to_json(value), jittered_ms(ttl)]))


async def versioned_get(redis, key: str) -> Any:
    raw = await redis.hget(key, "value")
    return MISSING if raw is None else json.loads(raw)


# ============================================================================ in-process caches


class LocalLRU:
    """A bounded in-process cache: least recently used entries go first, each entry lives ``ttl`` seconds."""

    def __init__(
        self, maxsize: int = 1024, ttl: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.maxsize = maxsize
        self.ttl = ttl
        self.clock = clock
        self._data: OrderedDict[str, tuple[float, Any]] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str, default: Any = MISSING) -> Any:
        item = self._data.get(key)
        if item is None or item[0] <= self.clock():
            if item is not None:
                del self._data[key]
            self.misses += 1
            return default
        self._data.move_to_end(key)
        self.hits += 1
        return item[1]

    def set(self, key: str, value: Any) -> None:
        self._data[key] = (self.clock() + self.ttl, value)
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)
            self.evictions += 1

    def pop(self, key: str) -> None:
        self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not MISSING


def _pubsub_telling(redis, on_reconnect: Callable[[], None]):
    """``redis.pubsub()`` whose automatic reconnects (redis-py resubscribes by itself) call ``on_reconnect``."""
    from redis.asyncio.client import PubSub

    class TellingPubSub(PubSub):
        async def on_connect(self, connection) -> None:
            await super().on_connect(connection)
            on_reconnect()

    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    pubsub.__class__ = TellingPubSub
    return pubsub


class NearCache:
    """A pod's two-level cache: a :class:`LocalLRU` in front of Redis, emptied by pub/sub invalidations.

    Pub/sub is fire-and-forget: a pod whose subscription is down when an invalidation is
    published never gets it. So, as the Redis docs ask of client-side caches, the pod
    **flushes its local cache whenever it (re)subscribes**: nothing it cached before
    can be trusted, because an invalidation of it may have been missed. redis-py
    reconnects a pub/sub connection by itself; the hook on that reconnect flushes too.
    What remains is the time a pod is cut off without knowing it yet: the local TTL is
    what bounds that. ``flush_on_subscribe=False`` is the common mistake, kept for the demo.
    """

    def __init__(
        self,
        redis,
        channel: str,
        local: LocalLRU,
        *,
        name: str = "pod",
        ttl: float = 300.0,
        flush_on_subscribe: bool = True,
        retry_every: float = 0.5,
    ) -> None:
        self.redis = redis
        self.channel = channel
        self.local = local
        self.name = name
        self.shared = CacheAside(redis, ttl=ttl)
        self.flight = SingleFlight()
        self.flush_on_subscribe = flush_on_subscribe
        self.retry_every = retry_every
        self.subscribes = 0  # first subscription and every reconnect
        self.received: list[str] = []
        self._pubsub = None
        self._listener: asyncio.Task | None = None
        self._seen: dict[str, asyncio.Event] = {}

    def _subscribed(self) -> None:
        self.subscribes += 1
        if self.flush_on_subscribe:
            self.local.clear()  # invalidations sent while we were not subscribed are lost: trust nothing

    async def start(self) -> NearCache:
        pubsub = _pubsub_telling(self.redis, self._subscribed)
        await pubsub.subscribe(self.channel)
        self._subscribed()
        self._pubsub = pubsub
        self._listener = asyncio.get_running_loop().create_task(self._listen(pubsub))
        return self

    async def _listen(self, pubsub) -> None:
        from redis.exceptions import ConnectionError as RedisConnectionError

        while True:
            try:
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    key = message["data"]
                    self.local.pop(key)
                    self.received.append(key)
                    self._seen.setdefault(key, asyncio.Event()).set()
                return  # unsubscribed
            except (RedisConnectionError, ConnectionError, OSError):
                if self.flush_on_subscribe:
                    self.local.clear()  # cut off: whatever we hold may be stale already
                await asyncio.sleep(self.retry_every)  # the next listen() reconnects and resubscribes

    async def stop(self) -> None:
        """Stop listening (a pod restarting or reconnecting): invalidations published now are lost."""
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        if self._pubsub is not None:
            await self._pubsub.unsubscribe(self.channel)
            await self._pubsub.aclose()
            self._pubsub = None

    async def get(self, key: str, loader: Loader) -> Any:
        value = self.local.get(key)
        if value is not MISSING:
            return value
        value = await self.flight.do(f"local:{key}", lambda: self.shared.get(key, loader))
        self.local.set(key, value)
        return value

    async def invalidate(self, key: str) -> int:
        """After a commit: delete the shared copy and tell every pod; returns how many pods heard it."""
        self.local.pop(key)
        await self.redis.delete(key)
        return int(await self.redis.publish(self.channel, key))

    async def wait_for(self, key: str, timeout: float = 2.0) -> bool:
        """Wait until this pod has processed an invalidation of ``key`` (demos)."""
        event = self._seen.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        event.clear()
        return True


# ---------------------------------------------------------------------------- hot keys


def replica_keys(key: str, replicas: int = 8) -> list[str]:
    return [f"{key}#{i}" for i in range(replicas)]


def replica_slots(key: str, replicas: int = 8) -> list[int]:
    """The Redis Cluster hash slot of each replica key: different slots land on different shards."""
    from redis.crc import key_slot

    return [key_slot(k.encode()) for k in replica_keys(key, replicas)]


async def set_replicated(redis, key: str, value: Any, *, replicas: int = 8, ttl: float = 60.0) -> None:
    """Write a hot key as ``replicas`` copies (each with its own jittered TTL)."""
    async with redis.pipeline(transaction=False) as pipe:
        for k in replica_keys(key, replicas):
            pipe.set(k, to_json(value), px=jittered_ms(ttl))
        await pipe.execute()


async def get_replicated(
    redis, key: str, *, replicas: int = 8, rand: Callable[[], float] = random.random
) -> tuple[str, Any]:
    """Read one copy chosen at random; returns ``(copy's key, value)``."""
    k = replica_keys(key, replicas)[int(rand() * replicas) % replicas]
    raw = await redis.get(k)
    return k, None if raw is None else json.loads(raw)
