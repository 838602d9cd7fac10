"""The voice-cloning handler with moto S3 and both stores: completion, claims, commit order, fencing, recovery."""

from __future__ import annotations

import hashlib
import threading
from datetime import timedelta

import pytest

from pipeline.errors import BadRecording
from tests.support import ARTIFACT_KEYS
from tests.voice.conftest import BUCKET, JOB_ID, PROFILE_ID, deliver, message_body, take_over
from worker.core.errors import QueueError
from worker.voice.records.errors import StaleWrite, StoreError
from worker.voice.records.rules import is_complete


def test_completes_a_job_in_commit_order(queues, make_worker, handler, recorder, raw_store, s3):
    """A job is persisted upload -> paths -> profile completed -> job completed, then the message is deleted."""
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    writes = [c for c in recorder.calls if c not in ("store.renew_lease", "store.set_progress")]
    assert writes == ["store.claim"] + ["s3.PutObject"] * len(ARTIFACT_KEYS) + [
        "store.write_paths", "store.mark_profile_completed", "store.mark_job_completed"]
    job, profile = raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID)
    assert is_complete(job, profile)
    full_model = hashlib.sha256(f"fullModel of {JOB_ID}\n".encode() * 10).hexdigest()
    assert profile["s3Paths"]["fullModel"] == (
        f"s3://{BUCKET}/models/production/{PROFILE_ID}/{JOB_ID}/{full_model}/full/model.pth")
    for key in ARTIFACT_KEYS:
        bucket, _, obj_key = profile["s3Paths"][key].removeprefix("s3://").partition("/")
        body = s3.get_object(Bucket=bucket, Key=obj_key)["Body"].read()
        assert body == f"{key} of {JOB_ID}\n".encode() * 10  # what FakeTrain wrote (since removed locally)
    assert job["completedAt"] is not None and job["lease"] is None
    assert client.ops()[-1] == "delete_message"
    assert queues.counts() == (0, 0)


def test_redelivered_complete_job_is_acked_without_work_or_writes(queues, make_worker, handler, recorder, train):
    """A second delivery of a completed job does no work and writes nothing, and is deleted."""
    worker, _ = make_worker(handler)
    queues.send(message_body())
    worker.run_once()
    recorder.calls.clear()
    queues.send(message_body())
    assert worker.run_once() == "ack"
    assert recorder.calls == [] and train.runs == 1
    assert queues.counts() == (0, 0)


def test_update_matching_nothing_is_not_acknowledged(queues, make_worker, handler, store):
    """When the commit marker matches no record the message is not deleted."""
    store.faults["mark_job_completed"] = lambda: StaleWrite("job record changed under us")
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "retry"
    assert "delete_message" not in client.ops()


def test_delete_failure_after_commit_leaves_completed_and_redelivery_only_deletes(
        memory_queue, make_memory_worker, fake_clock, handler, recorder, raw_store, train):
    """If the delete fails after the commit, both records stay completed and the redelivery only deletes."""
    worker = make_memory_worker(handler, SQS_VISIBILITY_TIMEOUT_SECONDS=1, SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=300)
    failures = iter([QueueError("DeleteMessage failed: InternalError")])
    memory_queue.faults["delete"] = lambda message: next(failures, None)
    memory_queue.send(message_body())
    assert worker.run_once() == "ack"
    assert memory_queue.counts() == (0, 1)  # still there, invisible
    assert is_complete(raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID))
    recorder.calls.clear()
    fake_clock.advance(1.2)  # its visibility runs out: the redelivery
    assert worker.run_once() == "ack"
    assert recorder.calls == [] and train.runs == 1
    assert memory_queue.counts() == (0, 0)


def test_duplicate_delivery_under_a_live_lease_is_acked_without_work(queues, make_worker, handler, raw_store, train):
    """A second worker finding a live lease held elsewhere deletes its copy without work or writes."""
    assert raw_store.claim(JOB_ID, owner="worker-a", token="token-a", lease_s=300).outcome == "claimed"
    before = raw_store.get_job(JOB_ID)
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    assert train.runs == 0
    assert raw_store.get_job(JOB_ID) == before
    assert client.ops()[-1] == "delete_message"


def test_replaced_token_cannot_write_paths_or_completion(queues, make_worker, handler, raw_store, clock, train,
                                                         recorder):
    """A worker whose claim was taken over uploads nothing, writes no paths and no completion, and does not ack."""
    def takeover(job, work_dir, stop, progress):
        take_over(raw_store, clock)  # our lease lapses in the store ...

    train.during = takeover
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "abandon"
    assert not [c for c in recorder.calls if c.startswith("s3.")], "a worker that lost the job uploaded"
    job, profile = raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID)
    assert job["status"] == "processing" and job["lease"]["token"] == "token-b"
    assert not profile.get("modelPaths") and profile["status"] != "completed"
    assert "delete_message" not in client.ops()


def test_matching_s3_objects_are_not_uploaded_twice(queues, make_worker, handler, store, recorder, train):
    """A retry after uploads succeeded reuses the S3 objects: no PutObject or UploadPart the second time."""
    failures = iter([StoreError("store unavailable")])
    store.faults["write_paths"] = lambda: next(failures, None)
    worker, _ = make_worker(handler, SQS_VISIBILITY_TIMEOUT_SECONDS=1, SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=300,
                            SQS_RETRY_VISIBILITY_BASE_SECONDS=0)
    queues.send(message_body())
    assert worker.run_once() == "retry"
    assert recorder.calls.count("s3.PutObject") == len(ARTIFACT_KEYS)
    recorder.calls.clear()
    assert worker.run_once() == "ack"
    assert train.runs == 2
    assert not [c for c in recorder.calls if c.startswith("s3.")]


def test_verified_artifacts_on_the_profile_are_reused_without_training(
        queues, make_worker, handler, store, raw_store, train):
    """A crash after the paths were written is resumed from the profile's verified files: no training."""
    failures = iter([StoreError("store unavailable")])
    store.faults["mark_profile_completed"] = lambda: next(failures, None)
    worker, _ = make_worker(handler, SQS_VISIBILITY_TIMEOUT_SECONDS=1, SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=300,
                            SQS_RETRY_VISIBILITY_BASE_SECONDS=0)
    queues.send(message_body())
    assert worker.run_once() == "retry"
    assert raw_store.get_job(JOB_ID)["status"] == "error"
    assert worker.run_once() == "ack"
    assert train.runs == 1
    assert is_complete(raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID))


def test_errors_are_recorded_on_the_job(queues, make_worker, handler, raw_store, train):
    """A permanent pipeline failure is recorded (type, message, not retryable) and dead-lettered."""
    def bad(job, work_dir, stop, progress):
        raise BadRecording("input[0] is not decodable audio")

    train.during = bad
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "dead_letter"
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == "error"
    assert job["error"]["type"] == "BadRecording" and job["error"]["retryable"] is False
    assert "not decodable" in job["error"]["message"]
    assert job["history"][-1]["outcome"] != "running"


def test_failure_to_record_an_error_does_not_hide_it(queues, make_worker, handler, store, train):
    """If recording the error fails, the original error still decides the outcome."""
    def bad(job, work_dir, stop, progress):
        raise BadRecording("gone")

    train.during = bad
    store.faults["record_error"] = lambda: StoreError("store unavailable")
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "dead_letter"


def test_cancel_requested_before_the_claim_ends_cancelled(queues, make_worker, handler, raw_store, train):
    """A job whose cancel was requested before it started ends cancelled, with no work, and is deleted."""
    assert raw_store.request_cancel(JOB_ID)
    worker, _ = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    assert raw_store.get_job(JOB_ID)["status"] == "cancelled" and train.runs == 0


@pytest.mark.parametrize("status,end", [("completed", "mark_job_completed"), ("cancelled", "mark_cancelled")])
def test_a_job_the_claim_finds_final_is_acknowledged_under_its_status(handler, raw_store, train, status, end):
    """A job another attempt ended (its profile not complete) is acknowledged without work, labelled with its status."""
    raw_store.claim(JOB_ID, owner="w0", token="t0", lease_s=30)
    getattr(raw_store, end)(JOB_ID, "t0")
    assert deliver(handler, 1) == status and train.runs == 0


def test_cancel_during_training_stops_it_and_ends_cancelled(queues, make_worker, handler, raw_store, train):
    """A cancel requested mid-training is noticed on a heartbeat tick, stops the work and ends cancelled."""
    def wait_for_cancel(job, work_dir, stop, progress):
        threading.Timer(0.1, raw_store.request_cancel, args=(JOB_ID,)).start()
        assert stop.wait(3)
        stop.raise_if_set()

    train.during = wait_for_cancel
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == "cancelled" and job["lease"] is None
    assert queues.counts() == (0, 0)


def test_shutdown_past_grace_releases_the_store_lease_too(queues, make_worker, handler, raw_store, train):
    """Stopped for shutdown, the job's lease is cleared so another worker can claim it at once."""
    def wait_for_stop(job, work_dir, stop, progress):
        worker.stop()
        assert stop.wait(3)
        stop.raise_if_set()

    train.during = wait_for_stop
    worker, _ = make_worker(handler, SHUTDOWN_GRACE_SECONDS=0.2)
    queues.send(message_body())
    assert worker.run_once() == "release"
    assert raw_store.get_job(JOB_ID)["lease"] is None
    assert raw_store.claim(JOB_ID, owner="w2", token="t2", lease_s=60).outcome == "claimed"


def test_time_limit_is_recorded_and_dead_lettered(queues, make_worker, handler, raw_store, train):
    """A job past its time limit is recorded as TimeLimitExceeded and dead-lettered."""
    def slow(job, work_dir, stop, progress):
        assert stop.wait(3)
        stop.raise_if_set()

    train.during = slow
    worker, _ = make_worker(handler, JOB_TIME_LIMIT_SECONDS=1)
    queues.send(message_body())
    assert worker.run_once() == "dead_letter"
    assert raw_store.get_job(JOB_ID)["error"]["type"] == "TimeLimitExceeded"


def test_unknown_job_is_retried_not_dead_lettered(queues, make_worker, handler):
    """A message for a job with no record yet is retried (the redrive policy bounds it)."""
    worker, client = make_worker(handler)
    queues.send(message_body(job_id="665f1c2e9b1e8a0012ab0000"))
    assert worker.run_once() == "retry"


def test_store_lease_is_renewed_with_the_message(queues, make_worker, fake_clock, handler, raw_store, clock, train):
    """Each heartbeat tick also renews the job's lease in the store."""
    seen = []

    def slow(job, work_dir, stop, progress):
        first = raw_store.get_job(JOB_ID)["lease"]["expiresAt"]
        clock.offset += timedelta(seconds=1)  # the store's clock, so that a renewal moves the expiry
        fake_clock.advance(0.2)  # one tick, well under the 2 s visibility: only a renewal can move it
        seen.append((first, raw_store.get_job(JOB_ID)["lease"]["expiresAt"]))

    train.during = slow
    worker, _ = make_worker(handler, clock=fake_clock)
    queues.send(message_body())
    assert worker.run_once() == "ack"
    first, later = seen[0]
    assert later > first


def test_same_message_redelivered_under_a_live_record_lease_is_not_deleted(queues, make_worker, handler, raw_store, train):
    """A delivery of the very message another worker holds (its SQS lease lapsed) is retried, never deleted."""
    msg_id = queues.send(message_body())
    assert raw_store.claim(JOB_ID, owner="worker-a", token="token-a", lease_s=300, message_id=msg_id).outcome == "claimed"
    worker, client = make_worker(handler)
    assert worker.run_once() == "retry"
    assert train.runs == 0 and "delete_message" not in client.ops()
    assert raw_store.get_job(JOB_ID)["lease"]["token"] == "token-a"


def test_lost_message_lease_clears_the_record_lease_for_the_next_delivery(queues, make_worker, handler, raw_store, train):
    """A worker that lost its SQS lease commits nothing and clears its record lease, so the next delivery claims at once."""
    from tests.support import client_error

    def wait_for_stop(job, work_dir, stop, progress):
        assert stop.wait(3)
        stop.raise_if_set()

    train.during = wait_for_stop
    worker, client = make_worker(handler)
    client.faults["change_message_visibility"] = lambda kw: client_error("ReceiptHandleIsInvalid")
    queues.send(message_body())
    assert worker.run_once() == "abandon"
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == "processing" and job["lease"] is None
    assert not raw_store.get_profile(PROFILE_ID).get("modelPaths")
    assert raw_store.claim(JOB_ID, owner="w2", token="t2", lease_s=60).outcome == "claimed"


def test_unexpected_error_in_the_job_is_retried_and_recorded(queues, make_worker, handler, raw_store, train):
    """A bug or unforeseen library error inside the job is retried and recorded, not a crash of the worker."""
    def buggy(job, work_dir, stop, progress):
        raise KeyError("surprise")

    train.during = buggy
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "retry"
    job = raw_store.get_job(JOB_ID)
    assert job["error"]["type"] == "UnexpectedError" and "KeyError" in job["error"]["message"]
    assert job["lease"] is None and "delete_message" not in client.ops()


@pytest.mark.parametrize("store_ahead_s", [0, 1000])
def test_busy_message_comes_back_when_the_holders_record_lease_ends(queues, make_worker, handler, raw_store,
                                                                    clock, store_ahead_s):
    """The retry of a busy message waits for the holder's record lease, judged on the store's clock."""
    clock.offset = timedelta(seconds=store_ahead_s)
    msg_id = queues.send(message_body())
    raw_store.claim(JOB_ID, owner="worker-a", token="token-a", lease_s=200, message_id=msg_id)
    worker, client = make_worker(handler)
    assert worker.run_once() == "retry"
    last = [c for c in client.calls if c[0] == "change_message_visibility"][-1]
    assert 195 <= last[1]["VisibilityTimeout"] <= 206


def test_a_failed_profile_stamp_lets_go_of_the_job_once(queues, make_worker, handler, raw_store, monkeypatch):
    """A claim whose profile stamp fails in the store releases the job it took exactly once, then retries."""
    real_swap, real_release, releases = raw_store._swap_profile, raw_store.release_lease, []

    def failing_stamp(op, *args):
        if op == "claim":
            raise StoreError("connection reset")
        return real_swap(op, *args)

    def counted_release(*args):
        releases.append(args)
        return real_release(*args)

    monkeypatch.setattr(raw_store, "_swap_profile", failing_stamp)
    monkeypatch.setattr(raw_store, "release_lease", counted_release)
    worker, _client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "retry"
    assert len(releases) == 1 and raw_store.get_job(JOB_ID)["lease"] is None


def test_a_profile_write_refused_while_the_job_lease_is_ours_releases_it(
        queues, make_worker, handler, raw_store, store, train):
    """StaleWrite from the profile paths write lets go of our still-live job lease and records no error."""
    store.faults["write_paths"] = lambda: StaleWrite("profile claim replaced")
    worker, client = make_worker(handler)
    queues.send(message_body())
    assert worker.run_once() == "retry" and train.runs == 1
    job = raw_store.get_job(JOB_ID)
    assert job["lease"] is None and job["history"][-1]["outcome"] == "released"
    assert job["status"] == "processing" and job["error"] is None
    assert "delete_message" not in client.ops()


def test_lease_lost_after_a_shutdown_request_still_stops_the_commit(queues, make_worker, fake_clock, handler,
                                                                    raw_store, s3):
    """A lease lost during the uploads, after a shutdown already set the stop reason, still writes no paths."""
    from tests.support import client_error

    def during_upload(model, **kw):
        if not hit:
            hit.append(1)
            worker.stop()
            worker.stop()  # second signal: the stop reason becomes "shutdown" at once
            client.faults["change_message_visibility"] = lambda kw: client_error("ReceiptHandleIsInvalid")
            fake_clock.advance(0.6)  # a few ticks: the lease is lost meanwhile

    hit = []
    s3.meta.events.register("before-call.s3.PutObject", during_upload)
    worker, client = make_worker(handler, clock=fake_clock)
    queues.send(message_body())
    assert worker.run_once() == "abandon"
    assert not raw_store.get_profile(PROFILE_ID).get("modelPaths")
    assert raw_store.get_job(JOB_ID)["status"] == "processing"
    assert "delete_message" not in client.ops()


def test_a_message_naming_another_profile_than_the_job_record_is_dead_lettered(queues, make_worker, handler, raw_store, train):
    """A message whose profileId differs from its job record's is rejected, leaving the record untouched."""
    before = raw_store.get_job(JOB_ID)
    worker, _ = make_worker(handler)
    queues.send(message_body(profile_id="665f1c2e9b1e8a0012ab9999"))
    assert worker.run_once() == "dead_letter"
    assert train.runs == 0 and raw_store.get_job(JOB_ID) == before
    [dead] = queues.receive_now(queues.dlq_url)
    assert "belongs to profile" in dead["MessageAttributes"]["ErrorMessage"]["StringValue"]


def test_a_takeover_after_training_uploads_nothing(queues, make_worker, handler, raw_store, clock, train, recorder):
    """A claim taken over between training and persisting is caught by the fenced check before any upload."""
    def takeover(job, work_dir, stop, progress):
        take_over(raw_store, clock)

    train.during, train.report_progress = takeover, False
    # No heartbeat tick during this short job: only the check before the uploads can notice.
    worker, client = make_worker(handler, SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=1500)
    queues.send(message_body())
    assert worker.run_once() == "abandon"
    assert not [c for c in recorder.calls if c.startswith("s3.")]
    assert raw_store.get_job(JOB_ID)["lease"]["token"] == "token-b"


def test_a_stages_note_reaches_the_attempts_entry_on_the_record(handler, train, raw_store):
    """What a stage notes while it trains (clips it left out) is on the committed job's record."""
    train.during = lambda job, work_dir, stop, progress: progress.note("train_full", "left out 1 clip(s): clip 2")
    assert deliver(handler, 1) == "completed"
    [entry] = raw_store.get_job(JOB_ID)["history"]
    assert entry["notes"] == [{"stage": "train_full", "text": "left out 1 clip(s): clip 2"}]
