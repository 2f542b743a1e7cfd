"""Hidden checks of ``create_link``: idempotency keys and aliases decided by PostgreSQL, gated races."""

from __future__ import annotations

import json

import psycopg

from autograder.checks.ch12.codes import _is_code
from autograder.harness import Report, error_line, task
from autograder.probes import SETTLE_LIMIT, Crowd, tally
from course import shortener
from course.chapters import ch12
from course.idempotency import IdempotencyKeyReused, RequestInProgress, retry_in_progress
from course.kit import lab
from course.retry import with_retry
from course.shortener import (
    decode_code as course_decode,
)  # bound now: in the kernel the references raise while a check runs (autograder/references.py)

# ============================================================================ create_link


async def _links(pool, **where) -> list[tuple]:
    ((column, value),) = where.items()
    async with pool.connection() as conn:
        cur = await conn.execute(f"SELECT code, url, custom FROM links WHERE {column} = %s ORDER BY id", (value,))
        return await cur.fetchall()


def _taken(err) -> bool:
    return isinstance(err, shortener.AliasTaken) or getattr(err, "status", None) == 409


@task("create_link", points=4, title="idempotent create, custom aliases decided by PostgreSQL", timeout=60, seed=1213)
async def check_create_link(r: Report, create_link) -> None:
    async with lab.scratch("ch12") as ns:
        pool = await ns.pool(max_size=16)
        await shortener.setup_schema(pool)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            await ch12.insert_gate(watcher)
            await _check_create_link(r, create_link, pool, watcher)
        finally:
            await watcher.close()


def _retrying(create_link, pool, url, *, key=None, alias=None, sleep, rand):
    """A client that retries RequestInProgress (409) with backoff, as chapter 03's did."""

    async def call():
        return await with_retry(
            lambda: create_link(pool, url, alias=alias, idempotency_key=key),
            retries=6,
            base_delay=0.1,
            max_delay=2.0,
            retryable=lambda err: isinstance(err, RequestInProgress) or retry_in_progress(err),
            sleep=sleep,
            rand=rand,
        )

    return call


async def _check_create_link(r: Report, create_link, pool, watcher) -> None:
    url = "https://example.com/one"
    link = await create_link(pool, url)
    code = link.get("code") if isinstance(link, dict) else None
    r.expect(
        isinstance(link, dict) and _is_code(code) and link.get("url") == url,
        f"create_link(pool, {url!r}) returned {link!r}",
        f"create_link(pool, {url!r}) returned {link!r}; expected a dict with 'code' (7 base62 characters) and 'url'",
    )
    rows = await _links(pool, code=code)
    r.expect(
        rows == [(code, url, False)] or [row[:2] for row in rows] == [(code, url)],
        f"links holds {code!r} -> {url!r}",
        f"links rows for code {code!r}: {rows}; expected one row with that url",
    )
    url = "https://example.com/two"
    first = await create_link(pool, url, idempotency_key="key-two")
    again = await create_link(pool, url, idempotency_key="key-two")
    rows = await _links(pool, url=url)
    r.expect(
        again == first and len(rows) == 1,
        f"the same call with idempotency_key='key-two' twice: the same response {first!r}, one link",
        f"the same call with idempotency_key='key-two' twice returned {first!r} then {again!r} and left "
        f"{len(rows)} link(s) for the url; expected the stored response and one link",
    )
    if r.public:
        return

    # --- the same key for another URL ---------------------------------------------------------------
    try:
        got = await create_link(pool, "https://example.com/other", idempotency_key="key-two")
        outcome, reused = f"returned {got!r}", False
    except Exception as err:  # noqa: BLE001 - any error is reported
        reused = isinstance(err, IdempotencyKeyReused) or getattr(err, "status", None) == 422
        outcome = f"raised {error_line(err, 100)}"
    others = await _links(pool, url="https://example.com/other")
    r.expect(
        reused and not others,
        f"the same key for another URL {outcome}, and made no link",
        f"the same key for another URL {outcome} and made {len(others)} link(s); expected IdempotencyKeyReused "
        "(422) and no link: compare request_hash of the body with the one stored for the key",
    )

    # --- the same key and URL with an alias: the alias is part of the request -----------------------
    try:
        got = await create_link(pool, url, alias="two-alias", idempotency_key="key-two")
        outcome, reused = f"returned {got!r}", False
    except Exception as err:  # noqa: BLE001 - any error is reported
        reused = isinstance(err, IdempotencyKeyReused) or getattr(err, "status", None) == 422
        outcome = f"raised {error_line(err, 100)}"
    aliased = await _links(pool, code="two-alias")
    r.expect(
        reused and not aliased,
        f"the same key and URL with alias='two-alias' {outcome}, and made no link",
        f"the same key and URL, now with alias='two-alias', {outcome} and made {len(aliased)} link(s) with that "
        "alias; expected IdempotencyKeyReused (422) and no link. Likely cause: a request hash over the URL "
        "alone; hash the whole request body, alias included (request_hash({'url': url, 'alias': alias}))",
    )

    # --- ten concurrent calls with one key, over two replicas ---------------------------------------
    url = "https://example.com/race"
    replicas = r.replicas("create_link", 2)
    r.note(
        "10 concurrent calls with one key, 5 in each of two replicas of your cell; every insert into links is "
        "held until all callers wait inside PostgreSQL; RequestInProgress is retried with backoff (virtual clock)"
    )
    await ch12.close_gate(watcher)

    async def release() -> None:
        await ch12.open_gate(watcher)

    crowd = Crowd(10, watcher, on_settled=release)
    try:
        results = await crowd.run(
            lambda i: _retrying(replicas[i % 2], pool, url, key="key-race", sleep=crowd.sleep, rand=r.random.random)()
        )
    finally:
        await ch12.open_gate(watcher)
    if crowd.stalls:
        r.note(
            f"the callers did not all wait inside PostgreSQL within {SETTLE_LIMIT:g} s: something waits in the "
            "process (an asyncio.Lock?), which another replica does not see"
        )
    rows = await _links(pool, url=url)
    answers = [x for x in results if not isinstance(x, BaseException)]
    distinct = {json.dumps(a, sort_keys=True, default=str) for a in answers}
    why = ""
    if len(rows) == 2:
        why = ": one per replica, so the key was kept in one process's memory; claim it in PostgreSQL"
    elif len(rows) > 2:
        why = ": every caller found the key free and created a link; claim the key atomically first"
    r.expect(
        len(rows) == 1,
        "one link for the key",
        f"10 concurrent calls with one key created {len(rows)} links{why}",
    )
    r.expect(
        len(answers) == 10 and len(distinct) == 1,
        "all 10 callers got the same response",
        f"10 concurrent calls with one key ended with {tally(results, ok='a response')} and {len(distinct)} "
        "different responses; expected one stored response for all (a loser of the claim waits for the winner "
        "in PostgreSQL, or raises RequestInProgress and is retried)",
    )

    # --- distinct links at once ----------------------------------------------------------------------
    await ch12.close_gate(watcher)
    crowd = Crowd(12, watcher, on_settled=release)
    try:
        results = await crowd.run(lambda i: create_link(pool, f"https://example.com/bulk/{i}"))
    finally:
        await ch12.open_gate(watcher)
    made = [x for x in results if isinstance(x, dict)]
    codes = {x.get("code") for x in made}
    async with pool.connection() as conn:
        (count,) = await (
            await conn.execute("SELECT count(*) FROM links WHERE url LIKE 'https://example.com/bulk/%'")
        ).fetchone()
    r.expect(
        len(made) == 12 and len(codes) == 12 and count == 12,
        "12 different links created at once: 12 links with 12 different codes",
        f"12 different links created at once: {tally(results, ok='a link')}, {len(codes)} different codes, "
        f"{count} rows. Take ids from the sequence (nextval('link_ids')), never from max(id) + 1 or count(*)",
    )
    await _check_codes_are_ids(r, pool, made)

    # --- custom aliases --------------------------------------------------------------------------------
    link = await create_link(pool, "https://example.com/sale", alias="spring-sale")
    rows = await _links(pool, code="spring-sale")
    r.expect(
        isinstance(link, dict) and link.get("code") == "spring-sale" and len(rows) == 1,
        "alias='spring-sale' makes the link with that code",
        f"create_link(..., alias='spring-sale') returned {link!r}, links rows {rows}; expected code 'spring-sale'",
    )
    try:
        got = await create_link(pool, "https://example.com/someone-else", alias="spring-sale")
        outcome, taken = f"returned {got!r}", False
    except Exception as err:  # noqa: BLE001
        outcome, taken = f"raised {error_line(err, 100)}", _taken(err)
    r.expect(
        taken,
        f"the alias again, for another URL: {outcome}",
        f"the alias again, for another URL, {outcome}; expected AliasTaken (409)",
    )

    # --- a call that fails leaves its key behind it free ------------------------------------------------
    outcomes = []
    for _ in range(2):
        try:
            got = await create_link(pool, "https://example.com/late", alias="spring-sale", idempotency_key="key-late")
            outcomes.append(f"returned {got!r}")
        except Exception as err:  # noqa: BLE001 - any error is reported
            pending = isinstance(err, RequestInProgress)
            outcomes.append("AliasTaken" if _taken(err) and not pending else f"raised {error_line(err, 100)}")
    r.expect(
        outcomes == ["AliasTaken", "AliasTaken"],
        "a taken alias with idempotency_key='key-late', twice: AliasTaken both times (the failed call left its key "
        "free, or stored the refusal)",
        f"a taken alias with idempotency_key='key-late', twice: {outcomes[0]}, then {outcomes[1]}; expected "
        "AliasTaken both times. "
        + (
            "The first call failed but its key stayed claimed (pending), so the same request can never get an "
            "answer. Likely cause: the key claimed in a transaction of its own, committed before the link was "
            "made; claim the key and create the link in one transaction, so a failure rolls the claim back"
            if outcomes[0] == "AliasTaken" and outcomes[1] != "AliasTaken" and not outcomes[1].startswith("returned")
            else "A taken alias must raise AliasTaken, with or without a key"
        ),
    )

    r.note("10 concurrent creates of alias 'launch-day' for 10 different URLs, inserts held until all wait")
    await ch12.close_gate(watcher)
    crowd = Crowd(10, watcher, on_settled=release)
    try:
        results = await crowd.run(
            lambda i: _retrying(
                create_link,
                pool,
                f"https://example.com/launch/{i}",
                alias="launch-day",
                sleep=crowd.sleep,
                rand=r.random.random,
            )()
        )
    finally:
        await ch12.open_gate(watcher)
    wins = [x for x in results if not isinstance(x, BaseException)]
    taken = [x for x in results if isinstance(x, BaseException) and _taken(x)]
    other = [x for x in results if isinstance(x, BaseException) and not _taken(x)]
    rows = await _links(pool, code="launch-day")
    hint = ""
    if other:
        hint = (
            ": a lookup before the insert sees the alias free in every caller, then the unique index refuses "
            "all inserts but one; let the insert decide (ON CONFLICT (code) DO NOTHING RETURNING) and raise "
            "AliasTaken when it inserted nothing"
        )
    elif len(wins) > 1:
        hint = ": only one caller may get the alias; the others must hear AliasTaken, not someone else's link"
    r.expect(
        len(wins) == 1 and len(taken) == 9 and len(rows) == 1,
        "exactly one caller got the alias, 9 got AliasTaken",
        f"10 concurrent creates of one alias: {tally(results, ok='a link')}; links holds {len(rows)} row(s) for "
        f"it. Expected 1 link and 9 x AliasTaken{hint}",
    )


async def _check_codes_are_ids(r: Report, pool, made: list) -> None:
    """Each generated code is encode_code of the link's own id, an id the sequence handed out."""
    decoders = [course_decode]
    own = r.namespace.get("decode_code")
    if callable(own) and own is not course_decode:
        decoders.append(own)
    async with pool.connection() as conn:
        (last,) = await (await conn.execute("SELECT last_value FROM link_ids")).fetchone()
        cur = await conn.execute("SELECT id, code FROM links WHERE code = ANY(%s)", ([x.get("code") for x in made],))
        rows = await cur.fetchall()

    def encodes(link_id: int, code: str) -> bool:
        for decode in decoders:
            try:
                if decode(code) == link_id:
                    return True
            except Exception:  # noqa: BLE001, S112 - a decoder that refuses the code does not match it
                continue
        return False

    beyond = [(i, c) for i, c in rows if i > last]
    other = [(i, c) for i, c in rows if i <= last and not encodes(i, c)]
    r.expect(
        bool(rows) and not beyond and not other,
        "each of those codes is encode_code of its link's own id, taken from the sequence",
        (
            f"{len(beyond)} of those links have an id the sequence never handed out (above its last_value): take "
            "the id from SELECT nextval('link_ids'), not from random or a counter of your own"
            if beyond
            else f"{len(other)} of those links have a code that is not encode_code of the link's own id. Likely "
            "cause: nextval taken for the code, then the row inserted without that id, so the column's DEFAULT "
            "took another; insert the id you encoded"
            if other
            else "the created links were not found in the links table by their codes"
        ),
    )
