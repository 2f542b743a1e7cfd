#!/usr/bin/env bash
# The single-user image's build steps (deploy/image/Dockerfile runs this), runnable on any Debian 12
# machine: bash deploy/image/build.sh DIR, where DIR holds the hand-out (git archive without solutions/).
#   - refuses a folder that holds solutions/ (every learner's server imports the course from DIR);
#   - the interpreter environment.yml names (python=3.11 there) and its pip section, constraints
#     included, into DIR/.venv, plus the hub extra (jupyterhub-singleuser); conda is not needed;
#   - removes the slow imports the Makefile removes (SLOW_IMPORTS), opens DIR to every account;
#   - checks, as an account with no rights of its own, that the servers' packages import.
set -euo pipefail
dir="$(cd "${1:?usage: build.sh DIR (the hand-out, unpacked)}" && pwd)"
cd "$dir"
if [ -e solutions ]; then
    echo "build: $dir holds solutions/: build the image from the hand-out (git archive without solutions)" >&2
    exit 2
fi
version="$(sed -n 's/^ *- python=\([0-9.]*\).*/\1/p' environment.yml)"
# the distribution's interpreter first: a venv made from one under /root (pyenv) is not another account's to run
python="${PYTHON:-$( [ -x "/usr/bin/python$version" ] && echo "/usr/bin/python$version" || command -v "python$version" || true)}"
if [ -z "$python" ]; then
    echo "build: environment.yml asks for Python $version, and python$version is not here" >&2
    exit 2
fi
# environment.yml's pip section (`- -c constraints.txt`, `- -e .[dev]`), with the hub extra added
mapfile -t pip_args < <(sed -n '/^ *- pip:/,$ s/^ *- \(-.*\)$/\1/p' environment.yml | sed 's/\.\[dev\]/.[dev,hub]/')
slow="$(sed -n 's/^SLOW_IMPORTS := //p' Makefile)"
started=$(date +%s)
"$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086 - each line of the pip section is one option with its value
.venv/bin/python -m pip install --quiet ${pip_args[*]}
[ -z "$slow" ] || .venv/bin/python -m pip uninstall --quiet --yes $slow
chmod -R a+rX "$dir"
echo "build: $(.venv/bin/python --version) with ${pip_args[*]} in $(($(date +%s) - started)) s"
check="import jupyterhub.singleuser, nbgrader, jupyterlab, course.kit.backends, autograder.hub"
if [ "$(id -u)" = 0 ]; then
    runuser -u nobody -- env HOME=/nonexistent "$dir/.venv/bin/python" -c "$check"
    echo "build: the account nobody imports the servers' packages from $dir/.venv"
else
    "$dir/.venv/bin/python" -c "$check"
    echo "build: the servers' packages import from $dir/.venv"
fi
