"""How much of a training run a resume costs: the resumed run's time as a fraction of a full run.

Runs the reference trainer's ``full`` stage through the real stage runner, side by side:
1. a full run from scratch (timed);
2. a run stopped once 90 % of the steps have reported progress (the stop signal ends its process
   group), then the same stage run again, which resumes from the newest checkpoint (timed).

With checkpoints after every step the resumed run should cost about the remaining 10 % of the steps
plus the fixed start-up (interpreter, imports, feature extraction). A script, not a test: timings
depend on the machine, so nothing here asserts.

    .venv/bin/python benchmarks/resume_fraction.py [--steps 100] [--step-delay-s 0.03]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import StageSpec  # noqa: E402
from pipeline.dataset import build_dataset  # noqa: E402
from pipeline.stages import StageContext, run_stage  # noqa: E402
from worker.core.errors import Stopped  # noqa: E402
from worker.core.stop import StopSignal  # noqa: E402


def synthesize(directory: Path) -> list[tuple[Path, str]]:
    directory.mkdir(parents=True)
    made = []
    for index, (rate, f0, seconds) in enumerate([(16_000, 140, 1.0), (44_100, 210, 1.2), (48_000, 120, 0.8)]):
        t = np.arange(int(rate * seconds)) / rate
        wave = sum(0.25 / k * np.sin(2 * np.pi * f0 * k * t) for k in range(1, 7))
        path = directory / f"{index}.wav"
        sf.write(path, wave * np.sin(np.pi * t / seconds), rate, subtype="PCM_16")
        made.append((path, f"utterance number {index}"))
    return made


def stage(steps: int, delay_s: float) -> StageSpec:
    return StageSpec(
        name="train_full",
        argv=("{python}", "-m", "pipeline.reference_trainer", "full", "--dataset", "{dataset_dir}",
              "--out", "{output_dir}/full", "--checkpoints", "{checkpoint_dir}",
              "--steps", str(steps), "--step-delay-s", str(delay_s)),
        outputs=("full/model.pth", "full/config.json"),
        resumable=True,
    )


def context(dataset: Path, root: Path) -> StageContext:
    return StageContext(dataset_dir=dataset, output_dir=root / "output", checkpoints_root=root / "ckpt",
                        log_dir=root / "logs", job_id="bench", language="en")


def timed_run(spec: StageSpec, ctx: StageContext, stop: StopSignal, progress) -> float:
    started = time.perf_counter()
    run_stage(spec, ctx, stop, progress, grace_s=5.0)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-delay-s", type=float, default=0.03)
    parser.add_argument("--stop-at-percent", type=float, default=90.0)
    args = parser.parse_args()
    spec = stage(args.steps, args.step_delay_s)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_dataset(synthesize(root / "media"), root / "dataset")

        full_s = timed_run(spec, context(root / "dataset", root / "full"), StopSignal(), lambda s, p: None)

        stop = StopSignal()

        def stop_late(_stage: str, percent: float) -> None:
            if percent >= args.stop_at_percent:
                stop.set(Stopped.SHUTDOWN, "benchmark")

        killed_ctx = context(root / "dataset", root / "killed")
        started = time.perf_counter()
        try:
            run_stage(spec, killed_ctx, stop, stop_late, grace_s=5.0)
            raise SystemExit("the run finished before the stop took effect; raise --steps")
        except Stopped:
            killed_s = time.perf_counter() - started
        resumed_s = timed_run(spec, killed_ctx, StopSignal(), lambda s, p: None)
        resumed_log = sorted((root / "killed/logs").glob("*.log"))[-1].read_text()
        resumed_steps = resumed_log.count("\nstep ")

    print(f"steps={args.steps} step_delay_s={args.step_delay_s} stop_at={args.stop_at_percent:g}%")
    print(f"full run:            {full_s:7.3f} s")
    print(f"killed run:          {killed_s:7.3f} s (stopped, then its process group ended)")
    print(f"resumed run:         {resumed_s:7.3f} s ({resumed_steps} of {args.steps} steps re-done)")
    print(f"resumed / full:      {resumed_s / full_s:7.3f}")


if __name__ == "__main__":
    main()
