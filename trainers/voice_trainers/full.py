"""``full``: Coqui VITS trained from scratch or fine-tuned from a base model, resumable, stopping on the global step."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from voice_trainers.base import Base, apply_base_config, load_base_weights, read_base
from voice_trainers.batching import EpochBatches, held_out_split
from voice_trainers.checkpoints import (
    atomic_write,
    checkpoint_path,
    list_checkpoints,
    prune,
    read_best,
    run_fingerprint,
    software_versions,
)
from voice_trainers.coqui import (
    DISCRIMINATOR_PREFIX,
    build_config,
    import_torch,
    parameter_count,
    patch_audio_loader,
    portable_config,
)
from voice_trainers.dataset import Clip, UnusableData, dataset_fingerprint, load_clips
from voice_trainers.device import select_device
from voice_trainers.loop import Precision, Run, freeze_text_encoder, should_freeze_text_encoder, train
from voice_trainers.profiles import Profile
from voice_trainers.signals import StageSignals
from voice_trainers.validation import HeldOut, Score, validation_score

MODEL_NAME = "model.pth"
CONFIG_NAME = "config.json"
SPEAKER = "speaker"

# Coqui's ids (one per IPA symbol, stress and length marks included, a blank between every two) that one
# second of speech can carry. Measured with espeak-ng: conversational speech (150 words a minute) gives
# 29-36 ids/s in English, French, German and Mandarin alike, espeak-ng at its fastest (450 words a minute)
# 95. A text well above that is not what the recording says: a date, a number or a CJK text that espeak-ng
# spells out at length, or the wrong transcript, and its length costs memory quadratically (below).
MAX_IDS_PER_SECOND = 100
# On top, for a short clip: "Hello world." is 29 ids, and a word may fill half a second.
IDS_SLACK = 50
# Whatever the duration: the text encoder's self-attention keeps several (batch x heads x ids x ids)
# tensors per layer for the backward pass, and a batch is padded to its longest text. Measured on the CPU,
# production's encoder holds 0.85 GB per clip of 1,500 ids (some 14 GB for its batch of 16), and the square
# of the length makes 9,000 ids 36 times that. 1,500 ids are 30 s (production's longest clip) at 50 ids/s,
# half again conversational speed.
MAX_IDS_PER_CLIP = 1_500
# How many left-out clips the summary line names: it must stay within the log tail the job record keeps.
LEFT_OUT_NAMED = 10
# Coqui logs a clip's whole phoneme string when it meets a character its vocabulary lacks: tens of
# thousands of characters on one line would crowd the reasons out of that tail.
LOG_MESSAGE_MAX_CHARS = 160


def run_full(args: argparse.Namespace, profile: Profile, voice: str, signals: StageSignals, *,
             score: Score = validation_score, precision: Precision | None = None) -> None:
    """``score`` and ``precision`` are for tests: another validation rule, bf16 autocast on the CPU."""
    clips = load_clips(args.dataset, min_clip_s=profile.min_clip_s, max_clip_s=profile.max_clip_s,
                       min_clips=profile.min_clips)
    torch = import_torch()
    # Before anything is read or built: a host without the device asked for is not this job's fault (exit 70).
    device = select_device(torch, profile.device)
    base_dir = getattr(args, "base_model_dir", None)
    base = read_base(base_dir, torch) if base_dir is not None else None
    fine_tune = base is not None
    fingerprint = training_fingerprint(dataset_fingerprint(args.dataset, clips), profile, voice,
                                       software_versions(), base=base.identity if base is not None else None)
    patch_audio_loader()
    from TTS.tts.models.vits import Vits

    cache = args.checkpoints / f"phonemes-{fingerprint[:16]}"
    for stale in args.checkpoints.glob("phonemes-*"):
        if stale != cache:
            shutil.rmtree(stale, ignore_errors=True)
    seed = int(fingerprint[:8], 16)
    torch.manual_seed(seed)
    config = build_config(profile, voice, phoneme_cache=cache)
    if base is not None:
        config = apply_base_config(config, base.config)
    # Vits builds its audio processor and tokenizer from the config (and fills in the vocabulary).
    model = Vits(config)
    # Piper's phonemizer, so the light voice is fed the ids trained on; a language the vocabulary (the
    # base's, with one) cannot carry whole is refused before any training (voice_trainers.tokenizer).
    from voice_trainers.tokenizer import check_language, install

    check_language(install(model, voice))
    if base is not None:
        load_base_weights(base, model)
        print(f"fine-tuning from the base model in {base.directory} (identity {base.identity[:16]},"
              f" {len(base.state)} tensors loaded strictly); optimisers and schedules start afresh", flush=True)
        # The model holds the weights now: production's would otherwise sit in memory twice.
        base = dataclasses.replace(base, state={})
    model = model.to(device)
    config = model.config
    samples = usable_samples(args.dataset, clips, model.tokenizer, profile.min_clips)
    split = held_out_split([s["audio_unique_name"] for s in samples], profile.min_clips)
    train_samples = [samples[i] for i in split.train]
    held_out = [samples[i] for i in split.held_out]
    if split.note is not None:
        print(f"NOTE {split.note}", flush=True)
    durations_s = {f"#wavs/{clip.uid}": clip.duration_s for clip in clips}
    speech_s = sum(durations_s[s["audio_unique_name"]] for s in train_samples)
    print(f"VITS: {parameter_count(model) / 1e6:.1f} M parameters on {device}, {len(train_samples)} clips"
          f" ({speech_s:.0f} s) train, {len(held_out)} held out for validation", flush=True)
    if should_freeze_text_encoder(fine_tune, speech_s, profile):
        frozen = freeze_text_encoder(model)
        print(f"text encoder frozen ({frozen} tensors): {speech_s:.0f} s of speech, under the"
              f" {profile.freeze_text_encoder_below_s:.0f} s a fine-tune needs to retrain it", flush=True)
    optimizers = model.get_optimizer()
    # The learning rate is a function of the step (voice_trainers.schedule), set before each step.
    schedulers: list[Any] = [None, None]
    criteria = [criterion.to(device) for criterion in model.get_criterion()]
    step = restore(args.checkpoints, fingerprint, model, optimizers, schedulers, torch, base=base)
    best = stored_best(args.checkpoints, fingerprint, torch)
    if best is not None:
        print(f"best validated step so far: {best['step']} (score {best['score']:.4f})", flush=True)
    # A resumed run draws other noise than the first steps did, not the same again.
    torch.manual_seed(seed + step)
    if step >= profile.total_steps:
        print(f"already at step {step} of {profile.total_steps}", flush=True)
    else:
        loader, sampler = training_loader(model, config, train_samples, profile.batch_size, seed, torch)
        measure = None
        if held_out:
            measure = HeldOut(model, config, held_out, [s["audio_file"] for s in train_samples], torch, device)
        peak = profile.fine_tune_learning_rate if fine_tune else profile.learning_rate
        run = Run(model=model, loader=loader, sampler=sampler, optimizers=optimizers, criteria=criteria,
                  config=config, profile=profile, fingerprint=fingerprint, checkpoints=args.checkpoints,
                  signals=signals, torch=torch, device=device, peak_lrs=[peak, peak], measure=measure,
                  best_score=best["score"] if best is not None else None, score=score, precision=precision,
                  save_checkpoint=lambda at: save_checkpoint(args.checkpoints, at, fingerprint, model, optimizers,
                                                             schedulers, profile.keep_checkpoints, torch))
        step = train(run, step)
        best = stored_best(args.checkpoints, fingerprint, torch)
    write_outputs(args.out, model, config, step, torch, best=best)


def stored_best(checkpoints: Path, fingerprint: str, torch: Any) -> dict[str, Any] | None:
    return read_best(checkpoints, fingerprint, lambda path: torch.load(path, map_location="cpu", weights_only=True))


def training_loader(model: Any, config: Any, samples: list[dict[str, Any]], batch_size: int, seed: int,
                    torch: Any) -> tuple[Any, EpochBatches]:
    """Coqui's dataset (its length filters and phonemes) read in length-bucketed batches reshuffled each epoch."""
    dataset = model.get_data_loader(config, is_eval=False, samples=samples, verbose=False).dataset
    sampler = EpochBatches([item["audio_length"] for item in dataset.samples], batch_size, seed)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=dataset.collate_fn,
                                         num_workers=0, pin_memory=False)
    return loader, sampler


def training_fingerprint(dataset: str, profile: Profile, voice: str, versions: dict[str, str], *,
                         base: str | None = None) -> str:
    """What a checkpoint of this stage trains: the data, the profile, the voice, the code that reads it, and
    the base model's identity when it fine-tunes one (a checkpoint of a fine-tune of another base is not resumed).

    The versions are in it because another Coqui (or adapter) may name or mean its parameters differently.
    """
    parts: dict[str, Any] = {"base": base} if base is not None else {}
    return run_fingerprint(stage="full", dataset=dataset, profile=profile.fingerprint_fields(), voice=voice,
                           versions=versions, **parts)


def phoneme_id_limit(duration_s: float) -> int:
    """The most phoneme ids a clip of this duration can be saying, within what one clip may cost in memory."""
    return min(MAX_IDS_PER_CLIP, int(MAX_IDS_PER_SECOND * duration_s) + IDS_SLACK)


def why_left_out(id_count: int, spoken_count: int, duration_s: float) -> str | None:
    """Why a clip's phonemes cannot be trained on (None: they can)."""
    if spoken_count == 0:
        return "its text phonemises to nothing"
    limit = phoneme_id_limit(duration_s)
    if id_count > limit:
        return f"{id_count} phoneme ids for {duration_s:.1f} s of audio, more than the {limit} that fit it"
    return None


class _ShortMessages(logging.Filter):
    """Cuts a log message to ``LOG_MESSAGE_MAX_CHARS``, saying how long it was."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > LOG_MESSAGE_MAX_CHARS:
            record.msg, record.args = f"{message[:LOG_MESSAGE_MAX_CHARS]}... ({len(message)} characters)", None
        return True


def usable_samples(dataset_dir: Path, clips: list[Clip], tokenizer: Any, min_clips: int) -> list[dict[str, Any]]:
    """Coqui samples of the clips whose phonemes are speech that fits the clip's audio; too few is unusable.

    The texts are tokenised as training will: only the id count shows what espeak-ng made of a text.
    """
    characters = tokenizer.characters
    not_spoken = set(characters.punctuations) | {" "}
    tokenizer_log = logging.getLogger(type(tokenizer).__module__)
    short = _ShortMessages()
    tokenizer_log.addFilter(short)
    samples, left_out = [], []
    try:
        for clip in clips:
            ids = tokenizer.text_to_ids(clip.text)
            symbols = [characters.id_to_char(i) for i in ids]
            spoken = [s for s in symbols if len(s) == 1 and s not in not_spoken]
            reason = why_left_out(len(ids), len(spoken), clip.duration_s)
            if reason is not None:
                left_out.append(f"clip {clip.index} ({clip.uid}): {reason}")
                continue
            samples.append({
                "text": clip.text,
                "audio_file": str(clip.wav_path),
                "speaker_name": SPEAKER,
                "root_path": str(dataset_dir),
                "language": "",
                "audio_unique_name": f"#wavs/{clip.uid}",
            })
    finally:
        tokenizer_log.removeFilter(short)
    if left_out:
        more = f"; and {len(left_out) - LEFT_OUT_NAMED} more" if len(left_out) > LEFT_OUT_NAMED else ""
        # NOTE: the worker keeps the line on the job's record, so a user learns which clips did not count.
        named = "; ".join(left_out[:LEFT_OUT_NAMED])
        print(f"NOTE left out {len(left_out)} clip(s) after phonemising: {named}{more}", flush=True)
    if len(samples) < min_clips:
        raise UnusableData(f"{len(samples)} clips whose text phonemises to speech that fits their audio,"
                           f" at least {min_clips} needed")
    return samples


def restore(checkpoints: Path, fingerprint: str, model: Any, optimizers: list[Any], schedulers: list[Any],
            torch: Any, *, base: Base | None = None) -> int:
    """The step of the newest checkpoint of this very run that restores whole (0: from scratch, or the base).

    A checkpoint that cannot be read or does not fit (not a dict, a key missing, a parameter renamed or
    reshaped) is removed and an older one tried; what it had loaded before it failed is undone, so a run
    from scratch starts from exactly the state it would have had without it (a fine-tune: from the base).
    A fine-tune's own checkpoint wins over the base: it is the base plus the steps already trained.
    """
    foreign = "another dataset, profile, version or base model" if base is not None else \
        "another dataset, profile or version"
    untouched = snapshot(model, optimizers, schedulers)
    for _, path in list_checkpoints(checkpoints):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise TypeError(f"holds a {type(state).__name__}, not a dict")
            if state.get("fingerprint") != fingerprint:
                # Another dataset, profile or version: resuming would train the wrong thing, and keeping it
                # would only crowd out this run's checkpoints.
                print(f"checkpoint {path.name} is of {foreign}: removed, not resumed", flush=True)
                path.unlink(missing_ok=True)
                continue
            step = load_state(state, model, optimizers, schedulers)
        except Exception as exc:  # a torn, foreign or misfitting file: fall back to an older one
            put_back(untouched, model, optimizers, schedulers)
            # Kept, it would never resume and, as the newest, would make pruning delete this run's checkpoints.
            path.unlink(missing_ok=True)
            detail = " ".join(str(exc).split())[:200]
            print(f"checkpoint {path.name} cannot be restored ({type(exc).__name__}: {detail}): removed,"
                  f" trying an older one", flush=True)
            continue
        print(f"Model restored from step {step} ({path.name})", flush=True)
        return step
    if base is not None:
        print("no checkpoint to resume from: fine-tuning from the base model's weights", flush=True)
    else:
        print("no checkpoint to resume from: training from scratch", flush=True)
    return 0


def load_state(state: dict[str, Any], model: Any, optimizers: list[Any], schedulers: list[Any]) -> int:
    """Apply a checkpoint's states; raises when any part does not fit (some parts may be applied by then)."""
    step = int(state["step"])
    if step < 1:
        raise ValueError(f"step {step}")
    model.load_state_dict(state["model"])
    for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    for scheduler, saved in zip(schedulers, state["schedulers"], strict=True):
        if (scheduler is None) != (saved is None):
            raise ValueError("the schedulers differ")
        if scheduler is not None:
            scheduler.load_state_dict(saved)
    return step


def snapshot(model: Any, optimizers: list[Any], schedulers: list[Any]) -> dict[str, Any]:
    """Copies of the states before any checkpoint is tried (the model's on the CPU, to spare the GPU)."""
    return {
        "model": {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()},
        "optimizers": [copy.deepcopy(optimizer.state_dict()) for optimizer in optimizers],
        "schedulers": [copy.deepcopy(s.state_dict()) if s is not None else None for s in schedulers],
    }


def put_back(untouched: dict[str, Any], model: Any, optimizers: list[Any], schedulers: list[Any]) -> None:
    """Undo a checkpoint that was applied only in part (``load_state_dict`` copies what fits before it raises)."""
    model.load_state_dict(untouched["model"])
    for optimizer, saved in zip(optimizers, untouched["optimizers"], strict=True):
        optimizer.load_state_dict(copy.deepcopy(saved))
    for scheduler, saved in zip(schedulers, untouched["schedulers"], strict=True):
        if scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(saved))


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


def write_outputs(out: Path, model: Any, config: Any, step: int, torch: Any, *,
                  best: dict[str, Any] | None = None) -> None:
    """model.pth holds the generator only (the inference checkpoint): the best-validated one when the run
    validated, else the last step's; ``step`` is how far the run trained, ``best_step`` (when validated) the
    step whose weights these are. config.json has no job paths."""
    generator = {k: v for k, v in model.state_dict().items() if not k.startswith(DISCRIMINATOR_PREFIX)}
    saved: dict[str, Any] = {"step": step}
    if best is not None:
        generator, saved["best_step"] = best["model"], best["step"]
        print(f"shipping the best validated step {best['step']} (score {best['score']:.4f}), trained to step {step}",
              flush=True)
    buffer = io.BytesIO()
    torch.save({"model": generator, **saved}, buffer)
    atomic_write(out / MODEL_NAME, lambda handle: handle.write(buffer.getvalue()))
    text = json.dumps(portable_config(config), indent=2, sort_keys=True) + "\n"
    atomic_write(out / CONFIG_NAME, lambda handle: handle.write(text.encode()))
    print(f"wrote {MODEL_NAME} ({(out / MODEL_NAME).stat().st_size / 1e6:.1f} MB) and {CONFIG_NAME} at step {step}",
          flush=True)
