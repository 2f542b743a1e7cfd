"""Chapter 09 grading: the wrong answers learners write are rejected for the reason the chapter
teaches, and correct variants (other cursor encodings, other hash functions, other ring
structures) pass. The writes between pages are made by the check in a fixed order, so every
verdict here is the same on every run.
"""

from __future__ import annotations

import pytest

from autograder.checks.ch09 import CURSOR_SECRET
from tests.helpers import assert_accepted, assert_rejected

HEADER = f"""
import base64, hashlib, hmac, json, os
from datetime import datetime
from course.pagination import InvalidCursor
CURSOR_SECRET = {CURSOR_SECRET!r}
"""

# ----------------------------------------------------------------------------- keyset_page

CODEC = """
def _encode(created_at, id_):
    body = json.dumps({"v": 1, "t": created_at.isoformat(), "id": id_}).encode()
    sig = hmac.new(CURSOR_SECRET, body, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(body + sig).decode()


def _decode(cursor):
    try:
        raw = base64.urlsafe_b64decode(cursor.encode())
        body, sig = raw[:-32], raw[-32:]
    except Exception as err:
        raise InvalidCursor("malformed cursor") from err
    if len(raw) <= 32 or not hmac.compare_digest(sig, hmac.new(CURSOR_SECRET, body, hashlib.sha256).digest()):
        raise InvalidCursor("cursor signature does not match")
    data = json.loads(body)
    return datetime.fromisoformat(data["t"]), data["id"]
"""

KEYSET = (
    HEADER
    + CODEC
    + """
async def keyset_page(pool, cursor, limit):
    async with pool.connection() as conn:
        if cursor is None:
            cur = await conn.execute(
                "SELECT id, created_at, title FROM ch09_posts ORDER BY created_at DESC, id DESC LIMIT %s",
                (limit + 1,))
        else:
            ts, last = _decode(cursor)
            cur = await conn.execute(
                "SELECT id, created_at, title FROM ch09_posts WHERE (created_at, id) < (%s, %s) "
                "ORDER BY created_at DESC, id DESC LIMIT %s", (ts, last, limit + 1))
        rows = await cur.fetchall()
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (_encode(rows[-1][1], rows[-1][0]) if more else None)
"""
)

# the expanded form of the row comparison, and "payload.signature" in hex
EXPANDED_HEX = (
    HEADER
    + """
def _sign(text):
    return hmac.new(CURSOR_SECRET, text.encode(), hashlib.sha256).hexdigest()


async def keyset_page(pool, cursor, limit):
    where, args = "", []
    if cursor is not None:
        try:
            text, sig = cursor.split("~")
        except ValueError:
            raise InvalidCursor("bad cursor") from None
        if not hmac.compare_digest(sig, _sign(text)):
            raise InvalidCursor("bad signature")
        ts, last = text.split("|")
        where = "WHERE created_at < %s OR (created_at = %s AND id < %s)"
        args = [datetime.fromisoformat(ts), datetime.fromisoformat(ts), int(last)]
    async with pool.connection() as conn:
        cur = await conn.execute(
            f"SELECT id, created_at, title FROM ch09_posts {where} ORDER BY created_at DESC, id DESC LIMIT %s",
            (*args, limit + 1))
        rows = await cur.fetchall()
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    text = f"{rows[-1][1].isoformat()}|{rows[-1][0]}"
    return rows, f"{text}~{_sign(text)}"
"""
)

# the course's own codec, rows as dicts
WITH_CODEC = f"""
from course.pagination import CursorCodec, InvalidCursor
CURSOR_SECRET = {CURSOR_SECRET!r}
codec = CursorCodec(CURSOR_SECRET)


async def keyset_page(pool, cursor, limit):
    async with pool.connection() as conn:
        if cursor is None:
            cur = await conn.execute("SELECT id, created_at, title FROM ch09_posts "
                                     "ORDER BY created_at DESC, id DESC LIMIT %s", (limit + 1,))
        else:
            ts, last = codec.decode(cursor)
            cur = await conn.execute("SELECT id, created_at, title FROM ch09_posts WHERE (created_at, id) < (%s, %s) "
                                     "ORDER BY created_at DESC, id DESC LIMIT %s", (ts, last, limit + 1))
        rows = [dict(zip(("id", "created_at", "title"), r)) for r in await cur.fetchall()]
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, codec.encode([rows[-1]["created_at"], rows[-1]["id"]]) if more else None
"""

# "has more" from a COUNT(*) instead of limit + 1: slower, still correct
COUNTED = KEYSET.replace(
    """    more = len(rows) > limit
    rows = rows[:limit]""",
    """    rows = rows[:limit]
    more = False
    if rows:
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT EXISTS (SELECT 1 FROM ch09_posts WHERE (created_at, id) < (%s, %s))",
                                     (rows[-1][1], rows[-1][0]))
            more = (await cur.fetchone())[0]""",
)

OFFSET_PAGES = (
    HEADER
    + """
def _sign(text):
    return hmac.new(CURSOR_SECRET, text.encode(), hashlib.sha256).hexdigest()


async def keyset_page(pool, cursor, limit):
    offset = 0
    if cursor is not None:
        text, _, sig = cursor.partition(".")
        if not sig or not hmac.compare_digest(sig, _sign(text)):
            raise InvalidCursor("bad cursor")
        offset = int(text)
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, created_at, title FROM ch09_posts ORDER BY created_at DESC, id DESC "
                                 "LIMIT %s OFFSET %s", (limit + 1, offset))
        rows = await cur.fetchall()
    if len(rows) <= limit:
        return rows, None
    nxt = str(offset + limit)
    return rows[:limit], f"{nxt}.{_sign(nxt)}"
"""
)

NO_TIE_BREAKER = KEYSET.replace(
    'WHERE (created_at, id) < (%s, %s) "\n                "ORDER BY created_at DESC, id DESC LIMIT %s", (ts, last, limit + 1))',
    'WHERE created_at < %s "\n                "ORDER BY created_at DESC, id DESC LIMIT %s", (ts, limit + 1))',
)
LTE_REPEATS = KEYSET.replace("WHERE (created_at, id) < (%s, %s)", "WHERE (created_at, id) <= (%s, %s)")
NO_LIMIT_PLUS_ONE = (
    KEYSET.replace("(limit + 1,)", "(limit,)")
    .replace("(ts, last, limit + 1)", "(ts, last, limit)")
    .replace("more = len(rows) > limit", "more = len(rows) == limit")
)
ID_ONLY_CURSOR = (
    HEADER
    + """
def _sign(text):
    return hmac.new(CURSOR_SECRET, text.encode(), hashlib.sha256).hexdigest()


async def keyset_page(pool, cursor, limit):
    where, args = "", []
    if cursor is not None:
        text, _, sig = cursor.partition(".")
        if not sig or not hmac.compare_digest(sig, _sign(text)):
            raise InvalidCursor("bad cursor")
        where = "WHERE (created_at, id) < (SELECT created_at, id FROM ch09_posts WHERE id = %s)"
        args = [int(text)]
    async with pool.connection() as conn:
        cur = await conn.execute(f"SELECT id, created_at, title FROM ch09_posts {where} "
                                 "ORDER BY created_at DESC, id DESC LIMIT %s", (*args, limit + 1))
        rows = await cur.fetchall()
    if len(rows) <= limit:
        return rows, None
    last = str(rows[limit - 1][0])
    return rows[:limit], f"{last}.{_sign(last)}"
"""
)
UNSIGNED_CURSOR = (
    HEADER
    + """
async def keyset_page(pool, cursor, limit):
    args, where = [], ""
    if cursor is not None:
        try:
            data = json.loads(base64.urlsafe_b64decode(cursor.encode()))
            args = [datetime.fromisoformat(data["t"]), int(data["id"])]
        except Exception as err:
            raise InvalidCursor("malformed cursor") from err
        where = "WHERE (created_at, id) < (%s, %s)"
    async with pool.connection() as conn:
        cur = await conn.execute(f"SELECT id, created_at, title FROM ch09_posts {where} "
                                 "ORDER BY created_at DESC, id DESC LIMIT %s", (*args, limit + 1))
        rows = await cur.fetchall()
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    body = json.dumps({"t": rows[-1][1].isoformat(), "id": rows[-1][0]})
    return rows, base64.urlsafe_b64encode(body.encode()).decode()
"""
)
PER_PROCESS_SECRET = KEYSET + "\nCURSOR_SECRET = os.urandom(32)  # made anew by every process\n"
MATERIALISED = (
    HEADER
    + """
def _sign(text):
    return hmac.new(CURSOR_SECRET, text.encode(), hashlib.sha256).hexdigest()


async def keyset_page(pool, cursor, limit):
    if cursor is None:  # the whole feed as of the first page, carried in the cursor
        async with pool.connection() as conn:
            cur = await conn.execute("SELECT id FROM ch09_posts ORDER BY created_at DESC, id DESC")
            ids = [r[0] for r in await cur.fetchall()]
    else:
        text, _, sig = cursor.partition(".")
        if not sig or not hmac.compare_digest(sig, _sign(text)):
            raise InvalidCursor("bad cursor")
        ids = json.loads(base64.urlsafe_b64decode(text))
    page, rest = ids[:limit], ids[limit:]
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT id, created_at, title FROM ch09_posts WHERE id = ANY(%s)", (page,))
        found = {r[0]: r for r in await cur.fetchall()}
    rows = [found.get(i, (i, None, None)) for i in page]
    if not rest:
        return rows, None
    text = base64.urlsafe_b64encode(json.dumps(rest).encode()).decode()
    return rows, f"{text}.{_sign(text)}"
"""
)
WRONG_EXCEPTION = KEYSET.replace(
    'raise InvalidCursor("malformed cursor") from err', "raise ValueError('bad') from err"
).replace('raise InvalidCursor("cursor signature does not match")', "raise ValueError('bad signature')")

# ----------------------------------------------------------------------------- hash_ring

RING_MD5 = """
import bisect, hashlib


class HashRing:
    def __init__(self, vnodes=160):
        self.vnodes = vnodes
        self.points = []

    @staticmethod
    def _h(text):
        return int.from_bytes(hashlib.md5(text.encode()).digest()[:8], "big")

    def add_node(self, node):
        for i in range(self.vnodes):
            bisect.insort(self.points, (self._h(f"{node}#{i}"), node))

    def remove_node(self, node):
        self.points = [p for p in self.points if p[1] != node]

    def node_for(self, key):
        i = bisect.bisect_left(self.points, (self._h(key), ""))
        return self.points[i % len(self.points)][1]
"""
RING_SHA256_DICT = """
import bisect, hashlib


def _h(text):
    return int(hashlib.sha256(text.encode()).hexdigest()[:16], 16)


class HashRing:
    def __init__(self, vnodes=128):
        self.vnodes = vnodes
        self.owner = {}
        self.keys = []

    def add_node(self, node):
        for i in range(self.vnodes):
            point = _h(f"{node}-vnode-{i}")
            if point not in self.owner or node < self.owner[point]:
                self.owner[point] = node
        self.keys = sorted(self.owner)

    def remove_node(self, node):
        self.owner = {p: n for p, n in self.owner.items() if n != node}
        self.keys = sorted(self.owner)

    def node_for(self, key):
        i = bisect.bisect(self.keys, _h(key))
        return self.owner[self.keys[i % len(self.keys)]]
"""
RING_CRC32 = """
import bisect, zlib


class HashRing:
    def __init__(self, vnodes=200):
        self.vnodes = vnodes
        self.points = []

    def add_node(self, node):
        self.points += [(zlib.crc32(f"{i}:{node}".encode()), node) for i in range(self.vnodes)]
        self.points.sort()

    def remove_node(self, node):
        self.points = [p for p in self.points if p[1] != node]

    def node_for(self, key):
        i = bisect.bisect_left(self.points, (zlib.crc32(key.encode()), ""))
        return self.points[i % len(self.points)][1]
"""
RING_BLAKE2_FAST = """
import bisect, hashlib


class HashRing:
    def __init__(self):
        self.points, self.names = [], []

    def add_node(self, node):
        for i in range(150):
            p = int.from_bytes(hashlib.blake2b(f"{node}/{i}".encode(), digest_size=8).digest(), "big")
            j = bisect.bisect_left(self.points, p)
            self.points.insert(j, p)
            self.names.insert(j, node)

    def remove_node(self, node):
        kept = [(p, n) for p, n in zip(self.points, self.names) if n != node]
        self.points = [p for p, _ in kept]
        self.names = [n for _, n in kept]

    def node_for(self, key):
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
        return self.names[bisect.bisect_left(self.points, h) % len(self.points)]
"""
MODULO = """
import hashlib


class HashRing:
    def __init__(self):
        self.nodes = []

    def add_node(self, node):
        self.nodes.append(node)
        self.nodes.sort()

    def remove_node(self, node):
        self.nodes.remove(node)

    def node_for(self, key):
        return self.nodes[int(hashlib.md5(key.encode()).hexdigest(), 16) % len(self.nodes)]
"""
ONE_POINT = RING_MD5.replace("def __init__(self, vnodes=160)", "def __init__(self, vnodes=1)")
PYTHON_HASH = RING_MD5.replace(
    """        return int.from_bytes(hashlib.md5(text.encode()).digest()[:8], "big")""",
    """        return hash(text) & 0xFFFFFFFFFFFFFFFF""",
)
ORDER_DEPENDENT = RING_MD5.replace(
    """    def add_node(self, node):
        for i in range(self.vnodes):
            bisect.insort(self.points, (self._h(f"{node}#{i}"), node))""",
    """    def add_node(self, node):
        n = len({name for _, name in self.points})  # the node's number: its place in the order of arrival
        for i in range(self.vnodes):
            bisect.insort(self.points, (self._h(f"{n}#{i}"), node))""",
)
REBUILT_BY_INDEX = """
import bisect, hashlib


class HashRing:
    '''Points named after each node's index in the sorted list: a new name shifts the others.'''

    def __init__(self, vnodes=160):
        self.vnodes, self.nodes, self.points = vnodes, [], []

    def _rebuild(self):
        self.points = sorted(
            (int.from_bytes(hashlib.md5(f"{i}#{v}".encode()).digest()[:8], "big"), node)
            for i, node in enumerate(self.nodes) for v in range(self.vnodes))

    def add_node(self, node):
        self.nodes = sorted(set(self.nodes) | {node})
        self._rebuild()

    def remove_node(self, node):
        self.nodes.remove(node)
        self._rebuild()

    def node_for(self, key):
        h = int.from_bytes(hashlib.md5(key.encode()).digest()[:8], "big")
        return self.points[bisect.bisect_left(self.points, (h, "")) % len(self.points)][1]
"""
REMOVE_RESHUFFLES = RING_MD5.replace(
    """    def remove_node(self, node):
        self.points = [p for p in self.points if p[1] != node]""",
    """    def remove_node(self, node):
        names = sorted({n for _, n in self.points} - {node})
        self.points = []
        self.vnodes = max(1, self.vnodes - 10)  # "fewer nodes, fewer points each"
        for name in names:
            self.add_node(name)""",
)

# a signed cursor that differs on every call: the time it was made ("iat", a float whose digits, and
# so the cursor's length, vary) or a random nonce inside the signed body; the check's changes are
# spread over the cursor by fractions of its length and no line quotes that length, so both get the
# same lines on every run
ISSUED_AT = KEYSET.replace("import base64,", "import time, base64,").replace(
    '{"v": 1, "t": created_at.isoformat(), "id": id_}',
    '{"v": 1, "t": created_at.isoformat(), "id": id_, "iat": time.time()}',
)
NONCE = KEYSET.replace("import base64,", "import secrets, base64,").replace(
    '{"v": 1, "t": created_at.isoformat(), "id": id_}',
    '{"v": 1, "t": created_at.isoformat(), "id": id_, "n": secrets.token_hex(4)}',
)
assert "import time, base64" in ISSUED_AT and '"iat"' in ISSUED_AT
assert "import secrets, base64" in NONCE and '"n"' in NONCE

# audit C, second pass: rings correct by the text whose worst node was 32 % to 58 % from the mean (crc32 of
# sequential labels is lumpy; even blake2b reaches 33 % with 128 points): the bound is now 65 %
RING_CRC32_NODE_COLON_I = RING_CRC32.replace('f"{i}:{node}"', 'f"{node}:{i}"')
RING_CRC32_DOT_180 = RING_CRC32.replace('f"{i}:{node}"', 'f"{node}.{i}"').replace("vnodes=200", "vnodes=180")
RING_BLAKE2B_128 = """
import bisect, hashlib


def _h(s):
    return int(hashlib.blake2b(s.encode()).hexdigest(), 16)


class HashRing:
    def __init__(self):
        self.points = []

    def add_node(self, node):
        self.points = sorted(self.points + [(_h(f"{node}:{i}"), node) for i in range(128)])

    def remove_node(self, node):
        self.points = [p for p in self.points if p[1] != node]

    def node_for(self, key):
        i = bisect.bisect_left(self.points, (_h(key), ""))
        return self.points[i % len(self.points)][1]
"""
assert 'f"{node}:{i}"' in RING_CRC32_NODE_COLON_I and 'f"{node}.{i}"' in RING_CRC32_DOT_180

# drops the fraction of a second from the cursor's timestamp: the check's rows are 0.250001 s apart, ties in
# one second, so the next page starts inside the cursor's own second and repeats or skips rows
DROPS_MICROSECONDS = KEYSET.replace('"t": created_at.isoformat()', '"t": created_at.replace(microsecond=0).isoformat()')
assert DROPS_MICROSECONDS != KEYSET

# a refused cursor swallowed: the signature check works, then page 1 is served again
SWALLOWS_INVALID_CURSOR = KEYSET.replace(
    """async def keyset_page(pool, cursor, limit):
""",
    """async def keyset_page(pool, cursor, limit):
    try:
        if cursor is not None:
            _decode(cursor)
    except InvalidCursor:
        cursor = None  # a broken cursor: start again from the first page
""",
)
assert SWALLOWS_INVALID_CURSOR != KEYSET

# a tie-breaker that compares id the other way than ORDER BY sorts it
TIE_BREAKER_WRONG_WAY = KEYSET.replace(
    """WHERE (created_at, id) < (%s, %s) "
                "ORDER BY created_at DESC, id DESC LIMIT %s", (ts, last, limit + 1))""",
    """WHERE created_at < %s OR (created_at = %s AND id > %s) "
                "ORDER BY created_at DESC, id DESC LIMIT %s", (ts, ts, last, limit + 1))""",
)
assert TIE_BREAKER_WRONG_WAY != KEYSET

# keys hashed into 32 bits, points into 64: every key sorts before almost every point
KEYS_IN_32_BITS = RING_MD5.replace(
    """        i = bisect.bisect_left(self.points, (self._h(key), ""))""",
    """        i = bisect.bisect_left(self.points, (self._h(key) >> 32, ""))""",
)
assert KEYS_IN_32_BITS != RING_MD5

# no wrap-around: a key past the last point has no index
NO_WRAP = RING_MD5.replace("return self.points[i % len(self.points)][1]", "return self.points[i][1]")
assert NO_WRAP != RING_MD5

# positions in a sorted list, owners in a dict: remove_node forgets the owners and keeps the positions
STALE_POSITIONS = """
import bisect, hashlib


class HashRing:
    def __init__(self, vnodes=160):
        self.vnodes = vnodes
        self.keys = []
        self.owner = {}

    @staticmethod
    def _h(text):
        return int.from_bytes(hashlib.md5(text.encode()).digest()[:8], "big")

    def add_node(self, node):
        for i in range(self.vnodes):
            p = self._h(f"{node}#{i}")
            self.owner[p] = node
            bisect.insort(self.keys, p)

    def remove_node(self, node):
        self.owner = {p: n for p, n in self.owner.items() if n != node}

    def node_for(self, key):
        i = bisect.bisect_left(self.keys, self._h(key))
        return self.owner[self.keys[i % len(self.keys)]]
"""

# the chapter's reference pager, called: no query of its own
CALLS_FETCH_PAGE = (
    HEADER
    + """
from course.pagination import CursorCodec, Keyset, fetch_page

POSTS = Keyset("ch09_posts", ("id", "created_at", "title"), (("created_at", True), ("id", True)))


async def keyset_page(pool, cursor, limit):
    page = await fetch_page(pool, POSTS, CursorCodec(CURSOR_SECRET), after=cursor, limit=limit)
    return page.rows, page.next
"""
)

WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "keyset_page": {
        "offset_pages": (OFFSET_PAGES, "OFFSET"),
        "no_tie_breaker": (NO_TIE_BREAKER, "tie-breaker"),
        "lte_repeats": (LTE_REPEATS, "not strict"),
        "no_limit_plus_one": (NO_LIMIT_PLUS_ONE, "LIMIT n + 1"),
        "id_only_cursor": (ID_ONLY_CURSOR, "sort values"),
        "materialised_snapshot": (MATERIALISED, "deleted before their page was read"),
        "unsigned_cursor": (UNSIGNED_CURSOR, "sign the cursor"),
        "per_process_secret": (PER_PROCESS_SECRET, "shared CURSOR_SECRET"),
        "wrong_exception": (WRONG_EXCEPTION, "expected InvalidCursor"),
        "cursor_drops_microseconds": (DROPS_MICROSECONDS, "microseconds"),
        "swallows_invalid_cursor": (SWALLOWS_INVALID_CURSOR, "Let InvalidCursor reach the caller"),
        "tie_breaker_wrong_way": (TIE_BREAKER_WRONG_WAY, "runs the other way"),
        "calls_fetch_page": (CALLS_FETCH_PAGE, "write the query yourself"),
    },
    "hash_ring": {
        "modulo": (MODULO, "hash(key) % len(nodes)"),
        "one_point_per_node": (ONE_POINT, "virtual nodes"),
        "python_hash": (PYTHON_HASH, "salted per process"),
        "order_dependent": (ORDER_DEPENDENT, "opposite order"),
        "rebuilt_sorted_by_index": (REBUILT_BY_INDEX, "position in a list"),
        "remove_reshuffles": (REMOVE_RESHUFFLES, "node-3 removed"),
        "keys_in_32_bits": (KEYS_IN_32_BITS, "same range"),
        "no_wrap_around": (NO_WRAP, "wraps around"),
        "stale_positions_after_remove": (STALE_POSITIONS, "Remove the node's points everywhere"),
    },
}

CORRECT: dict[str, dict[str, str]] = {
    "keyset_page": {
        "row_comparison_b64_hmac": KEYSET,
        "expanded_or_hex_signature": EXPANDED_HEX,
        "course_codec_dict_rows": WITH_CODEC,
        "exists_instead_of_limit_plus_one": COUNTED,
        "issued_at_in_signed_cursor": ISSUED_AT,
        "nonce_in_signed_cursor": NONCE,
    },
    "hash_ring": {
        "md5_bisect": RING_MD5,
        "sha256_dict_128": RING_SHA256_DICT,
        "crc32_200": RING_CRC32,
        "blake2b_parallel_lists_150": RING_BLAKE2_FAST,
        "crc32_node_colon_i_200": RING_CRC32_NODE_COLON_I,
        "crc32_node_dot_i_180": RING_CRC32_DOT_180,
        "blake2b_128": RING_BLAKE2B_128,
    },
}


@pytest.mark.parametrize(("task_id", "name"), [(t, n) for t, cases in WRONG.items() for n in cases], ids=lambda x: x)
def test_09_wrong_answer_is_rejected_for_its_reason(task_id, name):
    source, mentions = WRONG[task_id][name]
    assert_rejected(task_id, source, mentions=mentions)


@pytest.mark.parametrize(("task_id", "name"), [(t, n) for t, cases in CORRECT.items() for n in cases], ids=lambda x: x)
def test_09_correct_variant_is_accepted(task_id, name):
    assert_accepted(task_id, CORRECT[task_id][name])
