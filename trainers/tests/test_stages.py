"""The three real stages run by hand, in the trainer venv, on a dataset spoken by espeak-ng (ci profile).

    make test-trainers        # or: cd trainers && .venv/bin/python -m pytest -q tests

Each stage runs as the worker runs it: its own process, `python -m voice_trainers MODE ...`, a small
environment, a working directory elsewhere. The full stage is killed with SIGKILL after its first
checkpoint and run again: it must resume and stop at exactly the profile's global step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from make_dataset import SENTENCES, make_dataset

PROFILE = "ci"
CI_STEPS = 6
STAGE_TIMEOUT_S = 900


def stage_env() -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", "HOME": os.environ.get("HOME", "/root")}
    for name in ("LANG", "OMP_NUM_THREADS", "TMPDIR"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def argv(mode: str, job: Path, *extra: str, dataset: Path | None = None, checkpoints: str = "ck") -> list[str]:
    out = job / "output" / ("light" if mode == "light" else "full")
    return [sys.executable, "-m", "voice_trainers", mode, "--dataset", str(dataset or job / "dataset"),
            "--out", str(out), "--checkpoints", str(job / checkpoints / mode), "--language", "en",
            "--profile", PROFILE, *extra]


def run(args: list[str], job: Path, log_name: str) -> tuple[int, str]:
    log = job / f"{log_name}.log"
    with open(log, "w") as handle:
        code = subprocess.run(args, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=stage_env(), cwd="/", timeout=STAGE_TIMEOUT_S).returncode
    return code, log.read_text()


def start(args: list[str], log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=stage_env(), cwd="/", text=True)


def read_until(process: subprocess.Popen[str], needle: str, seen: list[str]) -> None:
    """Read the stage's output line by line until one contains ``needle`` (kept in ``seen``)."""
    assert process.stdout is not None
    for line in process.stdout:
        seen.append(line)
        if needle in line:
            return
    raise AssertionError(f"the stage ended before printing {needle!r}:\n{''.join(seen[-30:])}")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One job's three stages, with train_full killed by SIGKILL after its first checkpoint and restarted."""
    root = tmp_path_factory.mktemp("job")
    make_dataset(root / "dataset")
    result: dict[str, object] = {"root": root}
    result["embed"] = run(argv("embed", root), root, "embed")

    first: list[str] = []
    process = start(argv("full", root), root / "full-1.log")
    read_until(process, "checkpoint saved at step 2", first)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    result["full_killed"] = "".join(first)
    result["full"] = run(argv("full", root), root, "full-2")
    result["light"] = run(argv("light", root, "--full-model", str(root / "output/full/model.pth")), root, "light")
    return result


def test_every_stage_exits_0(job):
    """embed, full (second run) and light succeed."""
    for name in ("embed", "full", "light"):
        code, log = job[name]
        assert code == 0, f"{name} exited {code}:\n{log[-3000:]}"


def test_the_five_artifacts_are_written(job):
    """The five files of the pipeline's [artifacts] exist and are not empty."""
    output = job["root"] / "output"
    for name in ("full/model.pth", "full/config.json", "full/speakers.pth", "light/model.onnx",
                 "light/model.onnx.json"):
        assert (output / name).stat().st_size > 0, name


def test_speakers_pth_holds_the_unit_centroid_and_a_cosine_per_clip(job):
    """The speaker's file: a unit 256-d centroid of the kept clips, each clip's cosine to it, all kept."""
    import torch

    content = torch.load(job["root"] / "output/full/speakers.pth", weights_only=True)
    assert sorted(content["clips"]) == [f"utt{i:05d}" for i in range(len(SENTENCES))]
    assert all(clip["kept"] and 0.5 < clip["cosine"] <= 1.0 for clip in content["clips"].values())
    centroid = np.array(content["centroid"])
    # A real encoder ran, not zeros: the mean of unit d-vectors, normalised.
    assert centroid.shape == (256,) and np.isfinite(centroid).all()
    assert abs(np.linalg.norm(centroid) - 1.0) < 1e-6


def test_full_resumes_after_sigkill_and_stops_at_the_global_step(job):
    """The rerun restores step 2, trains steps 3 to 6 only and writes a model of step 6."""
    import torch

    assert "checkpoint saved at step 2" in job["full_killed"]
    _, log = job["full"]
    assert "Model restored from step 2" in log
    steps = [line.split()[1] for line in log.splitlines() if line.startswith("step ")]
    assert steps == [f"{n}/{CI_STEPS}:" for n in range(3, CI_STEPS + 1)]
    state = torch.load(job["root"] / "output/full/model.pth", weights_only=True)
    assert state["step"] == CI_STEPS


def test_checkpoints_stay_bounded_and_complete(job):
    """Two checkpoints are kept (the newest), and no temp file is left behind."""
    names = sorted(os.listdir(job["root"] / "ck/full"))
    assert [n for n in names if n.startswith("step-")] == ["step-00000004.pt", "step-00000006.pt"]
    assert not [n for n in names if n.startswith(".tmp-")]


def test_model_pth_is_the_generator_and_reloads_for_inference(job):
    """model.pth, which has no discriminator, loads strictly with its tokenizer (load_full_model) and speaks."""
    import torch
    from voice_trainers.light import load_full_model

    full = job["root"] / "output/full"
    state = torch.load(full / "model.pth", weights_only=True)
    assert state["model"] and not [k for k in state["model"] if k.startswith("disc.")]
    model = load_full_model(full / "model.pth")
    ids = torch.LongTensor([model.tokenizer.text_to_ids("Hello world.")])
    audio = model.inference(ids, aux_input={"x_lengths": torch.LongTensor([ids.shape[1]])})["model_outputs"]
    assert audio.numel() > 0 and torch.isfinite(audio).all()


def test_config_json_is_a_vits_config_without_job_paths(job):
    """config.json parses as a VITS config and names no path of the job (it travels with the model)."""
    text = (job["root"] / "output/full/config.json").read_text()
    data = json.loads(text)
    assert data["model"] == "vits" and data["audio"]["sample_rate"] == 22050
    assert data["phoneme_language"] == "en-us" and data["use_phonemes"] is True
    assert str(job["root"]) not in text and "/tmp" not in text
    assert data["output_path"] == "" and data["datasets"] == [] and data["phoneme_cache_path"] is None


def test_onnxruntime_returns_audio_from_the_light_model(job):
    """The ONNX takes Coqui's token ids and the three scales and returns a waveform."""
    import onnxruntime

    light = job["root"] / "output/light"
    config = json.loads((light / "model.onnx.json").read_text())
    ids_map = config["phoneme_id_map"]
    phonemes = list("həlˈoʊ wˈɜːld.")
    ids = ids_map["^"] + ids_map["_"] + [i for p in phonemes for i in ids_map[p] + ids_map["_"]] + ids_map["$"]
    session = onnxruntime.InferenceSession(str(light / "model.onnx"), providers=["CPUExecutionProvider"])
    audio = session.run(None, {
        "input": np.array([ids], dtype=np.int64),
        "input_lengths": np.array([len(ids)], dtype=np.int64),
        "scales": np.array([0.667, 1.0, 0.8], dtype=np.float32),
    })[0]
    assert audio.size > 0 and np.isfinite(audio).all()


def test_piper_speaks_the_light_pair_with_coquis_phoneme_ids(job, tmp_path):
    """Piper, given the light pair, feeds for every sentence the ids the full model trained on."""
    from piper import PiperVoice
    from voice_trainers.light import load_full_model
    from voice_trainers.normalise import normalise

    light = job["root"] / "output/light"
    voice = PiperVoice.load(str(light / "model.onnx"))
    coqui = load_full_model(job["root"] / "output/full/model.pth")
    tricky = ["Dr. Lee paid $1,250.50 on 3/14/2024; then — at 10:30 — \"nothing\"... Wait… what?"]
    for sentence in SENTENCES + tricky:
        spoken = normalise(sentence, voice.config.espeak_voice)  # what the product does before Piper
        fed = [voice.phonemes_to_ids(part) for part in voice.phonemize(spoken) if part]
        assert [i for ids in fed for i in ids] == coqui.tokenizer.text_to_ids(sentence), sentence
        unmapped = {p for part in voice.phonemize(spoken) for p in part} - set(voice.config.phoneme_id_map)
        assert not unmapped, (sentence, unmapped)
    out = tmp_path / "spoken.wav"
    with wave.open(str(out), "wb") as handle:
        voice.synthesize_wav("The worker cloned this voice.", handle)
    with wave.open(str(out), "rb") as handle:
        assert handle.getframerate() == 22050 and handle.getnframes() > 0


def test_sigusr1_writes_a_checkpoint_at_the_next_step_and_training_goes_on(tmp_path):
    """A checkpoint signal after step 2 adds a checkpoint at step 3 (not a multiple of 2), then the run finishes."""
    make_dataset(tmp_path / "dataset", clips=6)
    process = start(argv("full", tmp_path, "--steps", "5"), tmp_path / "full.log")
    seen: list[str] = []
    read_until(process, "checkpoint saved at step 2", seen)
    process.send_signal(signal.SIGUSR1)
    read_until(process, "checkpoint saved at step", seen)
    rest, _ = process.communicate(timeout=STAGE_TIMEOUT_S)
    assert seen[-1].startswith("checkpoint saved at step 3 ")
    assert process.returncode == 0, "".join(seen) + rest
    assert "step 5/5:" in rest and "checkpoint saved at step 5" in rest


def test_sigterm_stops_the_stage_with_a_retryable_code(tmp_path):
    """SIGTERM during training ends the process with 143 (not 65), leaving no temp file."""
    make_dataset(tmp_path / "dataset", clips=6)
    process = start(argv("full", tmp_path, "--steps", "50"), tmp_path / "full.log")
    seen: list[str] = []
    read_until(process, "step 1/50", seen)
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=120)
    assert process.returncode == 143, "".join(seen) + rest
    assert "stopped by SIGTERM" in rest
    assert "step 50/50" not in rest
    for directory in (tmp_path / "ck/full", tmp_path / "output/full"):
        if directory.exists():
            assert not [n for n in os.listdir(directory) if n.startswith(".tmp-")]


def test_a_checkpoint_of_another_dataset_is_refused(job, tmp_path):
    """Checkpoints of the module's job do not resume a run on other recordings: it starts from scratch."""
    make_dataset(tmp_path / "dataset", clips=8)
    shutil.copytree(job["root"] / "ck/full", tmp_path / "ck/full")
    code, log = run(argv("full", tmp_path, "--steps", "1"), tmp_path, "full")
    assert code == 0, log[-3000:]
    assert "is of another dataset, profile or version: removed, not resumed" in log
    assert "training from scratch" in log and "Model restored" not in log
    assert [n for n in os.listdir(tmp_path / "ck/full") if n.startswith("step-")] == ["step-00000001.pt"]


def test_texts_that_phonemise_to_nothing_exit_65(tmp_path):
    """Clips whose texts are only punctuation leave too few usable clips: the data is unusable, exit 65."""
    make_dataset(tmp_path / "dataset", clips=5, texts=["...", "?!", "-", ",", "Hello there."])
    code, log = run(argv("full", tmp_path), tmp_path, "full")
    assert code == 65, log[-3000:]
    assert "1 clips whose text phonemises to speech that fits their audio, at least 4 needed" in log


def record_message(log: str) -> str:
    """What the job record keeps of a failed stage: how it ended with its last line, then its last 20
    non-empty lines, the newest that fit in 1,900 characters.

    (pipeline.stages.exit_error, failure_message, TAIL_LINES and FAILURE_MESSAGE_MAX_CHARS.)
    """
    lines = [line for line in log.splitlines() if line.strip()][-20:]
    head = f"stage train_full exited with code 65: {lines[-1][:300]}\nlast lines of train_full.log:"
    kept: list[str] = []
    room = 1900 - len(head)
    for line in reversed(lines):
        room -= len(line) + 1
        if room < 0:
            break
        kept.insert(0, line)
    return "\n".join([head, *kept])


def test_a_transcript_far_longer_in_phonemes_than_its_clip_is_left_out_and_named_in_the_record(tmp_path):
    """A date spelled out for a 3.4 s clip and a text of punctuation leave 3 of 5 clips: exit 65, both named."""
    texts = ["2024-01-01 " * 12, "...", *SENTENCES[2:5]]
    make_dataset(tmp_path / "dataset", clips=5, texts=texts)
    code, log = run(argv("full", tmp_path, "--steps", "1"), tmp_path, "full")
    assert code == 65, log[-3000:]
    record = record_message(log)
    assert re.search(r"left out 2 clip\(s\) after phonemising: clip 0 \(utt00000\): \d+ phoneme ids for 3\.4 s"
                     r" of audio, more than the \d+ that fit it;", record)
    assert "clip 1 (utt00001): its text phonemises to nothing" in record
    assert "3 clips whose text phonemises to speech that fits their audio, at least 4 needed" in record
