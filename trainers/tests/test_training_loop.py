"""The training loop on a real ci-sized VITS, on the CPU: the text encoder frozen, the mels in fp32 under bf16
autocast, the best-validated checkpoint shipped and kept across a resume.

    cd trainers && .venv/bin/python -m pytest -q tests/test_training_loop.py
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from make_dataset import make_dataset
from voice_trainers.batching import EpochBatches
from voice_trainers.checkpoints import BEST_NAME, checkpoint_path
from voice_trainers.coqui import DISCRIMINATOR_PREFIX, build_config, patch_audio_loader
from voice_trainers.dataset import load_clips
from voice_trainers.full import run_full, training_loader, usable_samples
from voice_trainers.loop import Precision, Run, freeze_text_encoder, train
from voice_trainers.profiles import PROFILES
from voice_trainers.signals import StageSignals

CLIPS = 6


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loop") / "dataset"
    make_dataset(root, clips=CLIPS)
    return root


def tiny_run(dataset: Path, tmp_path: Path, **overrides) -> Run:
    """A ci VITS over the made-up clips, one step long, no validation and no checkpoint."""
    from TTS.tts.models.vits import Vits

    patch_audio_loader()
    profile = replace(PROFILES["ci"], total_steps=1)
    torch.manual_seed(0)
    model = Vits(build_config(profile, "en-us", phoneme_cache=tmp_path / "phonemes"))
    clips = load_clips(dataset, min_clip_s=profile.min_clip_s, max_clip_s=profile.max_clip_s,
                       min_clips=profile.min_clips)
    samples = usable_samples(dataset, clips, model.tokenizer, profile.min_clips)
    loader, sampler = training_loader(model, model.config, samples, profile.batch_size, 1, torch)
    assert isinstance(sampler, EpochBatches) and loader.batch_sampler is sampler
    fields = dict(model=model, loader=loader, sampler=sampler, optimizers=[],
                  criteria=list(model.get_criterion()), config=model.config, profile=profile, fingerprint="f" * 64,
                  checkpoints=tmp_path, signals=StageSignals(), torch=torch, device=torch.device("cpu"),
                  peak_lrs=[2e-4, 2e-4], measure=None, best_score=None, save_checkpoint=lambda step: None)
    fields.update(overrides)
    run = Run(**fields)
    if not run.optimizers:
        run.optimizers = model.get_optimizer()
    return run


def test_a_frozen_text_encoder_does_not_move_while_the_rest_of_the_generator_does(dataset, tmp_path):
    """After a step (AdamW, weight decay on), the text encoder is bit for bit as before; the decoder is not."""
    run = tiny_run(dataset, tmp_path)
    assert freeze_text_encoder(run.model) > 10
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    assert train(run, 0) == 1
    after = run.model.state_dict()
    encoder = [k for k in before if k.startswith("text_encoder.")]
    decoder = [k for k in before if k.startswith("waveform_decoder.") and before[k].is_floating_point()]
    assert encoder and all(torch.equal(before[k], after[k]) for k in encoder)
    assert sum(not torch.equal(before[k], after[k]) for k in decoder) > len(decoder) // 2


def test_under_bf16_autocast_the_spectrograms_and_mels_are_computed_in_fp32(dataset, tmp_path, monkeypatch):
    """The bf16 path (run here under the CPU's autocast) computes the batch's spectrogram and mel with autocast
    off, from fp32, and feeds Coqui's mel of the synthesis fp32, while the model's forward runs under autocast."""
    from TTS.tts.models import vits

    seen: list[tuple[str, torch.dtype, bool]] = []

    def spy(name, function):
        def wrapped(*args, **kwargs):
            tensor = kwargs.get("y", kwargs.get("spec", args[0] if args else None))
            seen.append((name, tensor.dtype, torch.is_autocast_enabled("cpu")))
            return function(*args, **kwargs)
        return wrapped

    for name in ("wav_to_mel", "wav_to_spec", "spec_to_mel"):
        monkeypatch.setattr(vits, name, spy(name, getattr(vits, name)))
    run = tiny_run(dataset, tmp_path, precision=Precision(torch, "cpu", autocast_device_type="cpu"))
    autocast_on: list[bool] = []
    run.model.text_encoder.register_forward_hook(
        lambda module, args, output: autocast_on.append(torch.is_autocast_enabled("cpu")))
    assert train(run, 0) == 1
    assert autocast_on == [True]
    # The batch's own (format_batch_on_device): fp32 in, autocast off, so the mel target is fp32.
    assert [(n, d, a) for n, d, a in seen if n != "wav_to_mel"] == \
        [("wav_to_spec", torch.float32, False), ("spec_to_mel", torch.float32, False)]
    # Coqui's mel of the generated audio: fp32 in (its autocast("cuda", enabled=False) does the rest on CUDA).
    assert [(n, d) for n, d, _ in seen if n == "wav_to_mel"] == [("wav_to_mel", torch.float32)]


def steps_of(path: Path) -> tuple[int, int | None]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["step"], state.get("best_step")


def generator_of(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return {k: v for k, v in state.items() if not k.startswith(DISCRIMINATOR_PREFIX)}


def lr_by_step(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^METRIC step=(\d+) .* lr=(\S+) ", out, re.M)}


def test_the_best_validated_step_is_shipped_and_stays_the_best_across_a_resume(dataset, tmp_path, capsys):
    """Scores 1.0, 0.5, 0.9, 0.8 at steps 1-4 ship step 2's generator; resumed from step 2 with worse scores for
    steps 3 and 4, the run still ships step 2 (best.pt beside the checkpoints) at the same learning rates."""
    profile = replace(PROFILES["ci"], total_steps=4, validate_every_steps=1, checkpoint_every_steps=1,
                      keep_checkpoints=4)
    checkpoints = tmp_path / "ck"
    checkpoints.mkdir()
    args = argparse.Namespace(dataset=dataset, out=tmp_path / "out", checkpoints=checkpoints, base_model_dir=None)
    scores = {1: 1.0, 2: 0.5, 3: 0.9, 4: 0.8}
    run_full(args, profile, "en-us", StageSignals(), score=lambda metrics, step: scores[step])
    first = capsys.readouterr().out
    assert re.search(r" 4 clips \(\d+ s\) train, 2 held out for validation$", first, re.M)
    step_names = [line.split()[2:] for line in first.splitlines() if line.startswith("METRIC step=3 ")]
    assert [[pair.split("=")[0] for pair in names] for names in step_names] == [
        ["loss_disc", "loss_gen", "loss_kl", "loss_feat", "loss_mel", "loss_duration", "loss_gen_total", "lr",
         "step_time_s"],
        ["val_mel_l1", "val_speaker_similarity", "val_score", "val_time_s"]]
    assert re.search(r"^METRIC step=2 val_mel_l1=\S+ val_speaker_similarity=\S+ val_score=0.5 val_time_s=\S+$",
                     first, re.M)
    assert "shipping the best validated step 2 (score 0.5000), trained to step 4" in first
    step_2 = generator_of(checkpoint_path(checkpoints, 2))
    shipped = generator_of(args.out / "model.pth")
    assert shipped.keys() == step_2.keys() and all(torch.equal(shipped[k], step_2[k]) for k in step_2)
    assert steps_of(args.out / "model.pth") == (4, 2)
    assert not all(torch.equal(shipped[k], v) for k, v in generator_of(checkpoint_path(checkpoints, 4)).items())

    for step in (3, 4):
        checkpoint_path(checkpoints, step).unlink()
    (args.out / "model.pth").unlink()
    run_full(args, profile, "en-us", StageSignals(), score=lambda metrics, step: {3: 0.7, 4: 0.6}[step])
    second = capsys.readouterr().out
    assert "Model restored from step 2" in second and "best validated step so far: 2 (score 0.5000)" in second
    assert "shipping the best validated step 2 (score 0.5000), trained to step 4" in second
    shipped = generator_of(args.out / "model.pth")
    assert all(torch.equal(shipped[k], step_2[k]) for k in step_2)
    assert (checkpoints / BEST_NAME).exists()
    assert lr_by_step(second) == {s: lr for s, lr in lr_by_step(first).items() if s > 2}
