"""Concurrent callers in lockstep on Redis, in one process or across several.

A read-then-write on Redis loses a race only when the reads of concurrent callers land
before their writes, and a scheduler interleaves them that way on some runs and not on
others. A check cannot grade on luck, so it runs the callers in lockstep: each Redis
command (or pipeline) is held until every caller still running has sent its next one, then
the round goes. All reads go, then all writes, on every run: one Lua script (or WATCH/MULTI
with a retry) stays exact through it, a GET-then-SET lets every caller read the same state.

:class:`Gate` is one process's lockstep. :class:`RemoteGate` is one replica's part of a
lockstep across processes: it parks when its callers are all in, and a coordinator in the
grader (:func:`coordinate`) lets a round go only when every replica has parked. That is
what catches an ``asyncio.Lock`` around a read-then-write: it serializes one replica's
callers, while the other replica's callers read the same state in the same round.

Standard library and redis-py only: a replica process imports this before the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import sys
import time

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

_caller: contextvars.ContextVar[int | None] = contextvars.ContextVar("caller", default=None)

#: loop id -> the grading session whose learner processes that loop's checks call (set by
#: :meth:`autograder.session.RemoteNamespace.bind`). There the lockstep is the session's Redis
#: proxies holding every learner command, whatever client sent it (:meth:`Gate._run_remote`).
REMOTE: dict[int, object] = {}


class Gate:
    """Runs ``n`` callers in lockstep: a round of commands goes only when every caller still
    running has sent one (or finished), so no caller's second command overtakes another's first.

    A caller that cannot send (it queues on an in-process lock, or sleeps) would hold up the
    others forever; a round also goes once nothing on the loop can move (no command in flight,
    nothing ready to run for ``CALM_TICKS`` looks), and ``stalled`` counts those rounds.
    """

    CALM_TICKS = 5  # consecutive 3 ms looks at an idle loop before a round goes without everyone

    def __init__(self, n: int, busy=None) -> None:
        self.n = n
        # ``await busy()``: True while callers are doing work the loop cannot see as runnable (a
        # PostgreSQL statement in flight): the loop looks idle then, but a caller is on its way
        self.busy = busy
        self.waiting: dict[int, list[asyncio.Future]] = {}
        self.finished: set[int] = set()
        self.in_flight = 0
        self.commands = 0
        self.rounds = 0
        self.stalled = 0
        self.running = False

    # -- the callers' side
    async def hold(self) -> None:
        who = _caller.get()
        if who is None or not self.running:
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(who, []).append(fut)
        self.commands += 1
        self._check_all_in()
        try:
            await fut
        except asyncio.CancelledError:
            held = self.waiting.get(who, [])
            if fut in held:
                held.remove(fut)
                if not held:
                    del self.waiting[who]
            raise

    @contextlib.asynccontextmanager
    async def command(self):
        """One round trip: held until its round goes, then counted as in flight."""
        await self.hold()
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    # -- when a round goes
    def _check_all_in(self) -> None:
        if self.waiting and len(self.waiting) + len(self.finished) >= self.n:
            self.all_in(stalled=False)

    def all_in(self, stalled: bool) -> None:
        """Every caller that can move is held: here the round goes at once."""
        self.stalled += stalled
        self.release()

    def release(self) -> None:
        waiting, self.waiting = self.waiting, {}
        self.rounds += bool(waiting)
        for who in sorted(waiting):
            for fut in waiting[who]:
                if not fut.done():
                    fut.set_result(None)

    def _done(self, who: int) -> None:
        self.finished.add(who)
        self._check_all_in()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        calm = 0
        while self.running:
            await asyncio.sleep(0.003)
            idle = not getattr(loop, "_ready", None) and self.in_flight == 0
            if idle and self.waiting and self.busy is not None and await self.busy():
                idle = False
            calm = calm + 1 if idle and self.waiting else 0
            if calm >= self.CALM_TICKS:
                calm = 0
                self.all_in(stalled=True)

    async def run(self, calls: list) -> list:
        """``[make() for make in calls]`` awaited concurrently in lockstep; results and exceptions, in order."""
        session = REMOTE.get(id(asyncio.get_running_loop()))
        if session is not None:
            return await self._run_remote(session, calls)

        async def one(i: int, make):
            _caller.set(i)
            try:
                return await make()
            finally:
                self._done(i)

        self.running = True
        watcher = asyncio.ensure_future(self._watch())
        try:
            return await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)), return_exceptions=True)
        finally:
            self.running = False
            self.release()
            await watcher

    async def _run_remote(self, session, calls: list) -> list:
        """The lockstep where the callers' code runs in learner processes: their Redis proxies hold every
        command. A round goes once every running caller has a command held (a connection of its own each),
        as in one process; else once everything has settled (every process idle, nothing on the wire,
        nothing in flight at Redis) and stays so for ``CALM_TICKS`` looks: a caller waits on something
        else (a lock, a sleep), and ``stalled`` counts that round. (One look is not enough: a thread of
        the learner's that has read its reply and not yet sent its next command looks idle.)"""
        gates = lambda: [x.redis_gate for x in session.learners if x.alive]  # noqa: E731
        for gate in gates():
            gate.hold(True)
        tasks = [asyncio.ensure_future(make()) for make in calls]

        def holding() -> tuple[int, int]:
            return sum(len({h[0] for h in g.held}) for g in gates()), sum(len(g.held) for g in gates())

        try:
            calm, last = 0, None
            while True:
                running = [t for t in tasks if not t.done()]
                if not running:
                    break
                links, commands = holding()
                if links < len(running):
                    await session.settled(redis=True, busy=self.busy)
                    links, commands = holding()
                    running = [t for t in tasks if not t.done()]
                    if not running:
                        continue
                    if links < len(running):
                        calm = calm + 1 if (links, commands, len(running)) == last else 0
                        last = (links, commands, len(running))
                        if calm < self.CALM_TICKS:
                            await asyncio.wait(running, timeout=0.003, return_when=asyncio.FIRST_COMPLETED)
                            continue
                calm, last = 0, None
                if os.environ.get("COURSE_DEBUG_LOCKSTEP"):  # what each round holds, for a grader's developer
                    print(
                        "round",
                        self.rounds,
                        [[h[1][0] for h in g.held] for g in gates()],
                        links,
                        len(running),
                        file=sys.__stderr__,
                    )
                if links:
                    self.rounds += 1
                    self.commands += commands
                    self.stalled += links < len(running)
                    for gate in gates():
                        gate.release()
                else:
                    await asyncio.wait(running, timeout=0.005, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for gate in gates():
                gate.hold(False)
        return await asyncio.gather(*tasks, return_exceptions=True)


class RemoteGate(Gate):
    """One replica's part of a lockstep across processes: when its callers are all in (or stuck),
    it parks (``RPUSH {tag}:park``) and lets its round go only on the coordinator's word
    (``{tag}:go:{me}``)."""

    def __init__(self, n: int, ctl: aioredis.Redis, tag: str, me: int) -> None:
        super().__init__(n)
        self.ctl, self.tag, self.me = ctl, tag, me
        self.parked = False
        self._pending: set[asyncio.Future] = set()

    def _message(self, state: str) -> str:
        return json.dumps({"w": self.me, "state": state, "commands": self.commands, "stalled": self.stalled})

    def _say(self, state: str) -> None:
        fut = asyncio.ensure_future(self.ctl.rpush(f"{self.tag}:park", self._message(state)))
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)

    def all_in(self, stalled: bool) -> None:
        if self.parked:
            return
        self.parked = True
        self.stalled += stalled
        self._say("parked")

    async def _listen(self) -> None:
        while self.running:
            got = await self.ctl.blpop([f"{self.tag}:go:{self.me}"], timeout=1)
            if got is not None:
                self.parked = False
                self.release()

    async def run(self, calls: list) -> list:
        listener = asyncio.ensure_future(self._listen())
        try:
            return await super().run(calls)
        finally:
            listener.cancel()
            await asyncio.gather(listener, *self._pending, return_exceptions=True)
            await self.ctl.rpush(f"{self.tag}:park", self._message("done"))


async def coordinate(ctl: aioredis.Redis, tag: str, replicas: int, alive, timeout: float = 60.0) -> dict:
    """The grader's side of a lockstep across ``replicas`` processes: a round goes when every one
    has parked or is done. ``alive()`` says whether the processes still run. Returns how it went:
    ``{"rounds": ..., "commands": ..., "stalled": ...}`` (commands and stalled rounds of all replicas)."""
    state = ["running"] * replicas
    counts = [{"commands": 0, "stalled": 0} for _ in range(replicas)]
    rounds = 0
    deadline = time.monotonic() + timeout
    while any(s != "done" for s in state):
        got = await ctl.blpop([f"{tag}:park"], timeout=1)
        if got is None:
            if not alive():
                raise RuntimeError("a replica process exited in the middle of its requests")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas' requests did not finish within {timeout:g} s")
            continue
        msg = json.loads(got[1])
        state[msg["w"]] = msg["state"]
        counts[msg["w"]] = {"commands": msg["commands"], "stalled": msg["stalled"]}
        if all(s in ("parked", "done") for s in state) and "parked" in state:
            rounds += 1
            for i, s in enumerate(state):
                if s == "parked":
                    state[i] = "running"
                    await ctl.rpush(f"{tag}:go:{i}", "go")
    return {"rounds": rounds, **{k: sum(c[k] for c in counts) for k in ("commands", "stalled")}}


class _GatedPipeline(Pipeline):
    gate: Gate

    async def immediate_execute_command(self, *args, **options):
        async with self.gate.command():
            return await super().immediate_execute_command(*args, **options)

    async def execute(self, raise_on_error: bool = True):
        async with self.gate.command():
            return await super().execute(raise_on_error)


class GatedRedis(aioredis.Redis):
    """A ``redis.asyncio.Redis`` whose every round trip (command, pipeline, WATCH mode, script)
    passes through ``self.gate``."""

    gate: Gate

    async def execute_command(self, *args, **options):
        async with self.gate.command():
            return await super().execute_command(*args, **options)

    def pipeline(self, transaction: bool = True, shard_hint=None):
        pipe = _GatedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.gate = self.gate
        return pipe


def gated_redis(url: str, gate: Gate) -> GatedRedis:
    client = GatedRedis.from_url(url, decode_responses=True)
    client.gate = gate
    return client
