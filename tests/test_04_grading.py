"""Chapter 04's checks reject the caches learners plausibly write wrong and accept the right ones."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import assert_accepted, assert_rejected, notebook_with_answers

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


def test_a_dict_of_shielded_tasks_is_accepted():
    assert_accepted("get_cached", FUTURES)


def test_a_future_set_by_a_task_of_its_own_is_accepted():
    assert_accepted("get_cached", FUTURE_SET_BY_A_TASK)


def test_waiting_with_asyncio_wait_instead_of_shield_is_accepted():
    assert_accepted("get_cached", WAIT_INSTEAD_OF_SHIELD)


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


def test_no_single_flight_is_rejected():
    assert_rejected("get_cached", NO_SINGLE_FLIGHT, mentions="made 50 database queries")


def test_one_lock_for_all_keys_is_rejected():
    assert_rejected("get_cached", ONE_GLOBAL_LOCK, mentions="different keys waited on each other")


def test_an_in_flight_entry_that_is_never_removed_is_rejected():
    assert_rejected("get_cached", ENTRY_NEVER_REMOVED, mentions="after expiry the burst made 0 queries")


def test_an_entry_removed_only_on_success_lets_one_error_poison_the_key():
    assert_rejected("get_cached", REMOVED_ONLY_ON_SUCCESS, mentions="poisons the key")


def test_a_loader_error_cached_as_a_value_is_rejected():
    assert_rejected("get_cached", ERROR_CACHED_AS_VALUE, mentions="0 of 20 callers got an error")


def test_waiters_that_get_none_after_a_failed_load_are_rejected():
    assert_rejected("get_cached", WAITERS_GET_NONE_ON_ERROR, mentions="must see its error")


def test_no_ttl_jitter_is_rejected():
    assert_rejected("get_cached", NO_JITTER, mentions="add jitter")


def test_200_ms_of_jitter_on_a_minute_is_rejected():
    assert_rejected("get_cached", JITTER_200_MS, mentions="add jitter")


def test_no_ttl_at_all_is_rejected():
    assert_rejected("get_cached", NO_TTL, mentions="no TTL")


def test_a_ttl_below_the_requested_one_is_rejected():
    assert_rejected("get_cached", JITTER_BELOW_TTL, mentions="between ttl and 1.2 x ttl")


def test_a_value_remembered_in_process_memory_is_rejected():
    assert_rejected("get_cached", IN_PROCESS_MEMO, mentions="after expiry the burst made 0 queries")


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


def test_users_with_a_cached_null_are_accepted():
    assert_accepted("get_user_cached", USER_NULL_MARKER)


def test_users_with_a_sentinel_and_a_dict_row_are_accepted():
    assert_accepted("get_user_cached", USER_SENTINEL)


def test_users_with_the_null_variant_helper_are_accepted():
    assert_accepted("get_user_cached", _user_variant('await redis.set(key, "null", ex=30)'))


def test_no_negative_caching_is_rejected():
    assert_rejected("get_user_cached", USER_NO_NEGATIVE_CACHE, mentions="made 100 database queries")


def test_a_cached_miss_without_a_ttl_is_rejected():
    assert_rejected("get_user_cached", USER_MISS_WITHOUT_TTL, mentions="has no TTL")


def test_a_miss_cached_as_long_as_a_user_is_rejected():
    assert_rejected("get_user_cached", USER_MISS_AS_LONG_AS_A_HIT, mentions="keep misses short")


def test_an_empty_string_read_back_as_a_miss_is_rejected():
    assert_rejected("get_user_cached", USER_EMPTY_STRING_AND_TRUTHINESS, mentions="truthiness")


def test_a_user_cached_without_a_ttl_is_rejected():
    assert_rejected("get_user_cached", USER_HIT_WITHOUT_TTL, mentions="has no TTL")


def test_misses_remembered_in_process_memory_are_rejected():
    assert_rejected("get_user_cached", USER_MISS_IN_PROCESS_SET, mentions="not cached in Redis")


# ============================================================================ the whole notebook


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
