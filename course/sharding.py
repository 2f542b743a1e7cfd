"""Placing keys on nodes: modulo, a consistent-hash ring, rendezvous and jump hash (chapter 09).

``hash(key) % N`` moves almost every key when N changes (a key stays only when
``h % N == h % (N + 1)``, about 1 key in N + 1). A consistent-hash ring (Karger et al.,
1997) puts nodes and keys on one circle of 64-bit positions; a key belongs to the first
node point at or after it, so a new node takes over only the arcs just before its
points, about 1/(N + 1) of the keys. One point per node gives very uneven arcs, so each
node gets ``vnodes`` points ("virtual nodes"). Rendezvous (highest random weight, Thaler
and Ravishankar 1996) needs no ring: each key goes to the node with the highest
``hash(node, key)``. Jump consistent hash (Lamping and Veach 2014) needs no state at all,
but its buckets are numbered 0..N-1 and only the last one can be removed.

Every hash here is :func:`stable_hash` (BLAKE2b), the same in every process: Python's
``hash()`` of a string is salted per process (PYTHONHASHSEED), so two replicas using it
would place one key on two nodes.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import Counter
from collections.abc import Callable, Iterable

__all__ = [
    "HashRing",
    "jump_hash",
    "loads",
    "modulo_node",
    "moved_fraction",
    "rendezvous_node",
    "stable_hash",
]


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text``, identical in every process and on every machine."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def modulo_node(key: str, nodes: list[str]) -> str:
    """``nodes[hash(key) % len(nodes)]``: fine until the number of nodes changes."""
    return nodes[stable_hash(key) % len(nodes)]


class HashRing:
    """A consistent-hash ring with ``vnodes`` points per node, looked up with bisect.

    A node's points are ``stable_hash(f"{node}#{i}")`` for ``i < vnodes``: they depend only
    on the node's name, so the ring is the same whatever order nodes were added in, and in
    every process. Ties between points of two nodes (64-bit collisions) go to the smaller
    name, for the same reason.
    """

    def __init__(
        self, nodes: Iterable[str] = (), vnodes: int = 160, hash: Callable[[str], int] = stable_hash
    ):  # noqa: A002
        self.vnodes = vnodes
        self._hash = hash
        self._points: list[tuple[int, str]] = []
        self._nodes: set[str] = set()
        for node in nodes:
            self.add_node(node)

    @property
    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def add_node(self, node: str) -> None:
        if node in self._nodes:
            return
        self._nodes.add(node)
        for i in range(self.vnodes):
            bisect.insort(self._points, (self._hash(f"{node}#{i}"), node))

    def remove_node(self, node: str) -> None:
        self._nodes.discard(node)
        self._points = [p for p in self._points if p[1] != node]

    def node_for(self, key: str) -> str:
        if not self._points:
            raise LookupError("the ring has no nodes")
        i = bisect.bisect_left(self._points, (self._hash(key), ""))
        return self._points[i % len(self._points)][1]  # past the last point: wrap to the first

    def arcs(self) -> dict[str, float]:
        """The share of the circle each node owns (the arc before each of its points)."""
        share: Counter = Counter()
        top = 2**64
        for i, (pos, node) in enumerate(self._points):
            prev = self._points[i - 1][0] if i else self._points[-1][0] - top
            share[node] += (pos - prev) / top
        return dict(share)


def rendezvous_node(key: str, nodes: Iterable[str]) -> str:
    """Highest random weight: the node whose ``hash(node, key)`` is largest."""
    return max(nodes, key=lambda node: (stable_hash(f"{node}|{key}"), node))


def jump_hash(key: int, buckets: int) -> int:
    """Lamping and Veach's jump consistent hash: a bucket in ``range(buckets)`` for a 64-bit ``key``.

    Growing from N to N + 1 buckets moves exactly the keys that jump to the new bucket,
    1/(N + 1) of them in expectation, with no table at all.
    """
    if buckets <= 0:
        raise ValueError("buckets must be positive")
    b, j = -1, 0
    key &= 0xFFFFFFFFFFFFFFFF
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def moved_fraction(before: Callable[[str], str], after: Callable[[str], str], keys: Iterable[str]) -> float:
    """The share of ``keys`` whose node differs between two placements."""
    keys = list(keys)
    return sum(before(k) != after(k) for k in keys) / len(keys)


def loads(place: Callable[[str], str], keys: Iterable[str]) -> Counter:
    """How many of ``keys`` each node gets."""
    return Counter(place(k) for k in keys)
