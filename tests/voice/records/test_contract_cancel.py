"""A cancel request is refused once the running attempt has begun committing, and only then."""

from __future__ import annotations

from tests.voice.records.conftest import JOB_ID, LEASE_S, claim, submit
from worker.voice.records.rules import COMMITTING


def test_a_cancel_request_is_refused_while_the_attempt_commits(store):
    """After the attempt writes the committing stage, request_cancel changes nothing and says so."""
    submit(store)
    attempt = claim(store, "t1").attempt
    attempt.progress(COMMITTING, 100.0)
    assert store.request_cancel(JOB_ID) is False
    assert store.get_job(JOB_ID)["cancelRequested"] is False


def test_a_cancel_request_is_taken_before_the_commit_and_once_its_lease_lapsed(store, clock):
    """Training progress does not block a cancel, nor does a committing stage whose attempt's lease ran out."""
    submit(store)
    attempt = claim(store, "t1").attempt
    attempt.progress("train_full", 40.0)
    assert store.request_cancel(JOB_ID) is True
    attempt.progress(COMMITTING, 100.0)
    clock.advance(LEASE_S + 1)
    assert store.request_cancel(JOB_ID) is True
