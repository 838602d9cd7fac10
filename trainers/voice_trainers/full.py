"""``full``: Coqui VITS trained from scratch, resumable, stopping on the global step."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import time
from pathlib import Path
from typing import Any

from voice_trainers.checkpoints import (
    atomic_write,
    checkpoint_path,
    list_checkpoints,
    prune,
    run_fingerprint,
)
from voice_trainers.coqui import (
    DISCRIMINATOR_PREFIX,
    build_config,
    import_torch,
    parameter_count,
    patch_audio_loader,
    portable_config,
)
from voice_trainers.dataset import dataset_fingerprint, load_clips, require_enough
from voice_trainers.profiles import Profile
from voice_trainers.signals import StageSignals

MODEL_NAME = "model.pth"
CONFIG_NAME = "config.json"
SPEAKER = "speaker"


def run_full(args: argparse.Namespace, profile: Profile, voice: str, signals: StageSignals) -> None:
    clips = load_clips(args.dataset, min_clip_s=profile.min_clip_s, max_clip_s=profile.max_clip_s,
                       min_clips=profile.min_clips)
    fingerprint = run_fingerprint(stage="full", dataset=dataset_fingerprint(args.dataset, clips),
                                  profile=profile.fingerprint_fields(), voice=voice)
    torch = import_torch()
    patch_audio_loader()
    from TTS.tts.models.vits import Vits

    cache = args.checkpoints / f"phonemes-{fingerprint[:16]}"
    for stale in args.checkpoints.glob("phonemes-*"):
        if stale != cache:
            shutil.rmtree(stale, ignore_errors=True)
    seed = int(fingerprint[:8], 16)
    torch.manual_seed(seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Vits builds its audio processor and tokenizer from the config (and fills in the vocabulary).
    model = Vits(build_config(profile, voice, phoneme_cache=cache)).to(device)
    config = model.config
    samples = usable_samples(args.dataset, clips, model.tokenizer)
    require_enough(len(samples), profile.min_clips, "clips whose text phonemises to something")
    print(f"VITS: {parameter_count(model) / 1e6:.1f} M parameters on {device}, {len(samples)} clips", flush=True)
    optimizers = model.get_optimizer()
    schedulers = model.get_scheduler(optimizers)
    criteria = [criterion.to(device) for criterion in model.get_criterion()]
    step = restore(args.checkpoints, fingerprint, model, optimizers, schedulers, torch)
    # A resumed run draws other noise than the first steps did, not the same again.
    torch.manual_seed(seed + step)
    if step >= profile.total_steps:
        print(f"already at step {step} of {profile.total_steps}", flush=True)
    else:
        loader = model.get_data_loader(config, is_eval=False, samples=samples, verbose=False)
        step = train(model, loader, optimizers, schedulers, criteria, config, profile, step, fingerprint,
                     args.checkpoints, signals, torch, device)
    write_outputs(args.out, model, config, step, torch)


def usable_samples(dataset_dir: Path, clips: list[Any], tokenizer: Any) -> list[dict[str, Any]]:
    """Coqui samples of the clips whose text gives at least one phoneme (punctuation and blanks do not count)."""
    characters = tokenizer.characters
    not_spoken = set(characters.punctuations) | {" "}
    samples = []
    for clip in clips:
        symbols = [characters.id_to_char(i) for i in tokenizer.text_to_ids(clip.text)]
        if not [s for s in symbols if len(s) == 1 and s not in not_spoken]:
            print(f"left out {clip.uid}: its text phonemises to nothing", flush=True)
            continue
        samples.append({
            "text": clip.text,
            "audio_file": str(clip.wav_path),
            "speaker_name": SPEAKER,
            "root_path": str(dataset_dir),
            "language": "",
            "audio_unique_name": f"#wavs/{clip.uid}",
        })
    return samples


def restore(checkpoints: Path, fingerprint: str, model: Any, optimizers: list[Any], schedulers: list[Any],
            torch: Any) -> int:
    """The step of the newest readable checkpoint of this very run (0: from scratch)."""
    for _, path in list_checkpoints(checkpoints):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a torn or foreign file: fall back to an older one
            print(f"checkpoint {path.name} unreadable ({type(exc).__name__}), trying an older one", flush=True)
            continue
        if state.get("fingerprint") != fingerprint:
            # Another dataset or profile: resuming would train the wrong thing, and keeping it would
            # only crowd out this run's checkpoints.
            print(f"checkpoint {path.name} is of another dataset or profile: removed, not resumed", flush=True)
            path.unlink(missing_ok=True)
            continue
        model.load_state_dict(state["model"])
        for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
            if scheduler is not None and saved is not None:
                scheduler.load_state_dict(saved)
        print(f"Model restored from step {state['step']} ({path.name})", flush=True)
        return int(state["step"])
    print("no checkpoint to resume from: training from scratch", flush=True)
    return 0


def save_checkpoint(checkpoints: Path, step: int, fingerprint: str, model: Any, optimizers: list[Any],
                    schedulers: list[Any], keep: int, torch: Any) -> None:
    state = {
        "step": step,
        "fingerprint": fingerprint,
        "model": model.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in optimizers],
        "schedulers": [scheduler.state_dict() if scheduler is not None else None for scheduler in schedulers],
    }
    path = checkpoint_path(checkpoints, step)
    atomic_write(path, lambda handle: torch.save(state, handle))
    prune(checkpoints, keep)
    print(f"checkpoint saved at step {step} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)


def train(model: Any, loader: Any, optimizers: list[Any], schedulers: list[Any], criteria: list[Any], config: Any,
          profile: Profile, step: int, fingerprint: str, checkpoints: Path, signals: StageSignals, torch: Any,
          device: Any) -> int:
    """Train until the global step reaches the profile's total; epochs only decide when schedulers step."""
    model.train()
    parameters = [
        list(model.disc.parameters()),
        [p for name, p in model.named_parameters() if not name.startswith(DISCRIMINATOR_PREFIX)],
    ]
    while step < profile.total_steps:
        for batch in loader:
            started_s = time.process_time()
            batch = model.format_batch(batch)
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            batch = model.format_batch_on_device(batch)
            losses = []
            for index in (0, 1):
                _, loss_dict = model.train_step(batch, criteria[index], index)
                optimizers[index].zero_grad(set_to_none=True)
                loss_dict["loss"].backward()
                torch.nn.utils.clip_grad_norm_(parameters[index], config.grad_clip[index])
                optimizers[index].step()
                losses.append(float(loss_dict["loss"].detach()))
            step += 1
            print(f"step {step}/{profile.total_steps}: loss_disc {losses[0]:.3f} loss_gen {losses[1]:.3f}"
                  f" ({time.process_time() - started_s:.1f} CPU-s)", flush=True)
            print(f"PROGRESS {100 * step / profile.total_steps:.1f}", flush=True)
            due = step % profile.checkpoint_every_steps == 0 or step == profile.total_steps
            if signals.take_checkpoint_request() or due:
                save_checkpoint(checkpoints, step, fingerprint, model, optimizers, schedulers,
                                profile.keep_checkpoints, torch)
            if step >= profile.total_steps:
                break
        for scheduler in schedulers:
            if scheduler is not None:
                scheduler.step()
    return step


def write_outputs(out: Path, model: Any, config: Any, step: int, torch: Any) -> None:
    """model.pth holds the generator only (the inference checkpoint); config.json has no job paths."""
    generator = {k: v for k, v in model.state_dict().items() if not k.startswith(DISCRIMINATOR_PREFIX)}
    buffer = io.BytesIO()
    torch.save({"model": generator, "step": step}, buffer)
    atomic_write(out / MODEL_NAME, lambda handle: handle.write(buffer.getvalue()))
    text = json.dumps(portable_config(config), indent=2, sort_keys=True) + "\n"
    atomic_write(out / CONFIG_NAME, lambda handle: handle.write(text.encode()))
    print(f"wrote {MODEL_NAME} ({(out / MODEL_NAME).stat().st_size / 1e6:.1f} MB) and {CONFIG_NAME} at step {step}",
          flush=True)
