"""Chapter 04's checks reject the caches learners plausibly write wrong and accept the right ones."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import (
    assert_accepted,
    assert_rejected,
    correct_params,
    notebook_with_answers,
    solution_source,
    wrong_params,
)

# ============================================================================ get_cached: right

FUTURES = """
import asyncio, json, random

_inflight = {}

async def get_cached(redis, key, ttl, loader):
    cached = await redis.get(key)
    if cached is not None:
        return json.loads(cached)
    pending = _inflight.get(key)
    if pending is None:
        async def load():
            try:
                value = await loader()
                await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
                return value
            finally:
                _inflight.pop(key, None)
        pending = _inflight[key] = asyncio.ensure_future(load())
    return await asyncio.shield(pending)  # a cancelled caller must not cancel the load the others share
"""

FUTURE_SET_BY_A_TASK = """
import asyncio, json, random

_waiting = {}

async def _load(redis, key, ttl, loader, fut):
    try:
        value = await loader()
        await redis.set(key, json.dumps(value), px=int(ttl * 1000 * (1 + 0.2 * random.random())))
        fut.set_result(value)
    except Exception as err:
        fut.set_exception(err)
    finally:
        del _waiting[key]

async def get_cached(redis, key, ttl, loader):
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    fut = _waiting.get(key)
    if fut is None:
        fut = _waiting[key] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        asyncio.get_running_loop().create_task(_load(redis, key, ttl, loader, fut))
    return await asyncio.shield(fut)
"""

WAIT_INSTEAD_OF_SHIELD = """
import asyncio, json, random

_inflight = {}

async def get_cached(redis, key, ttl, loader):
    cached = await redis.get(key)
    if cached is not None:
        return json.loads(cached)
    task = _inflight.get(key)
    if task is None:
        async def load():
            try:
                value = await loader()
                await redis.set(key, json.dumps(value), ex=int(ttl * random.uniform(1.0, 1.2)))
                return value
            finally:
                _inflight.pop(key, None)
        task = _inflight[key] = asyncio.create_task(load())
    await asyncio.wait([task])   # cancelling this wait cancels the waiter only, not the task
    return task.result()
"""

# ============================================================================ get_cached: right until a caller is
# cancelled (a client hangs up, a deadline passes while the load runs): they keep 4 of the 6 points

LOCK_PER_KEY = """
import asyncio, json, random
from collections import defaultdict

_locks = defaultdict(asyncio.Lock)

async def get_cached(redis, key, ttl, loader):
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    async with _locks[key]:
        raw = await redis.get(key)          # double-check: the holder before us may have filled it
        if raw is not None:
            return json.loads(raw)
        value = await loader()
        await redis.set(key, json.dumps(value), ex=int(ttl + random.uniform(0, 0.2 * ttl)))
        return value
"""

EVENTS = """
import asyncio, json, random

class _Call:
    def __init__(self):
        self.done = asyncio.Event()
        self.value = None
        self.error = None

_calls = {}

async def get_cached(redis, key, ttl, loader):
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    call = _calls.get(key)
    if call is not None:
        await call.done.wait()
        if call.error is not None:
            raise call.error
        return call.value
    call = _calls[key] = _Call()
    try:
        call.value = await loader()
        await redis.set(key, json.dumps(call.value), px=int(ttl * 1000 * (1 + 0.2 * random.random())))
        return call.value
    except Exception as err:
        call.error = err
        raise
    finally:
        del _calls[key]
        call.done.set()
"""

# ============================================================================ get_cached: wrong

NO_SINGLE_FLIGHT = """
import json, random

async def get_cached(redis, key, ttl, loader):
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    value = await loader()
    await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
    return value
"""

ONE_GLOBAL_LOCK = """
import asyncio, json, random

_lock = asyncio.Lock()

async def get_cached(redis, key, ttl, loader):
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    async with _lock:
        raw = await redis.get(key)
        if raw is not None:
            return json.loads(raw)
        value = await loader()
        await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
        return value
"""

ENTRY_NEVER_REMOVED = """
import asyncio, json, random

_inflight = {}

async def get_cached(redis, key, ttl, loader):
    cached = await redis.get(key)
    if cached is not None:
        return json.loads(cached)
    if key not in _inflight:
        async def load():
            value = await loader()
            await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
            return value
        _inflight[key] = asyncio.ensure_future(load())
    return await _inflight[key]
"""

REMOVED_ONLY_ON_SUCCESS = """
import asyncio, json, random

_inflight = {}

async def get_cached(redis, key, ttl, loader):
    cached = await redis.get(key)
    if cached is not None:
        return json.loads(cached)
    if key not in _inflight:
        async def load():
            value = await loader()
            await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
            del _inflight[key]
            return value
        _inflight[key] = asyncio.ensure_future(load())
    return await _inflight[key]
"""

ERROR_CACHED_AS_VALUE = """
import asyncio, json, random

_inflight = {}

async def get_cached(redis, key, ttl, loader):
    cached = await redis.get(key)
    if cached is not None:
        return json.loads(cached)
    if key not in _inflight:
        async def load():
            try:
                try:
                    value = await loader()
                except Exception as err:
                    value = {"error": str(err)}
                await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
                return value
            finally:
                _inflight.pop(key, None)
        _inflight[key] = asyncio.ensure_future(load())
    return await _inflight[key]
"""

WAITERS_GET_NONE_ON_ERROR = """
import asyncio, json, random

_inflight = {}

async def get_cached(redis, key, ttl, loader):
    cached = await redis.get(key)
    if cached is not None:
        return json.loads(cached)
    if key in _inflight:
        await _inflight[key].wait()
        raw = await redis.get(key)
        return None if raw is None else json.loads(raw)
    _inflight[key] = asyncio.Event()
    try:
        value = await loader()
        await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
        return value
    finally:
        _inflight.pop(key).set()
"""

# The model answer this chapter used to have: right until a waiter is cancelled.
NOT_SHIELDED = FUTURES.replace("return await asyncio.shield(pending)", "return await pending")

NO_JITTER = FUTURES.replace("int(ttl * 1000 * random.uniform(1.0, 1.2))", "int(ttl * 1000)")
JITTER_200_MS = FUTURES.replace(
    "int(ttl * 1000 * random.uniform(1.0, 1.2))", "int(ttl * 1000) + random.randint(0, 200)"
)
NO_TTL = FUTURES.replace(", px=int(ttl * 1000 * random.uniform(1.0, 1.2))", "")
JITTER_BELOW_TTL = FUTURES.replace("random.uniform(1.0, 1.2)", "random.uniform(0.5, 1.0)")
IN_PROCESS_MEMO = """
import asyncio, json, random

_local = {}      # "a local cache in front of Redis": no bound, no TTL, never invalidated
_inflight = {}

async def get_cached(redis, key, ttl, loader):
    if key in _local:
        return _local[key]
    cached = await redis.get(key)
    if cached is not None:
        return json.loads(cached)
    pending = _inflight.get(key)
    if pending is None:
        async def load():
            try:
                value = await loader()
                await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
                _local[key] = value
                return value
            finally:
                _inflight.pop(key, None)
        pending = _inflight[key] = asyncio.ensure_future(load())
    return await pending
"""


RAW_STRING_ON_A_HIT = FUTURES.replace(
    "        return json.loads(cached)\n", "        return cached  # already a string\n"
)

INT_SECONDS_TRUNCATED = FUTURES.replace(
    "px=int(ttl * 1000 * random.uniform(1.0, 1.2))", "ex=int(ttl * random.uniform(1.0, 1.2))"
)

GLOBAL_LOAD_NOT_PER_KEY = (
    FUTURES.replace("_inflight.get(key)", '_inflight.get("load")')
    .replace("_inflight[key] = ", '_inflight["load"] = ')
    .replace("_inflight.pop(key, None)", '_inflight.pop("load", None)')
)

USER_ROW_AS_A_TUPLE = """
import json

async def get_user_cached(redis, pool, user_id):
    key = f"user:{user_id}"
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    await redis.set(key, json.dumps(row), ex=30 if row is None else 300)
    return row
"""

USER_MISS_CACHED_IN_ANOTHER_KEY_FOREVER_CHECKED_FIRST = """
import json

async def get_user_cached(redis, pool, user_id):
    if await redis.sismember("missing_users", user_id):   # "one set for every miss"
        return None
    raw = await redis.get(f"user:{user_id}")
    if raw is not None:
        return json.loads(raw)
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    if row is None:
        await redis.sadd("missing_users", user_id)
        await redis.expire("missing_users", 30)
        return None
    user = {"id": row[0], "name": row[1], "email": row[2]}
    await redis.set(f"user:{user_id}", json.dumps(user), ex=300)
    return user
"""


def test_the_same_answer_passes_twice_in_one_process():
    # selfcheck and the hidden test run the check twice in one kernel, on new event loops
    assert_accepted("get_cached", FUTURES)
    assert_accepted("get_cached", FUTURES)


def test_a_shared_load_that_a_cancelled_waiter_cancels_loses_two_points():
    res = assert_rejected("get_cached", NOT_SHIELDED, mentions="asyncio.shield")
    assert res.points == 4 and "got CancelledError" in res.text()


def test_a_lock_per_key_loads_again_in_every_waiter_when_the_load_fails():
    # each waiter takes the lock in turn and calls loader() itself: 20 loads on a failing database
    assert_rejected("get_cached", LOCK_PER_KEY, mentions="started 20 loads")


def test_a_load_run_by_its_caller_restarts_when_that_caller_is_cancelled():
    res = assert_rejected("get_cached", HANDED_OVER_ON_CANCEL, mentions="2 loads for one key")
    assert res.points == 4


def test_an_entry_removed_by_each_caller_lets_a_late_caller_start_a_second_load():
    res = assert_rejected("get_cached", ENTRY_REMOVED_BY_EACH_CALLER, mentions="started a second load")
    assert res.points == 4


def test_an_event_per_key_hands_none_to_waiters_when_the_loading_caller_is_cancelled():
    res = assert_rejected("get_cached", EVENTS, mentions="the shared load must run to the end")
    assert res.points == 4


# ============================================================================ get_user_cached

USER_NULL_MARKER = """
import json, random

async def get_user_cached(redis, pool, user_id):
    key = f"user:{user_id}"
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)                      # "null" decodes to None: a cached miss
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    user = None if row is None else {"id": row[0], "name": row[1], "email": row[2]}
    ttl = 30 if user is None else 300 * (1 + 0.2 * random.random())
    await redis.set(key, json.dumps(user), px=int(ttl * 1000))
    return user
"""

USER_SENTINEL = """
import json
from psycopg.rows import dict_row

MISSING = "__missing__"

async def get_user_cached(redis, pool, user_id):
    key = f"users:{user_id}"
    raw = await redis.get(key)
    if raw == MISSING:
        return None
    if raw is not None:
        return json.loads(raw)
    async with pool.connection() as conn:
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute("SELECT * FROM users WHERE id = %s", (user_id,))
        user = await cur.fetchone()
    if user is None:
        await redis.set(key, MISSING, ex=15)
        return None
    await redis.set(key, json.dumps(user), ex=600)
    return user
"""


def _user_variant(miss_line: str, *, read: str = "if raw is not None:", hit_ttl: str = "ex=300") -> str:
    return f"""
import json

async def get_user_cached(redis, pool, user_id):
    key = f"user:{{user_id}}"
    raw = await redis.get(key)
    {read}
        return json.loads(raw) if raw not in ("", "null") else None
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    if row is None:
        {miss_line}
        return None
    user = {{"id": row[0], "name": row[1], "email": row[2]}}
    await redis.set(key, json.dumps(user), {hit_ttl})
    return user
"""


USER_NO_NEGATIVE_CACHE = _user_variant("pass")
USER_MISS_WITHOUT_TTL = _user_variant('await redis.set(key, "null")')
USER_MISS_AS_LONG_AS_A_HIT = _user_variant('await redis.set(key, "null", ex=300)')
USER_EMPTY_STRING_AND_TRUTHINESS = _user_variant('await redis.set(key, "", ex=30)', read="if raw:")
USER_HIT_WITHOUT_TTL = _user_variant('await redis.set(key, "null", ex=30)', hit_ttl="")
USER_MISS_IN_PROCESS_SET = """
import json

_missing = set()

async def get_user_cached(redis, pool, user_id):
    if user_id in _missing:
        return None
    raw = await redis.get(f"user:{user_id}")
    if raw is not None:
        return json.loads(raw)
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    if row is None:
        _missing.add(user_id)
        return None
    user = {"id": row[0], "name": row[1], "email": row[2]}
    await redis.set(f"user:{user_id}", json.dumps(user), ex=300)
    return user
"""


# ============================================================================ get_cached: found by audit B

HANDED_OVER_ON_CANCEL = """
import asyncio, json, random


class _Retry(Exception):
    pass  # the caller running the load was cancelled: a waiter takes over


_calls = {}


async def get_cached(redis, key, ttl, loader):
    while True:
        raw = await redis.get(key)
        if raw is not None:
            return json.loads(raw)
        fut = _calls.get(key)
        if fut is not None:
            try:
                return await asyncio.shield(fut)
            except _Retry:
                continue
        fut = _calls[key] = asyncio.get_running_loop().create_future()
        try:
            value = await loader()  # run by this caller itself: it dies with it
            await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
        except asyncio.CancelledError:
            fut.set_exception(_Retry())
            raise
        except Exception as err:
            fut.set_exception(err)
            raise
        else:
            fut.set_result(value)
            return value
        finally:
            _calls.pop(key, None)
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                pass  # retrieved: no "exception never retrieved" warning
"""

ENTRY_REMOVED_BY_EACH_CALLER = """
import asyncio, json, random

_inflight = {}

async def get_cached(redis, key, ttl, loader):
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    task = _inflight.get(key)
    if task is None:
        async def load():
            value = await loader()
            await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
            return value
        task = _inflight[key] = asyncio.create_task(load())
    try:
        return await asyncio.shield(task)
    finally:
        _inflight.pop(key, None)
"""

WAITERS_LOAD_AGAIN_AFTER_A_FAILURE = """
import asyncio, json, random

_inflight = {}

async def _load(redis, key, ttl, loader):
    try:
        value = await loader()
        await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
        return value
    finally:
        _inflight.pop(key, None)

async def get_cached(redis, key, ttl, loader):
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    task = _inflight.get(key)
    if task is None:
        task = _inflight[key] = asyncio.create_task(_load(redis, key, ttl, loader))
        return await asyncio.shield(task)
    try:
        return await asyncio.shield(task)
    except Exception:
        return await loader()   # the shared load failed: try ourselves
"""

FUTURE_SET_BY_ITS_OWN_TASK_TYPED = """
from __future__ import annotations

import asyncio
import json
import random
from typing import Any, Awaitable, Callable

_loads: dict[str, asyncio.Future] = {}


def _ttl_ms(ttl: float) -> int:
    return int(random.uniform(ttl, ttl * 1.2) * 1000)


async def _fill(redis, key: str, ttl: float, loader: Callable[[], Awaitable[Any]], fut: asyncio.Future) -> None:
    try:
        value = await loader()
    except BaseException as exc:  # noqa: BLE001
        fut.set_exception(exc)
        _loads.pop(key, None)
        return
    try:
        await redis.set(key, json.dumps(value), px=_ttl_ms(ttl))
        fut.set_result(value)
    except Exception as exc:
        fut.set_exception(exc)
    finally:
        _loads.pop(key, None)


async def get_cached(redis, key: str, ttl: float, loader) -> Any:
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    fut = _loads.get(key)
    if fut is None:
        fut = _loads[key] = asyncio.get_running_loop().create_future()
        asyncio.create_task(_fill(redis, key, ttl, loader, fut))
    return await asyncio.shield(fut)
"""

SET_THEN_PEXPIRE_IN_A_PIPELINE = """
import asyncio, json, random

inflight = {}

async def get_cached(redis, key, ttl, loader):
    v = await redis.get(key)
    if v is not None:
        return json.loads(v)
    if key in inflight:
        return await asyncio.shield(inflight[key])
    async def run():
        try:
            value = await loader()
            ms = int(1000 * ttl * (1 + 0.2 * random.random()))
            async with redis.pipeline(transaction=True) as p:
                p.set(key, json.dumps(value))
                p.pexpire(key, ms)
                await p.execute()
            return value
        finally:
            inflight.pop(key)
    t = inflight[key] = asyncio.get_running_loop().create_task(run())
    return await asyncio.shield(t)
"""

SET_THEN_PEXPIRE_TWO_CALLS = """
import asyncio, json, random

_inflight = {}

async def get_cached(redis, key, ttl, loader):
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    task = _inflight.get(key)
    if task is None:
        async def load():
            try:
                value = await loader()
                await redis.set(key, json.dumps(value))
                await redis.pexpire(key, int(ttl * random.uniform(1.0, 1.2) * 1000))
                return value
            finally:
                _inflight.pop(key, None)
        task = _inflight[key] = asyncio.create_task(load())
    return await asyncio.shield(task)
"""

RECHECK_INSIDE_THE_LOAD = """
import asyncio
import json
import random

_tasks = {}


async def _load(redis, key, ttl, loader):
    try:
        # someone may have filled it since our GET
        again = await redis.get(key)
        if again is not None:
            return json.loads(again)
        value = await loader()
        jittered = ttl + random.uniform(0, ttl / 5)
        await redis.set(key, json.dumps(value), px=int(jittered * 1000))
        return value
    finally:
        _tasks.pop(key, None)


async def get_cached(redis, key, ttl, loader):
    got = await redis.get(key)
    if got is not None:
        return json.loads(got)
    if key not in _tasks:
        _tasks[key] = asyncio.create_task(_load(redis, key, ttl, loader))
    return await asyncio.shield(_tasks[key])
"""

USER_AS_A_HASH = """
USER_TTL = 300
MISS_TTL = 30
async def get_user_cached(redis, pool, user_id):
    key = f"user:{user_id}"
    h = await redis.hgetall(key)
    if h:
        if h.get("missing"):
            return None
        return {"id": int(h["id"]), "name": h["name"], "email": h["email"]}
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    if row is None:
        await redis.hset(key, mapping={"missing": "1"})
        await redis.expire(key, MISS_TTL)
        return None
    await redis.hset(key, mapping={"id": row[0], "name": row[1], "email": row[2]})
    await redis.expire(key, USER_TTL)
    return {"id": row[0], "name": row[1], "email": row[2]}
"""

USER_SLIDING_EXPIRY_ON_MISSES = """
import json
USER_TTL = 300
MISS_TTL = 30
async def get_user_cached(redis, pool, user_id):
    key = f"user:{user_id}"
    cached = await redis.getex(key, ex=MISS_TTL) if False else await redis.get(key)
    if cached is not None:
        if cached == "null":
            await redis.expire(key, MISS_TTL)  # keep hot misses cached: sliding expiry
        return json.loads(cached)
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    user = None if row is None else {"id": row[0], "name": row[1], "email": row[2]}
    await redis.set(key, json.dumps(user), ex=MISS_TTL if user is None else USER_TTL)
    return user
"""

USER_DICT_ROW_CURSOR = """
import json
from psycopg.rows import dict_row

USER_TTL = 600
MISS_TTL = 45

async def get_user_cached(redis, pool, user_id):
    key = f"users:v1:{user_id}"
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    async with pool.connection() as conn:
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute("SELECT u.id, u.name, u.email FROM users AS u WHERE u.id = %(id)s", {"id": user_id})
            user = await cur.fetchone()
    await redis.set(key, json.dumps(user), ex=MISS_TTL if user is None else USER_TTL)
    return user
"""

USER_SEPARATE_MISS_KEY = """
import json

USER_TTL = 300
MISS_TTL = 60

async def get_user_cached(redis, pool, user_id):
    hit = await redis.get(f"user:{user_id}")
    if hit is not None:
        return json.loads(hit)
    if await redis.get(f"user-miss:{user_id}") is not None:
        return None
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    if row is None:
        await redis.set(f"user-miss:{user_id}", "1", ex=MISS_TTL)
        return None
    user = {"id": row[0], "name": row[1], "email": row[2]}
    await redis.set(f"user:{user_id}", json.dumps(user), ex=USER_TTL)
    return user
"""

USER_SET_THEN_EXPIRE_PIPELINE = """
import json

USER_TTL = 120
MISS_TTL = 5

async def get_user_cached(redis, pool, user_id):
    key = f"user:{user_id}"
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    user = row and {"id": row[0], "name": row[1], "email": row[2]}
    async with redis.pipeline(transaction=True) as p:
        p.set(key, json.dumps(user))
        p.expire(key, USER_TTL if user else MISS_TTL)
        await p.execute()
    return user
"""


ONE_LOCK_AROUND_EVERY_LOAD = """
import asyncio, json, random

_db_lock = asyncio.Lock()  # "protect the database": one load at a time
_inflight = {}

async def get_cached(redis, key, ttl, loader):
    raw = await redis.get(key)
    if raw is not None:
        return json.loads(raw)
    task = _inflight.get(key)
    if task is None:
        async def load():
            try:
                async with _db_lock:
                    value = await loader()
                    await redis.set(key, json.dumps(value), px=int(ttl * 1000 * random.uniform(1.0, 1.2)))
                    return value
            finally:
                _inflight.pop(key, None)
        task = _inflight[key] = asyncio.ensure_future(load())
    return await asyncio.shield(task)
"""

USER_TTL_IN_MILLISECONDS = """
import json
USER_TTL = 300
MISS_TTL = 30
async def get_user_cached(redis, pool, user_id):
    key = f"user:{user_id}"
    cached = await redis.get(key)
    if cached is not None:
        return json.loads(cached)
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT id, name, email FROM users WHERE id = %s", (user_id,))).fetchone()
    user = None if row is None else {"id": row[0], "name": row[1], "email": row[2]}
    await redis.set(key, json.dumps(user), px=MISS_TTL if user is None else USER_TTL)  # oops: ms
    return user
"""


# ============================================================================ the whole notebook


WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "get_cached": {
        "no single-flight": (NO_SINGLE_FLIGHT, "made 50 database queries"),
        "one lock for all keys": (ONE_LOCK_AROUND_EVERY_LOAD, "different keys waited on each other"),
        "one lock for all keys, each waiter loading": (ONE_GLOBAL_LOCK, "started 20 loads"),
        "one load shared by every key": (GLOBAL_LOAD_NOT_PER_KEY, "keyed by the key"),
        "in-flight entry never removed": (ENTRY_NEVER_REMOVED, "after expiry the burst made 0 queries"),
        "entry removed only on success": (REMOVED_ONLY_ON_SUCCESS, "poisons the key"),
        "loader error cached as a value": (ERROR_CACHED_AS_VALUE, "0 of 20 callers got an error"),
        "waiters get None after a failed load": (WAITERS_GET_NONE_ON_ERROR, "must see its error"),
        "a hit returns the raw string": (RAW_STRING_ON_A_HIT, "returns json.loads"),
        "no TTL jitter": (NO_JITTER, "add jitter"),
        "200 ms of jitter on a minute": (JITTER_200_MS, "add jitter"),
        "no TTL at all": (NO_TTL, "no TTL"),
        "TTL below the requested one": (JITTER_BELOW_TTL, "between ttl and 1.2 x ttl"),
        "value remembered in process memory": (IN_PROCESS_MEMO, "after expiry the burst made 0 queries"),
        "not shielded": (NOT_SHIELDED, "asyncio.shield"),
        "a lock per key": (LOCK_PER_KEY, "started 20 loads"),
        "a load run by its caller, handed over on cancel": (HANDED_OVER_ON_CANCEL, "2 loads for one key"),
        "in-flight entry removed by each caller": (ENTRY_REMOVED_BY_EACH_CALLER, "started a second load"),
        "waiters load again after a failure": (WAITERS_LOAD_AGAIN_AFTER_A_FAILURE, "started 20 loads"),
        "an event per key": (EVENTS, "the shared load must run to the end"),
    },
    "get_user_cached": {
        "a row as a tuple": (USER_ROW_AS_A_TUPLE, "expected {'id': 7"),
        "no negative caching": (USER_NO_NEGATIVE_CACHE, "made 100 database queries"),
        "a miss without a TTL": (USER_MISS_WITHOUT_TTL, "has no TTL"),
        "a miss as long as a user": (USER_MISS_AS_LONG_AS_A_HIT, "keep misses short"),
        "an empty string read by truthiness": (USER_EMPTY_STRING_AND_TRUTHINESS, "truthiness"),
        "a user without a TTL": (USER_HIT_WITHOUT_TTL, "has no TTL"),
        "misses in process memory": (USER_MISS_IN_PROCESS_SET, "process memory"),
        "one set for every miss": (USER_MISS_CACHED_IN_ANOTHER_KEY_FOREVER_CHECKED_FIRST, "one set for every miss"),
        "a user as a hash": (USER_AS_A_HASH, "as a JSON string"),
        "a sliding expiry on misses": (USER_SLIDING_EXPIRY_ON_MISSES, "sliding expiry"),
        "a TTL in milliseconds": (USER_TTL_IN_MILLISECONDS, "px= takes milliseconds"),
    },
}

CORRECT: dict[str, dict[str, str]] = {
    "get_cached": {
        "solution": solution_source("04", "get_cached"),
        "a dict of shielded tasks": FUTURES,
        "a future set by a task of its own": FUTURE_SET_BY_A_TASK,
        "asyncio.wait instead of shield": WAIT_INSTEAD_OF_SHIELD,
        "whole seconds with ex= (ttl is 60)": INT_SECONDS_TRUNCATED,
        "a future set by its own task, typed": FUTURE_SET_BY_ITS_OWN_TASK_TYPED,
        "SET then PEXPIRE in a MULTI pipeline": SET_THEN_PEXPIRE_IN_A_PIPELINE,
        "SET then PEXPIRE as two calls": SET_THEN_PEXPIRE_TWO_CALLS,
        "Redis read again inside the load": RECHECK_INSIDE_THE_LOAD,
    },
    "get_user_cached": {
        "solution": solution_source("04", "get_user_cached"),
        "a cached null": USER_NULL_MARKER,
        "a sentinel and a dict row": USER_SENTINEL,
        "the null variant helper": _user_variant('await redis.set(key, "null", ex=30)'),
        "a dict_row cursor and an alias": USER_DICT_ROW_CURSOR,
        "a separate key for misses": USER_SEPARATE_MISS_KEY,
        "SET then EXPIRE in a pipeline, a 5 s miss": USER_SET_THEN_EXPIRE_PIPELINE,
    },
}


@pytest.mark.parametrize(("task_id", "source", "mentions"), wrong_params(WRONG))
def test_04_wrong_answers_are_rejected_for_their_mistake(task_id, source, mentions):
    assert_rejected(task_id, source, mentions=mentions)


@pytest.mark.parametrize(("task_id", "source"), correct_params(CORRECT))
def test_04_correct_answers_get_full_marks(task_id, source):
    assert_accepted(task_id, source)


@pytest.mark.slow
def test_04_course_check_scores_a_wrong_notebook_below_full_marks(tmp_path):
    from autograder.check import check

    wrong = {"get_cached": NO_SINGLE_FLIGHT, "get_user_cached": USER_MISS_WITHOUT_TTL}
    path = notebook_with_answers("04_caching", wrong, tmp_path)
    res = check(path)
    shutil.rmtree(tmp_path, ignore_errors=True)
    by_task = {t.id: t for t in res.tasks}
    assert res.score == 0, res
    assert not by_task["get_cached"].passed and not by_task["get_user_cached"].passed
