#!/usr/bin/env bash
# What the grading sandbox needs, installed only when missing (`make test` runs this first):
#   - Debian's bubblewrap (bwrap), through apt-get when running as root.
# Not root and missing: nothing is installed; the sandbox tests skip and say why.
set -euo pipefail

if command -v bwrap >/dev/null 2>&1; then
    echo "sandbox setup: $(bwrap --version) found at $(command -v bwrap)"
elif [ "${EUID:-$(id -u)}" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "sandbox setup: installing Debian's bubblewrap with apt-get"
    started=$(date +%s)
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
    echo "sandbox setup: $(bwrap --version) installed in $(($(date +%s) - started)) s"
else
    echo "sandbox setup: bubblewrap (bwrap) is not installed, so the sandbox tests will be skipped." >&2
    echo "  Install it (Debian/Ubuntu: sudo apt-get install bubblewrap) to grade learner code in a sandbox." >&2
fi
