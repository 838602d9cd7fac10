#!/bin/sh
# The one install step, shared by the Makefile (tests, demo) and the Dockerfile (image):
#   scripts/install.sh PYTHON [dev|prod]
# dev: this project and its dev tools, every version pinned by constraints.txt.
# prod (the image): the runtime dependencies from requirements/image.lock, the same versions with
# the SHA-256 of each file (--require-hashes: a file that changed on the index fails the build), pip
# and setuptools included; then this project itself, with no dependency resolved from the index.
set -eu
python="$1"
kind="${2:-prod}"
cd "$(dirname "$0")/.."
if [ "$kind" = "dev" ]; then
    "$python" -m pip install --quiet --no-cache-dir --upgrade pip
    "$python" -m pip install --quiet --no-cache-dir -c constraints.txt -e '.[dev]'
else
    "$python" -m pip install --quiet --no-cache-dir --require-hashes --no-deps -r requirements/image.lock
    "$python" -m pip install --quiet --no-cache-dir --no-deps --no-build-isolation .
fi
