"""The dataset step: downloaded recordings -> an LJSpeech folder (``wavs/<id>.wav`` + ``metadata.csv``).

Every recording is decoded with libsndfile (soundfile), down-mixed to mono, resampled to 22,050 Hz
with a band-limited (Kaiser-windowed sinc, polyphase) resampler and written as 16-bit PCM WAV, block
by block (``pipeline.audio``). Every header is checked against the job's ``JobLimits`` (format, rate,
length per recording and for the whole job) before any recording is decoded. A recording that fails
a check, does not decode, has no samples, or is silent is a permanent ``BadRecording`` naming its
input index: retrying cannot make it usable.

``metadata.csv`` is written last and atomically, so its presence with the expected content plus all
the WAVs means "complete", and a re-run on a complete dataset touches nothing.

Text is escaped so a row is always one line of exactly three ``|``-separated fields: ``\\`` -> ``\\\\``,
``|`` -> ``\\|``, newline -> ``\\n``, carriage return -> ``\\r``, any other control or line-break
character -> ``\\uXXXX``. ``unescape_text`` and ``split_metadata_line`` undo it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.limits import JobLimits
from pipeline.manifest import atomic_write_bytes, remove_stale_temps
from worker.core.errors import BadRecording
from worker.core.stop import StopSignal

METADATA_NAME = "metadata.csv"
WAVS_DIR_NAME = "wavs"

_LINE_BREAKS = frozenset("\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


@dataclass(frozen=True)
class DatasetResult:
    metadata_path: Path
    rebuilt: bool
    notes: tuple[str, ...] = ()


def utterance_id(index: int) -> str:
    return f"utt{index:05d}"


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
        elif ch in _LINE_BREAKS or (ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def split_metadata_line(line: str) -> list[str]:
    """Split one metadata row on unescaped ``|`` and unescape each field."""
    fields, current, i = [], [], 0
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
            if nxt == "u" and len(line) >= i + 6:
                try:
                    current.append(chr(int(line[i + 2 : i + 6], 16)))
                    i += 6
                    continue
                except ValueError:
                    pass
            raise ValueError(f"bad escape at column {i}")
        current.append(ch)
        i += 1
    fields.append("".join(current))
    return fields


def unescape_text(escaped: str) -> str:
    fields = split_metadata_line(escaped)
    if len(fields) != 1:
        raise ValueError("unescaped '|' in an escaped field")
    return fields[0]


def metadata_bytes(texts: Sequence[str]) -> bytes:
    rows = []
    for index, text in enumerate(texts):
        escaped = escape_text(text)
        rows.append(f"{utterance_id(index)}|{escaped}|{escaped}\n")
    return "".join(rows).encode("utf-8")


def dataset_is_complete(dataset_dir: Path, texts: Sequence[str]) -> bool:
    """True when metadata.csv holds exactly the expected rows and every WAV is present."""
    try:
        if (dataset_dir / METADATA_NAME).read_bytes() != metadata_bytes(texts):
            return False
    except OSError:
        return False
    wavs = dataset_dir / WAVS_DIR_NAME
    return all(
        (wavs / f"{utterance_id(i)}.wav").is_file()
        and (wavs / f"{utterance_id(i)}.wav").stat().st_size > 44
        for i in range(len(texts))
    )


def build_dataset(
    recordings: Sequence[tuple[Path, str]],
    dataset_dir: Path,
    stop: StopSignal | None = None,
    *,
    limits: JobLimits | None = None,
    on_converted: Callable[[int], None] | None = None,
) -> DatasetResult:
    """Write the LJSpeech folder for ``(audio file, text)`` pairs; a no-op when already complete.

    ``on_converted(index)`` is called after each recording is written.
    """
    # Here, not at the top: numpy and libsndfile load only where a dataset is built (the dataset
    # step's own process, ``pipeline.dataset_stage``), never into the worker that only checks one.
    from pipeline.audio import TARGET_RATE_HZ, convert, read_header

    limits = limits or JobLimits()
    texts = [text for _, text in recordings]
    metadata = dataset_dir / METADATA_NAME
    if dataset_is_complete(dataset_dir, texts):
        return DatasetResult(metadata, rebuilt=False, notes=("dataset already complete",))
    # Every header before any decoding: a job over its audio total fails before spending the CPU.
    declared = 0.0
    for index, (source, _text) in enumerate(recordings):
        declared += read_header(source, index, limits.max_recording_seconds).seconds
        if declared > limits.max_job_audio_seconds:
            raise BadRecording(f"recording {index} takes the job's audio to {declared:.0f} s, over the limit of "
                               f"{limits.max_job_audio_seconds:g} s (MAX_JOB_AUDIO_SECONDS)")
    wavs = dataset_dir / WAVS_DIR_NAME
    wavs.mkdir(parents=True, exist_ok=True)
    metadata.unlink(missing_ok=True)
    remove_stale_temps(wavs)
    remove_stale_temps(dataset_dir)
    notes, decoded_s = [], 0.0
    for index, (source, _text) in enumerate(recordings):
        if stop is not None:
            stop.raise_if_set()
        done = convert(source, wavs / f"{utterance_id(index)}.wav", index, max_seconds=limits.max_recording_seconds,
                       job_seconds_left=limits.max_job_audio_seconds - decoded_s, stop=stop)
        decoded_s += done.seconds
        notes.append(
            f"{utterance_id(index)}: input {index}, {done.rate_hz} Hz, {done.channels} ch, "
            f"{done.seconds:.3f} s -> {done.frames_out} samples at {TARGET_RATE_HZ} Hz"
        )
        if on_converted is not None:
            on_converted(index)
    atomic_write_bytes(metadata, metadata_bytes(texts))
    return DatasetResult(metadata, rebuilt=True, notes=tuple(notes))
