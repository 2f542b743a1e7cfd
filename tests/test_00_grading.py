"""Chapter 00's warm-up check rejects the plausible wrong answers and accepts the right ones."""

from tests.helpers import assert_accepted, assert_rejected

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


def test_incr_with_an_insert_is_accepted():
    assert_accepted("count_visit", RIGHT_INCR)


def test_a_transaction_and_a_pipeline_are_accepted():
    assert_accepted("count_visit", RIGHT_PIPELINE_AND_TRANSACTION)


def test_get_then_set_loses_updates_and_is_rejected():
    assert_rejected("count_visit", GET_THEN_SET, mentions="lost updates")


def test_skipping_postgresql_is_rejected():
    assert_rejected("count_visit", REDIS_ONLY, mentions="visits rows per page, expected")


def test_the_wrong_key_is_rejected():
    assert_rejected("count_visit", WRONG_KEY, mentions="Redis holds")


def test_counting_rows_under_concurrency_is_rejected():
    assert_rejected("count_visit", COUNT_FROM_POSTGRES)
