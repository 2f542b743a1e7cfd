"""Hidden checks of ``record_score``: idempotent score events with the tie rule."""

from __future__ import annotations

import psycopg

from autograder.checks.ch13.rig import (
    BOARD,
    SETTLE_LIMIT,
    BoardGate,
    _board,
    _event,
    _events,
    _show,
    _totals,
    close_events_gate,
    close_score_gate,
    install_score_gate,
    open_events_gate,
    open_score_gate,
)
from autograder.harness import Report, task
from autograder.probes import Crowd, hooked_redis, tally
from course import leaderboard as lb
from course.kit import lab


@task("record_score", points=4, title="idempotent score events with the tie rule", timeout=60, seed=1313)
async def check_record_score(r: Report, record_score) -> None:
    async with lab.scratch("ch13") as ns:
        pool = await ns.pool(max_size=14)
        await lb.setup_schema(pool)
        plain = ns.redis()
        learner = hooked_redis(ns.redis_url, lambda commands, send: send())
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        try:
            await _check_record_score(r, record_score, ns, pool, plain, learner, watcher)
        finally:
            await watcher.close()
            await learner.aclose()


async def _check_record_score(r: Report, record_score, ns, pool, plain, learner, watcher) -> None:
    # --- one event, then the same event again ----------------------------------------------
    first = _event("e-ada-1", "ada", 30, 100)
    got = await record_score(pool, learner, first)
    r.expect(
        got is True, f"record_score(pool, r, {first}) returned {got!r}" + ("" if got is True else ", expected True")
    )
    totals, board = await _totals(pool), await _board(plain)
    r.expect(
        totals.get("ada") == (30, 100),
        "leaderboard_scores has ada with 30 points reached at 100",
        f"leaderboard_scores has {totals.get('ada')!r} for ada, expected (points, reached_at) = (30, 100)",
    )
    want = lb.encode(30, 100)
    if board.get("ada") == 30:
        r.fail(
            f"the board holds ada's raw points (30); expected encode(30, 100) = {want}. With raw points Redis orders "
            "equal scores by member name, not by who got there first"
        )
    r.expect(
        board.get("ada") == want,
        f"the board '{BOARD}' has ada at encode(30, 100) = {want}",
        f"the board '{BOARD}' has ada at {_show(board.get('ada'))}, expected encode(30, 100) = {want}",
    )
    again = await record_score(pool, learner, first)
    totals, board, n_events = await _totals(pool), await _board(plain), await _events(pool)
    r.expect(
        again is False and totals.get("ada") == (30, 100) and board.get("ada") == want and n_events == 1,
        "the same event again returned False and changed nothing",
        f"the same event delivered again returned {again!r} and left ada at {totals.get('ada')} in PostgreSQL, "
        f"{_show(board.get('ada'))} on the board, {n_events} row(s) in leaderboard_events; expected False, "
        "(30, 100), the same board score, 1 row: "
        + (
            "nothing changed, so only the return value is wrong: return False for a duplicate"
            if totals.get("ada") == (30, 100) and board.get("ada") == want and n_events == 1
            else "an event id is applied once"
        ),
    )
    zoe = _event("e-zoe-1", "zoe", 30, 200)
    await record_score(pool, learner, zoe)
    order = [m for m, _ in await plain.zrevrange(BOARD, 0, 1, withscores=True)]
    r.expect(
        order == ["ada", "zoe"],
        "zoe reached 30 at 200, after ada (at 100): the board ranks ada first",
        f"zoe reached 30 at 200, after ada (at 100), but the board ranks {order}; the earlier achiever goes first",
    )
    if r.public:
        return

    a, b = r.replicas("record_score", 2)
    r.note("two replicas of record_score (your answer cell run twice, as two processes of a service) share the work")

    # --- one event delivered six times at once, through both replicas ------------------------
    # every INSERT into leaderboard_events waits in PostgreSQL until all six deliveries are parked (or
    # can get no further), so a look-up before the insert finds the event absent on every run
    dup = _event("e-bo-1", "bo", 20, 300)
    await close_events_gate(watcher)
    crowd = Crowd(6, watcher, on_settled=lambda: open_events_gate(watcher))
    try:
        results = await crowd.run(lambda i: ((a, b)[i % 2])(pool, learner, dup))
    finally:
        await open_events_gate(watcher)
    r.note(
        "one event delivered 6 times at once, 3 through each replica; the check held every INSERT into "
        "leaderboard_events until all six were parked"
        + (f" ({6 - crowd.blocked_at_release} could not get that far: queued in-process?)" if crowd.stalls else "")
    )
    applied = sum(1 for x in results if x is True)
    errors = [x for x in results if isinstance(x, BaseException)]
    totals, board = await _totals(pool), await _board(plain)
    async with pool.connection() as conn:
        rows = (
            await (await conn.execute("SELECT count(*) FROM leaderboard_events WHERE event_id = 'e-bo-1'")).fetchone()
        )[0]
    ok = applied == 1 and not errors and totals.get("bo") == (20, 300) and board.get("bo") == lb.encode(20, 300)
    if not ok and applied >= 2 and crowd.stalls:
        r.fail(
            f"one event delivered 6 times at once through two replicas was applied {applied} times: in each replica "
            "the deliveries queued on something in-process (a lock?), so each replica let one through, and both "
            "found the event new. A lock in one process does not reach another; claim the event id in PostgreSQL "
            "(INSERT ... ON CONFLICT DO NOTHING RETURNING) in the transaction that adds the points"
        )
    if not ok and applied > 2 and rows == 1:
        r.fail(
            f"one event delivered 6 times at once through two replicas was applied {applied} times: every delivery "
            "looked the event id up before any had inserted it (check, then insert), so all found it new. Claim it "
            "with INSERT ... ON CONFLICT DO NOTHING RETURNING and apply the points only when a row came back"
        )
    if not ok and applied == 2 and totals.get("bo") == (40, 300):
        r.fail(
            "one event delivered 6 times at once through two replicas was applied twice (bo has 40 points, expected 20): "
            "one per replica. State kept in one process is not shared; claim the event id in PostgreSQL "
            "(INSERT ... ON CONFLICT DO NOTHING RETURNING) in the transaction that adds the points"
        )
    r.expect(
        ok,
        "one event delivered 6 times at once through two replicas: applied once (one True), bo has 20 points, "
        "one leaderboard_events row",
        f"one event delivered 6 times at once through two replicas: returned {tally(results)}; bo has "
        f"{totals.get('bo')} in PostgreSQL and {_show(board.get('bo'))} on the board, {rows} event row(s); expected "
        f"one True, (20, 300), {lb.encode(20, 300)}, 1 row"
        + (
            ". The board counted the redeliveries: a ZINCRBY that runs on every delivery is not idempotent"
            if board.get("bo", 0) > lb.encode(20, 300) and totals.get("bo") == (20, 300)
            else ""
        ),
    )

    # --- events of one player out of time order ----------------------------------------------
    await record_score(pool, learner, _event("e-cy-1", "cy", 10, 500))
    await record_score(pool, learner, _event("e-cy-2", "cy", 5, 400))  # delivered late
    await record_score(pool, learner, _event("e-dee-1", "dee", 15, 450))
    totals = await _totals(pool)
    order = [m for m, _ in await plain.zrevrange(BOARD, 0, -1, withscores=True) if m in ("cy", "dee")]
    r.expect(
        totals.get("cy") == (15, 500) and order == ["dee", "cy"],
        "cy got +10 at 500 then a late +5 at 400: reached 15 at 500 (the latest event), so dee (15 at 450) ranks above",
        f"cy got +10 at 500 then a late +5 at 400, and has {totals.get('cy')} with the board ranking {order}; "
        "expected (15, 500) and dee (15 at 450) above cy: a total is reached at the latest of its events "
        "(GREATEST(reached_at, at)), whatever order they arrive in",
    )
    cy_board = (await _board(plain)).get("cy")
    if totals.get("cy") == (15, 500):
        r.expect(
            cy_board == lb.encode(15, 500),
            f"cy's second event moved cy on the board to its new total: {lb.encode(15, 500)} (= encode(15, 500))",
            f"cy's second event (one after the other, nothing concurrent) left cy on the board at {_show(cy_board)}, "
            f"expected {lb.encode(15, 500)} (= encode(15, 500), the total PostgreSQL holds): the board did not take "
            "a player's new, higher total. ZADD ... NX (or XX) adds only new (or only existing) members; GT is the "
            "flag that lets a higher score replace a lower one",
        )

    # --- concurrent events of one player: writes that race to the board ---------------------
    points = [7, 11, 13, 17, 19]
    events = [_event(f"e-ivy-{k}", "ivy", p, 600 + k) for k, p in enumerate(points)]
    # every write to leaderboard_scores is held in PostgreSQL until all five callers have read (issue 35:
    # ivy's FIRST events race every run, not only when the scheduler happens to interleave them)
    await install_score_gate(watcher)
    await close_score_gate(watcher)
    gate = BoardGate(len(events), watcher, opens=lambda: open_score_gate(watcher))
    learner_gated = hooked_redis(ns.redis_url, gate.hook)
    try:
        results = await gate.run(lambda i: ((a, b)[i % 2])(pool, learner_gated, events[i]))
    finally:
        await open_score_gate(watcher)
        await learner_gated.aclose()
    want_total = (sum(points), 600 + len(points) - 1)
    totals, board = await _totals(pool), await _board(plain)
    errors = [x for x in results if isinstance(x, BaseException)]
    r.note(
        f"{len(events)} events of ivy at once (+{', +'.join(map(str, points))}); the check held each board write "
        f"until the others were parked and sent the newest first ({gate.released} writes released)"
        + (f"; the callers did not park within {SETTLE_LIMIT:g} s {gate.stalls} time(s)" if gate.stalls else "")
    )
    r.expect(not errors, f"all {len(events)} calls returned", f"calls raised: {tally(errors)}")
    r.expect(
        totals.get("ivy") == want_total,
        f"PostgreSQL has ivy at {want_total}",
        (
            f"PostgreSQL has ivy at {'fewer' if (totals.get('ivy') or (0, 0))[0] < want_total[0] else 'other'} points "
            f"than the five events add up to (expected {want_total}; which total survived depends on how the held "
            "writes were scheduled): concurrent events of one player lost an update. Likely causes: the total read "
            "(SELECT), added to in Python and written back, so each write overwrote the others; add in one statement "
            "(points = points + EXCLUDED.points), or read with SELECT ... FOR UPDATE, in the transaction that claims "
            "the event"
        ),
    )
    want = lb.encode(*want_total)
    got = board.get("ivy")
    if got is not None and got > want:
        r.fail(
            f"the board has ivy above encode{want_total}, the total PostgreSQL holds: more than the events add up "
            "to (the exact excess depends on how the writes interleaved). "
            "Increments (ZINCRBY) computed from the same starting point were each added; write the total "
            "PostgreSQL returns (ZADD ... GT) instead"
        )
    r.expect(
        got == want,
        f"the board has ivy at {want} (= encode{want_total})",
        f"the board has ivy {'missing' if got is None else 'below'} encode{want_total}, the total PostgreSQL holds "
        "(which older total won depends on how the writes interleaved): a board write computed before "
        "another event landed arrived after it and moved ivy back. Write with ZADD ... GT (scores only grow), or "
        "write the board while you hold the player's row lock",
    )

    # --- Redis loses everything ---------------------------------------------------------------
    await plain.flushdb()
    again = await b(pool, learner, first)
    totals = await _totals(pool)
    r.expect(
        again is False and totals.get("ada") == (30, 100),
        "after Redis lost everything (FLUSHDB), a redelivered old event returned False and ada kept 30 points",
        f"after Redis lost everything (FLUSHDB), the old event e-ada-1 delivered again returned {again!r} and ada "
        f"has {totals.get('ada')} in PostgreSQL, expected False and (30, 100): the dedup record must live where the "
        "points live (PostgreSQL), not in Redis",
    )
    await a(pool, learner, _event("e-ada-2", "ada", 15, 700))
    totals, board = await _totals(pool), await _board(plain)
    want = lb.encode(45, 700)
    r.expect(
        totals.get("ada") == (45, 700) and board.get("ada") == want,
        f"then a new event for ada (+15 at 700) put her full total on the empty board: {want}",
        f"then a new event for ada (+15 at 700): PostgreSQL has {totals.get('ada')}, the board "
        f"{_show(board.get('ada'))}; expected (45, 700) and {want}. Write the total PostgreSQL returns (ZADD), not "
        "an increment (ZINCRBY), so the board heals itself",
    )


# ============================================================================ top_and_rank
