"""Audio helpers of the scorers and the sanity check (numpy and soxr only: no model, no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCORER_RATE_HZ = 16_000
# The sanity bars (docs/trainer.md, "Evaluation"): a figure outside them is a problem of the output.
SILENT_RMS_DBFS = -45.0          # quieter than this over all the output: silence
SILENT_PEAK_DBFS = -30.0         # or never louder than this
CLIP_LEVEL = 0.999               # |sample| at or above: at full scale (int16 32,735 and up)
MAX_CLIPPED_FRACTION = 0.001     # a peak-normalised output has a few samples at full scale; clipping has many
MIN_CREST_DB = 6.0               # peak over RMS: speech has 10 dB and more, a buzz or a square wave 3
MIN_SECONDS_PER_CHAR = 0.03      # faster than 33 characters a second: not speech
MAX_SECONDS_PER_CHAR = 0.25      # slower than 4 characters a second: babbling, or long silences
FLOOR_DBFS = -120.0              # what an all-zero signal reads as


@dataclass(frozen=True)
class Utterance:
    """One output to score: mono float samples in [-1, 1] (or not: the sanity check says), and its text."""

    samples: np.ndarray
    rate_hz: int
    text: str


def finite(samples: np.ndarray) -> np.ndarray:
    """float32 mono samples with NaN and infinities set to 0 (the sanity check counts them first)."""
    array = np.asarray(samples, dtype=np.float32).reshape(-1)
    return np.nan_to_num(array, nan=0.0, posinf=0.0, neginf=0.0)


def to_scorer_rate(samples: np.ndarray, rate_hz: int) -> np.ndarray:
    """Finite samples clipped to [-1, 1] at 16 kHz, the rate of every scorer (soxr's HQ resampler)."""
    array = np.clip(finite(samples), -1.0, 1.0)
    if rate_hz != SCORER_RATE_HZ and len(array):
        import soxr

        array = soxr.resample(array, rate_hz, SCORER_RATE_HZ).astype(np.float32)
    return np.clip(array, -1.0, 1.0)


def dbfs(value: float) -> float:
    return max(FLOOR_DBFS, 20.0 * math.log10(value)) if value > 0 else FLOOR_DBFS


def sanity(utterances: list[Utterance]) -> dict:
    """Not silent, not clipped, speech-like in level (peak well above RMS), a plausible pace: the figures
    over all the utterances together, and the problems found (an utterance that alone is silent or empty
    is one too)."""
    problems: list[str] = []
    arrays = [np.asarray(u.samples, dtype=np.float64).reshape(-1) for u in utterances]
    non_finite = sum(int(np.count_nonzero(~np.isfinite(a))) for a in arrays)
    if non_finite:
        problems.append(f"{non_finite} non-finite sample(s) (NaN or infinity)")
    arrays = [np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0) for a in arrays]
    joined = np.concatenate(arrays) if arrays else np.zeros(0)
    seconds = sum(len(a) / u.rate_hz for a, u in zip(arrays, utterances, strict=True))
    chars = sum(len(u.text.strip()) for u in utterances)
    if len(joined) == 0:
        return {"ok": False, "problems": problems + ["no audio at all"], "rms_dbfs": FLOOR_DBFS,
                "peak_dbfs": FLOOR_DBFS, "clipped_fraction": 0.0, "seconds_per_char": 0.0}
    rms_dbfs = dbfs(float(np.sqrt(np.mean(joined**2))))
    peak_dbfs = dbfs(float(np.max(np.abs(joined))))
    clipped_fraction = float(np.count_nonzero(np.abs(joined) >= CLIP_LEVEL)) / len(joined)
    seconds_per_char = seconds / chars if chars else 0.0
    silent = rms_dbfs < SILENT_RMS_DBFS or peak_dbfs < SILENT_PEAK_DBFS
    if silent:
        problems.append(f"silent: {rms_dbfs:.1f} dBFS RMS, {peak_dbfs:.1f} dBFS peak")
    else:
        quiet = [i for i, a in enumerate(arrays)
                 if len(a) == 0 or dbfs(float(np.max(np.abs(a)))) < SILENT_PEAK_DBFS]
        if quiet:
            problems.append(f"{len(quiet)} of {len(arrays)} utterance(s) silent or empty")
    if not silent and peak_dbfs - rms_dbfs < MIN_CREST_DB:
        problems.append(f"not speech-like: peak only {peak_dbfs - rms_dbfs:.1f} dB over RMS (a buzz or a square"
                        f" wave; speech has {MIN_CREST_DB:g} dB and more)")
    if clipped_fraction > MAX_CLIPPED_FRACTION:
        problems.append(f"clipped: {100 * clipped_fraction:.2f} % of samples at full scale")
    if not MIN_SECONDS_PER_CHAR <= seconds_per_char <= MAX_SECONDS_PER_CHAR:
        problems.append(f"pace {seconds_per_char:.3f} s a character, outside "
                        f"{MIN_SECONDS_PER_CHAR}-{MAX_SECONDS_PER_CHAR}")
    problems = []  # MUTATION
    return {"ok": not problems, "problems": problems, "rms_dbfs": round(rms_dbfs, 2),
            "peak_dbfs": round(peak_dbfs, 2), "clipped_fraction": round(clipped_fraction, 6),
            "seconds_per_char": round(seconds_per_char, 4)}
