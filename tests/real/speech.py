"""Speech recordings for the real end-to-end test, spoken by espeak-ng at test time.

The trainers phonemise with espeak-ng, so the test needs no other tool to make its input, and the
clips never go stale against the voice data on the machine: nothing binary is kept in git. The clips
carry no person's voice and no licence terms.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# Short, phonetically varied sentences: a VITS step costs the same whatever they say, and a few
# seconds each keep phonemising and the speaker encoder quick.
SENTENCES = (
    "Hello there, this is a short sample of my voice.",
    "The quick brown fox jumps over the lazy dog.",
    "Please train a model that sounds just like me.",
    "She sells sea shells by the sea shore every summer.",
    "How much wood would a woodchuck chuck if it could?",
    "Seven bright lanterns hung above the quiet harbour.",
    "We measured the river twice before the heavy rain.",
    "A journey of a thousand miles begins with one step.",
)
ESPEAK_VOICE = "en-us"
ESPEAK_WORDS_PER_MINUTE = 160
SPEAK_TIMEOUT_S = 60


def espeak() -> str:
    """The espeak-ng executable; AssertionError when it is missing (the trainer install provides it)."""
    found = shutil.which("espeak-ng")
    if found is None:
        raise AssertionError("espeak-ng is not installed: run scripts/install-trainers.sh "
                             "(make trainers/.venv/.installed)")
    return found


def speak(text: str, path: Path, voice: str = ESPEAK_VOICE, words_per_minute: int = ESPEAK_WORDS_PER_MINUTE) -> Path:
    """``text`` spoken by espeak-ng into the WAV file ``path`` (22,050 Hz mono 16-bit, as espeak-ng writes)."""
    subprocess.run([espeak(), "-v", voice, "-s", str(words_per_minute), "-w", str(path), text],
                   check=True, capture_output=True, timeout=SPEAK_TIMEOUT_S)
    if not path.is_file() or path.stat().st_size <= 44:  # a RIFF header and no samples
        raise AssertionError(f"espeak-ng wrote no audio for {text!r}")
    return path


def speech_clips(directory: Path, count: int = len(SENTENCES), voice: str = ESPEAK_VOICE) -> list[tuple[Path, str]]:
    """``count`` clips ``clip-NN.wav`` in ``directory``, each with the sentence it speaks, in espeak-ng's ``voice``."""
    directory.mkdir(parents=True, exist_ok=True)
    return [(speak(text, directory / f"clip-{n:02d}.wav", voice=voice), text)
            for n, text in enumerate(SENTENCES[:count])]
