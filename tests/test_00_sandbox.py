"""autograder.sandbox: learner code sees its own folder and the course's servers, nothing else, within bounds.

Each probe is what a dishonest or broken submission would run, started through
``Sandbox.popen([sys.executable, "-c", PROBE])`` as the grader starts its runner.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from autograder import sandbox
from autograder.sandbox import Limits, Sandbox, SandboxUnavailable

REPO = Path(__file__).resolve().parents[1]
READONLY = [Path(sys.base_prefix), Path(sys.prefix), REPO / "course", REPO / "autograder"]
OK, WHY = sandbox.available()
needs_bwrap = pytest.mark.skipif(not OK, reason=f"{WHY}: tests/setup_sandbox.sh installs bubblewrap as root")


@pytest.fixture
def classroom(tmp_path):
    """An instructor's course folder: alice's submission (the workdir), bob's, a gradebook."""
    for learner in ("alice", "bob"):
        (tmp_path / "submitted" / learner / "03").mkdir(parents=True)
        (tmp_path / "submitted" / learner / "03" / "03.ipynb").write_text(f"{learner}'s notebook")
    (tmp_path / "gradebook.db").write_text("grades")
    return tmp_path


def run(probe: str, workdir: Path, *args: str, limits: Limits | None = None, servers=None, **popen):
    """Run a probe in a fresh sandbox: (return code, stdout, stderr, reason)."""
    with Sandbox(workdir=workdir, readonly=READONLY, servers=servers or {}, limits=limits) as box:
        proc = box.popen([sys.executable, "-c", probe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
        out, err = proc.communicate(timeout=60)
        return proc.returncode, out.decode(), err.decode(), box.reason(proc.returncode, err)


ATTEMPTS = textwrap.dedent(
    """
    import json, os, sys
    def attempt(fn):
        try:
            return fn()
        except OSError as err:
            return "refused: " + type(err).__name__
    repo, home, classroom, solution = sys.argv[1:5]
    print(json.dumps({
        "repo": sorted(os.listdir(repo)),
        "solutions": attempt(lambda: open(solution).read()[:20]),
        "gradebook": attempt(lambda: open(classroom + "/gradebook.db", "w").write("0 for everyone")),
        "new gradebook": attempt(lambda: open(classroom + "/gradebook-copy.db", "w").write("x")),
        "bob": attempt(lambda: open(classroom + "/submitted/bob/03/03.ipynb", "w").write("cheated")),
        "home": attempt(lambda: sorted(os.listdir(home))),
        "home file": attempt(lambda: open(home + "/" + sys.argv[5]).read()[:20]),
        "own notebook": attempt(lambda: open("03.ipynb", "a").write(" and an edit")),
        "sysctl": attempt(lambda: open("/proc/sys/kernel/core_pattern", "w").write("|/tmp/x")),
        "root": sorted(os.listdir("/")),
    }))
    """
)


@needs_bwrap
def test_learner_code_sees_only_its_folder_and_the_course_code(classroom):
    home = Path.home()
    alice = classroom / "submitted" / "alice" / "03"
    solution = next(REPO.glob("solutions/*/*.ipynb"))
    home_file = next((p.name for p in home.iterdir() if p.is_file() and os.access(p, os.R_OK)), "no-such-file")
    code, out, err, _ = run(ATTEMPTS, alice, str(REPO), str(home), str(classroom), str(solution), home_file)
    assert code == 0, err
    seen = json.loads(out)
    # the repository root holds only what the course code needs (and the venv, when it lives there)
    needed = {p.relative_to(REPO).parts[0] for p in READONLY if p.is_relative_to(REPO)}
    assert set(seen["repo"]) == needed, seen["repo"]
    for target in ("solutions", "gradebook", "new gradebook", "bob", "sysctl", "home file"):
        assert str(seen[target]).startswith("refused"), (target, seen[target])
    assert (classroom / "gradebook.db").read_text() == "grades"
    assert not (classroom / "gradebook-copy.db").exists()
    assert (classroom / "submitted" / "bob" / "03" / "03.ipynb").read_text() == "bob's notebook"
    # the home folder shows only the way to the Python installation bound inside it, if any
    on_the_way = {p.relative_to(home).parts[0] for p in READONLY if p.is_relative_to(home)}
    assert str(seen["home"]).startswith("refused") or set(seen["home"]) <= on_the_way, seen["home"]
    assert seen["own notebook"] == len(" and an edit")
    assert (alice / "03.ipynb").read_text() == "alice's notebook and an edit"
    assert set(seen["root"]) <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "run",
        "sbin",
        "tmp",
        "usr",
    } | {p.parts[1] for p in READONLY + [alice]}


NETWORK = textwrap.dedent(
    """
    import json, socket, sys
    def attempt(address):
        try:
            socket.create_connection(address, timeout=2).close()
            return "connected"
        except OSError as err:
            return "refused: " + type(err).__name__
    inside = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({
        "host port": attempt(("127.0.0.1", int(sys.argv[1]))),
        "outside": attempt(("1.1.1.1", 53)),
        "dns": attempt(("example.com", 80)),
        "own loopback": attempt(inside.getsockname()),
    }))
    """
)


@needs_bwrap
def test_no_network_but_its_own_loopback(tmp_path):
    host = socket.create_server(("127.0.0.1", 0))
    host.setblocking(False)
    code, out, err, _ = run(NETWORK, tmp_path, str(host.getsockname()[1]))
    assert code == 0, err
    seen = json.loads(out)
    assert seen["own loopback"] == "connected", seen
    assert all(seen[k].startswith("refused") for k in ("host port", "outside", "dns")), seen
    with pytest.raises(BlockingIOError):
        host.accept()  # nothing from the sandbox ever reached the host's port
    host.close()


HONEST = textwrap.dedent(
    """
    import os, sys
    import course, autograder, psycopg, redis
    from course.kit import backends
    r = redis.Redis.from_url(os.environ["REDIS_URL"])
    r.set("sandbox-probe", "seen")
    with psycopg.connect(os.environ["DATABASE_URL"]) as conn:
        one = conn.execute("select 1").fetchone()[0]
    print("redis", r.get("sandbox-probe").decode(), "postgres", one, "backend", backends.choose()[0])
    print(os.environ["REDIS_URL"], os.environ["DATABASE_URL"])
    os.write(int(sys.argv[1]), b"result through the pipe")
    """
)


@pytest.fixture
def gateways_env(tmp_path):
    """The servers as a grading run shows them to the sandbox: its gateways, as the run's role and ACL user
    (the servers' own sockets belong to their account and admit no sandboxed program)."""
    from autograder import gateways, privileges
    from autograder.session import _pg_target, _redis_target
    from course.kit import backends, lab

    srv = backends.servers()
    priv = privileges.RunPrivileges(srv.database_url, srv.redis_url)
    ns = lab.create("sandbox")
    priv.grant(ns.name, ns.key_prefix)
    loop = gateways.GatewayLoop()
    target, port = _pg_target(srv.database_url)
    pg = gateways.PostgresGate(loop, tmp_path / "pg", port, target, priv.name)
    pg.allow(ns.name)
    rd = gateways.RedisGate(
        loop, tmp_path / "r.sock", _redis_target(srv.redis_url), priv.name, priv.password, {ns.redis_db}, ns.redis_db
    )
    yield {
        "REDIS_URL": f"unix://{tmp_path / 'r.sock'}?db={ns.redis_db}",
        "DATABASE_URL": f"postgresql://{priv.name}:{priv.password}@/{ns.name}?host={tmp_path / 'pg'}&port={port}",
    }
    pg.close()
    rd.close()
    loop.stop()
    lab._forget(ns)  # noqa: SLF001
    priv.drop()


@needs_bwrap
def test_an_honest_program_reaches_the_servers_and_its_pipe(tmp_path, gateways_env):
    work = tmp_path / "work"
    work.mkdir()
    read, write = os.pipe()
    try:
        code, out, err, reason = run(HONEST, work, str(write), servers=gateways_env, pass_fds=[write])
        os.close(write)
        write = -1
        piped = os.read(read, 100)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    assert code == 0 and reason is None, err
    first, urls = out.splitlines()
    assert first == "redis seen postgres 1 backend env"
    assert all(u.startswith(("unix:///run/course/", "postgresql://")) and "/run/course/" in u for u in urls.split())
    assert piped == b"result through the pipe"


BRIDGED = textwrap.dedent(
    """
    import os, socket
    from urllib.parse import parse_qs, urlsplit
    import redis
    r = redis.Redis.from_url(os.environ["REDIS_URL"])
    r.set("k", "through the bridge")
    q = parse_qs(urlsplit(os.environ["DATABASE_URL"]).query)
    echo = socket.socket(socket.AF_UNIX)
    echo.connect(f"{q['host'][0]}/.s.PGSQL.{q['port'][0]}")
    echo.sendall(b"ping")
    print(r.get("k").decode(), echo.recv(4).decode(), os.environ["DATABASE_URL"])
    """
)


def _echo_server() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1024):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server


@needs_bwrap
def test_tcp_servers_are_bridged_and_the_bridge_stops(tmp_path):
    from course.kit import backends

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    redis_server = subprocess.Popen(
        [
            backends.redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    echo = _echo_server()
    try:
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)
        servers = {
            "REDIS_URL": f"redis://127.0.0.1:{port}/3",
            "DATABASE_URL": f"postgresql://learner:secret@127.0.0.1:{echo.getsockname()[1]}/course?sslmode=disable",
        }
        box = Sandbox(workdir=tmp_path, readonly=READONLY, servers=servers)
        with box:
            proc = box.popen([sys.executable, "-c", BRIDGED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        pg_port = echo.getsockname()[1]
        assert out.split() == [
            "through",
            "the",
            "bridge",
            "ping",
            f"postgresql://learner:secret@/course?sslmode=disable&host=/run/course/database&port={pg_port}",
        ]
        assert redis.Redis(port=port, db=3).get("k") == b"through the bridge"
        assert not any(t.name.startswith("sandbox-bridge") for t in threading.enumerate())
        assert not box._tmp.exists()
    finally:
        echo.close()
        redis_server.kill()
        redis_server.wait()


@needs_bwrap
def test_a_memory_hog_fails_its_run_with_one_line(tmp_path):
    code, _, err, reason = run(
        "b = []\nwhile True: b.append(bytearray(8 << 20))", tmp_path, limits=Limits(memory_mb=200)
    )
    assert code != 0
    assert reason == "the sandbox's memory limit (200 MB) was reached", err[-500:]


FORK_BOMB = textwrap.dedent(
    """
    import os, sys, time
    n = 0
    try:
        while n < 1000:
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
            n += 1
    except OSError as err:
        print(n, flush=True)
        sys.stdin.readline()
        raise
    """
)


def _left(marker: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]


@needs_bwrap
def test_a_fork_bomb_is_bounded_the_host_still_forks_and_nothing_is_left(tmp_path):
    marker = f"bomb-{uuid.uuid4().hex}"
    with Sandbox(workdir=tmp_path, readonly=READONLY, limits=Limits(processes=30)) as box:
        io = {k: subprocess.PIPE for k in ("stdin", "stdout", "stderr")}
        proc = box.popen([sys.executable, "-c", FORK_BOMB, marker], text=True, **io)
        forked = int(proc.stdout.readline())
        assert 10 <= forked <= 30
        assert len(_left(marker)) >= forked + 1  # all there, sleeping, while the host goes on forking:
        assert all(subprocess.run(["true"]).returncode == 0 for _ in range(5))
        _, err = proc.communicate("go on\n", timeout=30)
        assert box.reason(proc.returncode, err) == "the sandbox's process limit (30 processes) was reached"
    deadline = time.monotonic() + 5
    while _left(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _left(marker)


GRADER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from autograder.sandbox import Sandbox
    box = Sandbox(workdir=Path(sys.argv[1]), readonly=[Path(sys.base_prefix), Path(sys.prefix)])
    box.popen([sys.executable, "-c", "import os, time\\nfor _ in range(3): os.fork()\\ntime.sleep(60)", sys.argv[2]])
    print(box._tmp, *(box._cgroups.dirs.values() if box._cgroups else ()), flush=True)
    time.sleep(60)
    """
)


@needs_bwrap
def test_a_grader_killed_outright_takes_its_sandbox_along(tmp_path):
    marker = f"orphan-{uuid.uuid4().hex}"
    grader = subprocess.Popen([sys.executable, "-c", GRADER, str(tmp_path), marker], stdout=subprocess.PIPE, text=True)
    left_behind = [Path(d) for d in grader.stdout.readline().split()]  # its temporary folder and cgroups
    deadline = time.monotonic() + 10
    while len(_left(marker)) < 8 and time.monotonic() < deadline:  # the program and its 7 children
        time.sleep(0.05)
    assert len(_left(marker)) >= 8
    grader.kill()
    grader.wait()
    deadline = time.monotonic() + 5
    while _left(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _left(marker)
    # What the dead grader left (its folder, its cgroups) is removed by the next sandbox that starts:
    # this one, or one that another test worker started meanwhile, so only its absence is asserted.
    with Sandbox(workdir=tmp_path):
        assert not any(d.exists() for d in left_behind)


@needs_bwrap
def test_an_endless_loop_is_stopped_by_cpu_time_and_a_sleeper_by_the_clock(tmp_path):
    code, _, _, reason = run("while True: pass", tmp_path, limits=Limits(cpu_seconds=1))
    assert code != 0 and reason == "the sandbox's CPU time limit (1 s of CPU) was reached"
    started = time.monotonic()
    code, _, _, reason = run("import time; time.sleep(60)", tmp_path, limits=Limits(wall_seconds=1))
    assert code != 0 and reason == "killed after 1 s (the sandbox's time limit)"
    assert time.monotonic() - started < 10


FILES = textwrap.dedent(
    """
    import json
    out = {}
    try:
        open("big", "wb").write(b"x" * (2 << 20))
    except OSError as err:
        out["big"] = err.strerror
    try:
        files = [open("/dev/null") for _ in range(100)]
    except OSError as err:
        out["many"] = err.strerror
    print(json.dumps(out))
    """
)


@needs_bwrap
def test_file_size_and_open_files_are_bounded(tmp_path):
    code, out, err, _ = run(FILES, tmp_path, limits=Limits(file_mb=1, open_files=64))
    assert code == 0, err
    assert json.loads(out) == {"big": "File too large", "many": "Too many open files"}
    assert (tmp_path / "big").stat().st_size <= 1 << 20


def test_urls_are_rewritten_to_sockets_inside():
    r = sandbox._route("REDIS_URL", "redis://:pw@cache.example:6380/5")
    assert (r.url, r.tcp) == ("unix://:pw@/run/course/redis.sock?db=5", ("cache.example", 6380))
    r = sandbox._route("REDIS_URL", "unix:///tmp/run/redis.sock?db=0")
    assert (r.url, r.socket) == ("unix:///run/course/redis.sock?db=0", Path("/tmp/run/redis.sock"))
    r = sandbox._route("DATABASE_URL", "postgresql://postgres:@/postgres?host=/tmp/run/pg")
    assert r.url == "postgresql://postgres:@/postgres?host=/run/course/database&port=5432"
    assert r.socket == Path("/tmp/run/pg/.s.PGSQL.5432") and r.inside == Path("/run/course/database/.s.PGSQL.5432")
    r = sandbox._route("DATABASE_URL", "postgresql://u:p@[::1]:5433/db")
    assert (r.url, r.tcp) == ("postgresql://u:p@/db?host=/run/course/database&port=5433", ("::1", 5433))
    with pytest.raises(sandbox.SandboxError, match="rediss"):
        sandbox._route("REDIS_URL", "rediss://cache.example:6380/0")


def test_without_bubblewrap_grading_stops_unless_asked_to_go_unsandboxed(tmp_path, monkeypatch):
    assert sandbox._probe(None) == (False, "bubblewrap (bwrap) is not installed on this machine")
    ok, why = sandbox._probe(shutil.which("false"))
    assert not ok and why.startswith("bubblewrap") and "cannot create a sandbox here" in why
    monkeypatch.setattr(sandbox, "available", lambda: (False, "bubblewrap (bwrap) is not installed on this machine"))
    with pytest.raises(SandboxUnavailable) as raised:
        Sandbox(workdir=tmp_path, readonly=READONLY)
    assert "apt-get install bubblewrap" in str(raised.value) and "unsandboxed" in str(raised.value)
    with Sandbox(workdir=tmp_path, readonly=READONLY, limits=Limits(open_files=77), unsandboxed=True) as box:
        assert "WITHOUT a sandbox" in box.warning
        probe = "import os, resource; print(os.getcwd(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], os.getsid(0) == os.getpid())"
        proc = box.popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
        assert proc.communicate(timeout=30)[0].split() == [str(tmp_path.resolve()), "77", "True"]


OLD_BWRAP = """#!/bin/sh
# bubblewrap before 0.7: no --size
case " $* " in *" --help "*) echo "usage: bwrap [OPTIONS...] [--] COMMAND [ARGS...]"; exit 0;; *" --size "*) echo "bwrap: Unknown option --size" >&2; exit 1;; esac
exec {bwrap} "$@"
"""


@needs_bwrap
def test_an_older_bubblewrap_without_tmpfs_sizes_still_sandboxes(tmp_path, monkeypatch):
    old = tmp_path / "bwrap"
    old.write_text(OLD_BWRAP.format(bwrap=sandbox._find_bwrap()))
    old.chmod(0o755)
    assert sandbox._probe(str(old))[0] and not sandbox._sizes(str(old))
    monkeypatch.setattr(sandbox, "_find_bwrap", lambda: str(old))
    with Sandbox(workdir=tmp_path) as box:  # a setup failure is named without the host's paths
        proc = box.popen(["python3"], cwd=Path("/nonexistent"), stderr=subprocess.PIPE)
        assert "could not start" in box.reason(proc.wait(), proc.stderr.read())
    code, out, err, _ = run("print(open('/tmp/scratch', 'w').write('its own /tmp'))", tmp_path)
    assert code == 0 and out.strip() == "12", err


# ----------------------------------------------------------------------------- an unprivileged instructor

DRIVER = textwrap.dedent(
    """
    import json, os, socket, subprocess, sys, threading, time
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import sandbox as sbx
    out = {"uid": os.getuid(), "available": sbx.available()}
    work = os.path.join(here, "work")
    echo = socket.create_server(("127.0.0.1", 0))
    def serve():
        conn, _ = echo.accept()
        conn.sendall(conn.recv(4))
    threading.Thread(target=serve, daemon=True).start()
    servers = {"DATABASE_URL": f"postgresql://u@127.0.0.1:{echo.getsockname()[1]}/db"}
    def run(code, marker="", **limits):
        with sbx.Sandbox(workdir=work, servers=servers, limits=sbx.Limits(**limits)) as box:
            out["enforcement"] = box.enforcement
            p = box.popen([sys.executable, "-c", code, marker], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            o, e = p.communicate(timeout=60)
            return {"code": p.returncode, "out": o, "err": e[-800:], "reason": box.reason(p.returncode, e)}
    out["isolation"] = run(sys.argv[1])
    out["memory"] = run("b = []\\nwhile True: b.append(bytearray(8 << 20))", memory_mb=200)
    out["bomb"] = run(sys.argv[2], sys.argv[3], processes=20)
    time.sleep(0.2)
    def cmdline(pid):
        try:
            return open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            return b""
    mine = str(os.getpid())
    out["left"] = [p for p in os.listdir("/proc") if p.isdigit() and p != mine and sys.argv[3].encode() in cmdline(p)]
    print(json.dumps(out))
    """
)

USER_PROBE = textwrap.dedent(
    """
    import json, os, socket
    from urllib.parse import parse_qs, urlsplit
    def attempt(fn):
        try:
            return "ok: " + repr(fn())
        except OSError as err:
            return "refused: " + type(err).__name__
    q = parse_qs(urlsplit(os.environ["DATABASE_URL"]).query)
    def bridge():
        s = socket.socket(socket.AF_UNIX)
        s.connect(f"{q['host'][0]}/.s.PGSQL.{q['port'][0]}")
        s.sendall(b"ping")
        return s.recv(4).decode()
    print(json.dumps({
        "secret": attempt(lambda: open(os.path.dirname(os.getcwd()) + "/secret.txt").read()),
        "bridge": attempt(bridge),
        "outside": attempt(lambda: socket.create_connection(("1.1.1.1", 53), timeout=2)),
        "root": sorted(os.listdir("/")),
        "write": attempt(lambda: open("answer.txt", "w").write("42")),
    }))
    """
)

USER_BOMB = FORK_BOMB.replace("sys.stdin.readline()", "pass")  # no one to wait for


def _unprivileged_account() -> tuple[int, int, str]:
    """probeuser where it exists, else nobody: (uid, gid, name)."""
    for name in ("probeuser", "nobody"):
        try:
            entry = pwd.getpwnam(name)
            return entry.pw_uid, entry.pw_gid, name
        except KeyError:
            continue
    pytest.skip("no unprivileged account (probeuser or nobody) to run the sandbox as")


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the other tests run this path")
@pytest.mark.skipif(not shutil.which("setpriv"), reason="setpriv (util-linux) is needed to drop to another user")
@pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="a system /usr/bin/python3 is needed")
def test_as_an_unprivileged_instructor_rlimits_bound_the_same_probes():
    uid, gid, name = _unprivileged_account()
    here = Path("/tmp") / f"course-sandbox-user-{uuid.uuid4().hex[:8]}"
    here.mkdir(mode=0o755)
    try:
        shutil.copy(REPO / "autograder" / "sandbox.py", here / "sandbox.py")
        (here / "driver.py").write_text(DRIVER)
        (here / "secret.txt").write_text("the instructor's solutions")
        (here / "work").mkdir()
        for path in (here / "work", here / "secret.txt"):
            os.chown(path, uid, gid)
        marker = f"bomb-{uuid.uuid4().hex}"
        argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all"]
        done = subprocess.run(
            [*argv, "/usr/bin/python3", str(here / "driver.py"), USER_PROBE, USER_BOMB, marker],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/tmp",
            env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout)
    finally:
        shutil.rmtree(here, ignore_errors=True)
    assert seen["uid"] == uid and seen["available"][0], (name, seen)
    assert "cgroup" not in seen["enforcement"] and "processes" in seen["enforcement"], seen["enforcement"]
    iso = json.loads(seen["isolation"]["out"])
    assert iso["secret"].startswith("refused") and iso["outside"].startswith("refused"), iso
    assert iso["bridge"] == "ok: 'ping'" and iso["write"] == "ok: 2", iso
    assert seen["memory"]["code"] != 0 and seen["memory"]["reason"] == "the sandbox's memory limit (200 MB) was reached"
    assert 1 <= int(seen["bomb"]["out"] or 0) <= 20, seen["bomb"]  # other runs as this user count too
    assert seen["bomb"]["reason"] == "the sandbox's process limit (20 processes) was reached", seen["bomb"]
    assert seen["left"] == []
