"""The base model a fine-tune starts from (``full --base-model-dir DIR``; docs/trainer.md, "Fine-tuning").

``DIR`` holds two files:

- ``model.pth``: a ``torch.save``'d dict whose ``"model"`` is a whole Coqui VITS state dict, the generator
  *and* the discriminator (``disc.*``); other keys (``step``, ``optimizers``...) are ignored. The full
  stage's own checkpoint ``{checkpoint_dir}/step-NNNNNNNN.pt`` is one; ``python -m voice_trainers.base
  CHECKPOINT CONFIG OUT_DIR`` copies it without the optimiser states. The stage's ``model.pth`` artifact
  is not: it holds the generator only.
- ``config.json``: the VITS config those weights were trained with (the full stage's ``config.json``).

The fine-tune takes the base's vocabulary (characters, blanks, BOS/EOS), audio config and model
arguments, builds the model from them and loads the weights strictly; a base that does not fit the model
its own config builds is refused before any training step (``UnfitBase``, exit 65).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from voice_trainers.checkpoints import atomic_write
from voice_trainers.coqui import DISCRIMINATOR_PREFIX
from voice_trainers.dataset import SAMPLE_RATE_HZ, UnusableData
from voice_trainers.device import HostUnfit

BASE_MODEL_NAME = "model.pth"
BASE_CONFIG_NAME = "config.json"
TEXT_EMBEDDING = "text_encoder.emb.weight"
# The config fields a fine-tune takes from its base: whatever decides the token ids, the features and the
# tensors' shapes. The rest (batch, clip lengths, the phoneme cache, the espeak voice of the job's
# language) is the stage's own.
# The phonemizer is not the base's: it is always Piper's (voice_trainers.tokenizer), so the light voice is
# fed what the model trained on; the base's vocabulary decides which of its symbols have ids.
BASE_FIELDS = ("model_args", "audio", "characters", "text_cleaner", "use_phonemes", "add_blank",
               "enable_eos_bos_chars")
# Speaker and language conditioning need a speaker or language file of the base; the stage trains one speaker.
_CONDITIONING = ("use_speaker_embedding", "use_d_vector_file", "use_language_embedding", "use_speaker_encoder_as_loss")
NAMED = 3


class UnfitBase(UnusableData):
    """The base model cannot be fine-tuned as it is: any job given it would fail the same way (exit 65)."""


@dataclass(frozen=True)
class Base:
    directory: Path
    # SHA-256 over both files' digests: part of the run's fingerprint.
    identity: str
    config: dict[str, Any]
    state: dict[str, Any]


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def base_identity(directory: Path) -> str:
    """What the base is, by content: a copy elsewhere is the same base, a changed byte another one."""
    parts = {name: file_sha256(directory / name) for name in (BASE_MODEL_NAME, BASE_CONFIG_NAME)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def read_base(directory: Path, torch: Any) -> Base:
    """The base's config and weights. Files missing: HostUnfit (this host's copy); files wrong: UnfitBase."""
    for name in (BASE_MODEL_NAME, BASE_CONFIG_NAME):
        if not (directory / name).is_file():
            raise HostUnfit(f"the base model directory {directory} has no {name}")
    try:
        config = json.loads((directory / BASE_CONFIG_NAME).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise UnfitBase(f"{BASE_CONFIG_NAME} is not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("model") != "vits":
        raise UnfitBase(f"{BASE_CONFIG_NAME} is not a VITS config (its \"model\" is not \"vits\")")
    try:
        saved = torch.load(directory / BASE_MODEL_NAME, map_location="cpu", weights_only=True)
    except Exception as exc:  # not a torch file, or one holding objects: refuse it, never unpickle code
        detail = " ".join(str(exc).split())[:160]
        raise UnfitBase(f"{BASE_MODEL_NAME} cannot be loaded as weights ({type(exc).__name__}: {detail})") from None
    state = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise UnfitBase(f"{BASE_MODEL_NAME} holds no state dict of tensors under \"model\"")
    if not any(key.startswith(DISCRIMINATOR_PREFIX) for key in state):
        raise UnfitBase(f"{BASE_MODEL_NAME} holds no discriminator ({DISCRIMINATOR_PREFIX}*): a base needs the"
                        f" whole training state, a checkpoint, not the generator-only model.pth artifact")
    return Base(directory=directory, identity=base_identity(directory), config=config, state=state)


def apply_base_config(config: Any, base_config: dict[str, Any]) -> Any:
    """``config`` (the stage's, for this job) with the ``BASE_FIELDS`` of the base's config.json."""
    from TTS.tts.configs.vits_config import VitsConfig

    base = VitsConfig()
    try:
        base.from_dict(dict(base_config))
    except Exception as exc:
        detail = " ".join(str(exc).split())[:160]
        raise UnfitBase(f"{BASE_CONFIG_NAME} is not a VITS config this Coqui reads ({type(exc).__name__}:"
                        f" {detail})") from None
    rate = base.audio.sample_rate
    if rate != SAMPLE_RATE_HZ:
        raise UnfitBase(f"{BASE_CONFIG_NAME} is for {rate} Hz audio; the dataset is {SAMPLE_RATE_HZ} Hz")
    conditioned = [name for name in _CONDITIONING
                   if getattr(base.model_args, name, False) or getattr(base, name, False)]
    speakers = max(getattr(base.model_args, "num_speakers", 0) or 0, getattr(base, "num_speakers", 0) or 0,
                   len(getattr(base, "speakers", None) or []))
    if conditioned or speakers > 1:
        raise UnfitBase(f"{BASE_CONFIG_NAME} is a multi-speaker or multi-language model"
                        f" ({', '.join(conditioned) or f'{speakers} speakers'});"
                        f" the stage fine-tunes single-speaker bases only")
    if not base.model_args.init_discriminator:
        raise UnfitBase(f"{BASE_CONFIG_NAME} builds no discriminator (model_args.init_discriminator false)")
    for name in BASE_FIELDS:
        setattr(config, name, getattr(base, name))
    return config


def _shape(tensor: Any) -> str:
    return "[" + ", ".join(str(n) for n in tensor.shape) + "]"


def misfit(base_state: dict[str, Any], model: Any) -> str | None:
    """Why ``base_state`` does not load strictly into ``model`` (None: it does), in one line."""
    expected = model.state_dict()
    vocabulary = len(model.tokenizer.characters.vocab)
    base_embedding = base_state.get(TEXT_EMBEDDING)
    if base_embedding is not None and TEXT_EMBEDDING in expected \
            and base_embedding.shape != expected[TEXT_EMBEDDING].shape:
        return (f"its config.json's vocabulary has {vocabulary} symbols, model.pth's text embedding"
                f" ({TEXT_EMBEDDING}) {base_embedding.shape[0]} rows")
    missing = [key for key in expected if key not in base_state]
    unexpected = [key for key in base_state if key not in expected]
    reshaped = [f"{key} {_shape(base_state[key])} in model.pth, {_shape(value)} in the model"
                for key, value in expected.items() if key in base_state and base_state[key].shape != value.shape]
    problems = []
    for what, keys in (("reshaped", reshaped), ("missing from model.pth", missing),
                       ("in model.pth but not in the model", unexpected)):
        if keys:
            more = f" and {len(keys) - NAMED} more" if len(keys) > NAMED else ""
            problems.append(f"{len(keys)} tensor(s) {what} ({'; '.join(keys[:NAMED])}{more})")
    return "; ".join(problems) or None


def load_base_weights(base: Base, model: Any) -> None:
    """The base's weights into ``model``, every tensor or none: a misfit is refused before training."""
    problem = misfit(base.state, model)
    if problem is not None:
        raise UnfitBase(f"the base model in {base.directory} does not fit the model its config.json builds:"
                        f" {problem}")
    model.load_state_dict(base.state, strict=True)


def write_base(checkpoint: Path, config: Path, out: Path, torch: Any) -> None:
    """A base directory from one of the full stage's checkpoints and its config.json, without optimiser states."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        raise ValueError(f"{checkpoint} holds no \"model\" state dict")
    buffer = io.BytesIO()
    torch.save({"model": saved["model"], "step": saved.get("step")}, buffer)
    text = config.read_bytes()
    json.loads(text)
    atomic_write(out / BASE_MODEL_NAME, lambda handle: handle.write(buffer.getvalue()))
    atomic_write(out / BASE_CONFIG_NAME, lambda handle: handle.write(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m voice_trainers.base",
                                     description="Write a base model directory from a full-stage checkpoint.")
    parser.add_argument("checkpoint", type=Path, help="{checkpoint_dir}/step-NNNNNNNN.pt of a full run")
    parser.add_argument("config", type=Path, help="that run's config.json")
    parser.add_argument("out", type=Path, help="the base model directory to write")
    args = parser.parse_args(argv)
    import torch

    write_base(args.checkpoint, args.config, args.out, torch)
    print(f"wrote {args.out / BASE_MODEL_NAME} and {args.out / BASE_CONFIG_NAME}"
          f" (identity {base_identity(args.out)[:16]})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
