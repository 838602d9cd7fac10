"""The long fault soak: minutes of worker processes under kill -9, SIGSTOP past the lease, SIGTERM,
partitions, drops, latency and duplicate sends, then the total-queue checker.

    .venv/bin/python scripts/soak.py --seed 14 --minutes 5 --workers 4 --jobs 120
    .venv/bin/python scripts/soak.py --hosts --env CHECKPOINT_S3_SYNC_SECONDS=1   # the S3 mirror under faults

Prints the jobs, the faults by kind and every violation; exits 1 on any violation. The bounded run
in `make test` is tests/reliability/test_soak.py; both use tests/reliability/soak.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import conftest  # noqa: E402,F401  (hermetic AWS credentials, as in the tests)
from tests.reliability.soak import SoakConfig, run_soak  # noqa: E402
from worker.ops.demo import LocalAws  # noqa: E402

FAULTS_PER_MINUTE = 18


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--minutes", type=float, default=3.0, help="how long faults are injected")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--faults", type=int, help=f"default: {FAULTS_PER_MINUTE} a minute")
    parser.add_argument("--train-s", type=float, default=SoakConfig.train_s,
                        help="one training's duration (above the lease, a kill -9 mid-training leaves a trainer "
                             "running while the retry trains)")
    parser.add_argument("--keep", action="store_true", help="keep the run's files (logs, records) and print where")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a worker setting for the run, e.g. CHECKPOINT_S3_SYNC_SECONDS=1 (repeatable)")
    parser.add_argument("--hosts", action="store_true",
                        help="each worker a host of its own (its own WORK_ROOT): with the S3 mirror on, a retry "
                             "elsewhere resumes from what the job record vouches for")
    args = parser.parse_args(argv)
    worker_env = dict(item.split("=", 1) for item in args.env)
    window_s = args.minutes * 60
    faults = args.faults if args.faults is not None else max(1, int(args.minutes * FAULTS_PER_MINUTE))
    config = SoakConfig(seed=args.seed, workers=args.workers, jobs=args.jobs, window_s=window_s, train_s=args.train_s,
                        faults=faults, settle_timeout_s=max(120.0, window_s / 2), worker_env=worker_env,
                        hosts=args.hosts)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, LocalAws() as aws:
        root = Path(tempfile.mkdtemp(prefix="soak-")) if args.keep else Path(tmp)
        result = run_soak(aws.url, root, config)
        print(f"seed {args.seed}, {args.workers} workers, {args.minutes} min")
        print(result.summary())
        if args.keep:
            print(f"files: {root}")
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
