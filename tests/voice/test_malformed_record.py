"""The handler on records another writer malformed: a permanent MalformedRecord, dead-lettered with its
reason (and recorded on the job when the record takes the write), never an UnexpectedError retried."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import BadRecording
from tests.voice.conftest import JOB_ID, PROFILE_ID, deliver, message_body
from worker.core.errors import Action, InvalidMessage, UnexpectedError
from worker.voice.errors import MalformedRecord
from worker.voice.records.mongo import db_id
from worker.voice.records.sqlite import SqliteStore


def malform(store, fields: dict, *, table: str = "jobs", record_id: str = JOB_ID) -> None:
    """Set fields on the stored document as the product's backend would: past every rule of the store."""
    if isinstance(store, SqliteStore):
        (text,) = store._conn.execute(f"SELECT doc FROM {table} WHERE id = ?", (record_id,)).fetchone()
        store._conn.execute(f"UPDATE {table} SET doc = ? WHERE id = ?",
                            (json.dumps({**json.loads(text), **fields}), record_id))
    else:
        collection = store._jobs if table == "jobs" else store._profiles
        collection.update_one({"_id": db_id(record_id)}, {"$set": fields})


# Malformed fields the worker decides on, and the field the error names.
FATAL = {
    "history as text": ({"history": "oops"}, "history"),
    "error as text": ({"status": "error", "error": "boom"}, "error"),
    "lease as text": ({"status": "processing", "lease": "w1"}, "lease"),
    "attempts as text": ({"attempts": "three"}, "attempts"),
    "failedAttempts as text": ({"failedAttempts": "two"}, "failedAttempts"),
    "cancelRequested as text": ({"cancelRequested": "false"}, "cancelRequested"),
}


@pytest.mark.parametrize("case", FATAL)
def test_a_malformed_field_the_worker_decides_on_is_a_permanent_typed_error(handler, raw_store, train, case):
    """The handler raises MalformedRecord (permanent, dead-lettered), never UnexpectedError, and trains nothing."""
    fields, field = FATAL[case]
    malform(raw_store, fields)

    with pytest.raises(MalformedRecord) as raised:
        deliver(handler, 1)

    error = raised.value
    assert not isinstance(error, UnexpectedError) and not error.retryable and error.action is Action.DEAD_LETTER
    assert f"job {field}: " in str(error) and "written by something other than the worker" in str(error)
    assert train.runs == 0


@pytest.mark.parametrize("case", FATAL)
def test_the_reason_is_on_the_record_and_in_the_dlq_copy(queues, make_worker, handler, raw_store, case):
    """The loop dead-letters the message with MalformedRecord; the job record says so too, the malformed
    lease, history or failedAttempts replaced by the error write."""
    fields, field = FATAL[case]
    malform(raw_store, fields)
    worker, _ = make_worker(handler)
    queues.send(message_body())

    assert worker.run_once() == "dead_letter"

    [dead] = queues.receive_now(queues.dlq_url)
    attributes = dead["MessageAttributes"]
    assert attributes["ErrorType"]["StringValue"] == "MalformedRecord"
    assert f"job {field}: " in attributes["ErrorMessage"]["StringValue"]
    job = raw_store.get_job(JOB_ID)
    assert (job["status"], job["error"]["type"], job["error"]["retryable"]) == ("error", "MalformedRecord", False)
    assert f"job {field}: " in job["error"]["message"]
    assert job["lease"] is None and isinstance(job["history"], list) and job["failedAttempts"] in (0, "two")


def test_a_malformed_profile_fails_the_job_and_is_named(handler, raw_store, train):
    """A profile whose modelPaths are text fails the job permanently, naming the profile's field."""
    malform(raw_store, {"modelPaths": "/models/x"}, table="profiles", record_id=PROFILE_ID)

    with pytest.raises(MalformedRecord, match="profile modelPaths: "):
        deliver(handler, 1)

    assert train.runs == 0 and raw_store.get_job(JOB_ID)["error"]["type"] == "MalformedRecord"


# SQLite only: MongoDB holds no such time (a BSON date is UTC, and its year 0 stops the driver's decoder).
@pytest.mark.parametrize("raw_store", ["sqlite"], indirect=True)
def test_a_record_beyond_writing_is_still_dead_lettered_with_its_reason(handler, raw_store, train):
    """A time no store can encode (year 1 at +05:00) leaves the record as it is, and the error still names it."""
    malform(raw_store, {"progress": {"stage": "train_full", "percent": 5,
                                     "updatedAt": {"$date": "0001-01-01T00:00:00+05:00"}}})

    with pytest.raises(MalformedRecord, match=r"job progress\.updatedAt: .*outside the years 1-9999"):
        deliver(handler, 1)

    assert train.runs == 0 and raw_store.get_job(JOB_ID)["status"] == "pending"


def test_a_malformed_field_the_worker_writes_over_does_not_stop_the_job(handler, raw_store):
    """A percent stored as text is the commands' warning only: the job trains and commits as usual."""
    malform(raw_store, {"progress": {"stage": "train_full", "percent": "42"}})

    assert deliver(handler, 1) == "completed"

    assert raw_store.get_job(JOB_ID)["progress"]["percent"] == 100.0


def test_a_completed_job_with_a_malformed_history_is_still_acknowledged(handler, raw_store, train):
    """A redelivery of a committed job whose history another writer mangled does no work and is acknowledged."""
    assert deliver(handler, 1) == "completed"
    malform(raw_store, {"history": "oops", "attempts": "one"})

    assert deliver(handler, 2, message_id="m-2") == "already_complete"

    assert train.runs == 1


def test_a_history_mangled_during_training_does_not_fail_the_commit(handler, raw_store):
    """Another writer turning the history to text mid-attempt costs it nothing: the commit closes no entry and completes."""
    def mangle(job, work_dir, stop, progress):
        malform(raw_store, {"history": "oops"})
        progress("train_full", 50)

    handler._train.during = mangle

    assert deliver(handler, 1) == "completed"

    job = raw_store.get_job(JOB_ID)
    assert (job["status"], job["history"]) == ("completed", [])


# SQLite only: MongoDB holds no such time (a BSON date is UTC, and its year 0 stops the driver's decoder).
@pytest.mark.parametrize("raw_store", ["sqlite"], indirect=True)
def test_an_error_write_the_record_refuses_does_not_hide_the_error(handler, raw_store):
    """A permanent failure met while the record took a time no store encodes stays that failure, unrecorded."""

    def bad_audio_and_a_mangled_record(job, work_dir, stop, progress):
        malform(raw_store, {"startedAt": {"$date": "0001-01-01T00:00:00+05:00"}})
        raise BadRecording("input[0] is not audio")

    handler._train.during = bad_audio_and_a_mangled_record

    with pytest.raises(BadRecording):
        deliver(handler, 1)


def test_a_message_naming_another_profile_writes_nothing_on_a_malformed_record(handler, raw_store, train):
    """Whatever the record holds, a message for another profile is refused as invalid and changes nothing."""
    malform(raw_store, {"history": "oops"})
    before = raw_store.get_job(JOB_ID)

    with pytest.raises(InvalidMessage, match="belongs to profile"):
        deliver(handler, 1, body=message_body(profile_id="665f1c2e9b1e8a0012ab9999"))

    assert raw_store.get_job(JOB_ID) == before and train.runs == 0
