"""The job record's failedAttempts, on both stores: only an attempt's recorded retryable failure counts."""

from __future__ import annotations

import pytest

from tests.voice.records.conftest import JOB_ID, LEASE_S, claim, submit
from worker.voice.records.models import read_job
from worker.voice.records.rules import failed_attempts


def fail(store, token: str | None, retryable: bool = True) -> bool:
    return store.record_error(JOB_ID, token=token, error_type="StageFailed", message="exit 1",
                              retryable=retryable)


def test_a_new_job_has_failed_no_attempt(store):
    """A submitted job starts with failedAttempts 0."""
    submit(store)
    assert store.get_job(JOB_ID)["failedAttempts"] == 0


def test_each_retryable_failure_of_an_attempt_counts_once(store):
    """Three attempts that each record a retryable failure leave failedAttempts 3, over three claims."""
    submit(store)
    for n in range(1, 4):
        claim(store, f"t{n}")
        assert fail(store, f"t{n}")
        assert failed_attempts(store.get_job(JOB_ID)) == n
    assert store.get_job(JOB_ID)["attempts"] == 3


def test_a_permanent_failure_does_not_count(store):
    """A permanent failure is dead-lettered anyway: it spends no retry."""
    submit(store)
    claim(store, "t1")
    assert fail(store, "t1", retryable=False)
    assert failed_attempts(store.get_job(JOB_ID)) == 0


def test_an_error_recorded_outside_any_attempt_does_not_count(store):
    """An error with no token (found before any claim) did not run the job: it spends no retry."""
    submit(store)
    assert fail(store, None)
    assert failed_attempts(store.get_job(JOB_ID)) == 0


def test_a_refused_failure_from_a_replaced_token_does_not_count(store, clock):
    """An attempt that lost the job records nothing, so its failure counts for nothing."""
    submit(store)
    claim(store, "t1")
    clock.advance(LEASE_S)
    claim(store, "t2")
    assert not fail(store, "t1")
    assert failed_attempts(store.get_job(JOB_ID)) == 0


def test_releases_and_crashes_never_count(store, clock):
    """Six releases (shutdown, drain, handover), a crash whose lease lapsed, and the reconciler's
    WorkerLost leave failedAttempts 0 while the attempts go on counting."""
    submit(store)
    for n in range(6):
        claim(store, f"r{n}")
        assert store.release_lease(JOB_ID, f"r{n}")
    claim(store, "crashed")
    clock.advance(LEASE_S)
    claim(store, "crashed-again")  # takes over the lapsed lease: the crashed attempt is "abandoned"
    clock.advance(LEASE_S * 10)
    assert store.mark_worker_lost(JOB_ID, stale_after_s=LEASE_S, worker="reconciler")
    job = store.get_job(JOB_ID)
    assert job["attempts"] == 8 and job["error"]["type"] == "WorkerLost"
    assert failed_attempts(job) == 0


def test_the_reconciler_recording_the_dead_letter_starts_a_fresh_budget(store):
    """Once the DLQ copy is recorded, whatever arrives next (a redrive) has the whole budget again."""
    submit(store)
    for n in range(5):
        claim(store, f"t{n}")
        fail(store, f"t{n}")
    assert failed_attempts(store.get_job(JOB_ID)) == 5
    assert store.record_dead_letter(JOB_ID, dead_letter={
        "messageId": "dlq-1", "receiveCount": 5, "errorType": "StageFailed", "errorMessage": "exit 1"},
        worker="reconciler")
    assert failed_attempts(store.get_job(JOB_ID)) == 0


@pytest.mark.parametrize("record,count", [(None, 0), ({}, 0), ({"failedAttempts": None}, 0),
                                          ({"failedAttempts": 3}, 3)])
def test_a_record_made_before_the_count_has_failed_no_attempt(record, count):
    """Records written before failedAttempts existed (or none at all) read as 0."""
    assert failed_attempts(None if record is None else read_job(record)) == count
