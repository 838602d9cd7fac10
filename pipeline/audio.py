"""One recording -> a 22,050 Hz mono 16-bit PCM WAV, within bounded memory and bounded work.

A few kilobytes can declare hours of audio: a WAV whose header says 1 Hz turns each sample into
22,050, and a constant FLAC compresses an hour into a few hundred kilobytes. So every recording is
judged from its header before a single sample is decoded (libsndfile parses only the header on open):

- container format: WAV (also WAVEX, WAV's extensible header), FLAC, OGG (Vorbis, Opus) or MP3, as
  ``soundfile`` names them; every other format libsndfile knows (AIFF, AU, RF64, CAF, ...) is refused,
  which keeps rarely used parsers away from untrusted bytes;
- sample rate from 8 kHz to 192 kHz, and at most 8 channels;
- a declared length (an unknown length is refused), at most MAX_RECORDING_SECONDS, and with all the
  recordings before it at most MAX_JOB_AUDIO_SECONDS; ``build_dataset`` sums every header first.

Decoding then reads blocks of at most ``BLOCK_SAMPLES`` samples and counts frames as they come, so a
header that lies cannot take a recording past either cap. Each block is down-mixed, resampled by
soxr's HQ recipe as a stream (``soxr.ResampleStream``: its state is a filter's length of input, so
one block in gives about one block out) and written straight to the output file, so memory does not
grow with the length. Holding the whole decoded signal, as this module once did, took about 24 bytes
per input sample: some 2 GB for 1,800 s at 48 kHz, 8 GB at 192 kHz.

soxr HQ (libsoxr, 20-bit quality, linear phase) is flat to 91.3 % of the lower Nyquist frequency
(10.07 kHz at 22,050 Hz out) and stops everything above it: a resampled 9 kHz or 10 kHz sine is
within about 130 dB of the ideal one and a 15 kHz tone comes out some 140 dB down. The hand-written
Kaiser-sinc resampler it replaced gave 49.8 dB, 12.4 dB and -118 dB, at twelve times the CPU.

Every refusal is a permanent ``BadRecording`` naming the input's index.
"""

from __future__ import annotations

import math
import wave
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import soundfile as sf
import soxr

from pipeline.errors import BadRecording, DownloadError
from pipeline.manifest import replaced_atomically

TARGET_RATE_HZ = 22_050
SILENCE_PEAK_DBFS = -60.0
# What to_pcm16 rounds to +-32,767, the int16 limits it writes.
FULL_SCALE = 32766.5 / 32767.0
ALLOWED_FORMATS = frozenset({"WAV", "WAVEX", "FLAC", "OGG", "MP3"})
MIN_RATE_HZ = 8_000
MAX_RATE_HZ = 192_000
MAX_CHANNELS = 8
# Samples (frames x channels) decoded at once: 256 KB of float32. Blocks of 1 MB made glibc hand
# their memory back and fault it in again for every block, twice the step's system time.
BLOCK_SAMPLES = 1 << 16
# What libsndfile reports as the length of a stream that does not declare one.
_UNKNOWN_FRAMES = 2**63 - 1


@dataclass(frozen=True)
class AudioHeader:
    """What a recording's header declares, once it passed the checks."""

    rate_hz: int
    channels: int
    frames: int

    @property
    def seconds(self) -> float:
        return self.frames / self.rate_hz


@dataclass(frozen=True)
class Converted:
    rate_hz: int
    channels: int
    frames_in: int
    frames_out: int
    # Output samples at full scale: the input's own clipping, or resampling's overshoot past it (a
    # full-scale input rings a few per cent over it), which 16 bits cannot hold. Counted and reported,
    # never hidden: the trainers' data preparation leaves clipped clips out (docs/trainer.md).
    full_scale_samples: int = 0

    @property
    def full_scale_fraction(self) -> float:
        return self.full_scale_samples / self.frames_out if self.frames_out else 0.0

    @property
    def seconds(self) -> float:
        return self.frames_in / self.rate_hz


def read_header(path: Path, index: int, max_seconds: float) -> AudioHeader:
    """The header's format, rate, channels and length, checked; no sample is decoded."""
    with _reading(index):
        with sf.SoundFile(str(path)) as audio:
            header = AudioHeader(audio.samplerate, audio.channels, audio.frames)
            container = audio.format
    if container not in ALLOWED_FORMATS:
        raise BadRecording(f"recording {index} is {container} audio; accepted: {', '.join(sorted(ALLOWED_FORMATS))}")
    if not MIN_RATE_HZ <= header.rate_hz <= MAX_RATE_HZ:
        raise BadRecording(f"recording {index} has a sample rate of {header.rate_hz} Hz, "
                           f"outside {MIN_RATE_HZ}-{MAX_RATE_HZ} Hz")
    if not 1 <= header.channels <= MAX_CHANNELS:
        raise BadRecording(f"recording {index} has {header.channels} channels, more than {MAX_CHANNELS}")
    if header.frames >= _UNKNOWN_FRAMES:
        raise BadRecording(f"recording {index} does not declare its length")
    if header.seconds > max_seconds:
        raise BadRecording(f"recording {index} is {header.seconds:.0f} s long, over the limit of "
                           f"{max_seconds:g} s (MAX_RECORDING_SECONDS)")
    return header


def convert(path: Path, dest: Path, index: int, *, max_seconds: float, job_seconds_left: float,
            stop: Checks | None = None, more_job_seconds: Callable[[], float] | None = None) -> Converted:
    """Decode ``path`` block by block into ``dest`` (atomically); BadRecording when unusable.

    Call ``read_header`` first: this re-checks the lengths on the frames it counts, not the rest.
    The WAV's bytes are synced before its rename, the rename is not: the caller syncs ``dest``'s
    directory once for all its files (``fsync_dir``), before it writes what vouches for them.
    Past ``job_seconds_left`` of decoded audio, ``more_job_seconds()`` (when given) is asked once for
    the final allowance: a caller converting several recordings at once keeps the job's total exact.
    """
    with _reading(index):
        audio = sf.SoundFile(str(path))
    with audio, _wav_writer(dest) as write:
        rate_hz, channels = audio.samplerate, audio.channels
        decoded = _Decoded()
        blocks = _checked_mono_blocks(audio, index, decoded, max_seconds=max_seconds,
                                      job_seconds_left=job_seconds_left, more_job_seconds=more_job_seconds,
                                      stop=stop)
        full_scale = 0
        frames_out = 0
        for block in resample_blocks(blocks, rate_hz):
            full_scale += count_full_scale(block)
            frames_out += write(block)
        if decoded.frames == 0:
            raise BadRecording(f"recording {index} is empty (no audio samples)")
        peak_dbfs = 20.0 * math.log10(decoded.peak) if decoded.peak > 0 else -math.inf
        if peak_dbfs < SILENCE_PEAK_DBFS:
            raise BadRecording(f"recording {index} is silent "
                               f"(peak {peak_dbfs:.1f} dBFS < {SILENCE_PEAK_DBFS:g} dBFS)")
        if frames_out == 0:
            # A few frames at a high rate round to no output sample: an empty WAV is no utterance.
            raise BadRecording(f"recording {index} is empty (no audio samples at {TARGET_RATE_HZ} Hz)")
    return Converted(rate_hz, channels, decoded.frames, frames_out, full_scale)


def resample_blocks(blocks: Iterable[np.ndarray], rate_hz: int) -> Iterator[np.ndarray]:
    """Mono float32 blocks at ``rate_hz`` -> the same signal at 22,050 Hz (soxr HQ), block by block.

    Fed in any split, the stream gives exactly the samples of one call over the whole signal.
    """
    if rate_hz == TARGET_RATE_HZ:
        yield from blocks
        return
    stream = soxr.ResampleStream(rate_hz, TARGET_RATE_HZ, 1, dtype="float32", quality="HQ")
    for block in blocks:
        yield stream.resample_chunk(block)
    yield stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)



class Checks(Protocol):
    """What a conversion checks between blocks: a job's ``StopSignal``, or the dataset stage's checks."""

    def raise_if_set(self) -> None: ...

@dataclass
class _Decoded:
    frames: int = 0
    peak: float = 0.0


def _checked_mono_blocks(audio: sf.SoundFile, index: int, decoded: _Decoded, *, max_seconds: float,
                         job_seconds_left: float, more_job_seconds: Callable[[], float] | None,
                         stop: Checks | None) -> Iterator[np.ndarray]:
    """The decoded audio as mono float32 blocks, each counted against the caps before it is yielded."""
    rate_hz, channels = audio.samplerate, audio.channels
    # Floors: the caps are checked on whole frames, so a recording exactly at a cap passes.
    max_frames = math.floor(max_seconds * rate_hz)
    job_frames = math.floor(job_seconds_left * rate_hz)
    block_frames = max(1, BLOCK_SAMPLES // max(channels, 1))
    # Read into one buffer: each block is resampled or written before the next read replaces it.
    buffer = np.empty((block_frames, channels), dtype=np.float32)
    while True:
        if stop is not None:
            stop.raise_if_set()
        with _reading(index):
            block = audio.read(out=buffer)
        if not len(block):
            return
        decoded.frames += len(block)
        if decoded.frames > max_frames:
            raise BadRecording(f"recording {index} decodes to more than {max_seconds:g} s "
                               f"(MAX_RECORDING_SECONDS), more than its header declares")
        if decoded.frames > job_frames and more_job_seconds is not None:
            job_seconds_left, more_job_seconds = more_job_seconds(), None
            job_frames = math.floor(job_seconds_left * rate_hz)
        if decoded.frames > job_frames:
            raise BadRecording(f"recording {index} takes the job past its {job_seconds_left:.0f} s "
                               f"of audio left (MAX_JOB_AUDIO_SECONDS)")
        # One channel is a contiguous column already; more are averaged in float64, as always.
        mono = block[:, 0] if channels == 1 else block.mean(axis=1, dtype=np.float64).astype(np.float32)
        if not np.all(np.isfinite(mono)):
            raise BadRecording(f"recording {index} holds non-finite samples")
        decoded.peak = max(decoded.peak, float(np.max(np.abs(mono))))
        yield mono


@contextmanager
def _reading(index: int) -> Iterator[None]:
    """Turn a failure to read the input into the recording's error."""
    try:
        yield
    except (RuntimeError, TypeError, ValueError) as exc:
        # soundfile's own errors subclass RuntimeError; the message names no URL, only the format.
        raise BadRecording(f"recording {index} is not decodable audio ({_short(exc)})") from None
    except OSError as exc:
        raise DownloadError(f"recording {index}: downloaded file unreadable ({exc.strerror})") from exc


def count_full_scale(samples: np.ndarray) -> int:
    """Samples ``to_pcm16`` writes at its limits (+-32,767): at full scale, or clipped there."""
    return int(np.count_nonzero(np.abs(samples) >= FULL_SCALE))


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)


@contextmanager
def _wav_writer(dest: Path) -> Iterator:
    """Yield ``write(samples) -> count`` into a temp WAV; it replaces ``dest`` only on success.

    The standard library's ``wave`` writes the very bytes libsndfile would (the 44-byte header, then
    the samples) without the fsync libsndfile adds to every close, a third of the step's time when
    profiled; ``replaced_atomically`` makes the fsync that counts.
    """
    with replaced_atomically(dest, sync_dir=False) as temp:
        with _own_file_error(temp):
            raw = open(temp, "wb")  # closed below, once the header holds the lengths
            out = wave.open(raw, "wb")
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(TARGET_RATE_HZ)

        def write(samples: np.ndarray) -> int:
            if len(samples):
                with _own_file_error(temp):
                    # numpy declares ndarray's buffer protocol to type checkers only from Python 3.12 on.
                    out.writeframesraw(to_pcm16(samples))  # type: ignore[arg-type]
            return len(samples)

        try:
            yield write
        finally:
            with _own_file_error(temp):
                try:
                    out.close()  # writes the lengths into the header
                finally:
                    raw.close()


@contextmanager
def _own_file_error(path: Path) -> Iterator[None]:
    """A failed write (a full disk) names no file: the job's error should say which one."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
