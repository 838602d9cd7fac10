"""Store.claim() hands back an Attempt that carries its token; every write it offers is fenced on it."""

from __future__ import annotations

import pytest

from tests.voice.records.conftest import JOB_ID, LEASE_S, MODEL_PATHS, PROFILE_ID, S3_PATHS, claim, submit
from worker.voice.records.errors import StaleWrite, StoreError
from worker.voice.records.rules import is_complete


def test_only_a_claimed_outcome_carries_an_attempt(store, clock):
    """The claim that wins gets an Attempt with its token; a refused claim gets none."""
    submit(store)
    won = claim(store, "t1")
    assert won.outcome == "claimed" and won.attempt is not None
    assert (won.attempt.job_id, won.attempt.profile_id, won.attempt.token, won.attempt.lease_s) == (
        JOB_ID, PROFILE_ID, "t1", LEASE_S)
    lost = claim(store, "t2", owner="w2")
    assert lost.outcome == "held" and lost.attempt is None


def test_an_attempt_commits_in_order_through_its_own_methods(store):
    """renew, progress, write_paths, complete_profile and complete leave the job and profile complete."""
    submit(store)
    attempt = claim(store, "t1").attempt
    assert attempt.renew() is False
    attempt.progress("train_full", 50.0)
    attempt.write_paths(MODEL_PATHS, S3_PATHS)
    attempt.complete_profile()
    attempt.complete()
    assert is_complete(store.get_job(JOB_ID), store.get_profile(PROFILE_ID))


@pytest.mark.parametrize("write", ["renew", "progress", "write_paths", "complete_profile", "complete", "cancel"])
def test_a_superseded_attempt_can_write_nothing(store, clock, write):
    """Once another claim took the job over, every write of the old attempt raises StaleWrite."""
    submit(store)
    old = claim(store, "t1").attempt
    clock.advance(LEASE_S + 1)
    assert claim(store, "t2", owner="w2").outcome == "claimed"
    calls = {"renew": lambda: old.renew(), "progress": lambda: old.progress("x", 1.0),
             "write_paths": lambda: old.write_paths(MODEL_PATHS, S3_PATHS),
             "complete_profile": old.complete_profile, "complete": old.complete, "cancel": old.cancel}
    with pytest.raises(StaleWrite):
        calls[write]()
    assert store.get_job(JOB_ID)["lease"]["token"] == "t2"


def test_release_and_fail_report_whether_they_applied(store, clock):
    """release and fail return False for a superseded attempt and True for the holder."""
    submit(store)
    old = claim(store, "t1").attempt
    clock.advance(LEASE_S + 1)
    new = claim(store, "t2", owner="w2").attempt
    assert old.release() is False and old.fail("DownloadError", "x", retryable=True) is False
    assert new.fail("DownloadError", "timeout", retryable=True) is True
    assert store.get_job(JOB_ID)["status"] == "error"


def test_a_claim_whose_profile_stamp_fails_lets_go_of_the_job(store, monkeypatch):
    """Any failure while stamping the profile releases the just-claimed job (fenced) before it propagates."""
    from worker.voice.records import rules

    submit(store)

    def odd_profile(*_args, **_kwargs):
        raise TypeError("the profile holds data no rule expected")

    monkeypatch.setattr(rules, "stamped_profile", odd_profile)
    with pytest.raises(TypeError):
        claim(store, "t1")
    job = store.get_job(JOB_ID)
    assert job["lease"] is None and job["history"][-1]["outcome"] == "released"
    monkeypatch.undo()
    assert claim(store, "t2", owner="w2").outcome == "claimed"


def test_a_claim_whose_reply_is_lost_lets_go_of_the_job(store):
    """A claim that landed but failed on the way back (StoreError) releases the job before it propagates."""
    submit(store)
    real_swap = store._swap_job

    def landed_then_lost(op, *args):
        result = real_swap(op, *args)
        if op == "claim":
            raise StoreError("connection reset after the write")
        return result

    store._swap_job = landed_then_lost
    with pytest.raises(StoreError):
        claim(store, "t1")
    store._swap_job = real_swap
    job = store.get_job(JOB_ID)
    assert job["lease"] is None and job["history"][-1]["outcome"] == "released"
    assert claim(store, "t2", owner="w2").outcome == "claimed"
