"""Change data capture from a PostgreSQL logical replication slot, with the built-in ``pgoutput`` (chapter 06).

Instead of polling the outbox, read the changes PostgreSQL already wrote to its WAL:

1. a **publication** names the tables whose changes are sent (``CREATE PUBLICATION ...
   FOR TABLE outbox``: publish the outbox only, so internal columns of other tables never
   become a public contract);
2. a **logical replication slot** remembers how far its consumer has read, and makes the
   server keep every WAL segment the consumer has not confirmed yet;
3. the consumer reads committed transactions **in commit order**
   (``pg_logical_slot_peek_binary_changes``), publishes them, then confirms
   (``pg_replication_slot_advance``). Peek, publish, advance: a crash in between publishes
   again (at least once); advancing first would lose the events instead.

Production connectors (Debezium's PostgreSQL connector) speak the streaming replication
protocol; this module uses the SQL functions over the same slot and decodes pgoutput's
protocol-1 messages itself (Begin, Relation, Insert, Update, Delete, Commit), which is
enough for an outbox. It needs ``wal_level = logical`` (:func:`available` says whether
the server has it). A slot nobody reads keeps WAL forever: watch ``retained_bytes`` from
:func:`slot_status` and cap it with ``max_slot_wal_keep_size``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from psycopg import sql


async def available(conn) -> tuple[bool, str]:
    """Can this server decode logically? ``(answer, why)``."""
    cur = await conn.execute("SHOW wal_level")
    level = (await cur.fetchone())[0]
    if level != "logical":
        return False, f"wal_level is {level!r}; logical decoding needs wal_level = logical (a server restart)"
    return True, "wal_level = logical; pgoutput is built in"


async def create_slot(conn, slot: str, publication: str, tables: list[str]) -> str:
    """Create the publication (if missing) and a pgoutput slot; the LSN the slot starts at."""
    cur = await conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,))
    if await cur.fetchone() is None:
        await conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                sql.Identifier(publication), sql.SQL(", ").join(sql.Identifier(t) for t in tables)
            )
        )
    cur = await conn.execute(
        "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,)
    )
    return (await cur.fetchone())[0]


async def drop_slot(conn, slot: str, publication: str | None = None) -> None:
    """Drop the slot (if it exists) and the publication: an abandoned slot keeps WAL forever."""
    await conn.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    )
    if publication:
        await conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(publication)))


@dataclass
class Transaction:
    """One committed transaction as the slot delivers it: ``changes`` is ``[(op, table, row)]``."""

    xid: int
    commit_lsn: str = ""
    end_lsn: str = ""
    changes: list[tuple[str, str, dict]] = field(default_factory=list)


def _lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


class Decoder:
    """Decodes pgoutput protocol-1 messages; keeps the relations it has been told about."""

    def __init__(self) -> None:
        self.relations: dict[int, tuple[str, list[str]]] = {}
        self._open: Transaction | None = None

    def _string(self, data: bytes, pos: int) -> tuple[str, int]:
        end = data.index(b"\0", pos)
        return data[pos:end].decode(), end + 1

    def _tuple(self, data: bytes, pos: int, names: list[str]) -> tuple[dict, int]:
        (n,) = struct.unpack_from("!h", data, pos)
        pos += 2
        row = {}
        for i in range(n):
            kind = data[pos : pos + 1]
            pos += 1
            name = names[i] if i < len(names) else f"col{i}"
            if kind == b"n":
                row[name] = None
            elif kind == b"u":
                row[name] = "(unchanged toast)"
            else:  # b"t" text or b"b" binary
                (length,) = struct.unpack_from("!i", data, pos)
                pos += 4
                raw = data[pos : pos + length]
                pos += length
                row[name] = raw.decode() if kind == b"t" else raw
        return row, pos

    def feed(self, data: bytes) -> Transaction | None:
        """Decode one message; returns the transaction when its Commit arrives."""
        kind = data[:1]
        if kind == b"B":
            _final, _ts, xid = struct.unpack_from("!qqi", data, 1)
            self._open = Transaction(xid=xid)
        elif kind == b"R":
            (oid,) = struct.unpack_from("!I", data, 1)
            namespace, pos = self._string(data, 5)
            name, pos = self._string(data, pos)
            pos += 1  # replica identity
            (ncols,) = struct.unpack_from("!h", data, pos)
            pos += 2
            cols = []
            for _ in range(ncols):
                pos += 1  # flags
                col, pos = self._string(data, pos)
                pos += 8  # type oid, type modifier
                cols.append(col)
            self.relations[oid] = (name if namespace in ("public", "") else f"{namespace}.{name}", cols)
        elif kind in (b"I", b"U", b"D") and self._open is not None:
            (oid,) = struct.unpack_from("!I", data, 1)
            table, cols = self.relations.get(oid, (str(oid), []))
            pos = 5
            row: dict = {}
            while pos < len(data):
                marker = data[pos : pos + 1]
                row, pos = self._tuple(data, pos + 1, cols)
                if marker == b"N":  # the new row ends the message
                    break
            op = {b"I": "insert", b"U": "update", b"D": "delete"}[kind]
            self._open.changes.append((op, table, row))
        elif kind == b"C" and self._open is not None:
            _flags, commit, end, _ts = struct.unpack_from("!bqqq", data, 1)
            done, self._open = self._open, None
            done.commit_lsn, done.end_lsn = _lsn(commit), _lsn(end)
            return done
        return None


async def read(
    conn, slot: str, publication: str, *, peek: bool = True, limit: int | None = None
) -> list[Transaction]:
    """Committed transactions waiting in the slot, in commit order.

    ``peek=True`` leaves them there (confirm later with :func:`advance`); ``peek=False``
    consumes them as it reads. ``limit`` caps the number of changes read (whole
    transactions are always returned).
    """
    fn = "pg_logical_slot_peek_binary_changes" if peek else "pg_logical_slot_get_binary_changes"
    cur = await conn.execute(
        sql.SQL("SELECT data FROM {}(%s, NULL, %s, 'proto_version', '1', 'publication_names', %s)").format(
            sql.Identifier(fn)
        ),
        (slot, limit, publication),
    )
    decoder = Decoder()
    out = []
    for (data,) in await cur.fetchall():
        done = decoder.feed(bytes(data))
        if done is not None:
            out.append(done)
    return out


async def advance(conn, slot: str, lsn: str) -> None:
    """Confirm everything up to ``lsn``: the server may now recycle the WAL before it."""
    await conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, lsn))


async def slot_status(conn, slot: str) -> dict | None:
    """``{active, restart_lsn, confirmed_flush_lsn, retained_bytes, wal_status, safe_wal_size}``."""
    cur = await conn.execute(
        """
        SELECT active, restart_lsn::text, confirmed_flush_lsn::text,
               pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint, wal_status, safe_wal_size
        FROM pg_replication_slots WHERE slot_name = %s
        """,
        (slot,),
    )
    row = await cur.fetchone()
    if row is None:
        return None
    keys = ("active", "restart_lsn", "confirmed_flush_lsn", "retained_bytes", "wal_status", "safe_wal_size")
    return dict(zip(keys, row, strict=True))


async def relay_from_slot(
    conn, redis, stream: str, slot: str, publication: str, *, table: str = "outbox", page: int = 1000
) -> int:
    """The CDC relay: peek the outbox inserts, XADD them in commit order, then advance the slot.

    Reads ``page`` changes at a time (whole transactions), publishes and confirms them, and
    goes on until the slot is drained: a slot that fell a million changes behind is never
    decoded into memory at once. A crash between the XADD and the advance republishes at
    most one page (at-least-once, like the polling relay). Returns the number of events
    published. Row values arrive as text (pgoutput's text format): ``payload`` is the JSON
    text of the jsonb column.
    """
    n = 0
    while txns := await read(conn, slot, publication, peek=True, limit=page):
        pipe = redis.pipeline(transaction=False)
        for txn in txns:
            for op, name, row in txn.changes:
                if op == "insert" and name == table:
                    pipe.xadd(
                        stream,
                        {k: row[k] for k in ("aggregate_type", "aggregate_id", "event_type", "payload")}
                        | {"event_id": row["id"]},
                    )
                    n += 1
        await pipe.execute()
        await advance(conn, slot, txns[-1].end_lsn)
    return n
