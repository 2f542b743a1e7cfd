"""The learner's answer in processes of its own, for checks that need replicas on other hosts (issue 40).

:class:`Workers` and :func:`in_fresh_process` are what :mod:`autograder.probes` gives a check
when its learner runs in another process (:mod:`autograder.session`): each worker is one more
sandboxed learner process that replays the job's cells, so the answer there is as fresh as on
another host, with its own clock skew or ``PYTHONHASHSEED``. Their Redis traffic goes through
the run's gateways like every learner process's, so one lockstep holds all of them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading

from autograder import wire

_indices = itertools.count(100)


def _outcome(value) -> dict:
    if isinstance(value, BaseException):
        return {"error": f"{type(value).__name__}: {value}"[:200]}
    if isinstance(value, (wire.Proxy, wire.BoundMethod)):
        return {"error": f"returned {value!r:.80}, which is not JSON-able"}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return {"error": f"returned {value!r:.80}, which is not JSON-able"}
    return {"ok": value}


class Workers:
    """The same API as :class:`autograder.probes.Workers`, over learner processes of the session."""

    def __init__(self, session, name: str, redis_url: str, skews: tuple[float, ...]) -> None:
        import redis.asyncio as aioredis

        self.session, self.name = session, name
        self.learners: list = [None] * len(skews)
        self.errors: list[str | None] = [None] * len(skews)
        self.clients = [aioredis.Redis.from_url(redis_url, decode_responses=True) for _ in skews]
        self._threads = [
            threading.Thread(target=self._start, args=(i, skew), daemon=True) for i, skew in enumerate(skews)
        ]
        for t in self._threads:  # they boot while the check goes on
            t.start()

    def _start(self, i: int, skew: float) -> None:
        try:
            self.learners[i] = self.session.learner(next(_indices), {"skew": skew})
        except Exception as err:  # noqa: BLE001 - reported by ready()
            self.errors[i] = f"a worker process did not start: {type(err).__name__}: {err}"[:200]

    async def ready(self, timeout: float = 60.0) -> str | None:
        for t in self._threads:
            await asyncio.to_thread(t.join, timeout)
        for i, learner in enumerate(self.learners):
            if self.errors[i]:
                return self.errors[i]
            if learner is None or not learner.alive:
                return "a worker process exited before it was ready"
            if not learner.root.has(self.name):
                return f"NameError: name '{self.name}' is not defined in a fresh process"
        return None

    def _fn(self, i: int):
        return self.learners[i].root.get(self.name)

    async def call(self, i: int, n: int, *args, **kwargs) -> list:
        fn = self._fn(i)
        got = await asyncio.gather(*(fn(self.clients[i], *args, **kwargs) for _ in range(n)), return_exceptions=True)
        return [_outcome(x) for x in got]

    async def call_in_lockstep(self, n: int, *args, **kwargs) -> tuple[list, dict]:
        from autograder.lockstep import Gate

        calls = []
        for i in range(len(self.learners)):
            fn = self._fn(i)
            calls += [lambda fn=fn, c=self.clients[i]: fn(c, *args, **kwargs) for _ in range(n)]
        gate = Gate(len(calls))
        got = await gate.run(calls)
        return [_outcome(x) for x in got], {"rounds": gate.rounds, "commands": gate.commands, "stalled": gate.stalled}

    async def close(self) -> None:
        for client in self.clients:
            try:
                await client.aclose()
            except Exception:  # noqa: BLE001, S110
                pass
        for learner in self.learners:
            if learner is not None:
                self.session.forget(learner)


def in_fresh_process(session, calls: list[tuple[str, list]], hashseed: int) -> list:
    """``[name(*args) ...]`` in a new learner process with another ``PYTHONHASHSEED``: ``[{"ok"} | {"error"}]``."""
    learner = session.learner(next(_indices), {"hashseed": hashseed})
    try:
        out = []
        for name, args in calls:
            try:
                out.append(_outcome(learner.root.get(name)(*args)))
            except Exception as err:  # noqa: BLE001 - the answer's error, as text
                out.append(_outcome(err))
        return out
    finally:
        session.forget(learner)
