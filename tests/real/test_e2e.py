"""A voice actually cloned: the worker runs the real trainers end to end on the local stack.

`python -m worker run` takes a job whose recordings are espeak-ng speech, runs config/pipeline.real.toml
(Resemblyzer d-vectors, Coqui VITS from scratch in the ci profile, its ONNX export for Piper) under
the trainer virtualenv's interpreter and commits. One clean job is checked with the libraries that
will use its five artifacts (tests/real/check_artifacts.py, run by the trainer interpreter); a second
job has its worker killed with SIGKILL after the first checkpoint and is finished by a second worker,
resumed from that checkpoint at exactly the requested global step; and the demo's second act (`make
demo-real`) runs as a person would run it.

Not part of `make test` (minutes of CPU training): `make test-real` runs it, after building
trainers/.venv.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import pytest

from tests.real.harness import (
    REPO,
    TORCH_THREADS,
    Resumable,
    check_artifacts,
    download_artifacts,
    kill_after_first_checkpoint,
    make_real_stack,
    model_step,
    real_worker,
    requested_steps,
    s3_problems,
    submit_speech_job,
    unwrapped,
    wait_for_commit,
    worker_status,
)
from tests.real.speech import speech_clips
from worker.ops.demo import CI_PROFILE

# Generous: a job takes a few minutes on two idle cores; CI's machine may be busier.
JOB_TIMEOUT_S = 1500
SENTENCE = "The worker cloned this voice from a few short recordings."
SPEAKER_DIMENSIONS = 256
PROFILE = CI_PROFILE


# voice_trainers' full stage: step-NNNNNNNN.pt checkpoints, 'Model restored from step N' on a resume.
TRAIN_FULL = Resumable(stage="train_full", checkpoint_glob="step-*.pt",
                       resumed=re.compile(r"^Model restored from step (\d+)", re.M),
                       step_done=re.compile(r"^step (\d+)/\d+:", re.M))


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return speech_clips(tmp_path_factory.mktemp("clips"))


@pytest.fixture(scope="module")
def committed(moto_server, tmp_path_factory, clips):
    """One job run start to finish by one worker."""
    root = tmp_path_factory.mktemp("clean")
    stack = make_real_stack(moto_server, root, gate={})  # report only, whatever the shipped file's gate
    job = submit_speech_job(stack, clips)
    worker = real_worker(stack, root, "clean")
    try:
        worker.start()
        wait_for_commit(job, worker, JOB_TIMEOUT_S)
        assert worker.stop() == 0
    finally:
        worker.ensure_dead()
    return job


@pytest.fixture(scope="module")
def downloaded(committed, tmp_path_factory):
    return download_artifacts(committed, tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="module")
def report(committed, downloaded, tmp_path_factory):
    wav = tmp_path_factory.mktemp("checker") / "piper.wav"
    return check_artifacts(downloaded, wav, SENTENCE) | {"pipeline": committed.stack.pipeline}


def test_the_job_commits_five_non_empty_artifacts_to_s3(committed):
    """The committed profile names five S3 objects, each non-empty, uploaded once, holding the bytes its key names."""
    assert committed.record()["status"] == "completed"
    assert s3_problems(committed) == []


def test_each_stage_ran_once_in_the_ci_profile(committed):
    """embed, train_full, train_light and evaluate each ran once, in the ci profile, and exited 0."""
    for stage in ("embed", "train_full", "train_light", "evaluate"):
        logs = committed.stage_logs(stage)
        assert len(logs) == 1, (stage, logs)
        text = logs[0].read_text()
        assert f"profile {PROFILE}," in text, text[-2000:]
        assert f"stage {stage} exited with code 0\n" in text, text[-2000:]


def test_the_scores_land_on_the_records_and_in_status(committed):
    """The evaluate stage's scores of both models and of the recordings are on the job and the profile, the
    report-only gate decided nothing, and `status` shows them: a line per model as text, the stored
    document with --json."""
    record, profile = committed.record(), committed.profile()
    quality = record.get("quality")
    assert isinstance(quality, dict), record
    assert profile.get("quality") == quality
    assert quality["gate"]["applied"] is False and quality["gate"]["failed"] == []
    assert quality["report"].endswith("eval/quality.json")
    assert sorted(quality["models"]) == ["full", "light"] and quality["reference"] is not None
    for figures in [*quality["models"].values(), quality["reference"]]:
        assert -1.0 <= figures["speakerSimilarity"] <= 1.0, figures
        assert isinstance(figures["sanity"]["ok"], bool)
        assert figures["dnsmos"] is None or 1.0 <= figures["dnsmos"]["ovrl"] <= 5.0, figures
    # The recordings are the speaker: they sound more like themselves than the six-step models do.
    assert quality["reference"]["speakerSimilarity"] > max(m["speakerSimilarity"] for m in quality["models"].values())

    text = unwrapped(worker_status(committed.stack, committed.job_id))
    for name, figures in quality["models"].items():
        assert f"{name}: similarity {figures['speakerSimilarity']:.2f} " in text, text
    assert f"reference (the recordings): similarity {quality['reference']['speakerSimilarity']:.2f} " in text
    assert "gate: none configured (report only)" in text
    shown = json.loads(worker_status(committed.stack, committed.job_id, as_json=True))
    assert shown["job"]["quality"] == quality


def test_full_model_reloads_into_the_vits_its_config_describes(report):
    """config.json loads as a VITS config, and every generator tensor of that VITS comes from model.pth, which speaks."""
    assert report["config_model"] == "vits"
    assert report["generator_tensors"] > 0
    assert report["generator_tensors_loaded"] == report["generator_tensors"]
    assert report["full_audio_samples"] > 0 and report["full_audio_finite"]
    assert report["full_model_step"] == requested_steps(report["pipeline"])


def test_speaker_embeddings_are_256_dimensional_d_vectors(report, clips):
    """speakers.pth holds a finite, unit 256-d centroid and a cosine for every clip, all of them kept."""
    assert report["speaker_entries"] == report["speaker_kept"] == len(clips)
    assert report["speaker_dimensions"] == [SPEAKER_DIMENSIONS]
    assert report["speaker_vectors_finite"] and report["speaker_min_norm"] > 0


def test_onnxruntime_returns_audio_from_the_light_model(report):
    """onnxruntime runs model.onnx on phoneme ids from its Piper config and returns finite audio."""
    assert report["onnx_ids"] > 0
    assert report["onnx_audio_samples"] > 0 and report["onnx_audio_finite"]
    assert report["piper_num_speakers"] == 1
    assert report["piper_sample_rate"] == report["sample_rate"]


def test_piper_speaks_a_sentence_with_the_light_pair(report):
    """piper-tts's PiperVoice loads model.onnx with model.onnx.json and writes a mono WAV of a sentence."""
    assert report["piper_wav_frames"] > 0
    assert report["piper_wav_channels"] == 1
    assert report["piper_wav_rate"] == report["piper_sample_rate"]


def test_the_second_act_clones_the_shipped_clips_and_writes_a_wav_of_the_cloned_voice():
    """`python -m worker demo --real` (`make demo-real`) trains on samples/, exits 0 and names a mono WAV the
    cloned light model spoke, at the model's rate."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.run([sys.executable, "-m", "worker", "demo", "--real"], cwd=REPO, capture_output=True,
                          text=True, timeout=JOB_TIMEOUT_S, env={**env, "OMP_NUM_THREADS": TORCH_THREADS})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    spoken = re.search(r"listen to it:\n  (/\S+\.wav)$", proc.stdout, re.M)
    assert spoken, proc.stdout[-2000:]
    wav = Path(spoken.group(1))
    try:
        # Beside the WAV, the scores the evaluate stage wrote, as the demo's job read them: a block per model.
        [report] = wav.parent.glob("work/**/eval/quality.json")
        scores = json.loads(report.read_text())
        after = proc.stdout[spoken.end():]
        for name in ("full", "light"):
            model = scores["models"][name]
            block = re.search(rf"^  {name} model\n((?:    .*\n?)+)", after, re.M)
            assert block, after
            assert f"speaker similarity  {model['speaker_similarity']:.2f}\n" in block.group(1), block.group(1)
            if model["dnsmos"] is not None:
                assert f"DNSMOS overall      {model['dnsmos']['ovrl']:.2f}\n" in block.group(1), block.group(1)
        with wave.open(str(wav), "rb") as audio:
            assert audio.getnframes() > 0 and audio.getnchannels() == 1
            assert audio.getframerate() == json.loads(next(wav.parent.glob("work/.models/**/model.onnx.json")
                                                           ).read_text())["audio"]["sample_rate"]
    finally:
        # The run keeps its checkpoints for a person to look at (half a gigabyte): not a test's.
        shutil.rmtree(wav.parent)


def test_a_killed_worker_s_training_resumes_on_a_second_worker_at_the_requested_step(moto_server, tmp_path, clips):
    """SIGKILL to the worker after train_full's first checkpoint: a second worker takes the job after the
    visibility timeout, resumes from that checkpoint (not from scratch) and stops at exactly the requested step."""
    stack = make_real_stack(moto_server, tmp_path)
    steps = requested_steps(stack.pipeline)
    stage = TRAIN_FULL
    job = submit_speech_job(stack, clips)
    first, second = real_worker(stack, tmp_path, "first"), real_worker(stack, tmp_path, "second")
    try:
        outcome = kill_after_first_checkpoint(job, first, second, stage, JOB_TIMEOUT_S)
        assert second.stop() == 0
    finally:
        first.ensure_dead()
        second.ensure_dead()
    assert outcome.stage_processes, "no stage process was running at the kill"
    assert "train_full" not in outcome.verified_at_kill
    assert "message.deleted" not in first.event_names(), "the killed worker must not have acknowledged"
    record = job.record()
    assert record["status"] == "completed" and record["attempts"] == 2 and s3_problems(job) == []

    # embed had finished before the kill: its verified output was reused, not recomputed.
    assert len(job.stage_logs("embed")) == 1
    killed, resumed = job.stage_logs("train_full")
    killed_steps, resumed_steps = stage.steps_done(killed), stage.steps_done(resumed)
    checkpointed = int(outcome.checkpoints_at_kill[0].removeprefix("step-").removesuffix(".pt"))
    assert stage.resumed_at(killed) == []
    assert killed_steps[:checkpointed] == list(range(1, checkpointed + 1))
    restored = stage.resumed_at(resumed)
    assert len(restored) == 1 and checkpointed <= restored[0] < steps, (restored, checkpointed)
    assert resumed_steps == list(range(restored[0] + 1, steps + 1))
    assert f"at step {steps}" in resumed.read_text()
    assert model_step(download_artifacts(job, tmp_path / "artifacts")["fullModel"]) == steps
