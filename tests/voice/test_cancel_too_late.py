"""Once an attempt begins committing, a cancel is refused as too late; one that landed before is honoured."""

from __future__ import annotations

import io

import pytest

from tests.voice.conftest import JOB_ID, PROFILE_ID, deliver
from worker.ops.commands import EXIT_TOO_LATE, cmd_cancel
from worker.voice.records.rules import COMMITTING, is_complete


def test_a_cancel_during_the_commit_is_too_late_and_the_job_completes(handler, store, raw_store):
    """A cancel issued while the paths are written exits 5 without requesting anything, and the job completes."""
    answers = []

    def cancel_now():
        err = io.StringIO()
        answers.append((cmd_cancel(raw_store, JOB_ID, heartbeat_s=10, out=io.StringIO(), err=err),
                        err.getvalue()))

    store.faults["write_paths"] = cancel_now
    assert deliver(handler, receive_count=1) == "completed"
    [(code, text)] = answers
    assert code == EXIT_TOO_LATE and "too late to cancel" in text
    job = raw_store.get_job(JOB_ID)
    assert job["cancelRequested"] is False
    assert is_complete(job, raw_store.get_profile(PROFILE_ID))


def test_a_cancel_that_landed_just_before_the_commit_is_honoured(handler, raw_store, recorder, train):
    """A cancel requested after the last heartbeat but before the committing stage stops the job before any upload."""
    def cancel_at_the_end(job, work_dir, stop, progress):
        assert raw_store.request_cancel(JOB_ID)

    train.during = cancel_at_the_end
    assert deliver(handler, receive_count=1) == "cancelled"
    assert raw_store.get_job(JOB_ID)["status"] == "cancelled"
    assert not [c for c in recorder.calls if c.startswith("s3.")], "a cancelled job uploaded its models"


def test_the_committing_stage_is_written_before_the_first_upload(handler, raw_store, monkeypatch):
    """When the uploads begin, the job record already says the attempt is committing."""
    seen = []
    upload_all = handler._commit._uploader.upload_all

    def upload_and_look(*args, **kwargs):
        seen.append(raw_store.get_job(JOB_ID)["progress"]["stage"])
        return upload_all(*args, **kwargs)

    monkeypatch.setattr(handler._commit._uploader, "upload_all", upload_and_look)
    assert deliver(handler, receive_count=1) == "completed"
    assert seen == [COMMITTING]


def test_a_cancel_after_an_attempt_died_mid_commit_lets_the_next_attempt_finish_it(handler, store, raw_store):
    """Once an earlier attempt wrote its published paths, a later cancel is too late: the retry commits."""
    from worker.voice.records.errors import StoreError

    store.faults["mark_job_completed"] = lambda: StoreError("the worker died here")
    with pytest.raises(StoreError):
        deliver(handler, receive_count=1)
    assert raw_store.get_profile(PROFILE_ID)["status"] == "completed"  # steps 3 and 4 landed
    assert raw_store.request_cancel(JOB_ID)
    del store.faults["mark_job_completed"]
    assert deliver(handler, receive_count=2) == "completed"
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == "completed" and is_complete(job, raw_store.get_profile(PROFILE_ID))
