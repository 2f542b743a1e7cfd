"""Retries with capped exponential backoff and full jitter (chapter 01).

``with_retry`` is the reference answer to chapter 01's graded task and the retry that
later chapters reuse (chapter 03 retries a request that got 409 "in progress").
``is_retryable`` says which errors are worth another try for an idempotent call, and
:func:`outcome_unknown` which of those may have run already (so a call that is not
idempotent must not repeat them). :data:`RETRY_TABLE` is the course's one retry table:
every chapter that retries follows it, and chapter 01 prints it.

``Retry-After`` (RFC 9110, section 10.2.3): :func:`parse_retry_after` reads a header value
(delay-seconds or an HTTP-date), :func:`retry_after` reads it from a response, an error or
a header and caps it at the time the caller has left.

Beyond the graded task: :func:`retry_call` adds the limits a production retry needs
(attempts, total time, longest wait, any :mod:`course.backoff` strategy), honours
``Retry-After`` and keeps the metadata to log (:class:`RetryState`). Retry budgets and
deadlines are in :mod:`course.budgets`, hedged reads in :mod:`course.hedging`, delay
strategies in :mod:`course.backoff`; what chapter 01 measures with them is in
:mod:`course.chapters.ch01`.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import TypeVar

import httpx

from course.backoff import Backoff, FullJitter

T = TypeVar("T")

#: 4xx statuses that say "not now" rather than "never": the server did not process the request.
RETRYABLE_STATUS = frozenset({408, 429})
#: 5xx statuses that say "never": the server will not do this, however often you ask.
PERMANENT_STATUS = frozenset({501, 505})
#: Failures in the connect phase: the request never reached the server.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, ConnectionRefusedError)
#: httpx transport errors that are bugs in the caller (a bad URL scheme, a malformed request).
CALLER_BUGS = (httpx.UnsupportedProtocol, httpx.LocalProtocolError)


def status_of(err: BaseException) -> int | None:
    """The HTTP status an error carries, if any (httpx errors or a ``status`` attribute)."""
    if isinstance(err, httpx.HTTPStatusError):
        return err.response.status_code
    status = getattr(err, "status", None)
    if isinstance(status, int) and not isinstance(status, bool):
        return status
    return None


def is_retryable(err: BaseException) -> bool:
    """Worth another try for an idempotent call: timeouts, connection errors, 408, 429 and 5xx.

    Not: other 4xx, 501 and 505 (the server will never do it), a caller bug that httpx
    reports as a transport error (``UnsupportedProtocol``, ``LocalProtocolError``),
    ``httpx.PoolTimeout`` (your own pool is full: another wait only queues again), and
    anything else (bugs in our own code).
    """
    if isinstance(err, httpx.PoolTimeout) or isinstance(err, CALLER_BUGS):
        return False
    if isinstance(err, (TimeoutError, asyncio.TimeoutError, httpx.TimeoutException)):
        return True
    if isinstance(err, (httpx.TransportError, ConnectionError)):
        return True
    status = status_of(err)
    if status is not None:
        return status in RETRYABLE_STATUS or (500 <= status <= 599 and status not in PERMANENT_STATUS)
    return False


def outcome_unknown(err: BaseException) -> bool:
    """May the server have acted on the request before this error? Then only an idempotent
    call may be repeated. Only connect-phase failures (it never reached the server) and
    408 / 429 (the server refused it before doing anything) are known not to have run."""
    if isinstance(err, NOT_SENT) or isinstance(err, httpx.PoolTimeout) or isinstance(err, CALLER_BUGS):
        return False
    if status_of(err) in RETRYABLE_STATUS:
        return False
    return is_retryable(err)


def safe_to_retry(err: BaseException, *, idempotent: bool) -> bool:
    """``is_retryable``, and for a call that is not idempotent only what is known not to have run."""
    return is_retryable(err) and (idempotent or not outcome_unknown(err))


@dataclass(frozen=True)
class RetryRow:
    """One row of :data:`RETRY_TABLE`: a kind of failure and what a retry may do about it."""

    failure: str
    ran: str  # did the request run on the server?
    idempotent: str  # retry an idempotent call?
    not_idempotent: str  # retry a call that is not idempotent?
    examples: tuple[Callable[[], BaseException], ...] = ()


def _status(code: int) -> Callable[[], BaseException]:
    def make() -> BaseException:
        request = httpx.Request("POST", "http://payments.local/charge")
        return httpx.HTTPStatusError(
            f"{code}", request=request, response=httpx.Response(code, request=request)
        )

    return make


#: The course's one retry table. ``is_retryable`` answers the "idempotent" column (409 "in
#: progress" aside: :func:`course.idempotency.retry_in_progress` adds it), ``safe_to_retry``
#: both. Chapter 01 prints it; ``tests/test_01_patterns.py`` holds the code to it.
RETRY_TABLE = (
    RetryRow(
        "connect phase: `httpx.ConnectError`, `httpx.ConnectTimeout`, connection refused",
        "no: it never reached the server",
        "yes",
        "yes",
        (
            lambda: httpx.ConnectError("refused"),
            lambda: httpx.ConnectTimeout("connect"),
            ConnectionRefusedError,
        ),
    ),
    RetryRow(
        "408 Request Timeout, 429 Too Many Requests",
        "no: the server refused it before doing anything",
        "yes (429: after `Retry-After`)",
        "yes",
        (_status(408), _status(429)),
    ),
    RetryRow(
        "timeout after sending: `httpx.ReadTimeout`, `httpx.WriteTimeout`, `TimeoutError`",
        "**unknown**: the request or only its answer may be lost",
        "yes",
        "**no** (an idempotency key first, chapter 03)",
        (lambda: httpx.ReadTimeout("read"), lambda: httpx.WriteTimeout("write"), TimeoutError),
    ),
    RetryRow(
        "connection reset, server disconnected: `httpx.ReadError`, `httpx.RemoteProtocolError`, "
        "`ConnectionResetError`, `BrokenPipeError`",
        "**unknown**",
        "yes",
        "**no**",
        (
            lambda: httpx.ReadError("reset"),
            lambda: httpx.RemoteProtocolError("Server disconnected without sending a response."),
            ConnectionResetError,
            BrokenPipeError,
        ),
    ),
    RetryRow(
        "500, 502, 503, 504 (and the other 5xx but two)",
        "**unknown** (502/504: a gateway passed it on; a proxy answers 503 when its upstream dropped)",
        "yes (503: after `Retry-After`)",
        "**no**",
        (_status(500), _status(502), _status(503), _status(504)),
    ),
    RetryRow(
        "409 *request in progress* (the first request with this Idempotency-Key still runs, chapter 03)",
        "it is running now",
        "yes, same key, with backoff (`course.idempotency.retry_in_progress`)",
        "yes: that is what the key is for",
    ),
    RetryRow(
        "409 Conflict (a version or state conflict)",
        "refused",
        "**never** the same request: re-read, then decide",
        "never",
        (_status(409),),
    ),
    RetryRow(
        "other 4xx: 400, 401, 403, 404, 422",
        "refused: the request itself is wrong",
        "never",
        "never",
        (_status(400), _status(401), _status(403), _status(404), _status(422)),
    ),
    RetryRow(
        "501 Not Implemented, 505 HTTP Version Not Supported",
        "refused, for good",
        "never",
        "never",
        (_status(501), _status(505)),
    ),
    RetryRow(
        "`httpx.PoolTimeout`",
        "no: it never left your process",
        "no: your own pool is full; waiting again only queues again",
        "no",
        (lambda: httpx.PoolTimeout("no free connection"),),
    ),
    RetryRow(
        "caller bugs: `httpx.UnsupportedProtocol`, `httpx.LocalProtocolError`, `ValueError`, `KeyError`",
        "no",
        "never: a bug fails the same way every time",
        "never",
        (
            lambda: httpx.UnsupportedProtocol("Request URL is missing an 'http://' or 'https://' protocol."),
            lambda: httpx.LocalProtocolError("Illegal header value"),
            lambda: ValueError("bad input"),
            lambda: KeyError("id"),
        ),
    ),
)


def retry_table() -> str:
    """:data:`RETRY_TABLE` as a Markdown table (``IPython.display.Markdown(retry_table())``)."""
    lines = [
        "| failure | did it run on the server? | retry an idempotent call? | retry a call that is not idempotent? |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r.failure} | {r.ran} | {r.idempotent} | {r.not_idempotent} |" for r in RETRY_TABLE]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- Retry-After


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (RFC 9110, section 10.2.3).

    ``"120"`` (delay-seconds) is 120.0. An HTTP-date (``"Wed, 21 Oct 2015 07:28:00 GMT"``) is
    the time from ``now`` (epoch seconds; the local wall clock by default) to that date,
    never negative. None when the value is absent or unreadable.
    """
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(int(value))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_after(source: object, *, now: float | None = None, cap: float | None = None) -> float | None:
    """How long the server asked us to wait before the next try, in seconds, or None.

    ``source`` is an ``httpx.Response``, an error carrying one (``httpx.HTTPStatusError``),
    an error with a ``retry_after`` in seconds (chapter 02's ``CircuitOpenError``), a headers
    mapping or a raw header value. An HTTP-date is read against the response's own ``Date``
    header when there is one, so the two hosts' clocks need not agree. The answer never
    exceeds ``cap``: pass the time your caller has left, and compare (a server that asks
    for longer than that will not be ready in time; give up now instead of waiting).
    """
    seconds: float | None = None
    response = getattr(source, "response", None) if not isinstance(source, httpx.Response) else source
    if isinstance(source, BaseException) and response is None:
        hinted = getattr(source, "retry_after", None)
        if isinstance(hinted, (int, float)) and not isinstance(hinted, bool) and math.isfinite(hinted):
            seconds = max(0.0, float(hinted))
    elif isinstance(source, str) or source is None:
        seconds = parse_retry_after(source, now=now)
    else:
        headers = response.headers if isinstance(response, httpx.Response) else source
        if isinstance(headers, (Mapping, httpx.Headers)):
            value = headers.get("retry-after") or headers.get("Retry-After")
            date = headers.get("date") or headers.get("Date")
            reference = now
            if reference is None and date:
                try:
                    reference = parsedate_to_datetime(date).timestamp()
                except (TypeError, ValueError, IndexError):
                    reference = None
            seconds = parse_retry_after(value, now=reference)
    if seconds is not None and cap is not None:
        seconds = min(seconds, max(0.0, cap))
    return seconds


def jitter_retry_after(
    seconds: float, spread: float = 0.2, rand: Callable[[], float] = random.random
) -> float:
    """How long a client waits out a ``Retry-After`` of ``seconds``: that long, plus a random
    share of it up to ``spread``. Every caller turned away in one burst got the same value;
    without the spread they would all come back in the same instant."""
    return seconds * (1 + spread * rand())


async def with_retry(
    fn: Callable[[], Awaitable[T]],
    *,
    retries: int = 4,
    base_delay: float = 0.1,
    max_delay: float = 2.0,
    retryable: Callable[[BaseException], bool] = is_retryable,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rand: Callable[[], float] = random.random,
) -> T:
    """Await ``fn()`` up to ``retries + 1`` times, sleeping a full-jitter backoff between tries.

    After failed attempt ``k`` (from 0) it sleeps ``rand() * min(max_delay, base_delay * 2**k)``.
    The last error is re-raised unchanged when it is not retryable or the tries are spent.
    """
    for attempt in range(retries + 1):
        try:
            return await fn()
        except Exception as err:
            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2**attempt))
    raise AssertionError("unreachable")  # the loop returns or raises


# ----------------------------------------------------------------------------- limits and metadata


@dataclass
class RetryState:
    """What a retry loop knows about one operation: the metadata worth logging and storing.

    Chapter 05 keeps the same fields on a message that waits in a retry queue.
    """

    attempt: int = 0  # failed attempts so far
    first_failure_at: float | None = None
    last_failure_at: float | None = None
    next_retry_at: float | None = None
    last_error: BaseException | None = None
    delays: list[float] = field(default_factory=list)
    gave_up: str | None = None  # why the loop stopped retrying, if it did

    def as_row(self) -> dict:
        return {
            "attempt": self.attempt,
            "first_failure_at": self.first_failure_at,
            "last_failure_at": self.last_failure_at,
            "next_retry_at": self.next_retry_at,
            "last_error": f"{type(self.last_error).__name__}: {self.last_error}" if self.last_error else None,
        }


@dataclass(frozen=True)
class RetryPolicy:
    """Three limits, because one is never enough: attempts, total time and the longest wait.

    ``max_elapsed`` counts from the first call; a retry whose wait would end past it is not
    started (the caller hears the error now rather than after a pointless wait).

    ``retry_after_spread``: when the error carries ``Retry-After``, wait that long plus a
    random share of it up to this fraction (every caller the server turned away got the same
    value; without the spread they would all come back in the same instant). ``None``
    ignores ``Retry-After``.
    """

    max_attempts: int = 5
    max_elapsed: float | None = 10.0
    backoff: Backoff = field(default_factory=lambda: FullJitter(0.1, 2.0))
    retryable: Callable[[BaseException], bool] = is_retryable
    retry_after_spread: float | None = 0.2


async def retry_call(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy = RetryPolicy(),
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    rand: Callable[[], float] = random.random,
    on_retry: Callable[[RetryState], None] | None = None,
    state: RetryState | None = None,
) -> T:
    """``with_retry`` grown up: any :mod:`course.backoff` strategy, a total-time limit,
    ``Retry-After`` and metadata. ``on_retry(state)`` is called before each wait (log it,
    export a metric); ``state`` (if given) is filled in place, so the caller can read it
    after a failure."""
    state = state if state is not None else RetryState()
    started = clock()
    previous: float | None = None
    while True:
        try:
            return await fn()
        except Exception as err:
            now = clock()
            state.attempt += 1
            state.first_failure_at = now if state.first_failure_at is None else state.first_failure_at
            state.last_failure_at = now
            state.last_error = err
            state.next_retry_at = None
            if not policy.retryable(err):
                state.gave_up = "not retryable"
                raise
            if state.attempt >= policy.max_attempts:
                state.gave_up = f"{policy.max_attempts} attempts spent"
                raise
            delay = policy.backoff.delay(state.attempt - 1, previous, rand)
            asked = retry_after(err) if policy.retry_after_spread is not None else None
            if asked is not None:  # the server knows when it can take us again: not before that
                delay = max(delay, jitter_retry_after(asked, policy.retry_after_spread, rand))
            if policy.max_elapsed is not None and now + delay - started > policy.max_elapsed:
                at = (
                    f"next try at {now + delay - started:.2f} s would pass the {policy.max_elapsed:g} s limit"
                )
                state.gave_up = at if asked is None else f"Retry-After asks for {asked:g} s; {at}"
                raise
            previous = delay
            state.delays.append(delay)
            state.next_retry_at = now + delay
            if on_retry is not None:
                on_retry(state)
            await sleep(delay)
