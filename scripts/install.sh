#!/bin/sh
# The one install step, shared by the Makefile (tests, demo) and the Dockerfile (image):
#   scripts/install.sh PYTHON [dev|prod]
# Installs this project with every dependency pinned by constraints.txt.
set -eu
python="$1"
kind="${2:-prod}"
cd "$(dirname "$0")/.."
"$python" -m pip install --quiet --no-cache-dir --upgrade pip
if [ "$kind" = "dev" ]; then
    "$python" -m pip install --quiet --no-cache-dir -c constraints.txt -e '.[dev]'
else
    "$python" -m pip install --quiet --no-cache-dir -c constraints.txt .
fi
