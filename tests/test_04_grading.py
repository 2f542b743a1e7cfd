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


def test_a_lock_per_key_restarts_the_load_when_its_holder_is_cancelled():
    res = assert_rejected("get_cached", LOCK_PER_KEY, mentions="2 loads for one key")
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


# ============================================================================ the whole notebook


WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "get_cached": {
        "no single-flight": (NO_SINGLE_FLIGHT, "made 50 database queries"),
        "one lock for all keys": (ONE_GLOBAL_LOCK, "different keys waited on each other"),
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
        "a lock per key": (LOCK_PER_KEY, "2 loads for one key"),
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
    },
}

CORRECT: dict[str, dict[str, str]] = {
    "get_cached": {
        "solution": solution_source("04", "get_cached"),
        "a dict of shielded tasks": FUTURES,
        "a future set by a task of its own": FUTURE_SET_BY_A_TASK,
        "asyncio.wait instead of shield": WAIT_INSTEAD_OF_SHIELD,
        "whole seconds with ex= (ttl is 60)": INT_SECONDS_TRUNCATED,
    },
    "get_user_cached": {
        "solution": solution_source("04", "get_user_cached"),
        "a cached null": USER_NULL_MARKER,
        "a sentinel and a dict row": USER_SENTINEL,
        "the null variant helper": _user_variant('await redis.set(key, "null", ex=30)'),
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
