"""The dataset step: downloaded recordings -> an LJSpeech folder (``wavs/<id>.wav`` + ``metadata.csv``).

Every recording is decoded with libsndfile (soundfile), down-mixed to mono, resampled to 22,050 Hz
with a band-limited (Kaiser-windowed sinc, polyphase) resampler and written as 16-bit PCM WAV. A
recording that does not decode, has no samples, or is silent is a permanent ``BadRecording`` naming
its input index: retrying cannot make it usable.

``metadata.csv`` is written last and atomically, so its presence with the expected content plus all
the WAVs means "complete", and a re-run on a complete dataset touches nothing.

Text is escaped so a row is always one line of exactly three ``|``-separated fields: ``\\`` -> ``\\\\``,
``|`` -> ``\\|``, newline -> ``\\n``, carriage return -> ``\\r``, any other control or line-break
character -> ``\\uXXXX``. ``unescape_text`` and ``split_metadata_line`` undo it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from pipeline.manifest import atomic_write_bytes, remove_stale_temps
from worker.errors import BadRecording, DownloadError
from worker.stop import StopSignal

TARGET_RATE_HZ = 22_050
SILENCE_PEAK_DBFS = -60.0
METADATA_NAME = "metadata.csv"
WAVS_DIR_NAME = "wavs"

_READ_BLOCK_FRAMES = 1 << 20
# Resampler: 16 zero crossings each side, Kaiser beta 8 (about 80 dB stop band), pass band to
# 94.5 % of the lower Nyquist frequency, at most 4096 filter phases for awkward rate ratios.
_ZERO_CROSSINGS = 16
_KAISER_BETA = 8.0
_ROLLOFF = 0.945
_MAX_PHASES = 4096
_CHUNK_OUT = 1 << 15
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
    recordings: Sequence[tuple[Path, str]], dataset_dir: Path, stop: StopSignal | None = None
) -> DatasetResult:
    """Write the LJSpeech folder for ``(audio file, text)`` pairs; a no-op when already complete."""
    texts = [text for _, text in recordings]
    metadata = dataset_dir / METADATA_NAME
    if dataset_is_complete(dataset_dir, texts):
        return DatasetResult(metadata, rebuilt=False, notes=("dataset already complete",))
    wavs = dataset_dir / WAVS_DIR_NAME
    wavs.mkdir(parents=True, exist_ok=True)
    metadata.unlink(missing_ok=True)
    remove_stale_temps(wavs)
    remove_stale_temps(dataset_dir)
    notes = []
    for index, (source, _text) in enumerate(recordings):
        if stop is not None:
            stop.raise_if_set()
        samples, rate_hz, channels = decode_mono(source, index)
        resampled = resample(samples, rate_hz, TARGET_RATE_HZ)
        atomic_write_bytes(wavs / f"{utterance_id(index)}.wav", wav_bytes(resampled, TARGET_RATE_HZ))
        notes.append(
            f"{utterance_id(index)}: input {index}, {rate_hz} Hz, {channels} ch, "
            f"{len(samples) / rate_hz:.3f} s -> {len(resampled)} samples at {TARGET_RATE_HZ} Hz"
        )
    atomic_write_bytes(metadata, metadata_bytes(texts))
    return DatasetResult(metadata, rebuilt=True, notes=tuple(notes))


def decode_mono(path: Path, index: int) -> tuple[np.ndarray, int, int]:
    """(mono float32 samples, sample rate, channel count); BadRecording when unusable."""
    blocks = []
    try:
        with sf.SoundFile(str(path)) as audio:
            rate_hz, channels = audio.samplerate, audio.channels
            while True:
                block = audio.read(_READ_BLOCK_FRAMES, dtype="float32", always_2d=True)
                if not len(block):
                    break
                blocks.append(block.mean(axis=1, dtype=np.float64).astype(np.float32))
    except (RuntimeError, TypeError, ValueError) as exc:
        # soundfile's own errors subclass RuntimeError; the message names no URL, only the format.
        raise BadRecording(f"recording {index} is not decodable audio ({_short(exc)})") from None
    except OSError as exc:
        raise DownloadError(f"recording {index}: downloaded file unreadable ({exc.strerror})") from exc
    samples = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.float32)
    if samples.size == 0 or rate_hz <= 0:
        raise BadRecording(f"recording {index} is empty (no audio samples)")
    if not np.all(np.isfinite(samples)):
        raise BadRecording(f"recording {index} holds non-finite samples")
    peak_dbfs = peak_level_dbfs(samples)
    if peak_dbfs < SILENCE_PEAK_DBFS:
        raise BadRecording(
            f"recording {index} is silent (peak {peak_dbfs:.1f} dBFS < {SILENCE_PEAK_DBFS:g} dBFS)"
        )
    return samples, rate_hz, channels


def peak_level_dbfs(samples: np.ndarray) -> float:
    peak = float(np.max(np.abs(samples))) if samples.size else 0.0
    return 20.0 * math.log10(peak) if peak > 0 else -math.inf


def resample(samples: np.ndarray, from_hz: int, to_hz: int) -> np.ndarray:
    """Band-limited resampling by a Kaiser-windowed sinc evaluated per polyphase branch."""
    x = np.asarray(samples, dtype=np.float64)
    if from_hz == to_hz:
        return x.copy()
    g = math.gcd(from_hz, to_hz)
    up, down = to_hz // g, from_hz // g
    n_out = -(-len(x) * up // down)
    # Cut-off in cycles per input sample: below the lower of the two Nyquist frequencies.
    cutoff = 0.5 * min(1.0, up / down) * _ROLLOFF
    half_width = _ZERO_CROSSINGS / (2.0 * cutoff)
    k = int(math.ceil(half_width))
    offsets = np.arange(-k + 1, k + 1)
    phases = min(up, _MAX_PHASES)
    frac = np.arange(phases) / phases
    distance = offsets[None, :] - frac[:, None]
    table = 2.0 * cutoff * np.sinc(2.0 * cutoff * distance) * _kaiser(distance / half_width)
    padded = np.concatenate([np.zeros(k), x, np.zeros(k + 2)])
    out = np.empty(n_out)
    for start in range(0, n_out, _CHUNK_OUT):
        n = np.arange(start, min(start + _CHUNK_OUT, n_out), dtype=np.int64)
        numerator = n * down
        base = numerator // up
        if phases == up:
            phase = numerator % up
        else:
            phase = np.rint((numerator % up) * (phases / up)).astype(np.int64)
            carry = phase == phases
            base = base + carry
            phase[carry] = 0
        taps = padded[base[:, None] + offsets[None, :] + k]
        out[start : start + len(n)] = np.einsum("ij,ij->i", taps, table[phase])
    return out


def _kaiser(u: np.ndarray) -> np.ndarray:
    inside = np.abs(u) <= 1.0
    arg = np.sqrt(np.clip(1.0 - u * u, 0.0, None))
    return np.where(inside, np.i0(_KAISER_BETA * arg) / np.i0(_KAISER_BETA), 0.0)


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)


def wav_bytes(samples: np.ndarray, rate_hz: int) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, to_pcm16(samples), rate_hz, subtype="PCM_16", format="WAV")
    return buffer.getvalue()


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
