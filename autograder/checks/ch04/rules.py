"""Chapter 04's rule tables: every requirement of each task's text, the check that enforces it
and the kept wrong solution (``WRONG`` in ``tests/test_04_grading.py``) rejected for it."""

from __future__ import annotations

from autograder.rules import Rule

RULES: dict[str, list[Rule]] = {
    "get_cached": [
        Rule(
            "A hit returns json.loads of what Redis holds at key.",
            "_check_get_cached: 50 calls while the key is cached must return the loaded value, no query",
            wrong="a hit returns the raw string",
        ),
        Rule(
            "concurrent callers of the same key in this process share one loader() call",
            "_check_get_cached: 50 concurrent calls on a missing key must make exactly one query",
            wrong="no single-flight",
        ),
        Rule(
            "callers of different keys never wait on each other",
            "_check_get_cached: 10 keys x 5 callers: the 10 loads must be in flight at once (loads held on gates)",
            wrong="one lock for all keys",
        ),
        Rule(
            "Store json.dumps(value) at key with a TTL drawn from [ttl, 1.2 * ttl] seconds",
            "_check_get_cached: the TTL each SET asks for must lie within [ttl, 1.2 ttl]",
            wrong="TTL below the requested one",
        ),
        Rule(
            "every waiting caller gets the error",
            "_check_get_cached: a failing loader under 20 waiters: each must raise its error",
            wrong="waiters get None after a failed load",
        ),
        Rule(
            "nothing is cached, and the next call loads again",
            "_check_get_cached: after the failure Redis must hold nothing and the next call must query",
            wrong="loader error cached as a value",
        ),
        Rule(
            "must not cancel the shared load",
            "_check_cancelled_caller: cancels 2 of 10 callers, the starter among them, while the load is held",
            wrong="not shielded",
        ),
        Rule(
            "the other callers still get its value, and it still fills the cache",
            "_check_cancelled_caller: the 8 others must get the value of the one load, and Redis must hold it",
            wrong="an event per key",
        ),
        Rule(
            "Run the load as a task of its own and have every caller await it through asyncio.shield(task)",
            "_check_cancelled_caller: a load run by the first caller itself dies with it, and a second load starts",
            wrong="a load run by its caller, handed over on cancel",
        ),
        Rule(
            "every waiting caller gets the error of that one load (none of them calls loader() again for it)",
            "_check_get_cached: a failing loader under 20 waiters must be called once (loads counted as they start)",
            wrong="a lock per key",
        ),
        Rule(
            "then one more caller arrives while it still runs",
            "_check_cancelled_caller: an 11th caller after the cancellations, before the held load ends, must join it",
            wrong="in-flight entry removed by each caller",
        ),
        Rule(
            "50 concurrent calls on a missing key make exactly one database query",
            "_check_get_cached: PostgreSQL logs every load; one query for the burst",
            wrong="no single-flight",
        ),
        Rule(
            "after the key expires the next burst again makes exactly one",
            "_check_get_cached: the key is deleted and 50 more calls must make one new query",
            wrong="in-flight entry never removed",
        ),
        Rule(
            "a failing loader reaches all 20 waiters, caches nothing, and the next call loads",
            "_check_get_cached: a loader that raises once, then succeeds",
            wrong="entry removed only on success",
        ),
        Rule(
            "10 keys with 5 callers each make 10 loads that run at the same time",
            "_check_get_cached: one query per key, 10 loads in flight at once",
            wrong="one load shared by every key",
        ),
        Rule(
            "40 keys written together have TTLs within [ttl, 1.2 * ttl] that are spread out",
            "_check_get_cached: the requested TTLs of 40 keys must spread over at least 5% of ttl",
            wrong="no TTL jitter",
        ),
        Rule(
            "the 8 others and the late caller must get the value of that one load, and it must be cached",
            "_check_cancelled_caller: the values the 9 callers got and the key in Redis",
            wrong="an event per key",
        ),
        Rule(
            "That last check is worth 2 of the 6 points",
            "_check_get_cached: r.fraction is 4/6 once every check before the cancelled callers passed",
            wrong="not shielded",
        ),
    ],
    "get_user_cached": [
        Rule(
            'return the user as {"id": ..., "name": ..., "email": ...}, or None if there is no such user',
            "_check_get_user_cached: user 7 must come back as a dict; a missing id as None",
            wrong="a row as a tuple",
        ),
        Rule(
            "cache users in Redis as JSON for about USER_TTL seconds",
            "_check_get_user_cached: the TTL the user's SET asked for must be positive",
            wrong="a user without a TTL",
        ),
        Rule(
            "cache users in Redis as JSON",
            "_check_get_user_cached: one of the keys the first lookup of user 7 wrote must GET as the user's JSON",
            wrong="a user as a hash",
        ),
        Rule(
            "a lookup that hits a cached miss must not set its TTL again",
            "_check_get_user_cached: counts the commands that set a TTL on the miss's keys during 99 hits",
            wrong="a sliding expiry on misses",
        ),
        Rule(
            "so 100 lookups of a missing id make one database query",
            "_check_get_user_cached: PostgreSQL counts the queries on the users view",
            wrong="no negative caching",
        ),
        Rule(
            "at least 10 s",
            "_check_get_user_cached: the TTL the user's SET asked for must be at least 10 s",
            wrong="a TTL in milliseconds",
        ),
        Rule(
            "at least 1 s, at most 60 s",
            "_check_get_user_cached: the TTL the miss's SET asked for must be at least 1 s, checked before any lookup "
            "that a millisecond TTL would turn back into a query",
            wrong="a TTL in milliseconds",
        ),
        Rule(
            "for a short MISS_TTL (at least 1 s, at most 60 s)",
            "_check_get_user_cached: the miss's requested TTL must be at most 60 s and below the user's",
            wrong="a miss as long as a user",
        ),
        Rule(
            "and a user created later shows up once the miss expires",
            "_check_get_user_cached: the cached miss must have a TTL; the user is created, the miss deleted",
            wrong="a miss without a TTL",
        ),
        Rule(
            "the checks find your keys by what appears in Redis",
            "_check_get_user_cached: the keys that appear in Redis after a first lookup of a missing id",
            wrong="one set for every miss",
        ),
        Rule(
            "so keep users and misses in Redis, not in memory",
            "_check_get_user_cached: a miss kept in a set in the process leaves no key in Redis",
            wrong="misses in process memory",
        ),
        Rule(
            "decide hit or miss on Redis's raw reply",
            "_check_get_user_cached: 100 lookups of a missing id after its miss is cached as an empty string",
            wrong="an empty string read by truthiness",
        ),
        Rule(
            'An if cached: (or a miss stored as "") turns every cached miss back into a query.',
            "_check_get_user_cached: counts the queries those lookups make",
            wrong="an empty string read by truthiness",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {
    "get_cached": ["course.caching:CacheAside.get", "course.caching:SingleFlight.do"],
    "get_user_cached": [],
}
