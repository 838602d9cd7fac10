#!/usr/bin/env bash
# The web page's browser tests (tests/ops/test_ui_browser.py) drive Debian's headless chromium: install
# it once, from Debian's archive, when it is not on the machine yet (needs root or sudo, as CI has).
set -euo pipefail
for name in chromium chromium-browser chromium-headless-shell; do
    command -v "$name" >/dev/null && exit 0
done
sudo_=""
[ "$(id -u)" -eq 0 ] || sudo_="sudo"
$sudo_ apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends chromium >/dev/null
