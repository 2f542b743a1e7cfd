"""Time-ordered ids made without the database: a Snowflake-style generator and UUIDv7 (chapter 09).

A Snowflake id (Twitter, 2010) is a 64-bit integer: 41 bits of milliseconds since a
custom epoch, 10 bits of worker id, 12 bits of a per-millisecond sequence. It sorts by
time like a sequence, fits a ``bigint``, and needs no round trip: each worker only needs
a unique worker id. What it costs: the clock. A generator that trusts a clock that steps
back (an NTP correction, a VM migration) issues ids smaller than ones it already issued,
or duplicates. :class:`Snowflake` never goes back: it waits (on the injected ``sleep``)
for a small step back and raises :class:`ClockWentBackwards` for a large one.

Two more things make the ids unique. The worker id must belong to one process at a time (a
lease row in the database, a ZooKeeper or etcd sequential node, a StatefulSet ordinal): two
processes with one worker id issue the same ids. And one generator shared by threads must make
each id under a lock, or two threads read the same millisecond and sequence and return the
same id; :class:`Snowflake` holds one.

UUIDv7 (RFC 9562, 2024) is the standard form of the same idea: 48 bits of Unix
milliseconds, then random bits, in the 128-bit UUID layout. PostgreSQL 18 has
``uuidv7()``; Python 3.14 has ``uuid.uuid7()``; before that the ``uuid6`` package.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

#: 2024-01-01T00:00:00Z in Unix milliseconds: 41 bits of ms from here last until 2093.
EPOCH_MS = 1_704_067_200_000
WORKER_BITS = 10
SEQUENCE_BITS = 12


class ClockWentBackwards(RuntimeError):
    """The clock is further behind the last id's time than the generator will wait."""


class Snowflake:
    """A Snowflake id generator for one worker; ``clock()`` returns seconds (``time.time``)."""

    def __init__(
        self,
        worker: int,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        max_wait_ms: int = 50,
    ) -> None:
        if not 0 <= worker < 2**WORKER_BITS:
            raise ValueError(f"worker must be in [0, {2**WORKER_BITS})")
        self.worker = worker
        self.clock = clock
        self.sleep = sleep
        self.max_wait_ms = max_wait_ms
        self.last_ms = -1
        self.sequence = 0
        self.waited_ms = 0  # how long it waited for the clock, in all
        self._lock = threading.Lock()

    def _now_ms(self) -> int:
        return int(self.clock() * 1000) - EPOCH_MS

    def next_id(self) -> int:
        with self._lock:  # the read of last_ms and sequence and their update are one step
            return self._next_id()

    def _next_id(self) -> int:
        now = self._now_ms()
        if now < self.last_ms:
            behind = self.last_ms - now
            if behind > self.max_wait_ms:
                raise ClockWentBackwards(f"clock is {behind} ms behind the last id; refusing to issue ids")
            self.sleep(behind / 1000)
            self.waited_ms += behind
            now = max(self._now_ms(), self.last_ms)
        if now == self.last_ms:
            self.sequence = (self.sequence + 1) % 2**SEQUENCE_BITS
            if self.sequence == 0:  # 4096 ids in this millisecond: use the next one
                now = self.last_ms + 1
                while self._now_ms() < now:
                    self.sleep(0.0005)
        else:
            self.sequence = 0
        self.last_ms = now
        return (now << (WORKER_BITS + SEQUENCE_BITS)) | (self.worker << SEQUENCE_BITS) | self.sequence


def snowflake_parts(id_: int) -> dict:
    """What a Snowflake id tells anyone who sees it: when it was made, by which worker, how many that ms."""
    ms = (id_ >> (WORKER_BITS + SEQUENCE_BITS)) + EPOCH_MS
    return {
        "created": datetime.fromtimestamp(ms / 1000, tz=UTC),
        "worker": (id_ >> SEQUENCE_BITS) & (2**WORKER_BITS - 1),
        "sequence": id_ & (2**SEQUENCE_BITS - 1),
    }


def uuid7_time(value) -> datetime:
    """The creation time a UUIDv7 carries in its first 48 bits (anyone can read it)."""
    ms = int(str(value).replace("-", "")[:12], 16)
    return datetime.fromtimestamp(ms / 1000, tz=UTC)
