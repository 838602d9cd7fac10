"""An in-process worker for fault injection: real Worker, VoiceJobHandler, SQLite store and boto3 clients.

SQS and S3 are the moto server over HTTP (not ``mock_aws``: moto's in-process hook would still carry
out a request that a fault answered). Faults go in at two depths:
- ``BotoFaults``: a botocore ``before-send`` hook answers chosen requests with an injected HTTP error
  before they leave, so botocore's own retry mode (standard, 5 attempts) sees real throttling and 5xx
  answers and the worker's adapters see what is left after it;
- ``FlakyStore`` (``tests.support``): wraps the real store; while ``down`` every call raises
  ``StoreError``, and chosen methods can be slowed.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import boto3
import botocore.retries.standard
from botocore.awsrequest import AWSResponse

from tests.reliability.stack import ARTIFACTS, ENVIRONMENT, new_object_id
from tests.support import ARTIFACT_KEYS, FlakyStore, Queues, create_queues
from worker.core.aws import client_config, make_client
from worker.core.loop import Worker
from worker.core.queue import Queue
from worker.settings import Settings, load_settings
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.sqlite import SqliteStore

VISIBILITY_S = 2
RIG_ENV = {
    "SQS_VISIBILITY_TIMEOUT_SECONDS": str(VISIBILITY_S),
    "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "300",
    "SQS_WAIT_TIME_SECONDS": "1",
    "SQS_RETRY_VISIBILITY_BASE_SECONDS": "1",
    "SQS_RETRY_VISIBILITY_MAX_SECONDS": "2",
    "SHUTDOWN_GRACE_SECONDS": "5",
    "AWS_REGION": "us-east-1",
    "RECORDINGS_S3_BUCKET": "recordings-bucket",
}
# botocore's "max_attempts" counts retries: one call is the first attempt plus that many more.
ATTEMPTS_PER_CALL = client_config(load_settings({}).aws_config()).retries["max_attempts"] + 1


def fast_botocore_backoff(monkeypatch) -> None:
    """botocore's retries keep their count and rules but wait 10 ms instead of up to seconds."""
    monkeypatch.setattr(botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, ctx: 0.01)


class _Body:
    def __init__(self, data: bytes):
        self._data = data

    def stream(self, **_kwargs):
        yield self._data


def error_response(request, status: int, code: str, service: str) -> AWSResponse:
    """An AWS error answer in the service's wire format (SQS speaks JSON, S3 XML)."""
    if service == "sqs":
        body = json.dumps({"__type": f"com.amazonaws.sqs#{code}", "message": "injected"}).encode()
        headers = {"Content-Type": "application/x-amz-json-1.0", "x-amzn-query-error": f"{code};Sender"}
    else:
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        headers = {"Content-Type": "application/xml"}
    return AWSResponse(request.url, status, headers, _Body(body))


THROTTLING = (400, "ThrottlingException")
INTERNAL = (500, "InternalFailure")
UNAVAILABLE = (503, "ServiceUnavailable")
RECEIPT_INVALID = (400, "ReceiptHandleIsInvalid")


@dataclass
class Rule:
    """Answer matching requests with ``error`` (a (status, code) pair or a cycle of them) ``times`` times."""

    operation: str
    errors: list[tuple[int, str]]
    times: float = float("inf")
    when: Callable[[dict], bool] = lambda params: True
    fired: int = 0


class BotoFaults:
    """Injected answers for one client, decided per HTTP attempt (so botocore retries see each one)."""

    def __init__(self, client, service: str):
        self._service = service
        self.rules: list[Rule] = []
        self.attempts: Counter = Counter()
        self.injected: Counter = Counter()
        self._lock = threading.Lock()
        client.meta.events.register(f"before-send.{service}", self._before_send)

    def add(self, operation: str, *errors: tuple[int, str], times: float = float("inf"),
            when: Callable[[dict], bool] = lambda params: True) -> Rule:
        rule = Rule(operation, list(errors), times, when)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def _before_send(self, request, event_name: str, **_kwargs):
        operation = event_name.rsplit(".", 1)[-1]
        params = _request_params(request)
        with self._lock:
            self.attempts[operation] += 1
            for rule in self.rules:
                if rule.operation == operation and rule.fired < rule.times and rule.when(params):
                    status, code = rule.errors[rule.fired % len(rule.errors)]
                    rule.fired += 1
                    self.injected[operation] += 1
                    return error_response(request, status, code, self._service)
        return None


def _request_params(request) -> dict:
    """The request's JSON parameters (SQS), its URL (S3), and which attempt of its call this is."""
    params: dict = {"url": request.url}
    body = request.body
    if isinstance(body, bytes) and body.startswith(b"{"):
        try:
            params.update(json.loads(body))
        except ValueError:
            pass
    # botocore's standard retry mode numbers every attempt of one call in this header.
    header = request.headers.get("amz-sdk-request", b"")
    header = header.decode() if isinstance(header, bytes) else header
    attempt = header.partition("attempt=")[2].partition(";")[0]
    params["attempt"] = int(attempt) if attempt.isdigit() else 1
    return params


def first_attempt(params: dict) -> bool:
    return params["attempt"] == 1


class Train:
    """The pipeline's stand-in: works ``work_s`` (stoppable), then writes the five artifacts."""

    def __init__(self, work_s: float = 0.0):
        self.work_s = work_s
        self.runs = 0
        self.stopped: list[str | None] = []
        self.on_start: Callable[[], None] = lambda: None

    def __call__(self, job, work_dir: Path, stop, progress, ledger=None):
        self.runs += 1
        self.on_start()
        progress("train", 0.0)
        if stop.wait(self.work_s):
            self.stopped.append(stop.reason)
            stop.raise_if_set()
        paths = {}
        for name, rel in ARTIFACTS.items():
            path = work_dir / "output" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f"{name} of {job.job_id}\n".encode() * 64)
            paths[name] = path
        progress("train", 100.0)
        return paths


@dataclass
class Rig:
    root: Path
    settings: Settings
    queues: Queues
    sqs: object
    s3: object
    bucket: str
    store: FlakyStore
    train: Train
    sqs_faults: BotoFaults
    s3_faults: BotoFaults

    def handler(self, store=None, worker_id: str = "rig-worker") -> VoiceJobHandler:
        return VoiceJobHandler(HandlerConfig(work_root=self.root / "work", s3_prefix="models", worker_id=worker_id,
                                             lease_s=self.settings.sqs_visibility_timeout_s,
                                             policy=self.settings.input_policy()),
                               store=store or self.store, uploader=ArtifactUploader(self.s3, self.bucket),
                               train=self.train)

    def worker(self, handler=None, store=None, worker_id: str = "rig-worker") -> Worker:
        return Worker(self.settings.loop_config(), Queue(self.sqs, self.queues.url),
                      handler or self.handler(store, worker_id))

    def submit(self, directory: str = "voice-1") -> tuple[str, str, str]:
        job_id, profile_id = new_object_id(), new_object_id()
        self.store.wrapped.submit({"_id": job_id, "profileId": profile_id, "environment": ENVIRONMENT},
                                 {"_id": profile_id})
        body = json.dumps({
            "_doc": {"_id": job_id}, "jobId": job_id, "profileId": profile_id, "environment": ENVIRONMENT,
            "metadata": {"directoryName": directory},
            "input": [{"recordingUrl": f"s3://recordings-bucket/recordings/{profile_id}/clip.wav",
                       "originalText": "Hello."}],
        })
        self.queues.send(body)
        return job_id, profile_id, body

    def job(self, job_id: str) -> dict:
        return self.store.wrapped.get_job(job_id)

    def profile(self, profile_id: str) -> dict:
        return self.store.wrapped.get_profile(profile_id)

    def counts(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return self.queues.counts(), self.queues.counts(self.queues.dlq_url)

    def versions(self) -> Counter:
        listed = self.s3.list_object_versions(Bucket=self.bucket).get("Versions", [])
        return Counter(v["Key"] for v in listed)

    def completed_once(self, job_id: str, profile_id: str) -> bool:
        job, profile = self.job(job_id), self.profile(profile_id)
        done = [h for h in job["history"] if h["outcome"] == "completed"]
        return (job["status"] == "completed" and len(done) == 1 and profile["status"] == "completed"
                and len(profile["s3Paths"]) == len(ARTIFACT_KEYS) and len(profile["modelPaths"]) == len(ARTIFACT_KEYS)
                and sorted(self.versions().values()) == [1] * len(ARTIFACT_KEYS))


def make_rig(root: Path, endpoint: str, **env: str) -> Rig:
    """A fresh queue pair, versioned bucket and SQLite file on the moto server at ``endpoint``."""
    suffix = new_object_id()[:12]
    settings = load_settings({**RIG_ENV, "S3_BUCKET": f"models-{suffix}", "WORK_ROOT": str(root / "work"),
                              "STORE_URL": f"sqlite:///{root / 'records.db'}", "AWS_ENDPOINT_URL": endpoint,
                              **env})
    session = boto3.session.Session(region_name="us-east-1")
    sqs = make_client("sqs", settings.aws_config(), session)
    s3 = make_client("s3", settings.aws_config(), session)
    queues = create_queues(sqs, name=f"faults-{suffix}")
    settings = settings.model_copy(update={"sqs_queue_url": queues.url})
    s3.create_bucket(Bucket=settings.s3_bucket)
    s3.put_bucket_versioning(Bucket=settings.s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    store = FlakyStore(SqliteStore(str(root / "records.db")))
    return Rig(root=root, settings=settings, queues=queues, sqs=sqs, s3=s3, bucket=settings.s3_bucket,
               store=store, train=Train(), sqs_faults=BotoFaults(sqs, "sqs"), s3_faults=BotoFaults(s3, "s3"))
