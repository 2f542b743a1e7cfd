"""Hidden checks of chapter 08: ``token_bucket`` and ``sliding_window``.

Both limiters must hold across processes, so the checks run the learner's answer cell in
two fresh worker processes (:class:`autograder.probes.Workers`), replicas on other hosts,
as well as in the grader: a bucket kept in a dict admits twice as much there. One worker
can run with its clock set two minutes back, so a limiter that reads the client's clock
instead of Redis ``TIME`` admits more than its limit.

Time is injected (``now=``) everywhere else, so every verdict is exact: refill after 0.2 s,
a burst on both sides of a window boundary, the retry a ``Retry-After`` promises. Races
are made to happen every time: concurrent requests run in lockstep (:mod:`autograder.lockstep`),
each Redis command held until every request still running has sent its own, in one process
and across the two workers, so a read-then-write lets every request read the same state (and
an ``asyncio.Lock`` guards one replica only), while one Lua script (or WATCH/MULTI) stays exact.
"""

# Imported in the order the chapter's tasks are reported in.
from autograder.checks.ch08 import bucket, window  # noqa: F401, E402
from autograder.rules import Rule

# ============================================================================= rule tables (issue 28)

RULES: dict[str, list[Rule]] = {
    "token_bucket": [
        Rule(
            "Keep all the bucket's state in Redis under keys whose names contain",
            "_in_processes: the answer cell in two separate processes, 15 concurrent requests each, on one bucket "
            "of 10, in one lockstep across both: exactly 10 admitted",
            "dict-in-one-process",
        ),
        Rule(
            "An `asyncio.Lock` does not make it atomic",
            "_in_processes: the two processes' requests in one lockstep, so each replica's lock lets one through "
            "per round and both read the same bucket: exactly 10 admitted",
            "lock-in-one-process",
        ),
        Rule(
            "refills `rate` tokens per second",
            "_check_token_bucket: refill on injected time (now=), fractions included",
            "ignores-injected-now",
        ),
        Rule(
            "Never the caller's clock",
            "_skewed_turns: two processes take turns with now=None while the second one's clock is two minutes behind",
            "client-clock",
        ),
        Rule(
            "Otherwise it takes **none**",
            "_token_bucket_hidden: a request of cost above the tokens left is refused, then a cheaper one admitted",
            "refused-takes-tokens",
        ),
        Rule(
            "`(cost - tokens) / rate`, exactly or rounded up to the millisecond",
            "_check_token_bucket: the wait returned is compared with (cost - tokens) / rate",
            "wait-one-token",
        ),
        Rule(
            "`now` (seconds, a float) when it is given",
            "_check_token_bucket: every request of the visible part passes now=; the clock must be that one",
            "ignores-injected-now",
        ),
        Rule(
            "the **Redis server's clock**",
            "_skewed_turns: two processes take turns with now=None while the second one's clock is two minutes behind",
            "client-clock",
        ),
        Rule(
            "read, decide and write in **one Lua script**",
            "_token_bucket_hidden: 20 concurrent requests on a bucket of 5 in lockstep (each Redis command held "
            "until every request still running has sent its own): exactly 5 admitted",
            "get-then-set",
        ),
        Rule(
            "when `now` is None, the **Redis server's clock**",
            "_subsecond_refill: now=None, a bucket of 2 at 10/s emptied, then a request 120 ms later (same second "
            "of the server's clock) must be admitted: the microseconds of TIME count",
            "time-seconds-only",
        ),
        Rule(
            "exactly or rounded up to the millisecond",
            "_token_bucket_hidden: capacity 2 at 3/s, the refused request's wait must be 1/3 s or 0.334, not 0.333",
            "wait-rounded-down",
        ),
        Rule(
            "`WATCH` the key before you read it",
            "_take_inside_a_read: two requests on a bucket of 1; one is held at its WATCH (after any read before "
            "it) while the other takes the token: exactly 1 admitted",
            "reads-before-watch",
        ),
        Rule(
            "return milliseconds, or a string",
            "_check_token_bucket: a wait of a fraction of a second must come back as that fraction, not 0",
            "lua-float-truncated",
        ),
        Rule(
            "Expiry on **every write**",
            "_token_bucket_hidden: the check shortens the keys' TTLs, makes a request, and reads them again",
            "expire-only-on-create",
        ),
        Rule(
            "the key must expire no sooner than the bucket would be full again",
            "_token_bucket_hidden: an empty bucket's keys must have a TTL between capacity / rate - 1 and "
            "2 x capacity / rate + 1 seconds",
            "no-expiry",
        ),
        Rule(
            "returns a tuple `(admitted, retry_after)`",
            "_check_token_bucket: every answer is read as (admitted, retry_after) in seconds",
            "wait-in-milliseconds",
        ),
    ],
    "sliding_window": [
        Rule(
            "at most `limit` requests admitted in any `window` seconds",
            "_sliding_window_hidden: 100 requests in the second before a whole minute and 100 in the second after, "
            "limit 100 per 60 s",
            "fixed-window",
        ),
        Rule(
            "a limiter with **no boundary burst**",
            "_sliding_window_hidden: a window that would start at a client's first request",
            "fixed-window-from-first-request",
        ),
        Rule(
            "only admitted requests count",
            "_sliding_window_hidden: refused requests are retried; they must not push the window out",
            "refused-requests-count",
        ),
        Rule(
            "requests with the same timestamp each count",
            "_sliding_window_hidden: eight requests at one instant",
            "member-is-the-timestamp",
        ),
        Rule(
            "A retry after that long must be admitted",
            "_sliding_window_hidden: the promised wait is probed at that time",
            "counter-waits-for-next-window",
        ),
        Rule(
            "A retry after that long must be admitted",
            "_sliding_window_hidden: requests at 1.25 .. 4.25 s make the wait fractional (6.25 s): a wait truncated "
            "to whole seconds (a Lua number in a reply) is refused when retried",
            "lua-wait-truncated",
        ),
        Rule(
            "one at `max(0.5, 10%)` of it earlier must still be refused",
            "_sliding_window_hidden: the promised wait is probed before it ends",
            "wait-always-window",
        ),
        Rule(
            "one Lua script (or `WATCH`/`MULTI`",
            "_sliding_window_hidden: 20 concurrent requests in lockstep (each Redis command held until every "
            "request still running has sent its own): exactly 5 admitted",
            "count-then-add",
        ),
        Rule(
            "at most `2 x window + 1` seconds",
            "_sliding_window_hidden: the keys' TTLs are read: at most 121 s for a 60 s window",
            "expire-too-long",
        ),
        Rule(
            "`key`, each with an expiry",
            "_sliding_window_hidden: the keys' TTLs are read: every key has one",
            "no-expiry",
        ),
        Rule(
            "`now` when given, else `redis.call('TIME')`",
            "_check_sliding_window: (public) a retry at the injected now + the wait it said must be admitted",
            "ignores-injected-now",
        ),
        Rule(
            "at most `limit` requests admitted in any `window` seconds",
            "_check_sliding_window: (public) limit 3 per 10 s, 4 requests at one instant: the 4th refused",
            "admits-limit-plus-one",
        ),
        Rule(
            "one at `max(0.5, 10%)` of it earlier must still be refused",
            "_sliding_window_hidden: the promised wait is probed before it ends (a wait from the newest entry)",
            "wait-from-newest",
        ),
        Rule(
            "only admitted requests count",
            "_check_sliding_window: (public) the retry after the wait; entries older than the window must leave it",
            "never-trims",
        ),
        Rule(
            "each with an expiry set again by every write to it",
            "_expiry_again: the check shortens the keys' TTLs to half the window, one more admitted request must "
            "set at least the window again",
            "expire-only-on-create",
        ),
        Rule(
            "of at least `window` and at most",
            "_expiry_after_a_write: (public, first) one admitted request with a window of an hour; a key it wrote "
            "must live at least 3599 s (PEXPIRE given seconds lives 3.6 s)",
            "expire-window-as-milliseconds",
        ),
        Rule(
            "the key watched before it is read",
            "_take_inside_a_read: two requests on a limit of 1; one is held at its WATCH (after any read before "
            "it) while the other is admitted: exactly 1 admitted",
            "reads-before-watch",
        ),
        Rule(
            "`now` when given, else `redis.call('TIME')`",
            "_skewed_turns: two processes taking turns with now=None, one clock two minutes behind",
            "client-clock",
        ),
        Rule(
            "keys whose names contain `key`",
            "_in_processes: two processes with 12 concurrent requests each, limit 11, in one lockstep across both",
            "deque-in-one-process",
        ),
        Rule(
            "time, atomicity and keys as in `token_bucket`",
            "_in_processes: limit 11 (odd) in one lockstep across two processes: a count-then-add under a lock "
            "in each process admits two per round, 12",
            "lock-in-one-process",
        ),
        Rule(
            "A sliding log (a sorted set of admitted requests' times, at `key`) does this exactly",
            "_sliding_window_hidden: 100 requests either side of a whole minute, limit 100 per 60 s: at most 100 "
            "admitted (plus the counter's allowance)",
            "fixed-window",
        ),
        Rule(
            "is accepted too: the checks allow it",
            "_sliding_window_hidden: the boundary probe allows ceil(limit x 2 / window) extra requests, not the "
            "limit extra a fixed window lets through",
            "fixed-window",
        ),
        Rule(
            "100 requests in the second before a whole minute and 100 in the second after",
            "_sliding_window_hidden: runs the scenarios this sentence lists, each against its kept wrong answer",
            "fixed-window",
        ),
    ],
}

#: The course's own answers: a learner who only calls one of these earns nothing for the task.
REFERENCES: dict[str, list[str]] = {
    "token_bucket": ["course.ratelimit:token_bucket"],
    "sliding_window": ["course.ratelimit:sliding_window"],
}
