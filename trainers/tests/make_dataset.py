"""A small LJSpeech dataset spoken by espeak-ng, in the worker's exact format (docs/trainer.md).

    python trainers/tests/make_dataset.py OUT_DIR [--clips N] [--voice en-us]

espeak-ng writes 22,050 Hz mono 16-bit WAVs, the worker's dataset format, so no conversion is needed.
Texts go through the worker's escaping rules (a ``|`` and a backslash are in the sentences on purpose).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A voice model learns to speak from a few recordings.",
    "Please call Stella and ask her to bring these things with her.",
    "Six spoons of fresh snow peas, five thick slabs of blue cheese.",
    "We also need a small plastic snake and a big toy frog for the kids.",
    "She can scoop these things into three red bags.",
    "The rainbow is a division of white light into many beautiful colors.",
    "These take the shape of a long round arch, with its path high above.",
    "Training runs on the graphics card | or on the processor.",
    "Every checkpoint is written to a temporary file first.",
    "The worker uploads five files when the stages are done.",
    "A backslash \\ looks like a slanted line.",
    "When the sunlight strikes raindrops in the air, they act as a prism.",
    "Throughout the centuries people have explained the rainbow in various ways.",
    "Good morning, how are you today?",
    "It is a sunny day, and the birds are singing.",
]


def escape_text(text: str) -> str:
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == "|":
            out.append("\\|")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F or ch in "\x85\u2028\u2029":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def make_dataset(out: Path, *, clips: int = len(SENTENCES), voice: str = "en-us",
                 sentences: list[str] | None = None, texts: list[str] | None = None) -> list[str]:
    """Write ``out/wavs/uttNNNNN.wav`` and ``out/metadata.csv``; returns the texts.

    ``texts``, when given, replace the spoken sentences in metadata.csv (a dataset whose texts are wrong).
    """
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")
    spoken = (sentences or SENTENCES)[:clips]
    written = texts if texts is not None else spoken
    (out / "wavs").mkdir(parents=True, exist_ok=True)
    rows = []
    for index, (sentence, text) in enumerate(zip(spoken, written, strict=True)):
        uid = f"utt{index:05d}"
        subprocess.run([espeak, "-v", voice, "-s", "150", "-w", str(out / "wavs" / f"{uid}.wav"), sentence],
                       check=True, timeout=60)
        escaped = escape_text(text)
        rows.append(f"{uid}|{escaped}|{escaped}\n")
    (out / "metadata.csv").write_text("".join(rows), encoding="utf-8")
    return list(written)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--clips", type=int, default=len(SENTENCES))
    parser.add_argument("--voice", default="en-us")
    args = parser.parse_args(argv)
    make_dataset(args.out, clips=args.clips, voice=args.voice)
    return 0


if __name__ == "__main__":
    sys.exit(main())
