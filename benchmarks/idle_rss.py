"""Peak memory of an idle worker: `python -m worker run` long-polling an empty local queue.

    python benchmarks/idle_rss.py [--seconds 15] [--wait-s 1]

Reads VmHWM (peak resident set) and VmRSS from /proc after ``--seconds`` of idling, so the figure
covers start-up (imports, settings, store, clients) and the steady polling loop. The baseline, run
side by side, is the least an SQS consumer can be: boto3, one SQS client, a receive loop on the same
queue. The ratio says what the worker's loop, heartbeat, settings, logging and store add to that.
A third process, the baseline that also imports the libraries the worker is built on (pydantic,
structlog, sqlite3), shows how much of that ratio they take before any of the worker's own code.
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


BASELINE = """
import os, boto3
sqs = boto3.session.Session().client("sqs", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                                      region_name=os.environ["AWS_REGION"])
while True:
    sqs.receive_message(QueueUrl=os.environ["SQS_QUEUE_URL"],
                        WaitTimeSeconds=int(os.environ["SQS_WAIT_TIME_SECONDS"]))
"""

# The same loop after importing what the worker cannot start without; BaseModel loads pydantic's core.
LIBRARIES = "import sqlite3, structlog\nfrom pydantic import BaseModel\n" + BASELINE


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
        procs = {
            "worker": subprocess.Popen([sys.executable, "-m", "worker", "run"], cwd=ROOT, env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            "baseline": subprocess.Popen([sys.executable, "-c", BASELINE], cwd=ROOT, env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            "libraries": subprocess.Popen([sys.executable, "-c", LIBRARIES], cwd=ROOT, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        }
        figures = {}
        try:
            time.sleep(args.seconds)
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise SystemExit(f"the {name} exited with {proc.returncode}")
                figures[name] = status_kib(proc.pid, "VmHWM"), status_kib(proc.pid, "VmRSS")
        finally:
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    print(f"after {args.seconds:g} s idle (long polls of {args.wait_s} s):")
    for name, (peak_kib, now_kib) in figures.items():
        print(f"  {name:10} peak RSS {peak_kib / 1024:6.1f} MiB, current RSS {now_kib / 1024:6.1f} MiB")
    print(f"  ratio worker/baseline (peak) {figures['worker'][0] / figures['baseline'][0]:.2f}")
    print(f"  ratio libraries/baseline (peak) {figures['libraries'][0] / figures['baseline'][0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
