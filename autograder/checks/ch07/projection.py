"""Hidden checks of ``account_projection``: an idempotent, rebuildable balance projection."""

from __future__ import annotations

from autograder.harness import Report, error_line, task
from autograder.probes import tally
from course import eventstore as es
from course import projections
from course.chapters.ch07 import rig
from course.kit import lab

# ============================================================================= account_projection


def _expected(events: list[dict]) -> dict[str, tuple]:
    """The balances read model after ``events``, by folding them (the check's own answer)."""
    states: dict[str, tuple] = {}
    for e in events:
        event = projections.as_event(e)
        state = states.get(event.stream_id)
        folded = es.account_evolve(
            None if state is None else {"owner": state[0], "balance_cents": state[1], "events": 0}, event
        )
        states[event.stream_id] = (folded["owner"], folded["balance_cents"], event.version)
    return states


async def _checkpoint(pool) -> int | None:
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT position FROM projection_checkpoints WHERE name = 'account_balances'")
        row = await cur.fetchone()
    return row[0] if row else None


def _diff(got: dict, want: dict) -> str:
    lines = []
    for account in sorted(set(got) | set(want)):
        if got.get(account) != want.get(account):
            g, w = got.get(account), want.get(account)
            lines.append(
                f"{account}: {g[1] if g else 'no row'} (v{g[2] if g else '-'}) instead of {w[1] if w else 'no row'} (v{w[2] if w else '-'})"
            )
    return "; ".join(lines[:3])


async def _events_for_projection(pool, rng) -> list[dict]:
    for i in range(1, 5):
        await es.append(pool, f"acc-{i}", 0, [("AccountOpened", {"owner": f"owner-{i}"})])
    balances = {f"acc-{i}": 0 for i in range(1, 5)}
    for _ in range(32):
        account = f"acc-{rng.randint(1, 4)}"
        if balances[account] >= 500 and rng.random() < 0.35:
            kind, amount = "Withdrawn", rng.randint(1, balances[account] // 100) * 100
            balances[account] -= amount
        else:
            kind, amount = "Deposited", rng.randint(1, 20) * 100
            balances[account] += amount
        _, version = await es.load(pool, account, es.account_evolve, snapshots=False)
        await es.append(pool, account, version, [(kind, {"amount_cents": amount})])
    return [e.as_dict() for e in await es.read_all(pool, 0, 1000)]


@task(
    "account_projection",
    points=4,
    title="an idempotent, rebuildable balance projection",
    needs=("apply_events", "rebuild_balances"),
    timeout=60,
    seed=702,
)
async def check_account_projection(r: Report, apply_events, rebuild_balances) -> None:
    async with lab.scratch("ch07") as ns:
        pool = await ns.pool(max_size=12)
        await rig.install(pool)
        async with pool.connection() as conn:  # a TRUNCATE of the read model counts as its first write too
            await conn.execute(
                "CREATE TRIGGER ch07_rig_truncate BEFORE TRUNCATE ON account_balances "
                "FOR EACH STATEMENT EXECUTE FUNCTION ch07_rig()"
            )
        events = await _events_for_projection(pool, r.random)
        await _check_projection(r, apply_events, rebuild_balances, pool, ns, events)


async def _deliver(r: Report, apply_events, pool, batch: list[dict], what: str, attempts: int = 3):
    """At-least-once: deliver ``batch`` until ``apply_events`` returns; (returned, log)."""
    log = []
    for _ in range(attempts):
        try:
            got = await apply_events(pool, batch)
        except Exception as err:  # noqa: BLE001 - a failed delivery is redelivered, as a broker would
            log.append(error_line(err, 90))
            continue
        return got, log
    r.fail(f"{what}: apply_events kept failing on redelivery: {log}")
    return None, log


async def _check_projection(r: Report, apply_events, rebuild_balances, pool, ns, events: list[dict]) -> None:
    first = events[:5]
    got = await apply_events(pool, first)
    rows = await projections.read_balances(pool)
    want = _expected(first)
    r.expect(
        rows == want,
        f"events 1-5 applied: account_balances = {rows}",
        f"after events 1-5 account_balances holds {rows}, expected {want}",
    )
    r.expect(
        got == 5,
        "apply_events returned 5 (events applied)",
        f"apply_events returned {got!r} for 5 new events, expected 5",
    )
    checkpoint = await _checkpoint(pool)
    r.expect(
        checkpoint == first[-1]["position"],
        f"the checkpoint is at position {checkpoint}",
        f"projection_checkpoints('account_balances') is at {checkpoint!r} after events 1-5, expected "
        f"{first[-1]['position']} (the position of the last event applied)",
    )
    try:
        again = await apply_events(pool, first)
    except Exception as err:  # noqa: BLE001 - reported with its likely cause
        r.fail(
            f"the same 5 events delivered again: apply_events raised {error_line(err, 120)}. Likely cause: it "
            "applied them again (an AccountOpened inserted twice); skip events at or before the checkpoint"
        )
    rows = await projections.read_balances(pool)
    r.expect(
        rows == want and again == 0,
        "the same 5 events delivered again: nothing changed, returned 0",
        f"the same 5 events delivered again: returned {again!r}, account_balances {_diff(rows, want) or 'unchanged'}; "
        "expected 0 and no change (skip events at or before the checkpoint)",
    )
    if r.public:
        return

    # --- an overlapping batch ------------------------------------------------------------------
    got = await apply_events(pool, events[3:12])
    rows, want = await projections.read_balances(pool), _expected(events[:12])
    r.expect(
        rows == want and got == 7,
        "events 4-12 (2 old, 7 new): the 7 new ones applied once",
        f"events 4-12 delivered (4 and 5 for the second time): returned {got!r}, {_diff(rows, want) or 'rows right'}; "
        "expected 7 applied and each event once",
    )

    # --- crashes between apply and checkpoint, and before it -------------------------------------
    for table, nth, upto, words in (
        ("projection_checkpoints", 1, 18, "at the checkpoint write (after the balance writes)"),
        ("account_balances", 2, 24, "at the second balance write (before the checkpoint)"),
    ):
        batch = events[upto - 6 : upto]
        await rig.arm_crash(pool, table, nth)
        try:
            first_try = await apply_events(pool, batch)
            raised = None
        except Exception as err:  # noqa: BLE001
            first_try, raised = None, err
        fired = await rig.disarm(pool, table)
        r.expect(
            fired,
            f"events {upto - 5}-{upto}: a crash injected {words}",
            f"the check armed a crash at {table} but apply_events never wrote {table}: "
            + (
                "keep the checkpoint in projection_checkpoints (name 'account_balances')"
                if table == "projection_checkpoints"
                else "write the balances to account_balances"
            ),
        )
        if raised is None:
            rows, want = await projections.read_balances(pool), _expected(events[:upto])
            r.fail(
                f"the crash {words} was swallowed: apply_events returned {first_try!r}, so the broker would not "
                f"redeliver, and account_balances is {'right' if rows == want else 'wrong: ' + _diff(rows, want)}. "
                "Let the error reach the caller"
            )
        got, log = await _deliver(r, apply_events, pool, batch, f"after the crash {words}")
        rows, want = await projections.read_balances(pool), _expected(events[:upto])
        if rows == want:
            r.ok(f"redelivered after the crash: each event applied once ({error_line(raised, 70)}, then {got})")
            continue
        if table == "projection_checkpoints":
            reason = (
                "The balances were committed without the checkpoint, so the redelivery applied them again: "
                "write the rows and the checkpoint in one transaction"
            )
        else:
            reason = (
                "The checkpoint was committed without the balances (or the other way round), so the redelivery "
                "skipped or repeated them: write both in one transaction, so a crash leaves neither"
            )
        r.fail(f"after a crash {words}, then a redelivery: {_diff(rows, want)}. {reason}")

    # --- two replicas, one batch -------------------------------------------------------------------
    a, b = r.replicas("apply_events", 2)
    batch = events[24:30]
    r.note(
        "events 25-30 delivered to two replicas of apply_events at once (each reads the checkpoint before "
        "either writes a balance: the check holds the writes in PostgreSQL)"
    )
    results, log = await rig.race(
        ns.database_url, ["account_balances"], [lambda: a(pool, batch), lambda: b(pool, batch)]
    )
    applied = sum(x for x in results if isinstance(x, int) and not isinstance(x, bool))
    failed = [x for x in results if isinstance(x, BaseException)]
    # how the replicas split the batch is up to the database (one may apply 6, or 5 and 1 event at a
    # time): the note gives the total, so the same code reads the same feedback on every run
    r.note(log.line() + f"; {applied} event(s) applied in total" + (f", {tally(failed)}" if failed else ""))
    for i, outcome in enumerate(results):
        if isinstance(outcome, BaseException):
            await _deliver(r, (a, b)[i], pool, batch, "a redelivery to the replica that failed")
    rows, want = await projections.read_balances(pool), _expected(events[:30])
    r.expect(
        rows == want,
        "two replicas with one batch: each event applied once",
        f"two replicas handed the same batch at once: {_diff(rows, want)}; both read the old checkpoint and both "
        "applied the batch. Lock the checkpoint row (SELECT ... FOR UPDATE) in the transaction before deciding "
        "which events are new; state kept in one process is not shared"
        + (" (some replica waited outside PostgreSQL)" if log.stalled else ""),
    )

    # --- the rest, then a rebuild -------------------------------------------------------------------
    for start in range(30, len(events), 4):
        await _deliver(r, apply_events, pool, events[start : start + 4], f"events {start + 1}-{start + 4}")
    incremental = await projections.read_balances(pool)
    want = _expected(events)
    r.expect(
        incremental == want,
        f"all {len(events)} events applied: {len(want)} accounts match the fold of their streams",
        f"after all {len(events)} events: {_diff(incremental, want)}",
    )
    # A table scanned without ORDER BY returns rows in the order they sit on disk, which is position
    # order only by luck: rewrite every AccountOpened in place (a no-op UPDATE stores a new row version
    # after the others), so a replay that does not ask for position order meets the deposits first.
    async with pool.connection() as conn:
        await conn.execute("UPDATE es_events SET data = data WHERE type = 'AccountOpened'")
    # --- a rebuild that dies at its emptying, or at its reset, leaves rows that match the checkpoint ------
    for table, words in (
        ("projection_checkpoints", "at its first write to projection_checkpoints (the reset to 0)"),
        ("account_balances", "at its first write to account_balances (the emptying)"),
    ):
        await rig.arm_crash(pool, table, 1)
        try:
            returned, raised = await rebuild_balances(pool), None
        except Exception as err:  # noqa: BLE001 - the injected crash, expected to reach the caller
            returned, raised = None, err
        fired = await rig.disarm(pool, table)
        rows, checkpoint = await projections.read_balances(pool), await _checkpoint(pool)
        finished = returned == len(events) and rows == incremental and checkpoint == events[-1]["position"]
        if fired and raised is None and not finished:
            r.fail(
                f"rebuild_balances() crashed {words} (an injected crash, as if the process died there) and "
                f"returned {returned!r} without raising, though it did not replay the {len(events)} events "
                f"(account_balances holds {len(rows)} account(s), the checkpoint is at {checkpoint}): the crash "
                "was swallowed, so the caller believes the read model was rebuilt. Let the error reach the caller "
                "(or retry the whole rebuild until it finishes)"
            )
        upto = _expected([e for e in events if e["position"] <= (checkpoint or 0)])
        if fired and rows != upto:
            r.fail(
                f"rebuild_balances() crashed {words} (an injected crash, as if the process died there): "
                f"account_balances then holds {len(rows)} account(s) and the checkpoint is at {checkpoint}, "
                f"which do not match ({_diff(rows, upto)}), so the next delivery skips or repeats events. "
                "Likely cause: emptying account_balances and resetting the checkpoint are two transactions "
                "(two autocommit statements); do both in one transaction"
            )
        r.ok(f"rebuild_balances() crashed {words}: the rows still match the checkpoint ({checkpoint})")
        rest = [e for e in events if e["position"] > (checkpoint or 0)]
        if rest:
            await _deliver(r, apply_events, pool, rest, "the events after the checkpoint, delivered again")

    rebuilt = await rebuild_balances(pool)
    rows = await projections.read_balances(pool)
    checkpoint = await _checkpoint(pool)
    r.expect(
        rows == incremental,
        "rebuild_balances() from zero gave the same rows",
        f"rebuild_balances() left account_balances with {_diff(rows, incremental)} (compared with the incremental run). "
        + (
            "Nothing was replayed: reset the checkpoint to 0 together with emptying account_balances"
            if not rows
            else "Empty account_balances and reset the checkpoint in one transaction, then replay every event "
            "in position order (ORDER BY position: the check stored some events on disk after later ones, so a "
            "scan without ORDER BY returns them out of order)"
        ),
    )
    r.expect(
        rebuilt == len(events) and checkpoint == events[-1]["position"],
        f"it returned {rebuilt} and left the checkpoint at {checkpoint}",
        f"rebuild_balances() returned {rebuilt!r} and left the checkpoint at {checkpoint!r}; expected "
        f"{len(events)} (events replayed) and {events[-1]['position']}",
    )
    _, version = await es.load(pool, "acc-1", es.account_evolve, snapshots=False)
    await es.append(pool, "acc-1", version, [("Deposited", {"amount_cents": 4200})])
    more = [e.as_dict() for e in await es.read_all(pool, events[-1]["position"])]
    await _deliver(r, apply_events, pool, more, "an event after the rebuild")
    rows, want = await projections.read_balances(pool), _expected(events + more)
    r.expect(
        rows == want,
        "and a new event after the rebuild applied on top",
        f"a new event after the rebuild: {_diff(rows, want)}",
    )
