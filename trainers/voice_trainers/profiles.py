"""Training profiles: ``ci`` (a few CPU steps that still exercise every code path) and ``production``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    # VitsArgs overrides on top of Coqui's defaults.
    model_args: dict[str, Any] = field(default_factory=dict)

    def fingerprint_fields(self) -> dict[str, Any]:
        return asdict(self)


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
    "production": Profile(
        name="production",
        total_steps=30_000,
        checkpoint_every_steps=1_000,
        keep_checkpoints=2,
        batch_size=16,
        min_clips=10,
        min_clip_s=0.5,
        max_clip_s=30.0,
        model_args={},
    ),
}
