"""The learning rate of each global step: a linear warm-up, then a cosine decay to a fraction of the peak.

A pure function of the step, so a resumed run continues at exactly the rate it left (nothing to restore),
and it is set on the optimizers before every step (docs/trainer.md, "The training recipe").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def warmup_steps(total_steps: int, warmup_fraction: float) -> int:
    return max(1, math.ceil(total_steps * warmup_fraction)) if total_steps > 0 else 0


def lr_factor(step: int, total_steps: int, warmup_fraction: float, final_fraction: float) -> float:
    """The multiple of the peak rate for the update that takes the model from ``step`` to ``step + 1``."""
    warmup = warmup_steps(total_steps, warmup_fraction)
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step + 1 - warmup) / decay_steps)
    return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress))


def set_learning_rates(optimizers: Sequence[Any], peaks: Sequence[float], factor: float) -> list[float]:
    """Write each optimizer's rate for this step; returns them (discriminator first, as Coqui orders them)."""
    rates = []
    for optimizer, peak in zip(optimizers, peaks, strict=True):
        for group in optimizer.param_groups:
            group["lr"] = peak * factor
        rates.append(peak * factor)
    return rates
