"""librosa's mel spectrogram in numpy: the features of Resemblyzer and DNSMOS without librosa's STFT.

librosa 0.11 compiles numba kernels when its core is first imported (``librosa.core.audio`` builds
``guvectorize`` functions eagerly), some 10-25 s of CPU in every fresh process, since the stage's numba
cache lives in the job's checkpoint directory. These functions give the same numbers
(``librosa.feature.melspectrogram`` with its defaults: centred frames padded with zeros, a periodic Hann
window, power 2, Slaney's mel scale and area normalisation; tests/test_evaluate_scoring.py compares them).
"""

from __future__ import annotations

import numpy as np


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default, htk=False): linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    f_sp = 200.0 / 3
    mels = hz / f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    above = hz >= min_log_hz
    mels = np.where(above, min_log_mel + np.log(np.maximum(hz, min_log_hz) / min_log_hz) / logstep, mels)
    return mels


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, dtype=np.float64)
    f_sp = 200.0 / 3
    freqs = f_sp * mels
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    return np.where(mels >= min_log_mel, min_log_hz * np.exp(logstep * (mels - min_log_mel)), freqs)


def mel_filters(rate_hz: int, n_fft: int, n_mels: int) -> np.ndarray:
    """``librosa.filters.mel(sr, n_fft, n_mels)``: triangles from 0 Hz to Nyquist, Slaney-normalised."""
    fftfreqs = np.fft.rfftfreq(n=n_fft, d=1.0 / rate_hz)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(rate_hz / 2.0), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = np.subtract.outer(mel_f, fftfreqs)
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_f[2 : n_mels + 2] - mel_f[:n_mels])
    return (weights * enorm[:, None]).astype(np.float32)


def power_spectrogram(y: np.ndarray, n_fft: int, hop_length: int) -> np.ndarray:
    """``|librosa.stft(y, n_fft, hop_length)|**2``: (1 + n_fft // 2, frames)."""
    y = np.asarray(y, dtype=np.float32)
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)).astype(np.float32)  # periodic Hann
    padded = np.pad(y, (n_fft // 2, n_fft // 2), mode="constant")
    if len(padded) < n_fft:
        padded = np.pad(padded, (0, n_fft - len(padded)))
    count = 1 + (len(padded) - n_fft) // hop_length
    frames = np.lib.stride_tricks.as_strided(padded, shape=(count, n_fft),
                                             strides=(padded.strides[0] * hop_length, padded.strides[0]))
    spectrum = np.fft.rfft(frames * window, n=n_fft, axis=1)
    return (np.abs(spectrum) ** 2).T.astype(np.float32)


def melspectrogram(y: np.ndarray, rate_hz: int, n_fft: int, hop_length: int, n_mels: int) -> np.ndarray:
    """``librosa.feature.melspectrogram(y=y, sr=rate_hz, n_fft=n_fft, hop_length=hop_length, n_mels=n_mels)``."""
    return mel_filters(rate_hz, n_fft, n_mels) @ power_spectrogram(y, n_fft, hop_length)


def power_to_db(spectrogram: np.ndarray, top_db: float = 80.0, amin: float = 1e-10) -> np.ndarray:
    """``librosa.power_to_db(S, ref=np.max)``."""
    log_spec = 10.0 * np.log10(np.maximum(amin, spectrogram))
    log_spec -= 10.0 * np.log10(np.maximum(amin, np.max(spectrogram)))
    return np.maximum(log_spec, log_spec.max() - top_db)
