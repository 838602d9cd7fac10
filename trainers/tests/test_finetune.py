"""Fine-tuning from a base model (``full --base-model-dir``), on the CPU, with a base the tests make themselves.

    cd trainers && .venv/bin/python -m pytest -q tests/test_finetune.py

The base: two ci steps of ``full`` on an en-us espeak-ng voice, written as a base directory by
``python -m voice_trainers.base`` (model.pth: generator and discriminator; config.json). The fine-tunes run
on another espeak-ng voice (en-gb-x-rp). The device flag and the probe are in tests/test_finetune_device.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from make_dataset import make_dataset
from voice_trainers.base import BASE_CONFIG_NAME, BASE_MODEL_NAME, TEXT_EMBEDDING, UnfitBase, base_identity
from voice_trainers.checkpoints import list_checkpoints, software_versions
from voice_trainers.full import run_full, training_fingerprint
from voice_trainers.profiles import PROFILES, resolve
from voice_trainers.signals import StageSignals

STAGE_TIMEOUT_S = 900
BASE_STEPS = 2
BASE_VOICE, TUNE_VOICE = "en-us", "en-gb-x-rp"
CLIPS = 6


def stage_env() -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", "HOME": os.environ.get("HOME", "/root")}
    for name in ("LANG", "OMP_NUM_THREADS", "TMPDIR"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def run(args: list[str], log: Path) -> tuple[int, str]:
    """A stage as the worker runs it: its own process, a small environment, another working directory."""
    with open(log, "w") as handle:
        code = subprocess.run(args, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=stage_env(), cwd="/", timeout=STAGE_TIMEOUT_S).returncode
    return code, log.read_text()


def full_argv(dataset: Path, out: Path, checkpoints: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "voice_trainers", "full", "--dataset", str(dataset), "--out", str(out),
            "--checkpoints", str(checkpoints), "--language", "en", "--profile", "ci", *extra]


def generator(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith("disc.")}


def model_of(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The Euclidean distance between two state dicts' floating-point tensors, taken as one vector."""
    assert a.keys() == b.keys()
    return math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in a
                         if a[k].is_floating_point()))


def norm(a: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(v.double().square().sum()) for v in a.values() if v.is_floating_point()))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base directory made by the stage itself: two ci steps on the en-us voice, its last checkpoint."""
    root = tmp_path_factory.mktemp("base")
    make_dataset(root / "dataset", clips=CLIPS, voice=BASE_VOICE)
    code, log = run(full_argv(root / "dataset", root / "out", root / "ck", "--steps", str(BASE_STEPS)),
                    root / "full.log")
    assert code == 0, log[-3000:]
    [(step, checkpoint)] = list_checkpoints(root / "ck")[:1]
    assert step == BASE_STEPS
    made = subprocess.run([sys.executable, "-m", "voice_trainers.base", str(checkpoint),
                           str(root / "out" / "config.json"), str(root / "base")],
                          capture_output=True, text=True, env=stage_env(), cwd="/", timeout=120)
    assert made.returncode == 0, made.stderr
    return root / "base"


@pytest.fixture(scope="module")
def tuned(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One step of fine-tuning on the other voice, then the same command again (it must resume, not restart)."""
    root = tmp_path_factory.mktemp("tuned")
    make_dataset(root / "dataset", clips=CLIPS, voice=TUNE_VOICE)
    args = full_argv(root / "dataset", root / "out", root / "ck", "--base-model-dir", str(base), "--steps", "1")
    first = run(args, root / "full-1.log")
    model = model_of(root / "out" / "model.pth") if first[0] == 0 else {}
    second = run(args, root / "full-2.log")
    return {"root": root, "first": first, "second": second, "model": model}


def test_a_fine_tune_loads_the_base_strictly_and_trains_from_it(tuned):
    """The log says which base was loaded, how many tensors, and that no checkpoint of its own existed yet."""
    code, log = tuned["first"]
    assert code == 0, log[-3000:]
    assert "fine-tuning from the base model in " in log and " tensors loaded strictly);" in log
    assert "no checkpoint to resume from: fine-tuning from the base model's weights" in log
    assert "step 1/1:" in log and "training from scratch" not in log


def test_zero_steps_give_the_bases_generator_back_bit_for_bit(base, tmp_path):
    """A fine-tune of 0 steps writes model.pth: exactly the base's generator tensors, none missing or added."""
    make_dataset(tmp_path / "dataset", clips=CLIPS, voice=TUNE_VOICE)
    (tmp_path / "ck").mkdir()
    args = argparse.Namespace(dataset=tmp_path / "dataset", out=tmp_path / "out", checkpoints=tmp_path / "ck",
                              base_model_dir=base)
    profile = replace(resolve(PROFILES["ci"], steps=None, fine_tune=True, device="cpu"), total_steps=0)
    run_full(args, profile, "en-us", StageSignals())
    written = model_of(tmp_path / "out" / "model.pth")
    expected = generator(model_of(base / BASE_MODEL_NAME))
    assert written.keys() == expected.keys() and len(written) > 100
    assert all(written[k].dtype == expected[k].dtype and torch.equal(written[k], expected[k]) for k in expected)


def test_one_step_stays_close_to_the_base_and_far_from_a_fresh_initialisation(base, tuned, capsys):
    """One step moves the generator by a small fraction of its norm; a fresh model is as far as a random vector."""
    from TTS.tts.configs.vits_config import VitsConfig
    from TTS.tts.models.vits import Vits

    assert tuned["first"][0] == 0, tuned["first"][1][-3000:]
    base_generator = generator(model_of(base / BASE_MODEL_NAME))
    stepped = tuned["model"]
    config = VitsConfig()
    config.from_dict(json.loads((base / BASE_CONFIG_NAME).read_text()))
    torch.manual_seed(1)
    fresh = generator(Vits(config).state_dict())
    moved, apart, size = distance(stepped, base_generator), distance(fresh, base_generator), norm(base_generator)
    with capsys.disabled():
        print(f"\n[distance] |base| {size:.3f}; one step from the base {moved:.4f} ({moved / size:.2e} of |base|);"
              f" a fresh initialisation from the base {apart:.3f} ({apart / size:.2f}); one step from the fresh one"
              f" {distance(stepped, fresh):.3f}")
    assert 0 < moved < apart / 100
    assert distance(stepped, fresh) > apart / 2


def test_a_rerun_resumes_the_fine_tune_from_its_own_checkpoint_not_the_base(base, tuned):
    """The second run restores step 1 of the fine-tune and rewrites the same model, not the base's generator."""
    code, log = tuned["second"]
    assert code == 0, log[-3000:]
    assert "Model restored from step 1 (step-00000001.pt)" in log and "already at step 1 of 1" in log
    assert "fine-tuning from the base model's weights" not in log and "step 1/1:" not in log
    rewritten = model_of(tuned["root"] / "out" / "model.pth")
    assert all(torch.equal(rewritten[k], tuned["model"][k]) for k in tuned["model"])
    base_generator = generator(model_of(base / BASE_MODEL_NAME))
    assert distance(rewritten, base_generator) > 0


def test_the_fingerprint_names_the_base():
    """A fine-tune of one base, of another and a run from scratch are three different runs."""
    versions = software_versions()
    ci = PROFILES["ci"]
    scratch = training_fingerprint("d", ci, "en-us", versions)
    assert scratch == training_fingerprint("d", ci, "en-us", versions, base=None)
    one = training_fingerprint("d", ci, "en-us", versions, base="a" * 64)
    other = training_fingerprint("d", ci, "en-us", versions, base="b" * 64)
    assert len({scratch, one, other}) == 3


def test_a_checkpoint_of_a_fine_tune_of_another_base_is_not_resumed(base, tuned, tmp_path):
    """The same weights saved again (another file, another identity) are another base: the checkpoint is dropped."""
    other = tmp_path / "other-base"
    other.mkdir()
    shutil.copy(base / BASE_CONFIG_NAME, other / BASE_CONFIG_NAME)
    torch.save({**torch.load(base / BASE_MODEL_NAME, weights_only=True), "note": "saved again"},
               other / BASE_MODEL_NAME)
    assert base_identity(other) != base_identity(base)
    shutil.copytree(tuned["root"] / "ck", tmp_path / "ck")
    assert list_checkpoints(tmp_path / "ck")
    args = full_argv(tuned["root"] / "dataset", tmp_path / "out", tmp_path / "ck", "--base-model-dir", str(other),
                     "--steps", "1")
    code, log = run(args, tmp_path / "full.log")
    assert code == 0, log[-3000:]
    assert "is of another dataset, profile, version or base model: removed, not resumed" in log
    assert "Model restored" not in log and "fine-tuning from the base model's weights" in log and "step 1/1:" in log


def _edit_config(base: Path, out: Path, change) -> None:
    data = json.loads((base / BASE_CONFIG_NAME).read_text())
    change(data)
    (out / BASE_CONFIG_NAME).write_text(json.dumps(data))


def _edit_model(base: Path, out: Path, change) -> None:
    saved = torch.load(base / BASE_MODEL_NAME, weights_only=True)
    saved["model"] = change(dict(saved["model"]))
    torch.save(saved, out / BASE_MODEL_NAME)


def _one_more_symbol(data: dict) -> None:
    data["characters"]["characters"] += "\u0416"


def _widen(state: dict) -> dict:
    key = "duration_predictor.pre.weight"
    state[key] = torch.zeros(state[key].shape[0] + 1, *state[key].shape[1:])
    return state


def _drop_discriminator_tensor(state: dict) -> dict:
    del state[sorted(k for k in state if k.startswith("disc."))[0]]
    return state


def _multi_speaker(data: dict) -> None:
    data["model_args"]["use_speaker_embedding"] = True
    data["use_speaker_embedding"] = True


# What is spoiled in a copy of the base, and the one line that must name it.
UNFIT = {
    "a vocabulary one symbol larger": (
        lambda b, o: _edit_config(b, o, _one_more_symbol),
        r"does not fit the model its config\.json builds: its config\.json's vocabulary has (\d+) symbols,"
        rf" model\.pth's text embedding \({TEXT_EMBEDDING}\) (\d+) rows$"),
    "a tensor of another shape": (
        lambda b, o: _edit_model(b, o, _widen),
        r"does not fit the model its config\.json builds: 1 tensor\(s\) reshaped"
        r" \(duration_predictor\.pre\.weight \[\d+, \d+, 1\] in model\.pth, \[\d+, \d+, 1\] in the model\)$"),
    "a discriminator tensor missing": (
        lambda b, o: _edit_model(b, o, _drop_discriminator_tensor),
        r"does not fit the model its config\.json builds: 1 tensor\(s\) missing from model\.pth \(disc\.[^ ]+\)$"),
    "the generator-only model.pth artifact": (
        lambda b, o: _edit_model(b, o, generator),
        r"model\.pth holds no discriminator \(disc\.\*\)"),
    "another sample rate": (
        lambda b, o: _edit_config(b, o, lambda data: data["audio"].update(sample_rate=16000)),
        r"config\.json is for 16000 Hz audio; the dataset is 22050 Hz$"),
    "a multi-speaker model": (
        lambda b, o: _edit_config(b, o, _multi_speaker),
        r"is a multi-speaker or multi-language model \(use_speaker_embedding\)"),
}


def spoiled_copy(base: Path, out: Path, how: str) -> Path:
    shutil.copytree(base, out)
    UNFIT[how][0](base, out)
    return out


@pytest.fixture(scope="module")
def tune_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tune-dataset")
    make_dataset(root / "dataset", clips=CLIPS, voice=TUNE_VOICE)
    return root / "dataset"


@pytest.mark.parametrize("how", list(UNFIT))
def test_an_unfit_base_is_refused_before_any_training_step(base, tune_dataset, tmp_path, capsys, how):
    """Each misfit raises UnfitBase with one line naming it; no step is trained and no checkpoint written."""
    import re

    unfit = spoiled_copy(base, tmp_path / "base", how)
    (tmp_path / "ck").mkdir()
    args = argparse.Namespace(dataset=tune_dataset, out=tmp_path / "out", checkpoints=tmp_path / "ck",
                              base_model_dir=unfit)
    profile = resolve(PROFILES["ci"], steps=1, fine_tune=True, device="cpu")
    with pytest.raises(UnfitBase) as refused:
        run_full(args, profile, "en-us", StageSignals())
    message = str(refused.value)
    assert "\n" not in message and re.search(UNFIT[how][1], message), message
    if how == "a vocabulary one symbol larger":
        symbols, rows = re.search(UNFIT[how][1], message).groups()
        assert int(symbols) == int(rows) + 1
    assert "step 1/" not in capsys.readouterr().out
    assert list_checkpoints(tmp_path / "ck") == [] and not (tmp_path / "out" / "model.pth").exists()


def test_the_stage_exits_65_with_one_line_for_a_base_of_another_vocabulary(base, tune_dataset, tmp_path):
    """As the worker runs it: exit 65 (permanent), the reason on the log's last line, nothing trained."""
    unfit = spoiled_copy(base, tmp_path / "base", "a vocabulary one symbol larger")
    code, log = run(full_argv(tune_dataset, tmp_path / "out", tmp_path / "ck", "--base-model-dir", str(unfit)),
                    tmp_path / "full.log")
    assert code == 65, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith(f"unusable base model: the base model in {unfit} does not fit"), last
    assert "vocabulary has" in last and "step 1/" not in log and "VITS:" not in log


def test_a_base_directory_without_its_files_is_the_hosts_problem(tune_dataset, tmp_path):
    """An empty base directory (the host's copy missing) exits 70, retried elsewhere, not 65."""
    (tmp_path / "empty").mkdir()
    code, log = run(full_argv(tune_dataset, tmp_path / "out", tmp_path / "ck", "--base-model-dir",
                              str(tmp_path / "empty")), tmp_path / "full.log")
    assert code == 70, log[-3000:]
    assert log.strip().splitlines()[-1] == f"host unfit: the base model directory {tmp_path / 'empty'} has no model.pth"


def test_the_profiles_fine_tune_for_fewer_steps_than_from_scratch():
    """production fine-tunes for 15,000 steps (half its 30,000), ci for 4 with a checkpoint on the way."""
    production, ci = PROFILES["production"], PROFILES["ci"]
    assert (production.fine_tune_steps, production.total_steps) == (15_000, 30_000)
    assert 0 < ci.checkpoint_every_steps < ci.fine_tune_steps <= ci.total_steps
    assert resolve(ci, steps=None, fine_tune=True, device=None).total_steps == ci.fine_tune_steps
    assert resolve(ci, steps=3, fine_tune=True, device=None).total_steps == 3
