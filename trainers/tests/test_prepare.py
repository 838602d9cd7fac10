"""Data preparation inside the embed stage (docs/trainer.md, "Data preparation"), on espeak-ng clips.

One job mixes what preparation must sort out: clean clips of one voice, a clip of another voice, a noisy
one, a clipped one, one whose text is far too long for it, one whose text is another sentence, and a long
recording of six sentences.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
from make_dataset import SENTENCES, escape_text, make_dataset
from test_stages import stage_env
from voice_trainers import prep_audio, prep_rules
from voice_trainers.dataset import load_clips
from voice_trainers.speakers import FORMAT, read_centroid

RATE_HZ = 22050
LONG_SENTENCES = SENTENCES[8:14]
PAUSE_S = 0.8


def embed(root: Path, dataset: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "voice_trainers", "embed", "--dataset", str(dataset), "--out",
            str(root / "output" / "full"), "--prepared", str(root / "output" / "prep"), "--checkpoints",
            str(root / "ck"), "--language", "en", "--profile", "ci"]
    return subprocess.run(argv, capture_output=True, text=True, env=stage_env(), cwd="/", timeout=900)


def append(dataset: Path, uid: str, samples: np.ndarray, text: str) -> None:
    soundfile.write(str(dataset / "wavs" / f"{uid}.wav"), samples, RATE_HZ, subtype="PCM_16")
    with open(dataset / "metadata.csv", "a", encoding="utf-8") as handle:
        handle.write(f"{uid}|{escape_text(text)}|{escape_text(text)}\n")


def read(path: Path) -> np.ndarray:
    return soundfile.read(str(path), dtype="float64")[0]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("prep")
    dataset = root / "dataset"
    make_dataset(dataset, clips=5)
    make_dataset(root / "odd", clips=6, voice="en-us+f3")
    make_dataset(root / "long", clips=len(LONG_SENTENCES), sentences=LONG_SENTENCES)
    rng = np.random.default_rng(0)
    spoken = read(dataset / "wavs" / "utt00003.wav")
    append(dataset, "odd", read(root / "odd" / "wavs" / "utt00005.wav"), SENTENCES[5])
    level = np.sqrt(np.mean(spoken**2))
    append(dataset, "noisy", np.clip(spoken + rng.normal(0, level / 2, len(spoken)), -1, 1), SENTENCES[3])
    append(dataset, "clipped", np.clip(spoken * 12, -1, 1), SENTENCES[3])
    append(dataset, "wordy", read(dataset / "wavs" / "utt00001.wav"), " ".join(SENTENCES))
    # pocketsphinx hears this clip at a CER of 1.5 against that text (0.64 against its own), at a
    # plausible 6.5 phonemes a second: only the recogniser can tell.
    append(dataset, "mislabelled", read(root / "long" / "wavs" / "utt00005.wav"), SENTENCES[14])
    gap = np.zeros(int(PAUSE_S * RATE_HZ))
    parts = [read(root / "long" / "wavs" / f"utt{i:05d}.wav") for i in range(len(LONG_SENTENCES))]
    long = np.concatenate([x for part in parts for x in (part, gap)])
    assert len(long) / RATE_HZ > 20.0  # longer than ci's max_clip_s: it must be cut
    append(dataset, "long", long, " ".join(LONG_SENTENCES))
    result = embed(root, dataset)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((root / "output" / "prep" / "report.json").read_text(encoding="utf-8"))
    return {"root": root, "result": result, "report": report}


def reasons(report: dict) -> dict[str, str]:
    return {entry["id"]: entry["reason"] for entry in report["leftOut"]}


def test_the_odd_voice_noise_clipping_and_wrong_texts_are_left_out_each_with_its_reason(job):
    """Each bad clip is left out for its own reason and nothing else is."""
    assert reasons(job["report"]) == {"odd": "another_speaker", "noisy": "noisy", "clipped": "clipped",
                                      "wordy": "phoneme_rate", "mislabelled": "transcript_mismatch"}
    assert all(entry["detail"] for entry in job["report"]["leftOut"])


def test_a_long_recording_is_cut_at_its_sentence_pauses_and_each_piece_keeps_its_sentence(job):
    """The 6-sentence recording becomes 6 clips, each with its own sentence as its text."""
    clips = {c.uid: c for c in load_clips(job["root"] / "output" / "prep", min_clip_s=0.5, max_clip_s=20.0,
                                          min_clips=4)}
    pieces = sorted(uid for uid in clips if uid.startswith("long-"))
    assert [clips[uid].text for uid in pieces] == LONG_SENTENCES
    assert all(1.0 < clips[uid].duration_s < 12.0 for uid in pieces)


def test_kept_clips_are_trimmed_and_loudness_normalised(job):
    """Every kept clip has at most ~0.2 s of silence at each end, -20 dBFS RMS (or less), peak <= -1 dBFS."""
    prep = job["root"] / "output" / "prep"
    for entry in job["report"]["kept"]:
        audio = read(prep / "wavs" / f"{entry['id']}.wav")
        rms_dbfs = 20 * np.log10(np.sqrt(np.mean(audio**2)))
        peak_dbfs = 20 * np.log10(np.max(np.abs(audio)))
        assert peak_dbfs <= -0.95 and rms_dbfs <= -19.9, entry
        assert rms_dbfs >= -20.1 or peak_dbfs >= -1.05, entry
        loud = np.flatnonzero(np.abs(audio) > 0.01)
        assert loud[0] / RATE_HZ < 0.35 and (len(audio) - loud[-1]) / RATE_HZ < 0.35, entry


def test_the_report_totals_add_up(job):
    """Kept plus left out covers every recording; the seconds kept are the kept clips' sum."""
    report = job["report"]
    totals = report["totals"]
    assert totals["recordings"] == 11 and totals["keptClips"] == len(report["kept"]) == 5 + 6
    assert totals["leftOutClips"] == 5 and report["refused"] is None
    assert abs(totals["keptS"] - sum(k["seconds"] for k in report["kept"])) < 0.05
    assert "NOTE prepared 11 clip(s)" in job["result"].stdout


def test_speakers_pth_is_the_kept_clips_centroid_with_every_clips_cosine(job):
    """speakers.pth: a unit centroid, each embedded clip's cosine, the odd voice far below and not kept."""
    import torch

    content = torch.load(job["root"] / "output" / "full" / "speakers.pth", weights_only=True)
    assert content["format"] == FORMAT and content["dim"] == 256
    centroid = read_centroid(job["root"] / "output" / "full" / "speakers.pth")
    assert abs(np.linalg.norm(centroid) - 1) < 1e-6
    clips = content["clips"]
    kept = {entry["id"] for entry in job["report"]["kept"]}
    assert {uid for uid, c in clips.items() if c["kept"]} == kept
    assert clips["odd"]["cosine"] < min(clips[uid]["cosine"] for uid in kept) - 0.1


def test_a_prepared_dataset_is_unpacked_again_from_its_packed_file(job, tmp_path):
    """A retry reuses only the declared outputs: clips.tar alone gives the training stages the same clips."""
    prep = tmp_path / "prep"
    prep.mkdir()
    (prep / "clips.tar").write_bytes((job["root"] / "output" / "prep" / "clips.tar").read_bytes())
    clips = load_clips(prep, min_clip_s=0.5, max_clip_s=20.0, min_clips=4)
    assert [c.uid for c in clips] == [entry["id"] for entry in job["report"]["kept"]]


def test_too_little_usable_speech_is_refused_with_exit_65_and_a_report(tmp_path):
    """Three clips (ci wants four) exit 65 with one line saying what is missing; the report is written."""
    make_dataset(tmp_path / "dataset", clips=3)
    result = embed(tmp_path, tmp_path / "dataset")
    assert result.returncode == 65, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "unusable data: too little usable speech: 3 clips, at least 4 needed")
    report = json.loads((tmp_path / "output" / "prep" / "report.json").read_text(encoding="utf-8"))
    assert report["refused"] == "3 clips, at least 4 needed" and report["totals"]["keptClips"] == 3


def test_sentences_split_after_end_marks_followed_by_a_space():
    """Sentence ends are . ! ? and an ellipsis followed by a space; a decimal point is not one."""
    assert prep_rules.split_sentences("It costs 3.50 now. Really?! Yes… \"Fine.\" Done") == [
        "It costs 3.50 now.", "Really?!", "Yes…", "\"Fine.\"", "Done"]


def test_a_recording_is_cut_only_where_its_pauses_match_its_sentences():
    """Exactly n-1 pauses, or n-1 clearly longest ones, give the cuts; too few or ambiguous ones give None."""
    assert prep_rules.cut_frames([(10, 0.5), (30, 0.6)], 3) == [10, 30]
    assert prep_rules.cut_frames([(10, 0.9), (20, 0.31), (30, 0.8)], 3) == [10, 30]
    assert prep_rules.cut_frames([(10, 0.9), (20, 0.7), (30, 0.8)], 3) is None
    assert prep_rules.cut_frames([(10, 0.9)], 3) is None
    assert prep_rules.cut_frames([(10, 0.9)], 1) is None


def test_another_speaker_is_far_below_the_median_and_a_spread_widens_the_margin():
    """A clip 0.2 below tight neighbours is out; 0.15 below widely spread ones (4 MADs: 0.2) is not."""
    tight = {"a": 0.95, "b": 0.94, "c": 0.96, "d": 0.95, "x": 0.75}
    assert set(prep_rules.other_speakers(tight)) == {"x"}
    spread = {"a": 0.95, "b": 0.85, "c": 0.80, "d": 0.9, "x": 0.70}
    assert prep_rules.other_speakers(spread) == {}
    assert prep_rules.other_speakers({"a": 0.9, "x": 0.1}) == {}


def test_phonemes_a_second_outside_speech_rates_are_implausible():
    """12 phonemes a second is speech; 50 or 1 is a text that is not the clip's."""
    assert prep_rules.phoneme_reason(36, 3.0) is None
    assert prep_rules.phoneme_reason(150, 3.0)[0] == "phoneme_rate"
    assert prep_rules.phoneme_reason(3, 3.0)[0] == "phoneme_rate"


def test_only_a_strong_transcript_disagreement_leaves_a_clip_out():
    """A CER of 0.8 (pocketsphinx on correct espeak-ng text) passes; 1.2 does not; no recogniser passes."""
    assert prep_rules.transcript_reason(0.8, "heard") is None
    assert prep_rules.transcript_reason(1.2, "heard")[0] == "transcript_mismatch"
    assert prep_rules.transcript_reason(None, "") is None


def test_the_minimum_names_each_shortfall():
    """Speech and clip count are both required; enough of both is no shortfall."""
    assert prep_rules.shortfall(400.0, 60, 300.0, 50) is None
    assert prep_rules.shortfall(100.0, 20, 300.0, 50) == ("100.0 s of speech, at least 300 s needed;"
                                                          " 20 clips, at least 50 needed")


def test_normalised_audio_reaches_the_rms_target_unless_the_peak_limit_stops_it():
    """A sine reaches -20 dBFS RMS; a spiky signal stops at -1 dBFS peak, quieter than -20 dBFS RMS."""
    sine = 0.01 * np.sin(np.linspace(0, 200 * np.pi, 22050))
    out = prep_audio.normalised(sine)
    assert abs(20 * np.log10(np.sqrt(np.mean(out.astype(np.float64)**2))) + 20.0) < 0.01
    spiky = np.zeros(22050)
    spiky[::1000] = 0.5
    out = prep_audio.normalised(spiky)
    assert abs(20 * np.log10(np.max(np.abs(out))) + 1.0) < 0.01
    assert 20 * np.log10(np.sqrt(np.mean(out.astype(np.float64)**2))) < -20.0


def test_evaluate_scores_against_the_centroid_of_speakers_pth(tmp_path):
    """With speakers.pth beside model.pth the reference is its centroid, not the clips' own mean."""
    from voice_trainers.evaluate import speaker_reference
    from voice_trainers.speakers import speaker_file, write_speakers

    stored = np.zeros(256)
    stored[0] = 1.0
    clips = [np.eye(256)[1], np.eye(256)[2]]
    model = tmp_path / "full" / "model.pth"
    model.parent.mkdir()
    assert abs(speaker_reference(model, clips)[0]) < 1e-9  # no file: the clips' centroid
    write_speakers(model.parent / "speakers.pth", speaker_file(stored, {"a": 1.0}, {"a"}, "test"))
    assert np.allclose(speaker_reference(model, clips), stored)


def test_four_clips_of_one_voice_and_one_of_another_leave_the_odd_one_out(tmp_path):
    """The issue's case: 4 espeak-ng en-us clips and 1 of its female variant; only that one is left out."""
    dataset = tmp_path / "dataset"
    make_dataset(dataset, clips=4)
    make_dataset(tmp_path / "odd", clips=5, voice="en-us+f3")
    append(dataset, "odd", read(tmp_path / "odd" / "wavs" / "utt00004.wav"), SENTENCES[4])
    result = embed(tmp_path, dataset)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "output" / "prep" / "report.json").read_text(encoding="utf-8"))
    assert reasons(report) == {"odd": "another_speaker"}
    assert [entry["id"] for entry in report["kept"]] == [f"utt{i:05d}" for i in range(4)]


def test_a_clip_is_judged_against_the_centroid_of_the_others():
    """3 clips of one speaker and 1 at cosine 0.80: left out (0.88 to a centroid it is part of would pass)."""
    from voice_trainers.prepare import speaker

    one = np.eye(256)[0]
    odd = 0.8 * np.eye(256)[0] + 0.6 * np.eye(256)[1]
    centre, cosines, other = speaker({"a": one, "b": one, "c": one, "x": odd})
    assert set(other) == {"x"}
    assert np.allclose(centre, one) and abs(cosines["x"] - 0.8) < 1e-9
