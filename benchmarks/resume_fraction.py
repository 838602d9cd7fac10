"""How much of a training run a resume costs: the resumed run's time as a fraction of a full run.

Runs the reference trainer's ``full`` stage through the real stage runner, side by side:
1. a full run from scratch (timed);
2. a run stopped once 90 % of the steps have reported progress (the stop signal ends its process
   group), then the same stage run again, which resumes from the newest checkpoint (timed).

With checkpoints after every step the resumed run should cost about the remaining 10 % of the steps
plus the fixed start-up (interpreter, imports, feature extraction). A script, not a test: timings
depend on the machine, so nothing here asserts.

``--fresh-host``: the stopped run mirrors its checkpoints to S3 (``pipeline.remote_work``, as with
``CHECKPOINT_S3_SYNC_SECONDS``; moto in-process here) and the resumed run is a retry on another host:
an empty work root, whose checkpoints come from the mirror (the restore is timed with it).

    .venv/bin/python benchmarks/resume_fraction.py [--steps 100] [--step-delay-s 0.03] [--fresh-host]
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.config import StageSpec  # noqa: E402
from pipeline.dataset import build_dataset  # noqa: E402
from pipeline.remote_work import MemoryLedger, RemoteWork, RemoteWorkConfig  # noqa: E402
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
    parser.add_argument("--fresh-host", action="store_true",
                        help="resume on an empty work root from the checkpoints mirrored in S3")
    parser.add_argument("--sync-interval-s", type=float, default=0.5)
    args = parser.parse_args()
    if args.fresh_host:
        from moto import mock_aws

        with mock_aws():
            measure(args)
    else:
        measure(args)


def measure(args) -> None:
    spec = stage(args.steps, args.step_delay_s)
    mirrors: tuple[RemoteWork, RemoteWork] | None = None
    if args.fresh_host:
        import boto3

        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="bench")
        config = RemoteWorkConfig("bench", "", args.sync_interval_s)
        record: dict[str, dict[str, str]] = {}  # the job record's vouches (MemoryLedger)
        mirrors = (RemoteWork(s3, config, "bench/job/1", "1-a", MemoryLedger("1-a", record)),
                   RemoteWork(s3, config, "bench/job/1", "2-b", MemoryLedger("2-b", record)))

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_dataset(synthesize(root / "media"), root / "dataset")

        full_s = timed_run(spec, context(root / "dataset", root / "full"), StopSignal(), lambda s, p: None)

        stop = StopSignal()

        def stop_late(_stage: str, percent: float) -> None:
            if percent >= args.stop_at_percent:
                stop.set(Stopped.SHUTDOWN, "benchmark")

        killed_ctx = context(root / "dataset", root / "killed")
        mirroring = None if mirrors is None else functools.partial(
            mirrors[0].syncing, spec.name, killed_ctx.checkpoint_dir(spec))
        started = time.perf_counter()
        try:
            run_stage(spec, killed_ctx, stop, stop_late, grace_s=5.0, while_running=mirroring)
            raise SystemExit("the run finished before the stop took effect; raise --steps")
        except Stopped:
            killed_s = time.perf_counter() - started
        resumed_ctx, restore_s = killed_ctx, 0.0
        if mirrors is not None:
            resumed_ctx = context(root / "dataset", root / "fresh-host")  # an empty work root
            started = time.perf_counter()
            assert mirrors[1].pull_checkpoints(spec.name, resumed_ctx.checkpoint_dir(spec)) == "1-a"
            restore_s = time.perf_counter() - started
        resumed_s = restore_s + timed_run(spec, resumed_ctx, StopSignal(), lambda s, p: None)
        resumed_log = sorted((resumed_ctx.log_dir).glob("*.log"))[-1].read_text()
        resumed_steps = resumed_log.count("\nstep ")

    print(f"steps={args.steps} step_delay_s={args.step_delay_s} stop_at={args.stop_at_percent:g}%"
          + (f" fresh host, mirrored every {args.sync_interval_s:g} s" if mirrors else " same host"))
    print(f"full run:            {full_s:7.3f} s")
    print(f"killed run:          {killed_s:7.3f} s (stopped, then its process group ended)")
    if mirrors:
        print(f"restore from S3:     {restore_s:7.3f} s (counted in the resumed run)")
    print(f"resumed run:         {resumed_s:7.3f} s ({resumed_steps} of {args.steps} steps re-done)")
    print(f"resumed / full:      {resumed_s / full_s:7.3f}")

if __name__ == "__main__":
    main()
