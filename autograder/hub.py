"""``course hub``: the class on JupyterHub, on one machine whose accounts are the class.

Run as root from the instructor's course directory (docs/INSTRUCTORS.md, "A class on
JupyterHub"):

    sudo .venv/bin/course hub --instructor teach

It checks and makes what the hub needs, one line each, then runs JupyterHub in the
foreground (Ctrl-C or SIGTERM stops it, the proxy and every learner's server):

- **the proxy**: ``configurable-http-proxy``, installed with apt-get (Debian's
  ``node-configurable-http-proxy``) or npm when it is missing and the command runs as root;
- **the exchange**: ``/srv/nbgrader/exchange``, made with mode 1777 when missing. Each learner
  is an account of their own, so collect's owner check (:mod:`autograder.collect`) holds:
  nobody hands in as somebody else;
- **login**: PAM, the machine's own accounts and passwords (``--auth firstuse`` or
  ``--auth native`` for the authenticators that keep their own passwords), allowed to the
  instructors and to the learners on the gradebook's roster, read again at every login;
- **each learner's server** runs as that learner's Unix account, with the course's Python
  (checked first: an account with no rights of its own must be able to run it), and owns one
  pair of embedded Redis and PostgreSQL (this module's ``singleuser``, as ``course lab`` does);
- **nbgrader**: learners get the Assignment List and neither formgrader nor "Create assignment"
  (the learner's Jupyter configuration of ``course lab``); the instructors (the hub's group
  ``instructors``, hub admins) get formgrader in a server started in the course directory;
- **the idle culler**: ``jupyterhub-idle-culler`` as a hub service stops a server idle for
  ``--cull-idle`` seconds (the learner's embedded servers stop with it).

The hub's own files (its database, cookie secret, proxy token, the configuration it runs) are
in ``--state`` (``/srv/resilient-course-hub``, mode 700). Nothing here imports the grader: the
instructor's formgrader grades through the course directory's nbgrader configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from autograder.settings import COURSE_ID, EXCHANGE

REPO = Path(__file__).resolve().parent.parent
#: ``course lab``'s learner configuration: formgrader, "Create assignment" and the news hidden.
LEARNER_CONFIG = REPO / "course" / "kit" / "jupyter" / "learner"
STATE = Path("/srv/resilient-course-hub")
GROUP = "instructors"
AUTHENTICATORS = {
    "pam": "jupyterhub.auth.PAMAuthenticator",
    "firstuse": "firstuseauthenticator.FirstUseAuthenticator",
    "native": "nativeauthenticator.NativeAuthenticator",
}
#: Debian's node-configurable-http-proxy keeps its modules where only Debian's node looks.
DEBIAN_NODE_MODULES = "/usr/share/nodejs"
#: what the learners' Python must import (checked as an account with no rights of its own)
NEEDS = "jupyterhub.singleuser, nbgrader, jupyterlab, course.kit.backends"


class HubError(RuntimeError):
    """What stops ``course hub`` before JupyterHub starts; the message says what to do."""


def say(text: str) -> None:
    print(f"course hub: {text}", flush=True)


# ----------------------------------------------------------------------------- the proxy


def _proxy_runs(command: str) -> tuple[str, dict[str, str]] | None:
    """(version, environment it needs) when ``command --version`` answers, else None."""
    for extra in ({}, {"NODE_PATH": DEBIAN_NODE_MODULES}):
        try:
            proc = subprocess.run(
                [command, "--version"], capture_output=True, text=True, timeout=30, env={**os.environ, **extra}
            )
        except OSError:
            return None
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip(), extra
    return None


def proxy(install: bool) -> tuple[str, str, dict[str, str]]:
    """(path, version, environment) of a configurable-http-proxy that runs; installed when missing."""
    found = shutil.which("configurable-http-proxy")
    if found and (runs := _proxy_runs(found)):
        return found, *runs
    if not install:
        raise HubError(
            "no configurable-http-proxy runs here: `sudo apt-get install node-configurable-http-proxy` "
            "(Debian, Ubuntu) or `sudo npm install -g configurable-http-proxy`, then run course hub again"
        )
    if shutil.which("apt-get"):
        say("installing configurable-http-proxy with apt-get (Debian's node-configurable-http-proxy)")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, capture_output=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "node-configurable-http-proxy"],
            env=env,
            check=False,
            capture_output=True,
        )
    found = shutil.which("configurable-http-proxy")
    if not (found and _proxy_runs(found)) and shutil.which("npm"):
        say("installing configurable-http-proxy with npm")
        subprocess.run(["npm", "install", "-g", "configurable-http-proxy"], check=False, capture_output=True)
        found = shutil.which("configurable-http-proxy")
    if found and (runs := _proxy_runs(found)):
        return found, *runs
    raise HubError(
        "configurable-http-proxy could not be installed (apt-get and npm both failed or are missing): "
        "install it by hand (`apt-get install node-configurable-http-proxy`), then run course hub again"
    )


# ----------------------------------------------------------------------------- the course


def roster(course: Path) -> list[str]:
    """The learners on the gradebook's roster (``nbgrader db student import``); [] without a gradebook."""
    db = course / "gradebook.db"
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            return sorted(row[0] for row in conn.execute("SELECT id FROM student"))
        except sqlite3.Error:
            return []


def _account(login: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(login)
    except KeyError:
        raise HubError(
            f"no account {login!r} on this machine: make it first (`sudo useradd -m -s /bin/bash {login}`)"
        ) from None


def check_course(course: Path, instructors: list[str]) -> None:
    """The course directory exists, is nbgrader's, and belongs to the (first) instructor."""
    if not (course / "nbgrader_config.py").is_file() or not (course / "solutions").is_dir():
        raise HubError(
            f"{course} is not the course directory (no nbgrader_config.py and solutions/ there): "
            "run course hub from your clone, or name it with --course"
        )
    owner = course.stat().st_uid
    if owner not in {_account(login).pw_uid for login in instructors}:
        raise HubError(
            f"{course} belongs to uid {owner}, not to an instructor ({', '.join(instructors)}): formgrader runs as "
            f"the instructor and writes the gradebook there; `sudo chown -R {instructors[0]}: {course}`"
        )


def learners_python(python: str) -> tuple[dict[str, str], list[str]]:
    """(environment the learners' servers need, warnings) for ``python``, checked as the account ``nobody``.

    A venv under a closed folder (``/root``) is not another account's to run: its interpreter is
    then the distribution's, with the venv's packages and the course on ``PYTHONPATH``, as long as
    those folders are open to others (tests/helpers.account_python does the same).
    """
    nobody = pwd.getpwnam("nobody")
    probe = f"import {NEEDS}, os, course; print(os.path.dirname(os.path.dirname(os.path.abspath(course.__file__))))"
    base = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    tries = [({}, python)]
    version = subprocess.run(
        [python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if site and version:
        tries.append(({"PYTHONPATH": os.pathsep.join([site, str(REPO)])}, f"/usr/bin/python{version}"))
    why = ""
    for extra, exe in tries:
        try:
            proc = subprocess.run(
                [exe, "-c", probe],
                env={**base, **extra},
                user=nobody.pw_uid,
                group=nobody.pw_gid,
                extra_groups=[],
                cwd="/",
                capture_output=True,
                text=True,
                timeout=120,
            )
        except OSError as err:
            why = why or f"{exe}: {err.strerror}"
            continue
        if proc.returncode == 0:
            warnings = []
            solutions = Path(proc.stdout.strip().splitlines()[-1]) / "solutions"
            if solutions.is_dir() and _open_to_nobody(solutions, nobody):
                warnings.append(
                    f"the learners' servers import the course from {solutions.parent}, whose solutions/ every account "
                    "can read: give the hub a Python installed from the hand-out (docs/INSTRUCTORS.md, "
                    "section 13, step 3) and pass it with --python"
                )
            return {"python": exe, **extra}, warnings
        why = why or (proc.stderr.strip().splitlines() or ["?"])[-1]
    raise HubError(
        f"an account other than root cannot run {python} with the course's packages ({why}): install the class's "
        "Python where every account can read it (docs/INSTRUCTORS.md, section 13, step 3) and pass "
        "it with --python"
    )


def instructors_python(login: str) -> dict[str, str]:
    """The Python of the instructors' servers: the one running ``course hub``, checked as ``login``.

    Formgrader grades with it: the grading sandbox shows the course's code from the folder this
    Python's install of the course points at, so it must be the course directory's own venv (or
    one installed from the same checkout), never the class's Python of the hand-out.
    """
    account = _account(login)
    proc = subprocess.run(
        [sys.executable, "-c", f"import {NEEDS}"],
        env={"PATH": "/usr/bin:/bin", "HOME": account.pw_dir, "LANG": "C.UTF-8"},
        user=account.pw_uid,
        group=account.pw_gid,
        extra_groups=[],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise HubError(
            f"{login} cannot run {sys.executable} with the hub's packages ({why}): run course hub with your course "
            "directory's venv, with the hub extra in it (`.venv/bin/pip install -c constraints.txt -e '.[hub]'`)"
        )
    return {"python": sys.executable}


def _open_to_nobody(path: Path, nobody: pwd.struct_passwd) -> bool:
    proc = subprocess.run(
        ["ls", str(path)], user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[], capture_output=True, cwd="/"
    )
    return proc.returncode == 0


def make_exchange(exchange: Path) -> str:
    if exchange.is_dir():
        mode = exchange.stat().st_mode & 0o7777
        if mode != 0o1777:
            raise HubError(
                f"the exchange {exchange} has mode {mode:o}: nbgrader needs 1777 (`sudo chmod 1777 {exchange}`)"
            )
        return f"the exchange: {exchange} (mode 1777)"
    exchange.mkdir(parents=True)
    exchange.chmod(0o1777)
    return f"the exchange: {exchange} (made, mode 1777)"


# ----------------------------------------------------------------------------- the configuration


def write_state(settings: dict) -> Path:
    """The hub's folders: ``hub/`` (mode 700: its configuration, database, cookie secret, proxy token)
    and ``jupyter/`` (read by every account's server: the exchange and the course's id)."""
    state = Path(settings["state"])
    private, public = state / "hub", state / "jupyter"
    for folder, mode in ((state, 0o755), (private, 0o700), (public, 0o755)):
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(mode)
    token = private / "proxy_auth_token"
    if not token.exists():
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
    shared = public / "nbgrader_config.py"
    shared.write_text(
        "# written by `course hub`: nbgrader in every account's server on this hub\n"
        "c = get_config()\n"
        f"c.Exchange.root = {settings['exchange']!r}\n"
        f"c.CourseDirectory.course_id = {COURSE_ID!r}\n"
    )
    shared.chmod(0o644)
    config = private / "jupyterhub_config.py"
    config.write_text(
        "# written by `course hub`; run it again to change this file\n"
        "import json\n"
        "from autograder import hub\n\n"
        f"hub.configure(get_config(), json.loads({json.dumps(json.dumps(settings, indent=1))}))\n"
    )
    config.chmod(0o600)
    return config


def roster_authenticator(base: type, settings: dict) -> type:
    """``base`` allowing the instructors and whoever the roster names at the moment they log in."""

    class RosterAuthenticator(base):
        def check_allowed(self, username, authentication=None):
            return username in settings["instructors"] or username in roster(Path(settings["course"]))

    RosterAuthenticator.__name__ = f"Roster{base.__name__}"
    return RosterAuthenticator


def configure(c, settings: dict) -> None:
    """Fill JupyterHub's config ``c`` from what :func:`main` checked (the hub's config file calls this)."""
    from importlib import import_module

    state = Path(settings["state"]) / "hub"
    c.JupyterHub.ip = settings["ip"]
    c.JupyterHub.port = settings["port"]
    c.JupyterHub.hub_port = settings["port"] + 1
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.ConfigurableHTTPProxy.command = [settings["proxy"]]
    c.ConfigurableHTTPProxy.auth_token = (state / "proxy_auth_token").read_text().strip()
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{settings['port'] + 2}"
    os.environ.update(settings["proxy_env"])  # the proxy inherits the hub's environment

    module, _, name = AUTHENTICATORS[settings["auth"]].rpartition(".")
    c.JupyterHub.authenticator_class = roster_authenticator(getattr(import_module(module), name), settings)
    c.Authenticator.admin_users = set(settings["instructors"])
    c.Authenticator.allowed_users = set(settings["instructors"]) | set(roster(Path(settings["course"])))
    c.Authenticator.any_allow_config = True
    if settings["auth"] == "native":
        c.NativeAuthenticator.open_signup = False  # a sign-up waits for an instructor's approval
    c.JupyterHub.load_groups = {GROUP: {"users": list(settings["instructors"])}}

    c.Spawner.cmd = [settings["python"]["python"], "-m", "autograder.hub", "singleuser"]  # each account's: below
    c.Spawner.default_url = "/lab"
    c.Spawner.start_timeout = 180  # a 2-core machine starting a lab and its servers for several learners at once
    c.Spawner.http_timeout = 180
    c.Spawner.pre_spawn_hook = lambda spawner: _per_account(spawner, settings)

    if settings["cull_idle"]:
        c.JupyterHub.services = [
            {
                "name": "idle-culler",
                "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={settings['cull_idle']}"],
            }
        ]
        c.JupyterHub.load_roles = [
            {
                "name": "idle-culler",
                "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
                "services": ["idle-culler"],
            }
        ]


def is_instructor(user, settings: dict) -> bool:
    return user.name in settings["instructors"] or any(g.name == GROUP for g in user.groups)


def _per_account(spawner, settings: dict) -> None:
    """An instructor's server starts in the course directory with formgrader and the Python that runs
    ``course hub`` (the course directory's, which formgrader grades with); a learner's in their home
    with the class's Python, without formgrader."""
    instructor = is_instructor(spawner.user, settings)
    python = settings["instructor_python"] if instructor else settings["python"]
    config_path = [str(Path(settings["state"]) / "jupyter")] + ([] if instructor else [str(LEARNER_CONFIG)])
    env = {
        "PATH": os.pathsep.join([str(Path(python["python"]).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "JUPYTER_CONFIG_PATH": os.pathsep.join(config_path),
        "LANG": "C.UTF-8",
        **{k: v for k, v in python.items() if k != "python"},
    }
    spawner.cmd = [python["python"], "-m", "autograder.hub", "singleuser"]
    spawner.environment = {**spawner.environment, **env}
    if instructor:
        spawner.notebook_dir = settings["course"]
        spawner.args = [f"--cd={settings['course']}"]
    else:
        spawner.notebook_dir = "~"
        spawner.args = []


# ----------------------------------------------------------------------------- one account's server

#: Kubernetes (deploy/z2jh/values.yaml): every pod's uid is made from its login, so that files in the
#: shared exchange tell learners apart as they do on one machine. The hub's extraConfig computes the
#: same number (tests/test_00_deploy.py holds the two together).
POD_UID_BASE, POD_UID_RANGE = 20000, 1_000_000


def pod_uid(login: str) -> int:
    import zlib

    return POD_UID_BASE + zlib.crc32(login.encode()) % POD_UID_RANGE


def pod_accounts(course: Path, passwd: Path = Path("/etc/passwd")) -> list[str]:
    """In the instructor's pod: name the roster's pod uids in ``passwd``, so that collect's owner
    check reads a folder's owner as the learner's login. Returns what it says (collisions included)."""
    lines = passwd.read_text().splitlines()
    known = {line.split(":")[0] for line in lines if line}
    taken = {int(line.split(":")[2]): line.split(":")[0] for line in lines if line.count(":") >= 2}
    said, added = [], []
    for login in roster(course):
        uid = pod_uid(login)
        if login in known:
            continue
        if uid in taken:
            said.append(f"{login} and {taken[uid]} share the pod uid {uid}: collect cannot tell them apart")
            continue
        taken[uid] = login
        added.append(f"{login}:x:{uid}:100::/home/jovyan:/usr/sbin/nologin")
    if added:
        passwd.write_text("\n".join([*lines, *added]) + "\n")
        said.append(f"{len(added)} learner(s) of the roster named in {passwd} (pod uids)")
    return said


def singleuser(argv: list[str]) -> int:
    """One account's server: its own embedded Redis and PostgreSQL, then ``jupyterhub-singleuser``.

    Like ``course lab``: the servers belong to this process and stop with it (the idle culler's
    stop, the hub's, a crash), and every kernel of the account uses them.
    """
    from course.kit import backends

    cd = None
    rest = []
    for arg in argv:
        if arg.startswith("--cd="):
            cd = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if cd and os.environ.get("COURSE_POD_ACCOUNTS") and os.access("/etc/passwd", os.W_OK):
        for line in pod_accounts(Path(cd)):
            print(f"course hub: {line}", file=sys.stderr, flush=True)
    srv = backends.servers()
    env = {**os.environ, **srv.as_env(), "COURSE_BACKEND": "env"}
    proc = subprocess.Popen([sys.executable, "-m", "jupyterhub.singleuser", *rest], env=env, cwd=cd)

    def stop(signum, frame):  # noqa: ARG001 - the server stops first; the databases at this process's exit
        proc.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return proc.wait()


# ----------------------------------------------------------------------------- course hub


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="course hub", description="the class on JupyterHub, on this machine")
    p.add_argument("--course", default=".", help="the course directory (your clone; default: here)")
    p.add_argument(
        "--instructor", action="append", help="an instructor's login (repeatable; default: the account that ran sudo)"
    )
    p.add_argument("--ip", default="", help="the address to listen on (default: every interface)")
    p.add_argument("--port", type=int, default=8000, help="the hub's port (it also uses the next two)")
    p.add_argument("--auth", choices=sorted(AUTHENTICATORS), default="pam", help="how learners log in (default: pam)")
    p.add_argument("--cull-idle", type=int, default=3600, metavar="SECONDS", help="stop idle servers (0: never)")
    p.add_argument("--python", default=sys.executable, help="the Python the learners' servers run")
    p.add_argument("--exchange", default=EXCHANGE, help=f"nbgrader's exchange (default {EXCHANGE})")
    p.add_argument("--state", default=str(STATE), help=f"the hub's own files (default {STATE})")
    p.add_argument("--no-start", action="store_true", help="check and write the configuration, do not start")
    return p.parse_args(argv)


def prepare(args: argparse.Namespace) -> Path:
    """Check and make everything; the configuration file JupyterHub runs."""
    if os.geteuid() != 0:
        raise HubError(
            "JupyterHub starts as root here: it checks the machine's passwords (PAM) and starts each learner's "
            "server as that learner's account; run `sudo .venv/bin/course hub ...`"
        )
    instructors = args.instructor or ([os.environ["SUDO_USER"]] if os.environ.get("SUDO_USER") else [])
    if not instructors or "root" in instructors:
        raise HubError("name the instructors' own accounts with --instructor LOGIN (not root)")
    for login in instructors:
        _account(login)
    course = Path(args.course).resolve()
    check_course(course, instructors)
    path, version, proxy_env = proxy(install=True)
    say(f"the proxy: {path} {version}")
    say(make_exchange(Path(args.exchange)))
    python, warnings = learners_python(args.python)
    say(f"the learners' Python: {python['python']} (an account with no rights of its own runs it)")
    instructor_python = instructors_python(instructors[0])
    say(f"the instructors' Python: {sys.executable} (the one running course hub: formgrader grades with it)")
    for warning in warnings:
        say(f"warning: {warning}")
    learners = roster(course)
    say(
        f"the course: {course}; login ({args.auth}) for the instructors ({', '.join(instructors)}: formgrader, hub admin) "
        + (
            f"and the {len(learners)} learner(s) on the gradebook's roster"
            if learners
            else "only: the gradebook holds no roster yet (`nbgrader db student import`, section 1); "
            "learners imported later can log in at once"
        )
    )
    say(f"idle servers stopped after {args.cull_idle} s" if args.cull_idle else "idle servers are never stopped")
    settings = {
        "course": str(course),
        "instructors": instructors,
        "ip": args.ip,
        "port": args.port,
        "auth": args.auth,
        "cull_idle": args.cull_idle,
        "python": python,
        "instructor_python": instructor_python,
        "proxy": path,
        "proxy_env": proxy_env,
        "exchange": str(Path(args.exchange).resolve()),
        "state": str(Path(args.state).resolve()),
    }
    config = write_state(settings)
    say(f"configuration: {config}")
    return config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["singleuser"]:
        return singleuser(argv[1:])
    args = parse(argv)
    try:
        config = prepare(args)
    except HubError as err:
        print(f"course hub: {err}", file=sys.stderr)
        return 2
    if args.no_start:
        say(f"not started (--no-start): `{sys.executable} -m jupyterhub -f {config}` starts it")
        return 0
    host = args.ip or "this machine's address"
    say(f"starting JupyterHub at http://{host}:{args.port}/ (Ctrl-C stops it and every server it started)")
    os.chdir(config.parent)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a shell's background job ignores SIGINT: JupyterHub must not
        signal.signal(sig, signal.SIG_DFL)
    os.execv(sys.executable, [sys.executable, "-m", "jupyterhub", "-f", str(config)])
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
