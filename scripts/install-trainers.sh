#!/bin/sh
# Builds the trainer virtualenv (the real stages of config/pipeline.real.toml), never the worker's:
#   scripts/install-trainers.sh PYTHON VENV [dev|prod]
# dev: editable, with the test-only extra (piper-tts, pytest); torch==2.13.0 goes in first and alone,
# so nothing later can resolve a newer (CUDA, several GB) torch.
# prod (an image): the hashed requirements/trainers.lock (scripts/lock-trainers.sh), then the package alone.
set -eu
python="$1"
venv="$2"
kind="${3:-dev}"
cd "$(dirname "$0")/.."

# Coqui's phonemizer runs the espeak-ng program; Piper brings its own copy of the library.
if ! command -v espeak-ng >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends espeak-ng >/dev/null
    else
        echo "install-trainers: espeak-ng is not installed and this is not root with apt-get;" \
             "install it first (Debian/Ubuntu: apt-get install espeak-ng)" >&2
        exit 1
    fi
fi

"$python" -m venv "$venv"
vpython="$venv/bin/python"
"$vpython" -m pip install --quiet --no-cache-dir --upgrade pip
if [ "$kind" = "dev" ]; then
    "$vpython" -m pip install --quiet --no-cache-dir torch==2.13.0
    "$vpython" -m pip install --quiet --no-cache-dir -c trainers/constraints.txt -e 'trainers[test]'
else
    # prod (the production image): every package from requirements/trainers.lock with the SHA-256 of
    # each file (--require-hashes), the CUDA build of torch that config/gpu-pairing.toml pairs with
    # the AMI's driver included; then the package itself, with nothing resolved from the index.
    "$vpython" -m pip install --quiet --no-cache-dir --require-hashes --no-deps -r requirements/trainers.lock
    "$vpython" -m pip install --quiet --no-cache-dir --no-deps --no-build-isolation ./trainers
fi

# torchaudio's compiled extension is built against its own torch release and does not load against
# torch 2.13; without it torchaudio runs in pure-Python mode, which is all Coqui imports it for
# (the adapter reads audio with soundfile). A matching build (a CUDA image) keeps its libraries.
if ! "$vpython" -c "import torchaudio" >/dev/null 2>&1; then
    lib_dir=$("$vpython" -c "import importlib.util, os; s = importlib.util.find_spec('torchaudio'); print(os.path.join(s.submodule_search_locations[0], 'lib'))")
    rm -f "$lib_dir"/*.so
fi
"$vpython" -W ignore -c "import TTS.tts.models.vits, resemblyzer, onnxruntime, voice_trainers.cli, piper, pocketsphinx, jiwer
from voice_trainers.scoring.dnsmos import model_dir
from voice_trainers.sentences import held_out
assert (model_dir() / 'sig_bak_ovr.onnx').is_file() and held_out('en', 1)"
