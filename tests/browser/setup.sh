#!/usr/bin/env bash
# What the browser tests need, installed only when missing (`make test-browser` runs this first):
#   - Debian's chromium (and chromium-driver), through apt-get when running as root;
#   - the Python playwright package, in the workbook's venv, pointed at that chromium.
# It never downloads a browser: no `playwright install`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
chromium="${CHROMIUM:-/usr/bin/chromium}"
python="$repo/.venv/bin/python"
[ -x "$python" ] || python="$(command -v python3)"

if [ -x "$chromium" ]; then
    echo "browser setup: chromium found at $chromium"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "browser setup: installing Debian's chromium and chromium-driver with apt-get"
    started=$(date +%s)
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    echo "browser setup: chromium installed in $(($(date +%s) - started)) s"
else
    echo "browser setup: no chromium at $chromium." >&2
    echo "  Install it (Debian/Ubuntu: sudo apt-get install chromium chromium-driver)" >&2
    echo "  or point CHROMIUM at a Chromium binary; these tests never download a browser." >&2
    exit 1
fi

if "$python" -c "import playwright" 2>/dev/null; then
    echo "browser setup: playwright $("$python" -c 'from importlib.metadata import version; print(version("playwright"))') found"
else
    echo "browser setup: installing the playwright package into $("$python" -c 'import sys; print(sys.prefix)')"
    "$python" -m pip install --quiet 'playwright>=1.45'
fi

# chromium prints a harmless shell warning on some hosts; show the version without it
echo "browser setup: $("$chromium" --version 2>/dev/null || true)"
