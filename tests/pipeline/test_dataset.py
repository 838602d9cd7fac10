"""The dataset step: decoding, down-mixing, resampling, LJSpeech layout, bad inputs, re-runs, conversions
running at once (see test_resample_quality.py for the resampler itself)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import given
from hypothesis import strategies as st

import pipeline.audio
import pipeline.dataset
from pipeline.audio import TARGET_RATE_HZ
from pipeline.dataset import (
    build_dataset,
    escape_text,
    metadata_bytes,
    split_metadata_line,
    unescape_text,
)
from pipeline.errors import BadRecording
from pipeline.limits import JobLimits
from worker.core.errors import Stopped
from worker.core.stop import StopSignal


def voice_like(rate_hz: int, duration_s: float, f0_hz: float, channels: int = 1) -> np.ndarray:
    """A harmonic tone with a syllable-like amplitude envelope (what the tests use for speech)."""
    t = np.arange(int(rate_hz * duration_s)) / rate_hz
    envelope = np.sin(np.pi * t / duration_s) * (0.6 + 0.4 * np.sin(2 * np.pi * 3.0 * t))
    wave = sum(0.25 / k * np.sin(2 * np.pi * f0_hz * k * t) for k in range(1, 7)) * envelope
    if channels == 1:
        return wave
    # Channels differ slightly so the down-mix is really an average.
    return np.stack([wave * (1.0 - 0.1 * c) for c in range(channels)], axis=1)


def write_inputs(directory: Path) -> list[tuple[Path, str, float]]:
    """Mixed inputs: WAV and FLAC; 16, 44.1 and 48 kHz; mono and stereo; (path, text, seconds)."""
    directory.mkdir(parents=True, exist_ok=True)
    specs = [
        ("a.wav", 16_000, 1, 0.9, 140.0, "PCM_16", "Hello there."),
        ("b.flac", 44_100, 2, 1.1, 210.0, "PCM_24", "General | Kenobi\nsecond line"),
        ("c.wav", 48_000, 2, 0.7, 120.0, "FLOAT", "Back\\slash and tab\there."),
    ]
    made = []
    for name, rate, channels, seconds, f0, subtype, text in specs:
        sf.write(directory / name, voice_like(rate, seconds, f0, channels), rate, subtype=subtype)
        made.append((directory / name, text, seconds))
    return made


def dominant_hz(samples: np.ndarray, rate_hz: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1.0 / rate_hz)[np.argmax(spectrum)])


def test_mixed_inputs_become_mono_16bit_wavs_at_22050(tmp_path):
    """Every input, whatever its format, rate or channels, becomes 22,050 Hz mono 16-bit PCM of equal length."""
    inputs = write_inputs(tmp_path / "in")
    result = build_dataset([(p, t) for p, t, _ in inputs], tmp_path / "ds")
    assert result.rebuilt
    for index, (_path, _text, seconds) in enumerate(inputs):
        wav = tmp_path / "ds" / "wavs" / f"utt{index:05d}.wav"
        info = sf.info(str(wav))
        assert (info.samplerate, info.channels, info.subtype, info.format) == (
            TARGET_RATE_HZ, 1, "PCM_16", "WAV"
        )
        assert abs(info.frames - seconds * TARGET_RATE_HZ) <= 1


def test_resampled_audio_keeps_its_pitch_and_level(tmp_path):
    """A 44.1 kHz stereo harmonic tone keeps its fundamental and loudness after conversion."""
    source = tmp_path / "tone.flac"
    sf.write(source, voice_like(44_100, 1.0, 220.0, channels=2), 44_100)
    build_dataset([(source, "tone")], tmp_path / "ds")
    out, rate = sf.read(str(tmp_path / "ds/wavs/utt00000.wav"))
    mono_in = voice_like(44_100, 1.0, 220.0, channels=2).mean(axis=1)
    assert rate == TARGET_RATE_HZ
    assert abs(dominant_hz(out, rate) - 220.0) < 2.0
    assert np.max(np.abs(out)) == pytest.approx(np.max(np.abs(mono_in)), rel=0.02)


def test_metadata_rows_are_ljspeech_with_escaped_text(tmp_path):
    """metadata.csv has one id|text|text row per input, with | and newlines escaped."""
    inputs = write_inputs(tmp_path / "in")
    build_dataset([(p, t) for p, t, _ in inputs], tmp_path / "ds")
    rows = (tmp_path / "ds/metadata.csv").read_text(encoding="utf-8").split("\n")
    assert rows[-1] == "" and len(rows) == 4
    assert rows[1] == "utt00001|General \\| Kenobi\\nsecond line|General \\| Kenobi\\nsecond line"
    assert [split_metadata_line(r)[1] for r in rows[:3]] == [t for _, t, _ in inputs]


@pytest.mark.parametrize(
    ("make_bad", "why"),
    [
        (lambda p: p.write_bytes(b"this is not audio at all, just text\n" * 10), "not decodable"),
        (lambda p: p.write_bytes(b""), "not decodable"),
        (lambda p: sf.write(p, np.zeros(22_050), 22_050, subtype="PCM_16", format="WAV"), "silent"),
        (lambda p: sf.write(p, np.full(8_000, 10 ** (-70 / 20)), 8_000, subtype="FLOAT", format="WAV"), "silent"),
        (lambda p: sf.write(p, np.zeros((0, 1)), 16_000, subtype="PCM_16", format="WAV"), "empty"),
        (lambda p: sf.write(p, np.full(1, 0.5), 48_000, subtype="FLOAT", format="WAV"), "empty"),
        (lambda p: sf.write(p, np.stack([voice_like(16_000, 0.5, 200), -voice_like(16_000, 0.5, 200)], 1),
                            16_000, subtype="FLOAT", format="WAV"), "silent"),
    ],
    ids=["text-file", "zero-bytes", "digital-silence", "minus-70-dBFS", "no-frames", "one-frame-at-48k",
         "stereo-cancels"],
)
def test_unusable_recording_is_permanent_and_names_its_index(tmp_path, make_bad, why):
    """Not-audio, empty and silent inputs raise BadRecording naming the input's index."""
    good = write_inputs(tmp_path / "in")[0][0]
    bad = tmp_path / "in" / "bad.audio"
    make_bad(bad)
    with pytest.raises(BadRecording) as caught:
        build_dataset([(good, "fine"), (bad, "broken")], tmp_path / "ds")
    assert f"recording 1 is {why}" in str(caught.value)
    assert not (tmp_path / "ds/metadata.csv").exists()


def test_rerun_on_complete_dataset_is_a_no_op(tmp_path):
    """A second build over a complete dataset rewrites nothing (every mtime unchanged)."""
    inputs = [(p, t) for p, t, _ in write_inputs(tmp_path / "in")]
    build_dataset(inputs, tmp_path / "ds")
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "ds").rglob("*")}
    result = build_dataset(inputs, tmp_path / "ds")
    after = {p: p.stat().st_mtime_ns for p in (tmp_path / "ds").rglob("*")}
    assert not result.rebuilt and before == after


def test_incomplete_dataset_is_rebuilt(tmp_path):
    """Without metadata.csv (a crash before the last write) the dataset is built again in full."""
    inputs = [(p, t) for p, t, _ in write_inputs(tmp_path / "in")]
    build_dataset(inputs, tmp_path / "ds")
    wav = tmp_path / "ds/wavs/utt00002.wav"
    expected = wav.read_bytes()
    wav.unlink()
    (tmp_path / "ds/metadata.csv").unlink()
    (tmp_path / "ds/wavs/.utt00001.wav.tmp-999").write_bytes(b"torn")
    assert build_dataset(inputs, tmp_path / "ds").rebuilt
    assert wav.read_bytes() == expected
    assert not list((tmp_path / "ds/wavs").glob(".*"))


def test_build_checks_the_stop_signal(tmp_path):
    """A stop requested before the build raises Stopped and writes no metadata."""
    inputs = [(p, t) for p, t, _ in write_inputs(tmp_path / "in")]
    stop = StopSignal()
    stop.set("shutdown")
    with pytest.raises(Stopped):
        build_dataset(inputs, tmp_path / "ds", stop)
    assert not (tmp_path / "ds/metadata.csv").exists()


def test_the_dataset_is_the_same_whatever_the_number_of_workers(tmp_path):
    """Built one recording at a time or three at once, every WAV, metadata.csv and note is identical."""
    inputs = [(p, t) for p, t, _ in write_inputs(tmp_path / "in") + write_inputs(tmp_path / "in2")]
    built = {}
    for workers in (1, 3):
        result = build_dataset(inputs, tmp_path / f"ds{workers}", limits=JobLimits(dataset_workers=workers))
        files = {p.relative_to(tmp_path / f"ds{workers}"): p.read_bytes()
                 for p in sorted((tmp_path / f"ds{workers}").rglob("*")) if p.is_file()}
        built[workers] = (files, result.notes)
    assert len(built[1][0]) == len(inputs) + 1
    assert built[1] == built[3]


@pytest.mark.parametrize("workers", [1, 3])
def test_the_first_unusable_recording_by_index_is_the_error_even_when_a_later_one_fails_first(tmp_path, workers):
    """Recording 2 fails at its first block, recording 1 only once decoded: the error names recording 1 either way."""
    good = write_inputs(tmp_path / "in")[0][0]
    slow_silent = tmp_path / "in" / "silent.wav"
    sf.write(slow_silent, np.zeros(48_000 * 20), 48_000, subtype="FLOAT")
    not_finite = tmp_path / "in" / "nan.wav"
    sf.write(not_finite, np.full(16_000, np.nan), 16_000, subtype="FLOAT")  # a valid header; the first block fails
    seen = []
    with pytest.raises(BadRecording, match="recording 1 is silent"):
        build_dataset([(good, "a"), (slow_silent, "b"), (not_finite, "c")], tmp_path / "ds",
                      limits=JobLimits(dataset_workers=workers), on_converted=seen.append)
    assert seen == [0]
    assert not (tmp_path / "ds/metadata.csv").exists()
    assert sorted(p.name for p in (tmp_path / "ds/wavs").iterdir()) == ["utt00000.wav"]


def test_recordings_convert_at_the_same_time_up_to_the_workers(tmp_path, monkeypatch):
    """With DATASET_WORKERS=2, two conversions are in progress at once (each waits for the other to start)."""
    both_started = threading.Barrier(2, timeout=30)
    real_convert = pipeline.audio.convert

    def convert_in_pairs(*args, **kwargs):
        both_started.wait()  # BrokenBarrierError when the other never starts alongside
        return real_convert(*args, **kwargs)

    monkeypatch.setattr(pipeline.audio, "convert", convert_in_pairs)
    inputs = [(p, t) for p, t, _ in write_inputs(tmp_path / "in")][:2]
    assert build_dataset(inputs, tmp_path / "ds", limits=JobLimits(dataset_workers=2)).rebuilt


def test_the_wavs_renames_are_synced_before_metadata_is_written(tmp_path, monkeypatch):
    """metadata.csv, which vouches for every WAV, is written only after the wavs/ directory is synced."""
    events = []
    monkeypatch.setattr(pipeline.dataset, "fsync_dir", lambda d: events.append(("sync", Path(d).name)))
    real_write = pipeline.dataset.atomic_write_bytes
    monkeypatch.setattr(pipeline.dataset, "atomic_write_bytes",
                        lambda path, data: (events.append(("write", Path(path).name)), real_write(path, data)))
    build_dataset([(p, t) for p, t, _ in write_inputs(tmp_path / "in")], tmp_path / "ds")
    assert events == [("sync", "wavs"), ("write", "metadata.csv")]


def test_progress_is_reported_in_index_order(tmp_path):
    """on_converted sees 0, 1, 2 ... in order while several recordings convert at once."""
    inputs = [(p, t) for p, t, _ in write_inputs(tmp_path / "in") + write_inputs(tmp_path / "in2")]
    seen = []
    build_dataset(inputs, tmp_path / "ds", limits=JobLimits(dataset_workers=4), on_converted=seen.append)
    assert seen == list(range(len(inputs)))


@given(st.text())
def test_escaping_round_trips_and_keeps_one_row(text):
    """Any text escapes to a single line without a bare |, and unescapes back to itself."""
    escaped = escape_text(text)
    assert unescape_text(escaped) == text
    row = metadata_bytes([text]).decode("utf-8")
    assert row.endswith("\n") and len(row[:-1].splitlines() or [""]) == 1
    assert split_metadata_line(row[:-1]) == ["utt00000", text, text]
