"""The reconciler against both stores and moto: each rule, its idempotence, and what it must never touch."""

from __future__ import annotations

import io
import json
import re
import time

import pytest

from pipeline.errors import BadRecording
from tests.deploy.files import REPO, read_unit, timespan_s
from tests.support import FaultyClient, client_error
from tests.voice.conftest import message_body
from tests.voice.records.conftest import WallClock, make_store
from worker.core.errors import QueueError
from worker.core.queue import Message, Queue
from worker.ops.reconcile import Reconciler, cmd_reconcile, message_body_for
from worker.settings import load_settings
from worker.voice.message import parse_job
from worker.voice.submit import submit as submit_job

LEASE_S = 300
STALE_S = 3600
PENDING_S = 600
WRITES = {"claim", "renew_lease", "set_progress", "record_error", "write_paths", "mark_profile_completed",
          "mark_job_completed", "mark_cancelled", "release_lease", "request_cancel", "submit",
          "mark_enqueued", "mark_worker_lost", "record_dead_letter"}
PAYLOAD = {
    "profileId": "665f1c2e9b1e8a0012ab34ce",
    "environment": "staging",
    "metadata": {"directoryName": "user-1-voice-1", "language": "en"},
    "input": [{"recordingUrl": "s3://recordings/a.wav", "originalText": "Hello."}],
}


class CountingStore:
    """Delegates to a real store and counts the calls that write."""

    def __init__(self, store):
        self._store = store
        self.writes: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name in WRITES:
            def write(*args, **kwargs):
                self.writes.append(name)
                return attr(*args, **kwargs)
            return write
        return attr


@pytest.fixture
def clock():
    return WallClock()


@pytest.fixture(params=["sqlite", "mongo"])
def store(request, tmp_path, clock):
    real = make_store(request.param, tmp_path, clock, request)
    yield CountingStore(real)
    real.close()


@pytest.fixture
def sqs_client(queues):
    return FaultyClient(queues.sqs)


@pytest.fixture
def reconciler(store, sqs_client, queues):
    # No clock given: the reconciler reads the store's (``clock`` above), as in production.
    return Reconciler(store, sqs_client, queues.url, stale_after_s=STALE_S, pending_after_s=PENDING_S,
                      dlq_hold_s=30, dlq_wait_s=0)


def new_job(store, n: int, **extra) -> str:
    job_id, profile_id = f"{n:024x}", f"{n + 1000:024x}"
    store.submit({"_id": job_id, "profileId": profile_id, "environment": "production", **extra},
                 {"_id": profile_id})
    store.mark_enqueued(job_id)  # its message went out: only the rules under test apply
    return job_id


def dead_letter(queues, job_id: str, receive_count: int = 3) -> str:
    """Dead-letters a message for ``job_id`` the way the worker does; returns the DLQ message id."""
    message = Message(message_id=f"src-{job_id}", receipt_handle="-", body=message_body(job_id),
                      receive_count=receive_count, received_at_s=time.monotonic())
    assert Queue(queues.sqs, queues.url).dead_letter(message, BadRecording("recording 0 is not audio"))
    received = queues.receive_now(queues.dlq_url)
    for m in received:  # looked at: visible again, as the reconciler must find them
        queues.sqs.change_message_visibility(QueueUrl=queues.dlq_url, ReceiptHandle=m["ReceiptHandle"],
                                             VisibilityTimeout=0)
    [dlq_message] = [m for m in received if job_id in m["Body"]]
    return dlq_message["MessageId"]


def snapshot(store, *job_ids) -> dict:
    return {job_id: (store.get_job(job_id), store.get_profile(store.get_job(job_id)["profileId"]))
            for job_id in job_ids}


def sends(client) -> list[dict]:
    return [kwargs for op, kwargs, *_ in client.calls if op == "send_message"]


# ---------------------------------------------------------------- rule 1: lost workers

def test_lost_worker_job_becomes_error_keeping_its_files(store, reconciler, clock, tmp_path):
    """A processing job whose lease ended past the stale age becomes error WorkerLost; files and profile stay."""
    job_id = new_job(store, 1)
    store.claim(job_id, owner="w-dead", token="t", lease_s=LEASE_S)
    files = tmp_path / "work" / job_id / "output" / "full"
    files.mkdir(parents=True)
    (files / "model.pth").write_bytes(b"weights")
    profile = store.get_profile(store.get_job(job_id)["profileId"])
    clock.advance(LEASE_S + STALE_S)

    report = reconciler.run()

    assert report.worker_lost == [job_id] and report.ok
    job = store.get_job(job_id)
    assert job["status"] == "error" and job["error"]["type"] == "WorkerLost"
    assert "worker lost" in job["error"]["message"] and job["error"]["retryable"] is True
    assert [h["outcome"] for h in job["history"]] == ["abandoned", "worker_lost"]
    assert store.get_profile(job["profileId"]) == profile
    assert (files / "model.pth").read_bytes() == b"weights"


def test_lost_worker_rule_never_touches_live_recent_completed_or_cancelled_jobs(store, reconciler, clock):
    """Live leases, leases that ended recently, completed and cancelled jobs are left exactly as they were."""
    old, done, cancelled = new_job(store, 1), new_job(store, 2), new_job(store, 3)
    for job_id in (old, done, cancelled):
        store.claim(job_id, owner="w", token=f"t-{job_id}", lease_s=LEASE_S)
    store.write_paths(store.get_job(done)["profileId"], f"t-{done}", {}, {}, job_id=done)
    store.mark_profile_completed(store.get_job(done)["profileId"], f"t-{done}", job_id=done)
    store.mark_job_completed(done, f"t-{done}")
    store.mark_cancelled(cancelled, f"t-{cancelled}")
    clock.advance(STALE_S)  # `old` ended STALE_S - LEASE_S ago: not yet lost
    recent = new_job(store, 4)
    store.claim(recent, owner="w", token="t4", lease_s=LEASE_S)
    clock.advance(LEASE_S - 1)
    live = new_job(store, 5)
    store.claim(live, owner="w", token="t5", lease_s=LEASE_S)
    before = snapshot(store, old, done, cancelled, recent, live)
    store.writes.clear()

    report = reconciler.run()

    assert report.worker_lost == [] and store.writes == []
    assert snapshot(store, old, done, cancelled, recent, live) == before


# ---------------------------------------------------------------- rule 2: never enqueued

def test_pending_job_whose_send_failed_is_enqueued_once(store, reconciler, sqs_client, queues, clock):
    """A submit whose send failed leaves a pending job; the reconciler sends the stored body once, ever."""
    sqs_client.faults["send_message"] = lambda kw: client_error("ServiceUnavailable")
    with pytest.raises(QueueError):
        submit_job(store, sqs_client, queues.url, PAYLOAD)
    [job_id] = [j["_id"] for j in store.find_unenqueued(0)]
    sqs_client.faults.clear()
    clock.advance(PENDING_S)

    report = reconciler.run()

    assert report.reenqueued == [job_id]
    [msg] = queues.receive_now()
    assert msg["Body"] == store.get_job(job_id)["messageBody"]
    assert parse_job(msg["Body"]).job_id == job_id
    assert store.get_job(job_id)["reenqueuedAt"] == clock.now
    assert store.get_job(job_id)["status"] == "pending"

    clock.advance(10 * PENDING_S)
    store.writes.clear()
    again = reconciler.run()
    assert again.reenqueued == [] and store.writes == []
    assert len(sends(sqs_client)) == 2  # the failed submit's try, and the reconciler's one


def test_re_enqueue_to_a_fifo_queue_sends_the_job_as_its_own_group(store, sqs, clock):
    """On a .fifo queue the re-enqueued message's group is the job id, its deduplication id not the submit's."""
    fifo_url = sqs.create_queue(QueueName="jobs.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    client = FaultyClient(sqs)
    client.faults["send_message"] = lambda kw: client_error("ServiceUnavailable")
    with pytest.raises(QueueError):
        submit_job(store, client, fifo_url, PAYLOAD)
    [job_id] = [j["_id"] for j in store.find_unenqueued(0)]
    clock.advance(PENDING_S)

    report = Reconciler(store, sqs, fifo_url, stale_after_s=STALE_S, pending_after_s=PENDING_S,
                        dlq_wait_s=0).run()

    assert report.reenqueued == [job_id]
    [msg] = sqs.receive_message(QueueUrl=fifo_url, MessageSystemAttributeNames=["All"])["Messages"]
    assert msg["Attributes"]["MessageGroupId"] == job_id
    assert msg["Attributes"]["MessageDeduplicationId"] == f"{job_id}-reenqueue"


def test_enqueued_and_young_pending_jobs_are_not_sent_again(store, reconciler, sqs_client, queues, clock):
    """A job whose submit stamped enqueuedAt, or that is younger than the age, gets no second message."""
    submitted, _ = submit_job(store, queues.sqs, queues.url, PAYLOAD)
    clock.advance(PENDING_S)
    store.submit({"_id": "a" * 24, "profileId": "b" * 24, "environment": "production",
                  "messageBody": message_body("a" * 24)}, {"_id": "b" * 24})
    assert store.get_job(submitted)["enqueuedAt"] is not None

    report = reconciler.run()

    assert report.reenqueued == [] and sends(sqs_client) == []
    assert len(queues.receive_now()) == 1


def test_product_shaped_pending_record_is_rebuilt_into_a_valid_message(store, reconciler, queues, clock):
    """A record with the message's fields but no stored body gets a message built from those fields."""
    job_id = "c" * 24
    store.submit({"_id": job_id, "profileId": "d" * 24, "environment": "production",
                  "metadata": {"directoryName": "voice-9"}, "input": PAYLOAD["input"]}, {"_id": "d" * 24})
    clock.advance(PENDING_S)

    assert reconciler.run().reenqueued == [job_id]
    [msg] = queues.receive_now()
    job = parse_job(msg["Body"])
    assert job.job_id == job_id and job.directory_name == "voice-9"


def test_pending_record_without_a_buildable_message_becomes_error_once(store, reconciler, sqs_client, clock):
    """A pending record no valid message can be built from becomes error InvalidMessage, and stays so."""
    job_id = "e" * 24
    store.submit({"_id": job_id, "profileId": "f" * 24, "environment": "production"}, {"_id": "f" * 24})
    clock.advance(PENDING_S)

    report = reconciler.run()

    assert report.unenqueueable == [job_id] and sends(sqs_client) == []
    job = store.get_job(job_id)
    assert job["status"] == "error" and job["error"]["type"] == "InvalidMessage"
    assert "never enqueued" in job["error"]["message"]
    store.writes.clear()
    assert reconciler.run().unenqueueable == [] and store.writes == []


def test_failed_re_enqueue_is_reported_and_retried_next_pass(store, reconciler, sqs_client, queues, clock):
    """A send that fails stamps nothing, exits 1, and the next pass sends the message."""
    job_id = "1" * 24
    store.submit({"_id": job_id, "profileId": "2" * 24, "environment": "production",
                  "messageBody": message_body(job_id)}, {"_id": "2" * 24})
    clock.advance(PENDING_S)
    sqs_client.faults["send_message"] = lambda kw: client_error("ServiceUnavailable")

    out = io.StringIO()
    assert cmd_reconcile(reconciler, out=out) == 1
    assert "FAILED" in out.getvalue() and "never enqueued" in out.getvalue()
    assert store.get_job(job_id).get("reenqueuedAt") is None

    sqs_client.faults.clear()
    assert reconciler.run().reenqueued == [job_id]
    assert len(queues.receive_now()) == 1


def test_message_body_for_rejects_a_body_naming_another_job():
    """A stored body for another job id is not sent under this job's name."""
    from worker.core.errors import InvalidMessage

    with pytest.raises(InvalidMessage):
        message_body_for({"_id": "a" * 24, "messageBody": message_body("b" * 24)})


# ---------------------------------------------------------------- rule 3: dead letters

def test_dead_lettered_job_becomes_error_and_the_message_stays(store, reconciler, queues, clock):
    """A DLQ message makes its job error "dead-lettered after N receives" with the DLQ's attributes; the message stays."""
    job_id = new_job(store, 1)
    message_id = dead_letter(queues, job_id, receive_count=3)

    report = reconciler.run()

    assert report.dead_lettered == [job_id]
    error = store.get_job(job_id)["error"]
    assert error["message"] == "dead-lettered after 3 receives: BadRecording: recording 0 is not audio"
    assert error["type"] == "BadRecording" and error["retryable"] is False
    assert error["deadLetter"]["messageId"] == message_id
    assert error["deadLetter"]["sourceQueue"] == queues.url
    assert queues.counts(queues.dlq_url) == (1, 0)  # still there, and visible again


def test_message_moved_by_the_redrive_policy_counts_max_receives(store, reconciler, queues, clock):
    """A message SQS itself moved (no attributes of ours) reports the policy's maxReceiveCount."""
    job_id = new_job(store, 1)
    queues.send(message_body(job_id))
    for _ in range(6):  # maxReceiveCount is 5: the sixth receive moves it
        queues.sqs.receive_message(QueueUrl=queues.url, VisibilityTimeout=0)
    assert queues.counts(queues.dlq_url)[0] == 1

    assert reconciler.run().dead_lettered == [job_id]
    error = store.get_job(job_id)["error"]
    assert error["type"] == "DeadLettered" and error["message"] == "dead-lettered after 5 receives"


def test_dead_letter_rule_never_touches_leased_completed_or_cancelled_jobs(store, reconciler, queues, clock):
    """Jobs under a live lease, completed or cancelled keep their records though their messages are in the DLQ."""
    live, done, cancelled = new_job(store, 1), new_job(store, 2), new_job(store, 3)
    for job_id in (live, done, cancelled):
        store.claim(job_id, owner="w", token=f"t-{job_id}", lease_s=LEASE_S)
        dead_letter(queues, job_id)
    profile_id = store.get_job(done)["profileId"]
    store.write_paths(profile_id, f"t-{done}", {}, {}, job_id=done)
    store.mark_profile_completed(profile_id, f"t-{done}", job_id=done)
    store.mark_job_completed(done, f"t-{done}")
    store.mark_cancelled(cancelled, f"t-{cancelled}")
    before = snapshot(store, live, done, cancelled)
    store.writes.clear()

    report = reconciler.run()

    assert report.dead_lettered == [] and store.writes == []
    assert snapshot(store, live, done, cancelled) == before
    assert queues.counts(queues.dlq_url) == (3, 0)


def test_dead_letters_without_a_job_are_noted_not_written(store, reconciler, queues):
    """A DLQ message with no job id, or for a job with no record, is only noted."""
    queues.sqs.send_message(QueueUrl=queues.dlq_url, MessageBody="not json")
    queues.sqs.send_message(QueueUrl=queues.dlq_url, MessageBody=message_body("9" * 24))
    store.writes.clear()

    report = reconciler.run()

    assert report.dead_lettered == [] and store.writes == [] and report.ok
    assert any("names no job" in note for note in report.notes)
    assert any("no record of job" in note for note in report.notes)


# ---------------------------------------------------------------- one pass, twice

def test_second_pass_changes_nothing_after_a_first_pass_that_did_everything(store, reconciler, sqs_client,
                                                                            queues, clock):
    """Pass one applies all three rules; pass two writes nothing, sends nothing, and leaves the records equal."""
    lost = new_job(store, 1)
    store.claim(lost, owner="w", token="t", lease_s=LEASE_S)
    dead = new_job(store, 2)
    dead_letter(queues, dead)
    unsent = "3" * 24
    store.submit({"_id": unsent, "profileId": "4" * 24, "environment": "production",
                  "messageBody": message_body(unsent)}, {"_id": "4" * 24})
    clock.advance(LEASE_S + STALE_S)

    first = reconciler.run()
    assert (first.worker_lost, first.dead_lettered, first.reenqueued) == ([lost], [dead], [unsent])
    assert first.ok
    after_first = snapshot(store, lost, dead, unsent)
    sent_after_first = len(sends(sqs_client))
    store.writes.clear()
    clock.advance(60)

    second = reconciler.run()

    assert second.counts() == {"worker_lost": 0, "reenqueued": 0, "unenqueueable": 0, "dead_lettered": 0,
                               "failed": 0}
    assert store.writes == [] and len(sends(sqs_client)) == sent_after_first
    assert snapshot(store, lost, dead, unsent) == after_first
    assert [h["outcome"] for h in store.get_job(dead)["history"]] == ["dead_lettered"]
    assert queues.counts(queues.dlq_url) == (1, 0)


def test_a_failing_rule_does_not_stop_the_others(store, reconciler, sqs_client, clock):
    """When the DLQ cannot be read the other rules still run, and the pass reports the failure."""
    lost = new_job(store, 1)
    store.claim(lost, owner="w", token="t", lease_s=LEASE_S)
    clock.advance(LEASE_S + STALE_S)
    sqs_client.faults["receive_message"] = lambda kw: client_error("ServiceUnavailable")

    report = reconciler.run()

    assert report.worker_lost == [lost]
    assert not report.ok and report.failures[0].startswith("dead letters")


def test_queue_without_a_dlq_is_noted(store, sqs, clock):
    """A queue with no RedrivePolicy has no dead letters to look at: a note, not a failure."""
    from tests.support import create_queues

    bare = create_queues(sqs, name="bare", with_dlq=False)
    report = Reconciler(store, sqs, bare.url, stale_after_s=STALE_S, pending_after_s=PENDING_S,
                        clock=clock, dlq_wait_s=0).run()
    assert report.ok and "no RedrivePolicy" in report.notes[0]


def test_cli_reconcile_runs_one_pass_from_the_environment(queues, tmp_path, monkeypatch, capsys):
    """`python -m worker reconcile` reads the settings, runs a pass and prints its summary."""
    from worker.ops import cli
    from worker.voice.records.sqlite import SqliteStore

    db = tmp_path / "records.db"
    with SqliteStore(str(db)) as store:
        job_id = new_job(store, 7)
        dead_letter(queues, job_id)
    for name, value in {"SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{db}",
                        "AWS_REGION": "us-east-1", "METRICS_ENABLED": "false"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)

    assert cli.main(["reconcile"]) == 0
    out = capsys.readouterr().out
    assert "1 dead-lettered" in out and f"dead-lettered    {job_id}" in out


# ---------------------------------------------------------------- the schedule

def test_timer_runs_the_reconcile_service_often_enough():
    """The timer starts the oneshot reconcile service, catches up after downtime, and fires well within the pending age."""
    timer = read_unit(REPO / "config" / "voice-worker-reconcile.timer")
    service = read_unit(REPO / "config" / "voice-worker-reconcile.service")
    assert timer.value("Timer", "Unit") == "voice-worker-reconcile.service"
    assert timer.value("Timer", "Persistent") == "true"
    assert timer.value("Install", "WantedBy") == "timers.target"
    every = re.fullmatch(r"\*:0?0/(\d+)", timer.value("Timer", "OnCalendar"))
    assert every, "OnCalendar should read *:0/N (every N minutes)"
    interval_s = int(every.group(1)) * 60
    assert interval_s <= load_settings({}).reconcile_pending_after_s / 2
    assert service.value("Service", "Type") == "oneshot"
    assert service.value("Service", "ExecStart").split()[-3:] == ["-m", "worker", "reconcile"]
    assert service.value("Service", "EnvironmentFile") == "/etc/voice-worker/worker.env"
    # A pass that hangs on a dead endpoint must end before the next one is due.
    assert timespan_s(service.value("Service", "TimeoutStartSec")) < interval_s


def test_sent_bodies_are_json_objects(store, reconciler, sqs_client, clock):
    """Every re-enqueued body is the JSON object the worker parses, never a re-encoded string."""
    job_id = "5" * 24
    store.submit({"_id": job_id, "profileId": "6" * 24, "environment": "production",
                  "messageBody": message_body(job_id)}, {"_id": "6" * 24})
    clock.advance(PENDING_S)
    reconciler.run()
    [sent] = sends(sqs_client)
    assert isinstance(json.loads(sent["MessageBody"]), dict)


def test_one_receive_is_said_in_the_singular(store, reconciler, queues, clock):
    """A message dead-lettered at its first receive reads "after 1 receive", not "1 receives"."""
    job_id = new_job(store, 1)
    dead_letter(queues, job_id, receive_count=1)
    reconciler.run()
    assert store.get_job(job_id)["error"]["message"].startswith("dead-lettered after 1 receive: ")
