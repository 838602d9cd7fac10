"""Clipping in the dataset's conversion is counted and reported, never hidden (pipeline/audio.py)."""

from __future__ import annotations

import numpy as np
import soundfile as sf

from pipeline.audio import convert


def write_wav(path, samples: np.ndarray, rate_hz: int) -> None:
    sf.write(str(path), samples, rate_hz, subtype="PCM_16")


def converted(tmp_path, samples: np.ndarray, rate_hz: int):
    source = tmp_path / "in.wav"
    write_wav(source, samples, rate_hz)
    return convert(source, tmp_path / "out.wav", 0, max_seconds=60, job_seconds_left=60)


def tone(rate_hz: int, amplitude: float) -> np.ndarray:
    t = np.arange(rate_hz) / rate_hz
    return np.clip(amplitude * np.sin(2 * np.pi * 220 * t), -1.0, 1.0)


def test_a_clipped_recording_reports_its_full_scale_samples(tmp_path):
    """A tone driven 3x past full scale at 44.1 kHz comes out with its clipped samples counted."""
    done = converted(tmp_path, tone(44_100, 3.0), 44_100)
    written = sf.read(str(tmp_path / "out.wav"), dtype="int16")[0]
    at_limits = int(np.count_nonzero((written == 32767) | (written <= -32767)))
    assert done.full_scale_samples == at_limits > 0.3 * len(written)
    assert 0.3 < done.full_scale_fraction < 1.0


def test_a_recording_with_headroom_reports_no_clipping(tmp_path):
    """A tone at -6 dBFS, resampled, has no sample at full scale."""
    done = converted(tmp_path, tone(44_100, 0.5), 44_100)
    assert done.full_scale_samples == 0 and done.full_scale_fraction == 0.0


def test_the_dataset_notes_name_a_clipped_recording_and_not_a_clean_one(tmp_path):
    """The dataset step's note for each recording says how many samples sit at full scale, when any do."""
    from pipeline.dataset import build_dataset

    loud, soft = tmp_path / "loud.wav", tmp_path / "soft.wav"
    write_wav(loud, tone(44_100, 3.0), 44_100)
    write_wav(soft, tone(44_100, 0.5), 44_100)
    notes = build_dataset([(loud, "loud"), (soft, "soft")], tmp_path / "ds").notes
    assert "at full scale" in notes[0] and "clipped" in notes[0]
    assert "full scale" not in notes[1]
