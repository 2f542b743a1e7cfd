"""One grading run's learner processes, as the grader's process sees them (issue 40).

A :class:`Session` makes the run's privileges (:mod:`autograder.privileges`), the notebook's
namespace, and the gateways the sandbox reaches instead of the servers
(:mod:`autograder.gateways`); it starts learner processes (:mod:`autograder.learner`) in the
sandbox, runs cells in them, and gives the checks a :class:`RemoteNamespace`: the learner's
names, as proxies, in a mapping the harness reads like a notebook's globals.

Replicas are processes: :meth:`Session.replicas` gives copy *i* of a name from learner process
*i* (process 0 is the main one; the others replay the same cells), so state a replica keeps in
its process (a lock, a dict, a module global) is never shared with another.

The grader's objects a learner may use are listed in :data:`EXPOSED` (a virtual clock is
callable and has ``time`` and ``sleep``; nothing else of it); any other callable the checks pass
in can only be called.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from autograder import gateways, references, wire
from autograder.policy import GraderPolicy, _conninfo

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- one process


class Learner:
    """One sandboxed learner process, its gateways and its end of the wire."""

    def __init__(self, session: Session, index: int, env: dict[str, str] | None = None) -> None:
        self.session, self.index = session, index
        self.env = dict(env or {})  # hashseed=, skew=: fixed when the interpreter starts
        self.history: list[tuple[str, str, str]] = []  # cells run here, in order
        work = session.work / f"learner-{index}-{os.urandom(3).hex()}"
        work.mkdir()
        self.redis_gate = gateways.RedisGate(
            session.gateways,
            work / "redis.sock",
            session.redis_target,
            session.privileges.name,
            session.privileges.password,
            session.redis_dbs,
            session.namespace.redis_db,
        )
        self.pg_gate = gateways.PostgresGate(
            session.gateways, work / "pg", session.pg_port, session.pg_target, session.privileges.name
        )
        self.pg_gate.databases = session.databases
        from autograder import sandbox as sb

        nsdb = session.namespace
        servers = {
            "REDIS_URL": f"unix://{self.redis_gate.path}?db={nsdb.redis_db}",
            "DATABASE_URL": (
                f"postgresql://{session.privileges.name}:{session.privileges.password}@/{nsdb.name}"
                f"?host={work / 'pg'}&port={session.pg_port}"
            ),
        }
        self.box = sb.Sandbox(
            workdir=work,
            readonly=[Path(sys.base_prefix), Path(sys.prefix), REPO / "course", REPO / "autograder"],
            servers=servers,
            unsandboxed=session.unsandboxed,
            hidden=[REPO / "autograder" / "checks", REPO / "autograder" / "manifests"],
            overlays=session.stubs,
        )
        inside = self.box.env()
        db_url = urlsplit(inside["DATABASE_URL"])
        q = dict(parse_qsl(db_url.query))
        config = {
            "pg": f"host={q['host']} port={q['port']} user={session.privileges.name} password={session.privileges.password}",
            "redis": inside["REDIS_URL"].split("?")[0],
            "skew": (env or {}).get("skew", 0),
            "stubs": session.stub_specs,
            "preload": session.preload,
        }
        given = {
            "name": nsdb.name,
            "database_url": inside["DATABASE_URL"],
            "redis_url": inside["REDIS_URL"],
            "redis_db": nsdb.redis_db,
        }
        ours, theirs = socket.socketpair()
        extra = {
            "COURSE_LEARNER": json.dumps(config),
            "COURSE_NAMESPACE": json.dumps(given),
            "NBGRADER_EXECUTION": "autograde",
            "PYTHONHASHSEED": str((env or {}).get("hashseed", 0)),
            # this checkout's course/ and autograder/ (the ones shown in the sandbox), however the venv found them
            "PYTHONPATH": str(REPO),
        }
        self.proc = self.box.popen(
            [sys.executable, "-m", "autograder.learner", str(theirs.fileno())],
            env=extra,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.output: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.conn = wire.Conn(ours, object(), session.policy, name=f"grader-{index}")
        self.root = self.conn.root()
        self.root._meta = {"k": "obj", "t": ["autograder.learner", "Root"], "m": _ROOT_METHODS, "d": []}

    def _drain(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            self.output.append(raw.decode(errors="replace"))
            del self.output[:-50]

    @property
    def alive(self) -> bool:
        return self.conn.alive and self.proc.poll() is None

    def why_gone(self) -> str:
        code = self.proc.poll()
        reason = self.box.reason(code, "".join(self.output)) if code is not None else None
        return reason or self.conn.error or (f"exit code {code}" if code is not None else "stopped answering")

    def kill(self) -> None:
        self.conn.close()
        with contextlib.suppress(Exception):
            self.box.close()
        self.redis_gate.close()
        self.pg_gate.close()

    async def exec_cell(self, kind: str, cell_id: str, source: str, timeout: float) -> dict:
        result = await asyncio.wait_for(self.root.exec_cell(kind, cell_id, source), timeout)
        self.history.append((kind, cell_id, source))
        return result

    async def replay(self, cells: list[tuple[str, str, str]], timeout: float) -> None:
        """Run cells another process ran, quietly (their results were reported there)."""
        for kind, cell_id, source in cells:
            await self.exec_cell(kind, cell_id, source, timeout)


_ROOT_METHODS = {
    "exec_cell": True,
    "names": False,
    "has": False,
    "unfinished": False,
    "get": False,
    "replica": False,
    "set": False,
    "delete": False,
    "call_with": False,
    "fresh_namespace": False,
    "release": False,
    "collect": False,
    "seed_random": False,
    "restore_random": False,
    "loop_mark": False,
    "loop_fire": False,
    "loop_left_running": False,
}


# ----------------------------------------------------------------------------- the run


class Session:
    """A grading run's learners, privileges and gateways. Use as a context manager (it cleans up)."""

    def __init__(self, chapter: str, *, unsandboxed: bool = False, cell_timeout: float = 60.0) -> None:
        started = time.perf_counter()
        #: where a run's time goes (seconds): reported by the runner, read by benchmarks/run.py
        self.phases: dict[str, float] = {}
        self.chapter = chapter
        self.unsandboxed = unsandboxed
        self.cell_timeout = cell_timeout
        self.policy = GraderPolicy()
        self.work = Path(tempfile.mkdtemp(prefix="course-grade-"))
        self.history: list[tuple[str, str, str]] = []  # the job's cells run so far (a new process replays them)
        self._cycles: dict[tuple, asyncio.Future] = {}  # settling in progress, per loop (see settled)
        self.databases: set[str] = set()
        self.redis_dbs: set[int] = set()
        self.learners: list[Learner] = []
        self.ready: list[Learner] = []
        try:
            self._make(chapter)
        except BaseException:
            self._release()  # a run that could not start leaves nothing behind: no role, folder or thread
            raise
        self.phases["session in all"] = time.perf_counter() - started

    def _make(self, chapter: str) -> None:
        from autograder.privileges import RunPrivileges
        from course.kit import backends, lab

        srv = backends.servers()
        self.servers = srv
        mark = time.perf_counter()
        self.privileges = RunPrivileges(srv.database_url, srv.redis_url)
        self.phases["role and ACL user"] = time.perf_counter() - mark

        self.gateways = gateways.GatewayLoop()
        self.control = gateways.GatewayLoop()  # runs cells in learner processes, from any thread
        self.redis_target = _redis_target(srv.redis_url)
        self.pg_target, self.pg_port = _pg_target(srv.database_url)
        self.stubs, self.stub_specs = references.stubs(chapter, self.work / "stubs")
        self.policy.stubbed = frozenset(self.stub_specs)
        # the checks' own Redis clients go through a gate too (never held): as the run's ACL user, on the
        # run's databases, so one handed to learner code (a client that counts round trips) is no more
        self.check_gate = gateways.RedisGate(
            self.gateways,
            self.work / "checks-redis.sock",
            self.redis_target,
            self.privileges.name,
            self.privileges.password,
            self.redis_dbs,
            0,
        )
        self.policy.redis_gate = str(self.check_gate.path)
        self.policy.pg_role = self.privileges.name
        self._hook = self._grant
        lab.created_hooks.append(self._hook)
        self.lock = threading.Lock()
        #: the checks' scratch namespaces, each made ahead, between checks (see lab.Spares)
        self.spares = lab.spares = lab.Spares(f"scratch_{chapter[:2]}")
        # the run's namespace: its name and Redis database now, its database made while the learner
        # processes start (they connect only when the first cell runs: see wait_namespace)
        self.namespace = lab.reserve(f"grade_{chapter}")
        self._namespace_made = _in_thread(self._make_namespace)
        #: learner processes the chapter's checks use at once (``PROCESSES`` in its check modules): started
        #: together, each runs every cell, so a replica is ready when a check asks for it
        self.processes = max(1, int(references.declared(chapter, "PROCESSES", 1)))
        #: the ``import`` lines of the job's setup cells: each learner process runs them as it starts
        self.preload: list[str] = []
        #: the extra processes a task's check will ask for (``FRESH_PROCESSES`` in its check modules, by
        #: task: ``hashseed=``, ``skew=``, which a running interpreter cannot change), started once the
        #: setup cells ran when the job grades that task, so the check waits for the cells to be replayed
        #: there, not for an interpreter to start
        self.fresh_envs: dict[str, list[dict]] = {
            task: [dict(x) for x in envs] for task, envs in references.declared(chapter, "FRESH_PROCESSES", {}).items()
        }
        self.tasks: list[str] | None = None  # the job's tasks (start() is told): else the answer cell's

    # ---------------------------------------------------------------- namespaces

    def _make_namespace(self) -> None:
        from course.kit import lab

        mark = time.perf_counter()
        lab.make_database(self.namespace)
        self.phases["database and Redis namespace"] = time.perf_counter() - mark
        self.spares.begin()  # not before: two databases made at once would both come later

    def wait_namespace(self) -> None:
        """Until the run's database is made; its error (the servers') if it could not be."""
        self._namespace_made.result()

    def _grant(self, ns) -> None:
        """A namespace made in this process: the learner's role may use it, and the checks' own Redis
        clients of it connect as the run's ACL user (anything of theirs learner code reaches is that user's)."""
        self.privileges.grant(ns.name, ns.key_prefix)
        self.databases.add(ns.name)
        self.redis_dbs.add(ns.redis_db)
        ns.redis_url = f"unix://{self.check_gate.path}?db={ns.redis_db}"
        ns.learner_database_url = self.privileges.url(ns.name)

    # ---------------------------------------------------------------- learners

    def spawn(self, index: int, env: dict | None = None) -> Learner:
        """Start learner process ``index`` from the control thread, which lives as long as the run
        (bubblewrap ends its sandbox when the *thread* that started it ends)."""

        async def start() -> Learner:
            return Learner(self, index, env)

        learner = self.control.run(start(), 120)
        with self.lock:
            self.learners.append(learner)
        return learner

    def start(self, setup_sources: list[str] = (), tasks: list[str] | None = None) -> None:
        """Start every learner process the chapter uses (their interpreters start side by side, each
        importing what ``setup_sources``, the job's trusted setup cells, import); ``tasks``: the ones
        the job grades (whose extra processes start after the setup cells)."""
        self.preload = import_lines(setup_sources)
        self.tasks = tasks

        async def start_all() -> list[Learner]:
            return [Learner(self, i, None) for i in range(self.processes)]

        mark = time.perf_counter()
        made = self.control.run(start_all(), 120)
        self.phases["sandboxes started"] = time.perf_counter() - mark
        with self.lock:
            self.learners.extend(made)

    def _start_fresh(self, tasks: list[str]) -> None:
        """Start the processes of :attr:`fresh_envs` of ``tasks``, once: after the setup cells, whose
        imports would otherwise share the cores with theirs, so they start while the first checks run."""
        from autograder import processes

        envs = [env for task in tasks for env in self.fresh_envs.pop(task, [])]

        async def start_all() -> list[Learner]:
            return [Learner(self, next(processes._indices), env) for env in envs]  # noqa: SLF001

        if envs:
            made = self.control.run(start_all(), 120)
            with self.lock:
                self.ready.extend(made)

    def _catch_up(self, learner: Learner) -> Learner:
        missing = self.history[len(learner.history) :]
        if missing:
            limit = self.cell_timeout * len(missing) + 30
            self.control.run(learner.replay(missing, self.cell_timeout), limit)
        return learner

    def learner(self, index: int = 0, env: dict | None = None) -> Learner:
        """Learner process ``index``, alive and brought to where the run is (the cells so far replayed)."""
        for x in self.learners:
            if x.index == index and x.alive:
                return self._catch_up(x)
        with self.lock:
            started = next((x for x in self.ready if x.env == dict(env or {}) and x.alive), None)
            if started is not None:
                self.ready.remove(started)
                started.index = index
                self.learners.append(started)
        return self._catch_up(started or self.spawn(index, env))

    def main(self) -> Learner:
        return self.learner(0)

    def run_cell(self, kind: str, cell_id: str, source: str) -> dict:
        """Run a job's cell in every replica process, one after another (a setup cell's CREATE TABLE IF NOT
        EXISTS run by two processes at once can collide in PostgreSQL's catalog: one of them raises a
        UniqueViolation a notebook never meets); process 0's result is the cell's. A cell that overruns
        ends them (it is not replayed in the processes that start after)."""
        self.wait_namespace()
        if kind != "setup":
            self._start_fresh(self.tasks if self.tasks is not None else [cell_id])
        replicas = [self.learner(i) for i in range(self.processes)]

        async def everywhere() -> list:
            got = []
            for x in replicas:
                try:
                    got.append(await x.exec_cell(kind, cell_id, source, self.cell_timeout))
                except Exception as err:  # noqa: BLE001 - the caller sorts them out below
                    got.append(err)
                    if len(got) == 1:
                        break
            return got + [got[0]] * (len(replicas) - len(got))

        got = self.control.run(everywhere(), self.cell_timeout * len(replicas) + 5)
        if isinstance(got[0], BaseException):
            for x in replicas[1:]:
                self.forget(x)
            raise got[0]
        for x, result in zip(replicas[1:], got[1:], strict=True):
            if isinstance(result, BaseException):
                self.forget(x)  # started again, and brought up to date, when a check asks for it
        self.history.append((kind, cell_id, source))
        return got[0]

    def forget(self, learner: Learner) -> None:
        """End a learner process a check started for itself (a worker, a fresh replica)."""
        learner.kill()
        with self.lock:
            self.learners = [x for x in self.learners if x is not learner]

    def main_kill(self) -> str:
        """End learner process 0 (it overran or died); why it is gone."""
        why = "stopped answering"
        for x in self.learners:
            if x.index == 0:
                why = x.why_gone() if not x.alive else why
                x.kill()
        self.learners = [x for x in self.learners if x.index != 0]
        return why

    async def settled(self, local_idle=None, *, redis: bool = False, busy=None) -> None:
        """Until every learner process and this loop have nothing to run and nothing is on the wire.

        ``redis``: also until no learner command is in flight at Redis (a lockstep round). ``busy``:
        ``await busy()`` is True while something the loops cannot see is still working.
        """
        loop = asyncio.get_running_loop()
        key = (id(loop), redis, busy)
        cycle = self._cycles.get(key)
        if cycle is not None and not cycle.done():  # one settling at a time: thirty waiting loads ask together
            await asyncio.shield(cycle)
            return
        cycle = self._cycles[key] = loop.create_future()
        try:
            await self._settle(local_idle, redis, busy)
            cycle.set_result(None)
        except BaseException as err:
            cycle.set_exception(err)
            cycle.exception()  # retrieved: a waiter that was cancelled meanwhile must not leave it unread
            raise
        finally:
            if self._cycles.get(key) is cycle:
                del self._cycles[key]

    async def _settle(self, local_idle, redis: bool, busy) -> None:
        from course.kit.faults import _local_idle

        local_idle = local_idle or _local_idle
        while True:
            await local_idle()
            # A consistent look: a gateway that wrote nothing to its learner from before the ping until
            # after its own look cannot have woken a learner that said it was idle with nothing unread.
            written = [x.redis_gate.written for x in self.learners]
            conns = [x.conn for x in self.learners if x.conn.alive]
            pongs = await asyncio.gather(*(c.ping() for c in conns), return_exceptions=True)
            await local_idle()
            quiet = all(
                not isinstance(p, BaseException) and p.get("received") == c.sent and c.received == p.get("sent", -2) + 1
                for c, p in zip(conns, pongs, strict=True)
            )
            if (
                quiet
                and redis
                and (
                    any(x.redis_gate.in_flight() or not x.redis_gate.drained() for x in self.learners)
                    or written != [x.redis_gate.written for x in self.learners]
                )
            ):
                quiet = False
                await asyncio.sleep(0.001)
            if quiet and busy is not None and await busy():
                quiet = False
                await asyncio.sleep(0.002)
            if quiet:
                return

    def _release(self) -> None:
        """Drop what :meth:`_make` made, each part only if it was made (it may have failed half way):
        the databases before the role that may still use them, then the threads and the run's folder."""
        from course.kit import lab

        with contextlib.suppress(ValueError, AttributeError):
            lab.created_hooks.remove(self._hook)
        made = getattr(self, "_namespace_made", None)
        if made is not None:
            with contextlib.suppress(Exception):
                made.result()  # made (or failed) before it is dropped
        spares = getattr(self, "spares", None)
        if spares is not None:
            if lab.spares is spares:
                lab.spares = None
            spares.close()
        if getattr(self, "namespace", None) is not None:
            with contextlib.suppress(Exception):
                lab._forget(self.namespace)  # noqa: SLF001
        for name in ("gateways", "control"):
            loop = getattr(self, name, None)
            if loop is not None:
                loop.stop()
        if getattr(self, "privileges", None) is not None:
            self.privileges.drop()
        shutil.rmtree(self.work, ignore_errors=True)

    def close(self) -> None:
        for learner in self.learners + self.ready:
            learner.kill()
        self._release()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _in_thread(fn) -> Future:
    """``fn()`` on a thread of its own, as a future."""
    done: Future = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(err)

    threading.Thread(target=run, name="namespace", daemon=True).start()
    return done


def import_lines(sources) -> list[str]:
    """The top-level absolute ``import`` statements of ``sources`` (cells), each as one line of source."""
    lines: list[str] = []
    for source in sources:
        try:
            tree = ast.parse(re.sub(r"^(\s*)[%!].*$", r"\1pass", source, flags=re.MULTILINE))  # magics
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level):
                line = ast.unparse(node)
                if line not in lines:
                    lines.append(line)
    return lines


def _redis_target(url: str) -> tuple:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return ("unix", parts.path)
    return ("tcp", parts.hostname or "localhost", parts.port or 6379)


def _pg_target(url: str) -> tuple[tuple, int]:
    info = dict(_conninfo(url))
    host, port = info.get("host", "localhost"), int(info.get("port", 5432))
    if host.startswith("/"):
        return ("unix", f"{host}/.s.PGSQL.{port}"), port
    return ("tcp", info.get("hostaddr") or host, port), port


# ----------------------------------------------------------------------------- what checks see


class RemoteNamespace(Mapping):
    """The learner's globals in process 0, read through the wire; what :func:`harness.run_task` takes."""

    def __init__(self, session: Session, learner: Learner) -> None:
        self.session, self.learner = session, learner

    def __getitem__(self, name: str):
        if not self.learner.root.has(name):
            raise KeyError(name)
        return self.learner.root.get(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.learner.root.has(name)

    def __iter__(self):
        return iter(self.learner.root.names())

    def __len__(self) -> int:
        return len(self.learner.root.names())

    def __setitem__(self, name: str, value) -> None:
        self.learner.root.set(name, value)

    def pop(self, name: str, default=None):
        found = self.get(name, default)
        self.learner.root.delete(name)
        return found

    def unfinished(self, names) -> bool:
        """Is every one of ``names`` still the function handed out? (Asked of the learner's process.)"""
        return bool(self.learner.root.unfinished(list(names)))

    def call_seeing_args(self, name: str, *args) -> tuple:
        """``name(*args)`` in the learner's process, and its arguments as it left them."""
        result, after = self.learner.root.call_seeing_args(name, list(args))
        return result, list(after)

    def call_with(self, name: str, names: dict, modules: dict, calls: list) -> list:
        """See :meth:`autograder.learner.Root.call_with`: a replica run with some globals set, then called."""
        return self.learner.root.call_with(name, names, modules, calls)

    def bind(self, loop: asyncio.AbstractEventLoop):
        """While a check runs on ``loop``: virtual time waits for the learner processes too."""
        from course.kit import faults

        session = self.session

        async def settle(local_idle) -> None:
            await session.settled(local_idle)

        from autograder import lockstep

        faults.settle_beyond(loop, settle)
        lockstep.REMOTE[id(loop)] = session
        wire.home_loop.set(loop)  # objects a check hands over from a worker thread belong to its loop
        stack = contextlib.ExitStack()
        stack.callback(faults.settle_beyond, loop, None)
        stack.callback(lockstep.REMOTE.pop, id(loop), None)
        return stack

    def replicas(self, name: str, n: int) -> list:
        """Copy ``i`` of ``name`` from learner process ``i`` (a fresh copy of its defining cell)."""
        out = []
        for i in range(n):
            learner = self.learner if i == 0 else self.session.learner(i)
            out.append(learner.root.replica(name))
        return out

    def workers(self, name: str, redis_url: str, skews: tuple[float, ...]):
        from autograder import processes

        return processes.Workers(self.session, name, redis_url, skews)

    @contextlib.contextmanager
    def fresh(self, **env):
        """A namespace of a new learner process (``hashseed=``, ``skew=``), ended when the block is."""
        from autograder import processes

        learner = self.session.learner(next(processes._indices), env)  # noqa: SLF001
        try:
            yield RemoteNamespace(self.session, learner)
        finally:
            self.session.forget(learner)

    def fresh_process(self, calls: list, hashseed: int) -> list:
        from autograder import processes

        return processes.in_fresh_process(self.session, calls, hashseed)

    def after_task(self) -> None:
        for learner in self.session.learners:
            if learner.alive:
                with contextlib.suppress(Exception):
                    learner.root.collect()
                    learner.root.release()
                learner.conn.release_all()


def grade_source(task_id: str, source: str, *, sandbox: bool = False):
    """Grade one answer cell's ``source`` for ``task_id`` across the boundary, as grading does (the
    tests hold every kept answer to this and to the in-process harness)."""
    from autograder import harness

    task = harness.get_task(task_id)
    with Session(task.chapter, unsandboxed=not sandbox) as session:
        got = session.run_cell("answer", task_id, source)
        if not got.get("ok") and "NotImplementedError" not in str(got.get("error")):
            pass  # the checks say what is missing, as in grading
        namespace = RemoteNamespace(session, session.main())
        session.spares.ahead = False  # one check: no namespace made after its own
        result = harness.run_task(task, namespace)
        namespace.after_task()
        return result
