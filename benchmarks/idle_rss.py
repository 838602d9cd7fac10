"""Memory of an idle worker: `python -m worker run` long-polling an empty local queue.

    python benchmarks/idle_rss.py [--seconds 15] [--wait-s 1]

Reads VmHWM (peak resident set) and VmRSS from /proc after ``--seconds`` of idling, so the figure
covers start-up (imports, settings, store, clients) and the steady polling loop. The baseline, run
side by side, is the one the idle-memory target is stated against (issue 31): boto3's
receive loop on the same queue after importing the libraries the design names (boto3, pymongo,
pydantic with its core, structlog, sentry-sdk). The worker's idle peak must stay within 1.2 times it;
the ratio says what the worker's loop, heartbeat, settings, logging and store add to a consumer built
on those libraries. The worker imports pymongo only for a MongoDB store and sentry-sdk only with a
DSN, so with SQLite and no DSN it can be under 1.

Two more baselines are kept as extra lines: the least an SQS consumer can be (boto3, one SQS client,
the receive loop), and that loop after structlog and sqlite3, the libraries this idle worker cannot
start without.

The worker makes its job machinery (the handler, the pipeline, the message model, the S3 client) at
the first message, so one more process shows what it holds once that has happened: a worker that
took the demo's sample job (three s3:// clips, the reference trainer, five uploads) to completion
and then idled for ``--seconds`` too. Its current RSS is the idle figure of a worker that has
worked; its peak is the job's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sqs_bench import ROOT, LocalAws, session

from worker.ops.demo import dev_session, local_stack_env, provision, sample_job

JOB_TIMEOUT_S = 180


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

# The same loop after importing what the worker cannot start without.
LIBRARIES = "import sqlite3, structlog\n" + BASELINE

# The same loop after importing the libraries the design names; BaseModel loads pydantic's core (a bare
# `import pydantic` loads almost nothing: its names are imported lazily).
DESIGN = "import boto3, pymongo, sentry_sdk, structlog\nfrom pydantic import BaseModel\n" + BASELINE
TARGET = 1.2


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
            "design libs": subprocess.Popen([sys.executable, "-c", DESIGN], cwd=ROOT, env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            "baseline": subprocess.Popen([sys.executable, "-c", BASELINE], cwd=ROOT, env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            "libraries": subprocess.Popen([sys.executable, "-c", LIBRARIES], cwd=ROOT, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        }
        # The same settings as the idle worker but its own queue (with a DLQ), store and work root.
        job_env = {**env, **local_stack_env(aws.url, provision(dev_session(), aws.url), Path(tmp) / "job"),
                   "SQS_WAIT_TIME_SECONDS": str(args.wait_s), "KEEP_WORK_FILES": "false", "LOG_FORMAT": "json"}
        for name in ("METRICS_ENABLED", "LOG_LEVEL"):
            job_env[name] = env.get(name, "")  # as the idle worker has them: unset means the defaults
        procs["after one job"] = subprocess.Popen([sys.executable, "-m", "worker", "run"], cwd=ROOT, env=job_env,
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        figures = {}
        try:
            job_id = run_one_job(job_env, procs["after one job"])
            time.sleep(args.seconds)
            for name, proc in procs.items():
                if proc.poll() is not None:
                    raise SystemExit(f"the {name} exited with {proc.returncode}")
                figures[name] = status_kib(proc.pid, "VmHWM"), status_kib(proc.pid, "VmRSS")
        finally:
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    print(f"after {args.seconds:g} s idle (long polls of {args.wait_s} s); the last after job {job_id} too:")
    for name, (peak_kib, now_kib) in figures.items():
        print(f"  {name:13} peak RSS {peak_kib / 1024:6.1f} MiB, current RSS {now_kib / 1024:6.1f} MiB")
    design = figures["design libs"]
    ratio = figures["worker"][0] / design[0]
    print(f"  ratio worker/design libs (peak) {ratio:.2f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'MISSED'});"
          f" current {figures['worker'][1] / design[1]:.2f}")
    print(f"  ratio after one job/design libs (current) {figures['after one job'][1] / design[1]:.2f}"
          f" (peak, the job's own: {figures['after one job'][0] / design[0]:.2f})")
    print("  against the other baselines:")
    print(f"    ratio worker/baseline (peak) {figures['worker'][0] / figures['baseline'][0]:.2f}")
    print(f"    ratio libraries/baseline (peak) {figures['libraries'][0] / figures['baseline'][0]:.2f}")
    print(f"    ratio design libs/baseline (peak) {design[0] / figures['baseline'][0]:.2f}")
    print(f"    ratio after one job/baseline (current) {figures['after one job'][1] / figures['baseline'][1]:.2f}"
          f" (peak, the job's own: {figures['after one job'][0] / figures['baseline'][0]:.2f})")
    return 0


def run_one_job(env: dict[str, str], worker: subprocess.Popen) -> str:
    """Submit the demo's sample job with the CLI and wait until the worker has completed it."""
    submitted = subprocess.run([sys.executable, "-m", "worker", "submit", "-", "--json"], cwd=ROOT, env=env,
                               input=json.dumps(sample_job()), capture_output=True, text=True, timeout=60)
    if submitted.returncode != 0:
        raise SystemExit(f"submit failed: {submitted.stderr.strip()}")
    job_id = json.loads(submitted.stdout)["jobId"]
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        if worker.poll() is not None:
            raise SystemExit(f"the worker that takes the job exited with {worker.returncode}")
        shown = subprocess.run([sys.executable, "-m", "worker", "status", job_id, "--json"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=60)
        status = json.loads(shown.stdout)["job"]["status"] if shown.returncode == 0 else None
        if status == "completed":
            return job_id
        if status in ("error", "cancelled"):
            raise SystemExit(f"job {job_id} ended {status}: {shown.stdout}")
        time.sleep(0.5)
    raise SystemExit(f"job {job_id} did not complete within {JOB_TIMEOUT_S} s")


if __name__ == "__main__":
    raise SystemExit(main())
