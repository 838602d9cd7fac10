"""The shared rules on a record another writer malformed: a fence refuses, an error write replaces."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from worker.voice.records.models import read_job
from worker.voice.records.rules import (
    close_attempt,
    committing,
    errored,
    failed_attempts,
    holds_lease,
    lease_live,
    may_record_error,
    with_gpu_seconds,
)

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
LATER = NOW + timedelta(minutes=5)


@pytest.mark.parametrize("lease", ["w1", ["t"], {"token": "t"}, {"token": "t", "expiresAt": "soon"},
                                   {"token": "t", "expiresAt": LATER.replace(tzinfo=None)}])
def test_a_malformed_lease_is_not_live(lease):
    """A lease that is no document, or has no aware time of its end, is held by no attempt: not live."""
    assert lease_live({"status": "processing", "lease": lease}, NOW) is False


def test_a_lease_that_is_no_document_holds_no_token():
    """The fence of an attempt's writes refuses, rather than fails, on a lease written as text."""
    assert holds_lease({"status": "processing", "lease": "t"}, "t") is False


@pytest.mark.parametrize("history", ["oops", {"0": {}}, [None, "x"], 42])
def test_closing_an_attempt_drops_what_is_no_entry(history):
    """A history that is no list, or entries that are no documents, close as an empty history."""
    assert close_attempt(history, "retry", NOW) == []
    assert with_gpu_seconds({"history": history}, "t", 5.0) == {"history": history}


@pytest.mark.parametrize("count, expected", [("two", 0), ("2", 0), (None, 0), (float("nan"), 0), (-1, 0),
                                             (True, 0), (2, 2), (3.0, 3)])
def test_a_failed_attempts_count_that_is_no_count_reads_as_none(count, expected):
    """Only a whole number counts; any other value reads as no failed attempts, to be written over."""
    assert failed_attempts(read_job({"failedAttempts": count})) == expected


def test_an_error_found_before_a_claim_replaces_the_malformed_fields():
    """With no live lease to trample, the error write lands on a mangled record and replaces lease, history and count."""
    job = {"_id": "j", "status": "processing", "lease": "w1", "history": "oops", "failedAttempts": "two"}
    assert may_record_error(job, None, NOW)
    new = errored(job, token=None, error_type="MalformedRecord", message="m", retryable=False, now=NOW)
    assert (new["lease"], new["history"], new["failedAttempts"], new["error"]["type"]) == (
        None, [], 0, "MalformedRecord")


@pytest.mark.parametrize("progress", ["(committing)", {"stage": "(committing)", "updatedAt": "now"},
                                      {"stage": "(committing)", "updatedAt": LATER.replace(tzinfo=None)}])
def test_a_malformed_progress_is_not_committing(progress):
    """A progress no attempt wrote (text, a time as text or naive) never makes a cancel too late."""
    job = {"status": "processing", "startedAt": NOW, "progress": progress,
           "lease": {"token": "t", "expiresAt": LATER + timedelta(minutes=5)}}
    assert committing(job, NOW) is False


@pytest.mark.parametrize("fields", [
    {"lease": "w1"}, {"lease": {"expiresAt": "yesterday"}}, {"lease": None, "heartbeatAt": "x"},
    {"history": "oops"}, {"history": ["oops"]}, {"deadLetters": "m-1"},
])
def test_the_reconcilers_rules_never_raise_on_a_malformed_record(fields):
    """Lost-worker and dead-letter decisions, and what they write, take any shape another writer left."""
    from worker.voice.records import recovery

    now = datetime(2024, 5, 1, tzinfo=UTC)
    job = {"_id": "j", "status": "processing", "startedAt": datetime(2024, 4, 1, tzinfo=UTC), **fields}
    recovery.worker_lost(job, now, 60)
    recovery.lost(job, worker="r", now=now)
    assert recovery.may_record_dead_letter(job, "m-2", now) in (True, False)
    written = recovery.dead_lettered(job, {"messageId": "m-2", "receiveCount": 5}, worker="r", now=now)
    assert written["deadLetters"] == ["m-2"]  # not the characters of a text someone left there
