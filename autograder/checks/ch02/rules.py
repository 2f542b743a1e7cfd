"""Chapter 02's rule tables: every requirement of each task's text, the check that enforces it
and the kept wrong solution (``WRONG`` in ``tests/test_02_grading.py``) rejected for it."""

from __future__ import annotations

from autograder.rules import Rule

RULES: dict[str, list[Rule]] = {
    "circuit_breaker": [
        Rule(
            "threshold is a failure rate",
            "_check_window_rules: 10 calls, 6 failing but never 3 in a row, must open the breaker",
            wrong="consecutive failures instead of a rate",
        ),
        Rule(
            "10 calls of which 6 fail but never 3 in a row",
            "_check_window_rules: the 11th call after that pattern must fail fast",
            wrong="consecutive failures instead of a rate",
        ),
        Rule(
            "it may trip only once that many calls have been seen",
            "_check_window_rules: a new breaker whose first call fails must let the second call through",
            wrong="trips before the window fills",
        ),
        Rule(
            "cooldown is in seconds of clock()",
            "_check_breaker: the outage and every cooldown run on the virtual clock passed as clock=",
            wrong="reads the wall clock",
        ),
        Rule(
            "is_failure(err) says whether an error counts",
            "_check_breaker: 20 answers of 404 must not trip it; with is_failure=lambda err: True they must",
            wrong="counts 4xx",
        ),
        Rule(
            "awaits fn() and returns its result or lets its error propagate unchanged",
            "_check_breaker: every call during the outage must raise the dependency's own error or CircuitOpenError",
            wrong="wraps the dependency's errors",
        ),
        Rule(
            "then it raises CircuitOpenError (from course.breaker) without calling fn",
            "_check_breaker: 9 calls during the cooldown must raise CircuitOpenError and not reach payments",
            wrong="calls fn while open",
        ),
        Rule(
            'Its constructor is CircuitOpenError(name="breaker", retry_after=0.0, reason="open")',
            "_check_breaker: a rejection of another type is reported as neither CircuitOpenError nor the dependency's",
            wrong="rejects with its own error type",
        ),
        Rule(
            'a state attribute that reads "closed", "open" or "half-open"',
            "_check_breaker: reads state on a new breaker, after tripping, during the probe and after it",
            wrong="uppercase state names",
        ),
        Rule(
            "an error that is_failure does not count is a success for the window",
            "_check_breaker: 6 answers of 404, then 503s: the 5th 503 (5 of the last 10) must open it",
            wrong="leaves 404s out of the window",
        ),
        Rule(
            "and it still propagates to the caller unchanged",
            "_check_breaker: each of 20 answers of 404 must reach the caller as the 404 itself",
            wrong="swallows a 404",
        ),
        Rule(
            "in half-open, exactly one probe runs while concurrent callers (asyncio.gather) are rejected",
            "_check_breaker: holds the probe in flight on a gate while 5 callers arrive with asyncio.gather",
            wrong="admits everyone in half-open",
        ),
        Rule(
            "a failed probe reopens the breaker with a fresh cooldown counted from the probe",
            "_check_breaker: calls 1 s and cooldown - 1 s after each failed probe must fail fast",
            wrong="failed probe keeps the old cooldown",
        ),
        Rule(
            "a successful one closes it, and the breaker starts counting afresh (an empty window)",
            "_check_breaker: after recovery a one-off 503 must not reopen it (old failures must not count again)",
            wrong="never resets counts",
        ),
        Rule(
            "calls already in flight when the state changes are not cancelled",
            "_check_breaker: a slow call held on a gate while 10 failures open the breaker must return its value",
            wrong="cancels calls in flight when it opens",
        ),
        Rule(
            "one that ends while the probe is out",
            "_check_breaker: a slow call from before the breaker opened succeeds while the probe is held in flight; "
            "the breaker must stay half-open, then open when the probe fails",
            wrong="any call that ends in half-open decides",
        ),
        Rule(
            "but their outcome no longer counts",
            "_check_breaker: that slow call's late success must leave the breaker open",
            wrong="a late success closes an open breaker",
        ),
        Rule(
            "one that fails after a probe has closed the breaker again is not in the fresh window",
            "_check_breaker: a slow call from before the breaker opened fails after a probe closed it; with 4 "
            "failures in the next 9 calls the 10th must still go through",
            wrong="a late failure counts in the fresh window",
        ),
        Rule(
            "and for a probe (a probe answered 404 closes the breaker)",
            "_check_breaker: after the cooldown the probe is answered 404; the 404 must reach the caller and close it",
            wrong="a probe answered 404 reopens it",
        ),
        Rule(
            "a probe whose caller is cancelled (a BaseException) decides nothing, and the next caller is the probe",
            "_check_breaker: the probe is held in flight and cancelled; the next call must reach payments and close it",
            wrong="a cancelled probe wedges half-open",
        ),
        Rule(
            "Once the window trips, calls must fail fast and the dependency must not be called until the cooldown passes",
            "_check_breaker: after the cooldown the first call is the probe; before it, no call reaches payments",
            wrong="no half-open",
        ),
        Rule(
            "Read time only from self.clock(): the checks never wait for real.",
            "_check_breaker: only the virtual clock advances; a breaker reading time.monotonic never cools down",
            wrong="reads the wall clock",
        ),
    ],
    "bulkhead": [
        Rule(
            "at most limit calls of fn run at once",
            "_check_bulkhead: 10 calls held on a gate into Bulkhead(3, max_queue=2): 3 may enter fn",
            wrong="one call too many at once",
        ),
        Rule(
            "up to max_queue more calls wait for a free slot",
            "_check_bulkhead: the 2 queued calls must wait, then run once the gate opens",
            wrong="leaks on a cancelled waiting call",
        ),
        Rule(
            "any call beyond that fails at once with BulkheadFullError",
            "_check_bulkhead: the 5 calls beyond 3 + 2 must be rejected before anything is released",
            wrong="waits for room instead of rejecting",
        ),
        Rule(
            "from course.bulkhead; its constructor is BulkheadFullError",
            "_check_bulkhead: a rejection of another type is counted as another error, not a rejection",
            wrong="rejects with its own error type",
        ),
        Rule(
            "call returns what fn() returns, and lets its errors propagate unchanged",
            "_check_bulkhead: 6 calls whose fn raises ValueError must each raise that ValueError",
            wrong="wraps fn's errors",
        ),
        Rule(
            "a permit is returned whatever happens: when fn raises",
            "_check_bulkhead: after 6 errors in Bulkhead(2), 2 of 3 new calls must run",
            wrong="leaks on exception",
        ),
        Rule(
            "when a running call is cancelled",
            "_check_bulkhead: 2 running calls cancelled, then 2 of 3 new calls must run",
            wrong="leaks on a cancelled running call",
        ),
        Rule(
            "when a waiting call is cancelled (cancellation is a BaseException, not an Exception)",
            "_check_bulkhead: a cancelled waiter's place in the queue must go to the next caller",
            wrong="leaks on a cancelled waiting call",
        ),
        Rule(
            "The checks fill bulkheads with calls that block on events they control, hang one dependency",
            "_check_bulkhead: search hangs with its bulkhead full while 5 payments go through their own",
            wrong="permits shared between bulkheads",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {
    "circuit_breaker": ["course.breaker:CircuitBreaker"],
    "bulkhead": ["course.bulkhead:Bulkhead"],
}
