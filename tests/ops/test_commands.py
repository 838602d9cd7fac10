"""The operator's commands against the SQLite store and moto: submit, status, cancel, doctor, health."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from datetime import UTC, datetime, timedelta

import boto3
import pytest

from pipeline.config import load_pipeline_config
from tests.support import create_queues
from worker.ops.commands import cmd_cancel, cmd_health, cmd_status, cmd_submit
from worker.ops.doctor import report, run_checks
from worker.settings import load_settings
from worker.voice.records import open_store
from worker.voice.records.rules import COMMITTING
from worker.voice.records.sqlite import SqliteStore

PAYLOAD = {
    "profileId": "665f1c2e9b1e8a0012ab34ce",
    "environment": "staging",
    "metadata": {"directoryName": "user-1-voice-1", "language": "en"},
    "input": [{"recordingUrl": "s3://recordings/a.wav", "originalText": "Hello."}],
}


@pytest.fixture
def store(tmp_path):
    s = SqliteStore(str(tmp_path / "records.db"))
    yield s
    s.close()


def submit(store, queues, payload, as_json=True):
    out, err = io.StringIO(), io.StringIO()
    code = cmd_submit(lambda: contextlib.nullcontext(store), queues.sqs, queues.url,
                      io.StringIO(json.dumps(payload)), as_json=as_json, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_submit_creates_records_and_enqueues_a_valid_message(store, queues):
    """Submit generates jobId and _doc, creates pending records and sends a body the worker accepts."""
    code, out, _ = submit(store, queues, PAYLOAD)
    assert code == 0
    job_id = json.loads(out)["jobId"]
    assert len(job_id) == 24
    assert store.get_job(job_id)["status"] == "pending"
    assert store.get_profile(PAYLOAD["profileId"])["status"] == "pending"
    [msg] = queues.receive_now()
    body = json.loads(msg["Body"])
    assert body["jobId"] == job_id and body["_doc"] == {"_id": job_id}
    assert "idempotencyKey" not in body


def test_submit_with_the_same_idempotency_key_enqueues_once(store, queues):
    """A repeated submit with the same key returns the same job id, says it created nothing, and sends nothing new."""
    first = submit(store, queues, {**PAYLOAD, "idempotencyKey": "order-42"})
    second = submit(store, queues, {**PAYLOAD, "idempotencyKey": "order-42"})
    assert first[0] == second[0] == 0
    assert json.loads(first[1])["jobId"] == json.loads(second[1])["jobId"]
    assert (json.loads(first[1])["created"], json.loads(second[1])["created"]) == (True, False)
    assert len(queues.receive_now()) == 1


def test_submit_rejects_an_invalid_job_with_its_problems(store, queues):
    """An invalid submission prints one line per problem, exits 2 and enqueues nothing."""
    code, _, err = submit(store, queues, {**PAYLOAD, "input": [], "environment": "prod"})
    assert code == 2
    assert "input" in err and "environment" in err
    assert queues.receive_now() == []


def test_status_json_has_the_record_fields(store, queues):
    """status --json prints one object with the job and profile records of the design."""
    _, out, _ = submit(store, queues, PAYLOAD)
    job_id = json.loads(out)["jobId"]
    buf = io.StringIO()
    assert cmd_status(store, job_id, as_json=True, out=buf) == 0
    doc = json.loads(buf.getvalue())
    for field in ("status", "attempts", "lease", "progress", "heartbeatAt", "error", "history",
                  "cancelRequested", "startedAt", "completedAt", "idempotencyKey"):
        assert field in doc["job"]
    for field in ("status", "modelPaths", "s3Paths"):
        assert field in doc["profile"]


def test_status_human_output_and_missing_job(store, queues):
    """status prints a readable summary, and exits 3 for an unknown job."""
    _, out, _ = submit(store, queues, PAYLOAD)
    job_id = json.loads(out)["jobId"]
    store.claim(job_id, owner="w1", token="t", lease_s=60)
    store.set_progress(job_id, "t", "train_full", 42.0)
    buf = io.StringIO()
    cmd_status(store, job_id, as_json=False, out=buf)
    assert f"job {job_id}: processing" in buf.getvalue() and "train_full 42 %" in buf.getvalue()
    assert cmd_status(store, "0" * 24, as_json=False, out=io.StringIO(), err=io.StringIO()) == 3


def test_status_watch_repeats_until_the_job_ends(store, queues):
    """status --watch prints again until the job reaches a final state."""
    _, out, _ = submit(store, queues, PAYLOAD)
    job_id = json.loads(out)["jobId"]
    store.claim(job_id, owner="w1", token="t", lease_s=60)
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        if len(sleeps) == 2:
            store.mark_cancelled(job_id, "t")

    buf = io.StringIO()
    assert cmd_status(store, job_id, as_json=True, watch_s=1.0, out=buf, sleep=sleep) == 0
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [line["job"]["status"] for line in lines] == ["processing", "processing", "cancelled"]


def test_cancel_marks_the_request_and_refuses_finished_jobs(store, queues):
    """cancel sets cancelRequested; a cancelled or completed job cannot be cancelled again."""
    _, out, _ = submit(store, queues, PAYLOAD)
    job_id = json.loads(out)["jobId"]
    assert cmd_cancel(store, job_id, heartbeat_s=60, out=io.StringIO()) == 0
    assert store.get_job(job_id)["cancelRequested"] is True
    store.claim(job_id, owner="w", token="t", lease_s=60)
    store.mark_cancelled(job_id, "t")
    assert cmd_cancel(store, job_id, heartbeat_s=60, out=io.StringIO(), err=io.StringIO()) == 4
    assert cmd_cancel(store, "0" * 24, heartbeat_s=60, out=io.StringIO(), err=io.StringIO()) == 3


def doctor(tmp_path, queue_url, bucket="voice-models"):
    settings = load_settings({
        "SQS_QUEUE_URL": queue_url, "S3_BUCKET": bucket, "STORE_URL": f"sqlite:///{tmp_path}/doctor.db",
        "AWS_REGION": "us-east-1",
    })
    checks = run_checks(settings, sqs=boto3.client("sqs", region_name="us-east-1"),
                        s3=boto3.client("s3", region_name="us-east-1"),
                        sts=boto3.client("sts", region_name="us-east-1"),
                        open_store=lambda s: open_store(s.store_config()),
                        load_pipeline=load_pipeline_config)
    out = io.StringIO()
    return report(checks, out=out), out.getvalue()


def good_deployment(sqs, name: str):
    """Queues doctor passes (a longer-lived DLQ, a 300 s visibility, a redrive after 20 receives) and the bucket."""
    q = create_queues(sqs, name=name)
    sqs.set_queue_attributes(QueueUrl=q.dlq_url, Attributes={"MessageRetentionPeriod": "1209600"})
    sqs.set_queue_attributes(QueueUrl=q.url, Attributes={"VisibilityTimeout": "300",
                                                         "RedrivePolicy": redrive_policy(sqs, q, 20)})
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="voice-models")
    return q


def test_doctor_passes_on_a_good_deployment(sqs, tmp_path):
    """doctor passes every check on a queue with a redrive policy, a longer-lived DLQ and a writable bucket."""
    q = good_deployment(sqs, "good")
    code, out = doctor(tmp_path, q.url)
    assert code == 0, out
    assert "FAIL" not in out and "PASS  redrive policy" in out and "PASS  bucket writable" in out
    assert "PASS  retry backstop" in out
    assert "PASS  job code loads" in out


def redrive_policy(sqs, q, max_receives: int) -> str:
    policy = json.loads(sqs.get_queue_attributes(QueueUrl=q.url, AttributeNames=["RedrivePolicy"])
                        ["Attributes"]["RedrivePolicy"])
    return json.dumps({**policy, "maxReceiveCount": str(max_receives)})


def test_doctor_warns_when_the_queue_would_dead_letter_before_the_worker_does(sqs, tmp_path):
    """A maxReceiveCount at or below MAX_FAILED_ATTEMPTS is a WARN: interruptions would spend retries."""
    q = create_queues(sqs, name="tight")
    sqs.set_queue_attributes(QueueUrl=q.url, Attributes={"RedrivePolicy": redrive_policy(sqs, q, 5)})
    _code, out = doctor(tmp_path, q.url)
    assert "WARN  retry backstop: maxReceiveCount=5, the worker's retry budget 5" in out


def test_doctor_fails_by_name_without_a_redrive_policy(sqs, tmp_path):
    """doctor names the missing redrive policy (and the missing bucket) and exits 1."""
    q = create_queues(sqs, name="bare", with_dlq=False)
    code, out = doctor(tmp_path, q.url, bucket="no-such-bucket")
    assert code == 1
    assert "FAIL  redrive policy: the queue has no RedrivePolicy" in out
    assert "FAIL  bucket writable" in out


def test_doctor_fails_when_the_dlq_forgets_sooner(sqs, tmp_path):
    """doctor fails a DLQ whose retention is not longer than the source queue's."""
    q = create_queues(sqs, name="short")
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="voice-models")
    code, out = doctor(tmp_path, q.url)
    assert code == 1 and "FAIL  dead-letter retention" in out


def test_doctor_fails_when_the_job_code_does_not_import():
    """The daemon loads the job's code at its first message, so doctor imports it and names a broken module."""
    from worker.ops.doctor import job_code_check

    assert job_code_check().ok
    broken = job_code_check(("worker.voice.job", "pipeline.no_such_module"))
    assert not broken.ok and broken.detail.startswith("pipeline.no_such_module: ModuleNotFoundError")


def test_doctor_warns_without_metrics_dimensions_and_still_passes(sqs, tmp_path):
    """With METRICS_DIMENSIONS empty doctor prints a WARN naming the alarms' dimension set, and exits 0."""
    q = good_deployment(sqs, "dims")
    code, out = doctor(tmp_path, q.url)
    assert code == 0, out
    assert "WARN  metrics dimensions: METRICS_DIMENSIONS is empty" in out and "Environment=<...>,Queue=<...>" in out
    # The other WARN: the default config/pipeline.toml is the reference stand-in.
    assert "WARN  pipeline is real:" in out and out.rstrip().endswith("0 failed, 2 warned")


def test_metrics_dimensions_check_passes_only_the_alarms_dimension_set():
    """Environment and Queue pass; other names, none, or metrics off are warnings, never failures."""
    from worker.ops.doctor import metrics_dimensions_check

    good = metrics_dimensions_check(load_settings({"METRICS_DIMENSIONS": "Environment=production,Queue=jobs"}))
    assert good.ok and good.detail == "METRICS_DIMENSIONS=Environment=production,Queue=jobs"
    for env in ({"METRICS_DIMENSIONS": "Env=production"}, {}, {"METRICS_ENABLED": "false"}):
        check = metrics_dimensions_check(load_settings(env))
        assert not check.ok and check.warn_only, env


def test_a_warning_does_not_change_the_exit_code_but_a_failure_does():
    """report prints WARN for a warn-only finding and exits 0; one FAIL still makes it exit 1."""
    from worker.ops.doctor import Check

    warn, fail = Check("a", False, "x", warn_only=True), Check("b", False, "y")
    out = io.StringIO()
    assert report([Check("ok", True, "z"), warn], out=out) == 0
    assert "WARN  a: x" in out.getvalue() and "1 passed, 0 failed, 1 warned" in out.getvalue()
    out = io.StringIO()
    assert report([warn, fail], out=out) == 1
    assert "FAIL  b: y" in out.getvalue()


def test_health_follows_the_liveness_file(tmp_path):
    """health passes while the liveness file is fresh and fails when it is stale or missing."""
    path = tmp_path / "alive"
    environ = {"LIVENESS_FILE": str(path), "LIVENESS_MAX_AGE_SECONDS": "30"}
    assert cmd_health(out=io.StringIO(), environ=environ) == 1
    path.touch()
    assert cmd_health(out=io.StringIO(), environ=environ) == 0
    old = time.time() - 60
    os.utime(path, (old, old))
    assert cmd_health(out=io.StringIO(), environ=environ) == 1


def test_status_watch_goes_on_through_a_retryable_error(store, queues):
    """status --watch keeps watching a job whose error will be retried, and stops at a permanent one."""
    _, out, _ = submit(store, queues, PAYLOAD)
    job_id = json.loads(out)["jobId"]
    store.claim(job_id, owner="w1", token="t", lease_s=60)
    store.record_error(job_id, token="t", error_type="StoreError", message="down", retryable=True)
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        store.claim(job_id, owner="w1", token="t2", lease_s=60)
        store.record_error(job_id, token="t2", error_type="BadRecording", message="not audio", retryable=False)

    buf = io.StringIO()
    assert cmd_status(store, job_id, as_json=True, watch_s=1.0, out=buf, sleep=sleep) == 0
    assert len(sleeps) == 1 and len(buf.getvalue().splitlines()) == 2


def test_operator_command_failures_are_one_line_not_a_traceback(tmp_path):
    """A command that cannot read its input prints one line and exits 1."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQS_", "STORE_", "MONGO_"))}
    env.update({"SQS_QUEUE_URL": "http://127.0.0.1:9/000000000000/q", "STORE_URL": f"sqlite:///{tmp_path}/r.db"})
    proc = subprocess.run([sys.executable, "-m", "worker", "submit", str(tmp_path / "missing.json")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("submit failed:")


def cancel(store, job_id, heartbeat_s=60.0):
    out, err = io.StringIO(), io.StringIO()
    code = cmd_cancel(store, job_id, heartbeat_s=heartbeat_s, out=out, err=err)
    return code, out.getvalue().strip(), err.getvalue().strip()


@pytest.fixture
def job_id(store, queues):
    _, out, _ = submit(store, queues, PAYLOAD)
    return json.loads(out)["jobId"]


def test_cancel_of_a_running_job_says_who_stops_and_when(store, job_id):
    """A job with a live lease: the answer names the worker and the heartbeat interval it stops within."""
    store.claim(job_id, owner="gpu-3:412", token="t", lease_s=60)
    code, out, _ = cancel(store, job_id, heartbeat_s=15.0)
    assert code == 0
    assert out == (f"cancel requested for job {job_id}: the running attempt on gpu-3:412 stops at its next "
                   "heartbeat, within ~15 s (SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS), and the job ends cancelled")


def test_cancel_judges_the_running_lease_on_the_stores_clock(store, job_id, monkeypatch):
    """An operator host whose clock runs 300 s ahead still sees the 60 s lease as live: it is the store's clock that counts."""
    from datetime import datetime, timedelta

    from worker.voice.records import rules

    store.claim(job_id, owner="gpu-3:412", token="t", lease_s=60)
    monkeypatch.setattr(rules, "utc_now", lambda: datetime.now(UTC) + timedelta(seconds=300))
    code, out, _ = cancel(store, job_id, heartbeat_s=15.0)
    assert code == 0 and "the running attempt on gpu-3:412 stops at its next heartbeat" in out


def test_cancel_of_a_pending_job_says_no_training_starts(store, job_id):
    """A pending job: cancelled when a worker picks it up, before any training."""
    code, out, _ = cancel(store, job_id)
    assert code == 0 and store.get_job(job_id)["cancelRequested"] is True
    assert out == (f"job {job_id} is pending: it will be cancelled when a worker picks it up "
                   "(no training will start)")


def test_cancel_of_a_job_waiting_for_a_retry_stops_the_retry(store, job_id):
    """A job whose last attempt failed retryably is cancelled at its next delivery."""
    store.claim(job_id, owner="w1", token="t", lease_s=60)
    store.record_error(job_id, token="t", error_type="StoreError", message="down", retryable=True)
    code, out, _ = cancel(store, job_id)
    assert code == 0 and "has no running attempt (error, waiting to be retried)" in out
    assert store.get_job(job_id)["cancelRequested"] is True


@pytest.mark.parametrize("end", ["completed", "cancelled", "failed"])
def test_cancel_of_a_finished_job_has_nothing_to_do_and_exits_4(store, job_id, end):
    """Completed, cancelled and permanently failed jobs: "nothing to cancel", exit 4, the record untouched."""
    store.claim(job_id, owner="w1", token="t", lease_s=60)
    if end == "completed":
        store.mark_job_completed(job_id, "t")
    elif end == "cancelled":
        store.mark_cancelled(job_id, "t")
    else:
        store.record_error(job_id, token="t", error_type="BadRecording", message="not audio", retryable=False)
    code, out, err = cancel(store, job_id)
    assert (code, out) == (4, "") and "nothing to cancel" in err
    assert store.get_job(job_id)["cancelRequested"] is False


def test_cli_cancel_uses_the_configured_heartbeat_interval(tmp_path, monkeypatch, capsys):
    """`python -m worker cancel` reads SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS for its "within ~N s"."""
    from worker.ops import cli

    db = tmp_path / "records.db"
    with SqliteStore(str(db)) as s:
        s.submit({"_id": "a" * 24}, {"_id": "b" * 24})
        s.claim("a" * 24, owner="w1", token="t", lease_s=600)
    monkeypatch.setenv("STORE_URL", f"sqlite:///{db}")
    monkeypatch.setenv("SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS", "12500")
    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)
    assert cli.main(["cancel", "a" * 24]) == 0
    assert "within ~13 s" in capsys.readouterr().out


def test_the_submit_command_refuses_what_the_worker_would_refuse(queues, tmp_path, monkeypatch, capsys):
    """`python -m worker submit` applies the worker's input policy from the settings before any record exists."""
    from worker.ops import cli

    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)
    db = tmp_path / "records.db"
    for name, value in {"SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{db}",
                        "RECORDINGS_S3_BUCKET": "voice-recordings", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    job = tmp_path / "job.json"
    own = "s3://voice-recordings/recordings/665f1c2e9b1e8a0012ab34ce/a.wav"
    for url, expected in (("s3://recordings/a.wav", 2),
                          ("s3://voice-recordings/recordings/665f1c2e9b1e8a0012ab34cf/a.wav", 2),
                          (own, 0)):
        job.write_text(json.dumps({**PAYLOAD, "input": [{"recordingUrl": url, "originalText": "Hello."}]}))
        assert cli.main(["submit", str(job), "--json"]) == expected, url
        assert db.exists() == (expected == 0), "a refused submission created the store file"
    out, err = capsys.readouterr()
    assert "RECORDINGS_S3_BUCKET" in err and "RECORDINGS_S3_KEY_PREFIX" in err
    [message] = queues.receive_now()
    assert own in message["Body"]
    with SqliteStore(str(db)) as store:
        assert store.get_job(json.loads(out)["jobId"])["status"] == "pending"


def test_cancel_of_a_committing_job_is_too_late_and_exits_5(store, job_id):
    """A live attempt whose progress says committing: "too late", exit 5, and no cancel is requested."""
    store.claim(job_id, owner="gpu-3:412", token="t", lease_s=60)
    store.set_progress(job_id, "t", COMMITTING, 100)
    code, out, err = cancel(store, job_id)
    assert (code, out) == (5, "") and "too late to cancel" in err and "gpu-3:412" in err
    assert store.get_job(job_id)["cancelRequested"] is False


def test_a_commit_that_began_after_cancels_read_is_refused_by_the_store(store, job_id):
    """The store itself refuses the request once committing began, so a stale read cannot accept a cancel."""
    store.claim(job_id, owner="w1", token="t", lease_s=60)
    before = store.get_job(job_id)
    store.set_progress(job_id, "t", COMMITTING, 100)

    class StaleFirstRead:
        reads = 0

        def get_job(self, wanted):
            self.reads += 1
            return before if self.reads == 1 else store.get_job(wanted)

        def request_cancel(self, wanted):
            return store.request_cancel(wanted)

        def now(self):
            return store.now()

    code, _, err = cancel(StaleFirstRead(), job_id)
    assert code == 5 and "too late" in err
    assert store.get_job(job_id)["cancelRequested"] is False


def test_a_committing_stage_left_by_an_earlier_attempt_does_not_block_a_cancel(tmp_path, queues):
    """Only the running attempt's own committing stage counts: after a re-claim the cancel is requested."""
    start = datetime.now(UTC)
    moments = iter(start + timedelta(seconds=s) for s in range(100))
    store = SqliteStore(str(tmp_path / "clocked.db"), clock=lambda: next(moments))
    job_id = json.loads(submit(store, queues, PAYLOAD)[1])["jobId"]
    store.claim(job_id, owner="w1", token="t1", lease_s=600)
    store.set_progress(job_id, "t1", COMMITTING, 100)
    assert store.release_lease(job_id, "t1")
    store.claim(job_id, owner="w2", token="t2", lease_s=600)
    code, out, _ = cancel(store, job_id)
    assert code == 0 and "stops at its next heartbeat" in out
    assert store.get_job(job_id)["cancelRequested"] is True
    store.close()


def test_status_shows_record_strings_without_control_sequences_or_forged_lines(store, job_id):
    """An error text holding escapes and a forged line prints clean, its extra lines indented under the error."""
    forged = f"job {job_id}: completed"
    store.claim(job_id, owner="w1\x1b]0;owned\x07", token="t", lease_s=60)
    assert store.release_lease(job_id, "t")
    # The reconciler copies a DLQ message's ErrorMessage attribute, which anyone who can send set.
    store.record_dead_letter(job_id, dead_letter={
        "messageId": "dlq-1", "receiveCount": 5, "errorType": "Stage\x1b[2JFailed",
        "errorMessage": f"real failure\r{forged}\n\x1b[2J\x9b1mtail line\x85"}, worker="reconciler")
    assert "\x1b" in store.get_job(job_id)["error"]["message"], "the record is meant to hold the raw text"
    out = io.StringIO()
    assert cmd_status(store, job_id, as_json=False, out=out) == 0
    text = out.getvalue()
    assert not any(ch in text for ch in "\x1b\x07\r\x9b\x85"), repr(text)
    assert forged in text and "tail line" in text and "StageFailed" in text
    assert not any(line.startswith(forged) for line in text.splitlines()), text
    assert all(line.startswith(("job ", "profile ", "  ")) for line in text.splitlines()), text


def test_dlq_list_prints_one_clean_block_per_message():
    """A DLQ message's attributes cannot clear the screen or add lines of their own to `dlq list`."""
    from worker.ops.commands import render_letter

    block = render_letter({"messageId": "m\x1b[2J", "jobId": "j", "receiveCount": 1, "ageSeconds": 60,
                           "errorType": "InvalidMessage", "errorMessage": "bad\r\njob j: completed\x1b]0;x\x07"})
    assert not any(ch in block for ch in "\x1b\x07\r")
    assert block.splitlines() == ["job j  receives 1  age 1m", "  message  m",
                                  "  error    InvalidMessage: bad job j: completed"]


def test_a_body_sent_again_without_a_key_says_its_message_went_out_again(store, queues):
    """Re-submitting a job's own body (no idempotency key) names the jobId, not a key it never had."""
    code, out, _ = submit(store, queues, PAYLOAD)
    job_id = json.loads(out)["jobId"]
    body = json.loads(queues.receive_now()[0]["Body"])
    code, out, _ = submit(store, queues, body, as_json=False)
    assert code == 0 and out == f"{job_id} (a job with this jobId exists: its message was sent again)\n"
    assert len(queues.receive_now()) == 1
