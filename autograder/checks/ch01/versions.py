"""The versions of ``with_retry`` that chapter 01's ``retry_test`` check runs a learner's test against.

:data:`CORRECT` are right (the reference and two rewrites of it): the test must pass them.
:data:`MUTANTS` are each wrong in one way a retry loop often is: the test must fail them.
"""

from __future__ import annotations

import asyncio
import random

from course.retry import is_retryable as reference_is_retryable
from course.retry import with_retry as reference_with_retry


async def _correct_recursive(
    fn,
    *,
    retries=4,
    base_delay=0.1,
    max_delay=2.0,
    retryable=reference_is_retryable,
    sleep=asyncio.sleep,
    rand=random.random,
    _k=0,
):
    try:
        return await fn()
    except Exception as err:
        if _k >= retries or not retryable(err):
            raise
        await sleep(rand() * min(max_delay, base_delay * 2**_k))
    return await _correct_recursive(
        fn,
        retries=retries,
        base_delay=base_delay,
        max_delay=max_delay,
        retryable=retryable,
        sleep=sleep,
        rand=rand,
        _k=_k + 1,
    )


async def _correct_while(
    fn,
    *,
    retries=4,
    base_delay=0.1,
    max_delay=2.0,
    retryable=reference_is_retryable,
    sleep=asyncio.sleep,
    rand=random.random,
):
    attempt = 0
    while True:
        try:
            return await fn()
        except Exception as err:
            if attempt >= retries or not retryable(err):
                raise
            delay = min(max_delay, base_delay * (2**attempt))
            await sleep(delay * rand())
            attempt += 1


async def _no_jitter(
    fn,
    *,
    retries=4,
    base_delay=0.1,
    max_delay=2.0,
    retryable=reference_is_retryable,
    sleep=asyncio.sleep,
    rand=random.random,
):
    for attempt in range(retries + 1):
        try:
            return await fn()
        except Exception as err:
            if attempt == retries or not retryable(err):
                raise
            await sleep(min(max_delay, base_delay * 2**attempt))


async def _constant_delay(
    fn,
    *,
    retries=4,
    base_delay=0.1,
    max_delay=2.0,
    retryable=reference_is_retryable,
    sleep=asyncio.sleep,
    rand=random.random,
):
    for attempt in range(retries + 1):
        try:
            return await fn()
        except Exception as err:
            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay))


async def _no_cap(
    fn,
    *,
    retries=4,
    base_delay=0.1,
    max_delay=2.0,
    retryable=reference_is_retryable,
    sleep=asyncio.sleep,
    rand=random.random,
):
    for attempt in range(retries + 1):
        try:
            return await fn()
        except Exception as err:
            if attempt == retries or not retryable(err):
                raise
            await sleep(rand() * base_delay * 2**attempt)


async def _one_attempt_too_few(
    fn,
    *,
    retries=4,
    base_delay=0.1,
    max_delay=2.0,
    retryable=reference_is_retryable,
    sleep=asyncio.sleep,
    rand=random.random,
):
    if retries <= 0:
        return await fn()
    for attempt in range(retries):
        try:
            return await fn()
        except Exception as err:
            if attempt == retries - 1 or not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2**attempt))


async def _retries_everything(
    fn,
    *,
    retries=4,
    base_delay=0.1,
    max_delay=2.0,
    retryable=reference_is_retryable,
    sleep=asyncio.sleep,
    rand=random.random,
):
    for attempt in range(retries + 1):
        try:
            return await fn()
        except Exception:
            if attempt == retries:
                raise
            await sleep(rand() * min(max_delay, base_delay * 2**attempt))


async def _sleeps_after_last(
    fn,
    *,
    retries=4,
    base_delay=0.1,
    max_delay=2.0,
    retryable=reference_is_retryable,
    sleep=asyncio.sleep,
    rand=random.random,
):
    for attempt in range(retries + 1):
        try:
            return await fn()
        except Exception as err:
            if not retryable(err):
                raise
            await sleep(rand() * min(max_delay, base_delay * 2**attempt))
            if attempt == retries:
                raise


async def _swallows_final_error(
    fn,
    *,
    retries=4,
    base_delay=0.1,
    max_delay=2.0,
    retryable=reference_is_retryable,
    sleep=asyncio.sleep,
    rand=random.random,
):
    for attempt in range(retries + 1):
        try:
            return await fn()
        except Exception as err:
            if not retryable(err):
                raise
            if attempt == retries:
                return None
            await sleep(rand() * min(max_delay, base_delay * 2**attempt))


#: the correct versions a learner's test must pass (the reference and two rewrites of it)
CORRECT = {
    "course.retry.with_retry": reference_with_retry,
    "a recursive version": _correct_recursive,
    "a while-loop version": _correct_while,
}

#: the wrong versions a learner's test must fail, with what is wrong in each
MUTANTS = {
    "no jitter": (_no_jitter, "sleeps the whole window min(max_delay, base_delay * 2**k), never calls rand()"),
    "constant delay": (_constant_delay, "sleeps rand() * base_delay every time: the window never grows"),
    "no cap": (_no_cap, "sleeps rand() * base_delay * 2**k: max_delay is ignored"),
    "one attempt too few": (_one_attempt_too_few, "makes retries attempts in all instead of retries + 1"),
    "retries a non-retryable error": (_retries_everything, "ignores retryable: a 404 is retried like a 503"),
    "sleeps after the last attempt": (_sleeps_after_last, "waits once more before giving up"),
    "swallows the final error": (_swallows_final_error, "returns None when the attempts are spent instead of raising"),
}
