"""The dataset step: downloaded recordings -> an LJSpeech folder (``wavs/<id>.wav`` + ``metadata.csv``).

Every recording is decoded with libsndfile (soundfile), down-mixed to mono, resampled to 22,050 Hz
with soxr (HQ) and written as 16-bit PCM WAV, block by block (``pipeline.audio``). Every header is
checked against the job's ``JobLimits`` (format, rate, length per recording and for the whole job)
before any recording is decoded. A recording that fails a check, does not decode, has no samples, or
is silent is a permanent ``BadRecording`` naming its input index: retrying cannot make it usable.

Up to ``JobLimits.dataset_workers`` recordings are converted at once, on threads: libsndfile, soxr
and numpy's array loops release the GIL, so threads use every core while sharing one copy of the
libraries, the stop signal and the job's audio budget. The result does not depend on the count or
on which conversion finishes first: the WAVs and notes are the same, and when several recordings are
unusable the error names the first by index, as a one-at-a-time build would.

The job's ``MAX_JOB_AUDIO_SECONDS`` holds on decoded frames, exactly, however many run at once: each
recording may decode what its header declared (the headers' sum is within the cap); one that decodes
longer asks for more, and gets what the recordings before it actually decoded and the ones after it
declared leave, once every recording before it is done.

``metadata.csv`` is written last and atomically, so its presence with the expected content plus all
the WAVs means "complete", and a re-run on a complete dataset touches nothing.

Text is escaped so a row is always one line of exactly three ``|``-separated fields: ``\\`` -> ``\\\\``,
``|`` -> ``\\|``, newline -> ``\\n``, carriage return -> ``\\r``, any other control or line-break
character -> ``\\uXXXX``. ``unescape_text`` and ``split_metadata_line`` undo it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import BadRecording
from pipeline.files import fsync_dir
from pipeline.limits import JobLimits
from pipeline.manifest import atomic_write_bytes, remove_stale_temps
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

    ``on_converted(index)`` is called for each recording once it and every one before it are written.
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
    declared, total_s = [], 0.0
    for index, (source, _text) in enumerate(recordings):
        declared.append(read_header(source, index, limits.max_recording_seconds))
        total_s += declared[-1].seconds
        if total_s > limits.max_job_audio_seconds:
            raise BadRecording(f"recording {index} takes the job's audio to {total_s:.0f} s, over the limit of "
                               f"{limits.max_job_audio_seconds:g} s (MAX_JOB_AUDIO_SECONDS)")
    wavs = dataset_dir / WAVS_DIR_NAME
    wavs.mkdir(parents=True, exist_ok=True)
    metadata.unlink(missing_ok=True)
    remove_stale_temps(wavs)
    remove_stale_temps(dataset_dir)
    budget = _JobAudio(limits.max_job_audio_seconds, [header.seconds for header in declared])

    def one(index: int, source: Path):
        checks = _Checks(stop, budget, index)
        checks.raise_if_set()
        try:
            done = convert(source, wavs / f"{utterance_id(index)}.wav", index,
                           max_seconds=limits.max_recording_seconds,
                           # Half a frame over the declared length: float rounding never costs a frame.
                           job_seconds_left=(declared[index].frames + 0.5) / declared[index].rate_hz,
                           stop=checks, more_job_seconds=lambda: budget.more_s(index))
        except BaseException:
            budget.failed(index)
            raise
        budget.decoded(index, done.seconds)
        return done

    notes = []
    workers = max(1, min(limits.dataset_workers, len(recordings)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dataset") as pool:
        # Submitted in index order, so a recording starts only after every one before it has started:
        # one waiting on the earlier ones (``_JobAudio.more_s``) never waits on one that cannot run.
        futures: list[Future] = [pool.submit(one, index, source) for index, (source, _text) in enumerate(recordings)]
        try:
            for index, future in enumerate(futures):
                done = future.result()
                notes.append(
                    f"{utterance_id(index)}: input {index}, {done.rate_hz} Hz, {done.channels} ch, "
                    f"{done.seconds:.3f} s -> {done.frames_out} samples at {TARGET_RATE_HZ} Hz"
                    + (f", {done.full_scale_samples} at full scale ({100 * done.full_scale_fraction:.2f} %: clipped)"
                       if done.full_scale_samples else "")
                )
                if on_converted is not None:
                    on_converted(index)
        except BaseException:
            budget.failed(-1)  # nothing still running is wanted now
            for future in futures:
                future.cancel()
            raise
    # One sync for every WAV's rename, before metadata.csv can say they are all there.
    fsync_dir(wavs)
    atomic_write_bytes(metadata, metadata_bytes(texts))
    return DatasetResult(metadata, rebuilt=True, notes=tuple(notes))


class _Abandoned(Exception):
    """A conversion given up because a recording before it failed: that failure is the job's error."""


class _JobAudio:
    """MAX_JOB_AUDIO_SECONDS shared by the conversions running at once, decided in index order."""

    def __init__(self, cap_s: float, declared_s: Sequence[float]):
        self._cap_s = cap_s
        self._declared_s = list(declared_s)
        self._decoded_s: list[float | None] = [None] * len(declared_s)
        self._first_failed = len(declared_s)
        self._changed = threading.Condition()

    def abandoned(self, index: int) -> bool:
        return self._first_failed < index

    def decoded(self, index: int, seconds: float) -> None:
        with self._changed:
            self._decoded_s[index] = seconds
            self._changed.notify_all()

    def failed(self, index: int) -> None:
        with self._changed:
            self._first_failed = min(self._first_failed, index)
            self._changed.notify_all()

    def more_s(self, index: int) -> float:
        """Recording ``index`` decodes past its header: what the others leave it, once those before it are done."""
        with self._changed:
            self._changed.wait_for(lambda: self.abandoned(index)
                                   or all(s is not None for s in self._decoded_s[:index]))
            if self.abandoned(index):
                raise _Abandoned(f"recording {index} was not needed: an earlier one failed")
            before_s = sum(s for s in self._decoded_s[:index] if s is not None)
            return self._cap_s - before_s - sum(self._declared_s[index + 1 :])


class _Checks:
    """What a conversion checks between blocks: the job's stop, then whether an earlier recording failed."""

    def __init__(self, stop: StopSignal | None, budget: _JobAudio, index: int):
        self._stop, self._budget, self._index = stop, budget, index

    def raise_if_set(self) -> None:
        if self._stop is not None:
            self._stop.raise_if_set()
        if self._budget.abandoned(self._index):
            raise _Abandoned(f"recording {self._index} was not needed: an earlier one failed")
