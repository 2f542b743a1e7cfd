"""Chapter 00's warm-up check rejects the plausible wrong answers and accepts the right ones."""

import pytest

from tests.helpers import assert_accepted, assert_rejected, correct_params, wrong_params

RIGHT_INCR = """
async def count_visit(redis, pool, page):
    count = await redis.incr(f"visits:{page}")
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return count
"""

RIGHT_PIPELINE_AND_TRANSACTION = """
async def count_visit(redis, pool, page):
    async with pool.connection() as conn:
        async with conn.transaction():
            await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.incr(f"visits:{page}")
        (count,) = await pipe.execute()
    return int(count)
"""

GET_THEN_SET = """
async def count_visit(redis, pool, page):
    count = int(await redis.get(f"visits:{page}") or 0) + 1
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    await redis.set(f"visits:{page}", count)
    return count
"""

# the read-add-write under a lock: exact in one process, two replicas each have their own lock
GET_THEN_SET_UNDER_A_LOCK = """
import asyncio
_lock = asyncio.Lock()

async def count_visit(redis, pool, page):
    key = f"visits:{page}"
    async with _lock:
        count = int(await redis.get(key) or 0) + 1
        await redis.set(key, count)
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return count
"""

# the same race through other commands than a plain GET
MGET_THEN_SET = """
async def count_visit(redis, pool, page):
    key = f"visits:{page}"
    (value,) = await redis.mget([key])
    await redis.set(key, int(value or 0) + 1)
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return int(value or 0) + 1
"""

RIGHT_LUA = """
SCRIPT = "local n = tonumber(redis.call('GET', KEYS[1]) or '0') + 1; redis.call('SET', KEYS[1], n); return n"

async def count_visit(redis, pool, page):
    count = await redis.eval(SCRIPT, 1, f"visits:{page}")
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return int(count)
"""

REDIS_ONLY = """
async def count_visit(redis, pool, page):
    return await redis.incr(f"visits:{page}")
"""

WRONG_KEY = """
async def count_visit(redis, pool, page):
    count = await redis.incr(page)
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return count
"""

COUNT_FROM_POSTGRES = """
async def count_visit(redis, pool, page):
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
        row = await (await conn.execute("SELECT count(*) FROM visits WHERE page = %s", (page,))).fetchone()
    await redis.set(f"visits:{page}", row[0])
    return row[0]
"""


READ_BACK_WITH_GET = """
async def count_visit(redis, pool, page):
    await redis.incr(f"visits:{page}")
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return await redis.get(f"visits:{page}")
"""

INSERT_FIRST_THEN_GET_AND_SET = """
async def count_visit(redis, pool, page):
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    count = int(await redis.get(f"visits:{page}") or 0) + 1
    await redis.set(f"visits:{page}", count)
    return count
"""

INCRBY_AND_INT = """
async def count_visit(redis, pool, page: str) -> int:
    key = "visits:" + page
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return int(await redis.incrby(key, 1))
"""

# every INCR lands, but the count comes back from a second command: two visits can read the same one
INCR_THEN_GET = """
async def count_visit(redis, pool, page):
    key = f"visits:{page}"
    await redis.incr(key)
    async with pool.connection() as conn:
        await conn.execute("INSERT INTO visits (page) VALUES (%s)", (page,))
    return int(await redis.get(key))
"""

WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "count_visit": {
        "get then set": (GET_THEN_SET, "lost updates"),
        "insert first, then get and set": (INSERT_FIRST_THEN_GET_AND_SET, "lost updates"),
        "get then set under a lock": (GET_THEN_SET_UNDER_A_LOCK, "a lock in one process does not reach another"),
        "mget then set": (MGET_THEN_SET, "lost updates"),
        "redis only": (REDIS_ONLY, "visits rows per page, expected"),
        "wrong key": (WRONG_KEY, "Redis holds"),
        "count read back with GET": (READ_BACK_WITH_GET, "read back with GET"),
        "count from postgresql": (COUNT_FROM_POSTGRES, "stood at 41"),
        "incr, then get": (INCR_THEN_GET, "INCR, then GET"),
    },
}

CORRECT: dict[str, dict[str, str]] = {
    "count_visit": {
        "incr and an insert": RIGHT_INCR,
        "a transaction and a pipeline": RIGHT_PIPELINE_AND_TRANSACTION,
        "insert first, then incrby": INCRBY_AND_INT,
        "a lua script": RIGHT_LUA,
    },
}


@pytest.mark.parametrize(("task_id", "source", "mentions"), wrong_params(WRONG))
def test_00_wrong_answers_are_rejected_for_their_mistake(task_id, source, mentions):
    assert_rejected(task_id, source, mentions=mentions)


@pytest.mark.parametrize(("task_id", "source"), correct_params(CORRECT))
def test_00_correct_answers_get_full_marks(task_id, source):
    assert_accepted(task_id, source)
