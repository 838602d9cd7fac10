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
    # Usable speech (the seconds of the clips data preparation keeps) below which the job is refused
    # (docs/trainer.md, "Data preparation").
    min_speech_s: float = 0.0
    # Global steps of a fine-tune from a base model (``full --base-model-dir``), in place of total_steps.
    fine_tune_steps: int = 0
    # Where embed and full run unless --device says otherwise; never a silent fallback (docs/trainer.md).
    device: str = "cpu"
    # VitsArgs overrides on top of Coqui's defaults (a base model's own config.json replaces them).
    model_args: dict[str, Any] = field(default_factory=dict)
    # The training recipe (docs/trainer.md, "The training recipe"): the peak rates of both optimizers (from
    # scratch: Coqui's and Piper's 2e-4; a fine-tune: half), reached after a linear warm-up over this fraction
    # of the steps, then a cosine decay to this fraction of the peak at the last step.
    learning_rate: float = 2e-4
    fine_tune_learning_rate: float = 1e-4
    warmup_fraction: float = 0.02
    final_lr_fraction: float = 0.1
    # Steps between two validations on the held-out clips (the last step is always validated).
    validate_every_steps: int = 1_000
    # A fine-tune on less speech than this keeps the base's text encoder frozen.
    freeze_text_encoder_below_s: float = 600.0

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
        # Four of the tests' espeak-ng sentences (2-4 s each): ci trains on what the tests make up.
        min_speech_s=5.0,
        fine_tune_steps=4,
        device="cpu",
        validate_every_steps=2,
        # Above the 6 made-up clips of the tests (about 25 s): a ci fine-tune freezes the text encoder.
        freeze_text_encoder_below_s=60.0,
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
        # Five minutes in at least 50 clips of 1-12 s: below that a fine-tune of a few thousand steps
        # overfits the few sentences it saw (Piper's fine-tuning guide asks for minutes, not seconds), and a
        # held-out tenth is too few clips to pick a checkpoint by. VITS drops clips over ~11.6 s (its
        # recipe) and long clips make the alignment quadratic, hence the 12 s ceiling of segmentation.
        min_clips=50,
        min_clip_s=1.0,
        max_clip_s=12.0,
        min_speech_s=300.0,
        fine_tune_steps=15_000,
        device="cuda",
        model_args={},
    ),
}
