"""The Store contract, part one: submitting and claiming, run against SQLite and MongoDB (mongomock and a real server)."""

from __future__ import annotations

import threading
from datetime import UTC, timedelta

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
from worker.core.errors import InvalidMessage
from worker.voice.records.rules import HISTORY_LIMIT

# ---------------------------------------------------------------- submit

def test_submit_creates_pending_records(store, clock):
    """A submit creates a pending job (zeroed bookkeeping, extras kept) and a pending profile."""
    assert submit(store, metadata={"directoryName": "voice-1"}, status="completed") == (JOB_ID, True)
    job = store.get_job(JOB_ID)
    assert job["_id"] == JOB_ID and isinstance(job["_id"], str)
    assert job["status"] == "pending" and job["attempts"] == 0
    assert job["lease"] is None and job["error"] is None and job["history"] == []
    assert job["cancelRequested"] is False and job["idempotencyKey"] is None
    assert job["metadata"] == {"directoryName": "voice-1"} and job["profileId"] == PROFILE_ID
    assert job["createdAt"] == clock.now and job["createdAt"].tzinfo is not None
    profile = store.get_profile(PROFILE_ID)
    assert profile["_id"] == PROFILE_ID and profile["status"] == "pending"
    assert profile["claims"] == [] and profile["jobId"] == JOB_ID


def test_submit_same_idempotency_key_returns_first_job(store):
    """A key seen before returns the first job's id and creates neither a job nor a profile."""
    assert submit(store, key="req-1") == (JOB_ID, True)
    other_job, other_profile = "a" * 24, "b" * 24
    assert submit(store, other_job, other_profile, key="req-1") == (JOB_ID, False)
    assert store.get_job(other_job) is None and store.get_profile(other_profile) is None
    assert store.get_job(JOB_ID)["idempotencyKey"] == "req-1"


def test_submit_concurrent_same_key_creates_one_job(store):
    """Submits racing with one key from several threads create exactly one job, and all get its id."""
    results: list[tuple[str, bool]] = []
    barrier = threading.Barrier(6)

    def submit_one(n: int) -> None:
        barrier.wait()
        results.append(submit(store, f"{n:024x}", f"{n + 100:024x}", key="race"))

    threads = [threading.Thread(target=submit_one, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [job_id for job_id, created in results if created]
    assert len(winners) == 1
    assert {job_id for job_id, _ in results} == {winners[0]}
    assert sum(store.get_job(f"{n:024x}") is not None for n in range(6)) == 1


def test_submit_without_keys_is_not_deduplicated(store):
    """Jobs submitted without a key never collide with each other on the key."""
    assert submit(store)[1] is True
    assert submit(store, "c" * 24, "d" * 24)[1] is True


def test_submit_existing_job_id_creates_nothing(store, clock):
    """A job id that already exists is reported as not created and its record is left as it was."""
    submit(store)
    claim(store, "t1")
    before = store.get_job(JOB_ID)
    assert submit(store) == (JOB_ID, False)
    assert store.get_job(JOB_ID) == before


def test_submit_rejects_a_job_without_id(store):
    """The caller must generate the job id; a submit without one is an invalid message."""
    with pytest.raises(InvalidMessage):
        store.submit({"profileId": PROFILE_ID}, {"_id": PROFILE_ID})


def test_non_objectid_ids_work(store):
    """Ids that are not 24-hex strings are stored and returned unchanged."""
    assert submit(store, "job-1", "profile-1") == ("job-1", True)
    assert claim(store, "t1", job_id="job-1").outcome == "claimed"
    assert store.get_profile("profile-1")["claims"] == [{"jobId": "job-1", "token": "t1", "epoch": 1}]


# ---------------------------------------------------------------- claim

def test_claim_once(store, clock):
    """A first claim takes the job: processing, a lease, one attempt, a running history entry, the profile stamped."""
    submit(store)
    result = claim(store, "t1")
    assert result.outcome == "claimed" and result.cancel_requested is False
    job = result.job
    assert job == store.get_job(JOB_ID)
    assert job["status"] == "processing" and job["attempts"] == 1
    assert job["lease"] == {"owner": "w1", "token": "t1",
                            "expiresAt": clock.now + timedelta(seconds=LEASE_S), "messageId": None}
    assert job["lease"]["expiresAt"].tzinfo == UTC
    assert job["heartbeatAt"] == clock.now and job["startedAt"] == clock.now
    assert job["history"] == [{"worker": "w1", "token": "t1", "attempt": 1, "start": clock.now, "end": None,
                               "outcome": "running"}]
    profile = store.get_profile(PROFILE_ID)
    assert profile["status"] == "processing" and profile["claims"] == [{"jobId": JOB_ID, "token": "t1", "epoch": 1}]
    assert "claimToken" not in profile
    assert profile["jobId"] == JOB_ID and profile["updatedAt"] == clock.now


def test_second_claim_with_live_lease_is_held(store, clock):
    """While a lease is live another claim gets "held" and changes nothing."""
    submit(store)
    claim(store, "t1")
    before_job, before_profile = store.get_job(JOB_ID), store.get_profile(PROFILE_ID)
    clock.advance(LEASE_S - 0.001)
    result = claim(store, "t2", owner="w2")
    assert result.outcome == "held" and result.job == before_job
    assert store.get_job(JOB_ID) == before_job and store.get_profile(PROFILE_ID) == before_profile


def test_claim_after_expiry_abandons_previous_attempt(store, clock):
    """Once the lease has expired (at its instant exactly) a new claim wins and closes the dead attempt."""
    submit(store)
    claim(store, "t1")
    clock.advance(LEASE_S)
    result = claim(store, "t2", owner="w2")
    assert result.outcome == "claimed"
    job = store.get_job(JOB_ID)
    assert job["attempts"] == 2 and job["lease"]["token"] == "t2"
    assert [entry["outcome"] for entry in job["history"]] == ["abandoned", "running"]
    assert job["history"][0]["end"] == clock.now and job["history"][1]["token"] == "t2"
    assert store.get_profile(PROFILE_ID)["claims"] == [{"jobId": JOB_ID, "token": "t2", "epoch": 2}]


@pytest.mark.parametrize("final", ["completed", "cancelled"])
def test_claim_final_job_reports_its_status(store, final):
    """A completed or cancelled job is never claimed again; the claim says which and changes nothing."""
    submit(store)
    claim(store, "t1")
    if final == "completed":
        commit(store, "t1")
    else:
        store.mark_cancelled(JOB_ID, "t1")
    before = store.get_job(JOB_ID)
    result = claim(store, "t2")
    assert result.outcome == final and result.job == before
    assert store.get_job(JOB_ID) == before


def test_claim_missing_job(store):
    """Claiming a job that does not exist returns "missing" and no record."""
    result = claim(store, "t1")
    assert result.outcome == "missing" and result.job is None


def test_claim_reports_cancel_request_then_cancel(store):
    """A claim of a job whose cancel was requested succeeds, says so, and mark_cancelled finishes it."""
    submit(store)
    assert store.request_cancel(JOB_ID) is True
    result = claim(store, "t1")
    assert result.outcome == "claimed" and result.cancel_requested is True
    store.mark_cancelled(JOB_ID, "t1")
    job = store.get_job(JOB_ID)
    assert job["status"] == "cancelled" and job["lease"] is None
    assert job["history"][-1]["outcome"] == "cancelled"


def test_claim_keeps_a_completed_profile_completed(store):
    """Re-claiming a job whose profile already completed stamps the new token but keeps it completed."""
    submit(store)
    claim(store, "t1")
    store.write_paths(PROFILE_ID, "t1", MODEL_PATHS, S3_PATHS, job_id=JOB_ID)
    store.mark_profile_completed(PROFILE_ID, "t1", job_id=JOB_ID)
    store.record_error(JOB_ID, token="t1", error_type="StoreError", message="down", retryable=True)
    assert claim(store, "t2").outcome == "claimed"
    profile = store.get_profile(PROFILE_ID)
    assert profile["status"] == "completed" and profile["claims"] == [{"jobId": JOB_ID, "token": "t2", "epoch": 2}]


def test_history_keeps_the_last_twenty_attempts(store, clock):
    """History is capped at the newest twenty attempts, the newest last."""
    submit(store)
    for n in range(HISTORY_LIMIT + 5):
        assert claim(store, f"t{n}").outcome == "claimed"
        clock.advance(LEASE_S)
    job = store.get_job(JOB_ID)
    assert job["attempts"] == HISTORY_LIMIT + 5 and len(job["history"]) == HISTORY_LIMIT
    assert job["history"][0]["token"] == "t5" and job["history"][-1]["token"] == f"t{HISTORY_LIMIT + 4}"
    assert [e["outcome"] for e in job["history"]].count("running") == 1


def test_claim_records_the_message_it_came_with(store):
    """The lease names the SQS message that was claimed, so a later delivery of it can be recognised."""
    submit(store)
    result = store.claim(JOB_ID, owner="w1", token="t1", lease_s=LEASE_S, message_id="m-1")
    assert result.job["lease"]["messageId"] == "m-1"
    held = store.claim(JOB_ID, owner="w2", token="t2", lease_s=LEASE_S, message_id="m-1")
    assert held.outcome == "held" and held.job["lease"]["messageId"] == "m-1"
