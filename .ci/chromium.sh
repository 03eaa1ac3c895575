#!/usr/bin/env bash
# Headless Chromium for the report tests (tests/helpers/browser.py): Debian's package, installed with apt-get when
# missing (root needed), like .ci/slurm.sh installs Slurm. Prints the browser's path.
set -euo pipefail
find_browser() { command -v chromium || command -v chromium-browser || true; }
browser=$(find_browser)
if [[ -z $browser ]]; then
    [[ $(id -u) == 0 ]] || { echo "chromium.sh: chromium is not installed and this is not root" >&2; exit 1; }
    command -v apt-get >/dev/null || { echo "chromium.sh: chromium is not installed and there is no apt-get" >&2; exit 1; }
    log=$(mktemp)
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >"$log" 2>&1; then
        apt-get update -q >>"$log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >>"$log" 2>&1 \
            || { tail -20 "$log" >&2; echo "chromium.sh: apt-get install chromium failed" >&2; exit 1; }
    fi
    rm -f "$log"
    browser=$(find_browser)
fi
[[ -n $browser ]] || { echo "chromium.sh: no chromium after installing it" >&2; exit 1; }
echo "$browser"
