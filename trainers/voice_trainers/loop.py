"""The full stage's training loop: per-step learning rate, bf16 autocast on CUDA, validation and the best
checkpoint, METRIC lines, and a lost CUDA device turned into exit 70 (never a CPU continuation)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voice_trainers.checkpoints import write_best
from voice_trainers.coqui import DISCRIMINATOR_PREFIX
from voice_trainers.device import HostUnfit
from voice_trainers.profiles import Profile
from voice_trainers.schedule import lr_factor, set_learning_rates
from voice_trainers.signals import StageSignals
from voice_trainers.validation import Measure, Score, validation_score

# The interface the worker reads (docs/trainer.md): 16 name=value pairs at most, names of this shape.
METRIC_PAIRS_MAX = 16
# Coqui's generator loss terms printed each step (loss_gen is the adversarial term, ``loss`` their sum).
GENERATOR_TERMS = ("loss_gen", "loss_kl", "loss_feat", "loss_mel", "loss_duration")
# Messages of a CUDA RuntimeError that are not the device going away: memory (the worker retries) and an
# index out of range inside a kernel (a bug or bad data, not the host's fault).
NOT_DEVICE_LOSS = ("out of memory", "device-side assert")


class Precision:
    """bf16 autocast around the model's forward on CUDA only; the spectrograms and mels always in fp32.

    Coqui computes the training mels under ``autocast("cuda", enabled=False)`` on ``.float()`` inputs; the
    batch's own spectrogram and mel are computed here under ``fp32()``.
    """

    def __init__(self, torch: Any, device_type: str, *, autocast_device_type: str | None = None) -> None:
        self.torch = torch
        self.device_type = device_type
        # Tests run the bf16 path on the CPU by naming "cpu" here; the stage never does.
        self.autocast_device_type = autocast_device_type or ("cuda" if device_type == "cuda" else None)

    def forward(self) -> Any:
        if self.autocast_device_type is None:
            return contextlib.nullcontext()
        return self.torch.autocast(device_type=self.autocast_device_type, dtype=self.torch.bfloat16)

    def fp32(self) -> Any:
        return self.torch.autocast(device_type=self.autocast_device_type or self.device_type, enabled=False)


def device_lost(exc: BaseException, torch: Any) -> bool:
    """Whether a RuntimeError says the CUDA device is gone (a lost GPU, a driver or ECC fault)."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    message = str(exc)
    return "CUDA" in message and not any(marker in message for marker in NOT_DEVICE_LOSS)


def metric_line(step: int, values: Mapping[str, float]) -> str:
    """``METRIC step=<int> name=value ...``: the finite values only, at most ``METRIC_PAIRS_MAX`` pairs."""
    pairs = [f"{name}={value:.6g}" for name, value in values.items() if math.isfinite(value)]
    return " ".join([f"METRIC step={step}", *pairs[:METRIC_PAIRS_MAX]])


def freeze_text_encoder(model: Any) -> int:
    """Stop the text encoder (phoneme embedding included) from learning; returns how many tensors froze.

    Frozen params keep ``grad`` None, so AdamW skips them, weight decay included.
    """
    frozen = 0
    for parameter in model.text_encoder.parameters():
        parameter.requires_grad_(False)
        frozen += 1
    return frozen


def should_freeze_text_encoder(fine_tune: bool, speech_s: float, profile: Profile) -> bool:
    """Only a fine-tune (from scratch, a frozen encoder would stay random) on little speech."""
    return fine_tune and speech_s < profile.freeze_text_encoder_below_s


@dataclass
class Run:
    """What the loop trains with; ``sampler`` is the loader's EpochBatches, placed at the resumed step."""

    model: Any
    loader: Iterable[Any]
    sampler: Any
    optimizers: list[Any]
    criteria: list[Any]
    config: Any
    profile: Profile
    fingerprint: str
    checkpoints: Path
    signals: StageSignals
    torch: Any
    device: Any
    peak_lrs: list[float]
    measure: Measure | None
    best_score: float | None
    save_checkpoint: Callable[[int], None]
    score: Score = validation_score
    precision: Precision | None = None


def train(run: Run, step: int) -> int:
    """Train until the global step reaches the profile's total; a lost CUDA device raises HostUnfit."""
    try:
        return _train(run, step)
    except RuntimeError as exc:
        if run.device.type == "cuda" and (device_lost(exc, run.torch) or not run.torch.cuda.is_available()):
            detail = " ".join(str(exc).split())[:300]
            raise HostUnfit(f"the CUDA device was lost during training ({type(exc).__name__}: {detail});"
                            f" not going on on the CPU") from exc
        raise


def _train(run: Run, step: int) -> int:
    torch, model, profile = run.torch, run.model, run.profile
    precision = run.precision or Precision(torch, run.device.type)
    model.train()
    parameters = [
        list(model.disc.parameters()),
        [p for name, p in model.named_parameters() if not name.startswith(DISCRIMINATOR_PREFIX)],
    ]
    run.sampler.start(step)
    while step < profile.total_steps:
        for batch in run.loader:
            started_s = time.perf_counter()
            rates = set_learning_rates(run.optimizers, run.peak_lrs, lr_factor(
                step, profile.total_steps, profile.warmup_fraction, profile.final_lr_fraction))
            batch = model.format_batch(batch)
            batch = {k: v.to(run.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with precision.fp32():
                batch = model.format_batch_on_device(batch)
            terms: dict[str, float] = {}
            for index in (0, 1):
                with precision.forward():
                    _, loss_dict = model.train_step(batch, run.criteria[index], index)
                run.optimizers[index].zero_grad(set_to_none=True)
                loss_dict["loss"].backward()
                torch.nn.utils.clip_grad_norm_(parameters[index], run.config.grad_clip[index])
                run.optimizers[index].step()
                names = ("loss_disc",) if index == 0 else GENERATOR_TERMS
                terms.update({name: float(loss_dict[name].detach()) for name in names if name in loss_dict})
                terms["loss_disc" if index == 0 else "loss_gen_total"] = float(loss_dict["loss"].detach())
            if run.device.type == "cuda":
                torch.cuda.synchronize()
                if not torch.cuda.is_available():
                    raise RuntimeError("CUDA reports no device any more (torch.cuda.is_available() is false)")
            step += 1
            step_time_s = time.perf_counter() - started_s
            print(f"step {step}/{profile.total_steps}: loss_disc {terms['loss_disc']:.3f}"
                  f" loss_gen {terms['loss_gen_total']:.3f} ({step_time_s:.2f} s)", flush=True)
            print(metric_line(step, {**terms, "lr": rates[1], "step_time_s": step_time_s}), flush=True)
            print(f"PROGRESS {100 * step / profile.total_steps:.1f}", flush=True)
            if run.measure is not None and (step % profile.validate_every_steps == 0 or step == profile.total_steps):
                validate(run, step)
            due = step % profile.checkpoint_every_steps == 0 or step == profile.total_steps
            if run.signals.take_checkpoint_request() or due:
                run.save_checkpoint(step)
            if step >= profile.total_steps:
                break
    return step


def validate(run: Run, step: int) -> None:
    """Measure on the held-out clips; a better score than the best so far replaces the best generator."""
    assert run.measure is not None
    started_s = time.perf_counter()
    metrics = run.measure(run.model)
    score = float(run.score(metrics, step))
    print(metric_line(step, {**metrics, "val_score": score, "val_time_s": time.perf_counter() - started_s}),
          flush=True)
    if not math.isfinite(score) or (run.best_score is not None and not score < run.best_score):
        kept = f"{run.best_score:.4f}" if run.best_score is not None else "none"
        print(f"validation at step {step}: score {score:.4f}, the best stays {kept}", flush=True)
        return
    generator = {k: v.detach().to("cpu", copy=True) for k, v in run.model.state_dict().items()
                 if not k.startswith(DISCRIMINATOR_PREFIX)}
    write_best(run.checkpoints, run.fingerprint, step, score, generator, run.torch.save)
    run.best_score = score
    print(f"validation at step {step}: score {score:.4f}, the best so far (kept to ship)", flush=True)
