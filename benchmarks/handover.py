"""Time from SIGTERM of a busy worker to a second, idle worker starting the same job.

    python benchmarks/handover.py [--runs 3] [--grace-s 2]

Two `python -m worker run` processes share a local moto queue and a SQLite file. The first takes a job
whose training stage runs far longer than the grace; once that stage is running, it gets SIGTERM. It
waits out SHUTDOWN_GRACE_SECONDS, stops the trainer, clears its lease and makes the message visible at
once; the second worker, long-polling (1 s), receives it and claims the job. Measured: SIGTERM to the
second worker's claim (its attempt's start in the job history), and to the first worker's exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from sqs_bench import ROOT, LocalAws, session

from worker.voice.records.sqlite import SqliteStore
from worker.voice.submit import submit

PIPELINE = """
[artifacts]
fullModel = "full/model.pth"
fullConfig = "full/config.json"
speakerEmbeddings = "full/speakers.pth"
lightModel = "light/model.onnx"
lightConfig = "light/model.onnx.json"

[[stages]]
name = "train_full"
argv = ["{python}", "-m", "pipeline.reference_trainer", "full", "--dataset", "{dataset_dir}",
        "--out", "{output_dir}/full", "--checkpoints", "{checkpoint_dir}", "--steps", "600",
        "--step-delay-s", "0.05"]
outputs = ["full/model.pth", "full/config.json"]
resumable = true

[[stages]]
name = "embed"
argv = ["{python}", "-m", "pipeline.reference_trainer", "embed", "--dataset", "{dataset_dir}",
        "--out", "{output_dir}/full", "--checkpoints", "{checkpoint_dir}"]
outputs = ["full/speakers.pth"]

[[stages]]
name = "train_light"
argv = ["{python}", "-m", "pipeline.reference_trainer", "light", "--dataset", "{dataset_dir}",
        "--out", "{output_dir}/light", "--checkpoints", "{checkpoint_dir}", "--steps", "2",
        "--full-model", "{output_dir}/full/model.pth"]
outputs = ["light/model.onnx", "light/model.onnx.json"]
"""


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(interval_s)
    return value


def wait_exit(proc: subprocess.Popen, log: Path, what: str) -> None:
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise SystemExit(f"{what} did not exit within 60 s of SIGTERM; last log lines:\n" + "\n".join(tail)) from None


def one_run(endpoint: str, work: Path, grace_s: float, run_no: int) -> tuple[float, float]:
    aws = session()
    sqs, s3 = aws.client("sqs", endpoint_url=endpoint), aws.client("s3", endpoint_url=endpoint)
    queue_url = sqs.create_queue(QueueName=f"handover-{run_no}")["QueueUrl"]
    for bucket in (f"models-{run_no}", f"recordings-{run_no}"):
        s3.create_bucket(Bucket=bucket)
    key = "recordings/665f1c2e9b1e8a0012ab34ce/clip-1.wav"  # under the default RECORDINGS_S3_KEY_PREFIX
    s3.upload_file(str(ROOT / "samples" / "clip-1.wav"), f"recordings-{run_no}", key)
    (work / "pipeline.toml").write_text(PIPELINE)
    db = work / "records.db"
    env = {**os.environ, "SQS_QUEUE_URL": queue_url, "AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1",
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "STORE_URL": f"sqlite:///{db}",
           "S3_BUCKET": f"models-{run_no}", "RECORDINGS_S3_BUCKET": f"recordings-{run_no}", "WORK_ROOT": str(work / "work"),
           "PIPELINE_CONFIG": str(work / "pipeline.toml"), "SQS_VISIBILITY_TIMEOUT_SECONDS": "30",
           "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "1000", "SQS_WAIT_TIME_SECONDS": "1",
           "SHUTDOWN_GRACE_SECONDS": str(grace_s), "LOG_FORMAT": "json"}
    store = SqliteStore(str(db))
    job_id, _ = submit(store, sqs, queue_url, {
        "profileId": "665f1c2e9b1e8a0012ab34ce", "metadata": {"directoryName": "handover"},
        "input": [{"recordingUrl": f"s3://recordings-{run_no}/{key}", "originalText": "Hello there."}]})

    def start(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "worker", "run"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=open(work / f"{name}.log", "wb"),  # noqa: SIM115 - the child owns it
                                env={**env, "WORKER_ID": name, "LIVENESS_FILE": str(work / f"{name}.alive")})

    busy = start("busy")
    try:
        wait_for(lambda: ((store.get_job(job_id) or {}).get("progress") or {}).get("stage") == "train_full",
                 60, "the first worker to be training")
        idle = start("idle")
        wait_for(lambda: (work / "idle.alive").exists(), 60, "the second worker to poll")
        sent_at = datetime.now(UTC)
        sent_s = time.monotonic()
        busy.send_signal(signal.SIGTERM)
        history = wait_for(lambda: [h for h in (store.get_job(job_id) or {}).get("history", [])
                                    if h["worker"] == "idle"], 60, "the second worker's claim")
        claimed_after_s = (history[0]["start"] - sent_at).total_seconds()
        wait_exit(busy, work / "busy.log", "the first worker")
        exited_after_s = time.monotonic() - sent_s
        idle.send_signal(signal.SIGTERM)
        idle.send_signal(signal.SIGTERM)  # the second signal skips its grace: the benchmark is over
        wait_exit(idle, work / "idle.log", "the second worker")
    finally:
        for proc in (busy, locals().get("idle")):
            if proc is not None and proc.poll() is None:
                proc.kill()
        store.close()
    return claimed_after_s, exited_after_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--grace-s", type=float, default=2.0)
    args = parser.parse_args()
    claims, exits = [], []
    with LocalAws() as aws, tempfile.TemporaryDirectory() as tmp:
        for run_no in range(args.runs):
            work = Path(tmp) / f"run{run_no}"
            work.mkdir()
            claimed_s, exited_s = one_run(aws.url, work, args.grace_s, run_no)
            claims.append(claimed_s)
            exits.append(exited_s)
            print(f"  run {run_no + 1}: second worker claimed after {claimed_s:.2f} s, "
                  f"first exited after {exited_s:.2f} s", flush=True)
    print(json.dumps({"grace_s": args.grace_s, "claim_after_sigterm_s_median": round(statistics.median(claims), 2),
                      "first_exit_after_sigterm_s_median": round(statistics.median(exits), 2)}))
    print(f"SIGTERM -> second worker starts the job: median {statistics.median(claims):.2f} s with "
          f"SHUTDOWN_GRACE_SECONDS={args.grace_s:g} ({statistics.median(claims) - args.grace_s:.2f} s beyond the grace)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
