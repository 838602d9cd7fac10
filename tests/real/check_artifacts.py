"""Checks the five artifacts of a real job with the libraries that will use them; run by the trainer
virtualenv's interpreter (torch, coqui-tts, onnxruntime and piper-tts live there, not in the worker's).

    trainers/.venv/bin/python tests/real/check_artifacts.py --fullModel M --fullConfig C \
        --speakerEmbeddings S --lightModel O --lightConfig J --wav OUT.wav --sentence TEXT

Prints one JSON line of facts (the test asserts on them, so a failure shows what was found) and exits
0; a check that cannot even run (an import, a file that does not load) raises, and the exit is 1.
Standard library, the trainer's dependencies and its own package (voice_trainers) only: the worker's
packages are not importable here.
"""

from __future__ import annotations

import argparse
import json
import math
import wave
from pathlib import Path

ARTIFACTS = ("fullModel", "fullConfig", "speakerEmbeddings", "lightModel", "lightConfig")


def check_full(model_path: Path, config_path: Path) -> dict:
    """config.json loads as a VITS config; model.pth loads into the VITS it describes and speaks."""
    import torch
    from TTS.tts.configs.vits_config import VitsConfig
    from TTS.tts.models.vits import Vits

    # The full model phonemises with Piper's espeak-ng (voice_trainers.tokenizer): a consumer registers that
    # phonemizer with Coqui before building the model and installs the training tokenizer after, as
    # docs/trainer.md says.
    from voice_trainers.tokenizer import install, register

    register()
    config = VitsConfig()
    config.load_json(str(config_path))
    model = Vits(config)
    model.load_checkpoint(config, str(model_path), eval=True, strict=False)
    install(model, config.phoneme_language)
    checkpoint = torch.load(str(model_path), map_location="cpu", weights_only=False)
    saved = checkpoint["model"]
    own = model.state_dict()
    # strict=False tolerates the missing discriminator; every generator tensor must come from the file.
    generator = {k for k in own if not k.startswith("disc.")}
    loaded = sum(1 for k in generator if k in saved and torch.equal(saved[k], own[k]))
    ids = model.tokenizer.text_to_ids("hello world")
    with torch.inference_mode():
        out = model.inference(torch.tensor([ids], dtype=torch.long))["model_outputs"]
    return {"config_model": config.model, "sample_rate": config.audio.sample_rate,
            "full_model_step": checkpoint.get("step"),
            "generator_tensors": len(generator), "generator_tensors_loaded": loaded,
            "full_audio_samples": int(out.shape[-1]), "full_audio_finite": bool(torch.isfinite(out).all())}


def check_speakers(path: Path) -> dict:
    """speakers.pth is the speaker's file (trainers/voice_trainers/speakers.py): a unit centroid of the
    kept clips' d-vectors and each embedded clip's cosine to it."""
    import torch

    data = torch.load(str(path), map_location="cpu", weights_only=True)
    centroid = data["centroid"]
    return {"speaker_entries": len(data["clips"]),
            "speaker_kept": sum(1 for clip in data["clips"].values() if clip["kept"]),
            "speaker_dimensions": [len(centroid)],
            "speaker_vectors_finite": all(math.isfinite(x) for x in centroid),
            "speaker_min_norm": math.sqrt(sum(x * x for x in centroid))}


def check_onnx(model_path: Path, config_path: Path) -> dict:
    """onnxruntime runs the light model on ids from its Piper config and returns audio."""
    import numpy as np
    import onnxruntime

    config = json.loads(config_path.read_text())
    id_map = config["phoneme_id_map"]
    ids = [i for p in "hɛloʊ wɜːld" if p in id_map for i in id_map[p]]
    session = onnxruntime.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    feeds = {"input": np.array([ids], dtype=np.int64), "input_lengths": np.array([len(ids)], dtype=np.int64),
             "scales": np.array([0.667, 1.0, 0.8], dtype=np.float32)}
    names = [i.name for i in session.get_inputs()]
    audio = session.run(None, {n: feeds[n] for n in names})[0]
    return {"onnx_inputs": names, "onnx_ids": len(ids), "onnx_audio_samples": int(audio.size),
            "onnx_audio_finite": bool(np.isfinite(audio).all()),
            "piper_sample_rate": config["audio"]["sample_rate"], "piper_num_speakers": config["num_speakers"]}


def check_piper(model_path: Path, config_path: Path, sentence: str, wav_path: Path) -> dict:
    """piper-tts loads the light pair as a voice and speaks ``sentence`` into a WAV file."""
    from piper import PiperVoice

    voice = PiperVoice.load(model_path, config_path=config_path)
    with wave.open(str(wav_path), "wb") as wav:
        voice.synthesize_wav(sentence, wav)
    with wave.open(str(wav_path), "rb") as wav:
        return {"piper_wav_frames": wav.getnframes(), "piper_wav_rate": wav.getframerate(),
                "piper_wav_channels": wav.getnchannels()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ARTIFACTS:
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--wav", type=Path, required=True)
    parser.add_argument("--sentence", required=True)
    args = parser.parse_args()
    report: dict = {"sizes": {name: getattr(args, name).stat().st_size for name in ARTIFACTS}}
    report |= check_full(args.fullModel, args.fullConfig)
    report |= check_speakers(args.speakerEmbeddings)
    report |= check_onnx(args.lightModel, args.lightConfig)
    report |= check_piper(args.lightModel, args.lightConfig, args.sentence, args.wav)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
