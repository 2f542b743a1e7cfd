"""Chapter 12's demos of what changes at scale: partitions, durability, hash collisions.

- :func:`partition_demo`: PostgreSQL refuses ``UNIQUE (code)`` on a table partitioned by
  creation time; partitioned by id range, a code routes to one partition through
  ``decode_code`` (shown with ``EXPLAIN``), and aliases live in a table of their own.
  Everything runs in a transaction that is rolled back: nothing stays behind.
- :func:`aof_after_kill`: a Redis of the demo's own with ``appendonly yes`` takes stream
  entries, is killed with SIGKILL and started again: what came back.
- :func:`first_collisions`: how many URLs a truncated hash takes before two share a code,
  measured, beside the birthday bound.
"""

from __future__ import annotations

import hashlib
import math
import random
import statistics
import subprocess
import time

from course import shortener
from course.kit import backends

# ============================================================================ partitions

BY_TIME = """
CREATE TABLE ch12_links_by_month (
    id         bigint NOT NULL,
    code       text NOT NULL UNIQUE,
    url        text NOT NULL,
    created_at timestamptz NOT NULL
) PARTITION BY RANGE (created_at)
"""

BY_ID = """
CREATE TABLE ch12_links_by_id (
    id         bigint PRIMARY KEY,  -- the code is encode_code(id): unique because the id is
    url        text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
) PARTITION BY RANGE (id);
CREATE TABLE ch12_links_by_id_0 PARTITION OF ch12_links_by_id FOR VALUES FROM (1) TO (1000000000);
CREATE TABLE ch12_links_by_id_1 PARTITION OF ch12_links_by_id FOR VALUES FROM (1000000000) TO (2000000000);
-- custom aliases are not codes of an id: a table of their own, its own unique index
CREATE TABLE ch12_aliases (alias text PRIMARY KEY, link_id bigint NOT NULL)
"""


async def partition_demo(pool, link_id: int = 1_234_567_890) -> dict:
    """Try both layouts inside one transaction that is rolled back.

    Returns the error PostgreSQL gives for ``UNIQUE (code)`` on a table partitioned by time,
    the code of ``link_id``, and the plan of looking that code up in the id-partitioned table.
    """
    import psycopg

    code = shortener.encode_code(link_id)
    async with pool.connection() as conn:
        async with conn.transaction(force_rollback=True):
            try:
                async with conn.transaction():  # a savepoint: the failure undoes only this
                    await conn.execute(BY_TIME)
                refused = None
            except psycopg.errors.DatabaseError as err:
                refused = str(err).splitlines()[0]
            await conn.execute(BY_ID)
            await conn.execute(
                "INSERT INTO ch12_links_by_id (id, url) VALUES (%s, 'https://example.com/x')", (link_id,)
            )
            cur = await conn.execute(
                "EXPLAIN (COSTS OFF) SELECT url FROM ch12_links_by_id WHERE id = %s",
                (shortener.decode_code(code),),
            )
            plan = [row[0] for row in await cur.fetchall()]
    return {"refused": refused, "code": code, "id": link_id, "plan": plan}


# ============================================================================ durability


def _wait(ready, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError("the demo Redis did not get ready")
        time.sleep(0.005)


def aof_after_kill(entries: int = 2_000) -> dict:
    """A Redis of the demo's own, ``appendonly yes`` (``appendfsync`` left at its default,
    ``everysec``): ``entries`` XADDs, acknowledged, then SIGKILL and a restart from the AOF.
    Returns the fsync policy, how many entries were acknowledged, how many bytes of them Redis
    still held unwritten just before the kill (``held``: under ``everysec`` it postpones its write,
    for up to 2 s, while the last background fsync has not finished, and replies all the same)
    and how many came back. Blocking: run it in a thread."""
    import redis

    run = backends.new_run_dir("ch12-aof-")
    proc = None
    try:
        proc, url = backends.start_redis(run / "redis", databases=1)
        client = redis.Redis.from_url(url)

        def enabled() -> bool:
            info = client.info("persistence")
            return (
                info["aof_enabled"] == 1
                and not info["aof_rewrite_in_progress"]
                and not info["aof_rewrite_scheduled"]
            )

        client.config_set("appendonly", "yes")  # writes the AOF's base file, then appends every write
        _wait(enabled)
        policy = client.config_get("appendfsync")["appendfsync"]
        pipe = client.pipeline(transaction=False)
        for i in range(entries):
            pipe.xadd("clicks", {"c": i})
        acknowledged = sum(1 for reply in pipe.execute() if reply)
        held = int(client.info("persistence").get("aof_buffer_length", 0))
        client.close()
        proc.kill()  # SIGKILL: no shutdown, no final fsync
        proc.wait()
        conf = run / "redis" / "redis.conf"
        conf.write_text(conf.read_text().replace("appendonly no", "appendonly yes"))
        proc = subprocess.Popen(
            [backends.redis_server_binary(), str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        client = redis.Redis.from_url(url)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except (redis.ConnectionError, redis.BusyLoadingError):
                return False

        _wait(answers)
        back = client.xlen("clicks")
        client.close()
        return {"policy": policy, "acknowledged": acknowledged, "held": held, "after_kill": back}
    finally:
        backends.stop_embedded(run, redis_proc=proc)


# ============================================================================ the birthday bound


def birthday_bound(space: int) -> float:
    """Expected number of random draws from ``space`` values before the first repeat: sqrt(pi N / 2)."""
    return math.sqrt(math.pi * space / 2)


def expected_pairs(n: float, space: int) -> float:
    """Expected number of colliding pairs among ``n`` random draws from ``space`` values: n^2 / 2N."""
    return n * (n - 1) / (2 * space)


def first_collisions(chars: int = 3, *, trials: int = 100, seed: int = 12) -> dict:
    """Hash URLs (BLAKE2b) and keep ``chars`` base62 characters: how many URLs until two
    share a code? ``trials`` runs over different URLs; their mean, beside the birthday bound."""
    space = 62**chars
    rnd = random.Random(seed)
    firsts = []
    for _ in range(trials):
        prefix = hashlib.blake2b(f"https://example.com/{rnd.randrange(10**12)}/".encode(), digest_size=8)
        seen: set[int] = set()
        n = 0
        while True:
            n += 1
            h = prefix.copy()
            h.update(b"%d" % n)
            code = int.from_bytes(h.digest(), "big") % space  # the last `chars` base62 characters
            if code in seen:
                break
            seen.add(code)
        firsts.append(n)
    return {"chars": chars, "space": space, "trials": trials, "mean": statistics.fmean(firsts),
            "predicted": birthday_bound(space)}  # fmt: skip
