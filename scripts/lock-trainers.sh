#!/bin/sh
# Regenerate requirements/trainers.lock: the production image's trainer virtualenv (trainers/pyproject.toml's
# dependencies at the versions trainers/constraints.txt pins), each with the SHA-256 of every file PyPI
# has for it, so Dockerfile.trainer installs with --require-hashes. Resolved on and for Linux x86_64,
# Python 3.11 (the image's platform): torch comes from PyPI as the CUDA build config/gpu-pairing.toml
# names, with its nvidia-* runtime packages. Run after changing either file or the pairing:
#   scripts/lock-trainers.sh
set -eu
cd "$(dirname "$0")/.."
# Hashes from PyPI itself: no machine's own pip configuration (local mirrors, find-links, a CPU wheel
# cache) takes part.
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools"
"$tools/bin/python" -m pip install --quiet pip-tools==7.6.2
"$tools/bin/pip-compile" --quiet --generate-hashes --allow-unsafe --strip-extras --no-header \
    --annotation-style=line --no-emit-index-url --no-emit-find-links \
    -c trainers/constraints.txt -o requirements/trainers.lock trainers/pyproject.toml
