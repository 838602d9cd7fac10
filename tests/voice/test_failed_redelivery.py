"""A redelivery of a permanently failed message goes back to the DLQ without work; a new message for the
job (a redrive's copy, a resubmit) and a job the reconciler marked dead-lettered are worked on again."""

from __future__ import annotations

from pipeline.errors import BadRecording
from tests.voice.conftest import JOB_ID, PROFILE_ID, deliver, message_body
from worker.core.errors import QueueError
from worker.voice.errors import AlreadyFailed
from worker.voice.records.rules import is_complete


def bad_recording(job, work_dir, stop, progress):
    raise BadRecording("input[0] is not decodable audio")


def record_permanent_error(raw_store, message_id: str = "m-1") -> None:
    """The record an attempt of message ``message_id`` leaves when it fails permanently."""
    claim = raw_store.claim(JOB_ID, owner="w-1", token="t-1", lease_s=60, message_id=message_id)
    assert claim.attempt.fail("BadRecording", "input[0] is not decodable audio", retryable=False)
    assert raw_store.get_job(JOB_ID)["error"]["messageId"] == message_id


def test_redelivery_after_a_failed_delete_is_dead_lettered_again_without_work(
        memory_queue, make_memory_worker, fake_clock, handler, train, recorder, raw_store):
    """The message whose permanent failure was recorded but whose delete failed is not trained or claimed again."""
    train.during = bad_recording
    worker = make_memory_worker(handler, SQS_VISIBILITY_TIMEOUT_SECONDS=1, SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=300)
    failures = iter([QueueError("DeleteMessage failed: InternalError")])
    memory_queue.faults["delete"] = lambda message: next(failures, None)
    memory_queue.send(message_body())
    assert worker.run_once() == "dead_letter"
    assert memory_queue.counts() == (0, 1) and train.runs == 1  # the delete failed: the message comes back
    before = raw_store.get_job(JOB_ID)
    recorder.calls.clear()
    fake_clock.advance(1.2)  # its visibility runs out: the redelivery
    assert worker.run_once() == "dead_letter"
    assert train.runs == 1, "the failed job was trained again"
    assert recorder.calls == [], f"the redelivery wrote to the store: {recorder.calls}"
    assert raw_store.get_job(JOB_ID) == before
    assert memory_queue.counts() == (0, 0)
    copies = [held.message_attributes for held in memory_queue.dead_letter_queue.messages]
    assert len(copies) == 2
    assert {c["ErrorType"]["StringValue"] for c in copies} == {"BadRecording"}
    assert all("not decodable" in c["ErrorMessage"]["StringValue"] for c in copies)


def test_recorded_failure_is_raised_with_its_recorded_type_before_any_claim(handler, raw_store, recorder, train):
    """The short-circuit raises a PermanentError carrying the recorded type and message, with no store write."""
    record_permanent_error(raw_store)
    recorder.calls.clear()
    try:
        deliver(handler, receive_count=2)
    except AlreadyFailed as exc:
        assert exc.error_type == "BadRecording" and exc.retryable is False
        assert str(exc) == "input[0] is not decodable audio"
    else:
        raise AssertionError("the redelivery was not refused")
    assert recorder.calls == [] and train.runs == 0


def test_a_new_message_for_a_permanently_failed_job_is_worked_on(handler, raw_store, train):
    """A message received for the first time (a redrive's copy, a resubmit) retries the job as before."""
    record_permanent_error(raw_store)
    assert deliver(handler, receive_count=1, message_id="m-redriven") == "completed"
    assert train.runs == 1
    assert is_complete(raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID))


def test_a_job_the_reconciler_marked_dead_lettered_is_worked_on_when_redriven(handler, raw_store, train):
    """Once the reconciler recorded the DLQ copy, any delivery is an operator's redrive: it is trained."""
    record_permanent_error(raw_store)
    assert raw_store.record_dead_letter(JOB_ID, dead_letter={
        "messageId": "dlq-1", "receiveCount": 1, "errorType": "BadRecording",
        "errorMessage": "input[0] is not decodable audio"}, worker="reconciler")
    error = raw_store.get_job(JOB_ID)["error"]
    assert raw_store.get_job(JOB_ID)["status"] == "error" and error["retryable"] is False
    assert deliver(handler, receive_count=4) == "completed"
    assert train.runs == 1


def test_a_retryable_error_is_still_retried_on_redelivery(handler, raw_store, train):
    """Only a permanent failure short-circuits: a recorded retryable error is worked on again."""
    assert raw_store.record_error(JOB_ID, token=None, error_type="DownloadError", message="timeout",
                                  retryable=True)
    assert deliver(handler, receive_count=3) == "completed"
    assert train.runs == 1


def test_only_the_failed_message_itself_is_refused_not_a_later_message_for_the_job(handler, raw_store, train):
    """The recorded failure names its SQS message: a resubmit received twice is still trained, the failed message is not."""
    train.during = bad_recording
    try:
        deliver(handler, receive_count=1, message_id="m-1")
    except BadRecording:
        pass
    assert raw_store.get_job(JOB_ID)["error"]["messageId"] == "m-1"
    try:
        deliver(handler, receive_count=2, message_id="m-1")
    except AlreadyFailed:
        pass
    else:
        raise AssertionError("the failed message's own redelivery was worked on")
    train.during = None
    assert deliver(handler, receive_count=2, message_id="m-resubmitted") == "completed"
    assert train.runs == 2
