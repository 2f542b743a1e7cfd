"""Hidden checks of chapter 09 (data access): ``keyset_page`` and ``hash_ring``.

``keyset_page`` is walked page by page by the check itself, and the writes that break
OFFSET pages (rows inserted above the reader, rows deleted behind it, the cursor's own
row deleted, rows deleted ahead of it) run from another session *between* two calls, in
a fixed order: no timing is involved, so the same answer gets the same verdict on every
run. Pages alternate between two replicas of the answer (copies of the answer cell that
share no module state), so a cursor must be readable by a process that did not make it.

``hash_ring`` is measured on fixed key sets: keys moved when an eleventh node joins, the
spread of keys over ten nodes, agreement between rings built in different orders, between
replicas, and between two fresh Python processes started with different
``PYTHONHASHSEED`` values (Python's ``hash()`` of a string differs between them).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import timedelta

from autograder.harness import Report, cell_source, error_line, task
from autograder.probes import REPO, _environment
from autograder.wire import each  # a check's loop over keys: one round trip to the learner's process
from course.chapters.ch09 import EPOCH, setup_posts
from course.kit import lab
from course.pagination import InvalidCursor

NEWEST_FIRST = "ORDER BY created_at DESC, id DESC"

#: The secret the notebook's setup cell gives the learner as ``CURSOR_SECRET``.
CURSOR_SECRET = b"ch09: every replica of the feed service shares this secret"


# ----------------------------------------------------------------------------- keyset_page


def _ids(rows) -> list:
    out = []
    for row in rows:
        out.append(row["id"] if isinstance(row, dict) else row[0])
    return out


class Table:
    """The check's own record of ``ch09_posts``: id -> created_at, and what happened when."""

    def __init__(self, pool, random) -> None:
        self.pool = pool
        self.random = random
        self.when: dict[int, object] = {}

    async def fill(self, n: int, per_tie: int = 3) -> None:
        """``n`` rows, ``per_tie`` of them sharing each created_at, ids shuffled (not in time order); the
        created_at values are 0.250001 s apart."""
        ids = [10 * (i + 1) for i in range(n)]
        self.random.shuffle(ids)
        # ties 0.250001 s apart: several ties within one second, and microseconds in every timestamp, so a cursor
        # that drops them (or the fraction of a second) lands inside a tie of its own second
        self.when = {id_: EPOCH + timedelta(microseconds=250_001 * (i // per_tie)) for i, id_ in enumerate(ids)}
        async with self.pool.connection() as conn:
            await conn.execute("TRUNCATE ch09_posts")
            async with conn.cursor() as cur:
                await cur.executemany(
                    "INSERT INTO ch09_posts VALUES (%s, %s, %s)",
                    [(i, t, f"post {i}") for i, t in self.when.items()],
                )

    async def insert(self, id_: int, at) -> None:
        self.when[id_] = at
        async with self.pool.connection() as conn:
            await conn.execute("INSERT INTO ch09_posts VALUES (%s, %s, %s)", (id_, at, f"post {id_}"))

    async def delete(self, ids) -> None:
        async with self.pool.connection() as conn:
            await conn.execute("DELETE FROM ch09_posts WHERE id = ANY(%s)", (list(ids),))

    async def ordered(self) -> list[int]:
        async with self.pool.connection() as conn:
            cur = await conn.execute(f"SELECT id FROM ch09_posts {NEWEST_FIRST}")
            return [row[0] for row in await cur.fetchall()]

    def key(self, id_: int):
        return (self.when[id_], id_)


async def _walk(r: Report, fns, pool, limit: int, between=None, max_pages: int = 40) -> list[list]:
    """Every page from the first until next is None; ``between(i, ids)`` runs after page ``i``."""
    pages: list[list] = []
    cursor = None
    for i in range(max_pages):
        fn = fns[i % len(fns)]
        try:
            got = await fn(pool, cursor, limit)
        except InvalidCursor as err:
            if len(fns) > 1 and i > 0:
                r.fail(
                    f"page {i + 1}: replica {i % len(fns) + 1} raised {error_line(err)} for the cursor replica "
                    f"{(i - 1) % len(fns) + 1} made. Every replica must read every other's cursors: sign with the "
                    "shared CURSOR_SECRET, not a key made in the process (os.urandom, secrets)"
                )
            raise
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            r.fail(f"page {i + 1}: keyset_page returned {got!r:.80}, expected a pair (rows, next_cursor)")
        rows, cursor = got
        try:
            ids = _ids(rows)
        except (TypeError, KeyError, IndexError):
            r.fail(f"page {i + 1}: rows {rows!r:.80} are not (id, created_at, title) tuples")
        if len(ids) > limit:
            r.fail(f"page {i + 1}: {len(ids)} rows returned with limit={limit}")
        pages.append(ids)
        if cursor is None:
            return pages
        if not isinstance(cursor, str):
            r.fail(f"page {i + 1}: next_cursor is {type(cursor).__name__} {cursor!r:.60}, expected a str")
        if between is not None:
            await between(i, ids)
    r.fail(f"{max_pages} pages and next_cursor is still not None: the walk never ends")
    return pages


def _reference_calls(fn) -> list[str]:
    """The course's reference pagers (``fetch_page``, ``posts_page``) that ``fn``'s cell names, by the cell's AST."""
    import ast

    found = cell_source(fn)
    if found is None:
        return []
    try:
        tree = ast.parse(found[1])
    except SyntaxError:
        return []
    names = {"fetch_page", "posts_page"}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in names:
            used.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in names:
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            used.update(a.name for a in node.names if a.name in names)
    return sorted(used)


async def _serves_page_one(keyset_page, pool, page1: list) -> bool:
    """Whether a string that is no cursor at all gets page 1: a refusal swallowed, not a forged position."""
    try:
        out = await keyset_page(pool, "not-a-cursor", 5)
    except Exception:  # noqa: BLE001 - raising is what a refusal should do
        return False
    try:
        return _ids(out[0]) == page1
    except (TypeError, KeyError, IndexError):
        return False


def _pages_text(pages: list[list]) -> str:
    return " | ".join(" ".join(str(x) for x in p) for p in pages)


def _mutations(cursor: str, rnd, n: int = 10) -> list[tuple[int, str]]:
    """``n`` one-character changes of ``cursor`` (never its last 4 characters: base64 padding bits),
    one in each ``n``-th of it, at a spot drawn from ``rnd`` as a fraction of that stretch.

    Exactly ``n`` draws whatever the cursor, so what the check draws afterwards does not depend on
    the cursor's length, and a cursor that comes out a few characters longer or shorter on another
    run (a timestamp or a nonce inside it) is changed at the same places, proportionally. Fewer
    than ``n`` changes only when the cursor has fewer than ``n`` letters and digits."""
    fractions = [rnd.random() for _ in range(n)]
    spots = [i for i, ch in enumerate(cursor[:-4]) if ch.isascii() and ch.isalnum()]
    if len(spots) <= n:
        chosen = spots
    else:
        chosen = [spots[int((k + f) * len(spots) / n)] for k, f in enumerate(fractions)]  # one per stretch
    out = []
    for i in chosen:
        ch = cursor[i]
        if ch.isdigit():
            new = str((int(ch) + 1) % 10)
        elif ch.islower():
            new = "a" if ch == "z" else chr(ord(ch) + 1)
        else:
            new = "A" if ch == "Z" else chr(ord(ch) + 1)
        out.append((i, cursor[:i] + new + cursor[i + 1 :]))
    return out


@task(
    "keyset_page", points=6, title="keyset pages that never skip or repeat, with signed cursors", timeout=40, seed=909
)
async def check_keyset_page(r: Report, keyset_page) -> None:
    async with lab.scratch("ch09") as ns:
        pool = await ns.pool(max_size=4)
        await setup_posts(pool)
        await _check_keyset_page(r, keyset_page, pool)


async def _check_keyset_page(r: Report, keyset_page, pool) -> None:
    called = _reference_calls(keyset_page)
    if called:
        r.fail(
            f"keyset_page's cell calls the course's own {', '.join(called)}, the chapter's reference answer: write "
            "the query yourself (CursorCodec from course.pagination may still make the cursor)"
        )
    table = Table(pool, r.random)

    # --- a quiet table: 23 rows, ties of 3, 5 a page ---------------------------------------
    await table.fill(23)
    expected = await table.ordered()
    r.note("23 rows, 3 sharing each created_at, ids not in time order; pages of 5 on a quiet table")
    got = await _walk(r, [keyset_page], pool, 5)
    flat = [x for p in got for x in p]
    if flat != expected:
        repeated = sorted({x for x in flat if flat.count(x) > 1})
        skipped = [x for x in expected if x not in flat]
        ends = {p[-1] for p in got[:-1] if p}
        seen = f"pages: {_pages_text(got)}; expected {_pages_text([expected[i : i + 5] for i in range(0, 23, 5)])}"
        if repeated and set(repeated) <= ends and not skipped:
            r.fail(
                f"{seen}. Rows {repeated} each ended a page and came again at the top of the next: the comparison "
                "is not strict (<= repeats the cursor's own row). Continue strictly after it: "
                "(created_at, id) < (%s, %s)"
            )
        end_times = {table.when[x] for x in ends}
        if repeated and all(table.when[x] in end_times for x in repeated):
            r.fail(
                f"{seen}. Repeated {repeated}, skipped {skipped or 'none'}: rows tied with the last row of a page "
                "came again on the next one, so the tie-breaker is there but runs the other way: ORDER BY says "
                "id DESC and the seek condition goes to larger ids (id > %s). Compare in the direction you sort: "
                "(created_at, id) < (%s, %s) with ORDER BY created_at DESC, id DESC"
            )
        if repeated or skipped:
            r.fail(
                f"{seen}. Skipped {skipped or 'none'}, repeated {repeated or 'none'}: rows that share one "
                "created_at were lost or doubled at a page boundary. created_at alone has ties; add the unique id "
                "as a tie-breaker, in ORDER BY and in the cursor: WHERE (created_at, id) < (%s, %s) "
                "ORDER BY created_at DESC, id DESC. These rows are a fraction of a second apart: the cursor must "
                "also keep created_at exactly, microseconds and time zone (isoformat() keeps both)"
            )
        r.fail(f"{seen}: the rows are all there but out of order; sort by created_at DESC, id DESC")
    r.ok(f"5 pages, every row once, in order; the last page has {len(got[-1])} rows and next_cursor None")

    await table.fill(20)
    got = await _walk(r, [keyset_page], pool, 5)
    r.expect(
        len(got) == 4,
        "exactly 20 rows: four pages of 5, and the fourth says next_cursor None",
        f"exactly 20 rows at limit 5 took {len(got)} calls: {_pages_text(got) or '(empty)'}"
        + (
            ". The fourth page returned a cursor though no row followed, so the reader asked for an empty fifth "
            "page. Fetch LIMIT n + 1 rows: the extra row only says whether another page exists"
            if len(got) == 5 and not got[-1]
            else ""
        ),
    )
    if r.public:
        return

    # --- tampered and foreign cursors ------------------------------------------------------------
    await table.fill(23)
    rows, cursor = await keyset_page(pool, None, 5)
    page1 = _ids(rows)
    changes = _mutations(cursor, r.random, 16)
    r.note(f"a real cursor for page 2, changed one character at a time, {len(changes)} times, spread over its")
    r.note("length (a change that leaves the decoded bytes as they were, in unused bits of base64, may return")
    r.note("page 2 unchanged)")
    page2 = _ids((await keyset_page(pool, cursor, 5))[0])
    for pos, bad in changes:
        try:
            out = await keyset_page(pool, bad, 5)
        except InvalidCursor:
            continue
        except Exception as err:  # noqa: BLE001 - reported
            r.fail(
                f"character {pos} changed ({cursor[pos]!r} -> {bad[pos]!r}): raised {error_line(err, 80)}, expected "
                "InvalidCursor. Catch decoding errors and raise InvalidCursor"
            )
        if _ids(out[0]) == page2:  # e.g. base64's unused low bits at the end of a segment: same bytes, same page
            continue
        if _ids(out[0]) == page1 and await _serves_page_one(keyset_page, pool, page1):
            r.fail(
                f"character {pos} changed ({cursor[pos]!r} -> {bad[pos]!r}): keyset_page returned page 1 again "
                f"({page1}) instead of raising InvalidCursor. The signature check refused it, then the refusal was "
                "swallowed: a client with a broken cursor silently starts over and reads page 1 twice. Let "
                "InvalidCursor reach the caller (the API answers 400)"
            )
        r.fail(
            f"character {pos} changed ({cursor[pos]!r} -> {bad[pos]!r}): the altered cursor was accepted and "
            f"returned rows {_ids(out[0])} instead of page 2's {page2}. A client can forge any position: sign the "
            "cursor (an HMAC of its content with CURSOR_SECRET) and check the signature before using it"
        )
    for junk in ("not-a-cursor", ""):
        try:
            out = await keyset_page(pool, junk, 5)
        except InvalidCursor:
            continue
        except Exception as err:  # noqa: BLE001 - reported
            r.fail(f"cursor {junk!r}: raised {error_line(err, 80)}, expected InvalidCursor")
        served_first = _ids(out[0]) == page1
        r.fail(
            f"cursor {junk!r} was accepted and returned {_ids(out[0])}, expected InvalidCursor"
            + (": that is page 1 again; a refused cursor must raise, not start over" if served_first else "")
        )
    r.ok(f"{len(changes)} altered cursors and 2 strings that are not cursors: each refused with InvalidCursor")

    # --- writers between pages, two replicas ---------------------------------------------------------
    replicas = r.replicas("keyset_page", 2)
    await table.fill(40)
    start = await table.ordered()
    deleted_at: dict[int, int] = {}  # id -> the page after which it was deleted
    inserted: list[int] = []
    top = max(table.when.values())
    cursor_row: dict = {}

    read: list[int] = []

    async def between(i: int, ids: list) -> None:
        read.extend(ids)
        if i == 0:  # three newer posts arrive: a position counted in rows shifts down by three
            for k in range(3):
                await table.insert(1001 + k, top + timedelta(seconds=10 + k))
                inserted.append(1001 + k)
        elif i == 1:  # four posts already read are deleted: a row-count position shifts up by four
            gone = read[:2] + read[-3:-1]  # not the last: that is the cursor's row, deleted next
            await table.delete(gone)
            deleted_at.update(dict.fromkeys(gone, i))
        elif i == 2 and ids:  # the post the cursor was made from is deleted
            cursor_row["id"] = ids[-1]
            await table.delete([ids[-1]])
            deleted_at[ids[-1]] = i
        elif i == 3 and ids:  # two posts not yet read are deleted; two arrive beside the cursor's row
            ahead = [x for x in await table.ordered() if table.key(x) < table.key(ids[-1])][:2]
            await table.delete(ahead)
            deleted_at.update(dict.fromkeys(ahead, i))
            at = table.when[ids[-1]]
            for new in (ids[-1] + 1, ids[-1] - 1):
                if new not in table.when:
                    await table.insert(new, at)
                    inserted.append(new)

    r.note("40 rows, 6 a page, pages alternating between two replicas; between pages another session:")
    r.note("after page 1 inserts 3 newer rows; after page 2 deletes 4 rows already read; after page 3 deletes")
    r.note("the row page 3 ended with; after page 4 deletes 2 rows not yet read and adds 2 tied with page 4's last")
    got = await _walk(r, replicas, pool, 6, between)
    flat = [x for p in got for x in p]
    must = [x for x in start if x not in deleted_at]
    skipped = [x for x in must if x not in flat]
    repeated = sorted({x for x in flat if flat.count(x) > 1})
    page_of = {x: k for k, p in enumerate(got) for x in p}
    stale = [x for x in flat if x in deleted_at and page_of[x] > deleted_at[x]]
    disorder = [(a, b) for a, b in zip(flat, flat[1:], strict=False) if a in table.when and b in table.when
                and not table.key(a) > table.key(b)]  # fmt: skip
    if not (skipped or repeated or stale or disorder):
        r.ok(
            f"{len(got)} pages: every one of the {len(must)} rows that lived throughout came once, in order; "
            "no deleted row came back"
        )
        return
    seen = f"pages: {_pages_text(got)}"
    if len(got) >= 4 and cursor_row and len(got[3]) < 6 and skipped:
        r.fail(
            f"{seen}. After row {cursor_row['id']} (the last of page 3) was deleted, page 4 came back with "
            f"{len(got[3])} rows and {len(skipped)} rows were never returned: the cursor must carry the last "
            "row's sort values (created_at, id) themselves, not an id to look them up by"
        )
    if stale:
        r.fail(
            f"{seen}. Rows {stale} were deleted before their page was read and still came back: read each page "
            "from the table as it is now (keyset), not from a list made at the first page"
        )
    r.fail(
        f"{seen}. Repeated {repeated or 'none'}, skipped {skipped or 'none'}"
        + (f", out of order at {disorder[:2]}" if disorder else "")
        + ". Rows inserted above the reader pushed rows it had read onto the next page, and rows deleted behind "
        "it pulled unread rows onto a page it had passed: a position counted in rows (OFFSET) moves when other "
        "sessions write. Continue from the last row's (created_at, id) instead"
    )


# ----------------------------------------------------------------------------- hash_ring

NODES = [f"node-{i}" for i in range(10)]
KEYS = [f"user:{i}" for i in range(10_000)]

MARK = "ch09-ring-placement:"
PROCESS = r"""
import json, sys
MARK = "ch09-ring-placement:"
from autograder.child import build_namespace
spec = json.loads(sys.stdin.read())
ns = build_namespace(spec)
ring = ns["HashRing"]()
for node in spec["nodes"]:
    ring.add_node(node)
print("\n" + MARK + json.dumps([ring.node_for(k) for k in spec["keys"]]))  # after whatever the cell printed
"""


def _in_process(r: Report, seed: int, keys: list[str]) -> list[str] | str:
    """``node_for`` of ``keys`` in a fresh Python started with ``PYTHONHASHSEED=seed``; or what failed."""
    fresh = getattr(r.namespace, "fresh", None)
    if fresh is not None:  # graded: one more learner process, sandboxed like the first
        try:
            with fresh(hashseed=seed) as ns:
                ring = _build(ns["HashRing"], NODES)
                return each(ring.node_for, keys)
        except Exception as err:  # noqa: BLE001 - the answer's error, said in one line
            return error_line(err, 160)
    found = cell_source(r.namespace["HashRing"])
    if found is None:
        return "cannot find the cell that defines HashRing; run it again"
    filename, source = found
    spec = {"source": source, "filename": filename, "env": _environment(r.namespace, source), "nodes": NODES,
            "keys": keys}  # fmt: skip
    env = dict(
        os.environ, PYTHONHASHSEED=str(seed), PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROCESS], input=json.dumps(spec), capture_output=True, text=True, timeout=30,
            cwd=REPO, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "the process did not answer within 30 s"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["exited with an error"])[-1][:160]
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        return "the process printed no placement"
    return json.loads(lines[-1][len(MARK) :])


def _build(HashRing, nodes):
    ring = HashRing()
    for node in nodes:
        ring.add_node(node)
    return ring


def _placed(r: Report, ring, keys: list[str], what: str) -> list:
    """``ring.node_for`` of every key; a key that raises fails the check with the likely cause."""
    try:
        return each(ring.node_for, keys)  # one round trip when the answer runs in a process of its own
    except Exception:  # noqa: BLE001, S110 - found again below, key by key, and explained
        pass
    out = []
    for key in keys:
        try:
            out.append(ring.node_for(key))
        except Exception as err:  # noqa: BLE001 - reported with its cause
            r.fail(f"{what}: node_for({key!r}) raised {error_line(err, 80)}{_why_raised(err, what)}")
    return out


def _why_raised(err: Exception, what: str) -> str:
    if isinstance(err, IndexError):
        return (
            ". A key whose hash is past the last point belongs to the first point: the ring wraps around "
            "(index % len(points) after the bisect)"
        )
    if isinstance(err, KeyError) and "removed" in what:
        return (
            ". The bisect found a position whose node is no longer recorded: remove_node dropped the node from "
            "one structure and left its points in another. Remove the node's points everywhere you keep them"
        )
    if isinstance(err, KeyError):
        return ". The bisect found a position with no node recorded for it: keep positions and owners together"
    return ""


def _imbalance_cause(held: int, nodes: int) -> str:
    if held >= 50 * nodes:
        return (
            f". The ring keeps {held:,} entries ({held // nodes} per node), so points are not what is missing: the "
            "keys land in one narrow stretch of the circle. Hash keys and points into the same range (both into "
            "64 bits, or both into 32): a key hashed into 32 bits sorts before almost every 64-bit point and goes "
            "to the owner of the first points"
        )
    return (
        ". With one point per node the arcs are very unequal: give each node 100-200 points (virtual nodes), each "
        "hashed from the node's name and its number"
    )


def _points_held(ring) -> int:
    """The size of the largest list, dict, tuple or set the ring keeps (its points, in any sane layout)."""
    sizes = [len(v) for v in vars(ring).values() if isinstance(v, (list, dict, tuple, set))]
    return max(sizes, default=0)


@task(
    "hash_ring", points=5, title="a consistent-hash ring with virtual nodes", needs=("HashRing",), timeout=60, seed=911
)
async def check_hash_ring(r: Report, HashRing) -> None:
    ring = _build(HashRing, NODES[:4])
    sample = KEYS[:1000]
    first = _placed(r, ring, sample, "4 nodes, 1,000 keys")
    strange = sorted({n for n in first if n not in NODES[:4]})
    r.expect(not strange, "4 nodes: node_for returned one of them for 1,000 keys", f"node_for returned {strange[:3]}")
    again = _placed(r, ring, sample, "4 nodes, the same keys again")
    r.expect(again == first, "asked again, every key went to the same node", "asked twice, some keys changed node")
    if r.public:
        return

    ten = await asyncio.to_thread(_build, HashRing, NODES)
    before = await asyncio.to_thread(_placed, r, ten, KEYS, "10 nodes, 10,000 keys")
    counts = {n: before.count(n) for n in NODES}
    mean = len(KEYS) / len(NODES)
    worst = max(NODES, key=lambda n: abs(counts[n] - mean))
    dev = abs(counts[worst] - mean) / mean
    r.expect(
        # 65 %: with 100-200 points per node the worst node of a good hash is up to a third from the mean (blake2b,
        # 128 points: 33 %), and crc32 of sequential labels up to 58 % ("node-0.{i}", 180 points); one point per
        # node is 90 % or more
        dev <= 0.65,
        f"10 nodes, 10,000 keys: the worst node ({worst}, {counts[worst]:,} keys) is {dev:.0%} from the mean of "
        f"{mean:,.0f}",
        f"10 nodes, 10,000 keys: {worst} got {counts[worst]:,} keys, {dev:.0%} from the mean of {mean:,.0f} "
        f"(loads {sorted(counts.values())})" + _imbalance_cause(_points_held(ten), len(NODES)),
    )

    backwards = await asyncio.to_thread(_build, HashRing, NODES[::-1])
    other = await asyncio.to_thread(_placed, r, backwards, KEYS, "10 nodes added in the opposite order")
    differ = sum(a != b for a, b in zip(before, other, strict=True))
    r.expect(
        differ == 0,
        "nodes added in the opposite order: every key on the same node",
        f"nodes added in the opposite order: {differ:,} of 10,000 keys on another node. Placement must depend only "
        "on the names: hash each point from the node's name (never its position in a list), and break ties by name",
    )

    copy = await asyncio.to_thread(_build, r.replicas("HashRing", 1)[0], NODES)
    theirs = await asyncio.to_thread(_placed, r, copy, KEYS, "a second replica, 10 nodes")
    r.expect(theirs == before, "a second replica of the answer cell agrees on every key", "a second replica disagrees")

    r.note("two fresh Python processes, PYTHONHASHSEED=1 and PYTHONHASHSEED=2, each builds the 10-node ring")
    probe = KEYS[:2000]
    got = await asyncio.gather(*(asyncio.to_thread(_in_process, r, seed, probe) for seed in (1, 2)))
    for seed, out in zip((1, 2), got, strict=True):
        if isinstance(out, str):
            r.fail(f"the process with PYTHONHASHSEED={seed} failed: {out}")
    apart = sum(a != b for a, b in zip(got[0], got[1], strict=True))
    r.expect(
        apart == 0 and got[0] == before[:2000],
        "both processes placed 2,000 keys exactly as this one did",
        f"the two processes placed {apart:,} of 2,000 keys on different nodes. Python's hash() of a string is "
        "salted per process (PYTHONHASHSEED), so two replicas would route one key to two nodes: use a stable "
        "hash (hashlib.md5/sha1/blake2b, or zlib.crc32) of the encoded string",
    )

    ten.add_node("node-10")
    after = await asyncio.to_thread(_placed, r, ten, KEYS, "node-10 joined")
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    share = len(moved) / len(KEYS)
    sideways = sum(b != "node-10" for a, b in moved)
    if 0.045 <= share <= 0.16 and sideways == 0:
        r.ok(f"node-10 joined: {share:.1%} of the keys moved (ideal 1/11 = 9.1%), every one of them to node-10")
    else:
        why = ""
        if sideways > 0.3 * len(KEYS):
            why = (
                ". Placement changed for nodes that did not change: hash(key) % len(nodes), or points named after "
                "a node's position in a list, renumbers everything when one node joins. Place each node at points "
                "hashed from its name, and give a key to the first point at or after the key's hash"
            )
        elif sideways:
            why = ". Only the new node should take keys (the arcs before its points); the others keep theirs"
        r.fail(
            f"node-10 joined: {share:.1%} of 10,000 keys moved (expected about 1/11 = 9.1%), {sideways:,} of them "
            f"between old nodes{why}"
        )

    ten.remove_node("node-3")
    gone = await asyncio.to_thread(_placed, r, ten, KEYS, "node-3 removed")
    wrongly = sum(a != b for a, b in zip(after, gone, strict=True) if a != "node-3")
    left = sum(g == "node-3" for g in gone)
    r.expect(
        wrongly == 0 and left == 0,
        "node-3 removed: only its keys moved, spread over the others",
        f"node-3 removed: {left:,} keys still on it, {wrongly:,} keys of other nodes moved; remove only node-3's "
        "points and leave every other point where it was",
    )


from autograder.checks.ch09.rules import REFERENCES, RULES  # noqa: E402,F401 - the rule tables, beside the checks

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 2
#: Processes of another PYTHONHASHSEED that check_hash_ring asks for, started once the setup cells ran.
FRESH_PROCESSES = {"hash_ring": ({"hashseed": 1}, {"hashseed": 2})}
