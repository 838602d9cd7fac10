"""The real daemon and the demo as processes: `python -m worker run` and `python -m worker demo`."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from tests.support import ARTIFACT_KEYS, create_queues
from worker.voice.records.sqlite import SqliteStore
from worker.voice.submit import submit

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.server
def test_daemon_trains_a_job_and_speaks_sd_notify(moto_server, tmp_path):
    """`python -m worker run` completes a real job, keeps its liveness file fresh, and sends READY, WATCHDOG, STOPPING in order,
    with STATUS lines for the job and the stop."""
    session = boto3.session.Session(region_name="us-east-1")
    sqs = session.client("sqs", endpoint_url=moto_server)
    s3 = session.client("s3", endpoint_url=moto_server)
    suffix = f"{os.getpid()}-{time.monotonic_ns()}"
    q = create_queues(sqs, name=f"daemon-{suffix}")
    bucket, recordings = f"models-{suffix}", f"recordings-{suffix}"
    for b in (bucket, recordings):
        s3.create_bucket(Bucket=b)
    prefix = "recordings/665f1c2e9b1e8a0012ab34ce"  # the default RECORDINGS_S3_KEY_PREFIX for this profile
    s3.upload_file(str(REPO / "samples" / "clip-1.wav"), recordings, f"{prefix}/clip-1.wav")
    s3.upload_file(str(REPO / "samples" / "clip-3.flac"), recordings, f"{prefix}/clip-3.flac")
    db = tmp_path / "records.db"
    store = SqliteStore(str(db))
    job_id, _ = submit(store, sqs, q.url, {
        "profileId": "665f1c2e9b1e8a0012ab34ce",
        "metadata": {"directoryName": "voice-1"},
        "input": [{"recordingUrl": f"s3://{recordings}/{prefix}/clip-1.wav", "originalText": "Hello there."},
                  {"recordingUrl": f"s3://{recordings}/{prefix}/clip-3.flac", "originalText": "Train me."}],
    })

    notify_path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(0.2)
    liveness = tmp_path / "alive"
    env = {**os.environ, "SQS_QUEUE_URL": q.url, "AWS_ENDPOINT_URL": moto_server, "AWS_REGION": "us-east-1",
           "STORE_URL": f"sqlite:///{db}", "S3_BUCKET": bucket, "RECORDINGS_S3_BUCKET": recordings, "WORK_ROOT": str(tmp_path / "work"),
           "SQS_VISIBILITY_TIMEOUT_SECONDS": "30", "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "1000",
           "SQS_WAIT_TIME_SECONDS": "1", "NOTIFY_SOCKET": notify_path, "LIVENESS_FILE": str(liveness),
           "SHUTDOWN_GRACE_SECONDS": "5",
           # The shipped config is the reference stand-in, and this job is a production one.
           "ALLOW_STAND_IN_TRAINER": "true"}
    # umask 022 as most shells and runtimes hand it: the worker must tighten it itself.
    proc = subprocess.Popen([sys.executable, "-m", "worker", "run"], env=env, cwd=REPO, umask=0o022,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    states = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                states.append(listener.recv(256).decode())
            except TimeoutError:
                pass
            if (store.get_job(job_id) or {}).get("status") == "completed" and q.counts() == (0, 0):
                break
            assert proc.poll() is None, proc.stderr.read()
        assert store.get_job(job_id)["status"] == "completed"
        health = subprocess.run([sys.executable, "-m", "worker", "health"], env=env, cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert health.returncode == 0, health.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        while True:
            try:
                states.append(listener.recv(256).decode())
            except TimeoutError:
                break
    finally:
        proc.kill()
        listener.close()
        store.close()
    assert states[0] == "READY=1"
    # STOPPING=1 once, when SIGTERM arrives; the loop's last receive may still ping the watchdog after it.
    stopping = states.index("STOPPING=1")
    assert "WATCHDOG=1" in states[1:stopping]
    assert set(states[stopping + 1:]) <= {"WATCHDOG=1"}
    statuses = [s for s in states if s.startswith("STATUS=")]
    assert statuses[0] == "STATUS=idle" and statuses[-1] == "STATUS=stopping"
    assert any(s.startswith("STATUS=working on message ") for s in statuses)
    profile = SqliteStore(str(db)).get_profile("665f1c2e9b1e8a0012ab34ce")
    for uri in profile["s3Paths"].values():
        key = uri.removeprefix(f"s3://{bucket}/")
        assert s3.head_object(Bucket=bucket, Key=key)["ContentLength"] > 0
    # After the commit only the logs stay besides the five published models (which modelPaths name),
    # and nothing the worker wrote is readable by other users.
    models = tmp_path / "work" / ".models"
    left = [p for p in (tmp_path / "work").rglob("*")]
    scratch = [p for p in left if models not in p.parents]
    assert any(p.is_file() and p.parent.name == "logs" for p in scratch)
    assert not [p for p in scratch if p.is_file() and p.parent.name != "logs"]
    assert sorted(Path(p) for p in profile["modelPaths"].values()) == sorted(
        p for p in models.rglob("*") if p.is_file())
    assert not [p for p in left if p.stat().st_mode & 0o007], "world-accessible work files"


def test_no_notify_socket_means_no_datagrams(tmp_path):
    """Without NOTIFY_SOCKET the worker sends nothing (and does not fail)."""
    from worker.core.health import Liveness, notify

    assert notify(None, "READY=1") is False
    Liveness(None, None).ready()


def test_demo_completes_and_lists_five_s3_objects():
    """`python -m worker demo` exits 0 and its summary lists five S3 objects that exist and five local files."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "worker", "demo"], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={k: v for k, v in os.environ.items() if not k.startswith("AWS_")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    objects = re.findall(r"^\s+\w+\s+(s3://\S+) \((\d+) bytes\)$", proc.stdout, re.M)
    assert len(objects) == len(ARTIFACT_KEYS) and all(int(size) > 0 for _, size in objects)
    files = re.findall(r"^\s+\w+\s+(/\S+)$", proc.stdout, re.M)
    assert len(files) == len(ARTIFACT_KEYS) and all(Path(f).stat().st_size > 0 for f in files)
    assert "status        completed" in proc.stdout
    assert time.monotonic() - started < 60
