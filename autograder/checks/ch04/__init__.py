"""Hidden checks of chapter 04 (caching, stampedes and invalidation).

``get_cached``: 50 concurrent requests for a missing or expired key make exactly one
database query, errors reach every waiter and are never cached, different keys load in
parallel, TTLs are jittered, and a caller that is cancelled does not cancel the load the
others share (the last is worth 2 of the 6 points). ``get_user_cached`` is negative
caching over the chapter's ``users`` view.

Database queries are counted by PostgreSQL (a logging SQL function, the ``users`` view's
``user_reads``). Concurrency is decided by what was observed, never by wall time: the
check's loaders hold every load until all callers are parked (no Redis command on the
wire, nothing ready to run on the loop), so one load per key is exact, and "loads run in
parallel" means ten loads were seen running at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import json
import random
import time

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from autograder.harness import Report, task
from autograder.probes import burst, seeded_random, settled, tally
from course.chapters.ch04 import add_user, setup_users, user_queries
from course.kit import lab

TTL = 60.0
_RUNS = itertools.count(1)  # fresh key names per run: a learner's per-key locks belong to one event loop


# ----------------------------------------------------------------------------- watching Redis traffic


class _Traffic:
    def __init__(self) -> None:
        self.in_flight = 0
        self.ttl_ms: dict[str, float] = {}  # key -> the TTL its last SET / EXPIRE asked for, in ms
        self.ttl_writes: dict[str, int] = {}  # key -> how many commands asked for a TTL on it

    def saw(self, args: tuple) -> None:
        """Remember the TTL a command asks for: the TTL check reads this, not PTTL minus elapsed time."""
        if not args:
            return
        name = str(args[0]).upper()
        rest = [str(a).upper() if isinstance(a, str) else a for a in args]
        try:
            if name == "SET" and len(args) >= 3:
                for flag, scale in (("EX", 1000.0), ("PX", 1.0)):
                    if flag in rest[3:]:
                        self.ttl_ms[str(args[1])] = float(args[3 + rest[3:].index(flag) + 1]) * scale
                        self.ttl_writes[str(args[1])] = self.ttl_writes.get(str(args[1]), 0) + 1
                        return
                if "KEEPTTL" not in rest[3:]:
                    self.ttl_ms.pop(str(args[1]), None)
            elif name in ("SETEX", "PSETEX", "EXPIRE", "PEXPIRE") and len(args) >= 3:
                scale = 1000.0 if name in ("SETEX", "EXPIRE") else 1.0
                self.ttl_ms[str(args[1])] = float(args[2]) * scale
                self.ttl_writes[str(args[1])] = self.ttl_writes.get(str(args[1]), 0) + 1
            elif name in ("GETEX", "EXPIREAT", "PEXPIREAT") and len(args) >= 3:
                self.ttl_writes[str(args[1])] = self.ttl_writes.get(str(args[1]), 0) + 1
        except (ValueError, IndexError, TypeError):
            return


class _CountingPipeline(Pipeline):
    traffic: _Traffic

    async def execute(self, raise_on_error: bool = True):
        for command in self.command_stack:
            self.traffic.saw(command[0])  # (args, options)
        self.traffic.in_flight += 1
        try:
            return await super().execute(raise_on_error)
        finally:
            self.traffic.in_flight -= 1


class _CountingRedis(aioredis.Redis):
    """A ``redis.asyncio.Redis`` that knows how many of its commands are on the wire right now."""

    traffic: _Traffic

    async def execute_command(self, *args, **options):
        self.traffic.saw(args)
        self.traffic.in_flight += 1
        try:
            return await super().execute_command(*args, **options)
        finally:
            self.traffic.in_flight -= 1

    def pipeline(self, transaction: bool = True, shard_hint=None):
        pipe = _CountingPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.traffic = self.traffic
        return pipe


def _watched_redis(ns) -> _CountingRedis:
    client = _CountingRedis.from_url(ns.redis_url, decode_responses=True)
    client.traffic = _Traffic()
    return client


async def _parked(traffic: _Traffic, limit: float = 5.0) -> bool:
    """Wait until every other task is parked: no Redis command in flight and nothing ready to run.

    Only a liveness bound (``limit``) is real time; correct code parks within milliseconds.
    """
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + limit
    calm = 0
    while time.monotonic() < deadline:
        await settled()  # this loop, and the learner's process when the answer runs in its own
        if traffic.in_flight == 0 and not getattr(loop, "_ready", None):
            calm += 1
            if calm >= 3:
                return True
        else:
            calm = 0
            await asyncio.sleep(0.002)  # a reply is on its way
    return False


# ----------------------------------------------------------------------------- the data source

SOURCE_SQL = """
CREATE TABLE source_loads (
    id  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key text NOT NULL,
    at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION load_value(p_key text, p_item text) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE n bigint;
BEGIN
    INSERT INTO source_loads (key) VALUES (p_key);
    SELECT count(*) INTO n FROM source_loads WHERE key = p_key;
    RETURN jsonb_build_object('item', p_item, 'load', n);
END $$;
"""

_caller: contextvars.ContextVar[int | None] = contextvars.ContextVar("caller", default=None)
LATE = 10  # the caller of the cancellation check that arrives after the cancellations


def _item(key: str) -> str:
    """What a key's value calls itself: the key without the check's per-run prefix (``ch04:3:``)."""
    return key.split(":", 2)[-1]


def _value(key: str, load: int) -> dict:
    return {"item": _item(key), "load": load}


class SourceDown(Exception):
    """The check's database is down for this key."""


class _Source:
    """Loaders for the check: each load is one query PostgreSQL logs; loads are held until callers park."""

    def __init__(self, pool, traffic: _Traffic) -> None:
        self.pool = pool
        self.traffic = traffic
        self.running = 0
        self.max_running = 0
        self.failing: set[str] = set()
        self.gates: dict[str, asyncio.Event] = {}  # a load of this key waits here after the callers park
        self.started: list[tuple[str, int | None]] = []  # (key, the caller whose context started the load)
        self.cancelled: list[str] = []  # the keys of loads cancelled before they ended

    async def setup(self) -> None:
        async with self.pool.connection() as conn:
            await conn.execute(SOURCE_SQL)

    def loader(self, key: str):
        async def load():
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self.started.append((key, _caller.get()))
            try:
                await _parked(self.traffic)
                if key in self.gates:
                    await self.gates[key].wait()
                if key in self.failing:
                    raise SourceDown(f"database unavailable while loading {_item(key)}")
                async with self.pool.connection() as conn:
                    row = await (await conn.execute("SELECT load_value(%s, %s)", (key, _item(key)))).fetchone()
                return row[0]
            except asyncio.CancelledError:
                self.cancelled.append(key)
                raise
            finally:
                self.running -= 1

        return load

    async def queries(self, key: str | None = None) -> int:
        async with self.pool.connection() as conn:
            if key is None:
                row = await (await conn.execute("SELECT count(*) FROM source_loads")).fetchone()
            else:
                row = await (await conn.execute("SELECT count(*) FROM source_loads WHERE key = %s", (key,))).fetchone()
        return int(row[0])


# ----------------------------------------------------------------------------- get_cached


@task(
    "get_cached",
    points=6,
    title="cache-aside with single-flight and jittered TTLs",
    timeout=60,
    partial=True,
    seed=4004,
)
async def check_get_cached(r: Report, get_cached) -> None:
    run = next(_RUNS)
    async with lab.scratch("ch04") as ns:
        pool = await ns.pool(max_size=12)
        redis = _watched_redis(ns)
        try:
            with seeded_random(r):
                await _check_get_cached(r, get_cached, pool, redis, f"ch04:{run}")
        finally:
            await redis.aclose()


async def _check_get_cached(r: Report, get_cached, pool, redis, prefix: str) -> None:
    src = _Source(pool, redis.traffic)
    await src.setup()
    hot = f"{prefix}:hot"
    r.note(f"each load is one query that PostgreSQL logs; ttl={TTL:g} s")

    # 1. a stampede on a missing key ------------------------------------------------------
    got = await burst(50, lambda: get_cached(redis, hot, TTL, src.loader(hot)))
    errors = [x for x in got if isinstance(x, BaseException)]
    stubs = [x for x in errors if isinstance(x, NotImplementedError)]
    if stubs and len(stubs) == len(got):
        raise stubs[0]  # the answer is still the stub: the harness says "not done yet" in one line
    r.expect(
        not errors,
        "50 concurrent calls on an empty cache all returned",
        f"50 concurrent calls on an empty cache: {len(errors)} raised ({tally(errors, top=3)})",
    )
    queries = await src.queries(hot)
    r.expect(
        queries == 1,
        "50 concurrent calls on a missing key made 1 database query",
        f"50 concurrent calls on a missing key made {queries} database queries, expected exactly 1: "
        "concurrent callers of one key must share one load (single-flight)",
    )
    first = _value(hot, 1)
    r.expect(
        all(v == first for v in got),
        f"all 50 callers got {first}",
        f"the 50 callers got {tally(got, top=3)}, expected 50 x {first}",
    )
    if r.public:
        return

    raw = await redis.get(hot)
    stored = None
    with contextlib.suppress(TypeError, ValueError):
        stored = json.loads(raw)
    r.expect(
        stored == first,
        "Redis holds the value as JSON under the key",
        f"Redis holds {raw!r} under the key, expected the JSON of {first}",
    )
    pttl = redis.traffic.ttl_ms.get(hot) or await redis.pttl(hot)  # asked for, so real time does not shift it
    r.expect(
        pttl > 0,
        f"the key has a TTL ({pttl / 1000:.1f} s)",
        "the key has no TTL (PTTL -1): every key needs one, or a lost invalidation lives forever",
    )

    # 2. hits ------------------------------------------------------------------------------
    got = await burst(50, lambda: get_cached(redis, hot, TTL, src.loader(hot)))
    queries = await src.queries(hot)
    r.expect(
        queries == 1 and all(v == first for v in got),
        "50 more calls while the key is cached: no query, all got the cached value",
        f"50 more calls while the key is cached made {queries - 1} more queries and returned {tally(got, top=3)}, "
        + (
            "expected no query (read Redis first)"
            if queries != 1
            else f"expected {first!r}: a hit returns json.loads of what Redis holds (returned the raw string?)"
        ),
    )

    # 3. after expiry ----------------------------------------------------------------------
    await redis.delete(hot)
    r.note("the hot key expires (deleted), then 50 concurrent calls again")
    got = await burst(50, lambda: get_cached(redis, hot, TTL, src.loader(hot)))
    again = await src.queries(hot) - 1
    stuck = " (something outside Redis still holds the old value: a finished load left in the in-flight map?)"
    r.expect(
        again == 1,
        "after expiry: exactly 1 more query",
        f"after expiry the burst made {again} queries, expected exactly 1{stuck if again == 0 else ''}",
    )
    second = _value(hot, 2)
    r.expect(
        all(v == second for v in got),
        f"all 50 got the fresh value {second}",
        f"after expiry the callers got {tally(got, top=3)}, expected 50 x {second}",
    )

    # 4. a load that fails -------------------------------------------------------------------
    flaky = f"{prefix}:flaky"
    src.failing.add(flaky)
    got = await burst(20, lambda: get_cached(redis, flaky, TTL, src.loader(flaky)))
    saw = [x for x in got if isinstance(x, Exception)]
    r.expect(
        len(saw) == 20,
        "a failing load: all 20 waiting callers got the error",
        f"a failing load: {len(saw)} of 20 callers got an error; the others got "
        f"{tally([x for x in got if not isinstance(x, Exception)], top=3)} (every caller waiting on the load must see "
        "its error)",
    )
    failed_loads = sum(key == flaky for key, _ in src.started)
    r.expect(
        failed_loads == 1,
        "the 20 callers of the failing key shared its one load",
        f"a failing load: 20 callers of one key started {failed_loads} loads, expected 1: the waiters must get the "
        "shared load's error, not run loader() again themselves (after a failure, a retry in every waiter is a "
        "stampede on a database that is already failing)",
    )
    leftover = await redis.get(flaky)
    r.expect(
        leftover is None,
        "nothing was cached for the failed load",
        f"after the failed load Redis holds {leftover!r} under the key: an error must not be cached",
    )
    src.failing.discard(flaky)
    before = await src.queries(flaky)
    try:
        value = await get_cached(redis, flaky, TTL, src.loader(flaky))
    except Exception as err:  # noqa: BLE001 - learner code
        r.fail(
            f"the first call after the failed load raised {type(err).__name__}: {err}; it must load again "
            "(the failed in-flight entry was never removed, so one error poisons the key)"
        )
        return
    loaded = await src.queries(flaky) - before
    r.expect(
        loaded == 1 and value == _value(flaky, 1),
        "the next call after the failure loaded again and returned the value",
        f"the next call after the failure made {loaded} queries and returned {value!r}, expected 1 new load",
    )

    # 5. different keys in parallel ------------------------------------------------------------
    # ``random`` afresh from the seed: how many draws the steps above made depends on which callers
    # won their races, and the jitter of steps 5-6 (40 writes) must be the same draws on every run
    random.seed(r.random.getrandbits(64))
    keys = [f"{prefix}:k{i}" for i in range(10)]
    src.max_running = 0
    got = await asyncio.gather(
        *(get_cached(redis, k, TTL, src.loader(k)) for k in keys for _ in range(5)), return_exceptions=True
    )
    per_key = [await src.queries(k) for k in keys]
    r.expect(
        per_key == [1] * 10,
        "10 keys x 5 concurrent callers: one query per key",
        # most first: which key won a shared load depends on timing
        f"10 keys x 5 concurrent callers: queries per key, most first, {sorted(per_key, reverse=True)}; "
        "expected 1 each"
        + (
            " (one load shared by different keys: is the map of loads in flight keyed by the key?)"
            if sum(per_key) < 10
            else ""
        ),
    )
    r.expect(
        src.max_running == 10,
        "the 10 loads ran at the same time (10 in flight at once)",
        f"at most {src.max_running} of the 10 loads were in flight at once: different keys waited on each other "
        "(one lock for all keys?); keys must not block each other",
    )
    expected = [_value(k, 1) for k in keys for _ in range(5)]
    r.expect(
        got == expected,
        "each caller got its own key's value",
        f"callers got {tally(got, top=3)}; expected each key's own value",
    )

    # 6. jittered TTLs ----------------------------------------------------------------------------
    more = [f"{prefix}:j{i}" for i in range(30)]
    await asyncio.gather(*(get_cached(redis, k, TTL, src.loader(k)) for k in more))
    # the TTL each SET asked for (PTTL only for a key set some other way): real time passing between
    # the writes and this read must not move a TTL below ttl
    ttls = [redis.traffic.ttl_ms.get(k) or await redis.pttl(k) for k in keys + more]
    r.expect(
        min(ttls) > 0,
        "all 40 keys written have a TTL",
        f"{sum(t < 0 for t in ttls)} of 40 keys have no TTL (PTTL {min(ttls)})",
    )
    low, high = min(ttls) / 1000, max(ttls) / 1000
    r.expect(
        low >= TTL - 0.001 and high <= 1.2 * TTL + 0.001,
        f"TTLs lie within [{TTL:g}, {1.2 * TTL:g}] s",
        f"TTLs range from {low:.1f} s to {high:.1f} s with ttl={TTL:g}; expected between ttl and 1.2 x ttl"
        + (" (ex= takes whole seconds: int() of a float rounds down)" if low < TTL and low == int(low) else ""),
    )
    r.expect(
        high - low >= 0.05 * TTL,
        f"40 keys written together spread their TTLs over more than {0.05 * TTL:g} s (jittered)",
        f"40 keys written together expire within {high - low:.1f} s of each other (TTL {low:.1f}-{high:.1f} s): "
        f"add jitter up to 20% of ttl ({0.2 * TTL:g} s) so keys written together do not expire together",
    )

    # 7. a cancelled caller (2 of the 6 points) -------------------------------------------------
    r.fraction = 4 / 6  # everything above holds; what follows decides the last two points
    await _check_cancelled_caller(r, get_cached, redis, src, f"{prefix}:slow")


async def _check_cancelled_caller(r: Report, get_cached, redis, src: _Source, slow: str) -> None:
    src.gates[slow] = gate = asyncio.Event()

    async def caller(i: int):
        _caller.set(i)
        return await get_cached(redis, slow, TTL, src.loader(slow))

    r.note("10 concurrent calls on a missing key; while the load runs, 2 callers are cancelled")
    r.note("(their clients hung up or their deadlines passed), including the one whose call started the load;")
    r.note("then one more caller arrives while the load still runs")
    tasks = [asyncio.ensure_future(caller(i)) for i in range(10)]
    await _parked(redis.traffic)
    starters = [who for key, who in src.started if key == slow]
    leader = starters[0] if starters and starters[0] is not None else 0
    cancelled = {leader, (leader + 5) % 10}
    for i in cancelled:
        tasks[i].cancel()
    await _parked(redis.traffic)
    # one more caller arrives after the cancellations, while the load still runs: it must join it
    tasks.append(asyncio.ensure_future(caller(LATE)))
    await _parked(redis.traffic)
    gate.set()
    got = await asyncio.gather(*tasks, return_exceptions=True)
    others = [x for i, x in enumerate(got) if i not in cancelled]
    loads = sum(key == slow for key, _ in src.started)
    load_cancelled = slow in src.cancelled  # else every load ran to its end: a second one found no entry to join
    queries = await src.queries(slow)
    expected = _value(slow, max(1, queries))
    raw = await redis.get(slow)
    cached = None
    with contextlib.suppress(TypeError, ValueError):
        cached = json.loads(raw) if raw is not None else None
    cancelled_too = sum(isinstance(x, asyncio.CancelledError) for x in others)
    if all(x == expected for x in others) and loads == 1 and cached == expected:
        r.ok(
            "the 8 other callers and the late one got the value of the one shared load, which ran to the end and "
            "filled the cache"
        )
        r.fraction = 1.0
    elif cancelled_too:
        r.fail(
            f"cancelling 2 callers cancelled the shared load too: {cancelled_too} of the 9 others got CancelledError. "
            "A cancelled caller must leave the shared load running: a waiter that awaits the task directly cancels "
            "it along with itself (await asyncio.shield(task) instead), and no caller may cancel it itself (-2 points)",
            stop=False,
        )
    elif loads > 1 and not load_cancelled:
        r.fail(
            f"a caller that arrived after 2 callers were cancelled, while the shared load still ran, started a second "
            f"load ({loads} loads for one key): the in-flight entry was gone before the load ended. Remove it when "
            "the load ends (in the load's own finally), not when a caller stops waiting (-2 points)",
            stop=False,
        )
    elif loads > 1 and not any(x is None for x in others):
        r.fail(
            f"the load was cancelled with the caller that ran it and started again: {loads} loads for one key. Run the "
            "load as a task of its own and have every caller await it through asyncio.shield, so a cancelled caller "
            "leaves it running for the others (-2 points)",
            stop=False,
        )
    else:
        r.fail(
            f"after 2 callers were cancelled, the 8 others and the late one got {tally(others, top=3)} and Redis holds {raw!r}; "
            f"expected 9 x {expected} and the value cached: the shared load must run to the end (-2 points)",
            stop=False,
        )


# ----------------------------------------------------------------------------- get_user_cached

MISS_TTL_LIMIT = 60.0
MISS_TTL_FLOOR = 1.0  # seconds: a miss cached for milliseconds stops no repeated lookup
HOLD_MISS_MS = 600_000  # how long the check keeps the miss while it looks it up (its own PEXPIRE)
USER_TTL_FLOOR = 10.0  # seconds: "about USER_TTL seconds", not milliseconds


@task(
    "get_user_cached",
    points=4,
    title="users through the cache, with negative caching",
    timeout=60,
    seed=4041,
)
async def check_get_user_cached(r: Report, get_user_cached) -> None:
    async with lab.scratch("ch04") as ns:
        pool = await ns.pool(max_size=10)
        redis = _watched_redis(ns)
        try:
            await setup_users(pool, n=50)
            with seeded_random(r):
                await _check_get_user_cached(r, get_user_cached, pool, redis)
        finally:
            await redis.aclose()


def _user(i: int) -> dict:
    return {"id": i, "name": f"user {i}", "email": f"user{i}@example.com"}


async def _check_get_user_cached(r: Report, get_user_cached, pool, redis) -> None:
    r.note("users 1..50 exist; PostgreSQL counts every query on the users view")
    before = set(await redis.keys("*"))
    user = await get_user_cached(redis, pool, 7)
    r.expect(
        user == _user(7),
        f"get_user_cached(7) returned {user!r}",
        f"get_user_cached(7) returned {user!r}, expected {_user(7)}",
    )
    user_keys = set(await redis.keys("*")) - before
    missing = await get_user_cached(redis, pool, 4242)
    r.expect(
        missing is None,
        "get_user_cached(4242), a missing id, returned None",
        f"get_user_cached(4242), a missing id, returned {missing!r}, expected None",
    )
    if r.public:
        return

    # the TTL the user's SET asked for, before any lookup a TTL of milliseconds would turn back into a query
    short = [t for t in (redis.traffic.ttl_ms.get(k) for k in user_keys) if t is not None and t < USER_TTL_FLOOR * 1000]
    r.expect(
        not short,
        f"the user is cached for at least {USER_TTL_FLOOR:g} s",
        f"the user is cached for {min(short or [0]) / 1000:g} s: cache users for about USER_TTL seconds, at least "
        f"{USER_TTL_FLOOR:g} s (px= takes milliseconds: px=USER_TTL caches for USER_TTL ms)",
    )
    q1 = await user_queries(pool)
    got = [await get_user_cached(redis, pool, 7) for _ in range(20)]
    q2 = await user_queries(pool)
    r.expect(
        q2 == q1 and all(g == _user(7) for g in got),
        "20 more lookups of user 7: no query, the cached user",
        f"20 more lookups of user 7 made {q2 - q1} queries and returned {tally(got, top=3)}, expected no query "
        "(cache existing users)",
    )
    r.expect(bool(user_keys), "looking up user 7 wrote a key to Redis", "looking up user 7 wrote nothing to Redis")
    as_json = []
    for k in sorted(user_keys):
        with contextlib.suppress(Exception):  # a hash or a list under the key: WRONGTYPE
            as_json.append(json.loads(await redis.get(k)))
    r.expect(
        _user(7) in as_json,
        "Redis holds user 7 as JSON",
        f"none of the keys looking up user 7 wrote ({', '.join(sorted(user_keys)) or 'none'}) holds the user as a "
        "JSON string: cache users in Redis as JSON (SET key json.dumps(user)), not as a hash or another encoding",
    )
    # the TTLs the SETs asked for: PTTL shrinks with real time, and the lines must read the same every run
    user_ttls = [redis.traffic.ttl_ms.get(k) or await redis.pttl(k) for k in user_keys]
    r.expect(
        min(user_ttls) > 0,
        f"the user's key has a TTL ({min(user_ttls) / 1000:.0f} s)",
        "the user's key has no TTL (PTTL -1): every key needs one",
    )

    # a missing id, looked up 100 times ----------------------------------------------------
    absent = 4343
    before = set(await redis.keys("*"))
    q_start = await user_queries(pool)
    first = await get_user_cached(redis, pool, absent)
    q_first = await user_queries(pool) - q_start
    miss_keys = set(await redis.keys("*")) - before
    # the TTLs the miss asked for, read now; then the check holds the miss past the real seconds the next
    # 120 lookups take (a 5 s miss expired mid-check on a loaded machine, and a correct answer lost a point).
    # Not through the watched client: the answer's own TTL writes stay the only ones counted.
    miss_ttls = [redis.traffic.ttl_ms.get(k) or await redis.pttl(k) for k in miss_keys]
    plain = aioredis.Redis(connection_pool=redis.connection_pool)
    for k in miss_keys:
        if await plain.pttl(k) > 0:
            await plain.pexpire(k, HOLD_MISS_MS)
    early = [redis.traffic.ttl_ms.get(k) for k in miss_keys]
    short = [t for t in early if t is not None and 0 < t < MISS_TTL_FLOOR * 1000]
    r.expect(
        not short,
        f"the miss is cached for at least {MISS_TTL_FLOOR:g} s",
        f"the miss is cached for {min(short or [0]) / 1000:g} s: keep it between {MISS_TTL_FLOOR:g} and "
        f"{MISS_TTL_LIMIT:g} s (px= takes milliseconds: px=MISS_TTL caches for MISS_TTL ms)",
    )
    ttl_writes = {k: redis.traffic.ttl_writes.get(k, 0) for k in miss_keys}
    rest = [await get_user_cached(redis, pool, absent) for _ in range(99)]
    pushed = {k: redis.traffic.ttl_writes.get(k, 0) - n for k, n in ttl_writes.items()}
    total = await user_queries(pool) - q_start
    answers = [first, *rest]
    r.expect(
        all(x is None for x in answers),
        "100 lookups of missing id 4343 all returned None",
        f"100 lookups of missing id 4343 returned {tally(answers, top=3)}, expected None",
    )
    truthiness = " - an empty string or 'null' read back from Redis is a hit: test `is None`, not truthiness"
    r.expect(
        total == q_first,
        f"100 lookups of a missing id made {total} database quer{'y' if total == 1 else 'ies'} (the first lookup only)",
        f"100 lookups of a missing id made {total} database queries, expected {q_first} (the first lookup only): "
        f"cache the miss too (negative caching){truthiness if miss_keys else ''}",
    )
    r.expect(
        bool(miss_keys),
        "the miss was cached in Redis",
        "no new key appeared in Redis after the first lookup of missing id 4343: is the miss kept in process memory "
        "(not shared, never invalidated), or in a key that already existed, such as one set for every miss whose "
        "TTL each new miss pushes back?",
    )
    worst = max(miss_ttls or [-1])
    r.expect(
        min(miss_ttls or [-1]) > 0,
        f"the cached miss expires ({worst / 1000:.0f} s)",
        "the cached miss has no TTL (PTTL -1): a user created later would stay 'missing' forever",
    )
    r.expect(
        worst <= MISS_TTL_LIMIT * 1000,
        f"the miss's TTL is short ({worst / 1000:.0f} s <= {MISS_TTL_LIMIT:g} s)",
        f"the miss is cached for {worst / 1000:.0f} s; keep misses short (at most {MISS_TTL_LIMIT:g} s)",
    )
    r.expect(
        not any(pushed.values()),
        "the 99 lookups that hit the cached miss left its TTL alone",
        f"the 99 lookups that hit the cached miss set its TTL again {sum(pushed.values())} times (a sliding expiry): "
        "a missing id that keeps being asked for stays cached as missing for as long as it is asked for, and a user "
        "created meanwhile never shows up; set the miss's TTL once, when the miss is cached",
    )
    r.expect(
        worst < min(user_ttls),
        "a miss is kept for less time than a user",
        f"a miss is kept {worst / 1000:.0f} s, a user {min(user_ttls) / 1000:.0f} s: misses should expire sooner",
    )

    q_before = await user_queries(pool)
    got = await asyncio.gather(*(get_user_cached(redis, pool, absent) for _ in range(20)), return_exceptions=True)
    extra = await user_queries(pool) - q_before
    r.expect(
        extra == 0 and all(x is None for x in got),
        "20 concurrent lookups of the cached miss: no query, all None",
        f"20 concurrent lookups of the cached miss made {extra} queries and returned {tally(got, top=3)}",
    )

    # the miss expires and the user now exists -----------------------------------------------
    await add_user(pool, absent, "late user", "late@example.com")
    if miss_keys:
        await redis.delete(*miss_keys)
    r.note("user 4343 is created and the cached miss expires (deleted)")
    late = await get_user_cached(redis, pool, absent)
    expected = {"id": absent, "name": "late user", "email": "late@example.com"}
    r.expect(
        late == expected,
        "the next lookup finds the new user",
        f"after the cached miss expired the lookup returned {late!r}, expected {expected} "
        "(is a miss remembered outside Redis?)",
    )


from autograder.checks.ch04.rules import REFERENCES, RULES  # noqa: E402 - the rule tables, kept beside the checks

__all__ = ["REFERENCES", "RULES"]
