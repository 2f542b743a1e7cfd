"""Chapter 01's rule tables: every requirement of each task's text, the check that enforces it
and the kept wrong solution (``WRONG`` in ``tests/test_01_grading.py``) rejected for it."""

from __future__ import annotations

from autograder.rules import Rule

RULES: dict[str, list[Rule]] = {
    "is_retryable": [
        Rule(
            "timeouts: TimeoutError (also asyncio.TimeoutError) and httpx.TimeoutException",
            "check_is_retryable: TimeoutError() and httpx's timeouts must be True, whatever their message says",
            wrong="matches 'timeout' in the message",
        ),
        Rule(
            "except httpx.PoolTimeout (your own pool is full: waiting again only queues again)",
            "check_is_retryable: httpx.PoolTimeout made by hand and from a live full pool must be False",
            wrong="retries a full pool (PoolTimeout)",
        ),
        Rule(
            "connection errors: httpx.TransportError and ConnectionError",
            "check_is_retryable: ConnectError, ReadError, resets, refusals, broken pipes, live ones too, must be True",
            wrong="forgets connection errors",
        ),
        Rule(
            "except the two caller bugs httpx.UnsupportedProtocol and httpx.LocalProtocolError",
            "check_is_retryable: an ftp:// URL and a header with a newline, made by hand and live, must be False",
            wrong="retries the caller bugs",
        ),
        Rule(
            "HTTP errors whose status is 408, 429, or 5xx (500 to 599) other than 501 and 505",
            "check_is_retryable: 408, 429, 500-504, 599 True; 501 and 505 False, as httpx errors and as status=",
            wrong="5xx only, forgets 408 and 429",
        ),
        Rule(
            "an httpx.HTTPStatusError (its status is err.response.status_code)",
            "check_is_retryable: httpx.HTTPStatusError 503 (no status attribute) must be True",
            wrong="only a status attribute (httpx errors have none)",
        ),
        Rule(
            "or any exception with an integer status attribute",
            "check_is_retryable: an error with status=503 and DependencyError(503) must be True",
            wrong="only httpx status errors (a status attribute is ignored)",
        ),
        Rule(
            "False for every other status (the other 4xx, 501, 505)",
            "check_is_retryable: 400, 401, 403, 404, 409, 418, 422, 451, 501, 505 must be False",
            wrong="every 5xx, 501 and 505 too",
        ),
        Rule(
            "or 5xx (500 to 599) other than 501 and 505",
            "check_is_retryable: status=600 and status=999 must be False (5xx is 500 to 599, not 500 and up)",
            wrong="5xx as any status from 500 up",
        ),
        Rule(
            "and for anything else (bugs such as ValueError, an error whose status is not an int)",
            "check_is_retryable: ValueError, KeyError, status=None and status='503' must be False",
            wrong="converts a string status",
        ),
        Rule(
            "and for anything else (bugs such as ValueError, an error whose status is not an int)",
            "check_is_retryable: FileNotFoundError and PermissionError (OSErrors, not connection errors) must be False",
            wrong="every OSError as a connection error",
        ),
        Rule(
            "Many of the True cases have unknown outcomes",
            "check_is_retryable: nothing; the text marks whether a non-idempotent call may repeat them not graded",
            not_graded=True,
        ),
        Rule(
            "Always return a bool, and never raise.",
            "check_is_retryable: every answer must be a bool; an exception from is_retryable fails the task",
            wrong="falls off the end (returns None)",
        ),
        Rule(
            "The checks try every case above with made-up errors, then real ones from httpx",
            "check_is_retryable: errors collected live from a FlakyService, a closed port, a full pool, bad requests",
            wrong="every HTTP error",
        ),
    ],
    "with_retry": [
        Rule(
            "it awaits fn() at most retries + 1 times and returns the first result",
            "check_with_retry: counts calls with retries=0, 1, 3, 4, 6, 7 and 10",
            wrong="one attempt too few",
        ),
        Rule(
            "it awaits sleep(rand() * min(max_delay, base_delay * 2 ** k)) (full jitter)",
            "check_with_retry: every delay must equal the recorded rand() draw times its window",
            wrong="no jitter",
        ),
        Rule(
            "min(max_delay, base_delay * 2 ** k)",
            "check_with_retry: with rand() = 1 the delays must double up to max_delay, then stay there",
            wrong="no cap",
        ),
        Rule(
            "after failed attempt k (k = 0, 1, ...)",
            "check_with_retry: the first delay's window is base_delay (k = 0)",
            wrong="off by one exponent",
        ),
        Rule(
            "when the error is not retryable (ask retryable(err))",
            "check_with_retry: a 404, a 400 and a ValueError are called once; a custom retryable is asked",
            wrong="ignores the retryable argument",
        ),
        Rule(
            "it re-raises the last error, unchanged",
            "check_with_retry: the error raised must be the very object the last attempt raised",
            wrong="wraps the final error",
        ),
        Rule(
            "it never sleeps after the final attempt",
            "check_with_retry: counts the sleeps when the attempts are spent (retries=3, 1, 0 and the defaults)",
            wrong="sleeps after the final attempt",
        ),
        Rule(
            "Use the sleep and rand you are given",
            "check_with_retry: injects a recording sleep and a seeded rand(); module random's draws do not match",
            wrong="module random instead of the injected rand",
        ),
        Rule(
            "catch Exception (not BaseException: cancellation must get through)",
            "check_with_retry: cancels a caller while its attempt hangs; it must end with CancelledError",
            wrong="catches BaseException (retries cancellation)",
        ),
        Rule(
            "keep no state between calls",
            "check_with_retry: 50 concurrent callers, each with its own rand(), on one virtual clock",
            wrong="a global attempt counter",
        ),
    ],
    "retry_test": [
        Rule(
            "every retry helper deserves: async def test_survives_three_of_five_failures(with_retry)",
            "check_retry_test: a spy with_retry passed as the argument counts the test's calls",
            wrong="never calls the with_retry it is given",
        ),
        Rule(
            "builds a dependency that fails 3 of its first 5 calls",
            "check_retry_test: the test must pass against three correct versions of with_retry",
            wrong="fails against a correct with_retry",
        ),
        Rule(
            "using an injected sleep (a VirtualClock's clock.sleep, or your own recorder)",
            "check_retry_test: a spy with_retry counts the calls that pass no sleep=",
            wrong="sleeps for real",
        ),
        Rule(
            "fails (raises, for example an AssertionError) when with_retry is wrong.",
            "check_retry_test: a test that never calls the with_retry it is given earns nothing",
            wrong="never calls the with_retry it is given",
        ),
        Rule(
            "it must pass against correct versions of with_retry",
            "check_retry_test: runs it against the reference, a recursive and a while-loop version",
            wrong="checks which function it got",
        ),
        Rule(
            "no jitter | sleeps the whole window",
            "check_retry_test: the 'no jitter' mutant must fail the test (one seventh of the points)",
            wrong="misses no jitter (a vacuous zip)",
        ),
        Rule(
            "constant delay | sleeps rand() * base_delay every time",
            "check_retry_test: the 'constant delay' mutant must fail the test",
            wrong="misses constant delay (only upper bounds)",
        ),
        Rule(
            "no cap | sleeps rand() * base_delay * 2**k, ignoring max_delay",
            "check_retry_test: the 'no cap' mutant must fail the test",
            wrong="misses no cap (max_delay never reached)",
        ),
        Rule(
            "one attempt too few | makes retries attempts in all",
            "check_retry_test: the 'one attempt too few' mutant must fail the test",
            wrong="misses one attempt too few (counts sleeps, not calls)",
        ),
        Rule(
            "retries a non-retryable error | ignores retryable",
            "check_retry_test: the 'retries a non-retryable error' mutant must fail the test",
            wrong="misses retries of a non-retryable error (no 404)",
        ),
        Rule(
            "sleeps after the last attempt | waits once more before giving up",
            "check_retry_test: the 'sleeps after the last attempt' mutant must fail the test",
            wrong="misses a sleep after the last attempt (counts calls only)",
        ),
        Rule(
            "swallows the final error | returns None when the attempts are spent",
            "check_retry_test: the 'swallows the final error' mutant must fail the test",
            wrong="misses a swallowed final error (no pytest.raises)",
        ),
        Rule(
            "Make the dependency, clock and recorders inside the test (it runs many times)",
            "check_retry_test: runs the test again against the correct version after the first run and the mutants",
            wrong="state shared between runs",
        ),
        Rule(
            "a test that calls the course's own course.retry.with_retry",
            "check_retry_test: a test whose code names course.retry.with_retry (or course.retry's with_retry) fails",
            wrong="compares against the course's with_retry",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {
    "is_retryable": ["course.retry:is_retryable"],
    "with_retry": ["course.retry:with_retry"],
    "retry_test": ["course.retry:with_retry"],
}
