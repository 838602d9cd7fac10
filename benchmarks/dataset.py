"""The dataset step against soxr called directly: the same clips, side by side in one run.

    python benchmarks/dataset.py [--clips 50] [--seconds 10] [--rate 44100] [--runs 3]

CLIPS mono 16-bit WAVs of SECONDS each at RATE Hz (a harmonic tone with an envelope and a little
noise) become 22,050 Hz mono 16-bit WAVs, RUNS times each way, the ways taking turns:
  project     the dataset step as a job runs it: ``run_dataset_stage`` with the child the job starts
              before its downloads (``prestart_dataset``), under its stage keeper, held once it has
              loaded its libraries; timed from then: the header checks, block-wise decoding and
              resampling on DATASET_WORKERS threads, atomic writes with fsync, metadata.csv, exits.
              In a job the downloads hide the start-up only when they take longer (some 0.1 s): a
              retry whose recordings are all kept waits for it, which is the next line
  cold        the same with the child started at the step (``run_dataset_stage`` alone): the
              keeper's and the child's start-up included
  in-process  ``build_dataset`` called in this process: the same work without the two start-ups
  start-up    a child that only imports what the dataset child imports (part of the cold time)
  baseline    soxr used directly in this process, one clip after another: soundfile reads the whole
              clip, ``soxr.resample(..., "HQ")`` converts it, soundfile writes it (libsndfile syncs
              each file as it closes it)
Wall time is time.perf_counter; CPU time is user + system from getrusage (the children's for the
project and the start-up, this process's otherwise). Medians are printed, with the ratios to the
baseline. Afterwards a quality check: SNR of 9 kHz and 10 kHz sines against the ideal ones, and the
level of a 15 kHz tone, after RATE -> 22,050 Hz through the project's resampler and soxr HQ.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.dataset import build_dataset  # noqa: E402
from pipeline.dataset_stage import HELD_LINE, prestart_dataset, run_dataset_stage  # noqa: E402
from pipeline.limits import JobLimits  # noqa: E402
from pipeline.stage_env import stage_environment  # noqa: E402
from worker.core.stop import StopSignal  # noqa: E402

TARGET_HZ = 22_050


def write_clips(directory: Path, clips: int, seconds: float, rate_hz: int) -> list[Path]:
    rng = np.random.default_rng(16)
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 3.0 * t)
    paths = []
    for index in range(clips):
        f0 = 100.0 + 5.0 * index
        wave = sum(0.2 / k * np.sin(2 * np.pi * f0 * k * t) for k in range(1, 9)) * envelope
        wave += 0.01 * rng.standard_normal(len(t))
        path = directory / f"{index:05d}.wav"
        sf.write(path, wave, rate_hz, subtype="PCM_16")
        paths.append(path)
    return paths


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child_env() -> dict[str, str]:
    # PYTHONPATH passed on: the child runs this checkout's code, as this process does.
    return stage_environment({"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)},
                             extra_names=("PYTHONPATH",))


def project_run(clips: list[Path], work: Path) -> tuple[float, float]:
    recordings = [(path, f"clip {i}") for i, path in enumerate(clips)]
    cpu0 = children_cpu_s()
    child = prestart_dataset([text for _, text in recordings], work / "dataset", work / "logs", env=child_env(),
                             grace_s=5.0)
    assert child is not None
    while HELD_LINE not in child.log_path.read_text():  # the job's downloads, as far as the child can tell
        time.sleep(0.005)
    wall0 = time.perf_counter()
    run_dataset_stage(recordings, work / "dataset", work / "logs", StopSignal(), lambda _step, _pct: None,
                      limits=JobLimits(), env={}, grace_s=5.0, child=child)
    # CPU: the whole child's, start-up included (it is spent, only off the critical path).
    return time.perf_counter() - wall0, children_cpu_s() - cpu0


def cold_run(clips: list[Path], work: Path) -> tuple[float, float]:
    cpu0, wall0 = children_cpu_s(), time.perf_counter()
    run_dataset_stage([(path, f"clip {i}") for i, path in enumerate(clips)], work / "dataset", work / "logs",
                      StopSignal(), lambda _step, _pct: None, limits=JobLimits(), env=child_env(), grace_s=5.0)
    return time.perf_counter() - wall0, children_cpu_s() - cpu0


def in_process_run(clips: list[Path], work: Path) -> tuple[float, float]:
    cpu0, wall0 = self_cpu_s(), time.perf_counter()
    build_dataset([(path, f"clip {i}") for i, path in enumerate(clips)], work / "dataset")
    return time.perf_counter() - wall0, self_cpu_s() - cpu0


def startup_run(_clips: list[Path], _work: Path) -> tuple[float, float]:
    cpu0, wall0 = children_cpu_s(), time.perf_counter()
    subprocess.run([sys.executable, "-c", "import pipeline.dataset_stage, pipeline.audio"], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - wall0, children_cpu_s() - cpu0


def baseline_run(clips: list[Path], work: Path) -> tuple[float, float]:
    out = work / "baseline"
    out.mkdir()
    cpu0, wall0 = self_cpu_s(), time.perf_counter()
    for index, path in enumerate(clips):
        samples, rate_hz = sf.read(path, dtype="float32")
        sf.write(out / f"utt{index:05d}.wav", soxr.resample(samples, rate_hz, TARGET_HZ, "HQ"), TARGET_HZ,
                 subtype="PCM_16")
    return time.perf_counter() - wall0, self_cpu_s() - cpu0


def snr_db(resampled: np.ndarray, f_hz: float) -> float:
    """Signal to error of a resampled 0.5-amplitude sine against the ideal one, middle 80 %."""
    ideal = 0.5 * np.sin(2 * np.pi * f_hz * np.arange(len(resampled)) / TARGET_HZ)
    middle = slice(len(resampled) // 10, -len(resampled) // 10)
    error = resampled[middle] - ideal[middle]
    return float(10 * np.log10(np.mean(ideal[middle] ** 2) / np.mean(error**2)))


def level_db(resampled: np.ndarray) -> float:
    """RMS of what is left of a 0.5-amplitude tone, relative to its input RMS."""
    middle = slice(len(resampled) // 10, -len(resampled) // 10)
    return float(20 * np.log10(np.sqrt(np.mean(resampled[middle] ** 2)) / (0.5 / np.sqrt(2))))


def project_resampler(rate_hz: int):
    """The project's resampler as a whole-signal function (whichever module provides it)."""
    try:
        from pipeline.audio import resample_blocks
    except ImportError:  # before soxr: the hand-written resampler
        from pipeline.resample import resample

        return lambda x: resample(x, rate_hz, TARGET_HZ)
    return lambda x: np.concatenate(list(resample_blocks([x.astype(np.float32)], rate_hz))).astype(np.float64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=44_100)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.chdir(ROOT)  # ``python -m`` puts the working directory first on the child's path
    limits = JobLimits()
    workers = getattr(limits, "dataset_workers", 1)
    results: dict[str, list[tuple[float, float]]] = {
        "project": [], "cold": [], "in-process": [], "start-up": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="dataset-bench-") as tmp:
        clips = write_clips(Path(tmp), args.clips, args.seconds, args.rate)
        for run in range(args.runs):
            for name, fn in (("project", project_run), ("cold", cold_run), ("in-process", in_process_run),
                             ("start-up", startup_run), ("baseline", baseline_run)):
                work = Path(tmp) / f"{name}-{run}"
                work.mkdir()
                results[name].append(fn(clips, work))
    wall = {name: statistics.median(w for w, _ in runs) for name, runs in results.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in results.items()}
    print(f"clips                {args.clips} x {args.seconds:g} s mono 16-bit WAV at {args.rate} Hz -> {TARGET_HZ} Hz, "
          f"median of {args.runs} runs")
    print(f"project  (dataset step, child started ahead, DATASET_WORKERS={workers})".ljust(67) +
          f"wall {wall['project']:6.2f} s   CPU {cpu['project']:6.2f} s")
    print(f"  cold: the child started at the step (keeper and child start-up)  "
          f"wall {wall['cold']:6.2f} s   CPU {cpu['cold']:6.2f} s   "
          f"ratio wall {wall['cold'] / wall['baseline']:.2f}   CPU {cpu['cold'] / cpu['baseline']:.2f}")
    print(f"  the same in this process (build_dataset)                         "
          f"wall {wall['in-process']:6.2f} s   CPU {cpu['in-process']:6.2f} s   "
          f"ratio wall {wall['in-process'] / wall['baseline']:.2f}   CPU {cpu['in-process'] / cpu['baseline']:.2f}")
    print(f"  a child's start-up (imports only)                                "
          f"wall {wall['start-up']:6.2f} s   CPU {cpu['start-up']:6.2f} s")
    print(f"baseline (soxr.resample HQ directly, one clip after another)       "
          f"wall {wall['baseline']:6.2f} s   CPU {cpu['baseline']:6.2f} s")
    print(f"ratio project/baseline   wall {wall['project'] / wall['baseline']:.2f}   "
          f"CPU {cpu['project'] / cpu['baseline']:.2f}   (target: wall <= 1.30; cold "
          f"{wall['cold'] / wall['baseline']:.2f})")

    ours = project_resampler(args.rate)
    n = args.rate  # one second of each tone
    tones = {f: 0.5 * np.sin(2 * np.pi * f * np.arange(n) / args.rate) for f in (9_000, 10_000, 15_000)}
    for name, fn in (("project", ours), ("soxr HQ", lambda x: soxr.resample(x, args.rate, TARGET_HZ, "HQ"))):
        out = {f: fn(x) for f, x in tones.items()}
        print(f"quality {name:8s} SNR 9 kHz {snr_db(out[9_000], 9_000):6.1f} dB   "
              f"10 kHz {snr_db(out[10_000], 10_000):6.1f} dB   15 kHz tone left at {level_db(out[15_000]):7.1f} dB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
