"""The dataset's resampler (soxr HQ, fed block by block): a sine keeps its shape, level and timing through
the pass band, what lies above the new Nyquist frequency is gone, and the blocks' split changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from pipeline.audio import TARGET_RATE_HZ, convert, resample_blocks, to_pcm16

AMPLITUDE = 0.5


def sine(f_hz: float, rate_hz: int, seconds: float = 1.0) -> np.ndarray:
    return (AMPLITUDE * np.sin(2 * np.pi * f_hz * np.arange(int(rate_hz * seconds)) / rate_hz)).astype(np.float32)


def resampled(x: np.ndarray, rate_hz: int, block: int | None = None) -> np.ndarray:
    blocks = [x] if block is None else [x[i : i + block] for i in range(0, len(x), block)]
    return np.concatenate(list(resample_blocks(blocks, rate_hz))).astype(np.float64)


def middle(y: np.ndarray) -> slice:
    """The central 80 %: every output there is a full filter length away from the signal's edges."""
    return slice(len(y) // 10, len(y) - len(y) // 10)


def snr_db(y: np.ndarray, f_hz: float) -> float:
    """Tone power over the power of the difference from the ideal tone at 22,050 Hz (same amplitude, no delay)."""
    m = middle(y)
    ideal = AMPLITUDE * np.sin(2 * np.pi * f_hz * np.arange(len(y)) / TARGET_RATE_HZ)
    return float(10 * np.log10(np.mean(ideal[m] ** 2) / np.mean((y[m] - ideal[m]) ** 2)))


def fitted(y: np.ndarray, f_hz: float) -> tuple[float, float, float]:
    """(noise and distortion below the best-fitting tone in dB, its gain in dB, its delay in output samples)."""
    m = middle(y)
    t = np.arange(len(y))[m] / TARGET_RATE_HZ
    basis = np.stack([np.sin(2 * np.pi * f_hz * t), np.cos(2 * np.pi * f_hz * t)], axis=1)
    (s, c), *_ = np.linalg.lstsq(basis, y[m], rcond=None)
    tone = basis @ (s, c)
    residual_db = 10 * np.log10(np.mean(tone**2) / np.mean((y[m] - tone) ** 2))
    delay = -np.arctan2(c, s) / (2 * np.pi * f_hz) * TARGET_RATE_HZ
    return float(residual_db), float(20 * np.log10(np.hypot(s, c) / AMPLITUDE)), float(delay)


def level_db(y: np.ndarray) -> float:
    """RMS left of a 0.5-amplitude tone, relative to its input RMS."""
    return float(20 * np.log10(np.sqrt(np.mean(y[middle(y)] ** 2)) / (AMPLITUDE / np.sqrt(2))))


@pytest.mark.parametrize("f_hz", [1_000, 9_000, 10_000])
def test_44k1_to_22k05_keeps_a_passband_sine_within_120_db_of_the_ideal(f_hz):
    """44.1 kHz -> 22,050 Hz: a 1, 9 or 10 kHz sine differs from the ideal one by 120 dB less than its power."""
    assert snr_db(resampled(sine(f_hz, 44_100), 44_100), f_hz) >= 120.0  # the hand-written one: 49.8 and 12.4 dB at 9 and 10 kHz


@pytest.mark.parametrize("rate_hz", [8_000, 16_000, 32_000, 44_100, 48_000, 96_000, 192_000])
def test_every_rate_keeps_shape_level_and_timing_through_the_passband(rate_hz):
    """From any rate, tones up to 10 kHz come out with noise and distortion 120 dB down, within 0.01 dB, undelayed."""
    for f_hz in (f for f in (100, 1_000, 3_000, 7_900, 9_000, 10_000) if f < 0.45 * rate_hz):
        residual_db, gain_db, delay = fitted(resampled(sine(f_hz, rate_hz), rate_hz), f_hz)
        assert residual_db >= 120.0, (f_hz, residual_db)
        assert abs(gain_db) <= 0.01, (f_hz, gain_db)
        assert abs(delay) <= 1e-3, (f_hz, delay)


@pytest.mark.parametrize("rate_hz", [44_100, 48_000, 192_000])
def test_tones_above_the_new_nyquist_frequency_are_rejected_by_130_db(rate_hz):
    """11.2, 12, 15 and 20 kHz tones (above 11,025 Hz) come out at least 130 dB down instead of aliasing into the band."""
    for f_hz in (11_200, 12_000, 15_000, 20_000):
        assert level_db(resampled(sine(f_hz, rate_hz), rate_hz)) <= -130.0, f_hz  # hand-written at 15 kHz: -118 dB


@pytest.mark.parametrize("rate_hz", [8_000, 16_000, 22_050, 44_101, 48_000, 192_000])
def test_block_by_block_equals_one_call_over_the_whole_signal(rate_hz):
    """Fed in blocks of any size, the stream gives exactly the samples of one call, about N x 22,050 / rate of them."""
    rng = np.random.default_rng(rate_hz)
    x = (0.1 * rng.standard_normal(int(rate_hz * 0.3) + 7)).astype(np.float32)
    whole = resampled(x, rate_hz)
    for block in (1, 333, 4096):
        assert np.array_equal(resampled(x, rate_hz, block), whole)
    assert abs(len(whole) - len(x) * TARGET_RATE_HZ / rate_hz) <= 1


def test_a_dataset_wav_is_the_resampled_mono_signal_in_16_bits(tmp_path):
    """``convert`` writes exactly the resampler's output of the down-mixed input, rounded to 16-bit PCM."""
    rate_hz = 44_100
    stereo = np.stack([sine(440, rate_hz, 2.0), 0.5 * sine(9_000, rate_hz, 2.0)], axis=1)
    source = tmp_path / "in.wav"
    sf.write(source, stereo, rate_hz, subtype="FLOAT")
    convert(source, tmp_path / "out.wav", 0, max_seconds=10, job_seconds_left=10)
    written, rate = sf.read(str(tmp_path / "out.wav"), dtype="int16")
    mono = stereo.mean(axis=1, dtype=np.float64).astype(np.float32)
    assert rate == TARGET_RATE_HZ
    assert np.array_equal(written, to_pcm16(np.concatenate(list(resample_blocks([mono], rate_hz)))))
