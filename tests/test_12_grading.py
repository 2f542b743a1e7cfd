"""Chapter 12's checks reject the shorteners learners plausibly write wrong and accept the right ones."""

from __future__ import annotations

import pytest

from tests.helpers import assert_accepted, assert_rejected

# ============================================================================ codes: right

FEISTEL = """
import hashlib
from course.shortener import ALPHABET, CODE_KEY, ID_SPACE

def _f(i, half):
    return int.from_bytes(hashlib.blake2b(bytes([i]) + half.to_bytes(3, "big"), key=CODE_KEY, digest_size=3).digest(), "big") & 0x1FFFFF

def _perm(n, inverse=False):
    left, right = n >> 21, n & 0x1FFFFF
    for i in (reversed(range(4)) if inverse else range(4)):
        if inverse:
            left, right = right ^ _f(i, left), left
        else:
            left, right = right, left ^ _f(i, right)
    return (left << 21) | right

def encode_code(n):
    if not 0 <= n < ID_SPACE:
        raise ValueError(n)
    n = _perm(n)
    while n >= ID_SPACE:
        n = _perm(n)
    out = ""
    for _ in range(7):
        n, d = divmod(n, 62)
        out = ALPHABET[d] + out
    return out

def decode_code(code):
    if not isinstance(code, str) or len(code) != 7 or any(ch not in ALPHABET for ch in code):
        raise ValueError(code)
    n = 0
    for ch in code:
        n = n * 62 + ALPHABET.index(ch)
    n = _perm(n, inverse=True)
    while n >= ID_SPACE:
        n = _perm(n, inverse=True)
    return n
"""

HMAC_SIX_ROUNDS = """
import hmac, hashlib
from course.shortener import ALPHABET, CODE_KEY, ID_SPACE

BITS, ROUNDS = 21, 6
MASK = (1 << BITS) - 1

def round_fn(i, half):
    mac = hmac.new(CODE_KEY, f"{i}:{half}".encode(), hashlib.sha256).digest()
    return int.from_bytes(mac[:4], "big") & MASK

def forward(x):
    l, r = x >> BITS, x & MASK
    for i in range(ROUNDS):
        l, r = r, l ^ round_fn(i, r)
    return (l << BITS) | r

def backward(x):
    l, r = x >> BITS, x & MASK
    for i in range(ROUNDS - 1, -1, -1):
        l, r = r ^ round_fn(i, l), l
    return (l << BITS) | r

def walk(fn, x):
    x = fn(x)
    while x >= ID_SPACE:
        x = fn(x)
    return x

def encode_code(n: int) -> str:
    if not isinstance(n, int) or not 0 <= n < ID_SPACE:
        raise ValueError("id out of range")
    x = walk(forward, n)
    return "".join(ALPHABET[(x // 62**k) % 62] for k in range(6, -1, -1))

def decode_code(code: str) -> int:
    if len(code) != 7 or not set(code) <= set(ALPHABET):
        raise ValueError("not a code")
    x = sum(ALPHABET.index(ch) * 62**k for k, ch in zip(range(6, -1, -1), code))
    return walk(backward, x)
"""

# a Feistel network on the two parts of the number itself (62**3 and 62**4), with modular
# addition instead of xor: a permutation of exactly [0, 62**7), no cycle-walking needed
MODULAR_FEISTEL = """
import hashlib
from course.shortener import ALPHABET, CODE_KEY, ID_SPACE

A, B = 62**3, 62**4

def F(i, x, mod):
    return int.from_bytes(hashlib.sha256(CODE_KEY + bytes([i]) + x.to_bytes(6, "big")).digest()[:8], "big") % mod

def encode_code(n):
    if not 0 <= n < ID_SPACE:
        raise ValueError(n)
    a, b = divmod(n, B)
    for i in range(4):
        a = (a + F(2 * i, b, A)) % A
        b = (b + F(2 * i + 1, a, B)) % B
    n = a * B + b
    return "".join(ALPHABET[n // 62**k % 62] for k in reversed(range(7)))

def decode_code(code):
    if len(code) != 7 or any(c not in ALPHABET for c in code):
        raise ValueError(code)
    n = 0
    for c in code:
        n = n * 62 + ALPHABET.index(c)
    a, b = divmod(n, B)
    for i in reversed(range(4)):
        b = (b - F(2 * i + 1, a, B)) % B
        a = (a - F(2 * i, b, A)) % A
    return a * B + b
"""

# ============================================================================ codes: wrong

SEQUENTIAL = """
from course.shortener import ALPHABET, ID_SPACE

def encode_code(n):
    if not 0 <= n < ID_SPACE:
        raise ValueError(n)
    out = ""
    for _ in range(7):
        n, d = divmod(n, 62)
        out = ALPHABET[d] + out
    return out

def decode_code(code):
    if len(code) != 7 or any(c not in ALPHABET for c in code):
        raise ValueError(code)
    n = 0
    for c in code:
        n = n * 62 + ALPHABET.index(c)
    return n
"""

REVERSED = SEQUENTIAL.replace("    return out\n", "    return out[::-1]\n").replace(
    "    n = 0\n    for c in code:", "    n = 0\n    for c in code[::-1]:"
)

MULTIPLIED = """
from course.shortener import ALPHABET, ID_SPACE

P = 1_580_030_173                 # odd, not a multiple of 31: invertible modulo 62**7
P_INV = pow(P, -1, ID_SPACE)

def encode_code(n):
    if not 0 <= n < ID_SPACE:
        raise ValueError(n)
    n = n * P % ID_SPACE
    return "".join(ALPHABET[n // 62**k % 62] for k in reversed(range(7)))

def decode_code(code):
    if len(code) != 7 or any(c not in ALPHABET for c in code):
        raise ValueError(code)
    n = 0
    for c in code:
        n = n * 62 + ALPHABET.index(c)
    return n * P_INV % ID_SPACE
"""

XOR_KEY = """
from course.shortener import ALPHABET, ID_SPACE

KEY = 0x2A5F3C1B9D7

def encode_code(n):
    if not 0 <= n < ID_SPACE:
        raise ValueError(n)
    n ^= KEY
    out = ""
    while n:
        n, d = divmod(n, 62)
        out = ALPHABET[d] + out
    return out.rjust(7, "0")

def decode_code(code):
    if len(code) != 7 or any(c not in ALPHABET for c in code):
        raise ValueError(code)
    n = 0
    for c in code:
        n = n * 62 + ALPHABET.index(c)
    return n ^ KEY
"""

#: kept wrong solutions whose own behaviour is random (a key from os.urandom): their verdict and
#: failures repeat on every run, the codes their feedback quotes cannot (tests/test_00_determinism.py)
RANDOM_BY_DESIGN = {("encode_code", "key-per-process"), ("create_link", "random-id")}

KEY_DRAWN_AT_START = FEISTEL.replace(
    "from course.shortener import ALPHABET, CODE_KEY, ID_SPACE",
    "import os\nfrom course.shortener import ALPHABET, ID_SPACE\nCODE_KEY = os.urandom(16)  # a fresh key per process",
)

# a round function on Python's hash(): the same in every replica inside one process, different in
# another process (PYTHONHASHSEED randomizes the hash of str and bytes)
HASH_ROUND = FEISTEL.replace(
    'return int.from_bytes(hashlib.blake2b(bytes([i]) + half.to_bytes(3, "big"), key=CODE_KEY, digest_size=3).digest(), "big") & 0x1FFFFF',
    "return hash((CODE_KEY, i, half)) & 0x1FFFFF",
)
assert HASH_ROUND != FEISTEL

NO_CYCLE_WALK = FEISTEL.replace("    while n >= ID_SPACE:\n        n = _perm(n)\n", "    n %= ID_SPACE\n")

NO_PADDING = FEISTEL.replace(
    '    out = ""\n    for _ in range(7):\n        n, d = divmod(n, 62)\n        out = ALPHABET[d] + out\n    return out\n',
    '    out = ""\n    while n:\n        n, d = divmod(n, 62)\n        out = ALPHABET[d] + out\n    return out\n',
).replace("if not isinstance(code, str) or len(code) != 7 or", "if not isinstance(code, str) or len(code) > 7 or")

HASHED = """
import hashlib
from course.shortener import ALPHABET, ID_SPACE

_seen = {}

def encode_code(n):
    if not 0 <= n < ID_SPACE:
        raise ValueError(n)
    h = int(hashlib.md5(str(n).encode()).hexdigest(), 16) % ID_SPACE
    code = "".join(ALPHABET[h // 62**k % 62] for k in reversed(range(7)))
    _seen[code] = n
    return code

def decode_code(code):
    if len(code) != 7:
        raise ValueError(code)
    return _seen[code]
"""


# ============================================================================ create_link: right

ONE_TRANSACTION = """
from psycopg.types.json import Jsonb
from course.idempotency import IdempotencyKeyReused, request_hash
from course.shortener import AliasTaken, encode_code

async def create_link(pool, url, *, alias=None, idempotency_key=None):
    body = {"url": url, "alias": alias}
    async with pool.connection() as conn, conn.transaction():
        if idempotency_key is not None:
            cur = await conn.execute(
                "INSERT INTO idempotency_keys (key, request_hash) VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING key",
                (idempotency_key, request_hash(body)))
            if await cur.fetchone() is None:
                cur = await conn.execute("SELECT request_hash, response FROM idempotency_keys WHERE key = %s", (idempotency_key,))
                stored, response = await cur.fetchone()
                if stored != request_hash(body):
                    raise IdempotencyKeyReused(idempotency_key)
                return response
        if alias is None:
            (link_id,) = await (await conn.execute("SELECT nextval('link_ids')")).fetchone()
            code = encode_code(link_id)
            await conn.execute("INSERT INTO links (id, code, url) VALUES (%s, %s, %s)", (link_id, code, url))
        else:
            cur = await conn.execute(
                "INSERT INTO links (code, url, custom) VALUES (%s, %s, true) ON CONFLICT (code) DO NOTHING RETURNING id",
                (alias, url))
            if await cur.fetchone() is None:
                raise AliasTaken(alias)
            code = alias
        response = {"code": code, "url": url}
        if idempotency_key is not None:
            await conn.execute("UPDATE idempotency_keys SET status = 'done', response = %s WHERE key = %s",
                               (Jsonb(response), idempotency_key))
    return response
"""

# chapter 03's design: claim in its own statement, 409 while pending, release on failure
PENDING_CLAIM = """
import psycopg
from psycopg.types.json import Jsonb
from course.idempotency import IdempotencyKeyReused, RequestInProgress, request_hash
from course.shortener import AliasTaken, encode_code

async def _insert(pool, url, alias):
    async with pool.connection() as conn:
        if alias is not None:
            try:
                await conn.execute("INSERT INTO links (code, url, custom) VALUES (%s, %s, true)", (alias, url))
            except psycopg.errors.UniqueViolation:
                raise AliasTaken(alias) from None
            return {"code": alias, "url": url}
        cur = await conn.execute("INSERT INTO links (code, url) VALUES ('tmp-' || txid_current(), %s) RETURNING id", (url,))
        (link_id,) = await cur.fetchone()
        code = encode_code(link_id)
        await conn.execute("UPDATE links SET code = %s WHERE id = %s", (code, link_id))
        return {"code": code, "url": url}

async def create_link(pool, url, *, alias=None, idempotency_key=None):
    if idempotency_key is None:
        return await _insert(pool, url, alias)
    h = request_hash({"url": url, "alias": alias})
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO idempotency_keys (key, request_hash) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING RETURNING key",
            (idempotency_key, h))
        if await cur.fetchone() is None:
            row = await (await conn.execute(
                "SELECT request_hash, status, response FROM idempotency_keys WHERE key = %s", (idempotency_key,))).fetchone()
            if row is None:
                raise RequestInProgress(idempotency_key)
            if row[0] != h:
                raise IdempotencyKeyReused(idempotency_key)
            if row[1] != "done":
                raise RequestInProgress(idempotency_key)
            return row[2]
    try:
        link = await _insert(pool, url, alias)
    except Exception:
        async with pool.connection() as conn:
            await conn.execute("DELETE FROM idempotency_keys WHERE key = %s AND status = 'pending'", (idempotency_key,))
        raise
    async with pool.connection() as conn:
        await conn.execute("UPDATE idempotency_keys SET status = 'done', response = %s WHERE key = %s",
                           (Jsonb(link), idempotency_key))
    return link
"""

# ============================================================================ create_link: wrong

CHECK_THEN_INSERT_ALIAS = ONE_TRANSACTION.replace(
    """            cur = await conn.execute(
                "INSERT INTO links (code, url, custom) VALUES (%s, %s, true) ON CONFLICT (code) DO NOTHING RETURNING id",
                (alias, url))
            if await cur.fetchone() is None:
                raise AliasTaken(alias)""",
    """            taken = await (await conn.execute("SELECT 1 FROM links WHERE code = %s", (alias,))).fetchone()
            if taken:
                raise AliasTaken(alias)
            await conn.execute("INSERT INTO links (code, url, custom) VALUES (%s, %s, true)", (alias, url))""",
)

ALIAS_RETURNS_EXISTING = ONE_TRANSACTION.replace(
    """            if await cur.fetchone() is None:
                raise AliasTaken(alias)""",
    """            if await cur.fetchone() is None:
                (url,) = await (await conn.execute("SELECT url FROM links WHERE code = %s", (alias,))).fetchone()""",
)

KEY_CHECK_THEN_ACT = """
from psycopg.types.json import Jsonb
from course.idempotency import IdempotencyKeyReused, request_hash
from course.shortener import AliasTaken, encode_code

async def create_link(pool, url, *, alias=None, idempotency_key=None):
    h = request_hash({"url": url, "alias": alias})
    async with pool.connection() as conn:
        if idempotency_key is not None:
            row = await (await conn.execute(
                "SELECT request_hash, response FROM idempotency_keys WHERE key = %s", (idempotency_key,))).fetchone()
            if row is not None:
                if row[0] != h:
                    raise IdempotencyKeyReused(idempotency_key)
                return row[1]
        if alias is None:
            (link_id,) = await (await conn.execute("SELECT nextval('link_ids')")).fetchone()
            code = encode_code(link_id)
            await conn.execute("INSERT INTO links (id, code, url) VALUES (%s, %s, %s)", (link_id, code, url))
        else:
            cur = await conn.execute(
                "INSERT INTO links (code, url) VALUES (%s, %s) ON CONFLICT (code) DO NOTHING RETURNING id", (alias, url))
            if await cur.fetchone() is None:
                raise AliasTaken(alias)
            code = alias
        response = {"code": code, "url": url}
        if idempotency_key is not None:
            await conn.execute(
                "INSERT INTO idempotency_keys (key, request_hash, status, response) VALUES (%s, %s, 'done', %s) "
                "ON CONFLICT (key) DO NOTHING", (idempotency_key, h, Jsonb(response)))
    return response
"""

KEY_IN_PROCESS = """
import asyncio
from collections import defaultdict
from course.idempotency import IdempotencyKeyReused
from course.shortener import AliasTaken, encode_code

_responses = {}
_locks = defaultdict(asyncio.Lock)

async def create_link(pool, url, *, alias=None, idempotency_key=None):
    if idempotency_key is None:
        return await _create(pool, url, alias)
    async with _locks[idempotency_key]:
        if idempotency_key in _responses:
            body, response = _responses[idempotency_key]
            if body != (url, alias):
                raise IdempotencyKeyReused(idempotency_key)
            return response
        response = await _create(pool, url, alias)
        _responses[idempotency_key] = ((url, alias), response)
        return response

async def _create(pool, url, alias):
    async with pool.connection() as conn:
        if alias is not None:
            cur = await conn.execute(
                "INSERT INTO links (code, url) VALUES (%s, %s) ON CONFLICT (code) DO NOTHING RETURNING id", (alias, url))
            if await cur.fetchone() is None:
                raise AliasTaken(alias)
            return {"code": alias, "url": url}
        (link_id,) = await (await conn.execute("SELECT nextval('link_ids')")).fetchone()
        code = encode_code(link_id)
        await conn.execute("INSERT INTO links (id, code, url) VALUES (%s, %s, %s)", (link_id, code, url))
        return {"code": code, "url": url}
"""

# Issue 28: the request hash leaves out the alias, so the same key with another alias is not refused.
HASH_WITHOUT_ALIAS = ONE_TRANSACTION.replace(
    """    body = {"url": url, "alias": alias}""", """    body = {"url": url}"""
)

NO_HASH_COMPARE = ONE_TRANSACTION.replace(
    """                if stored != request_hash(body):
                    raise IdempotencyKeyReused(idempotency_key)
""",
    "",
)

MAX_ID_PLUS_ONE = ONE_TRANSACTION.replace(
    """(link_id,) = await (await conn.execute("SELECT nextval('link_ids')")).fetchone()""",
    """(link_id,) = await (await conn.execute("SELECT coalesce(max(id), 0) + 1 FROM links")).fetchone()""",
).replace(
    """"INSERT INTO links (code, url, custom) VALUES (%s, %s, true) ON CONFLICT (code) DO NOTHING RETURNING id",""",
    """"INSERT INTO links (id, code, url, custom) SELECT coalesce(max(id), 0) + 1, %s, %s, true FROM links "
                "ON CONFLICT (code) DO NOTHING RETURNING id",""",
)


# ============================================================================ resolve: right

RESOLVE = """
import contextlib
import redis.exceptions
from course.breaker import CircuitOpenError
from course.shortener import CACHE_TTL, MISS_TTL

DOWN = (CircuitOpenError, redis.exceptions.RedisError)

async def resolve(code, redis, pool, breaker):
    key = f"link:{code}"
    try:
        cached = await breaker.call(lambda: redis.get(key))
    except DOWN:
        cache_up = False
    else:
        cache_up = True
        if cached is not None:
            return cached or None
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT url FROM links WHERE code = %s", (code,))).fetchone()
    url = row[0] if row else None
    if cache_up:
        with contextlib.suppress(*DOWN):
            await breaker.call(lambda: redis.set(key, url or "", ex=int(CACHE_TTL if url else MISS_TTL)))
    return url
"""


# jittered TTLs (what course/shortener.py does): the feedback must read the same on every run
RESOLVE_JITTERED = RESOLVE.replace("import contextlib\n", "import contextlib, random\n", 1).replace(
    'redis.set(key, url or "", ex=int(CACHE_TTL if url else MISS_TTL))',
    'redis.set(key, url or "", px=int((CACHE_TTL if url else MISS_TTL) * 1000 * random.uniform(0.9, 1.1)))',
)
assert RESOLVE_JITTERED != RESOLVE

RESOLVE_JSON = """
import json, random
from course.breaker import CircuitOpenError
import redis.exceptions

async def _cache(breaker, fn):
    try:
        return True, await breaker.call(fn)
    except (CircuitOpenError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
        return False, None

async def resolve(code, redis, pool, breaker):
    key = "short:" + code
    ok, raw = await _cache(breaker, lambda: redis.get(key))
    if raw is not None:
        return json.loads(raw)          # "null" is a remembered miss
    async with pool.connection() as conn:
        cur = conn.cursor()
        await cur.execute("SELECT url FROM links WHERE code = %s", (code,))
        row = await cur.fetchone()
    url = row[0] if row else None
    ttl = 30 if url is None else int(86400 * random.uniform(1.0, 1.2))
    await _cache(breaker, lambda: redis.set(key, json.dumps(url), ex=ttl))   # an open breaker refuses it at once
    return url
"""

# ============================================================================ resolve: wrong

NO_FALLBACK = """
async def resolve(code, redis, pool, breaker):
    cached = await breaker.call(lambda: redis.get(f"link:{code}"))
    if cached is not None:
        return cached or None
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT url FROM links WHERE code = %s", (code,))).fetchone()
    url = row[0] if row else None
    await breaker.call(lambda: redis.set(f"link:{code}", url or "", ex=86400 if url else 60))
    return url
"""

NO_BREAKER = """
from redis.exceptions import RedisError

async def resolve(code, redis, pool, breaker):
    try:
        cached = await redis.get(f"link:{code}")
    except RedisError:
        cached = None
    if cached is not None:
        return cached or None
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT url FROM links WHERE code = %s", (code,))).fetchone()
    url = row[0] if row else None
    try:
        await redis.set(f"link:{code}", url or "", ex=86400 if url else 60)
    except RedisError:
        pass
    return url
"""

SET_AROUND_THE_BREAKER = RESOLVE.replace(
    """    if cache_up:
        with contextlib.suppress(*DOWN):
            await breaker.call(lambda: redis.set(key, url or "", ex=int(CACHE_TTL if url else MISS_TTL)))""",
    """    with contextlib.suppress(*DOWN):
        await redis.set(key, url or "", ex=int(CACHE_TTL if url else MISS_TTL))""",
)

# "use RedisError from the setup cell": inside the function `redis` is the client, so
# `redis.exceptions` raises AttributeError the moment Redis fails and the except clause is evaluated
CLIENT_EXCEPTIONS = RESOLVE.replace(
    "    except DOWN:\n        cache_up = False",
    "    except (CircuitOpenError, redis.exceptions.RedisError):\n        cache_up = False",
)
assert CLIENT_EXCEPTIONS != RESOLVE

NO_NEGATIVE_CACHE = RESOLVE.replace("    if cache_up:\n", "    if cache_up and url is not None:\n")

MISS_WITHOUT_TTL = RESOLVE.replace(
    'await breaker.call(lambda: redis.set(key, url or "", ex=int(CACHE_TTL if url else MISS_TTL)))',
    'await breaker.call(lambda: redis.set(key, url, ex=int(CACHE_TTL)) if url else redis.set(key, ""))',
)

TRUTHY_MISS = RESOLVE.replace(
    "        if cached is not None:\n            return cached or None", "        if cached:\n            return cached"
)

IN_PROCESS_CACHE = """
_cache = {}

async def resolve(code, redis, pool, breaker):
    if code in _cache:
        return _cache[code]
    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT url FROM links WHERE code = %s", (code,))).fetchone()
    _cache[code] = row[0] if row else None
    return _cache[code]
"""

DB_ERROR_AS_MISS = RESOLVE.replace(
    """    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT url FROM links WHERE code = %s", (code,))).fetchone()""",
    """    try:
        async with pool.connection() as conn:
            row = await (await conn.execute("SELECT url FROM links WHERE code = %s", (code,))).fetchone()
    except Exception:
        row = None""",
)

REDIS_ERRORS_ONLY = RESOLVE.replace(
    "DOWN = (CircuitOpenError, redis.exceptions.RedisError)", "DOWN = (redis.exceptions.RedisError,)"
)


# Issue 28 audit: a link cached for a minute, not for about CACHE_TTL.
LINK_CACHED_A_MINUTE = RESOLVE.replace("ex=int(CACHE_TTL if url else MISS_TTL)", "ex=int(60 if url else MISS_TTL)")


# Issue 28: decode_code takes any string: a code with a character outside ALPHABET is not refused.
NO_DECODE_VALIDATION = FEISTEL.replace(
    """    if not isinstance(code, str) or len(code) != 7 or any(ch not in ALPHABET for ch in code):
        raise ValueError(code)
""",
    "",
)


# Issue 28 audit: PostgreSQL down, it caches a miss it never saw, then raises.
CACHES_MISS_ON_DB_ERROR = RESOLVE.replace(
    """    async with pool.connection() as conn:
        row = await (await conn.execute("SELECT url FROM links WHERE code = %s", (code,))).fetchone()""",
    """    try:
        async with pool.connection() as conn:
            row = await (await conn.execute("SELECT url FROM links WHERE code = %s", (code,))).fetchone()
    except Exception:
        if cache_up:
            with contextlib.suppress(*DOWN):
                await breaker.call(lambda: redis.set(key, "", ex=int(MISS_TTL)))
        raise""",
)


# found by an outside audit: a Feistel network whose round function ignores the key (anyone can undo it)
KEYLESS_ROUND = FEISTEL.replace("key=CODE_KEY, digest_size=3", "digest_size=3")

# the code encodes one nextval, the row takes another from the column's DEFAULT
CODE_OF_ANOTHER_ID = ONE_TRANSACTION.replace(
    """await conn.execute("INSERT INTO links (id, code, url) VALUES (%s, %s, %s)", (link_id, code, url))""",
    """await conn.execute("INSERT INTO links (code, url) VALUES (%s, %s)", (code, url))""",
)

# ids drawn at random instead of from the sequence: they collide with the sequence's later ids
RANDOM_ID = ONE_TRANSACTION.replace(
    """(link_id,) = await (await conn.execute("SELECT nextval('link_ids')")).fetchone()""",
    """import random; link_id = random.randrange(10**9, 10**12)""",
)

# the key claimed and committed on its own, the link made in a second transaction: a failed call
# (alias taken) leaves the key pending forever
CLAIM_IN_OWN_TRANSACTION = """
import asyncio
from psycopg.types.json import Jsonb
from course.idempotency import IdempotencyKeyReused, RequestInProgress, request_hash
from course.shortener import AliasTaken, encode_code

async def create_link(pool, url, *, alias=None, idempotency_key=None):
    body = {"url": url, "alias": alias}
    if idempotency_key is not None:
        async with pool.connection() as conn:
            cur = await conn.execute(
                "INSERT INTO idempotency_keys (key, request_hash, request) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING key", (idempotency_key, request_hash(body), Jsonb(body)))
            if await cur.fetchone() is None:
                for _ in range(50):
                    row = await (await conn.execute(
                        "SELECT request_hash, status, response FROM idempotency_keys WHERE key = %s",
                        (idempotency_key,))).fetchone()
                    if row[0] != request_hash(body):
                        raise IdempotencyKeyReused(idempotency_key)
                    if row[1] == "done":
                        return row[2]
                    await asyncio.sleep(0.01)
                raise RequestInProgress(idempotency_key)
    async with pool.connection() as conn, conn.transaction():
        if alias is None:
            (link_id,) = await (await conn.execute("SELECT nextval('link_ids')")).fetchone()
            code = encode_code(link_id)
            await conn.execute("INSERT INTO links (id, code, url) VALUES (%s, %s, %s)", (link_id, code, url))
        else:
            cur = await conn.execute(
                "INSERT INTO links (code, url, custom) VALUES (%s, %s, true) ON CONFLICT DO NOTHING", (alias, url))
            if cur.rowcount == 0:
                raise AliasTaken(alias)
            code = alias
        response = {"code": code, "url": url}
        if idempotency_key is not None:
            await conn.execute("UPDATE idempotency_keys SET status = 'done', response = %s WHERE key = %s",
                               (Jsonb(response), idempotency_key))
    return response
"""

# correct: a taken alias found by the unique index (UniqueViolation), the custom flag left at its default
UNIQUE_VIOLATION_ALIAS = ONE_TRANSACTION.replace(
    """            cur = await conn.execute(
                "INSERT INTO links (code, url, custom) VALUES (%s, %s, true) ON CONFLICT (code) DO NOTHING RETURNING id",
                (alias, url))
            if await cur.fetchone() is None:
                raise AliasTaken(alias)""",
    """            try:
                await conn.execute("INSERT INTO links (code, url) VALUES (%s, %s)", (alias, url))
            except errors.UniqueViolation:
                raise AliasTaken(alias) from None""",
).replace(
    "from psycopg.types.json import Jsonb\n", "from psycopg import errors\nfrom psycopg.types.json import Jsonb\n", 1
)

# the write to the cache made with redis directly: right while Redis is up (the GET through the breaker
# already failed over when it is down), but the breaker neither counts nor stops it
SET_OUTSIDE_BREAKER = RESOLVE.replace(
    """        with contextlib.suppress(*DOWN):
            await breaker.call(lambda: redis.set(key, url or "", ex=int(CACHE_TTL if url else MISS_TTL)))""",
    """        await redis.set(key, url or "", ex=int(CACHE_TTL if url else MISS_TTL))""",
)

# a look (EXISTS) then a read (GET): a TTL running out between them turns a link into a 404
EXISTS_THEN_GET = RESOLVE.replace(
    """        cached = await breaker.call(lambda: redis.get(key))""",
    """        cached = None
        if await breaker.call(lambda: redis.exists(key)):
            cached = await breaker.call(lambda: redis.get(key))
            return cached or None""",
)

CORRECT: dict[str, dict[str, str]] = {
    "encode_code": {
        "feistel": FEISTEL,
        "hmac": HMAC_SIX_ROUNDS,
        "modular": MODULAR_FEISTEL,
    },
    "create_link": {
        "one-transaction": ONE_TRANSACTION,
        "pending-claim": PENDING_CLAIM,
        "unique-violation-alias": UNIQUE_VIOLATION_ALIAS,
    },
    "resolve": {
        "sentinel": RESOLVE,
        "json": RESOLVE_JSON,
        "jittered-ttl": RESOLVE_JITTERED,
    },
}


WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "encode_code": {
        "sequential": (SEQUENTIAL, "share"),
        "reversed": (REVERSED, "share"),
        "multiplied": (MULTIPLIED, "fixed step"),
        "xor": (XOR_KEY, "7 characters"),
        "key-per-process": (KEY_DRAWN_AT_START, "replica"),
        "round-function-on-hash": (HASH_ROUND, "PYTHONHASHSEED"),
        "no-cycle-walk": (NO_CYCLE_WALK, "cycle-walking"),
        "no-padding": (NO_PADDING, "pad"),
        "no-decode-validation": (NO_DECODE_VALIDATION, "expected ValueError"),
        "hashed": (HASHED, "KeyError"),
        "keyless-round": (KEYLESS_ROUND, "another CODE_KEY"),
    },
    "create_link": {
        "check-then-insert-alias": (CHECK_THEN_INSERT_ALIAS, "ON CONFLICT"),
        "alias-returns-existing": (ALIAS_RETURNS_EXISTING, "AliasTaken"),
        "key-check-then-act": (KEY_CHECK_THEN_ACT, "claim the key atomically"),
        "key-in-process": (KEY_IN_PROCESS, "one process"),
        "no-hash": (NO_HASH_COMPARE, "IdempotencyKeyReused"),
        "hash-without-alias": (HASH_WITHOUT_ALIAS, "alias included"),
        "max-id": (MAX_ID_PLUS_ONE, "nextval"),
        "code-of-another-id": (CODE_OF_ANOTHER_ID, "the link's own id"),
        "random-id": (RANDOM_ID, "never handed out"),
        "claim-in-own-transaction": (CLAIM_IN_OWN_TRANSACTION, "one transaction"),
    },
    "resolve": {
        "caches-miss-on-db-error": (CACHES_MISS_ON_DB_ERROR, "afterwards it returned None"),
        "no-fallback": (NO_FALLBACK, "must not fail the redirect"),
        "client-exceptions": (CLIENT_EXCEPTIONS, "must not fail the redirect"),
        "no-breaker": (NO_BREAKER, "breaker.call"),
        "set-around-breaker": (SET_AROUND_THE_BREAKER, "hammers"),
        "no-negative-cache": (NO_NEGATIVE_CACHE, "negative caching"),
        "miss-without-ttl": (MISS_WITHOUT_TTL, "expires within 5 minutes"),
        "truthy-miss": (TRUTHY_MISS, "truthiness"),
        "link-cached-a-minute": (LINK_CACHED_A_MINUTE, "expected about CACHE_TTL"),
        "in-process": (IN_PROCESS_CACHE, "one process"),
        "db-error-as-miss": (DB_ERROR_AS_MISS, "503"),
        "redis-errors-only": (REDIS_ERRORS_ONLY, "CircuitOpenError"),
        "set-outside-breaker": (SET_OUTSIDE_BREAKER, "outside breaker.call"),
        "exists-then-get": (EXISTS_THEN_GET, "EXISTS (or TTL)"),
    },
}


def _after_own_encode(source: str) -> str:
    """A create_link cell as the notebook runs it: after the learner's own encode_code cell (the course's
    is the answer to another task, left out where answers are graded)."""
    own = source.replace(
        "from course.shortener import AliasTaken, encode_code", "from course.shortener import AliasTaken"
    )
    return FEISTEL + own


CORRECT["create_link"] = {name: _after_own_encode(src) for name, src in CORRECT["create_link"].items()}
WRONG["create_link"] = {name: (_after_own_encode(src), says) for name, (src, says) in WRONG["create_link"].items()}


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in CORRECT.items() for n in d])
def test_12_correct_answers_pass(task, name):
    assert_accepted(task, CORRECT[task][name])


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in WRONG.items() for n in d])
def test_12_wrong_answers_are_rejected_for_the_reason(task, name):
    source, mentions = WRONG[task][name]
    assert_rejected(task, source, mentions=mentions)
