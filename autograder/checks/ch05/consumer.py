"""Hidden checks of ``ordered_consumer``: the scenarios, each a weighted share of the points (WEIGHTS)."""

from __future__ import annotations

import math
import time

import psycopg

from autograder.checks.ch05.rig import (
    CLOCK_START,
    GROUP,
    IDLE_LIMIT,
    SCENARIOS,
    Clock,
    Draws,
    Sleeps,
    World,
    applied,
    blocked,
    expect_ack_after_commit,
    expect_all_acked,
    expect_clean_run,
    expect_no_overlap,
    expect_order,
    malformed,
    parked,
    pending,
    per_key,
    policy_of,
    run_consumer,
    scenario,
    serialization_failure,
    start_replica,
    stop_replica,
    timeout_error,
    unavailable,
)
from autograder.harness import Report, Stop, task
from autograder.probes import fmt
from course import messaging as mq
from course.chapters import ch05
from course.kit import lab


@task(
    "ordered_consumer",
    points=10,
    title="per-key ordered consumer: retries, dead letters, parking, takeover",
    timeout=90,
    partial=True,
    seed=505,
)
async def check_ordered_consumer(r: Report, ordered_consumer) -> None:
    async with lab.scratch("ch05") as ns:
        pool = await ns.pool(max_size=4)
        await ch05.setup_schema(pool)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        admin = ns.redis()
        try:
            chosen = SCENARIOS[:1] if r.public else SCENARIOS
            top = sum(weight(fn) for _, fn in chosen)
            passed, earned = 0, 0.0
            for title, fn in chosen:
                r.note(title if r.public else f"{title} [{100 * weight(fn) / top:g}% of the points]")
                before = r.failures
                if getattr(r, "hung", False):
                    r.fail("skipped: the consumer did not return in an earlier scenario", stop=False)
                    continue
                try:
                    await fn(r, ordered_consumer, ns, watcher, admin)
                except Stop:
                    pass
                if r.failures == before:
                    passed += 1
                    earned += weight(fn)
            r.fraction = earned / top
            if not r.public:
                r.note(f"{passed} of {len(chosen)} scenarios passed ({100 * earned / top:g}% of the points)")
        finally:
            await watcher.close()


#: Each scenario's share of the points. Other keys never waiting for one key's retry is the point of the
#: chapter, so the scenario that checks it weighs most: a consumer that handles one key at a time for the
#: whole stream keeps 60% at most. Scenarios not named here (the four kills) weigh DEFAULT_WEIGHT each.
WEIGHTS = {"_basic": 1.0, "_retries": 4.0, "_dead_letters": 2.0}
DEFAULT_WEIGHT = 0.75


def weight(fn) -> float:
    return WEIGHTS.get(fn.__name__, DEFAULT_WEIGHT)


async def _setup_world(ns, admin, name: str, watcher) -> World:
    """A fresh stream and group; the tables emptied (message ids repeat from one scenario to the next)."""
    await watcher.execute("TRUNCATE mq_processed, mq_parked, mq_blocked_keys, ch05_applied")
    world = World(ns, name)
    await admin.delete(world.stream, world.dlq)
    await admin.xgroup_create(world.stream, GROUP, id="0", mkstream=True)
    return world


@scenario("1. healthy messages of 3 keys, two of them delivered twice: each applied once, in its key's order")
async def _basic(r: Report, consumer, ns, watcher, admin) -> None:
    world = await _setup_world(ns, admin, "basic", watcher)
    specs = [("A", 1), ("B", 1), ("A", 2), ("C", 1), ("B", 2), ("A", 3), ("C", 2), ("B", 2), ("A", 1), ("C", 3)]
    await world.publish(admin, specs)
    clock = Clock()
    rep = await start_replica(ns, world, "c1", watcher, overlap_probe=True)
    try:
        run = await run_consumer(
            consumer, rep, policy=policy_of(4, 0.1, 1.0), sleeps=Sleeps(clock), draws=Draws(r.random), clock=clock
        )
        expect_clean_run(r, run, rep, "10 entries")
        if run.killed:
            r.fail(f"10 healthy entries: the consumer died with {rep.killed_at or 'a ConsumerKilled'}")
        expect_no_overlap(r, [rep], "10 entries")
        rows = await applied(watcher, world)
        expect_order(
            r, world, rows, {"A": ["A-1", "A-2", "A-3"], "B": ["B-1", "B-2"], "C": ["C-1", "C-2", "C-3"]}, "10 entries"
        )
        r.ok("10 entries (A-1 and B-2 twice): 8 messages applied once each, every key in stream order")
        await expect_all_acked(r, admin, world, "10 entries")
        expect_ack_after_commit(r, [rep], world, "10 entries")
        r.ok("every entry acknowledged, each after its commit; nothing pending")
        dead = await admin.xrange(world.dlq)
        r.expect(
            not dead, "nothing dead-lettered", f"healthy messages were dead-lettered: {[f.get('id') for _, f in dead]}"
        )
    finally:
        await stop_replica(rep)


@scenario(
    "2. R-1 fails 3 times (timeout, 503, serialization failure), then succeeds: full-jitter backoff, "
    "R-2 and R-3 wait, keys S and T go on"
)
async def _retries(r: Report, consumer, ns, watcher, admin) -> None:
    world = await _setup_world(ns, admin, "retries", watcher)
    world.plan["R-1"] = [timeout_error, unavailable, serialization_failure, "ok"]
    await world.publish(admin, [("R", 1), ("S", 1), ("R", 2), ("T", 1), ("S", 2), ("R", 3), ("T", 2)])
    healthy = {"S-1", "S-2", "T-1", "T-2"}
    base, cap = 0.1, 0.3
    clock = Clock()
    sleeps = Sleeps(clock, held=True)
    draws = Draws(r.random)
    rep = await start_replica(ns, world, "c1", watcher)
    seen: dict = {}
    last = {"progress": None, "since": time.monotonic()}

    async def until() -> bool:
        rows = await applied(watcher, world)
        done = {m for _, m in rows}
        progress = (rep.commands, len(rows), len(sleeps.delays))
        if progress != last["progress"]:
            last["progress"], last["since"] = progress, time.monotonic()
        if sleeps.waiting and healthy <= done:
            seen.update(rows=rows, why="done")
            return True
        if time.monotonic() - last["since"] > IDLE_LIMIT:
            seen.update(rows=rows, why="stuck")
            return True
        return False

    try:
        run = await run_consumer(
            consumer, rep, policy=policy_of(5, base, cap), sleeps=sleeps, draws=draws, clock=clock, until=until
        )
        expect_clean_run(r, run, rep, "R-1 failing 3 times")
        rows = await applied(watcher, world)
        expect_order(
            r,
            world,
            rows,
            {"R": ["R-1", "R-2", "R-3"], "S": ["S-1", "S-2"], "T": ["T-1", "T-2"]},
            "R-1 failing 3 times",
        )
        tries = world.attempts["R-1"]
        r.expect(
            tries == 4,
            "R-1 was attempted 4 times: 3 transient failures, then success",
            f"R-1 was attempted {tries} time(s); it fails with TimeoutError, a 503 and a SerializationFailure (all "
            "transient: policy.retryable says so), then succeeds: expected 4 attempts",
        )
        if seen.get("why") == "stuck":
            done = {m for _, m in seen["rows"]}
            r.fail(
                f"while R-1 waited in its first backoff, {len(healthy & done)} of the 4 messages of keys S and T were "
                f"applied and the consumer made no progress for {IDLE_LIMIT:g} s: head-of-line blocking. Give every key its own lane "
                "(a task) so one key's retry never holds another key's messages, even those read in a later batch"
            )
        if seen:
            early = [m for _, m in seen["rows"] if m in ("R-2", "R-3")]
            r.expect(
                not early,
                "while R-1 waited in its backoff: S-1, S-2, T-1, T-2 applied; R-2 and R-3 not yet",
                f"{', '.join(early)} applied while R-1 was still waiting for its retry: the key's later messages "
                "overtook it (a separate retry queue, or moving on, reorders a key)",
            )
        else:
            r.fail(
                "the consumer finished without ever waiting in the injected sleep: retry R-1 after "
                "await sleep(rand() * min(cap, base * 2**k))"
            )
        expect_jitter(r, sleeps.delays, draws.values, base, cap)
        await expect_all_acked(r, admin, world, "R-1 failing 3 times")
        expect_ack_after_commit(r, [rep], world, "R-1 failing 3 times")
        r.ok("every entry acknowledged after its commit")
    finally:
        await stop_replica(rep)


def _close(a, b) -> bool:
    return len(a) == len(b) and all(
        isinstance(x, (int, float)) and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
        for x, y in zip(a, b, strict=False)
    )


def expect_jitter(r: Report, got: list, draws: list[float], base: float, cap: float) -> None:
    n = 3
    windows = [min(cap, base * 2**k) for k in range(n)]
    if len(got) != n:
        r.fail(
            f"R-1 failed 3 times: the consumer slept {len(got)} time(s) {fmt(got)}, expected 3 backoff sleeps "
            f"(rand() * {fmt(windows)}). Use the injected sleep for the backoff waits only"
        )
    if len(draws) < n:
        if _close(got, windows):
            r.fail(
                f"backoff sleeps {fmt(got)}: no jitter, every delay is the whole window min(cap, base * 2**k). "
                "Multiply it by rand() (full jitter), or many consumers retry in lockstep"
            )
        r.fail(
            f"backoff sleeps {fmt(got)} drew rand() only {len(draws)} time(s): the delays must be rand() * {fmt(windows)}"
        )
    expected = [draws[k] * windows[k] for k in range(n)]
    if _close(got, expected):
        r.ok(f"backoff sleeps {fmt(got)} = rand() * {fmt(windows)} (capped exponential, full jitter)")
        return
    guesses = {
        "no jitter: each delay is the whole window min(cap, base * 2**k); multiply it by rand()": windows,
        "no cap: rand() * base * 2**k grows past the cap; take min(cap, base * 2**k) first": [
            draws[k] * base * 2**k for k in range(n)
        ],
        "constant window: rand() * base every time; the window must double after each failure": [
            draws[k] * base for k in range(n)
        ],
        "off by one: the wait after the first failure (k = 0) uses the window base * 2**0 = base": [
            draws[k] * min(cap, base * 2 ** (k + 1)) for k in range(n)
        ],
    }
    for text, guess in guesses.items():
        if _close(got, guess):
            r.fail(f"backoff sleeps {fmt(got)}: {text}")
    r.fail(f"backoff sleeps {fmt(got)}, expected {fmt(expected)} = rand() * {fmt(windows)} with the injected rand")


@scenario(
    "3. P-1 is malformed (permanent), X-1 times out on every attempt, G is healthy: two dead letters with their "
    "metadata, P and X blocked, their later messages parked, G applied"
)
async def _dead_letters(r: Report, consumer, ns, watcher, admin) -> None:
    world = await _setup_world(ns, admin, "dlq", watcher)
    attempts = 4
    world.then["P-1"] = malformed
    world.plan["X-1"] = [timeout_error] * attempts + ["stop"] * 1
    world.then["X-1"] = "stop"
    await world.publish(
        admin, [("P", 1), ("G", 1), ("X", 1), ("P", 2), ("G", 2), ("X", 2), ("P", 3), ("G", 3), ("P", 2)]
    )
    clock = Clock()
    sleeps = Sleeps(clock)
    rep = await start_replica(ns, world, "c1", watcher)
    try:
        run = await run_consumer(
            consumer, rep, policy=policy_of(attempts, 0.05, 1.0), sleeps=sleeps, draws=Draws(r.random), clock=clock
        )
        if run.stopped or world.attempts["X-1"] > attempts:
            r.fail(
                f"X-1 fails with TimeoutError on every attempt; the check stopped the consumer after "
                f"{world.attempts['X-1']} attempts. With policy.max_attempts = {attempts} it must go to the "
                f"dead-letter stream after attempt {attempts}: unbounded retries let one message consume a worker forever"
            )
        expect_clean_run(r, run, rep, "poison messages")
        r.expect(
            world.attempts["P-1"] == 1,
            "P-1 (MalformedMessage, permanent) was attempted once",
            f"P-1 raised MalformedMessage, a permanent error, and was attempted {world.attempts['P-1']} times: "
            "a retry cannot fix malformed data. Send it to the dead-letter stream at once (policy.retryable(err) is False)",
        )
        r.expect(
            world.attempts["X-1"] == attempts,
            f"X-1 (TimeoutError every time) was attempted {attempts} times, then dead-lettered",
            f"X-1 was attempted {world.attempts['X-1']} time(s), expected exactly policy.max_attempts = {attempts}",
        )
        rows = await applied(watcher, world)
        got = per_key(rows)
        # named in id order: the order they were applied in depends on the consumers' timing
        late = sorted(got.get("P", []) + got.get("X", []), key=lambda m: (m[0], int(m.split("-")[1])))
        if late:
            r.fail(
                f"{', '.join(late)} applied after the first message of its key was dead-lettered: the key's state "
                "skipped an event. Block the key (mq_blocked_keys) and park its later messages (mq_parked)"
            )
        if got.get("G", []) != ["G-1", "G-2", "G-3"]:
            r.fail(
                f"key G applied {got.get('G', [])}, expected ['G-1', 'G-2', 'G-3']: a dead letter must block its "
                "own key only, not the whole stream"
            )
        r.ok("G-1, G-2, G-3 applied in order; nothing of P or X applied")
        await _expect_dead_letters(r, world, admin, watcher, sleeps, attempts)
        park = await parked(watcher, world)
        want = ["P-2", "X-2", "P-3"]
        have = {world.by_entry.get(e, e) for e in park}
        missing = [m for m in want if m not in have]
        if missing:
            r.fail(
                f"{', '.join(missing)} not in mq_parked (parked: {sorted(have) or 'nothing'}). Later messages of a "
                "blocked key must be parked (INSERT INTO mq_parked), then acknowledged: not applied, not lost"
            )
        bad = [
            world.by_entry.get(e, e)
            for e, row in park.items()
            if e in world.by_entry
            and (row["fields"] != dict(world.entries)[e] or row["key"] != dict(world.entries)[e]["key"])
        ]
        r.expect(
            not bad,
            "P-2, P-3 and X-2 parked in mq_parked with their key and fields",
            f"mq_parked rows for {bad} do not hold the entry's key and its fields as read from the stream",
        )
        cur = await watcher.execute(
            "SELECT message_id FROM mq_processed WHERE stream = %s AND message_id = ANY(%s) ORDER BY message_id",
            (world.stream, want),
        )
        recorded = [row[0] for row in await cur.fetchall()]
        r.expect(
            not recorded,
            "the parked messages are not in mq_processed (parking does nothing else)",
            f"{', '.join(recorded)} parked and also recorded in mq_processed: a replay would take them for "
            "duplicates and never apply them. A blocked key's entry is parked and nothing else (no mq_processed "
            "row, no handle)",
        )
        await expect_all_acked(r, admin, world, "poison messages")
        expect_ack_after_commit(r, [rep], world, "poison messages")
        r.ok("every entry acknowledged after its commit (parked and dead-lettered ones too)")
    finally:
        await stop_replica(rep)


async def _expect_dead_letters(r: Report, world: World, admin, watcher, sleeps: Sleeps, attempts: int) -> None:
    dead = await admin.xrange(world.dlq)
    ids = [f.get("id") for _, f in dead]
    if sorted(ids) != ["P-1", "X-1"]:
        r.fail(f"the dead-letter stream {world.dlq!r} holds {ids}, expected one entry each for P-1 and X-1")
    blocks = await blocked(watcher, world)
    for dlq_id, entry in dead:
        mid = entry["id"]
        fields = world.fields_of(mid)
        source = world.entry_of(mid)
        missing = [k for k in (*mq.FIELDS, *mq.DLQ_FIELDS) if k not in entry]
        if missing:
            r.fail(
                f"the dead letter of {mid} lacks {missing}: an operator needs the original fields and the failure's "
                f"metadata to fix and replay it (got {sorted(entry)})"
            )
        changed = [k for k in mq.FIELDS if entry[k] != fields[k]]
        if changed:
            r.fail(f"the dead letter of {mid} changed the original fields {changed}: copy them as read from the stream")
        perm = mid == "P-1"
        err_text = "body is not valid JSON" if perm else "the payment service timed out"
        problems = []
        if entry["source_stream"] != world.stream:
            problems.append(f"source_stream {entry['source_stream']!r}, expected {world.stream!r}")
        if entry["source_entry_id"] != source:
            problems.append(f"source_entry_id {entry['source_entry_id']!r}, expected {source!r}")
        want_attempts = 1 if perm else attempts
        if entry["attempts"] != str(want_attempts):
            problems.append(f"attempts {entry['attempts']!r}, expected '{want_attempts}'")
        if err_text not in entry["error"]:
            problems.append(f"error {entry['error']!r} does not hold the last error's text ({err_text!r})")
        want_type = "MalformedMessage" if perm else "TimeoutError"
        if entry["error_type"] != want_type:
            problems.append(f"error_type {entry['error_type']!r}, expected {want_type!r}")
        want_reason = "permanent" if perm else "exhausted"
        if entry["reason"] != want_reason:
            problems.append(f"reason {entry['reason']!r}, expected {want_reason!r}")
        try:
            first, last = float(entry["first_failed_at"]), float(entry["last_failed_at"])
        except ValueError:
            problems.append(
                f"first_failed_at {entry['first_failed_at']!r} / last_failed_at {entry['last_failed_at']!r} are not "
                "numbers: store str(clock()) at the first and the last failure"
            )
        else:
            if not (CLOCK_START <= first <= last <= CLOCK_START + 3600):
                problems.append(
                    f"first_failed_at {first!r} and last_failed_at {last!r} are not times of the injected clock "
                    f"(which started at {CLOCK_START:.0f}): read the time with clock()"
                )
            elif not perm:
                waited = sum(d for d in sleeps.delays if isinstance(d, (int, float)))
                if not math.isclose(last - first, waited, abs_tol=1e-6):
                    problems.append(
                        f"last_failed_at - first_failed_at = {last - first:.6g} s, but the backoff between X-1's "
                        f"failures took {waited:.6g} s: first is the time of the first failure, last of the last one"
                    )
            elif first != last:
                problems.append(f"P-1 failed once, yet first_failed_at {first!r} != last_failed_at {last!r}")
        if problems:
            r.fail(f"the dead letter of {mid}: " + "; ".join(problems))
        block = blocks.get(fields["key"])
        if block is None:
            r.fail(
                f"{mid} was dead-lettered but its key {fields['key']} has no row in mq_blocked_keys: block the key "
                "so its later messages are parked"
            )
        wrong = []
        if block["entry_id"] != source:
            wrong.append(f"entry_id {block['entry_id']!r} (expected {source!r})")
        if block["message_id"] != mid:
            wrong.append(f"message_id {block['message_id']!r}")
        if block["dlq_id"] != dlq_id:
            wrong.append(f"dlq_id {block['dlq_id']!r} (the dead letter is {dlq_id!r})")
        if block["fields"] != fields:
            wrong.append("fields (expected the entry's fields as read)")
        if wrong:
            r.fail(f"mq_blocked_keys row of key {fields['key']}: wrong " + ", ".join(wrong))
    r.ok(
        "dead letters of P-1 (permanent, 1 attempt) and X-1 (exhausted, 4 attempts): original fields, source, "
        "attempts, first/last failure times, error text and type, reason; both keys blocked with the dead letter's id"
    )


KILLS = {
    "before change": "inside the handler of {k}-2, before its change",
    "after change": "inside the handler of {k}-2, after its change, before the commit",
    "before ack": "after {k}-2 committed, at the consumer's next Redis command (before its XACK)",
    "after ack": "right after the XACK of {k}-2",
}
#: Each crash scenario has keys of its own, so message ids never repeat between scenarios.
CRASH_KEYS = {
    "before change": ("K", "L"),
    "after change": ("M", "N"),
    "before ack": ("U", "V"),
    "after ack": ("W", "Y"),
}


def _crash_scenario(where: str, number: int):
    k = CRASH_KEYS[where][0]

    @scenario(
        f"{number}. a consumer is killed {KILLS[where].format(k=k)}; another replica takes over "
        f"({k}-5 arrives meanwhile)"
    )
    async def crash(r: Report, consumer, ns, watcher, admin) -> None:
        await _crash(r, ns, watcher, admin, where)

    crash.__name__ = f"_crash_{where.replace(' ', '_')}"
    return crash


async def _crash(r: Report, ns, watcher, admin, where: str) -> None:
    first, second = r.replicas("ordered_consumer", 2)
    k, other = CRASH_KEYS[where]
    k2 = f"{k}-2"
    where_text = KILLS[where].format(k=k)
    world = await _setup_world(ns, admin, "crash-" + where.replace(" ", "-"), watcher)
    if where == "before change":
        world.plan[k2] = ["kill before change"]
    elif where == "after change":
        world.plan[k2] = ["kill after change"]
    await world.publish(admin, [(k, 1), (other, 1), (k, 2), (other, 2), (k, 3), (k, 4), (other, 3)])
    clock = Clock()
    # the overlap probe: a consumer that runs one key's entries at once is named for it, every run, instead of
    # failing on whichever of them happened to commit first
    a = await start_replica(ns, world, "replica-a", watcher, overlap_probe=True)
    if where == "before ack":
        a.kill_next_command_of = k2
    elif where == "after ack":
        a.kill_after_ack = world.entry_of(k2)
    what = f"killed {where_text}"
    try:
        run = await run_consumer(
            first, a, policy=policy_of(4, 0.1, 1.0), sleeps=Sleeps(clock), draws=Draws(r.random), clock=clock
        )
        expect_clean_run(r, run, a, f"replica a ({what})")
        expect_no_overlap(r, [a], what)
    finally:
        await stop_replica(a)
    if not a.dead:
        r.fail(
            f"the check armed a kill {where_text}, but replica a never got there: "
            + (
                f"does it call handle(conn, fields) for {k2}?"
                if "change" in where
                else "does it acknowledge with redis.xack(stream, group, entry_id) after the commit?"
            )
        )
    # the dead consumer's entries look long idle; a new message of K arrives meanwhile
    left = await pending(admin, world)
    for p in left:
        await admin.xclaim(world.stream, GROUP, p["consumer"], 0, [p["message_id"]], idle=3_600_000, justid=True)
    await world.publish(admin, [(k, 5), (other, 4)])
    b = await start_replica(ns, world, "replica-b", watcher)
    try:
        run = await run_consumer(
            second, b, policy=policy_of(4, 0.1, 1.0), sleeps=Sleeps(clock), draws=Draws(r.random), clock=clock
        )
        expect_clean_run(r, run, b, "replica b, taking over")
        if run.killed:
            r.fail(f"replica b died too: {b.killed_at or 'ConsumerKilled'} (catch nothing you did not raise)")
    finally:
        await stop_replica(b)
    rows = await applied(watcher, world)
    got = per_key(rows)
    if k2 not in got.get(k, []):
        cur = await watcher.execute("SELECT 1 FROM mq_processed WHERE message_id = %s", (k2,))
        recorded = await cur.fetchone() is not None
        still = [p for p in await pending(admin, world) if world.by_entry.get(p["message_id"]) == k2]
        if still:
            why = (
                f"its entry is still pending for {still[0]['consumer']}: replica b must first take over entries a dead "
                "consumer left pending (XAUTOCLAIM with claim_idle_ms; the check made them look idle for an hour)"
            )
        elif recorded:
            why = (
                "mq_processed says it was processed, but its change was never committed: the id was recorded in a "
                "commit of its own. Record it in the same transaction as the change"
            )
        elif any(e == world.entry_of(k2) for e, _ in a.acks):
            why = "replica a acknowledged it before its change was committed, so nobody redelivered it"
        else:
            why = "it was acknowledged without being applied"
        r.fail(f"killed {where_text}: {k2} was lost (never applied): {why}")
    expect_order(
        r,
        world,
        rows,
        {k: [f"{k}-{i}" for i in range(1, 6)], other: [f"{other}-{i}" for i in range(1, 5)]},
        what,
        takeover=True,
    )
    r.ok(f"{what}: after the takeover {k}-1..{k}-5 and {other}-1..{other}-4 applied once each, in order")
    await expect_all_acked(r, admin, world, what)
    expect_ack_after_commit(r, [a, b], world, what)
    r.ok("nothing left pending, every XACK after its commit")


for _i, _where in enumerate(KILLS, start=4):
    _crash_scenario(_where, _i)
