"""Test helpers shared by the suites: moto queues, a recording/fault-injecting client wrapper, a flaky store."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import ClientError

from pipeline.config import load_pipeline_config
from pipeline.recording_url import RecordingUrl
from worker.voice.records.errors import StoreError

# The shipped pipeline config: the one declaration of the artifact set. Fakes write exactly its layout
# (SHIPPED_ARTIFACTS: key -> path under the output dir) and tests name its keys (ARTIFACT_KEYS, in order).
SHIPPED_CONFIG = load_pipeline_config(Path(__file__).resolve().parents[1] / "config" / "pipeline.toml")
SHIPPED_ARTIFACTS = dict(SHIPPED_CONFIG.artifacts)
ARTIFACT_KEYS = SHIPPED_CONFIG.artifact_keys

# Short timings so heartbeat behaviour shows in well under a second of test time.
FAST = {
    "SQS_VISIBILITY_TIMEOUT_SECONDS": "2",
    "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "200",
    "SQS_WAIT_TIME_SECONDS": "0",
    "SHUTDOWN_GRACE_SECONDS": "5",
}


@dataclass
class Queues:
    sqs: object
    url: str
    dlq_url: str | None

    def send(self, body: str = '{"hello": "world"}', **kw) -> str:
        return self.sqs.send_message(QueueUrl=self.url, MessageBody=body, **kw)["MessageId"]

    def counts(self, url: str | None = None) -> tuple[int, int]:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=url or self.url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]), int(attrs["ApproximateNumberOfMessagesNotVisible"])

    def receive_now(self, url: str | None = None, wait_s: int = 0) -> list[dict]:
        return self.sqs.receive_message(
            QueueUrl=url or self.url, MaxNumberOfMessages=10, WaitTimeSeconds=wait_s,
            MessageAttributeNames=["All"], MessageSystemAttributeNames=["ApproximateReceiveCount"],
        ).get("Messages", [])


def create_queues(sqs, name: str = "jobs", with_dlq: bool = True) -> Queues:
    dlq_url = None
    attrs = {"VisibilityTimeout": "30"}
    if with_dlq:
        dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        attrs["RedrivePolicy"] = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "5"})
    url = sqs.create_queue(QueueName=name, Attributes=attrs)["QueueUrl"]
    return Queues(sqs, url, dlq_url)


def moto_bucket(bucket: str):
    """A moto-backed S3 client (inside the ``aws`` fixture's mock) with ``bucket`` created."""
    import boto3

    client = boto3.client("s3", region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    return client


def on_the_clock(handler, clock):
    """The handler, started only once the heartbeat thread is parked on ``clock`` (a FakeClock).

    A heartbeat thread just started has not read the clock yet; time moved before it parks would
    start it late.
    """
    def handler_on_the_clock(message, lease):
        clock.block_until_waiting()
        return handler(message, lease)

    return handler_on_the_clock


def client_error(code: str, message: str = "injected", operation: str = "Op") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}}, operation)


class FaultyClient:
    """Delegates to a boto3 client, recording each call; ``faults[op](kwargs)`` may return an error to raise."""

    def __init__(self, client):
        self._client = client
        self.calls: list[tuple[str, dict, str, float]] = []
        self.faults: dict = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if name.startswith("_") or name == "meta" or not callable(attr):
            return attr

        def call(**kwargs):
            with self._lock:
                self.calls.append((name, kwargs, threading.current_thread().name, time.monotonic()))
            fault = self.faults.get(name)
            if fault is not None:
                exc = fault(kwargs)
                if exc is not None:
                    raise exc
            return attr(**kwargs)

        return call

    def ops(self) -> list[str]:
        return [c[0] for c in self.calls]


# Store calls that change records; reads are not writes.
STORE_WRITES = frozenset({"claim", "renew_lease", "set_progress", "record_mirror", "record_note", "record_error", "write_paths",
                          "mark_profile_completed", "mark_job_completed", "mark_cancelled", "release_lease", "release_for_host_fault",
                          "record_quality", "mark_refused", "write_profile_quality", "record_base_model",
                          "write_profile_base_model"})


class FlakyStore:
    """A store behind a switch, for outage tests: while ``down`` is set every call fails.

    The failure is ``StoreError`` naming the call, or the error given to ``fail``; refused calls are
    counted in ``refused``. ``slow[name]`` makes that method take so many seconds first (real ones: the
    reliability rig's workers run on the real clock). ``calls`` names every call, in order; the wrapped
    store is ``wrapped``.
    """

    def __init__(self, store):
        self.wrapped = store
        self.down = threading.Event()
        self.error: Exception | None = None
        self.slow: dict[str, float] = {}
        self.calls: list[str] = []
        self.refused: Counter = Counter()

    def fail(self, error: Exception | None = None) -> None:
        """Take the store down: every call raises ``error`` (a StoreError naming the call when None)."""
        self.error = error
        self.down.set()

    def writes(self) -> list[str]:
        return [c for c in self.calls if c in STORE_WRITES]

    def __getattr__(self, name):
        attr = getattr(self.wrapped, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def call(*args, **kwargs):
            self.calls.append(name)
            if self.down.is_set():
                self.refused[name] += 1
                raise self.error or StoreError(f"injected: the store is unavailable ({name})")
            if name in self.slow:
                time.sleep(self.slow[name])
            return attempt_through(self, attr(*args, **kwargs))

        return call


def attempt_through(proxy, result):
    """A store proxy's claim result, its Attempt writing through the proxy (not the store behind it),
    so the proxy sees and can fail the attempt's writes like any other call."""
    import dataclasses

    attempt = getattr(result, "attempt", None)
    if attempt is None:
        return result
    return dataclasses.replace(result, attempt=dataclasses.replace(attempt, store=proxy))


UNPRIVILEGED_UID = 65534  # nobody
# Readable by any user, unlike an interpreter under /root; probes import only the standard library.
SYSTEM_PYTHON = "/usr/bin/python3"


def run_unprivileged(code: str, *args: str, timeout_s: float = 60) -> str:
    """Run ``code`` (with the repository on sys.path) as a user without CAP_SYS_PTRACE; its stdout.

    Root reads any process's /proc entries whatever its dumpable flag says, so under root the probe
    drops to ``nobody``; any other user is unprivileged already.
    """
    import os
    import subprocess
    import sys

    repo = str(Path(__file__).resolve().parents[1])
    as_root = os.geteuid() == 0
    drop = {"user": UNPRIVILEGED_UID, "group": UNPRIVILEGED_UID, "extra_groups": []} if as_root else {}
    python = SYSTEM_PYTHON if as_root else sys.executable
    prelude = f"import sys; sys.path.insert(0, {repo!r})\n"
    proc = subprocess.run([python, "-c", prelude + code, *args], capture_output=True, text=True, cwd="/",
                          env={"PATH": "/usr/bin:/bin", "WORKER_SECRET": "hunter2"}, timeout=timeout_s,
                          **drop)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


class CountingHashlib:
    """Stands in for ``hashlib`` in the uploader's modules: counts the bytes hashed with SHA-256."""

    def __init__(self):
        self.hashed_bytes = 0

    def sha256(self, data: bytes = b""):
        counter, real = self, hashlib.sha256()

        class Counted:
            def update(self, chunk: bytes) -> None:
                counter.hashed_bytes += len(chunk)
                real.update(chunk)

            def hexdigest(self) -> str:
                return real.hexdigest()

        counted = Counted()
        counted.update(data)
        return counted


def events_until(proc, event: str) -> list[dict]:
    """The JSON log lines a worker process has written to stderr, up to and including the first ``event``."""
    events: list[dict] = []
    for line in proc.stderr:
        events.append(json.loads(line))
        if events[-1]["event"] == event:
            break
    return events


def events_after(proc) -> list[dict]:
    """The rest of a worker process's JSON log lines, once it has exited."""
    return [json.loads(line) for line in proc.stderr.read().splitlines()]


def start_sleepy_worker(moto_server: str, queue_url: str, *, job_s: float, grace_s: float = 1):
    """``tests.core.sleepy_worker`` (the real loop with a handler that sleeps ``job_s``) on the queue,
    its JSON logs on a stderr pipe."""
    env = {
        **os.environ,
        "SQS_QUEUE_URL": queue_url,
        "AWS_ENDPOINT_URL": moto_server,
        "AWS_REGION": "us-east-1",
        "SQS_VISIBILITY_TIMEOUT_SECONDS": "30",
        "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "1000",
        "SQS_WAIT_TIME_SECONDS": "1",
        "SHUTDOWN_GRACE_SECONDS": f"{grace_s:g}",
        "TEST_JOB_SECONDS": f"{job_s:g}",
    }
    return subprocess.Popen([sys.executable, "-m", "tests.core.sleepy_worker"], env=env,
                            stderr=subprocess.PIPE, text=True, cwd=os.getcwd())


@dataclass(frozen=True)
class FakeRecording:
    """A recording as the pipeline reads it (``pipeline.run.Recording``)."""

    url: RecordingUrl
    text: str = "t"


@dataclass(frozen=True)
class FakeJob:
    """A job as the pipeline reads it (``pipeline.run.Job``): its recordings, id and language."""

    recordings: tuple[FakeRecording, ...]
    job_id: str = "job"
    language: str = "en"


@contextlib.contextmanager
def recorded_spans():
    """Tracing on (worker.core.tracing), its finished spans kept by the SDK's in-memory exporter; off after."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from worker.core import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        yield exporter
    finally:
        tracing.disable()
