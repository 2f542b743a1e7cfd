"""Chapter 08 grading: the wrong limiters learners write are rejected, for the reason the
chapter teaches; different correct designs (Lua or WATCH/MULTI, sliding log or sliding
counter) pass. Races are forced by the check's gate and the processes are real, so every
verdict here is the same on every run.
"""

from __future__ import annotations

import pytest

from tests.helpers import assert_accepted, assert_rejected

# ============================================================================= token_bucket: correct designs

TB_REFERENCE = "from course.ratelimit import token_bucket\n"

TB_LUA_MS = '''
BUCKET = """
local capacity, rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = tonumber(ARGV[4])
if now == nil then
  local t = redis.call('TIME')
  now = t[1] + t[2] / 1e6
end
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens')) or capacity
local last = tonumber(redis.call('HGET', KEYS[1], 'last')) or now
tokens = math.min(capacity, tokens + math.max(0, now - last) * rate)
local wait_ms = 0
local ok = 0
if tokens >= cost then tokens = tokens - cost; ok = 1 else wait_ms = math.ceil((cost - tokens) / rate * 1000) end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'last', now)
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / rate))
return {ok, wait_ms}
"""

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    script = redis.register_script(BUCKET)
    ok, wait_ms = await script(keys=[key], args=[capacity, rate, cost, "" if now is None else now])
    return ok == 1, wait_ms / 1000
'''

TB_WATCH_MULTI = """
from redis.exceptions import WatchError

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    while True:
        async with redis.pipeline() as pipe:
            try:
                await pipe.watch(key)
                if now is None:
                    sec, usec = await pipe.time()
                    t = sec + usec / 1e6
                else:
                    t = now
                tokens, last = await pipe.hmget(key, "tokens", "ts")
                tokens = capacity if tokens is None else float(tokens)
                last = t if last is None else float(last)
                tokens = min(capacity, tokens + max(0.0, t - last) * rate)
                ok = tokens >= cost
                if ok:
                    tokens -= cost
                pipe.multi()
                pipe.hset(key, mapping={"tokens": repr(tokens), "ts": repr(t)})
                pipe.pexpire(key, max(1, int((capacity - tokens) / rate * 1000) + 1))
                await pipe.execute()
                return ok, 0.0 if ok else (cost - tokens) / rate
            except WatchError:
                continue
"""

TB_LUA_STRING = '''
import json

SCRIPT = """
local now = tonumber(ARGV[4])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local cap, rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local raw = redis.call('GET', KEYS[1])
local tokens, ts = cap, now
if raw then local s = cjson.decode(raw); tokens, ts = s[1], s[2] end
tokens = math.min(cap, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= cost then tokens = tokens - cost else wait = (cost - tokens) / rate end
redis.call('SET', KEYS[1], cjson.encode({tokens, now}), 'PX', math.ceil((cap - tokens) / rate * 1000) + 500)
return {wait == 0 and 1 or 0, tostring(wait)}
"""

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    ok, wait = await redis.eval(SCRIPT, 1, key, capacity, rate, cost, "" if now is None else repr(now))
    return bool(ok), float(wait)
'''


# ============================================================================= token_bucket: wrong answers

TB_GET_THEN_SET = """
async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    if now is None:
        sec, usec = await redis.time()
        now = sec + usec / 1e6
    state = await redis.hgetall(key)
    tokens = float(state.get("tokens", capacity))
    last = float(state.get("ts", now))
    tokens = min(capacity, tokens + max(0.0, now - last) * rate)
    ok = tokens >= cost
    if ok:
        tokens -= cost
    await redis.hset(key, mapping={"tokens": tokens, "ts": now})
    await redis.pexpire(key, int((capacity - tokens) / rate * 1000) + 1)
    return ok, 0.0 if ok else (cost - tokens) / rate
"""


def _under_a_lock(source: str, name: str) -> str:
    """``source`` with the body of ``async def name`` run under one ``asyncio.Lock``: exact in one
    process, a read-then-write race between two."""
    head, body = source.split(f"async def {name}(", 1)
    signature, body = body.split("\n", 1)
    inner = "".join(f"    {line}\n" if line.strip() else "\n" for line in body.rstrip().splitlines())
    return f"import asyncio\n{head}\n_lock = asyncio.Lock()\n\nasync def {name}({signature}\n    async with _lock:\n{inner}"


TB_LOCKED = _under_a_lock(TB_GET_THEN_SET, "token_bucket")


TB_CLIENT_TIME = """
import time
from course.ratelimit import TOKEN_BUCKET_LUA

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    now = time.time() if now is None else now  # the client's clock
    ok, wait_ms, _, _ = await redis.eval(TOKEN_BUCKET_LUA, 1, key, repr(now), capacity, rate, cost)
    return bool(ok), wait_ms / 1000
"""

TB_IGNORES_NOW = """
from course.ratelimit import TOKEN_BUCKET_LUA

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    ok, wait_ms, _, _ = await redis.eval(TOKEN_BUCKET_LUA, 1, key, "", capacity, rate, cost)  # always TIME
    return bool(ok), wait_ms / 1000
"""


def _lua_variant(replace: str, by: str, ret: str = "return bool(ok), wait_ms / 1000") -> str:
    """The reference script with one line changed: a learner's near miss."""
    from course.ratelimit import TOKEN_BUCKET_LUA

    assert replace in TOKEN_BUCKET_LUA
    script = TOKEN_BUCKET_LUA.replace(replace, by)
    return f'''
SCRIPT = """{script}"""

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    ok, wait_ms, _, _ = await redis.eval(SCRIPT, 1, key, "" if now is None else repr(now), capacity, rate, cost)
    {ret}
'''


TB_NO_EXPIRY = _lua_variant("redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil(full_in * 1000)))", "")
TB_EXPIRE_ON_CREATE = _lua_variant(
    "redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil(full_in * 1000)))",
    "if not state[2] then redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate * 1000)) end",
)
TB_WAIT_ONE_TOKEN = _lua_variant("wait = (cost - tokens) / rate", "wait = 1 / rate")
TB_WAIT_MS = _lua_variant("", "", ret="return bool(ok), wait_ms")
TB_DENIED_TAKES_TOKENS = _lua_variant(
    "  wait = (cost - tokens) / rate", "  wait = (cost - tokens) / rate\n  tokens = tokens - cost"
)

TB_LUA_FLOAT_TRUNCATED = """
from course.ratelimit import TOKEN_BUCKET_LUA

SCRIPT = TOKEN_BUCKET_LUA.replace("math.ceil(wait * 1000)", "wait")  # seconds, as a Lua number

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    ok, wait, _, _ = await redis.eval(SCRIPT, 1, key, "" if now is None else repr(now), capacity, rate, cost)
    return bool(ok), float(wait)
"""

TB_IN_PROCESS = """
import time

_buckets = {}

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    now = time.time() if now is None else now
    tokens, last = _buckets.get(key, (capacity, now))
    tokens = min(capacity, tokens + max(0.0, now - last) * rate)
    ok = tokens >= cost
    if ok:
        tokens -= cost
    _buckets[key] = (tokens, now)
    return ok, 0.0 if ok else (cost - tokens) / rate
"""


# ============================================================================= sliding_window: correct designs

SW_REFERENCE = "from course.ratelimit import sliding_window\n"

SW_LOG_WATCH_MULTI = """
import uuid
from redis.exceptions import WatchError

async def sliding_window(redis, key, limit, window, now=None):
    while True:
        async with redis.pipeline() as pipe:
            try:
                await pipe.watch(key)
                if now is None:
                    sec, usec = await pipe.time()
                    t = sec + usec / 1e6
                else:
                    t = now
                entries = await pipe.zrangebyscore(key, f"({t - window}", "+inf", withscores=True)
                pipe.multi()
                pipe.zremrangebyscore(key, "-inf", t - window)
                ok = len(entries) < limit
                if ok:
                    pipe.zadd(key, {f"{t}:{uuid.uuid4().hex}": t})
                    pipe.pexpire(key, int(window * 1000))
                await pipe.execute()
                if ok:
                    return True, 0.0
                return False, entries[len(entries) - limit][1] + window - t
            except WatchError:
                continue
"""

SW_COUNTER_LUA = """
from course.ratelimit import SLIDING_COUNTER_LUA

async def sliding_window(redis, key, limit, window, now=None):
    script = redis.register_script(SLIDING_COUNTER_LUA)
    ok, wait_ms, _, _ = await script(keys=[key], args=["" if now is None else repr(now), limit, window, 1])
    return bool(ok), wait_ms / 1000
"""

SW_COUNTER_TWO_KEYS_FLOOR = '''
SCRIPT = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1e6 end
local w = math.floor(now / window)
local e = now - w * window
local curr_key, prev_key = KEYS[1] .. ':' .. w, KEYS[1] .. ':' .. (w - 1)
local curr = tonumber(redis.call('GET', curr_key)) or 0
local prev = tonumber(redis.call('GET', prev_key)) or 0
local weighted = math.floor(prev * (window - e) / window)
if weighted + curr + 1 <= limit then
  redis.call('INCR', curr_key)
  redis.call('PEXPIRE', curr_key, math.ceil(2 * window * 1000))
  return {1, 0}
end
-- floor(prev * (window - e') / window) <= limit - curr - 1  <=>  prev * (window - e') / window < limit - curr
local wait
if curr + 1 <= limit and prev > 0 then
  wait = window * (1 - (limit - curr) / prev) - e
else
  local later = 0
  if curr > 0 then later = math.max(0, window * (1 - limit / curr)) end
  wait = window - e + later
end
return {0, math.ceil(wait * 1000) + 1}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait_ms = await redis.eval(SCRIPT, 1, key, limit, window, "" if now is None else repr(now))
    return bool(ok), wait_ms / 1000
'''


# ============================================================================= sliding_window: wrong answers

SW_FIXED_WINDOW = '''
SCRIPT = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1e6 end
local k = KEYS[1] .. ':' .. math.floor(now / window)
local n = tonumber(redis.call('GET', k)) or 0
if n < limit then
  redis.call('INCR', k)
  redis.call('PEXPIRE', k, math.ceil(window * 1000))
  return {1, 0}
end
return {0, math.ceil(((math.floor(now / window) + 1) * window - now) * 1000)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait_ms = await redis.eval(SCRIPT, 1, key, limit, window, "" if now is None else repr(now))
    return bool(ok), wait_ms / 1000
'''

SW_FIXED_FROM_FIRST = '''
SCRIPT = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1e6 end
local start = tonumber(redis.call('HGET', KEYS[1], 'start'))
local n = tonumber(redis.call('HGET', KEYS[1], 'n')) or 0
if not start or now >= start + window then start = now; n = 0 end
if n < limit then
  redis.call('HSET', KEYS[1], 'start', start, 'n', n + 1)
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))
  return {1, 0}
end
return {0, math.ceil((start + window - now) * 1000)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait_ms = await redis.eval(SCRIPT, 1, key, limit, window, "" if now is None else repr(now))
    return bool(ok), wait_ms / 1000
'''

SW_COUNT_THEN_ADD = """
import uuid

async def sliding_window(redis, key, limit, window, now=None):
    if now is None:
        sec, usec = await redis.time()
        now = sec + usec / 1e6
    await redis.zremrangebyscore(key, "-inf", now - window)
    entries = await redis.zrange(key, 0, -1, withscores=True)
    if len(entries) < limit:
        await redis.zadd(key, {uuid.uuid4().hex: now})
        await redis.pexpire(key, int(window * 1000))
        return True, 0.0
    return False, entries[len(entries) - limit][1] + window - now
"""


SW_LOCKED = _under_a_lock(SW_COUNT_THEN_ADD, "sliding_window")


def _log_variant(replace: str, by: str, ret: str = "return bool(ok), wait_ms / 1000") -> str:
    from course.ratelimit import SLIDING_LOG_LUA

    assert replace in SLIDING_LOG_LUA
    script = SLIDING_LOG_LUA.replace(replace, by)
    return f'''
import uuid

SCRIPT = """{script}"""

async def sliding_window(redis, key, limit, window, now=None):
    args = ["" if now is None else repr(now), limit, window, 1, uuid.uuid4().hex]
    ok, wait_ms, _, _ = await redis.eval(SCRIPT, 1, key, *args)
    {ret}
'''


SW_MEMBER_IS_TIME = _log_variant("ARGV[5] .. ':' .. i", "tostring(now)")
SW_NO_EXPIRY = _log_variant("redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))", "")
SW_COUNTS_REFUSED = '''
import uuid

SCRIPT = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1e6 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZADD', KEYS[1], now, ARGV[4])  -- every request goes in the log, refused or not
redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))
local n = redis.call('ZCARD', KEYS[1])
if n <= limit then return {1, 0} end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, math.ceil((tonumber(oldest[2]) + window - now) * 1000)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    args = [limit, window, "" if now is None else repr(now), uuid.uuid4().hex]
    ok, wait_ms = await redis.eval(SCRIPT, 1, key, *args)
    return bool(ok), wait_ms / 1000
'''
SW_WAIT_WINDOW = _log_variant("", "", ret="return bool(ok), 0.0 if ok else float(window)")
SW_COUNTER_WAITS_FOR_NEXT_WINDOW = """
from course.ratelimit import SLIDING_COUNTER_LUA

async def sliding_window(redis, key, limit, window, now=None):
    if now is None:
        sec, usec = await redis.time()
        now = sec + usec / 1e6
    ok, _, _, _ = await redis.eval(SLIDING_COUNTER_LUA, 1, key, repr(now), limit, window, 1)
    return bool(ok), 0.0 if ok else (now // window + 1) * window - now  # "until the next window"
"""

SW_IN_PROCESS = """
import time
from collections import deque

_logs = {}

async def sliding_window(redis, key, limit, window, now=None):
    now = time.time() if now is None else now
    log = _logs.setdefault(key, deque())
    while log and log[0] <= now - window:
        log.popleft()
    if len(log) < limit:
        log.append(now)
        await redis.set(key, len(log), px=int(window * 1000))
        return True, 0.0
    return False, log[len(log) - limit] + window - now
"""

SW_CLIENT_TIME = """
import time, uuid
from course.ratelimit import SLIDING_LOG_LUA

async def sliding_window(redis, key, limit, window, now=None):
    now = time.time() if now is None else now
    ok, wait_ms, _, _ = await redis.eval(SLIDING_LOG_LUA, 1, key, repr(now), limit, window, 1, uuid.uuid4().hex)
    return bool(ok), wait_ms / 1000
"""


CORRECT: dict[str, dict[str, str]] = {
    "token_bucket": {
        "lua-hash-ms": TB_LUA_MS,
        "watch-multi-server-time": TB_WATCH_MULTI,
        "lua-json-string": TB_LUA_STRING,
    },
    "sliding_window": {
        "log-watch-multi": SW_LOG_WATCH_MULTI,
        "counter-hash": SW_COUNTER_LUA,
        "counter-two-keys-floor": SW_COUNTER_TWO_KEYS_FLOOR,
    },
}


# Answers that only call the course's own answer (REFERENCES in the chapter's check module). Once the
# grader's reference guard (issue 28, autograder/rules.py) is in, they earn nothing; until then they pass.
CALLS_THE_REFERENCE: dict[str, dict[str, str]] = {
    "token_bucket": {"reference": TB_REFERENCE},
    "sliding_window": {"reference-log": SW_REFERENCE},
}


# ============================================================================= audit C (a fifth audit)
TB_AUDIT_TIME_SECONDS_ONLY = r'''import math
import time
from redis.exceptions import WatchError
LUA = """
local capacity, rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = tonumber(ARGV[4])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1])
end
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local wait_ms = 0
if tokens >= cost then
  tokens = tokens - cost
else
  wait_ms = math.ceil((cost - tokens) / rate * 1000)
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil((capacity - tokens) / rate * 1000)))
return wait_ms
"""

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    script = redis.register_script(LUA)
    wait_ms = await script(keys=[key], args=[capacity, rate, cost, "" if now is None else repr(now)])
    return wait_ms == 0, wait_ms / 1000
'''

TB_AUDIT_WAIT_ROUNDED_DOWN = r'''import math
import time
from redis.exceptions import WatchError
LUA = """
local capacity, rate, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = tonumber(ARGV[4])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or capacity
local ts = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - ts) * rate)
local wait_ms = 0
if tokens >= cost then
  tokens = tokens - cost
else
  wait_ms = math.max(1, math.floor((cost - tokens) / rate * 1000))
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.max(1, math.ceil((capacity - tokens) / rate * 1000)))
return wait_ms
"""

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    script = redis.register_script(LUA)
    wait_ms = await script(keys=[key], args=[capacity, rate, cost, "" if now is None else repr(now)])
    return wait_ms == 0, wait_ms / 1000
'''


# ============================================================================= audit C, second pass
# reads the bucket, then WATCHes: lockstep sends every WATCH before any EXEC, so only a take that lands
# between one request's read and its WATCH (the staggered step) shows the stale read
TB_AUDIT_READS_BEFORE_WATCH = """
from redis.exceptions import WatchError

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    while True:
        if now is None:
            sec, usec = await redis.time()
            t = sec + usec / 1e6
        else:
            t = now
        state = await redis.hgetall(key)          # read first ...
        tokens = float(state.get("tokens", capacity))
        last = float(state.get("ts", t))
        tokens = min(capacity, tokens + max(0.0, t - last) * rate)
        ok = tokens >= cost
        if ok:
            tokens -= cost
        async with redis.pipeline() as pipe:
            try:
                await pipe.watch(key)             # ... then WATCH: too late
                pipe.multi()
                pipe.hset(key, mapping={"tokens": repr(tokens), "ts": repr(t)})
                pipe.pexpire(key, max(1, int((capacity - tokens) / rate * 1000) + 1))
                await pipe.execute()
                return ok, 0.0 if ok else (cost - tokens) / rate
            except WatchError:
                continue
"""

# correct with a lock in Redis (redis-py's Lock, or SET NX PX with a token): the staggered step must not hang
TB_AUDIT_REDIS_LOCK = """
async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    async with redis.lock(f"{key}:lock", timeout=5, sleep=0.01):
        if now is None:
            sec, usec = await redis.time()
            now = sec + usec / 1e6
        state = await redis.hgetall(key)
        tokens = float(state.get("tokens", capacity))
        last = float(state.get("ts", now))
        tokens = min(capacity, tokens + max(0.0, now - last) * rate)
        ok = tokens >= cost
        if ok:
            tokens -= cost
        await redis.hset(key, mapping={"tokens": repr(tokens), "ts": repr(now)})
        await redis.pexpire(key, max(1, int((capacity - tokens) / rate * 1000) + 1))
        return ok, 0.0 if ok else (cost - tokens) / rate
"""

TB_AUDIT_SETNX_LOCK = """
import asyncio, uuid

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    me = uuid.uuid4().hex
    while not await redis.set(key + ":mutex", me, nx=True, px=2000):
        await asyncio.sleep(0.005)
    try:
        if now is None:
            sec, usec = await redis.time()
            now = sec + usec / 1e6
        tokens, ts = await redis.hmget(key, "tokens", "ts")
        tokens = capacity if tokens is None else float(tokens)
        ts = now if ts is None else float(ts)
        tokens = min(capacity, tokens + max(0.0, now - ts) * rate)
        ok = tokens >= cost
        if ok:
            tokens -= cost
        async with redis.pipeline(transaction=True) as p:
            p.hset(key, mapping={"tokens": repr(tokens), "ts": repr(now)})
            p.pexpire(key, max(1, int((capacity - tokens) / rate * 1000) + 1))
            await p.execute()
        return ok, 0.0 if ok else (cost - tokens) / rate
    finally:
        if await redis.get(key + ":mutex") == me:
            await redis.delete(key + ":mutex")
"""

TB_AUDIT_TRANSACTION_HELPER = """
async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    out = {}
    async def body(pipe):
        if now is None:
            sec, usec = await pipe.time()
            t = sec + usec / 1e6
        else:
            t = now
        raw = await pipe.hgetall(key)
        tokens = float(raw.get("tokens", capacity)); last = float(raw.get("ts", t))
        tokens = min(capacity, tokens + max(0.0, t - last) * rate)
        ok = tokens >= cost
        if ok:
            tokens -= cost
        pipe.multi()
        pipe.hset(key, mapping={"tokens": repr(tokens), "ts": repr(t)})
        pipe.pexpire(key, max(1, int((capacity - tokens) / rate * 1000) + 1))
        out["r"] = (ok, 0.0 if ok else (cost - tokens) / rate)
    await redis.transaction(body, key)
    return out["r"]
"""

# a harmless read before WATCH, then WATCH and a fresh read: correct
TB_AUDIT_PREREAD_REREAD = """
from redis.exceptions import WatchError

async def token_bucket(redis, key, capacity, rate, cost=1, now=None):
    await redis.exists(key)  # a harmless look first
    while True:
        async with redis.pipeline() as pipe:
            try:
                await pipe.watch(key)
                t = now
                if t is None:
                    sec, usec = await pipe.time(); t = sec + usec / 1e6
                tokens, last = await pipe.hmget(key, "tokens", "ts")
                tokens = capacity if tokens is None else float(tokens)
                last = t if last is None else float(last)
                tokens = min(capacity, tokens + max(0.0, t - last) * rate)
                ok = tokens >= cost
                if ok: tokens -= cost
                pipe.multi()
                pipe.hset(key, mapping={"tokens": repr(tokens), "ts": repr(t)})
                pipe.pexpire(key, max(1, int((capacity - tokens) / rate * 1000) + 1))
                await pipe.execute()
                return ok, 0.0 if ok else (cost - tokens) / rate
            except WatchError:
                continue
"""

CORRECT["token_bucket"].update(
    {
        "redis-lock": TB_AUDIT_REDIS_LOCK,
        "set-nx-lock": TB_AUDIT_SETNX_LOCK,
        "watch-transaction-helper": TB_AUDIT_TRANSACTION_HELPER,
        "look-then-watch-and-read-again": TB_AUDIT_PREREAD_REREAD,
    }
)


# sliding_window, audit C second pass: fresh answers (a wait truncated to whole seconds, expiry set in
# milliseconds as seconds or only on create, a stale read before WATCH, ...) and correct styles

SW_AUDIT_READS_BEFORE_WATCH = r"""
import uuid
from redis.exceptions import WatchError

async def sliding_window(redis, key, limit, window, now=None):
    while True:
        if now is None:
            sec, usec = await redis.time()
            t = sec + usec / 1e6
        else:
            t = now
        entries = await redis.zrangebyscore(key, f"({t - window}", "+inf", withscores=True)  # read first
        async with redis.pipeline() as pipe:
            try:
                await pipe.watch(key)   # then WATCH: too late
                pipe.multi()
                pipe.zremrangebyscore(key, "-inf", t - window)
                ok = len(entries) < limit
                if ok:
                    pipe.zadd(key, {uuid.uuid4().hex: t})
                    pipe.pexpire(key, int(window * 1000))
                await pipe.execute()
                return (True, 0.0) if ok else (False, entries[len(entries) - limit][1] + window - t)
            except WatchError:
                continue
"""

SW_AUDIT_EXPIRE_ON_CREATE = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)   --TRIM
local n = redis.call('ZCARD', KEYS[1])
if n < limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  if n == 0 then redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000)) end   --EXP
  return {1, '0'}
end
local oldest = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')   --WAITENTRY
return {0, tostring(tonumber(oldest[2]) + window - now)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_hex(8))
    return bool(ok), float(wait)
'''

SW_AUDIT_EXPIRE_WINDOW_AS_MS = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)   --TRIM
local n = redis.call('ZCARD', KEYS[1])
if n < limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  redis.call('PEXPIRE', KEYS[1], window)   --EXP
  return {1, '0'}
end
local oldest = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')   --WAITENTRY
return {0, tostring(tonumber(oldest[2]) + window - now)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_hex(8))
    return bool(ok), float(wait)
'''

SW_AUDIT_EXPIRE_TOO_LONG = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)   --TRIM
local n = redis.call('ZCARD', KEYS[1])
if n < limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  redis.call('PEXPIRE', KEYS[1], math.ceil(10 * window * 1000))   --EXP
  return {1, '0'}
end
local oldest = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')   --WAITENTRY
return {0, tostring(tonumber(oldest[2]) + window - now)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_hex(8))
    return bool(ok), float(wait)
'''

SW_AUDIT_LUA_WAIT_TRUNCATED = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)   --TRIM
local n = redis.call('ZCARD', KEYS[1])
if n < limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))   --EXP
  return {1, 0}
end
local oldest = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')   --WAITENTRY
return {0, tonumber(oldest[2]) + window - now}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_hex(8))
    return bool(ok), float(wait)
'''

SW_AUDIT_IGNORES_NOW = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)   --TRIM
local n = redis.call('ZCARD', KEYS[1])
if n < limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))   --EXP
  return {1, '0'}
end
local oldest = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')   --WAITENTRY
return {0, tostring(tonumber(oldest[2]) + window - now)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "", secrets.token_hex(8))
    return bool(ok), float(wait)
'''

SW_AUDIT_ADMITS_LIMIT_PLUS_ONE = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)   --TRIM
local n = redis.call('ZCARD', KEYS[1])
if n <= limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))   --EXP
  return {1, '0'}
end
local oldest = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')   --WAITENTRY
return {0, tostring(tonumber(oldest[2]) + window - now)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_hex(8))
    return bool(ok), float(wait)
'''

SW_AUDIT_WAIT_FROM_NEWEST = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)   --TRIM
local n = redis.call('ZCARD', KEYS[1])
if n < limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))   --EXP
  return {1, '0'}
end
local oldest = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')   --WAITENTRY
return {0, tostring(tonumber(oldest[2]) + window - now)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_hex(8))
    return bool(ok), float(wait)
'''

SW_AUDIT_NO_TRIM = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end

local n = redis.call('ZCARD', KEYS[1])
if n < limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))   --EXP
  return {1, '0'}
end
local oldest = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')   --WAITENTRY
return {0, tostring(tonumber(oldest[2]) + window - now)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_hex(8))
    return bool(ok), float(wait)
'''

SW_AUDIT_LOG_STRING_WAIT = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)   --TRIM
local n = redis.call('ZCARD', KEYS[1])
if n < limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))   --EXP
  return {1, '0'}
end
local oldest = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')   --WAITENTRY
return {0, tostring(tonumber(oldest[2]) + window - now)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_hex(8))
    return bool(ok), float(wait)
'''

SW_AUDIT_LOG_SEQUENCE_MEMBERS = r'''
SCRIPT = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if now == nil then
  local t = redis.call('TIME')
  now = t[1] + t[2] / 1e6
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], 0, now - window)
local count = redis.call('ZCARD', KEYS[1])
if count >= limit then
  local e = redis.call('ZRANGE', KEYS[1], count - limit, count - limit, 'WITHSCORES')
  return {0, math.ceil((e[2] + window - now) * 1000)}
end
local seq = redis.call('INCR', KEYS[1] .. ':seq')
redis.call('ZADD', KEYS[1], now, now .. '-' .. seq)
redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))
redis.call('PEXPIRE', KEYS[1] .. ':seq', math.ceil(window * 1000))
return {1, 0}
"""

async def sliding_window(redis, key: str, limit: int, window: float, now: float | None = None) -> tuple[bool, float]:
    script = redis.register_script(SCRIPT)
    allowed, wait_ms = await script(keys=[key], args=[limit, window, "" if now is None else now])
    return allowed == 1, wait_ms / 1000.0
'''

SW_AUDIT_TRANSACTION_HELPER = r"""
import uuid

async def sliding_window(redis, key, limit, window, now=None):
    out = {}
    async def body(pipe):
        if now is None:
            sec, usec = await pipe.time()
            t = sec + usec / 1e6
        else:
            t = now
        entries = await pipe.zrangebyscore(key, f"({t - window}", "+inf", withscores=True)
        pipe.multi()
        pipe.zremrangebyscore(key, "-inf", t - window)
        if len(entries) < limit:
            pipe.zadd(key, {uuid.uuid4().hex: t})
            pipe.pexpire(key, int(window * 1000) + 1)
            out["r"] = (True, 0.0)
        else:
            out["r"] = (False, entries[len(entries) - limit][1] + window - t)
    await redis.transaction(body, key)
    return out["r"]
"""

SW_AUDIT_REDIS_LOCK = r"""
import uuid

async def sliding_window(redis, key, limit, window, now=None):
    async with redis.lock(key + ":lock", timeout=5, sleep=0.01):
        if now is None:
            sec, usec = await redis.time()
            now = sec + usec / 1e6
        await redis.zremrangebyscore(key, "-inf", now - window)
        entries = await redis.zrange(key, 0, -1, withscores=True)
        if len(entries) < limit:
            await redis.zadd(key, {uuid.uuid4().hex: now})
            await redis.pexpire(key, int(window * 1000) + 1)
            return True, 0.0
        return False, entries[len(entries) - limit][1] + window - now
"""

SW_AUDIT_CLASS = r'''
import secrets

class _Limiter:
    LUA = """
local now = tonumber(ARGV[1])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local limit, window = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local n = redis.call('ZCARD', KEYS[1])
if n < limit then
  redis.call('ZADD', KEYS[1], now, ARGV[4])
  redis.call('EXPIRE', KEYS[1], math.ceil(window) + 1)
  return {1, '0'}
end
local e = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')
return {0, string.format('%.6f', tonumber(e[2]) + window - now)}
"""
    async def __call__(self, redis, key, limit, window, now=None):
        script = redis.register_script(self.LUA)
        ok, wait = await script(keys=[key], args=["" if now is None else repr(now), limit, window, secrets.token_hex(6)])
        return bool(ok), float(wait)

_limiter = _Limiter()

async def sliding_window(redis, key, limit, window, now=None):
    return await _limiter(redis, key, limit, window, now)
'''

SW_AUDIT_ZCOUNT = r'''
import secrets
LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local n = redis.call('ZCOUNT', KEYS[1], '(' .. (now - window), '+inf')
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if n >= limit then
  local e = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')
  return {0, math.ceil((tonumber(e[2]) + window - now) * 1000)}
end
redis.call('ZADD', KEYS[1], now, ARGV[4])
redis.call('PEXPIRE', KEYS[1], math.ceil(2 * window * 1000))
return {1, 0}
"""
async def sliding_window(redis, key, limit, window, now=None):
    ok, ms = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_urlsafe(12))
    return bool(ok), ms / 1000
'''

# keeps an entry exactly `window` old (a closed window): stricter at one instant, admitted 1 ms after

SW_AUDIT_TRIM_KEEPS_EDGE = r'''
import secrets

LUA = """
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - window))   --TRIM
local n = redis.call('ZCARD', KEYS[1])
if n < limit then   --CMP
  redis.call('ZADD', KEYS[1], now, ARGV[4])   --ADD
  redis.call('PEXPIRE', KEYS[1], math.ceil(window * 1000))   --EXP
  return {1, '0'}
end
local oldest = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')   --WAITENTRY
return {0, tostring(tonumber(oldest[2]) + window - now)}
"""

async def sliding_window(redis, key, limit, window, now=None):
    ok, wait = await redis.eval(LUA, 1, key, limit, window, "" if now is None else repr(now), secrets.token_hex(8))
    return bool(ok), float(wait)
'''

CORRECT["sliding_window"].update(
    {
        "log-eval-string-wait": SW_AUDIT_LOG_STRING_WAIT,
        "log-sequence-members": SW_AUDIT_LOG_SEQUENCE_MEMBERS,
        "watch-transaction-helper": SW_AUDIT_TRANSACTION_HELPER,
        "redis-lock": SW_AUDIT_REDIS_LOCK,
        "class-behind-a-function": SW_AUDIT_CLASS,
        "zcount-then-trim": SW_AUDIT_ZCOUNT,
        "trim-keeps-the-edge-entry": SW_AUDIT_TRIM_KEEPS_EDGE,
    }
)

WRONG: dict[str, dict[str, tuple[str, str]]] = {
    "token_bucket": {
        "get-then-set": (TB_GET_THEN_SET, "read the bucket before any of them wrote it back"),
        "client-clock": (TB_CLIENT_TIME, "redis.call('TIME')"),
        "ignores-injected-now": (TB_IGNORES_NOW, "injected now"),
        "no-expiry": (TB_NO_EXPIRY, "without an expiry"),
        "expire-only-on-create": (TB_EXPIRE_ON_CREATE, "on every write"),
        "wait-one-token": (TB_WAIT_ONE_TOKEN, "1 / rate"),
        "wait-in-milliseconds": (TB_WAIT_MS, "milliseconds"),
        "refused-takes-tokens": (TB_DENIED_TAKES_TOKENS, "takes no tokens"),
        "lua-float-truncated": (TB_LUA_FLOAT_TRUNCATED, "into an integer"),
        "dict-in-one-process": (TB_IN_PROCESS, "not shared"),
        "lock-in-one-process": (TB_LOCKED, "does not reach another"),
        "time-seconds-only": (TB_AUDIT_TIME_SECONDS_ONLY, "microseconds"),
        "wait-rounded-down": (TB_AUDIT_WAIT_ROUNDED_DOWN, "rounded down"),
        "reads-before-watch": (TB_AUDIT_READS_BEFORE_WATCH, "before its WATCH"),
    },
    "sliding_window": {
        "fixed-window": (SW_FIXED_WINDOW, "double burst at the boundary"),
        "fixed-window-from-first-request": (SW_FIXED_FROM_FIRST, "resets all at once"),
        "count-then-add": (SW_COUNT_THEN_ADD, "count, then add"),
        "member-is-the-timestamp": (SW_MEMBER_IS_TIME, "make members unique"),
        "no-expiry": (SW_NO_EXPIRY, "without an expiry"),
        "refused-requests-count": (SW_COUNTS_REFUSED, "refused again"),
        "wait-always-window": (SW_WAIT_WINDOW, "longer than it must be"),
        "counter-waits-for-next-window": (SW_COUNTER_WAITS_FOR_NEXT_WINDOW, "refused again"),
        "deque-in-one-process": (SW_IN_PROCESS, "not shared"),
        "lock-in-one-process": (SW_LOCKED, "does not reach another"),
        "client-clock": (SW_CLIENT_TIME, "redis.call('TIME')"),
        "reads-before-watch": (SW_AUDIT_READS_BEFORE_WATCH, "before its WATCH"),
        "expire-only-on-create": (SW_AUDIT_EXPIRE_ON_CREATE, "on every write"),
        "expire-window-as-milliseconds": (SW_AUDIT_EXPIRE_WINDOW_AS_MS, "PEXPIRE takes milliseconds"),
        "expire-too-long": (SW_AUDIT_EXPIRE_TOO_LONG, "twice the window"),
        "lua-wait-truncated": (SW_AUDIT_LUA_WAIT_TRUNCATED, "into an integer"),
        "ignores-injected-now": (SW_AUDIT_IGNORES_NOW, "injected now"),
        "admits-limit-plus-one": (SW_AUDIT_ADMITS_LIMIT_PLUS_ONE, "expected 3 admitted"),
        "wait-from-newest": (SW_AUDIT_WAIT_FROM_NEWEST, "longer than it must be"),
        "never-trims": (SW_AUDIT_NO_TRIM, "refused again"),
    },
}


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in CORRECT.items() for n in d])
def test_08_correct_answers_pass(task, name):
    assert_accepted(task, CORRECT[task][name])


@pytest.mark.parametrize(("task", "name"), [(t, n) for t, d in WRONG.items() for n in d])
def test_08_wrong_answers_are_rejected_for_the_reason(task, name):
    source, mentions = WRONG[task][name]
    assert_rejected(task, source, mentions=mentions)


def test_08_a_run_that_straddled_a_minute_of_the_servers_clock_is_run_again_on_a_fresh_key(monkeypatch):
    """Without now= a sliding window counter rightly admits one more across a whole minute of the server's
    clock (6 of 12 at limit 5): the check judges a run that did not straddle one, so the verdict never
    depends on when it ran. A loaded run of the suite once straddled one and failed this correct answer."""
    from autograder.checks.ch08 import window as checks

    minutes, keys = iter([7, 8, 8, 8]), []
    turns = checks._skewed_turns

    async def minute(ns) -> int:
        return next(minutes)

    async def recorded(workers, n, key, *args, **kwargs):
        keys.append(key)
        return await turns(workers, n, key, *args, **kwargs)

    monkeypatch.setattr(checks, "_server_minute", minute)
    monkeypatch.setattr(checks, "_skewed_turns", recorded)
    assert_accepted("sliding_window", CORRECT["sliding_window"]["counter-two-keys-floor"])
    assert [k for k in keys if k.startswith("sw:")] == ["sw:clock", "sw:clock:again"]
