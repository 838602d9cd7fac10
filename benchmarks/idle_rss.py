"""Peak memory of an idle worker: `python -m worker run` long-polling an empty local queue.

    python benchmarks/idle_rss.py [--seconds 15] [--wait-s 1]

Reads VmHWM (peak resident set) and VmRSS from /proc after ``--seconds`` of idling, so the figure
covers start-up (imports, settings, store, clients) and the steady polling loop.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqs_bench import ROOT, LocalAws, session


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/{pid}/status has no {field}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--wait-s", type=int, default=1, help="SQS_WAIT_TIME_SECONDS of the idle worker")
    args = parser.parse_args()
    with LocalAws() as aws, tempfile.TemporaryDirectory() as tmp:
        sqs, s3 = session().client("sqs", endpoint_url=aws.url), session().client("s3", endpoint_url=aws.url)
        queue_url = sqs.create_queue(QueueName="idle")["QueueUrl"]
        s3.create_bucket(Bucket="idle-models")
        env = {**os.environ, "SQS_QUEUE_URL": queue_url, "AWS_ENDPOINT_URL": aws.url, "AWS_REGION": "us-east-1",
               "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "STORE_URL": f"sqlite:///{tmp}/records.db", "S3_BUCKET": "idle-models", "WORK_ROOT": f"{tmp}/work",
               "PIPELINE_CONFIG": str(ROOT / "config" / "pipeline.toml"), "SQS_WAIT_TIME_SECONDS": str(args.wait_s)}
        proc = subprocess.Popen([sys.executable, "-m", "worker", "run"], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(args.seconds)
            if proc.poll() is not None:
                raise SystemExit(f"the worker exited with {proc.returncode}")
            peak_kib, now_kib = status_kib(proc.pid, "VmHWM"), status_kib(proc.pid, "VmRSS")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    print(f"idle worker after {args.seconds:g} s (long polls of {args.wait_s} s): "
          f"peak RSS {peak_kib / 1024:.1f} MiB, current RSS {now_kib / 1024:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
