"""Training profiles: ``ci`` (a few CPU steps that still exercise every code path) and ``production``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Profile:
    name: str
    total_steps: int
    checkpoint_every_steps: int
    keep_checkpoints: int
    batch_size: int
    min_clips: int
    min_clip_s: float
    max_clip_s: float
    # Global steps of a fine-tune from a base model (``full --base-model-dir``), in place of total_steps.
    fine_tune_steps: int = 0
    # Where embed and full run unless --device says otherwise; never a silent fallback (docs/trainer.md).
    device: str = "cpu"
    # VitsArgs overrides on top of Coqui's defaults (a base model's own config.json replaces them).
    model_args: dict[str, Any] = field(default_factory=dict)

    def fingerprint_fields(self) -> dict[str, Any]:
        """What a checkpoint's meaning depends on: not the device, so a retry on another host resumes it."""
        fields = asdict(self)
        del fields["device"]
        return fields


def resolve(profile: Profile, *, steps: int | None, fine_tune: bool, device: str | None) -> Profile:
    """The profile a run trains with: a fine-tune's step count, ``--steps`` over either, ``--device`` over the
    profile's default."""
    if fine_tune:
        profile = replace(profile, total_steps=profile.fine_tune_steps)
    if steps is not None:
        profile = replace(profile, total_steps=steps)
    if device is not None:
        profile = replace(profile, device=device)
    return profile


PROFILES: dict[str, Profile] = {
    # 16.3 M parameters, 13.9 M of them the discriminator (model.pth holds the 2.4 M of the generator):
    # a couple of CPU-s a step, and still every part of a real VITS.
    "ci": Profile(
        name="ci",
        total_steps=6,
        checkpoint_every_steps=2,
        keep_checkpoints=2,
        batch_size=2,
        min_clips=4,
        min_clip_s=0.5,
        max_clip_s=20.0,
        fine_tune_steps=4,
        device="cpu",
        model_args={
            "hidden_channels": 64,
            "hidden_channels_ffn_text_encoder": 256,
            "num_layers_text_encoder": 2,
            "num_layers_posterior_encoder": 4,
            "num_layers_flow": 2,
            "upsample_initial_channel_decoder": 64,
            "periods_multi_period_discriminator": [2],
            "spec_segment_size": 16,
        },
    ),
    # Coqui's VITS defaults (about 83 M parameters with the discriminator); sized for one GPU and one
    # worker attempt (JOB_TIME_LIMIT_SECONDS 6 h) at well under a second a step.
    # A fine-tune from a base model trains half as long: Piper's training guide fine-tunes for about 1,000
    # epochs on top of a base where a voice from scratch takes about 2,000. 15,000 steps fit the train_full
    # timeout of config/pipeline.real.toml (16,200 s) at up to 1 s a step with some 1,200 s left for the
    # start (imports, phonemising) and fifteen checkpoints of 1 GB: twice the margin of the 30,000 from scratch.
    "production": Profile(
        name="production",
        total_steps=30_000,
        checkpoint_every_steps=1_000,
        keep_checkpoints=2,
        batch_size=16,
        min_clips=10,
        min_clip_s=0.5,
        max_clip_s=30.0,
        fine_tune_steps=15_000,
        device="cuda",
        model_args={},
    ),
}
