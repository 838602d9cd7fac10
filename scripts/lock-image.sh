#!/bin/sh
# Regenerate requirements/image.lock: the image's runtime dependencies (pyproject.toml's
# [project] dependencies at the versions constraints.txt pins, plus the installers in
# requirements/installers.in), each with the SHA-256 of every file PyPI has for it, so the image
# build installs with --require-hashes. Run after changing either file:
#   scripts/lock-image.sh
set -eu
cd "$(dirname "$0")/.."
# Hashes from PyPI itself: no machine's own pip configuration (local mirrors, find-links) takes part.
export PIP_CONFIG_FILE=/dev/null
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/python" -m pip install --quiet pip-tools==7.6.2
"$tools/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras --no-header \
    --annotation-style=line --no-emit-index-url --no-emit-find-links \
    -c constraints.txt -o requirements/image.lock \
    pyproject.toml requirements/installers.in
