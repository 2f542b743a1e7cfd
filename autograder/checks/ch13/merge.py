"""Hidden checks of ``merge_top``: the global top N from the shards' local top N."""

from __future__ import annotations

import inspect

from autograder.harness import Report, task
from autograder.probes import call_seeing_args
from course import leaderboard as lb


def _shards(rng, n: int) -> list[list[tuple[str, float]]]:
    k = rng.randint(1, 5)
    shards: list[list[tuple[str, float]]] = []
    used = set()
    for s in range(k):
        size = rng.choice([0, 1, n // 2, n, n, n])
        entries = []
        for _ in range(size):
            name = f"{'abcde'[s]}{rng.randint(0, 999):03d}"
            if name in used:
                continue
            used.add(name)
            points = rng.randint(20, 26)  # few distinct points: ties across shards are common
            at = rng.choice([5, 6, 7, rng.randint(0, 100)])  # some exact ties of the whole score
            entries.append((name, float(lb.encode(points, at))))
        entries.sort(key=lambda e: (e[1], e[0]), reverse=True)
        shards.append(entries)
    return shards


def _reference_merge(shards, n):
    every = [e for s in shards for e in s]
    return sorted(every, key=lambda e: (e[1], e[0]), reverse=True)[:n]


def _fmt_entries(entries) -> str:
    try:
        return "[" + ", ".join(f"({p!r}, {lb.decode(s)[0]}@{lb.decode(s)[1]})" for p, s in entries) + "]"
    except (TypeError, ValueError):
        return repr(entries)


def _merge_hint(got, want, shards) -> str:
    try:
        return _why_merge_differs([tuple(x) for x in got], want, shards)
    except (TypeError, ValueError):
        return ""


def _why_merge_differs(got, want, shards) -> str:
    firsts = [s[0] for s in shards if s]
    if len(got) < len(want) and all(e in firsts for e in got):
        return ": that is each shard's first entry; the second of one shard can beat the first of another"
    if len(got) != len(want):
        return f": {len(got)} entries, expected {len(want)}"
    if [s for _, s in got] == [s for _, s in want]:
        return ": equal scores go in member order, descending, as ZREVRANGE orders one board"
    if sorted(got) != sorted(want):
        return ": not the n highest scores of all shards"
    points = [lb.decode(s)[0] for _, s in got]
    if points == sorted(points, reverse=True):
        return ": sorted by points alone. The score's low digits hold the tie-breaker (who got there first): compare whole scores"
    return ": the right entries in the wrong order (highest score first)"


@task("merge_top", points=3, title="global top N from the shards' local top N", timeout=20, seed=4646)
async def check_merge_top(r: Report, merge_top) -> None:
    eu = [("ana", float(lb.encode(90, 10))), ("bo", float(lb.encode(80, 5))), ("cy", float(lb.encode(70, 1)))]
    us = [("dan", float(lb.encode(95, 3))), ("eve", float(lb.encode(80, 2))), ("fay", float(lb.encode(10, 0)))]
    asia = [("gus", float(lb.encode(85, 8)))]
    shards = [eu, us, asia]
    want = _reference_merge(shards, 5)
    got = merge_top([list(s) for s in shards], 5)
    if inspect.isawaitable(got):  # "a plain function, no I/O": the merge needs no server
        if inspect.iscoroutine(got):
            got.close()
        r.fail(
            "merge_top returned an awaitable: write it as a plain `def` that merges the lists it is "
            "given, with no I/O (the shards' tops are already fetched)"
        )
        return
    r.expect(
        _same(got, want),
        f"3 shards (eu, us, asia), n = 5: {_fmt_entries(got)} (points@time)",
        f"3 shards (eu, us, asia), n = 5 gave {got!r}, expected {_fmt_entries(want)} (points@time)"
        + _merge_hint(got, want, shards),
    )
    if r.public:
        return
    rng = r.random
    cases = 0
    for _ in range(60):
        n = rng.randint(1, 12)
        shards = _shards(rng, n)
        want = _reference_merge(shards, n)
        got, copies = call_seeing_args(r, "merge_top", [list(s) for s in shards], n)
        copies = copies[0]
        if not _same(got, want):
            r.fail(
                f"{len(shards)} shard(s) of sizes {[len(s) for s in shards]}, n = {n}: got {_fmt_entries(got)}, "
                f"expected {_fmt_entries(want)} (points@time)" + _merge_hint(got, want, shards)
            )
        if copies != shards:
            r.fail("merge_top changed the lists it was given; leave the shards' lists as they are")
        cases += 1
    r.ok(
        f"{cases} random cases (seed {r.task.seed}): shards of 0 to n entries, ties across shards, n larger than "
        "all entries: every result is the global top n"
    )
    long = [[(f"s{s}-{i:05d}", float(lb.encode(100_000 - i * 3 - s, 0))) for i in range(5000)] for s in range(3)]
    got = merge_top(long, 5000)
    r.expect(_same(got, _reference_merge(long, 5000)), "3 shards of 5,000, n = 5,000: right")


def _same(got, want) -> bool:
    try:
        return [(str(p), float(s)) for p, s in got] == [(p, float(s)) for p, s in want] and isinstance(got, list)
    except (TypeError, ValueError):
        return False
