"""A Bloom filter kept in Redis, against cache penetration (chapter 04).

Lookups of ids that do not exist miss the cache and reach the database every time; an
attacker enumerating ids defeats negative caching too, because every id is new. A Bloom
filter answers "definitely not there" from a few bits: each item sets ``k`` of ``m`` bits
in one Redis string, and an item whose bits are not all set was never added. It may say
"maybe" for an item never added (a false positive, at a rate we choose), never "no" for
one that was. Items cannot be removed (a counting filter or a rebuild does that).

One BITFIELD command sets or reads all ``k`` bits of an item in a single round trip
(SETBIT/GETBIT would need ``k``). Redis Stack's ``BF.ADD`` does the same server-side; the
Redis 6.2 here has no modules, so the filter is built from bit operations.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable


def optimal_size(capacity: int, error_rate: float) -> tuple[int, int]:
    """Bits ``m`` and hash count ``k`` for ``capacity`` items at a false-positive rate ``error_rate``.

    ``m = -n ln p / (ln 2)^2`` and ``k = (m / n) ln 2``: about 9.6 bits and 7 hashes per item at 1%.
    """
    if capacity <= 0 or not 0 < error_rate < 1:
        raise ValueError("capacity must be positive and error_rate between 0 and 1")
    m = math.ceil(-capacity * math.log(error_rate) / math.log(2) ** 2)
    k = max(1, round(m / capacity * math.log(2)))
    return m, k


def false_positive_rate(m: int, k: int, n: int) -> float:
    """The theoretical false-positive rate after ``n`` items: ``(1 - e^(-k n / m))^k``."""
    return (1 - math.exp(-k * n / m)) ** k


class BloomFilter:
    """A Bloom filter in one Redis string (``key``), read and written with BITFIELD."""

    def __init__(self, redis, key: str, *, capacity: int, error_rate: float = 0.01) -> None:
        self.redis = redis
        self.key = key
        self.capacity = capacity
        self.error_rate = error_rate
        self.m, self.k = optimal_size(capacity, error_rate)

    def positions(self, item: object) -> list[int]:
        """The ``k`` bit positions of an item: double hashing ``h1 + i * h2`` of one 128-bit digest."""
        digest = hashlib.blake2b(str(item).encode(), digest_size=16).digest()
        h1 = int.from_bytes(digest[:8], "little")
        h2 = int.from_bytes(digest[8:], "little") | 1  # odd, so the k positions differ
        return [(h1 + i * h2) % self.m for i in range(self.k)]

    def _bitfield(self, op: str, items: list) -> list:
        """One BITFIELD (SET) or BITFIELD_RO (GET) command covering every bit of ``items``."""
        args: list = ["BITFIELD" if op == "SET" else "BITFIELD_RO", self.key]
        for item in items:
            for pos in self.positions(item):
                args += [op, "u1", pos] + ([1] if op == "SET" else [])
        return args

    async def add(self, item: object) -> None:
        await self.redis.execute_command(*self._bitfield("SET", [item]))

    async def add_many(self, items: Iterable[object], chunk: int = 500) -> int:
        """Add many items, ``chunk`` items (``chunk * k`` bits) per command."""
        batch: list = []
        count = 0
        for item in items:
            batch.append(item)
            if len(batch) >= chunk:
                await self.redis.execute_command(*self._bitfield("SET", batch))
                count += len(batch)
                batch = []
        if batch:
            await self.redis.execute_command(*self._bitfield("SET", batch))
            count += len(batch)
        return count

    async def might_contain(self, item: object) -> bool:
        """False means "never added"; True means "maybe" (check the cache and the database)."""
        bits = await self.redis.execute_command(*self._bitfield("GET", [item]))
        return all(bits)

    async def might_contain_many(self, items: list, chunk: int = 500) -> list[bool]:
        out: list[bool] = []
        for start in range(0, len(items), chunk):
            bits = await self.redis.execute_command(*self._bitfield("GET", items[start : start + chunk]))
            out += [all(bits[i : i + self.k]) for i in range(0, len(bits), self.k)]
        return out

    async def bits_set(self) -> int:
        return int(await self.redis.bitcount(self.key))

    def expected_rate(self, n: int) -> float:
        return false_positive_rate(self.m, self.k, n)

    def __repr__(self) -> str:
        return (
            f"BloomFilter(key={self.key!r}, m={self.m} bits = {self.m / 8 / 1024:.1f} KiB, k={self.k}, "
            f"capacity={self.capacity}, error_rate={self.error_rate})"
        )
