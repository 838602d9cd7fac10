"""What the evaluate stage costs next to the training it judges: ci ``train_full`` vs ``evaluate``, one run.

    python benchmarks/evaluate_cost.py [--trainer-python trainers/.venv/bin/python] [--work DIR] [--clips 16]

Makes the 16-clip espeak-ng dataset of trainers/tests/make_dataset.py, then runs the real stages as the
worker would (``python -m voice_trainers full|light|evaluate ... --profile ci``, each a fresh process,
the Hugging Face hub off) and measures each with ``wait4``'s rusage: wall seconds, CPU-s (user + system,
children included) and peak RSS. Prints a table and the ratio evaluate / train_full; exits 1 when
evaluate took as long as train_full or longer (it is meant to be cheaper). Not a test: timings on a
shared machine vary; docs/trainer.md records a measured run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAINERS = REPO / "trainers"


def measured(argv: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    """Run ``argv`` to its end; its wall time, CPU-s and peak RSS (MiB) from the kernel's rusage."""
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=TRAINERS, env=env)
        _pid, status, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - started
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{argv[3]} exited {code}; see {log}")
    return {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer-python", default=str(TRAINERS / ".venv" / "bin" / "python"))
    parser.add_argument("--work", type=Path, default=None, help="kept when given (default: a temporary dir)")
    parser.add_argument("--clips", type=int, default=16)
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="evaluate-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(TRAINERS / "tests"))
    from make_dataset import make_dataset

    dataset, output = work / "dataset", work / "output"
    if not dataset.exists():
        make_dataset(dataset, clips=args.clips)
    env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "TMPDIR", "OMP_NUM_THREADS") if key in os.environ}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")

    def stage(mode: str, out: str, *extra: str) -> list[str]:
        return [args.trainer_python, "-m", "voice_trainers", mode, "--dataset", str(dataset),
                "--out", str(output / out), "--checkpoints", str(work / "checkpoints" / out),
                "--language", "en", "--profile", "ci", *extra]

    model = str(output / "full" / "model.pth")
    results = {
        "train_full": measured(stage("full", "full"), env, work / "full.log"),
        "train_light": measured(stage("light", "light", "--full-model", model), env, work / "light.log"),
        "evaluate": measured(stage("evaluate", "eval", "--full-model", model,
                                   "--light-model", str(output / "light" / "model.onnx")), env, work / "eval.log"),
    }
    report = json.loads((output / "eval" / "quality.json").read_text(encoding="utf-8"))
    print(f"{'stage':<12} {'wall s':>8} {'CPU-s':>8} {'peak RSS MiB':>13}")
    for name, figures in results.items():
        print(f"{name:<12} {figures['wall_s']:>8} {figures['cpu_s']:>8} {figures['peak_rss_mib']:>13}")
    full, evaluate = results["train_full"], results["evaluate"]
    ratio = {key: round(evaluate[key] / full[key], 2) for key in full}
    print(f"evaluate / train_full: wall {ratio['wall_s']}, CPU {ratio['cpu_s']}, peak RSS {ratio['peak_rss_mib']}"
          f" ({len(report['sentences'])} held-out sentences; the report's own cost: {report['cost']})")
    print(json.dumps({"stages": results, "ratio": ratio, "work": str(work)}))
    return 0 if ratio["wall_s"] < 1 else 1


if __name__ == "__main__":
    sys.exit(main())
