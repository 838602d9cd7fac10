"""The LJSpeech folder the worker writes (docs/trainer.md, "The dataset a stage receives"), read without torch."""

from __future__ import annotations

import hashlib
import re
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

import soundfile

METADATA_NAME = "metadata.csv"
WAVS_DIR_NAME = "wavs"
PACKED_NAME = "clips.tar"
SAMPLE_RATE_HZ = 22050
_SAFE_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class UnusableData(Exception):
    """The dataset cannot be trained on; a retry would see the same data (exit 65)."""


@dataclass(frozen=True)
class Clip:
    uid: str
    text: str
    wav_path: Path
    duration_s: float
    # The row of metadata.csv, which is the recording's place in the message's ``input``: what a person
    # reading the job record knows the clip by.
    index: int


def split_metadata_line(line: str) -> list[str]:
    """Split one metadata row on unescaped ``|`` and undo the worker's escaping in each field.

    The rules mirror ``pipeline.dataset.escape_text``: ``\\\\`` ``\\|`` ``\\n`` ``\\r`` and ``\\uXXXX``.
    """
    fields: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "|":
            fields.append("".join(current))
            current = []
            i += 1
            continue
        if ch == "\\":
            nxt = line[i + 1 : i + 2]
            if nxt in ("\\", "|"):
                current.append(nxt)
                i += 2
                continue
            if nxt in ("n", "r"):
                current.append("\n" if nxt == "n" else "\r")
                i += 2
                continue
            digits = line[i + 2 : i + 6]
            if nxt == "u" and len(digits) == 4 and all(c in "0123456789abcdefABCDEF" for c in digits):
                current.append(chr(int(digits, 16)))
                i += 6
                continue
            raise ValueError(f"bad escape at column {i}")
        current.append(ch)
        i += 1
    fields.append("".join(current))
    return fields


def read_metadata(dataset_dir: Path) -> list[tuple[str, str]]:
    """(id, text) per row of metadata.csv; any malformed row makes the whole dataset unusable."""
    path = dataset_dir / METADATA_NAME
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UnusableData(f"cannot read {METADATA_NAME}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnusableData(f"{METADATA_NAME} is not UTF-8 (byte {exc.start})") from None
    rows: list[tuple[str, str]] = []
    seen: set[str] = set()
    for number, line in enumerate(text.split("\n"), start=1):
        if line == "":
            continue
        try:
            fields = split_metadata_line(line)
        except ValueError as exc:
            raise UnusableData(f"{METADATA_NAME} line {number}: {exc}") from None
        if len(fields) != 3:
            raise UnusableData(f"{METADATA_NAME} line {number}: {len(fields)} fields, expected 3")
        uid = fields[0]
        if not _SAFE_ID.fullmatch(uid) or uid in seen:
            raise UnusableData(f"{METADATA_NAME} line {number}: bad or repeated id {uid[:40]!r}")
        seen.add(uid)
        rows.append((uid, fields[2]))
    if not rows:
        raise UnusableData(f"{METADATA_NAME} has no rows")
    return rows


def unpack_prepared(dataset_dir: Path) -> None:
    """Unpack ``PACKED_NAME`` (the embed stage's prepared dataset, one file so the worker can verify and
    reuse it as a stage output) into ``dataset_dir`` unless its metadata.csv is there already.

    metadata.csv is written last: a folder without it is an interrupted unpack and is unpacked again.
    """
    packed = dataset_dir / PACKED_NAME
    if not packed.is_file() or (dataset_dir / METADATA_NAME).is_file():
        return
    shutil.rmtree(dataset_dir / WAVS_DIR_NAME, ignore_errors=True)
    with tarfile.open(packed) as archive:
        members = [m for m in archive.getmembers() if m.name != METADATA_NAME]
        # The "data" filter refuses links, absolute paths and ".." (the file is an earlier stage's output).
        archive.extractall(dataset_dir, members=members, filter="data")
        archive.extract(METADATA_NAME, dataset_dir, filter="data")


def read_recordings(dataset_dir: Path) -> list[Clip]:
    """Every row of the dataset as a clip, whatever its length or text (a prepared dataset is unpacked
    first).

    A WAV that is missing or not mono 22,050 Hz 16-bit PCM breaks the contract, so it fails the whole
    dataset.
    """
    unpack_prepared(dataset_dir)
    clips: list[Clip] = []
    for index, (uid, text) in enumerate(read_metadata(dataset_dir)):
        wav_path = dataset_dir / WAVS_DIR_NAME / f"{uid}.wav"
        try:
            info = soundfile.info(str(wav_path))
        except (OSError, RuntimeError) as exc:
            raise UnusableData(f"{uid}.wav: cannot be read ({type(exc).__name__})") from None
        if (info.samplerate, info.channels, info.subtype) != (SAMPLE_RATE_HZ, 1, "PCM_16"):
            raise UnusableData(
                f"{uid}.wav: {info.samplerate} Hz, {info.channels} channel(s), {info.subtype};"
                f" expected {SAMPLE_RATE_HZ} Hz mono PCM_16"
            )
        clips.append(Clip(uid=uid, text=text, wav_path=wav_path, duration_s=info.frames / info.samplerate,
                          index=index))
    return clips


def load_clips(dataset_dir: Path, *, min_clip_s: float, max_clip_s: float, min_clips: int) -> list[Clip]:
    """The clips a trainer can use; fewer than ``min_clips`` of them is unusable data.

    A clip that is merely too short, too long or has a blank text is left out (data preparation has left
    out such clips of the prepared dataset already, each with its reason in its report).
    """
    clips: list[Clip] = []
    skipped: list[str] = []
    for clip in read_recordings(dataset_dir):
        if not clip.text.strip() or not min_clip_s <= clip.duration_s <= max_clip_s:
            skipped.append(clip.uid)
            continue
        clips.append(clip)
    if skipped:
        # NOTE: the worker keeps the line on the job's record, so a user learns which clips did not count.
        print(f"NOTE left out {len(skipped)} clip(s) (blank text or not {min_clip_s}-{max_clip_s} s): "
              + " ".join(skipped[:10]), flush=True)
    require_enough(len(clips), min_clips, "usable clips")
    return clips


def escape_text(text: str) -> str:
    """A metadata field as the worker writes it (``pipeline.dataset.escape_text``; undone by
    ``split_metadata_line``)."""
    out = []
    for ch in text:
        if ch in "\\|":
            out.append("\\" + ch)
        elif ch in "\n\r":
            out.append("\\n" if ch == "\n" else "\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F or ch in "\x85\u2028\u2029":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def require_enough(count: int, minimum: int, what: str) -> None:
    if count < minimum:
        raise UnusableData(f"{count} {what}, at least {minimum} needed")


def dataset_fingerprint(dataset_dir: Path, clips: list[Clip]) -> str:
    """SHA-256 over metadata.csv and every used WAV's bytes: a changed recording changes it."""
    digest = hashlib.sha256()
    digest.update(hashlib.sha256((dataset_dir / METADATA_NAME).read_bytes()).digest())
    for clip in clips:
        with open(clip.wav_path, "rb") as handle:
            digest.update(clip.uid.encode() + b"\0" + hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()
