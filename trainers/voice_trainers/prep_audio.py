"""The signal side of data preparation (numpy, soxr and webrtcvad: no model, no torch).

A recording is judged on 30 ms frames that webrtcvad calls speech or not (at 16 kHz, one of the rates it
accepts); every position below is a sample index at the dataset's own rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

VAD_RATE_HZ = 16_000
FRAME_S = 0.03
# webrtcvad's 0..3: 2 keeps soft word ends that 3 cuts, and still calls a clean pause silence.
VAD_AGGRESSIVENESS = 2
# Silence kept before the first and after the last speech frame: Piper's VAD trim keeps 0.25 s, VITS
# recipes about 0.2 s; less clips word onsets the VAD calls silence.
PAD_S = 0.2
# A gap of at least this much silence between speech frames is a pause a recording may be cut at.
MIN_PAUSE_S = 0.3
TARGET_RMS_DBFS = -20.0
MAX_PEAK_DBFS = -1.0
# |sample| at or above this is at full scale (int16 32,735 and up), as the evaluate stage's sanity check.
CLIP_LEVEL = 0.999
NOISE_PERCENTILE = 10
SNR_CAP_DB = 100.0


@dataclass(frozen=True)
class Voicing:
    """The frames of one recording that webrtcvad calls speech, with their sample bounds."""

    speech: np.ndarray  # bool per frame
    frame_len: int  # samples per frame at the recording's rate, rounded (for levels only)
    rate_hz: int

    def bounds(self, frame: int) -> tuple[int, int]:
        """The frame's samples, from its exact times: a rounded frame length drifts (22,050 Hz: 0.5 sample
        a frame, 0.45 s in ten minutes)."""
        return round(frame * FRAME_S * self.rate_hz), round((frame + 1) * FRAME_S * self.rate_hz)


def voicing(samples: np.ndarray, rate_hz: int) -> Voicing:
    """webrtcvad's verdict on each 30 ms frame of ``samples`` (float in [-1, 1])."""
    import soxr
    import webrtcvad

    vad = webrtcvad.Vad(VAD_AGGRESSIVENESS)
    audio = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    at_vad_rate = soxr.resample(audio, rate_hz, VAD_RATE_HZ) if rate_hz != VAD_RATE_HZ and len(audio) else audio
    pcm = (np.clip(at_vad_rate, -1.0, 1.0) * 32767).astype(np.int16)
    vad_frame = int(VAD_RATE_HZ * FRAME_S)
    count = len(pcm) // vad_frame
    speech = np.array([vad.is_speech(pcm[i * vad_frame:(i + 1) * vad_frame].tobytes(), VAD_RATE_HZ)
                       for i in range(count)], dtype=bool)
    return Voicing(speech=speech, frame_len=int(round(rate_hz * FRAME_S)), rate_hz=rate_hz)


def trimmed(voiced: Voicing, start: int, end: int, rate_hz: int, total: int) -> tuple[int, int] | None:
    """Sample bounds of the speech in frames ``[start, end)`` with ``PAD_S`` around it (never past the
    recording), or None when there is no speech frame there."""
    frames = np.flatnonzero(voiced.speech[start:end])
    if len(frames) == 0:
        return None
    pad = int(PAD_S * rate_hz)
    first, last = start + int(frames[0]), start + int(frames[-1])
    return max(0, voiced.bounds(first)[0] - pad), min(total, voiced.bounds(last)[1] + pad)


def pauses(voiced: Voicing) -> list[tuple[int, float]]:
    """The pauses between the first and the last speech frame: (middle frame, seconds), in order."""
    frames = np.flatnonzero(voiced.speech)
    if len(frames) == 0:
        return []
    found = []
    run_start = None
    for index in range(int(frames[0]), int(frames[-1]) + 1):
        if not voiced.speech[index]:
            run_start = index if run_start is None else run_start
            continue
        if run_start is not None:
            seconds = (index - run_start) * FRAME_S
            if seconds >= MIN_PAUSE_S:
                found.append(((run_start + index) // 2, seconds))
            run_start = None
    return found


def clipped_fraction(samples: np.ndarray) -> float:
    return float(np.count_nonzero(np.abs(samples) >= CLIP_LEVEL)) / max(1, len(samples))


def snr_db(samples: np.ndarray, voiced: Voicing) -> float | None:
    """Mean power of the speech frames over the power of the recording's quietest frames
    (``NOISE_PERCENTILE``), in dB, capped at ``SNR_CAP_DB``; None for a recording shorter than a frame.

    Not webrtcvad's non-speech frames: it calls steady noise speech, and soft consonants silence. The
    quietest tenth of a recording is its pauses; in one cut tight to its speech, its quietest sounds, which
    in a clean recording still lie well above the noise floor.
    """
    count = min(len(voiced.speech), len(samples) // voiced.frame_len)
    if count == 0:
        return None
    frames = np.asarray(samples[:count * voiced.frame_len], dtype=np.float64).reshape(count, voiced.frame_len)
    power = np.mean(frames**2, axis=1)
    speech = voiced.speech[:count]
    signal = float(np.mean(power[speech] if np.any(speech) else power))
    noise = float(np.percentile(power, NOISE_PERCENTILE))
    if noise <= 0:
        return SNR_CAP_DB
    return min(SNR_CAP_DB, 10 * math.log10(max(signal, 1e-20) / noise))


def normalised(samples: np.ndarray) -> np.ndarray:
    """``samples`` scaled to ``TARGET_RMS_DBFS`` RMS, then down to ``MAX_PEAK_DBFS`` peak when louder."""
    audio = np.asarray(samples, dtype=np.float64)
    rms = float(np.sqrt(np.mean(audio**2))) if len(audio) else 0.0
    if rms == 0:
        return audio.astype(np.float32)
    audio = audio * (10 ** (TARGET_RMS_DBFS / 20) / rms)
    peak = float(np.max(np.abs(audio)))
    limit = 10 ** (MAX_PEAK_DBFS / 20)
    if peak > limit:
        audio = audio * (limit / peak)
    return audio.astype(np.float32)
