"""One owner per stream (chapter 05; :mod:`course.messaging`): a lease with a fencing token.

A consumer owns a stream while it holds chapter 04's :class:`course.caching.RedisLock` on it
(``SET key token NX PX ttl``, renewed while it runs); the lock's fencing token goes into the
stream's row of ``mq_fence``, and every transaction of the consumer checks it there, so a
consumer that lost its lease (a pause longer than the lease, a partition) cannot write
after the new owner took over (Kleppmann, "How to do distributed locking", 2016).
"""

from __future__ import annotations

from course.caching import RedisLock

LEASE_MS = 30_000  # the owner's lease on its stream, renewed every third of it


class LeaseLost(Exception):
    """Another consumer owns the stream now (a newer fencing token): stop, write nothing, ack nothing."""


async def check_fence(conn, stream: str, token: int) -> None:
    """In the caller's transaction: go on only if ``token`` is still the stream's newest. The row is
    held ``FOR SHARE`` until the commit, so a new owner's :func:`take_ownership` waits for this
    transaction, and every later one of the old owner is refused (:class:`LeaseLost`)."""
    cur = await conn.execute("SELECT token FROM mq_fence WHERE stream = %s FOR SHARE", (stream,))
    row = await cur.fetchone()
    if row is None or row[0] != token:
        raise LeaseLost(f"fencing token {token} of {stream} is stale: the stream's is {row and row[0]}")


def lease_key(stream: str, group: str) -> str:
    """The Redis key of the stream's owner lease (its fencing counter is ``<key>:fence``)."""
    return f"{stream}:{group}:owner"


_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_AT_LEAST = "if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end"


async def take_ownership(pool, redis, *, stream: str, group: str, consumer: str, lease_ms: int = LEASE_MS):
    """Become the one consumer of ``stream``: a held :class:`course.caching.RedisLock`, or None while
    another consumer holds the lease.

    Chapter 04's lock with a fencing token: ``SET <key> <random> NX PX lease_ms``, and ``INCR`` of a
    counter in the same script. The token goes into the stream's ``mq_fence`` row, where every
    transaction of the consumer checks it (:func:`check_fence`): the update waits for the old
    owner's open transactions, then refuses each later one. A token not above the row's (Redis lost
    its counter) moves the counter past it, and the lease is taken again.
    """
    for _ in range(2):
        lease = RedisLock(redis, lease_key(stream, group), lease_ms / 1000, fencing=True)
        if not await lease.acquire():
            return None
        async with pool.connection() as conn:
            cur = await conn.execute(
                "INSERT INTO mq_fence AS f (stream, token, owner) VALUES (%s, %s, %s) ON CONFLICT (stream) "
                "DO UPDATE "
                "SET token = excluded.token, owner = excluded.owner, taken_at = now() "
                "WHERE f.token < excluded.token "
                "RETURNING token",
                (stream, lease.fence, consumer),
            )
            if await cur.fetchone() is not None:
                return lease
            cur = await conn.execute("SELECT token FROM mq_fence WHERE stream = %s", (stream,))
            (newest,) = await cur.fetchone()
        await redis.eval(_AT_LEAST, 1, f"{lease.name}:fence", newest)
        await lease.release()
    raise RuntimeError(f"{stream}: no fencing token above {newest}")


async def renew_lease(redis, lease: RedisLock, lease_ms: int = LEASE_MS) -> bool:
    """Extend ``lease`` if it is still held; False once it was lost (expired, or taken by another)."""
    return bool(await redis.eval(_RENEW, 1, lease.name, lease.token or "", int(lease_ms)))
