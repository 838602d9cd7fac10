"""The store's claim token decides whether a commit write lands; the SQS lease is a signal to stop.

The commit checks the heartbeat's lease between its steps, so a write already past the last check may
land after the heartbeat declared the SQS lease lost: safe, since the store still held our token (the
fault soaks saw a commit marker 5 ms and 3.8 s after the heartbeat's ``lease_lost``). Had another
attempt claimed the job, the same write would be refused (``StaleWrite``) and nothing committed.
"""

from __future__ import annotations

import pytest

from tests.voice.conftest import BUCKET, JOB_ID, PROFILE_ID, message_body, take_over
from worker.core.errors import LeaseLost
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.errors import StaleWrite
from worker.voice.records.rules import is_complete


@pytest.fixture
def voice_handler(store, s3, train, tmp_path):
    """The handler with a record lease far longer than the test (the store's clock is real time)."""
    return VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="test-worker",
                                         lease_s=30),
                           store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)


def recording(handler, leases: list, returned: list):
    def handle(message, lease):
        leases.append(lease)
        returned.append(handler(message, lease))
        return returned[-1]
    return handle


def test_a_commit_marker_in_flight_when_the_sqs_lease_is_lost_lands_and_the_message_is_left_to_sqs(
        memory_queue, make_memory_worker, fake_clock, voice_handler, store, raw_store, recorder):
    """The heartbeat loses the SQS lease after the commit's last lease check, just before the marker: the
    marker lands because the store still holds our token, the job is committed, and the loop, seeing the
    lease lost, abandons the message (no delete); its redelivery is acknowledged as already complete."""
    leases: list = []
    returned: list = []
    checks_passed: list[bool] = []

    def sqs_lease_lost_just_before_the_marker():
        checks_passed.append(not leases[0].lost)  # the commit's last check saw a live lease
        memory_queue.faults["extend"] = lambda message: LeaseLost("ReceiptHandleIsInvalid")
        assert fake_clock.advance(1, until=lambda: leases[0].lost)  # the next tick's renewal is refused
        return None  # then the marker itself, unchanged

    store.faults["mark_job_completed"] = sqs_lease_lost_just_before_the_marker
    worker = make_memory_worker(recording(voice_handler, leases, returned))
    memory_queue.send(message_body())

    assert worker.run_once() == "abandon"
    assert checks_passed == [True] and "ReceiptHandleIsInvalid" in (leases[0].lost_reason or "")
    assert returned == ["completed"]  # the handler committed and returned to acknowledge
    job, profile = raw_store.get_job(JOB_ID), raw_store.get_profile(PROFILE_ID)
    assert job["status"] == "completed" and is_complete(job, profile)
    assert recorder.calls[-1] == "store.mark_job_completed"
    assert "delete" not in memory_queue.ops()
    assert [held.message_id for held in memory_queue.messages] == ["m-1"]  # left to its visibility

    # SQS redelivers once the visibility lapses: a redelivery of a completed job, acknowledged without work.
    memory_queue.faults.clear()
    store.faults.clear()
    fake_clock.advance(3)
    assert worker.run_once() == "ack"
    assert returned[-1] == "already_complete" and memory_queue.messages == []


def test_a_commit_marker_after_another_claim_took_the_token_is_refused_and_nothing_is_committed(
        memory_queue, make_memory_worker, voice_handler, store, raw_store, clock):
    """The record lease lapsed and another worker claimed the job between the last check and the marker:
    the marker is refused (StaleWrite), the job is not completed and stays the new holder's, and the
    message is not deleted (StaleWrite's retry backoff)."""
    leases: list = []
    returned: list = []
    refused: list[Exception] = []

    def another_worker_claims_first():
        take_over(raw_store, clock)  # our record lease lapsed on the store's clock
        return None  # then our marker, fenced on our (replaced) token

    real_mark = raw_store.mark_job_completed

    def watched_mark(*args, **kwargs):
        try:
            return real_mark(*args, **kwargs)
        except StaleWrite as exc:
            refused.append(exc)
            raise

    store.faults["mark_job_completed"] = another_worker_claims_first
    raw_store.mark_job_completed = watched_mark
    worker = make_memory_worker(recording(voice_handler, leases, returned))
    memory_queue.send(message_body())

    assert worker.run_once() == "retry"
    assert len(refused) == 1 and returned == [] and not leases[0].lost
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == "processing" and job["lease"]["token"] == "token-b" and job["lease"]["owner"] == "worker-b"
    assert not is_complete(job, raw_store.get_profile(PROFILE_ID))
    assert "delete" not in memory_queue.ops()
    assert [held.message_id for held in memory_queue.messages] == ["m-1"]
