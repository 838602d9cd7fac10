"""Injected faults: each ends in the outcome DESIGN.md names, the message neither lost nor deleted early.

The worker is the real one (loop, heartbeat, VoiceJobHandler, SQLite store, boto3 clients with the
project's retry config) in this process, against the moto server; see ``rig.py`` for where the faults
go in.
"""

from __future__ import annotations

import threading
import time

import pytest
import structlog
from pymongo.errors import ServerSelectionTimeoutError
from structlog.testing import capture_logs

from tests.reliability.rig import (
    ATTEMPTS_PER_CALL,
    INTERNAL,
    RECEIPT_INVALID,
    THROTTLING,
    UNAVAILABLE,
    VISIBILITY_S,
    Rig,
    fast_botocore_backoff,
    first_attempt,
    make_rig,
)
from tests.reliability.stack import REPO
from worker.core.daemon import EXIT_CRASHED
from worker.ops import cli
from worker.voice.records import mongo as store_mongo

SQS_OPERATIONS = ("ReceiveMessage", "ChangeMessageVisibility", "DeleteMessage", "GetQueueAttributes",
                  "GetQueueUrl", "SendMessage")
ATTEMPT_WRITES = {"claim", "set_progress"}  # all an attempt may write before it commits or fails


pytestmark = pytest.mark.server


@pytest.fixture
def rig(moto_server, tmp_path, monkeypatch):
    fast_botocore_backoff(monkeypatch)
    rig = make_rig(tmp_path, moto_server)
    yield rig
    rig.store.close()


def heartbeat(params: dict) -> bool:
    return params.get("VisibilityTimeout") == VISIBILITY_S


class VisibilityWatch:
    """Samples the queue while a job runs: a message that turns visible mid-job is one a second worker could take."""

    def __init__(self, rig: Rig, interval_s: float = 0.1):
        self._rig, self._interval_s = rig, interval_s
        self._done = threading.Event()
        self.max_visible = 0
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(self._interval_s):
            self.max_visible = max(self.max_visible, self._rig.queues.counts()[0])

    def __enter__(self) -> VisibilityWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._done.set()
        self._thread.join()


def run_until_settled(rig: Rig, worker, job_id: str, timeout_s: float = 15) -> list[str]:
    """run_once until the job is completed and the queue empty; fails at once if the message vanished first."""
    actions, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        actions.append(worker.run_once())
        (visible, in_flight), dlq = rig.counts()
        status = rig.job(job_id)["status"]
        if visible + in_flight == 0:
            assert status == "completed" and dlq == (0, 0), f"message gone, job {status}, actions {actions}"
            return actions
    raise AssertionError(f"job not settled in {timeout_s} s: actions {actions}, job {rig.job(job_id)}")


def test_throttling_and_5xx_on_every_sqs_call_are_absorbed(rig):
    """Throttling, 500 and 503 on the first attempt of every SQS call: the job completes once and a bad body still reaches the DLQ."""
    for operation in SQS_OPERATIONS:
        rig.sqs_faults.add(operation, THROTTLING, INTERNAL, UNAVAILABLE, when=first_attempt)
    rig.train.work_s = 0.8  # long enough for heartbeats
    job_id, profile_id, _ = rig.submit()
    worker = rig.worker()
    assert run_until_settled(rig, worker, job_id)[-1] == "ack"
    assert rig.completed_once(job_id, profile_id)

    rig.queues.send('{"jobId": 7}')
    assert worker.run_once() == "dead_letter"
    [dead] = rig.queues.receive_now(rig.queues.dlq_url)
    assert dead["MessageAttributes"]["ErrorType"]["StringValue"] == "InvalidMessage"
    assert rig.queues.counts() == (0, 0)
    assert {op for op in SQS_OPERATIONS if rig.sqs_faults.injected[op] == 0} == set()


def test_receive_failing_past_the_retry_budget_leaves_the_message(rig):
    """ReceiveMessage failing on all five attempts: the loop carries on and the message stays untouched."""
    rig.sqs_faults.add("ReceiveMessage", UNAVAILABLE, times=ATTEMPTS_PER_CALL)
    rig.submit()
    assert rig.worker().run_once() is None
    assert rig.sqs_faults.injected["ReceiveMessage"] == ATTEMPTS_PER_CALL
    assert rig.counts() == ((1, 0), (0, 0))


def test_delete_failing_after_commit_is_retried_by_the_redelivery_without_work(rig):
    """A delete that fails after the commit leaves the job completed; the redelivery does no work and deletes."""
    rig.sqs_faults.add("DeleteMessage", UNAVAILABLE, times=ATTEMPTS_PER_CALL)
    job_id, profile_id, _ = rig.submit()
    worker = rig.worker()
    assert worker.run_once() == "ack"
    assert rig.sqs_faults.injected["DeleteMessage"] == ATTEMPTS_PER_CALL
    assert rig.completed_once(job_id, profile_id)
    assert rig.counts() == ((0, 1), (0, 0)), "the message must still be there after the failed delete"
    writes_before, runs_before = len(rig.store.writes()), rig.train.runs

    assert run_until_settled(rig, worker, job_id)[-1] == "ack"
    assert rig.store.writes()[writes_before:] == [] and rig.train.runs == runs_before
    assert rig.completed_once(job_id, profile_id)


def test_s3_upload_failure_commits_nothing_and_the_retry_reuses_what_was_stored(rig):
    """PutObject failing for the third artifact: nothing is committed, the message waits its backoff, the retry uploads only the rest."""
    rig.s3_faults.add("PutObject", UNAVAILABLE, when=lambda p: p["url"].endswith("/full/speakers.pth"))
    job_id, profile_id, _ = rig.submit()
    worker = rig.worker()
    assert worker.run_once() == "retry"
    job, profile = rig.job(job_id), rig.profile(profile_id)
    assert job["status"] == "error" and job["error"]["type"] == "StorageError" and job["error"]["retryable"]
    assert profile["status"] != "completed" and not profile["s3Paths"]
    assert len(rig.versions()) == 2 and rig.counts() == ((0, 1), (0, 0))
    assert "write_paths" not in rig.store.writes()

    rig.s3_faults.clear()
    assert run_until_settled(rig, worker, job_id)[-1] == "ack"
    assert rig.completed_once(job_id, profile_id)  # includes: every object has exactly one version


def test_transient_s3_5xx_is_absorbed(rig):
    """A 503 on the first attempt of every S3 upload and head is retried by botocore; the job completes once."""
    for operation in ("PutObject", "HeadObject"):
        rig.s3_faults.add(operation, UNAVAILABLE, INTERNAL, when=first_attempt)
    job_id, profile_id, _ = rig.submit()
    assert run_until_settled(rig, rig.worker(), job_id)[-1] == "ack"
    assert rig.completed_once(job_id, profile_id)
    assert rig.s3_faults.injected["PutObject"] == 5


def test_store_down_mid_job_past_the_record_lease_stops_without_commit(rig):
    """The store down from the start of training until the record lease lapses: the attempt stops (another worker could claim the job), nothing commits, the message stays, the retry completes."""
    rig.train.work_s = VISIBILITY_S + 0.5
    rig.train.on_start = rig.store.down.set
    job_id, profile_id, _ = rig.submit()
    worker = rig.worker()
    with capture_logs() as logs, VisibilityWatch(rig) as watch:
        assert worker.run_once() == "abandon"
    assert watch.max_visible == 0, "the message turned visible while the job ran"
    assert rig.store.refused["renew_lease"] >= 1 and rig.store.refused["write_paths"] == 0
    assert any(e["event"] == "heartbeat.lease_lost" and "record lease" in e["reason"] for e in logs)
    assert rig.train.stopped == ["lease_lost"]
    assert rig.counts() == ((0, 1), (0, 0))
    assert rig.profile(profile_id)["status"] != "completed" and rig.job(job_id)["status"] == "processing"

    rig.store.down.clear()
    rig.train.on_start = lambda: None
    assert run_until_settled(rig, worker, job_id)[-1] == "ack"
    assert rig.completed_once(job_id, profile_id)


class UnreachableMongo:
    """A pymongo client whose server never answers."""

    pings = 0

    def __init__(self, *_args, **_kwargs):
        self.admin = self

    def command(self, name: str):
        UnreachableMongo.pings += 1
        raise ServerSelectionTimeoutError("injected: no primary available")

    def close(self) -> None:
        pass


def test_store_unreachable_past_the_connect_budget_stops_the_worker_before_any_receive(rig, monkeypatch):
    """MongoDB silent for every attempt of the connect budget: `run` exits 1 and the queued message is never received."""
    rig.submit()
    monkeypatch.setattr(store_mongo.pymongo, "MongoClient", UnreachableMongo)
    env = {"SQS_QUEUE_URL": rig.queues.url, "AWS_ENDPOINT_URL": rig.settings.aws_endpoint_url,
           "AWS_REGION": "us-east-1", "MONGO_URI": "mongodb://db.invalid:27017/voice", "S3_BUCKET": rig.bucket,
           "MONGO_CONNECT_MAX_ATTEMPTS": "3", "MONGO_CONNECT_RETRY_DELAY_MS": "10",
           "PIPELINE_CONFIG": str(REPO / "config" / "pipeline.toml"), "WORK_ROOT": str(rig.root / "work")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    UnreachableMongo.pings = 0
    try:
        assert cli.main(["run"]) == EXIT_CRASHED
    finally:
        structlog.reset_defaults()
    assert UnreachableMongo.pings == 3
    [message] = rig.queues.receive_now()
    assert message["Attributes"]["ApproximateReceiveCount"] == "1", "the worker must not have taken the message"


def test_heartbeat_failing_for_one_tick_is_retried_on_the_next(rig):
    """One renewal failing after all botocore retries is logged and retried on the next tick; the job completes."""
    rig.sqs_faults.add("ChangeMessageVisibility", UNAVAILABLE, times=ATTEMPTS_PER_CALL, when=heartbeat)
    rig.train.work_s = VISIBILITY_S + 0.5  # outlasts the visibility: only the later renewals keep it hidden
    job_id, profile_id, _ = rig.submit()
    with capture_logs() as logs, VisibilityWatch(rig) as watch:
        assert rig.worker().run_once() == "ack"
    assert watch.max_visible == 0, "the message turned visible while the job ran"
    events = [e["event"] for e in logs]
    assert events.count("heartbeat.renewal_failed") == 1 and "heartbeat.lease_lost" not in events
    assert rig.completed_once(job_id, profile_id) and rig.counts() == ((0, 0), (0, 0))


def assert_abandoned_cleanly(rig: Rig, job_id: str, profile_id: str) -> None:
    """The attempt stopped its work, committed and deleted nothing, and only cleared its own record lease."""
    assert rig.train.stopped == ["lease_lost"]
    # release_lease is fenced on the attempt's token: it lets the next delivery claim at once.
    assert set(rig.store.writes()) <= ATTEMPT_WRITES | {"renew_lease", "release_lease"}
    assert rig.sqs_faults.attempts["DeleteMessage"] == 0
    assert rig.job(job_id)["status"] == "processing" and rig.profile(profile_id)["status"] != "completed"
    (visible, in_flight), dlq = rig.counts()
    assert visible + in_flight == 1 and dlq == (0, 0), "the message must stay on the queue for SQS to return"


def test_heartbeat_failing_past_the_visibility_timeout_loses_the_lease_and_the_job_still_completes(rig):
    """No renewal for longer than the visibility timeout: the trainer stops, nothing is committed or deleted, and the next delivery completes the job."""
    rig.sqs_faults.add("ChangeMessageVisibility", UNAVAILABLE, when=heartbeat)
    # A slow store read before the claim: the record's lease then outlives the message's visibility.
    rig.store.slow["get_profile"] = 0.25
    rig.train.work_s = 10
    job_id, profile_id, _ = rig.submit()
    assert rig.worker(worker_id="first").run_once() == "abandon"
    assert_abandoned_cleanly(rig, job_id, profile_id)

    rig.sqs_faults.clear()
    rig.store.slow.clear()
    rig.train.work_s = 0
    assert run_until_settled(rig, rig.worker(worker_id="second"), job_id)[-1] == "ack"
    assert rig.completed_once(job_id, profile_id)


def test_receipt_handle_rejected_mid_job_stops_the_attempt_and_the_job_still_completes(rig):
    """ReceiptHandleIsInvalid on a renewal mid-job: the trainer stops, nothing is committed or deleted, the next delivery completes."""
    renewals = []

    def second_renewal_on(params: dict) -> bool:
        renewals.append(params["attempt"]) if heartbeat(params) else None
        return heartbeat(params) and len(renewals) >= 2

    rig.sqs_faults.add("ChangeMessageVisibility", RECEIPT_INVALID, when=second_renewal_on)
    rig.train.work_s = 10
    job_id, profile_id, _ = rig.submit()
    assert rig.worker(worker_id="first").run_once() == "abandon"
    assert rig.sqs_faults.injected["ChangeMessageVisibility"] == 1, "a rejected handle is not retried"
    assert_abandoned_cleanly(rig, job_id, profile_id)

    rig.sqs_faults.clear()
    rig.train.work_s = 0
    assert run_until_settled(rig, rig.worker(worker_id="second"), job_id)[-1] == "ack"
    assert rig.completed_once(job_id, profile_id)
