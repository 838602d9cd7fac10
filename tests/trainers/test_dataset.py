"""Reading the worker's LJSpeech folder in the trainer: its escaping, its audio format, what is unusable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from hypothesis import given
from hypothesis import strategies as st
from voice_trainers.dataset import (
    UnusableData,
    dataset_fingerprint,
    load_clips,
    read_metadata,
    split_metadata_line,
)

from pipeline.dataset import escape_text, metadata_bytes

RATE_HZ = 22050


def write_dataset(root: Path, texts: list[str], *, durations_s: list[float] | None = None,
                  rate_hz: int = RATE_HZ, subtype: str = "PCM_16", channels: int = 1) -> Path:
    (root / "wavs").mkdir(parents=True, exist_ok=True)
    (root / "metadata.csv").write_bytes(metadata_bytes(texts))
    for index, duration_s in enumerate(durations_s or [1.0] * len(texts)):
        t = np.arange(int(rate_hz * duration_s)) / rate_hz
        wave = 0.3 * np.sin(2 * np.pi * 220 * t)
        data = wave if channels == 1 else np.stack([wave] * channels, axis=1)
        sf.write(root / "wavs" / f"utt{index:05d}.wav", data, rate_hz, subtype=subtype)
    return root


@given(st.text(max_size=60))
def test_a_text_the_worker_escaped_reads_back_unchanged(text):
    """Any text, control and line-break characters included, survives the worker's escaping and the trainer's reading."""
    escaped = escape_text(text)
    assert split_metadata_line(f"utt00000|{escaped}|{escaped}") == ["utt00000", text, text]


def test_each_escape_rule_is_undone():
    """Backslash, pipe, newline, carriage return and \\uXXXX are each turned back into their character."""
    assert split_metadata_line(r"a\\b\|c\nd\re\u2028f|x") == ["a\\b|c\nd\re\u2028f", "x"]


@pytest.mark.parametrize("line", [r"abc\q", "abc\\", r"a\u12", r"a\u12zz"])
def test_a_malformed_escape_is_refused(line):
    """An escape the worker never writes is an error, not a guess."""
    with pytest.raises(ValueError):
        split_metadata_line(line)


def test_metadata_rows_come_back_as_id_and_text(tmp_path):
    """read_metadata returns the worker's rows in order, with the texts unescaped."""
    texts = ["Hello | there", "back\\slash", "two\nlines"]
    (tmp_path / "metadata.csv").write_bytes(metadata_bytes(texts))
    assert read_metadata(tmp_path) == [(f"utt{i:05d}", t) for i, t in enumerate(texts)]


@pytest.mark.parametrize("content", [
    b"utt00000|only two\n",
    b"utt00000|a|b|c\n",
    b"utt00000|bad \\q escape|x\n",
    b"../etc|a|a\n",
    b"utt00000|a|a\nutt00000|b|b\n",
    b"utt00000|\xff|x\n",
    b"",
])
def test_malformed_metadata_is_unusable_data(tmp_path, content):
    """Wrong field counts, bad escapes, unsafe or repeated ids, non-UTF-8 or no rows: exit 65, not a crash."""
    (tmp_path / "metadata.csv").write_bytes(content)
    with pytest.raises(UnusableData):
        read_metadata(tmp_path)


def test_a_missing_metadata_file_is_unusable_data(tmp_path):
    """No metadata.csv at all is the data's fault too."""
    with pytest.raises(UnusableData, match="metadata.csv"):
        read_metadata(tmp_path)


def test_usable_clips_are_returned_with_their_durations(tmp_path):
    """Every clip in range with a text comes back, with its WAV path and duration."""
    root = write_dataset(tmp_path, ["one", "two", "three"], durations_s=[1.0, 2.0, 1.5])
    clips = load_clips(root, min_clip_s=0.5, max_clip_s=20, min_clips=3)
    assert [(c.uid, c.text, round(c.duration_s, 2)) for c in clips] == [
        ("utt00000", "one", 1.0), ("utt00001", "two", 2.0), ("utt00002", "three", 1.5)]
    assert clips[0].wav_path == root / "wavs" / "utt00000.wav"


def test_too_short_too_long_and_blank_clips_are_left_out(tmp_path):
    """A clip out of the duration range or with a blank text is dropped; the rest is used."""
    root = write_dataset(tmp_path, ["ok", "short", "long", "  ", "ok too"], durations_s=[1, 0.2, 25, 1, 1])
    clips = load_clips(root, min_clip_s=0.5, max_clip_s=20, min_clips=2)
    assert [c.uid for c in clips] == ["utt00000", "utt00004"]


def test_too_few_usable_clips_is_unusable_data(tmp_path):
    """Fewer usable clips than the profile's minimum: the data cannot be trained on."""
    root = write_dataset(tmp_path, ["ok", "short", "ok"], durations_s=[1, 0.2, 1])
    with pytest.raises(UnusableData, match="2 usable clips, at least 3 needed"):
        load_clips(root, min_clip_s=0.5, max_clip_s=20, min_clips=3)


@pytest.mark.parametrize("fmt", [{"rate_hz": 16000}, {"subtype": "FLOAT"}, {"channels": 2}])
def test_a_wav_not_in_the_worker_format_is_unusable_data(tmp_path, fmt):
    """The contract says 22,050 Hz mono 16-bit; anything else fails the dataset rather than training on it."""
    root = write_dataset(tmp_path, ["a", "b"], **fmt)
    with pytest.raises(UnusableData, match="expected 22050 Hz mono PCM_16"):
        load_clips(root, min_clip_s=0.5, max_clip_s=20, min_clips=1)


def test_a_missing_wav_is_unusable_data(tmp_path):
    """A row without its WAV fails the dataset."""
    root = write_dataset(tmp_path, ["a", "b"])
    (root / "wavs" / "utt00001.wav").unlink()
    with pytest.raises(UnusableData, match=r"utt00001\.wav"):
        load_clips(root, min_clip_s=0.5, max_clip_s=20, min_clips=1)


def test_the_fingerprint_follows_texts_and_audio(tmp_path):
    """The dataset fingerprint is stable, and changes with a text or with one sample of audio."""
    root = write_dataset(tmp_path / "a", ["one", "two"])
    clips = load_clips(root, min_clip_s=0.5, max_clip_s=20, min_clips=1)
    first = dataset_fingerprint(root, clips)
    assert dataset_fingerprint(root, clips) == first
    wav = root / "wavs" / "utt00001.wav"
    data = bytearray(wav.read_bytes())
    data[-1] ^= 1
    wav.write_bytes(bytes(data))
    assert dataset_fingerprint(root, clips) != first
    other = write_dataset(tmp_path / "b", ["one", "Two"])
    assert dataset_fingerprint(other, load_clips(other, min_clip_s=0.5, max_clip_s=20, min_clips=1)) != first
