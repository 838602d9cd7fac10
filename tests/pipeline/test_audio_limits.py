"""Decode bombs and limits: every recording is judged from its header before any sample is decoded,
the caps hold again on the frames actually decoded, and memory does not grow with a recording's length."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import pipeline.audio
from pipeline.audio import AudioHeader, convert
from pipeline.dataset import build_dataset
from pipeline.errors import BadRecording
from pipeline.limits import JobLimits
from tests.pipeline.test_dataset import voice_like
from worker.core.errors import ConfigError
from worker.settings import load_settings

REPO = Path(__file__).resolve().parents[2]

# Decoding either bomb below would allocate tens of megabytes at least; refusing it from the header
# allocates next to nothing.
HEADER_ONLY_PEAK_BYTES = 1_000_000


def tone(path: Path, rate_hz: int = 16_000, seconds: float = 0.5, channels: int = 1, **write_args) -> Path:
    sf.write(path, voice_like(rate_hz, seconds, 150.0, channels), rate_hz, **write_args)
    return path


def constant_flac(path: Path, seconds: float, rate_hz: int = 8_000) -> Path:
    """A loud constant signal: FLAC stores it in a few bytes per block, so hours fit in kilobytes."""
    block = np.full(1 << 20, 0.5, dtype=np.float32)
    left = int(seconds * rate_hz)
    with sf.SoundFile(path, "w", rate_hz, 1, "PCM_16", format="FLAC") as out:
        while left > 0:
            out.write(block[: min(left, len(block))])
            left -= len(block)
    return path


def peak_allocated(fn) -> int:
    """The most memory Python and numpy held at once while ``fn`` ran (tracemalloc sees both)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def refusal(fn) -> tuple[str, int]:
    """(message of the BadRecording ``fn`` raises, peak memory until then)."""
    caught = []

    def run() -> None:
        with pytest.raises(BadRecording) as raised:
            fn()
        caught.append(str(raised.value))

    peak = peak_allocated(run)
    return caught[0], peak


def test_a_one_hz_wav_is_refused_from_its_header(tmp_path):
    """A 2 KB WAV declaring 1 Hz (1,000 s, 22 million output samples) is refused before anything is decoded."""
    bomb = tmp_path / "bomb.wav"
    sf.write(bomb, np.full(1000, 0.5), 1, subtype="PCM_16")
    assert bomb.stat().st_size < 2100
    good = tone(tmp_path / "good.wav")
    message, peak = refusal(lambda: build_dataset([(good, "ok"), (bomb, "bomb")], tmp_path / "ds"))
    assert "recording 1 has a sample rate of 1 Hz, outside 8000-192000 Hz" in message
    assert peak < HEADER_ONLY_PEAK_BYTES
    assert not (tmp_path / "ds" / "wavs").exists()  # not even the good recording was decoded


def test_a_long_constant_flac_is_refused_from_its_header(tmp_path):
    """A ~45 KB FLAC holding 1,801 s of a constant is over MAX_RECORDING_SECONDS and never decoded."""
    bomb = constant_flac(tmp_path / "bomb.flac", 1801)
    assert bomb.stat().st_size < 100_000
    good = tone(tmp_path / "good.wav")
    message, peak = refusal(lambda: build_dataset([(good, "ok"), (bomb, "bomb")], tmp_path / "ds"))
    assert "recording 1 is 1801 s long, over the limit of 1800 s (MAX_RECORDING_SECONDS)" in message
    assert peak < HEADER_ONLY_PEAK_BYTES  # decoding it would take 58 MB as float32 alone


def test_the_job_audio_total_is_capped_across_recordings(tmp_path):
    """Recordings each under their own cap are refused together once their sum passes MAX_JOB_AUDIO_SECONDS."""
    inputs = [(tone(tmp_path / f"{i}.wav", seconds=1.0), f"t{i}") for i in range(3)]
    limits = JobLimits(max_recording_seconds=1.5, max_job_audio_seconds=2.5)
    with pytest.raises(BadRecording, match=r"recording 2 takes the job's audio to 3 s, .*MAX_JOB_AUDIO_SECONDS"):
        build_dataset(inputs, tmp_path / "ds", limits=limits)
    assert not (tmp_path / "ds" / "wavs").exists()
    assert build_dataset(inputs[:2], tmp_path / "ds2", limits=limits).rebuilt


def test_a_recording_exactly_at_the_caps_is_accepted(tmp_path):
    """The caps are inclusive: a 1.0 s recording passes limits of 1.0 s each."""
    source = tone(tmp_path / "one.wav", seconds=1.0)
    assert build_dataset([(source, "x")], tmp_path / "ds",
                         limits=JobLimits(max_recording_seconds=1.0, max_job_audio_seconds=1.0)).rebuilt


@pytest.mark.parametrize(
    ("max_seconds", "job_left", "named"),
    [(1.0, 100.0, "MAX_RECORDING_SECONDS"), (100.0, 1.0, "MAX_JOB_AUDIO_SECONDS")],
)
def test_decoding_counts_frames_whatever_the_header_said(tmp_path, max_seconds, job_left, named):
    """The decode loop stops at a cap on the frames it counted, leaving no output or temp file."""
    source = tone(tmp_path / "three.wav", seconds=3.0)
    dest = tmp_path / "out" / "utt.wav"
    dest.parent.mkdir()
    with pytest.raises(BadRecording, match=f"recording 4 .*{named}"):
        convert(source, dest, 4, max_seconds=max_seconds, job_seconds_left=job_left)
    assert list(dest.parent.iterdir()) == []


@pytest.mark.parametrize(
    ("write_args", "accepted"),
    [({"format": "WAV"}, True), ({"format": "WAVEX"}, True), ({"format": "FLAC"}, True),
     ({"format": "OGG"}, True), ({"format": "MP3"}, True), ({"format": "AIFF"}, False),
     ({"format": "AU"}, False), ({"format": "RF64"}, False), ({"format": "CAF"}, False)],
    ids=lambda v: v["format"] if isinstance(v, dict) else str(v),
)
def test_only_wav_flac_ogg_and_mp3_containers_are_accepted(tmp_path, write_args, accepted):
    """WAV (plain or extensible), FLAC, OGG and MP3 convert; other containers libsndfile reads are refused."""
    source = tone(tmp_path / "in.audio", **write_args)
    if accepted:
        assert build_dataset([(source, "x")], tmp_path / "ds").rebuilt
    else:
        with pytest.raises(BadRecording, match=f"recording 0 is {write_args['format']} audio; accepted: "):
            build_dataset([(source, "x")], tmp_path / "ds")


@pytest.mark.parametrize(("rate_hz", "accepted"), [(7_999, False), (8_000, True), (192_000, True), (192_001, False)])
def test_sample_rates_from_8_to_192_khz_are_accepted(tmp_path, rate_hz, accepted):
    """The rate bounds are inclusive; a rate outside them is refused naming the rate."""
    source = tone(tmp_path / "in.wav", rate_hz=rate_hz, seconds=0.1)
    if accepted:
        assert build_dataset([(source, "x")], tmp_path / "ds").rebuilt
    else:
        with pytest.raises(BadRecording, match=f"recording 0 has a sample rate of {rate_hz} Hz"):
            build_dataset([(source, "x")], tmp_path / "ds")


def test_more_than_eight_channels_are_refused(tmp_path):
    """A 9-channel file is refused from its header (8 channels still convert)."""
    nine = tone(tmp_path / "nine.wav", channels=9, seconds=0.1)
    eight = tone(tmp_path / "eight.wav", channels=8, seconds=0.1)
    with pytest.raises(BadRecording, match="recording 1 has 9 channels, more than 8"):
        build_dataset([(eight, "ok"), (nine, "x")], tmp_path / "ds")
    assert build_dataset([(eight, "ok")], tmp_path / "ds2").rebuilt


def test_memory_does_not_grow_with_the_recording_length(tmp_path, monkeypatch):
    """With small blocks, converting 60 s takes no more memory than 6 s: nothing holds the whole signal."""
    monkeypatch.setattr(pipeline.audio, "BLOCK_SAMPLES", 1 << 14)
    peaks = {}
    for seconds in (6, 60):
        source = tone(tmp_path / f"{seconds}.flac", rate_hz=16_000, seconds=seconds)
        dest = tmp_path / f"{seconds}.wav"
        peaks[seconds] = peak_allocated(lambda s=source, d=dest: convert(s, d, 0, max_seconds=100, job_seconds_left=100))
        assert sf.info(str(dest)).frames == seconds * 22_050
    # 60 s at 16 kHz is 3.8 MB as float32 and 7.7 MB as float64: holding it once would show.
    assert peaks[60] < 2_000_000
    assert peaks[60] < peaks[6] * 1.3


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_headers_that_understate_the_length_cannot_take_the_job_past_its_audio_cap(tmp_path, monkeypatch, workers):
    """Headers claiming half the length: the frames decoded still keep the job within MAX_JOB_AUDIO_SECONDS, exactly."""
    real_read_header = pipeline.audio.read_header

    def understated(path: Path, index: int, max_seconds: float) -> AudioHeader:
        header = real_read_header(path, index, max_seconds)
        return AudioHeader(header.rate_hz, header.channels, header.frames // 2)

    monkeypatch.setattr(pipeline.audio, "read_header", understated)
    inputs = [(tone(tmp_path / f"{i}.wav", seconds=1.0), f"t{i}") for i in range(3)]
    # Declared 1.5 s in all, decoded 3 s: the third recording is the one past 2.5 s.
    over = JobLimits(max_recording_seconds=10, max_job_audio_seconds=2.5, dataset_workers=workers)
    with pytest.raises(BadRecording, match=r"recording 2 takes the job past its 0 s of audio left \(MAX_JOB_AUDIO_SECONDS\)"):
        build_dataset(inputs, tmp_path / "ds", limits=over)
    exactly = JobLimits(max_recording_seconds=10, max_job_audio_seconds=3.0, dataset_workers=workers)
    assert build_dataset(inputs, tmp_path / "ds3", limits=exactly).rebuilt


@pytest.mark.parametrize("workers", [1, 2])
def test_an_understated_header_cannot_spend_what_later_recordings_declared(tmp_path, monkeypatch, workers):
    """The first recording decodes twice its header; the second is honest: the first fails, the job stays within its cap."""
    real_read_header = pipeline.audio.read_header

    def first_understated(path: Path, index: int, max_seconds: float) -> AudioHeader:
        header = real_read_header(path, index, max_seconds)
        return AudioHeader(header.rate_hz, header.channels, header.frames // 2) if index == 0 else header

    monkeypatch.setattr(pipeline.audio, "read_header", first_understated)
    inputs = [(tone(tmp_path / f"{i}.wav", seconds=1.0), f"t{i}") for i in range(2)]
    # Declared 0.5 + 1.0 s, within 1.5 s; decoded 2.0 s would not be, so the one that lied fails.
    with pytest.raises(BadRecording, match=r"recording 0 takes the job past its 0 s of audio left"):
        build_dataset(inputs, tmp_path / "ds", limits=JobLimits(max_recording_seconds=10, max_job_audio_seconds=1.5,
                                                                dataset_workers=workers))


PEAK_PROBE = """
import sys
from pathlib import Path
from pipeline.dataset_stage import main
code = main(sys.argv[1:])
hwm = [line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:")]
print(code, hwm[0].split()[1])
"""


def dataset_step_peak_kib(tmp_path: Path, name: str, recordings: list[tuple[Path, str]], workers: int) -> int:
    """Run the dataset step's own entry point in a fresh child; its peak resident set in KiB (VmHWM).

    Not getrusage's ru_maxrss: Linux carries the high-water mark across fork and exec, so a child of
    this test process would report at least this process's own resident set.
    """
    request, result = tmp_path / f"{name}-request.json", tmp_path / f"{name}-result.json"
    request.write_text(json.dumps({
        "recordings": [[str(path), text] for path, text in recordings],
        "dataset_dir": str(tmp_path / name),
        "limits": asdict(JobLimits(dataset_workers=workers)),
    }))
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(request), str(result)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    code, peak_kib = out.stdout.strip().splitlines()[-1].split()
    assert code == "0"
    return int(peak_kib)


def long_tone_wav(path: Path, seconds: int, rate_hz: int = 44_100) -> Path:
    """A tone written a second at a time, so making it takes no memory either."""
    one_s = np.sin(2 * np.pi * 220.0 * np.arange(rate_hz) / rate_hz) * 0.5
    with sf.SoundFile(path, "w", rate_hz, 1, "PCM_16", format="WAV") as out:
        for _ in range(seconds):
            out.write(one_s)
    return path


def test_the_dataset_step_peak_rss_does_not_grow_with_the_recordings_length(tmp_path):
    """Two 10-minute recordings converted at once peak within 16 MiB of two 1-minute ones (holding one: 100 MiB)."""
    short, long = long_tone_wav(tmp_path / "1min.wav", 60), long_tone_wav(tmp_path / "10min.wav", 600)
    try:
        short_kib = dataset_step_peak_kib(tmp_path, "short", [(short, "a"), (short, "b")], workers=2)
        long_kib = dataset_step_peak_kib(tmp_path, "long", [(long, "a"), (long, "b")], workers=2)
        assert sf.info(str(tmp_path / "long" / "wavs" / "utt00001.wav")).frames == 600 * 22_050
    finally:  # 150 MB of WAVs: not worth keeping in pytest's retained temp directories
        for wav in [short, long, *tmp_path.glob("*/wavs/*.wav")]:
            wav.unlink(missing_ok=True)
    # 600 s at 44.1 kHz is 106 MB as float32: holding either signal once would show many times over.
    assert long_kib - short_kib < 16 * 1024, (short_kib, long_kib)


def test_settings_reach_the_limits():
    """The settings' job limits take the job limits and DATASET_WORKERS from their environment variables."""
    settings = load_settings({"MAX_JOB_DOWNLOAD_BYTES": "1000", "MAX_RECORDING_SECONDS": "60",
                              "MAX_JOB_AUDIO_SECONDS": "600", "DATASET_WORKERS": "3"})
    assert settings.job_limits() == JobLimits(1000, 60.0, 600.0, dataset_workers=3)
    usable_cpus = len(os.sched_getaffinity(0))
    assert load_settings({}).job_limits() == JobLimits(8 * 1024**3, 1800.0, 36_000.0, usable_cpus)
    assert JobLimits().dataset_workers == usable_cpus
    with pytest.raises(ConfigError, match="DATASET_WORKERS"):
        load_settings({"DATASET_WORKERS": "0"})
