"""``light``: the full stage's VITS exported to ONNX, with the voice config Piper reads beside it."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from voice_trainers.checkpoints import atomic_write, fsync_dir
from voice_trainers.coqui import import_torch, parameter_count
from voice_trainers.dataset import SAMPLE_RATE_HZ, UnusableData
from voice_trainers.full import CONFIG_NAME
from voice_trainers.piper_json import piper_voice_config
from voice_trainers.profiles import Profile

ONNX_NAME = "model.onnx"
ONNX_CONFIG_NAME = "model.onnx.json"


def load_full_model(model_path: Path) -> Any:
    """The full stage's generator, for inference (its config.json sits next to it), with the training tokenizer.

    Loaded strictly: model.pth holds the whole generator and nothing else, so a tensor missing or extra
    means another model (or a damaged file), never something to fill with random weights.
    """
    torch = import_torch()
    from TTS.tts.configs.vits_config import VitsConfig
    from TTS.tts.models.vits import Vits

    config_path = model_path.parent / CONFIG_NAME
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        # The full stage's outputs are checked by the worker: a broken one is not the data's fault.
        raise RuntimeError(f"cannot read {config_path.name}: {exc}") from None
    from voice_trainers.tokenizer import install, register

    register()
    config = VitsConfig()
    config.from_dict(data)
    # Inference needs no discriminator; its weights are not in model.pth either.
    config.model_args.init_discriminator = False
    model = Vits(config)
    saved = torch.load(model_path, map_location="cpu", weights_only=True)
    try:
        model.load_state_dict(saved["model"], strict=True)
    except (KeyError, TypeError, RuntimeError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise RuntimeError(f"{model_path.name} does not fit the model its {CONFIG_NAME} builds: {detail}") from None
    model.eval()
    install(model, config.phoneme_language)
    return model


def light_voice_config(model: Any, voice: str, language: str) -> dict[str, Any]:
    """model.onnx.json for ``model``: its vocabulary and blank/BOS/EOS settings, and its own inference noise,
    so the light voice speaks with the full model's rhythm."""
    from voice_trainers.normalise import VERSION

    tokenizer = model.tokenizer
    characters = tokenizer.characters
    args = model.config.model_args
    return piper_voice_config(
        vocab=characters.vocab,
        blank=characters.blank,
        add_blank=tokenizer.add_blank,
        bos=characters.bos if tokenizer.use_eos_bos else None,
        eos=characters.eos if tokenizer.use_eos_bos else None,
        espeak_voice=voice,
        language=language,
        sample_rate_hz=model.config.audio.sample_rate or SAMPLE_RATE_HZ,
        hop_length=model.config.audio.hop_length,
        noise_scale=args.inference_noise_scale,
        length_scale=args.length_scale,
        noise_w=args.inference_noise_scale_dp,
        normaliser_version=VERSION,
    )


def run_light(args: argparse.Namespace, profile: Profile, voice: str) -> None:
    started_s = time.process_time()
    model = load_full_model(args.full_model)
    if model.num_speakers > 1:
        raise UnusableData("the full model has several speakers; the light voice is single-speaker")
    print(f"exporting {parameter_count(model) / 1e6:.1f} M parameters to ONNX", flush=True)
    onnx_path = args.out / ONNX_NAME
    temp = args.out / f".tmp-{ONNX_NAME}.{os.getpid()}"
    try:
        model.export_onnx(output_path=str(temp), verbose=False)
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, onnx_path)
    finally:
        temp.unlink(missing_ok=True)
    fsync_dir(args.out)
    print("PROGRESS 80", flush=True)
    piper = light_voice_config(model, voice, args.language)
    text = json.dumps(piper, indent=2, ensure_ascii=False) + "\n"
    atomic_write(args.out / ONNX_CONFIG_NAME, lambda handle: handle.write(text.encode("utf-8")))
    print(f"wrote {ONNX_NAME} ({onnx_path.stat().st_size / 1e6:.2f} MB) and {ONNX_CONFIG_NAME}"
          f" ({time.process_time() - started_s:.1f} CPU-s)", flush=True)
