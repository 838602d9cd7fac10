"""The Store contract, part two: lease, progress, commit, errors and reconcile, against both stores."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.voice.records.conftest import (
    JOB_ID,
    LEASE_S,
    MODEL_PATHS,
    PROFILE_ID,
    S3_PATHS,
    claim,
    commit,
    submit,
)
from worker.voice.records.errors import StaleWrite
from worker.voice.records.rules import ERROR_MESSAGE_MAX_CHARS, is_complete

# ---------------------------------------------------------------- lease, progress, cancel

def test_renew_extends_the_lease(store, clock):
    """A renewal by the holder moves expiresAt and heartbeatAt and reports no cancel request."""
    submit(store)
    claim(store, "t1")
    clock.advance(60)
    assert store.renew_lease(JOB_ID, "t1", LEASE_S) is False
    job = store.get_job(JOB_ID)
    assert job["lease"]["expiresAt"] == clock.now + timedelta(seconds=LEASE_S)
    assert job["heartbeatAt"] == clock.now and job["lease"]["owner"] == "w1"


def test_renew_with_a_wrong_token_is_stale(store):
    """A renewal with a token that does not hold the lease raises StaleWrite and changes nothing."""
    submit(store)
    claim(store, "t1")
    before = store.get_job(JOB_ID)
    with pytest.raises(StaleWrite):
        store.renew_lease(JOB_ID, "other", LEASE_S)
    assert store.get_job(JOB_ID) == before
    with pytest.raises(StaleWrite):
        store.renew_lease("f" * 24, "t1", LEASE_S)


def test_renew_after_completion_is_stale(store):
    """Once the job is committed a late renewal cannot touch it."""
    submit(store)
    claim(store, "t1")
    commit(store, "t1")
    with pytest.raises(StaleWrite):
        store.renew_lease(JOB_ID, "t1", LEASE_S)


def test_request_cancel_then_renew_returns_true(store):
    """The holder's next renewal reports a cancel requested meanwhile."""
    submit(store)
    claim(store, "t1")
    assert store.request_cancel(JOB_ID) is True
    assert store.renew_lease(JOB_ID, "t1", LEASE_S) is True


def test_request_cancel_refuses_missing_and_final_jobs(store):
    """A cancel request for a missing, completed or cancelled job is refused and changes nothing."""
    assert store.request_cancel(JOB_ID) is False
    submit(store)
    claim(store, "t1")
    commit(store, "t1")
    assert store.request_cancel(JOB_ID) is False
    assert store.get_job(JOB_ID)["cancelRequested"] is False
    submit(store, "e" * 24, "f" * 24)
    claim(store, "t2", job_id="e" * 24)
    store.mark_cancelled("e" * 24, "t2")
    assert store.request_cancel("e" * 24) is False


def test_set_progress_is_fenced(store, clock):
    """The holder records progress; any other token gets StaleWrite."""
    submit(store)
    claim(store, "t1")
    store.set_progress(JOB_ID, "t1", "train_full", 42.5)
    assert store.get_job(JOB_ID)["progress"] == {"stage": "train_full", "percent": 42.5,
                                                 "updatedAt": clock.now}
    with pytest.raises(StaleWrite):
        store.set_progress(JOB_ID, "other", "train_full", 50)
    assert store.get_job(JOB_ID)["progress"]["percent"] == 42.5


def test_mark_cancelled_with_a_wrong_token_is_stale(store):
    """Only the holder can mark a job cancelled."""
    submit(store)
    claim(store, "t1")
    with pytest.raises(StaleWrite):
        store.mark_cancelled(JOB_ID, "other")
    assert store.get_job(JOB_ID)["status"] == "processing"


def test_release_lets_another_claim_at_once(store, clock):
    """A released lease is free at once: status stays processing and the next claim wins immediately."""
    submit(store)
    claim(store, "t1")
    assert store.release_lease(JOB_ID, "t1") is True
    job = store.get_job(JOB_ID)
    assert job["status"] == "processing" and job["lease"] is None
    assert job["history"][-1]["outcome"] == "released" and job["history"][-1]["end"] == clock.now
    assert claim(store, "t2", owner="w2").outcome == "claimed"
    job = store.get_job(JOB_ID)
    assert [e["outcome"] for e in job["history"]] == ["released", "running"]
    assert job["attempts"] == 2


def test_release_with_a_wrong_token_does_nothing(store):
    """Releasing a lease held by another token returns False and leaves the lease alone."""
    submit(store)
    claim(store, "t1")
    assert store.release_lease(JOB_ID, "other") is False
    assert store.get_job(JOB_ID)["lease"]["token"] == "t1"


# ---------------------------------------------------------------- commit

def test_commit_sequence_completes_both_records(store, clock):
    """Paths, profile completion and the job's commit marker make the pair complete."""
    submit(store)
    claim(store, "t1")
    store.set_progress(JOB_ID, "t1", "train_full", 100)
    commit(store, "t1")
    job, profile = store.get_job(JOB_ID), store.get_profile(PROFILE_ID)
    assert is_complete(job, profile)
    assert profile["modelPaths"] == MODEL_PATHS and profile["s3Paths"] == S3_PATHS
    assert job["completedAt"] == clock.now and job["lease"] is None and job["error"] is None
    assert job["history"][-1]["outcome"] == "completed"


def test_the_commit_marker_records_the_committed_artifact_keys(store):
    """mark_job_completed keeps the keys the commit wrote on the job record (what is_complete judges)."""
    submit(store)
    claim(store, "t1")
    store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    store.mark_profile_completed(PROFILE_ID, "t1", job_id=JOB_ID)
    store.mark_job_completed(JOB_ID, "t1", artifacts=[*MODEL_PATHS, "vocoder"])
    job, profile = store.get_job(JOB_ID), store.get_profile(PROFILE_ID)
    assert job["artifacts"] == [*MODEL_PATHS, "vocoder"]
    assert not is_complete(job, profile)  # the profile lacks the sixth the job says it committed


def test_replaced_token_cannot_commit(store, clock):
    """A worker whose token was replaced cannot write paths or mark anything completed, and nothing changes."""
    submit(store)
    claim(store, "t1")
    clock.advance(LEASE_S + 1)
    claim(store, "t2", owner="w2")
    before_job, before_profile = store.get_job(JOB_ID), store.get_profile(PROFILE_ID)
    with pytest.raises(StaleWrite):
        store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    with pytest.raises(StaleWrite):
        store.mark_profile_completed(PROFILE_ID, "t1", job_id=JOB_ID)
    with pytest.raises(StaleWrite):
        store.mark_job_completed(JOB_ID, "t1")
    assert store.get_job(JOB_ID) == before_job and store.get_profile(PROFILE_ID) == before_profile


def test_commit_on_a_missing_profile_is_stale(store):
    """Fenced profile writes on a profile that does not exist raise StaleWrite."""
    with pytest.raises(StaleWrite):
        store.write_paths("f" * 24, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    with pytest.raises(StaleWrite):
        store.mark_profile_completed("f" * 24, "t1", job_id=JOB_ID)


def test_completion_clears_an_earlier_error(store):
    """A job that failed once and then succeeds carries no error."""
    submit(store)
    claim(store, "t1")
    store.record_error(JOB_ID, token="t1", error_type="StageFailed", message="exit 1", retryable=True)
    claim(store, "t2")
    commit(store, "t2")
    job = store.get_job(JOB_ID)
    assert job["status"] == "completed" and job["error"] is None
    assert [e["outcome"] for e in job["history"]] == ["retry", "completed"]


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("retryable,outcome", [(True, "retry"), (False, "error")])
def test_record_error_by_the_holder(store, clock, retryable, outcome):
    """The holder's error sets status error with details, clears the lease and closes its attempt."""
    submit(store)
    claim(store, "t1")
    assert store.record_error(JOB_ID, token="t1", error_type="StageFailed", message="exit 1",
                              retryable=retryable) is True
    job = store.get_job(JOB_ID)
    assert job["status"] == "error" and job["lease"] is None
    assert job["error"] == {"type": "StageFailed", "message": "exit 1", "retryable": retryable,
                            "at": clock.now}
    assert job["history"][-1]["outcome"] == outcome and job["history"][-1]["end"] == clock.now
    assert claim(store, "t2").outcome == "claimed"


def test_record_error_with_a_wrong_token_changes_nothing(store):
    """An error from a token that does not hold the job is not recorded."""
    submit(store)
    claim(store, "t1")
    before = store.get_job(JOB_ID)
    assert store.record_error(JOB_ID, token="old", error_type="X", message="m", retryable=True) is False
    assert store.get_job(JOB_ID) == before


@pytest.mark.parametrize("token", ["t1", None])
def test_record_error_never_touches_a_completed_job(store, clock, token):
    """A completed job keeps its state whatever error arrives afterwards, with or without a token."""
    submit(store)
    claim(store, "t1")
    commit(store, "t1")
    clock.advance(LEASE_S * 2)
    before = store.get_job(JOB_ID)
    assert store.record_error(JOB_ID, token=token, error_type="X", message="m", retryable=False) is False
    assert store.get_job(JOB_ID) == before


def test_record_error_never_touches_a_cancelled_job(store):
    """A cancelled job keeps its state when an error arrives without a token."""
    submit(store)
    claim(store, "t1")
    store.mark_cancelled(JOB_ID, "t1")
    before = store.get_job(JOB_ID)
    assert store.record_error(JOB_ID, token=None, error_type="X", message="m", retryable=False) is False
    assert store.get_job(JOB_ID) == before


def test_record_error_without_token_respects_a_live_lease(store, clock):
    """Without a token an error is recorded on an unclaimed or expired job, never over a live lease."""
    submit(store)
    assert store.record_error(JOB_ID, token=None, error_type="InvalidMessage", message="bad",
                              retryable=False) is True
    assert store.get_job(JOB_ID)["status"] == "error"
    claim(store, "t1")
    before = store.get_job(JOB_ID)
    assert store.record_error(JOB_ID, token=None, error_type="X", message="m", retryable=False) is False
    assert store.get_job(JOB_ID) == before
    clock.advance(LEASE_S)
    assert store.record_error(JOB_ID, token=None, error_type="X", message="m", retryable=False) is True
    job = store.get_job(JOB_ID)
    assert job["status"] == "error" and job["history"][-1]["outcome"] == "abandoned"


def test_record_error_on_a_missing_job(store):
    """An error for a job that does not exist is reported as not recorded."""
    assert store.record_error(JOB_ID, token=None, error_type="X", message="m", retryable=True) is False


def test_record_error_bounds_the_message(store):
    """A huge error message is truncated so the record stays small."""
    submit(store)
    store.record_error(JOB_ID, token=None, error_type="X", message="x" * 100_000, retryable=True)
    assert len(store.get_job(JOB_ID)["error"]["message"]) == ERROR_MESSAGE_MAX_CHARS


# ---------------------------------------------------------------- reconcile

def test_find_stale_lists_processing_jobs_without_a_live_lease(store, clock):
    """Expired and released processing jobs are stale; live, pending and completed ones are not."""
    ids = [f"{n:024x}" for n in range(1, 6)]
    for job_id in ids:
        submit(store, job_id, job_id[::-1])
    claim(store, "expired", job_id=ids[0])
    claim(store, "released", job_id=ids[1])
    store.release_lease(ids[1], "released")
    claim(store, "done", job_id=ids[2])
    store.mark_job_completed(ids[2], "done")
    clock.advance(LEASE_S)
    claim(store, "live", job_id=ids[3])
    assert sorted(job["_id"] for job in store.find_stale()) == sorted(ids[:2])
    assert len(store.find_stale(limit=1)) == 1
