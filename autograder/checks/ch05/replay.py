"""Hidden checks of ``replay_key``: re-driving a blocked key in order, once."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import psycopg
from psycopg.types.json import Jsonb

from autograder.checks.ch05.consumer import (
    _setup_world,
)
from autograder.checks.ch05.rig import (
    GROUP,
    RUN_LIMIT,
    Clock,
    Group,
    Sleeps,
    World,
    _killed,
    applied,
    blocked,
    malformed,
    parked,
    per_key,
    policy_of,
)
from autograder.harness import Report, Stop, error_line, task
from course import messaging as mq
from course.chapters import ch05
from course.kit import lab

# ----------------------------------------------------------------------------- replay_key


class ReplayHandler:
    """The handler for replays: applies, fails while ``broken``, can kill, and watches the block row."""

    def __init__(self, world: World, watcher, *, broken: set | None = None, kill_after: str | None = None) -> None:
        self.world = world
        self.watcher = watcher
        self.broken = set(broken or ())
        self.kill_after = kill_after
        self.calls: list[str] = []
        self.unblocked_early: list[str] = []
        self.misuse: list[str] = []
        self.dead = False
        self.xdel_early = False  # an XDEL came while the key's block row was still committed

    async def __call__(self, conn, fields) -> None:
        if self.dead:
            raise mq.ConsumerKilled("this replica is dead")
        if not isinstance(fields, dict) or "id" not in fields:
            self.misuse.append(f"handle was called with {fields!r:.120}; expected the message's fields dict")
            raise TypeError("handle(conn, fields): fields must be the message's fields dict")
        mid = fields["id"]
        self.calls.append(mid)
        if mid in self.broken:
            raise malformed(mid)
        if fields.get("seq") != "1":  # a parked message: is the key still blocked for everyone else?
            cur = await self.watcher.execute(
                "SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s", (self.world.stream, fields["key"])
            )
            if await cur.fetchone() is None:
                self.unblocked_early.append(mid)
        await conn.execute(
            "INSERT INTO ch05_applied (stream, message_id, key, seq, consumer) VALUES (%s, %s, %s, %s, 'replay')",
            (self.world.stream, mid, fields["key"], int(fields["seq"])),
        )
        if mid == self.kill_after:
            self.dead = True
            raise mq.ConsumerKilled(f"the check killed the replay inside handle({mid}), after its change")


async def _blocked_world(ns, watcher, admin, name: str) -> World:
    """P-1 dead (malformed), P-2..P-12 parked (with ids 1-3..1-13, so text order is wrong), a
    duplicate of P-3, Q-1 dead too, B healthy: the state the reference consumer leaves."""
    world = await _setup_world(ns, admin, name, watcher)
    specs = [("B", 1), ("P", 1), *[("P", s) for s in range(2, 13)], ("Q", 1), ("B", 2), ("P", 3), ("Q", 2)]
    await world.publish(admin, specs)
    handler = ReplayHandler(world, watcher, broken={"P-1", "Q-1"})
    pool = await ns.pool(max_size=4)
    await mq.ordered_consumer(
        pool,
        admin,
        handler,
        stream=world.stream,
        group=GROUP,
        consumer="reference",
        dlq=world.dlq,
        policy=policy_of(3, 0.1, 1.0),
        sleep=Sleeps(Clock()),
        clock=Clock(),
    )
    await _unsorted_parked(watcher, world)
    return world


def _entry_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


async def _unsorted_parked(watcher, world: World) -> None:
    """Write the parked rows back in an order other than the stream's, their ``parked_at`` following
    that order (rows are read in no order unless the query orders them: nothing but the entry id says
    which came first), and park a message of key P in another stream that shares the tables."""
    async with watcher.transaction():
        cur = await watcher.execute(
            "DELETE FROM mq_parked WHERE stream = %s RETURNING entry_id, key, fields, parked_at", (world.stream,)
        )
        rows = sorted(await cur.fetchall(), key=lambda row: _entry_order(row[0]))
        if not rows:
            return
        start = min(row[3] for row in rows)
        for i, (entry_id, key, fields, _) in enumerate(rows[::2][::-1] + rows[1::2]):
            await watcher.execute(
                "INSERT INTO mq_parked (stream, entry_id, key, fields, parked_at) "
                "VALUES (%s, %s, %s, %s, %s + %s * interval '1 millisecond')",
                (world.stream, entry_id, key, Jsonb(fields), start, i),
            )
        decoy = next((dict(f) for e, k, f, _ in rows if k == "P"), None)
        if decoy is not None:
            decoy["id"] = OTHER_STREAM_MESSAGE
            await watcher.execute(
                "INSERT INTO mq_parked (stream, entry_id, key, fields) VALUES (%s, '1-1', 'P', %s) "
                "ON CONFLICT DO NOTHING",
                (world.stream + OTHER_STREAM, Jsonb(decoy)),
            )


OTHER_STREAM = ":other"  # the stream, elsewhere, whose key P is parked too: a replay of this stream's P leaves it
OTHER_STREAM_MESSAGE = "P-of-another-stream"


class ReplayHung(Exception):
    pass


class _WatchedXdel:
    """The Redis client a replay gets: at each XDEL it asks PostgreSQL (another connection) whether
    the key's block row is still there, i.e. the dead letter goes before the replay committed."""

    def __init__(self, client, handler: ReplayHandler, key: str) -> None:
        self._client, self._handler, self._key = client, handler, key

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def _deleting(self) -> None:
        cur = await self._handler.watcher.execute(
            "SELECT 1 FROM mq_blocked_keys WHERE stream = %s AND key = %s", (self._handler.world.stream, self._key)
        )
        if await cur.fetchone() is not None:
            self._handler.xdel_early = True

    async def xdel(self, name, *ids):
        await self._deleting()
        return await self._client.xdel(name, *ids)

    async def execute_command(self, *args, **options):
        if args and str(args[0]).upper() == "XDEL":
            await self._deleting()
        return await self._client.execute_command(*args, **options)


async def _replay(replay_key, pool, admin, handler, world: World, key: str):
    redis = _WatchedXdel(admin, handler, key)
    job = asyncio.ensure_future(replay_key(pool, redis, handler, stream=world.stream, key=key, dlq=world.dlq))
    done, _ = await asyncio.wait([job], timeout=RUN_LIMIT)
    if not done:
        job.cancel()
        raise ReplayHung(f"replay_key(stream, key={key!r}) did not return within {RUN_LIMIT:g} s of real time")
    return job.result()


P_ORDER = [f"P-{s}" for s in range(1, 13)]


def _as_text(mids: list[str]) -> bool:
    """Were the parked messages applied in the text order of their entry ids? P-9..P-12 are 1-10..1-13,
    which sort as text before 1-3 (P-2)."""
    return mids[:4] == ["P-9", "P-10", "P-11", "P-12"]


async def _expect_replayed(r: Report, watcher, admin, world: World, what: str) -> None:
    got = per_key(await applied(watcher, world))
    p = got.get("P", [])
    if p != P_ORDER:
        dup = [m for m, n in Counter(p).items() if n > 1]
        if dup:
            r.fail(
                f"{what}: key P applied {p}; {dup[0]} twice. A replay applies each message once: record its id in "
                "mq_processed with its change, skip ids already there (the parked P-3 was delivered twice)"
            )
        if OTHER_STREAM_MESSAGE in p:
            r.fail(
                f"{what}: key P applied {p}: {OTHER_STREAM_MESSAGE!r} is parked under key P of another stream. "
                "Read mq_parked by stream and key, both"
            )
        if sorted(p) == sorted(P_ORDER):
            hint = (
                " The parked entries were sorted as text ('1-10' < '1-3'): order by the entry id as two numbers"
                if _as_text(p[1:])
                else " Apply the dead-lettered message first, then the parked ones in stream order (the parked rows "
                "were written in another order: order them by entry id, as two numbers, not by parked_at or by "
                "nothing)"
            )
            r.fail(f"{what}: key P applied {p}, expected {P_ORDER}.{hint}")
        r.fail(f"{what}: key P applied {p}, expected {P_ORDER}")
    r.ok(f"{what}: P-1 (the dead letter), then P-2..P-12 (parked) applied once each, in stream order")
    blocks = await blocked(watcher, world)
    park = await parked(watcher, world)
    left = [world.by_entry.get(e, e) for e, row in park.items() if row["key"] == "P"]
    r.expect("P" not in blocks, "key P unblocked", "key P is still in mq_blocked_keys after the replay: unblock it")
    r.expect(not left, "no parked rows left for P", f"mq_parked still holds {left} after the replay: delete them")
    dead = {f.get("id") for _, f in await admin.xrange(world.dlq)}
    r.expect(
        "P-1" not in dead,
        "P-1's dead letter deleted (XDEL)",
        "the dead-letter stream still holds P-1 after the replay: delete it (XDEL dlq_id) once the replay committed, "
        "or the DLQ size alert never clears",
    )
    cur = await watcher.execute(
        "SELECT count(*) FROM mq_parked WHERE stream = %s AND key = 'P'", (world.stream + OTHER_STREAM,)
    )
    other = (await cur.fetchone())[0]
    r.expect(
        other == 1,
        "key P's parked message in another stream untouched",
        "the replay deleted key P's parked message of another stream: filter mq_parked (and mq_blocked_keys) by "
        "stream and key, both",
    )
    r.expect(
        "Q" in blocks and "Q-1" in dead and "Q-2" in {world.by_entry.get(e) for e in park},
        "key Q (another dead letter) untouched: still blocked, its dead letter and parked message kept",
        f"replaying P changed key Q: blocked {sorted(blocks)}, dead letters {sorted(dead)}; replay only the given key",
    )


REPLAYS: list[tuple[str, Callable]] = []


def replay_scenario(title: str):
    def register(fn):
        REPLAYS.append((title, fn))
        return fn

    return register


#: Each scenario's share. Re-driving a key in order and once, after its cause is fixed, is the point of the
#: task: that scenario weighs most. Scenarios not named here weigh 1.
REPLAY_WEIGHTS = {"_replay_basic": 2.0}


@task("replay_key", points=5, title="replay a blocked key in order, once", timeout=60, partial=True, seed=506)
async def check_replay_key(r: Report, replay_key) -> None:
    async with lab.scratch("ch05") as ns:
        pool = await ns.pool(max_size=4)
        await ch05.setup_schema(pool)
        watcher = await psycopg.AsyncConnection.connect(ns.database_url, autocommit=True)
        admin = ns.redis()
        try:
            chosen = REPLAYS[:1] if r.public else REPLAYS
            top = sum(REPLAY_WEIGHTS.get(fn.__name__, 1.0) for _, fn in chosen)
            passed, earned = 0, 0.0
            for title, fn in chosen:
                share = REPLAY_WEIGHTS.get(fn.__name__, 1.0)
                r.note(title if r.public else f"{title} [{100 * share / top:g}% of the points]")
                before = r.failures
                try:
                    await fn(r, replay_key, ns, pool, watcher, admin)
                except Stop:
                    pass
                except Exception as err:  # noqa: BLE001 - the learner's replay raised where it must not
                    if isinstance(err, NotImplementedError):
                        raise
                    r.fail(f"replay_key raised {error_line(err, 200)}", stop=False)
                if r.failures == before:
                    passed += 1
                    earned += share
            r.fraction = earned / top
            if not r.public:
                r.note(f"{passed} of {len(chosen)} scenarios passed ({100 * earned / top:g}% of the points)")
        finally:
            await watcher.close()


@replay_scenario(
    "1. key P blocked by its dead letter P-1 with 11 parked messages (P-3 twice), key Q blocked too; "
    "the cause is fixed: replay P"
)
async def _replay_basic(r: Report, replay_key, ns, pool, watcher, admin) -> None:
    world = await _blocked_world(ns, watcher, admin, "replay")
    handler = ReplayHandler(world, watcher, broken={"Q-1"})
    got = await _replay(replay_key, pool, admin, handler, world, "P")
    if handler.misuse:
        r.fail(handler.misuse[0])
    if handler.unblocked_early:
        r.fail(
            f"key P was already unblocked (committed) while {handler.unblocked_early[0]} was being applied: a new "
            "message of P could overtake the parked ones. Unblock only after (or in the transaction of) the last one"
        )
    await _expect_replayed(r, watcher, admin, world, "replay of P")
    r.expect(
        not handler.xdel_early,
        "the dead letter was deleted after the replay committed",
        "the dead letter was deleted (XDEL) while key P's block row was still committed: delete it only after the "
        "replay's transaction committed, or a replay that fails or dies after the XDEL loses the dead letter for good",
    )
    r.expect(
        got == len(P_ORDER),
        f"replay_key returned {got}: the messages it applied",
        f"replay_key applied P-1..P-12 (12 messages; P-3 was parked twice) and returned {got!r}; expected 12. "
        "Return how many messages it applied: count a message when its mq_processed insert returned a row and "
        "handle ran, not every row it read",
    )


@replay_scenario("2. replay P again, from another replica; then a new P-13 arrives: nothing changes, P-13 applies")
async def _replay_twice(r: Report, replay_key, ns, pool, watcher, admin) -> None:
    world = await _blocked_world(ns, watcher, admin, "twice")
    first, second = r.replicas("replay_key", 2)
    await _replay(first, pool, admin, ReplayHandler(world, watcher, broken={"Q-1"}), world, "P")
    handler = ReplayHandler(world, watcher, broken={"Q-1"})
    again = await _replay(second, pool, admin, handler, world, "P")
    r.expect(
        again == 0,
        "the second replay returned 0",
        f"a second replay of P, with P no longer blocked, returned {again!r}; expected 0 (it applied nothing)",
    )
    r.expect(
        not handler.calls,
        "a second replay of P (another replica) called handle for nothing",
        f"a second replay of P called handle for {handler.calls}: once a key is replayed (unblocked), replaying "
        "it again must change nothing",
    )
    await _expect_replayed(r, watcher, admin, world, "two replays of P")
    await world.publish(admin, [("P", 13)])
    await mq.ordered_consumer(
        pool,
        admin,
        ReplayHandler(world, watcher, broken={"Q-1"}),
        stream=world.stream,
        group=GROUP,
        consumer="reference",
        dlq=world.dlq,
        policy=policy_of(3, 0.1, 1.0),
        sleep=Sleeps(Clock()),
        clock=Clock(),
    )
    p = per_key(await applied(watcher, world)).get("P", [])
    r.expect(
        p == [*P_ORDER, "P-13"],
        "a new P-13 after the replay is applied by the consumer, after P-12",
        f"after the replay a new P-13 was not applied in order ({p[-3:]}): the key must be unblocked",
    )


@replay_scenario("3. replay P while the cause is not fixed (P-1 still fails): nothing changes")
async def _replay_not_fixed(r: Report, replay_key, ns, pool, watcher, admin) -> None:
    world = await _blocked_world(ns, watcher, admin, "notfixed")
    handler = ReplayHandler(world, watcher, broken={"P-1", "Q-1"})
    try:
        await _replay(replay_key, pool, admin, handler, world, "P")
        r.note("replay_key returned although P-1 failed again (letting the error through tells the operator)")
    except Exception as err:  # noqa: BLE001 - expected: the handler's error comes through
        if isinstance(err, NotImplementedError):
            raise
        r.ok(f"replay_key let the error through: {error_line(err, 100)}")
    got = per_key(await applied(watcher, world)).get("P", [])
    blocks = await blocked(watcher, world)
    park = await parked(watcher, world)
    left = sorted((world.by_entry.get(e, e) for e, row in park.items() if row["key"] == "P"), key=lambda m: int(m[2:]))
    dead = {f.get("id") for _, f in await admin.xrange(world.dlq)}
    r.expect(
        not got and "P" in blocks and len(left) >= 11 and "P-1" in dead,
        "P-1 failed again: nothing of P applied, P still blocked, its 11 parked messages and its dead letter kept",
        f"P-1 failed again during the replay, and then: applied {got}, P blocked: {'P' in blocks}, parked "
        f"{left}, dead letter kept: {'P-1' in dead}. A failed replay must leave the key as it was (roll back)",
    )
    handler = ReplayHandler(world, watcher, broken={"Q-1"})
    await _replay(replay_key, pool, admin, handler, world, "P")
    await _expect_replayed(r, watcher, admin, world, "the replay after the fix")


@replay_scenario("4. the replay is killed inside the handler of P-4 (after its change); another replica replays again")
async def _replay_crash(r: Report, replay_key, ns, pool, watcher, admin) -> None:
    world = await _blocked_world(ns, watcher, admin, "crash")
    first, second = r.replicas("replay_key", 2)
    killer = ReplayHandler(world, watcher, broken={"Q-1"}, kill_after="P-4")
    small = await ns.pool(max_size=2, fresh=True)
    try:
        await _replay(first, small, admin, killer, world, "P")
        r.fail("the check killed the replay inside handle(P-4), yet replay_key returned: do not catch ConsumerKilled")
    except mq.ConsumerKilled:
        pass
    except Group as eg:
        if not _killed(eg):
            raise
    finally:
        await small.close()
    r.expect(bool(killer.dead), "killed the replay inside handle(P-4)", "the replay never called handle for P-4")
    await _replay(second, pool, admin, ReplayHandler(world, watcher, broken={"Q-1"}), world, "P")
    await _expect_replayed(r, watcher, admin, world, "a replay killed mid-way, then run again")
