"""Keyset pagination with opaque, signed, versioned cursors (taught in chapter 09).

OFFSET pages cost more the deeper they go and skip or repeat rows when rows are inserted
or deleted between pages. A keyset page continues from the *values* of the last row seen
instead: ``WHERE (created_at, id) < (%s, %s) ORDER BY created_at DESC, id DESC LIMIT n + 1``.
The unique ``id`` breaks ties, so the order is total; ``n + 1`` rows tell "has more"
without a count; an index on the same columns in the same directions makes every page a
short range scan.

The cursor a client gets is opaque: base64url of a small JSON payload (a version, the sort
values, a fingerprint of the filter and sort it was made for) and an HMAC of it under a
server-side secret. Base64 is not encryption: a client can decode and read the payload,
but it cannot change it without the signature failing (encrypt the payload too, e.g. with
AES-GCM, if its values must stay private). An old version is rejected by name, and a cursor
made for another filter or sort is refused instead of silently returning the wrong rows.

    codec = CursorCodec(b"server secret")
    page = await fetch_page(pool, POSTS, codec, after=token, limit=20)
    page.rows, page.next, page.prev
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from uuid import UUID

from psycopg import sql

__all__ = ["CursorCodec", "InvalidCursor", "Keyset", "Page", "fetch_page", "seek_condition"]


class InvalidCursor(ValueError):
    """A cursor that was altered, made with another secret or version, or for another query."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _to_json(value):
    if isinstance(value, datetime):
        return {"dt": value.isoformat()}
    if isinstance(value, date):
        return {"d": value.isoformat()}
    if isinstance(value, UUID):
        return {"u": str(value)}
    if isinstance(value, Decimal):
        return {"n": str(value)}
    return value


def _from_json(value):
    if isinstance(value, dict):
        (tag, text), *_ = value.items()
        return {"dt": datetime.fromisoformat, "d": date.fromisoformat, "u": UUID, "n": Decimal}[tag](text)
    return value


@dataclass(frozen=True)
class CursorCodec:
    """Encodes a page position as an opaque, tamper-evident token.

    ``secret`` is shared by every replica of the service (configuration, never
    ``os.urandom`` at import: another replica could not read the cursor). ``version`` is
    written into each cursor; ``accepts`` lists the versions :meth:`decode` still takes.
    """

    secret: bytes
    version: int = 1
    accepts: tuple[int, ...] = (1,)

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self.secret, payload, hashlib.sha256).digest()[:16]

    def encode(self, values: Sequence, *, binding: str = "") -> str:
        """A token for the position ``values`` (the sort key of the last row), bound to ``binding``."""
        payload = json.dumps(
            {"v": self.version, "k": [_to_json(v) for v in values], "b": _fingerprint(binding)},
            separators=(",", ":"),
        ).encode()
        return f"{_b64(payload)}.{_b64(self._sign(payload))}"

    def decode(self, token: str, *, binding: str = "") -> list:
        """The sort values in ``token``; :class:`InvalidCursor` when it cannot be trusted."""
        try:
            body, sig = token.split(".")
            payload, mac = _unb64(body), _unb64(sig)
        except (ValueError, AttributeError) as err:
            raise InvalidCursor("malformed cursor") from err
        if not hmac.compare_digest(mac, self._sign(payload)):
            raise InvalidCursor("cursor signature does not match: altered, or made with another secret")
        data = json.loads(payload)
        if data.get("v") not in self.accepts:
            raise InvalidCursor(
                f"cursor version {data.get('v')} is no longer accepted (accepts {self.accepts})"
            )
        if data.get("b") != _fingerprint(binding):
            raise InvalidCursor("cursor was made for another filter or sort order: start again from page 1")
        return [_from_json(v) for v in data["k"]]


def _fingerprint(binding: str) -> str:
    return hashlib.sha256(binding.encode()).hexdigest()[:12]


def seek_condition(columns: Sequence[str], descending: Sequence[bool]) -> sql.Composed:
    """``WHERE`` condition for "strictly after this position" in the given sort order.

    One direction for every column: a row comparison, ``(a, b) < (%s, %s)``, which
    PostgreSQL matches to a btree index on ``(a, b)``. Mixed directions cannot use a
    row comparison, so it is expanded: ``a < %s OR (a = %s AND b > %s)``. That OR alone
    gives the index scan no place to start, so PostgreSQL reads the index from its first
    entry and filters every row before the cursor (as costly as OFFSET). A redundant bound on
    the first column, ``a <= %s AND (a < %s OR (a = %s AND b > %s))``, is an index condition:
    the scan starts at the cursor. The parameters are the values repeated, as
    :func:`seek_params` gives them.
    """
    idents = [sql.Identifier(c) for c in columns]
    if len(set(descending)) == 1:
        op = sql.SQL("<" if descending[0] else ">")
        cols = sql.SQL(", ").join(idents)
        marks = sql.SQL(", ").join(sql.Placeholder() * len(columns))
        return sql.SQL("({}) {} ({})").format(cols, op, marks)
    terms = []
    for i, ident in enumerate(idents):
        equal = [sql.SQL("{} = %s").format(idents[j]) for j in range(i)]
        strict = sql.SQL("{} {} %s").format(ident, sql.SQL("<" if descending[i] else ">"))
        terms.append(sql.SQL("({})").format(sql.SQL(" AND ").join([*equal, strict])))
    bound = sql.SQL("{} {} %s").format(idents[0], sql.SQL("<=" if descending[0] else ">="))
    return sql.SQL("{} AND ({})").format(bound, sql.SQL(" OR ").join(terms))


def seek_params(values: Sequence, descending: Sequence[bool]) -> list:
    """Parameters for :func:`seek_condition` with the position ``values``."""
    if len(set(descending)) == 1:
        return list(values)
    return [values[0], *(v for i in range(len(values)) for v in [*values[:i], values[i]])]


@dataclass(frozen=True)
class Keyset:
    """What a paginated listing is: the table, the columns returned, the total sort order.

    ``order`` must end in a unique column (the tie-breaker), e.g.
    ``(("created_at", True), ("id", True))`` for newest first. ``where`` is a fixed SQL
    filter with ``params``; it is part of every cursor's binding.
    """

    table: str
    columns: tuple[str, ...]
    order: tuple[tuple[str, bool], ...]
    where: str = "TRUE"
    params: tuple = ()

    @property
    def binding(self) -> str:
        return json.dumps([self.table, self.order, self.where, [str(p) for p in self.params]])


@dataclass
class Page:
    rows: list[tuple]
    next: str | None  # cursor for the page after this one, None on the last page
    prev: str | None = None  # cursor for the page before this one, None on the first
    sql: str = field(default="", repr=False)


async def fetch_page(
    pool,
    keyset: Keyset,
    codec: CursorCodec,
    *,
    after: str | None = None,
    before: str | None = None,
    limit: int = 20,
) -> Page:
    """One page of ``keyset``: rows after the cursor ``after`` (or before ``before``).

    Reads ``limit + 1`` rows: the extra row only says whether another page exists. A
    backwards page runs the same query with every direction flipped, then reverses it.
    """
    if after is not None and before is not None:
        raise ValueError("pass after or before, not both")
    sort_cols = [c for c, _ in keyset.order]
    desc = [d for _, d in keyset.order]
    backwards = before is not None
    run_desc = [not d for d in desc] if backwards else desc
    conditions = [sql.SQL(keyset.where)]
    params: list = list(keyset.params)
    token = before if backwards else after
    if token is not None:
        position = codec.decode(token, binding=keyset.binding)
        if len(position) != len(sort_cols):
            raise InvalidCursor("cursor does not fit this sort order")
        conditions.append(seek_condition(sort_cols, run_desc))
        params += seek_params(position, run_desc)
    order = sql.SQL(", ").join(
        sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL("DESC" if d else "ASC"))
        for c, d in zip(sort_cols, run_desc, strict=True)
    )
    query = sql.SQL("SELECT {} FROM {} WHERE {} ORDER BY {} LIMIT {}").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in keyset.columns + tuple(sort_cols)),
        sql.Identifier(keyset.table),
        sql.SQL(" AND ").join(conditions),
        order,
        sql.Literal(limit + 1),
    )
    async with pool.connection() as conn:
        cur = await conn.execute(query, params)
        got = await cur.fetchall()
        text = query.as_string(conn)
    more = len(got) > limit
    got = got[:limit]
    if backwards:
        got.reverse()
    width = len(keyset.columns)
    rows = [tuple(r[:width]) for r in got]
    keys = [tuple(r[width:]) for r in got]
    has_next = (more if not backwards else True) and bool(keys)
    has_prev = (more if backwards else token is not None) and bool(keys)
    return Page(
        rows,
        codec.encode(keys[-1], binding=keyset.binding) if has_next else None,
        codec.encode(keys[0], binding=keyset.binding) if has_prev else None,
        text,
    )
