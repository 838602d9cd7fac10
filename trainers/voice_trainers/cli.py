"""``python -m voice_trainers embed|full|light``: the real stages, with pipeline/reference_trainer.py's argv.

Exit codes: 0 done; 65 the data (or the language, or the base model) cannot be trained on, a retry would
not help; 70 the host lacks what the stage needs (the CUDA device asked for, the base model's files);
143 stopped by SIGTERM; anything else (a crash, CUDA out of memory) is retried by the worker.
``python -m voice_trainers probe`` prints one JSON line about torch and the GPU (voice_trainers.probe).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from voice_trainers.base import UnfitBase
from voice_trainers.checkpoints import remove_stale_temps
from voice_trainers.dataset import UnusableData
from voice_trainers.device import EXIT_HOST_UNFIT, HostUnfit
from voice_trainers.languages import espeak_voice
from voice_trainers.profiles import DEVICES, PROFILES, Profile, resolve
from voice_trainers.signals import EXIT_TERMINATED, StageSignals, Terminated

EXIT_UNUSABLE_DATA = 65
CACHE_DIR_NAME = ".cache"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m voice_trainers",
                                     description="Real trainer stages: Resemblyzer, Coqui VITS, ONNX for Piper.")
    parser.add_argument("mode", choices=("embed", "full", "light", "evaluate"))
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="directory the stage writes its outputs into")
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--language", required=True)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="production")
    parser.add_argument("--steps", type=int, default=None, help="global steps to train (default: the profile's)")
    parser.add_argument("--full-model", type=Path, default=None, help="light, evaluate: the full stage's model.pth")
    parser.add_argument("--light-model", type=Path, default=None, help="evaluate: the light stage's model.onnx")
    parser.add_argument("--base-model-dir", type=Path, default=None,
                        help="full: fine-tune from the base model in this directory (model.pth, config.json)")
    parser.add_argument("--prepared", type=Path, default=None,
                        help="embed: where the prepared dataset and its report.json go (default: prep/ beside --out)")
    parser.add_argument("--device", choices=DEVICES, default=None,
                        help="embed, full: where to run (default: the profile's); never a fallback to the CPU")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.mode == "light" and args.full_model is None:
        parser.error("light needs --full-model")
    if args.mode == "evaluate" and (args.full_model is None or args.light_model is None):
        parser.error("evaluate needs --full-model and --light-model")
    if args.mode == "embed" and args.prepared is None:
        args.prepared = args.out.parent / "prep"
    if args.base_model_dir is not None and args.mode != "full":
        parser.error("--base-model-dir is for full only")
    for name in ("dataset", "out", "checkpoints", "full_model", "light_model", "base_model_dir", "prepared"):
        value = getattr(args, name)
        if value is not None and not value.is_absolute():
            parser.error(f"--{name.replace('_', '-')} must be an absolute path (the stage's cwd is the worker's)")
    return args


def resolve_profile(args: argparse.Namespace) -> Profile:
    return resolve(PROFILES[args.profile], steps=args.steps, fine_tune=args.base_model_dir is not None,
                   device=args.device)


def stage_environment(checkpoints: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """Settings that keep the stage offline and its caches inside the job, set before any heavy import."""
    cache = checkpoints / CACHE_DIR_NAME
    updates = {
        # No hub: weights come from wheels (Resemblyzer) or are trained from scratch.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # librosa's numba kernels and matplotlib (imported by Coqui) write caches; $HOME may be read-only.
        "NUMBA_CACHE_DIR": str(cache / "numba"),
        "MPLCONFIGDIR": str(cache / "matplotlib"),
        "MPLBACKEND": "Agg",
    }
    return {key: value for key, value in updates.items() if key not in environ or key.endswith("OFFLINE")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:
        from voice_trainers.probe import main as probe

        return probe(argv[1:])
    args = parse_args(argv)
    signals = StageSignals().install()
    os.environ.update(stage_environment(args.checkpoints, os.environ))
    try:
        voice = espeak_voice(args.language)
        if voice is None:
            raise UnusableData(f"no espeak-ng voice for language {args.language[:40]!r}")
        args.out.mkdir(parents=True, exist_ok=True)
        if args.prepared is not None:
            args.prepared.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(args.prepared)
        args.checkpoints.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(args.out)
        remove_stale_temps(args.checkpoints)
        profile = resolve_profile(args)
        print(f"{args.mode}: profile {profile.name}, {profile.total_steps} steps, espeak voice {voice}", flush=True)
        print("PROGRESS 0", flush=True)
        if args.mode == "embed":
            from voice_trainers.embed import run_embed

            run_embed(args, profile, voice)
        elif args.mode == "full":
            from voice_trainers.full import run_full

            run_full(args, profile, voice, signals)
        elif args.mode == "evaluate":
            from voice_trainers.evaluate import run_evaluate

            run_evaluate(args, profile, voice)
        else:
            from voice_trainers.light import run_light

            run_light(args, profile, voice)
    except UnfitBase as exc:
        print(f"unusable base model: {exc}", file=sys.stderr, flush=True)
        return EXIT_UNUSABLE_DATA
    except UnusableData as exc:
        print(f"unusable data: {exc}", file=sys.stderr, flush=True)
        return EXIT_UNUSABLE_DATA
    except HostUnfit as exc:
        print(f"host unfit: {exc}", file=sys.stderr, flush=True)
        return EXIT_HOST_UNFIT
    except Terminated:
        print("stopped by SIGTERM; the newest checkpoint stays for the next attempt", file=sys.stderr, flush=True)
        return EXIT_TERMINATED
    print("PROGRESS 100", flush=True)
    return 0
