"""Reference trainer: the LOCAL STAND-IN FOR GPU TRAINING. It is not a voice model.

The demo, local runs and the tests use it in place of a real (GPU) voice-cloning trainer so the whole
pipeline can run anywhere. It still does real, deterministic work on the dataset, with numpy only:

- ``embed``: log-mel features (STFT, Hann window, 80-band mel filterbank) of every utterance; the
  speaker embedding is each utterance's per-band mean and standard deviation, averaged over the
  utterances and L2-normalised -> ``<out>/speakers.pth``.
- ``full``: a linear next-frame predictor over standardised log-mel frames, fitted by N steps of
  full-batch gradient descent -> ``<out>/model.pth`` + ``<out>/config.json``.
- ``light``: a reduced copy distilled from the full model (20 pooled bands instead of 80, fitted by N
  steps of gradient descent to the full model's predictions) with int8-quantised weights ->
  ``<out>/model.onnx`` + ``<out>/model.onnx.json``. Despite the name the file is not ONNX: it fills
  the configured artifact slot.

``.pth`` and ``.onnx`` files hold a zip of ``.npy`` arrays (readable with ``numpy.load``) written with
fixed zip timestamps, so the same dataset always gives byte-identical files. ``full`` and ``light``
write a checkpoint after every step (atomically) and resume from the newest valid one. Each step
prints ``PROGRESS n`` and a ``METRIC`` line (docs/trainer.md) with the stand-in's own figures: ``loss``
(the predictor's mean squared error, no voice's loss), ``lr`` and ``step_time_s``; ``--step-delay-s``
slows each step for crash and shutdown tests. Exit codes:
65 unusable data (no WAVs, bad metadata, undecodable or wrong-format audio), 66 missing teacher model,
70 the device lost: only with ``--lose-device-once MARKER``, which, while MARKER does not exist, creates it
and exits 70 after loading the data (a GPU gone mid-run, once: the host fault tests).

    python -m pipeline.reference_trainer <embed|full|light> --dataset D --out O --checkpoints C
        [--steps N] [--step-delay-s S] [--language L] [--full-model PATH]   (light needs --full-model)
        [--lose-device-once MARKER]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from pipeline.dataset import split_metadata_line
from pipeline.manifest import atomic_write_bytes, remove_stale_temps
from worker.core.names import SAFE_NAME

SAMPLE_RATE_HZ = 22_050
N_FFT = 1024
HOP = 256
N_MELS = 80
FMAX_HZ = 8_000.0
LIGHT_BANDS = 20
DEFAULT_STEPS = {"embed": 1, "full": 40, "light": 20}
EXIT_UNUSABLE_DATA = 65
EXIT_MISSING_INPUT = 66
EXIT_DEVICE_LOST = 70  # as a real trainer exits when its GPU is gone (docs/trainer.md)
_ID = re.compile(SAFE_NAME)
_CKPT = re.compile(r"ckpt-([0-9]{6})\.npz")
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
_KEEP_CHECKPOINTS = 2


class UnusableData(Exception):
    """The dataset cannot be trained on; retrying will not change that."""


@dataclass(frozen=True)
class Utterance:
    uid: str
    text: str
    samples: np.ndarray


def encode_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """An ``.npz``-compatible zip with fixed timestamps and order: same arrays, same bytes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            array_bytes = io.BytesIO()
            np.lib.format.write_array(array_bytes, np.asarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
            info.external_attr = 0o644 << 16
            archive.writestr(info, array_bytes.getvalue())
    return buffer.getvalue()


def decode_arrays(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def load_dataset(dataset_dir: Path) -> list[Utterance]:
    """Read metadata.csv and the WAVs it names; UnusableData for anything a trainer cannot use."""
    try:
        lines = (dataset_dir / "metadata.csv").read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise UnusableData(f"metadata.csv unreadable: {type(exc).__name__}") from None
    utterances = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            fields = split_metadata_line(line)
        except ValueError as exc:
            raise UnusableData(f"metadata.csv line {number}: {exc}") from None
        if len(fields) != 3 or not _ID.fullmatch(fields[0]) or not fields[1].strip():
            raise UnusableData(f"metadata.csv line {number}: expected id|text|text")
        utterances.append(Utterance(fields[0], fields[1], _read_wav(dataset_dir, fields[0])))
    if not utterances:
        raise UnusableData("no utterances: metadata.csv lists no WAVs")
    return utterances


def _read_wav(dataset_dir: Path, uid: str) -> np.ndarray:
    path = dataset_dir / "wavs" / f"{uid}.wav"
    try:
        samples, rate_hz = sf.read(str(path), dtype="float64", always_2d=True)
    except (OSError, RuntimeError, TypeError, ValueError):
        raise UnusableData(f"wavs/{uid}.wav is missing or not decodable") from None
    if rate_hz != SAMPLE_RATE_HZ or samples.shape[1] != 1 or samples.shape[0] == 0:
        raise UnusableData(f"wavs/{uid}.wav must be non-empty mono at {SAMPLE_RATE_HZ} Hz")
    return samples[:, 0]


def dataset_fingerprint(dataset_dir: Path, utterances: list[Utterance]) -> str:
    digest = hashlib.sha256((dataset_dir / "metadata.csv").read_bytes())
    for utt in utterances:
        digest.update((dataset_dir / "wavs" / f"{utt.uid}.wav").read_bytes())
    return digest.hexdigest()


def mel_filterbank(n_mels: int = N_MELS, n_fft: int = N_FFT, rate_hz: int = SAMPLE_RATE_HZ) -> np.ndarray:
    """Triangular filters equally spaced on the HTK mel scale, shape (n_fft // 2 + 1, n_mels)."""
    mels = np.linspace(0.0, 2595.0 * np.log10(1.0 + FMAX_HZ / 700.0), n_mels + 2)
    edges_hz = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    bins_hz = np.linspace(0.0, rate_hz / 2.0, n_fft // 2 + 1)
    lower, centre, upper = edges_hz[:-2], edges_hz[1:-1], edges_hz[2:]
    rising = (bins_hz[:, None] - lower) / (centre - lower)
    falling = (upper - bins_hz[:, None]) / (upper - centre)
    return np.clip(np.minimum(rising, falling), 0.0, None)


def log_mel(samples: np.ndarray, filterbank: np.ndarray) -> np.ndarray:
    """Log-mel frames, shape (frames, n_mels): centred STFT with a periodic Hann window."""
    padded = np.pad(samples, (N_FFT // 2, N_FFT // 2))
    count = 1 + max(0, len(padded) - N_FFT) // HOP
    starts = np.arange(count)[:, None] * HOP + np.arange(N_FFT)[None, :]
    window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT)
    power = np.abs(np.fft.rfft(padded[starts] * window, axis=1)) ** 2
    return np.log(matmul(power, filterbank) + 1e-6)


def speaker_embedding(features: list[np.ndarray]) -> np.ndarray:
    stats = np.stack([np.concatenate([f.mean(axis=0), f.std(axis=0)]) for f in features])
    pooled = stats.mean(axis=0)
    return pooled / max(float(np.linalg.norm(pooled)), 1e-12)


def training_pairs(features: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Standardised (frame t, frame t+1) pairs within each utterance, plus the mean and std used."""
    frames = np.concatenate(features)
    mean, std = frames.mean(axis=0), np.maximum(frames.std(axis=0), 1e-6)
    xs = [(f[:-1] - mean) / std for f in features if len(f) > 1]
    ys = [(f[1:] - mean) / std for f in features if len(f) > 1]
    if not xs:
        raise UnusableData("utterances are too short to train on")
    return np.concatenate(xs), np.concatenate(ys), mean, std


def with_bias(x: np.ndarray) -> np.ndarray:
    return np.hstack([x, np.ones((len(x), 1))])


def pool_bands(x: np.ndarray, bands: int = LIGHT_BANDS) -> np.ndarray:
    return x.reshape(len(x), bands, -1).mean(axis=2)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product without BLAS: one thread, one summation order, the same bits on every machine.

    (Threaded BLAS also spins on a busy CPU for matrices this small, which made steps slower.)
    """
    return np.einsum("ij,jk->ik", a, b)


def fit_linear(
    x1: np.ndarray, y: np.ndarray, steps: int, checkpoints: Path, fingerprint: str, step_delay_s: float
) -> tuple[np.ndarray, float]:
    """Gradient descent on mean squared error from the newest valid checkpoint; (weights, loss)."""
    # The loss and its gradient only need these small products, computed once.
    gram, cross, yy = matmul(x1.T, x1), matmul(x1.T, y), float(np.sum(y * y))
    scale = 1.0 / (len(x1) * y.shape[1])
    # 1 / trace(X'X / n) bounds the step below 1 / largest eigenvalue: stable without tuning.
    learning_rate = len(x1) / float(np.trace(gram))
    weights, done = resume_point(checkpoints, fingerprint, (x1.shape[1], y.shape[1]), steps)
    if done:
        print(f"resumed from checkpoint at step {done}", flush=True)
        print(f"PROGRESS {100 * done // steps}", flush=True)
    gram_w = matmul(gram, weights)
    loss = scale * (float(np.sum(weights * gram_w)) - 2.0 * float(np.sum(weights * cross)) + yy)
    for step in range(done + 1, steps + 1):
        started_s = time.monotonic()
        gradient = (2.0 / len(x1)) * (gram_w - cross)
        weights = weights - learning_rate * gradient
        gram_w = matmul(gram, weights)
        loss = scale * (float(np.sum(weights * gram_w)) - 2.0 * float(np.sum(weights * cross)) + yy)
        if step_delay_s > 0:
            time.sleep(step_delay_s)
        save_checkpoint(checkpoints, step, weights, fingerprint)
        print(f"step {step}/{steps} loss {loss:.6f}", flush=True)
        print(f"METRIC step={step} loss={loss:.6g} lr={learning_rate:.6g} "
              f"step_time_s={time.monotonic() - started_s:.4f}", flush=True)
        if step < steps:
            print(f"PROGRESS {100 * step // steps}", flush=True)
    return weights, loss


def save_checkpoint(checkpoints: Path, step: int, weights: np.ndarray, fingerprint: str) -> None:
    data = encode_arrays(
        {"weights": weights, "step": np.array(step), "fingerprint": np.array(fingerprint)}
    )
    atomic_write_bytes(checkpoints / f"ckpt-{step:06d}.npz", data)
    for _step, old in _checkpoint_files(checkpoints)[_KEEP_CHECKPOINTS:]:
        old.unlink(missing_ok=True)


def resume_point(
    checkpoints: Path, fingerprint: str, shape: tuple[int, int], steps: int
) -> tuple[np.ndarray, int]:
    """(weights, step) of the newest checkpoint that is intact and was made for this very training."""
    for step, path in _checkpoint_files(checkpoints):
        try:
            state = decode_arrays(path.read_bytes())
            weights = state["weights"]
            usable = (
                str(state["fingerprint"]) == fingerprint
                and int(state["step"]) == step
                and 1 <= step <= steps
                and weights.shape == shape
                and weights.dtype == np.float64
                and bool(np.all(np.isfinite(weights)))
            )
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            usable = False
        if usable:
            return weights, step
        # Not resumable from: drop it so the "keep the newest" rule never keeps garbage.
        path.unlink(missing_ok=True)
    return np.zeros(shape), 0


def _checkpoint_files(checkpoints: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in checkpoints.iterdir() if (m := _CKPT.fullmatch(p.name))]
    return sorted(found, reverse=True)


def _hyper_fingerprint(mode: str, data_fingerprint: str, extra: str = "") -> str:
    settings = f"{mode}|{N_FFT}|{HOP}|{N_MELS}|{FMAX_HZ}|{LIGHT_BANDS}|{data_fingerprint}|{extra}"
    return hashlib.sha256(settings.encode()).hexdigest()


def _json_bytes(value: dict) -> bytes:
    return json.dumps(value, indent=2, sort_keys=True).encode() + b"\n"


def _audio_config() -> dict:
    return {"sample_rate": SAMPLE_RATE_HZ, "n_fft": N_FFT, "hop_length": HOP, "n_mels": N_MELS,
            "fmax": FMAX_HZ}


def run_embed(features: list[np.ndarray], out: Path) -> None:
    embedding = speaker_embedding(features)
    atomic_write_bytes(
        out / "speakers.pth",
        encode_arrays({"embedding": embedding.astype(np.float32), "utterances": np.array(len(features))}),
    )


def run_full(args, features, fingerprint: str, out: Path) -> None:
    x, y, mean, std = training_pairs(features)
    x1 = with_bias(x)
    weights, loss = fit_linear(
        x1, y, args.steps, args.checkpoints, _hyper_fingerprint("full", fingerprint), args.step_delay_s
    )
    model = {"weights": weights.astype(np.float32), "feature_mean": mean.astype(np.float32),
             "feature_std": std.astype(np.float32),
             "speaker_embedding": speaker_embedding(features).astype(np.float32)}
    atomic_write_bytes(out / "model.pth", encode_arrays(model))
    config = {"model": "reference-linear-predictor (local stand-in, not a voice model)",
              "audio": _audio_config(), "language": args.language, "dataset_sha256": fingerprint,
              "training": {"steps": args.steps, "final_loss": loss, "pairs": len(x1)}}
    atomic_write_bytes(out / "config.json", _json_bytes(config))


def run_light(args, features, fingerprint: str, out: Path) -> None:
    if args.full_model is None or not args.full_model.is_file():
        print("light needs --full-model pointing at the full model", file=sys.stderr)
        raise SystemExit(EXIT_MISSING_INPUT)
    teacher_bytes = args.full_model.read_bytes()
    try:
        teacher = decode_arrays(teacher_bytes)
        teacher_weights = teacher["weights"].astype(np.float64)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        print("the full model is unreadable", file=sys.stderr)
        raise SystemExit(EXIT_MISSING_INPUT) from None
    x, _y, _mean, _std = training_pairs(features)
    targets = pool_bands(matmul(with_bias(x), teacher_weights))
    x1 = with_bias(pool_bands(x))
    teacher_sha = hashlib.sha256(teacher_bytes).hexdigest()
    weights, loss = fit_linear(
        x1, targets, args.steps, args.checkpoints,
        _hyper_fingerprint("light", fingerprint, teacher_sha), args.step_delay_s,
    )
    scale = np.maximum(np.abs(weights).max(axis=0), 1e-12) / 127.0
    quantised = np.round(weights / scale).astype(np.int8)
    atomic_write_bytes(out / "model.onnx", encode_arrays(
        {"weights_int8": quantised, "scale": scale.astype(np.float32),
         "feature_mean": teacher["feature_mean"], "feature_std": teacher["feature_std"]}))
    config = {"model": "reference-light-predictor (local stand-in, not ONNX, not a voice model)",
              "audio": _audio_config(), "bands": LIGHT_BANDS, "quantization": "int8 per output",
              "language": args.language, "dataset_sha256": fingerprint, "teacher_sha256": teacher_sha,
              "training": {"steps": args.steps, "final_loss": loss}}
    atomic_write_bytes(out / "model.onnx.json", _json_bytes(config))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline.reference_trainer",
                                     description="Local stand-in for GPU training (not a voice model).")
    parser.add_argument("mode", choices=("embed", "full", "light"))
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    parser.add_argument("--language", default="")
    parser.add_argument("--full-model", type=Path, default=None)
    parser.add_argument("--lose-device-once", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = DEFAULT_STEPS[args.mode]
    if args.steps < 1 or args.step_delay_s < 0:
        parser.error("--steps must be >= 1 and --step-delay-s >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.checkpoints.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(args.out)
    remove_stale_temps(args.checkpoints)
    try:
        utterances = load_dataset(args.dataset)
        fingerprint = dataset_fingerprint(args.dataset, utterances)
        filterbank = mel_filterbank()
        features = [log_mel(utt.samples, filterbank) for utt in utterances]
        print(f"{args.mode}: {len(utterances)} utterances, {sum(map(len, features))} frames", flush=True)
        if args.lose_device_once is not None and not args.lose_device_once.exists():
            args.lose_device_once.touch()
            print("device lost: CUDA error: unspecified launch failure (injected)", file=sys.stderr, flush=True)
            return EXIT_DEVICE_LOST
        {"embed": lambda: run_embed(features, args.out),
         "full": lambda: run_full(args, features, fingerprint, args.out),
         "light": lambda: run_light(args, features, fingerprint, args.out)}[args.mode]()
    except UnusableData as exc:
        print(f"unusable data: {exc}", file=sys.stderr, flush=True)
        return EXIT_UNUSABLE_DATA
    print("PROGRESS 100", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
