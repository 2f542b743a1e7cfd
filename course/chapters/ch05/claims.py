"""What chapter 05's runs claim: for each run in :mod:`course.chapters.ch05`, the keyword
arguments of :func:`course.kit.claims.check` (the notebook cell that ran it calls ``check(**claim)``)."""

from __future__ import annotations


def order_of(marks: dict[str, dict[str, float]], stage: str) -> list[str]:
    """The messages of a run's marks in the order they reached ``stage`` (``ch05.order_of``)."""
    return sorted(marks, key=lambda m: marks[m].get(stage, float("inf")))


KLEPPMANN = "Kleppmann, DDIA (2017), ch. 11"
ALL_M = ["M-1", "M-2", "M-3", "M-4"]


def kill_claims(runs: list) -> list[dict]:
    """What acknowledging before or after the commit does to M-2 when its consumer is killed
    (``runs``: the ``CrashRun`` list of :func:`course.chapters.ch05.kill_runs`)."""
    by = {(run.ack, run.hang_at): run for run in runs}
    out = []
    run = by.get(("last", "before commit"))
    if run is not None:
        out.append(
            dict(
                claim="ack after the commit, killed before it: M-2 stays pending and the takeover applies it, "
                "so every message is applied once",
                measured=f"pending after the kill: {len(run.pending_after_kill)}; "
                f"applied after the takeover: {run.applied_after_takeover}",
                held=bool(run.pending_after_kill)
                and "M-2" not in run.applied_before_kill
                and run.applied_after_takeover == ALL_M,
                source=KLEPPMANN,
                otherwise="the kill is sent while the worker holds M-2 in an open transaction: a miss is a bug",
            )
        )
    run = by.get(("first", "before commit"))
    if run is not None:
        out.append(
            dict(
                claim="ack before the commit, killed before it: nothing is pending after the kill and M-2 is "
                "never applied (lost)",
                measured=f"pending after the kill: {len(run.pending_after_kill)}; "
                f"applied after the takeover: {run.applied_after_takeover}",
                held=not run.pending_after_kill and "M-2" not in run.applied_after_takeover,
                otherwise="the kill is sent after the worker acked M-2 and before its commit: a miss is a bug",
            )
        )
    run = by.get(("last", "after commit"))
    if run is not None:
        out.append(
            dict(
                claim="killed between the commit and the ack: M-2 is applied and still pending, so it is "
                "delivered again, and the dedup record turns the redelivery into a duplicate",
                measured=f"applied when killed: {run.applied_before_kill}; pending: {len(run.pending_after_kill)}; "
                f"the takeover: {dict(run.takeover)}; applied: {run.applied_after_takeover}",
                held="M-2" in run.applied_before_kill
                and bool(run.pending_after_kill)
                and run.takeover.get("duplicate", 0) >= 1
                and run.applied_after_takeover == ALL_M,
                source=KLEPPMANN + ': "effectively once"',
                otherwise="the kill is sent after M-2's commit and before its ack: a miss is a bug",
            )
        )
    return out


def order_claims(events: list[dict], states: dict[str, str]) -> list[dict]:
    """The three orders of the state-machine demo, from the consumer's log events and the orders' states."""
    retries = sum(1 for e in events if e["event"] == "retry" and e["message_id"] == "order-1-2")
    done = {e["message_id"]: e["at"] for e in events if e["event"] in ("applied", "parked", "dead")}
    outcome = {e["message_id"]: e["event"] for e in events if e["event"] in ("applied", "parked", "dead")}
    other = done.get("order-2-1", float("inf"))
    paid = done.get("order-1-2", float("-inf"))
    return [
        dict(
            claim="order-1's payment, refused twice with a 503, is retried and applied, and order-1 ships",
            measured=f"{retries} retries of order-1-2; order-1 is {states.get('order-1')!r}",
            held=retries == 2
            and outcome.get("order-1-2") == "applied"
            and states.get("order-1") == "shipped",
        ),
        dict(
            claim="order-2 does not wait for order-1's retries: its message is applied before order-1's payment",
            measured=f"order-2-1 applied {(paid - other) * 1000:.0f} ms before order-1-2",
            held=other < paid,
            otherwise="the lanes run at once: order-1-2 needs three transactions and two backoffs, order-2-1 one",
        ),
        dict(
            claim="order-3's unreadable payment (schema 9) goes to the dead-letter stream and its shipment is "
            "parked, not applied",
            measured=f"order-3-2 {outcome.get('order-3-2')}, order-3-3 {outcome.get('order-3-3')}; "
            f"order-3 is {states.get('order-3')!r}",
            held=outcome.get("order-3-2") == "dead"
            and outcome.get("order-3-3") == "parked"
            and states.get("order-3") == "created",
        ),
    ]


def five_orders_claim(pool_run: dict, lane_run: dict) -> dict:
    """A worker pool commits A-2 first although A-1 came first; the per-key lane keeps A-1 first."""
    first = {stage: order_of(pool_run, stage)[0] for stage in ("publish", "deliver", "commit")}
    return dict(
        claim="a worker pool receives A-1 first (published and delivered first) and still commits A-2 first; "
        "the per-key lane commits A-1 first",
        measured=f"worker pool first to publish {first['publish']}, deliver {first['deliver']}, commit "
        f"{first['commit']}; per-key lane first to commit {order_of(lane_run, 'commit')[0]}",
        held=first["publish"] == first["deliver"] == "A-1"
        and first["commit"] == "A-2"
        and order_of(lane_run, "commit")[0] == "A-1",
        otherwise="A-1's handler takes 40 ms and A-2's 5 ms: only a stall of over 35 ms in A-2's commit alone "
        "lets A-1 commit first",
    )


def head_of_line_claims(results: list[dict]) -> list[dict]:
    """What one poison message (K0-1) holds up under each ordering scope."""
    out = []
    for res in results:
        scope, status, done = res["scope"], res["status"], res["done"]
        applied_keys = sorted({m.split("-")[0] for m, s in status.items() if s == "applied"})
        counts = res["counts"]
        if scope == "global":
            out.append(
                dict(
                    claim="one global FIFO: nothing after the poison message is applied",
                    measured=f"applied {counts.get('applied', 0)}, parked {counts.get('parked', 0)}, "
                    f"dead {counts.get('dead', 0)}",
                    held=counts.get("applied", 0) == 0 and counts.get("dead", 0) == 1,
                )
            )
        elif scope == "partitions":
            stalled = sorted(k for k, lane in res["lanes"].items() if lane == res["lanes"]["K0"])
            others = sorted(k for k in res["lanes"] if k not in stalled)
            out.append(
                dict(
                    claim="partitions: the keys that share K0's partition stall with it, the others are applied",
                    measured=f"sharing K0's partition: {stalled}; keys with messages applied: {applied_keys}",
                    held=applied_keys == others,
                )
            )
        else:
            others = [k for k in sorted(res["lanes"]) if k != "K0"]
            firsts = [done.get(f"{k}-1", float("inf")) for k in others]
            dead_at = done.get("K0-1", float("-inf"))
            out.append(
                dict(
                    claim="one lane per key: only K0's later messages wait, and every other key's first "
                    "message is applied while K0-1 is still retrying",
                    measured=f"keys with messages applied: {applied_keys}; the others' first messages applied by "
                    f"{max(firsts) * 1000:.0f} ms, K0-1 dead-lettered at {dead_at * 1000:.0f} ms",
                    held=applied_keys == others and max(firsts) < dead_at,
                    otherwise="K0-1 takes four attempts with backoff before its dead letter; the others' first "
                    "messages one transaction each",
                )
            )
    return out
