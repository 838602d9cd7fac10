"""Fixtures for the job handler: both stores (SQLite, a real MongoDB server), moto S3, a fake training step that writes the configured artifacts."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest

from tests.support import SHIPPED_ARTIFACTS, STORE_WRITES, attempt_through
from worker.core.core_config import LeaseTimings
from worker.core.lease import Lease, Shutdown
from worker.core.queue import Message, Queue
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.mongo import MongoStore
from worker.voice.records.sqlite import SqliteStore

JOB_ID = "665f1c2e9b1e8a0012ab34cd"
PROFILE_ID = "665f1c2e9b1e8a0012ab34ce"
BUCKET = "voice-models"
ARTIFACTS = SHIPPED_ARTIFACTS


def message_body(job_id: str = JOB_ID, profile_id: str = PROFILE_ID, **extra) -> str:
    return json.dumps({
        "_doc": {"_id": job_id}, "jobId": job_id, "profileId": profile_id, "environment": "production",
        "metadata": {"directoryName": "user-123-voice-1", "language": "en"},
        "input": [{"recordingUrl": "https://media.example.com/rec/1.wav", "originalText": "Hello there."}],
        **extra,
    })


def deliver(handler, receive_count: int, message_id: str = "m-1", body: str | None = None):
    """Call the handler directly with one message received ``receive_count`` times."""
    message = Message(message_id, "-", message_body() if body is None else body, receive_count,
                      time.monotonic())
    timings = LeaseTimings(visibility_timeout_s=60, interval_s=10, time_limit_s=600, shutdown_grace_s=1)
    lease = Lease(Queue(None, "q"), message, timings, shutdown=Shutdown())
    return handler(message, lease)


class OffsetClock:
    """Real UTC time plus an offset a test can move forward (to expire a lease)."""

    def __init__(self):
        self.offset = timedelta()

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.offset


def take_over(raw_store, clock):
    """Worker B claims the job once our record lease has lapsed; returns B's attempt.

    Our heartbeat thread may renew between the clock's jump and B's claim (the renewal reads the
    moved clock, so the lease is held again): B then waits out that lease too, as a real B would."""
    for _ in range(3):
        clock.offset += timedelta(hours=1)
        claim = raw_store.claim(JOB_ID, owner="worker-b", token="token-b", lease_s=3600)
        if claim.outcome == "claimed":
            return claim.attempt
    raise AssertionError(f"worker B could not claim the job: {claim.outcome}")


class Recorder:
    """One ordered log of store writes and S3 writes."""

    def __init__(self):
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def add(self, name: str) -> None:
        with self.lock:
            self.calls.append(name)


class RecordingStore:
    """Delegates to a real store, logging each write, with optional injected failures per method."""

    def __init__(self, store, recorder: Recorder):
        self._store, self._recorder = store, recorder
        self.faults: dict = {}

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args, **kwargs):
            if name in STORE_WRITES:
                self._recorder.add(f"store.{name}")
            fault = self.faults.get(name)
            if fault is not None:
                exc = fault()
                if exc is not None:
                    raise exc
            return attempt_through(self, attr(*args, **kwargs))

        return call


class FakeTrain:
    """Stands in for the pipeline: writes the artifacts (``artifacts``: the shipped config's unless a test
    sets others) under work_dir/output, deterministically."""

    def __init__(self):
        self.runs = 0
        self.artifacts = dict(ARTIFACTS)
        self.during = None  # optional callable(job, work_dir, stop, progress) run before writing
        self.report_progress = True

    def __call__(self, job, work_dir: Path, stop, progress, ledger=None):
        self.runs += 1
        if self.during is not None:
            self.during(job, work_dir, stop, progress)
        out = work_dir / "output"
        paths = {}
        for name, rel in self.artifacts.items():
            path = out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f"{name} of {job.job_id}\n".encode() * 10)
            paths[name] = path
        if self.report_progress:
            progress("train_full", 100)
        return paths


@pytest.fixture
def clock():
    return OffsetClock()


# The handler over both stores; MongoDB is the real server of tests/mongo_server.py (a database of each
# test's own), not mongomock: the store contract (tests/voice/records) runs on mongomock as well.
@pytest.fixture(params=["sqlite", "mongo"])
def raw_store(request, tmp_path, clock):
    if request.param == "sqlite":
        store = SqliteStore(str(tmp_path / "records.db"), clock=clock)
    else:
        store = MongoStore(request.getfixturevalue("mongo_db"), clock=clock)
        store.ensure_indexes()
    store.submit({"_id": JOB_ID, "profileId": PROFILE_ID, "environment": "production"}, {"_id": PROFILE_ID})
    yield store
    store.close()


@pytest.fixture
def recorder():
    return Recorder()


@pytest.fixture
def store(raw_store, recorder):
    return RecordingStore(raw_store, recorder)


@pytest.fixture
def s3(aws, recorder):
    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    for op in ("PutObject", "UploadPart", "CreateMultipartUpload"):
        client.meta.events.register(f"before-call.s3.{op}", lambda model, **kw: recorder.add(f"s3.{model.name}"))
    return client


@pytest.fixture
def train():
    return FakeTrain()


@pytest.fixture
def handler(store, s3, train, tmp_path):
    return VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="test-worker",
                                         lease_s=2),
                           store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)
