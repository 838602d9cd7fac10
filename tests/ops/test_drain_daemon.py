"""`python -m worker run` drained by SIGUSR2 mid-job: the job completes, the next one waits, exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from tests.support import create_queues, events_after, events_until
from worker.voice.records.sqlite import SqliteStore
from worker.voice.submit import submit

REPO = Path(__file__).resolve().parents[2]
PROFILE = "665f1c2e9b1e8a0012ab34ce"


@pytest.mark.server
def test_sigusr2_mid_job_completes_it_leaves_the_next_queued_and_exits_zero(moto_server, tmp_path):
    """The daemon given SIGUSR2 after receiving a job completes and deletes it, never receives the second, and exits 0."""
    session = boto3.session.Session(region_name="us-east-1")
    sqs = session.client("sqs", endpoint_url=moto_server)
    s3 = session.client("s3", endpoint_url=moto_server)
    suffix = f"{os.getpid()}-{time.monotonic_ns()}"
    q = create_queues(sqs, name=f"drain-daemon-{suffix}")
    bucket, recordings = f"models-{suffix}", f"recordings-{suffix}"
    for b in (bucket, recordings):
        s3.create_bucket(Bucket=b)
    prefix = f"recordings/{PROFILE}"
    s3.upload_file(str(REPO / "samples" / "clip-1.wav"), recordings, f"{prefix}/clip-1.wav")
    db = tmp_path / "records.db"
    store = SqliteStore(str(db))
    jobs = [submit(store, sqs, q.url, {
        "profileId": PROFILE,
        "metadata": {"directoryName": f"voice-{n}"},
        "input": [{"recordingUrl": f"s3://{recordings}/{prefix}/clip-1.wav", "originalText": "Hello there."}],
    })[0] for n in (1, 2)]
    env = {**os.environ, "SQS_QUEUE_URL": q.url, "AWS_ENDPOINT_URL": moto_server, "AWS_REGION": "us-east-1",
           "STORE_URL": f"sqlite:///{db}", "S3_BUCKET": bucket, "RECORDINGS_S3_BUCKET": recordings,
           "WORK_ROOT": str(tmp_path / "work"), "SQS_VISIBILITY_TIMEOUT_SECONDS": "30",
           "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "1000", "SQS_WAIT_TIME_SECONDS": "1",
           # No grace at all: a SIGTERM here would stop the job at once and hand it back.
           "SHUTDOWN_GRACE_SECONDS": "0",
           # The shipped config is the reference stand-in, and these jobs are production ones.
           "ALLOW_STAND_IN_TRAINER": "true"}
    proc = subprocess.Popen([sys.executable, "-m", "worker", "run"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        events = events_until(proc, "message.received")
        proc.send_signal(signal.SIGUSR2)
        assert proc.wait(90) == 0
        events += events_after(proc)
    finally:
        proc.kill()
    names = [e["event"] for e in events]
    assert names.count("message.received") == 1
    assert names.index("worker.drain_requested") < names.index("job.completed") < names.index("message.deleted")
    assert [e["reason"] for e in events if e["event"] == "worker.stopped"] == ["drain"]
    statuses = [(store.get_job(job_id) or {}).get("status") for job_id in jobs]
    assert statuses.count("completed") == 1
    [left] = q.receive_now(wait_s=0)
    assert left["Attributes"]["ApproximateReceiveCount"] == "1"
    store.close()
