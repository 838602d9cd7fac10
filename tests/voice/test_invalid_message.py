"""A malformed message never changes another message's fate: it is dead-lettered with its own reason,
and the job it names is left as it was, so the job's own message is worked on."""

from __future__ import annotations

import json

import pytest

from tests.voice.conftest import JOB_ID, PROFILE_ID, deliver, message_body
from worker.core.errors import InvalidMessage
from worker.voice.records.rules import is_complete

OTHER_PROFILE_ID = "665f1c2e9b1e8a0012ab34cf"


def test_a_malformed_message_naming_a_job_does_not_fail_that_jobs_own_message(
        queues, make_worker, handler, raw_store, train):
    """A malformed body naming a real job is dead-lettered alone; the job's valid message received twice completes."""
    before = raw_store.get_job(JOB_ID)
    worker, _ = make_worker(handler)
    queues.send(message_body(input=[]))
    assert worker.run_once() == "dead_letter"
    [dead] = queues.receive_now(queues.dlq_url)
    assert dead["MessageAttributes"]["ErrorType"]["StringValue"] == "InvalidMessage"
    assert "input" in dead["MessageAttributes"]["ErrorMessage"]["StringValue"]
    assert raw_store.get_job(JOB_ID) == before, "the malformed message wrote to the job it names"

    assert deliver(handler, receive_count=2, message_id="m-valid") == "completed"
    assert train.runs == 1
    job = raw_store.get_job(JOB_ID)
    assert job["attempts"] == 1 and job["history"][-1]["outcome"] == "completed"
    assert is_complete(job, raw_store.get_profile(PROFILE_ID))


@pytest.mark.parametrize("body", [
    "{not json", json.dumps({"jobId": JOB_ID}), message_body(input=[]),
], ids=["not-json", "schema", "policy"])
def test_no_malformed_body_writes_to_the_store(handler, store, recorder, body):
    """Whatever makes a body invalid, the handler raises InvalidMessage and writes nothing."""
    with pytest.raises(InvalidMessage):
        deliver(handler, 1, body=body)
    assert recorder.calls == []


def test_a_message_for_another_profile_does_not_fail_the_job(handler, store, raw_store, recorder, train):
    """A body naming another profile than the job record's is refused unrecorded; the job's own message completes."""
    with pytest.raises(InvalidMessage, match="belongs to profile"):
        deliver(handler, 1, message_id="m-stray", body=message_body(profile_id=OTHER_PROFILE_ID))
    assert recorder.calls == [] and train.runs == 0
    assert deliver(handler, receive_count=2, message_id="m-valid") == "completed"
    assert is_complete(raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID))


def test_an_error_no_message_met_does_not_dead_letter_a_message_received_twice(handler, raw_store, train):
    """A permanent error recorded before any claim names no message, so no delivery counts as having met it."""
    assert raw_store.record_error(JOB_ID, token=None, error_type="InvalidMessage", message="never enqueued",
                                  retryable=False)
    assert "messageId" not in raw_store.get_job(JOB_ID)["error"]
    assert deliver(handler, receive_count=3, message_id="m-1") == "completed"
    assert train.runs == 1

