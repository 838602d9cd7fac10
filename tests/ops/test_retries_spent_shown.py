"""A job the worker dead-lettered for spending its retries says so at once in status, jobs and to a watch."""

from __future__ import annotations

import io

import pytest

from worker.ops.commands import cmd_jobs, cmd_status
from worker.voice.records.sqlite import SqliteStore

JOB_ID = "665f1c2e9b1e8a0012ab34cd"
PROFILE_ID = "665f1c2e9b1e8a0012ab34ce"


@pytest.fixture
def store(tmp_path):
    store = SqliteStore(str(tmp_path / "records.db"))
    store.submit({"_id": JOB_ID, "profileId": PROFILE_ID, "environment": "production"}, {"_id": PROFILE_ID})
    yield store
    store.close()


def fail_once(store, *, retries_spent: bool) -> None:
    claim = store.claim(JOB_ID, owner="w1", token=f"t-{retries_spent}", lease_s=300, message_id="m-1")
    assert claim.attempt is not None
    assert claim.attempt.fail("StageFailed", "stage train_full exited 1", retryable=True,
                              retries_spent=retries_spent)


def test_status_and_jobs_say_dead_lettered_not_retryable(store):
    """After the failure that spent the last retry, status and jobs show the error as dead-lettered."""
    fail_once(store, retries_spent=True)
    status, jobs = io.StringIO(), io.StringIO()
    assert cmd_status(store, JOB_ID, as_json=False, out=status) == 0
    assert cmd_jobs(store, out=jobs) == 0
    assert "StageFailed (dead-lettered: retries spent)" in status.getvalue()
    assert "StageFailed (dead-lettered: retries spent): stage train_full exited 1" in jobs.getvalue()
    assert "retryable" not in status.getvalue() + jobs.getvalue()


def test_a_failure_with_retries_left_still_reads_retryable(store):
    """A retryable failure that did not spend the budget is shown as retryable, as before."""
    fail_once(store, retries_spent=False)
    out = io.StringIO()
    cmd_status(store, JOB_ID, as_json=False, out=out)
    assert "StageFailed (retryable)" in out.getvalue()
    assert store.get_job(JOB_ID).error.retries_spent is None


def test_a_watch_ends_at_once_on_a_spent_job(store):
    """status --watch stops at the spent job's first poll (exit 0), as at any permanent error: nothing retries it."""
    fail_once(store, retries_spent=True)
    polls: list[float] = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) > 2:
            raise AssertionError("the watch went on polling a job nothing will retry")

    code = cmd_status(store, JOB_ID, as_json=True, watch_s=1.0, out=io.StringIO(), sleep=sleep, tty=False)
    assert polls == [] and code == 0


def test_the_spent_failure_still_counts_and_the_reconciler_can_apply_the_dlq_copy(store):
    """failedAttempts counts the spent failure, and the record stays open to the reconciler's dead-letter write."""
    fail_once(store, retries_spent=True)
    assert store.get_job(JOB_ID).failed_attempts == 1
    assert store.record_dead_letter(JOB_ID, dead_letter={"messageId": "dlq-1", "receiveCount": 1,
                                                          "errorType": "StageFailed"}, worker="reconciler")
    assert store.get_job(JOB_ID).error.dead_lettered
