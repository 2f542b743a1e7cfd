"""Hidden checks of chapter 12 (the URL shortener): ``encode_code``, ``create_link``, ``resolve``.

- Codes are checked as a bijection (round trips both ways, on the edges and on thousands
  of seeded random ids and codes), for guessability (codes of consecutive ids must share
  almost no characters and their end characters must not predict each other) and across
  replicas (a code made by one copy of the answer decodes in another).
- ``create_link`` races for real: a trigger holds every insert into ``links`` until every
  concurrent caller is parked inside PostgreSQL (or backing off on a virtual clock), so a
  check-then-insert loses the race every time. The callers of one key are split over two
  replicas of the answer, so state kept in one process does not pass.
- ``resolve`` runs against a Redis client and a pool whose faults the check switches: a
  Redis that refuses connections and a PostgreSQL that does. Both count every command, so
  "no query" and "does not hammer Redis" are counts, not timings. The breaker it is given
  runs on a virtual clock.
"""

# Imported in the order the chapter's tasks are reported in.
from autograder.checks.ch12 import codes, links, resolve  # noqa: F401, E402
from autograder.rules import Rule

# ============================================================================ rule tables (issue 28)

RULES: dict[str, list[Rule]] = {
    "encode_code": [
        Rule(
            "to a code of exactly **7 characters** of `ALPHABET`",
            "check_codes: the edges and thousands of seeded random ids must give 7 characters of ALPHABET",
            "no-padding",
        ),
        Rule(
            "base62 of a **shuffled** id",
            "check_codes: 3 runs of 1,000 consecutive ids; neighbouring codes must share no more characters than "
            "chance",
            "sequential",
        ),
        Rule(
            "Codes of consecutive ids must look unrelated",
            "check_codes: the same runs; reversing the digits of the id is no shuffle",
            "reversed",
        ),
        Rule(
            "The shuffle is a **keyed bijection**",
            "check_codes: two more replicas (the cell run again) must give the same codes and decode each other's",
            "key-per-process",
        ),
        Rule(
            "with cycle-walking back into the range",
            "check_codes: decode_code(encode_code(n)) == n for the edges and the seeded random ids",
            "no-cycle-walk",
        ),
        Rule(
            "`encode_code(decode_code(c)) == c` for every 7-character code",
            "check_codes: seeded random codes must decode, and encode back to themselves",
            "hashed",
        ),
        Rule(
            "Both raise `ValueError` for an id outside the range",
            "check_codes: out-of-range ids and malformed codes must raise ValueError",
            "no-decode-validation",
        ),
        Rule(
            "no shared characters beyond chance",
            "check_codes: the share of characters in the same place between consecutive codes is measured",
            "xor",
        ),
        Rule(
            "beyond chance, no constant step",
            "check_codes: whether the first or last character of the next code is predictable from this one",
            "multiplied",
        ),
        Rule(
            "their codes must agree with yours",
            "check_codes: two more replicas of the cell (run again from scratch) must give the same codes as yours "
            "and decode each other's",
            "key-per-process",
        ),
        Rule(
            "use `CODE_KEY` (bytes) as the key",
            "check_codes: a replica of the cell configured with another CODE_KEY (in the notebook's names and in "
            "course.shortener) must give other codes",
            "keyless-round",
        ),
        Rule(
            "One more replica is configured with another `CODE_KEY`: its codes must differ from yours",
            "check_codes: _with_key runs the cell again with CODE_KEY swapped; fewer than a tenth of 200 codes may "
            "stay the same",
            "keyless-round",
        ),
        Rule(
            "one of them in another Python process",
            "check_codes: a replica in a fresh process with another PYTHONHASHSEED must give the same codes and "
            "decode yours (hash() of str or bytes differs between processes)",
            "round-function-on-hash",
        ),
    ],
    "create_link": [
        Rule(
            "that creates a link and returns",
            "_check_create_link: 12 links created at once must each return {code, url} with 12 distinct codes",
            "max-id",
        ),
        Rule(
            "may wait for it inside PostgreSQL or raise `RequestInProgress`",
            "_check_create_link: a RequestInProgress is retried with backoff on a virtual clock (_retrying); the ten "
            "callers of one key must still get the same response and make one link",
            "key-check-then-act",
        ),
        Rule(
            "split ten callers of one key over two replicas of your cell",
            "_check_create_link: the ten callers of one key are split over two replicas, inserts held until all wait",
            "key-in-process",
        ),
        Rule(
            "take it from the sequence (`SELECT nextval('link_ids')`)",
            "_check_create_link: 12 links created at once, inserts held until all wait (gated): 12 codes",
            "max-id",
        ),
        Rule(
            "the code is `encode_code(id)` of the link's own id",
            "_check_codes_are_ids: each of the 12 links' codes must decode (shortener.decode_code or the notebook's "
            "decode_code) to the row's id",
            "code-of-another-id",
        ),
        Rule(
            "insert the row with that id",
            "_check_codes_are_ids: the 12 links' ids must be at most the sequence's last_value",
            "random-id",
        ),
        Rule(
            "A call that fails (its alias is taken) leaves no claim behind",
            "_check_create_link: a taken alias with one idempotency key, twice: AliasTaken both times",
            "claim-in-own-transaction",
        ),
        Rule(
            "if it is taken, raise `AliasTaken(alias)`",
            "_check_create_link: the alias again for another URL must raise AliasTaken",
            "alias-returns-existing",
        ),
        Rule(
            "PostgreSQL decides: the checks start ten claims of one alias at once",
            "_check_create_link: ten claims of one alias at once, inserts held until all wait in PostgreSQL",
            "check-then-insert-alias",
        ),
        Rule(
            "returns the **same response** and creates one link, however many calls arrive at once",
            "_check_create_link: ten callers of one key, inserts held until all wait in PostgreSQL (gated)",
            "key-check-then-act",
        ),
        Rule(
            "however many calls arrive at once",
            "_check_create_link: the ten callers are split over two replicas of the cell",
            "key-in-process",
        ),
        Rule(
            "the same key with another `url` or `alias` raises",
            "_check_create_link: the same key with another URL must raise IdempotencyKeyReused and make no link",
            "no-hash",
        ),
        Rule(
            "another `url` or `alias` raises",
            "_check_create_link: the same key and URL with alias='two-alias' must raise IdempotencyKeyReused",
            "hash-without-alias",
        ),
    ],
    "resolve": [
        Rule(
            "the URL of `code`, or `None` if no link has that code",
            "_check_resolve: hits must return the link's URL and a missing code None; PostgreSQL down is no miss, "
            "so returning None then is refused",
            "db-error-as-miss",
        ),
        Rule(
            "use `RedisError` from the setup cell",
            "_check_resolve: Redis refusing connections for 30 redirects; an except that does not catch the "
            "Redis error (as redis.exceptions on the client would not) fails the redirect",
            "client-exceptions",
        ),
        Rule(
            "count every Redis command and every PostgreSQL query",
            "_check_resolve: every Redis command and PostgreSQL query is counted; a missing code looked up 50 times "
            "must reach PostgreSQL once",
            "no-negative-cache",
        ),
        Rule(
            "Send **every** Redis command through it",
            "_check_resolve: the check counts Redis commands made while the breaker is open",
            "no-breaker",
        ),
        Rule(
            "cache the URL for about `CACHE_TTL` seconds",
            "_check_resolve: the cached link's PTTL must be within half of CACHE_TTL either way",
            "link-cached-a-minute",
        ),
        Rule(
            "Cache a **miss** too",
            "_check_resolve: a missing code looked up 50 times must reach PostgreSQL once",
            "no-negative-cache",
        ),
        Rule(
            "(an empty string works) for `MISS_TTL` seconds",
            "_check_resolve: the cached miss must expire within 5 minutes, sooner than a link",
            "miss-without-ttl",
        ),
        Rule(
            "Send **every** Redis command through it",
            "_check_resolve: the breakers the check hands out mark the commands sent inside their calls; a command "
            "sent outside breaker.call is counted even while Redis is up",
            "set-outside-breaker",
        ),
        Rule(
            "test what Redis returned with `is None` (nothing cached)",
            "_check_resolve: a cached link's key is deleted right after an EXISTS/TTL of it (a TTL running out "
            "between two commands); the redirect must still find the link",
            "exists-then-get",
        ),
        Rule(
            "test what Redis returned with `is None`",
            "_check_resolve: a cached miss ('') must be served from Redis, not looked up again",
            "truthy-miss",
        ),
        Rule(
            "answer from PostgreSQL, never fail the request",
            "_check_resolve: Redis refusing connections for 30 redirects; every redirect must still be answered",
            "no-fallback",
        ),
        Rule(
            "Once the breaker is open, Redis gets no more commands until its cooldown",
            "_check_resolve: the commands sent to the dead Redis are counted",
            "set-around-breaker",
        ),
        Rule(
            "PostgreSQL down: let the error through",
            "_check_resolve: PostgreSQL down must raise (the service answers 503), never return None",
            "db-error-as-miss",
        ),
        Rule(
            "never cache a miss you did not see",
            "_check_resolve: after PostgreSQL comes back, the code must resolve (no miss cached while it was down)",
            "caches-miss-on-db-error",
        ),
        Rule(
            "`CircuitOpenError` when the breaker is open",
            "_check_resolve: both down; a breaker that is open must still answer from PostgreSQL",
            "redis-errors-only",
        ),
        Rule(
            "Cache-aside: Redis first; on a miss read `links`",
            "_check_resolve: a second replica must be served by the first one's cached entry",
            "in-process",
        ),
    ],
}

#: The course's own answers: a learner who only calls one of these earns nothing for the task.
REFERENCES: dict[str, list[str]] = {
    "encode_code": [
        "course.shortener:encode_code",
        "course.shortener:decode_code",
        # the keyed shuffle itself (base62 alone is the chapter's "failure first" and stays allowed)
        "course.shortener:shuffle",
        "course.shortener:unshuffle",
        "course.shortener:feistel",
        "course.shortener:unfeistel",
    ],
    "create_link": ["course.shortener:create_link"],
    "resolve": ["course.shortener:resolve"],
}

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 2
#: A process of another PYTHONHASHSEED that check_encode_code asks for (in_fresh_process), started once
#: the setup cells ran.
FRESH_PROCESSES = {"encode_code": ({"hashseed": 1},)}
