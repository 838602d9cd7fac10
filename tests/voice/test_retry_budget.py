"""Interruptions don't spend the retry budget: only recorded retryable failures count toward
MAX_FAILED_ATTEMPTS, after which the worker dead-letters the job itself; SQS's receive count is the backstop."""

from __future__ import annotations

from datetime import timedelta

import pytest

from pipeline.errors import StageFailed
from tests.voice.conftest import BUCKET, JOB_ID, PROFILE_ID, message_body
from worker.core.errors import QueueError, Stopped
from worker.core.testing import MemoryQueue
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler
from worker.voice.records.errors import StoreError
from worker.voice.records.rules import failed_attempts, is_complete

# The template's RedrivePolicy: SQS moves a message only after this many receives.
BACKSTOP_RECEIVES = 20
# No backoff: a retried message is visible again at once.
NO_BACKOFF = {"SQS_RETRY_VISIBILITY_BASE_SECONDS": 0}


@pytest.fixture
def queue(fake_clock):
    return MemoryQueue(fake_clock, url="memory://jobs", max_receive_count=BACKSTOP_RECEIVES,
                       dead_letter_queue=MemoryQueue(fake_clock, url="memory://jobs-dlq"))


def interrupted(times: int):
    """A trainer stand-in stopped for shutdown (SIGTERM, drain past its deadline) on its first ``times`` runs."""
    def during(job, work_dir, stop, progress):
        if during.runs < times:
            during.runs += 1
            raise Stopped(Stopped.SHUTDOWN, "SIGTERM")
    during.runs = 0
    return during


def failing(job, work_dir, stop, progress):
    raise StageFailed("stage train_full exited 1")


def test_a_job_released_six_times_by_shutdown_still_completes(queue, make_memory_worker, handler, raw_store, train):
    """Six shutdown releases take six receives and spend no retry: the seventh receive completes the job."""
    train.during = interrupted(6)
    receive_counts = []

    def counting(message, lease):
        receive_counts.append(message.receive_count)
        return handler(message, lease)

    worker = make_memory_worker(counting, queue=queue, **NO_BACKOFF)
    queue.send(message_body())
    actions = [worker.run_once() for _ in range(7)]
    assert actions == ["release"] * 6 + ["ack"]
    assert receive_counts == [1, 2, 3, 4, 5, 6, 7]  # past the old maxReceiveCount of 5
    job = raw_store.get_job(JOB_ID)
    assert is_complete(job, raw_store.get_profile(PROFILE_ID))
    assert job["attempts"] == 7 and failed_attempts(job) == 0
    assert [entry["outcome"] for entry in job["history"]] == ["released"] * 6 + ["completed"]
    assert queue.counts() == (0, 0) and queue.dead_letter_queue.messages == []


def test_a_job_failing_retryably_every_time_is_dead_lettered_by_the_worker_after_five(
        queue, make_memory_worker, handler, raw_store, train):
    """Four retries, then the fifth recorded failure dead-letters the message with its error attributes and
    records on the job, in the same write, that its retries are spent."""
    train.during = failing
    worker = make_memory_worker(handler, queue=queue, **NO_BACKOFF)
    queue.send(message_body())
    actions = [worker.run_once() for _ in range(5)]
    assert actions == ["retry"] * 4 + ["dead_letter"]
    assert queue.counts() == (0, 0) and train.runs == 5
    (copy,) = queue.dead_letter_queue.messages
    assert copy.message_attributes["ErrorType"]["StringValue"] == "StageFailed"
    assert copy.message_attributes["ErrorMessage"]["StringValue"] == (
        "5 failed attempts (MAX_FAILED_ATTEMPTS=5); the last: stage train_full exited 1")
    assert copy.message_attributes["ReceiveCount"]["StringValue"] == "5"
    job = raw_store.get_job(JOB_ID)
    assert failed_attempts(job) == 5 and job["status"] == "error"
    # Said at once on the record (defect 5), not "retryable" until the reconciler applies the DLQ copy.
    assert job["error"]["type"] == "StageFailed" and job["error"]["retryable"] is False
    assert job["error"]["retriesSpent"] is True and job["history"][-1]["outcome"] == "error"


def test_the_limit_is_the_setting(queue, make_memory_worker, store, s3, train, tmp_path):
    """With MAX_FAILED_ATTEMPTS=2 the second recorded failure dead-letters the message."""
    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="test-worker",
                                            lease_s=2, max_failed_attempts=2),
                              store=store, uploader=ArtifactUploader(s3, BUCKET), train=train)
    train.during = failing
    worker = make_memory_worker(handler, queue=queue, **NO_BACKOFF)
    queue.send(message_body())
    assert [worker.run_once() for _ in range(2)] == ["retry", "dead_letter"]


def test_interruptions_between_failures_leave_the_budget_whole(queue, make_memory_worker, handler, raw_store, train):
    """Releases mixed into failures: only the four failures count, so the job is still retried, not dead-lettered."""
    runs = iter(["fail", "stop", "fail", "stop", "stop", "fail", "fail", "stop"])

    def during(job, work_dir, stop, progress):
        kind = next(runs, None)
        if kind == "fail":
            failing(job, work_dir, stop, progress)
        if kind == "stop":
            raise Stopped(Stopped.SHUTDOWN, "SIGTERM")

    train.during = during
    worker = make_memory_worker(handler, queue=queue, **NO_BACKOFF)
    queue.send(message_body())
    actions = [worker.run_once() for _ in range(9)]
    assert actions.count("retry") == 4 and actions.count("release") == 4 and actions[-1] == "ack"
    job = raw_store.get_job(JOB_ID)
    assert job["status"] == "completed" and failed_attempts(job) == 4


def test_a_failure_that_could_not_be_recorded_spends_no_retry(queue, make_memory_worker, handler, store, raw_store,
                                                               train, clock):
    """Like a crash, a failure the store never heard of is not counted: SQS's receive count is the backstop."""
    train.during = failing
    store.faults["record_error"] = lambda: StoreError("store unavailable")
    worker = make_memory_worker(handler, queue=queue, **NO_BACKOFF)
    queue.send(message_body())
    actions = []
    for _ in range(6):
        actions.append(worker.run_once())
        clock.offset += timedelta(seconds=3)  # the unreleased record lease lapses before the next receive
    assert actions == ["retry"] * 6 and train.runs == 6
    assert failed_attempts(raw_store.get_job(JOB_ID)) == 0
    assert queue.dead_letter_queue.messages == []


def test_an_unrecorded_failure_at_the_last_retry_is_retried_not_dead_lettered(
        queue, make_memory_worker, handler, store, raw_store, train):
    """Four failures recorded, then a fifth the store never heard of: it spends nothing, so it is retried."""
    for n in range(4):
        raw_store.claim(JOB_ID, owner="w-1", token=f"t-{n}", lease_s=60).attempt.fail(
            "StageFailed", "exit 1", retryable=True)
    train.during = failing
    store.faults["record_error"] = lambda: StoreError("store unavailable")
    worker = make_memory_worker(handler, queue=queue, **NO_BACKOFF)
    queue.send(message_body())
    assert worker.run_once() == "retry"
    assert failed_attempts(raw_store.get_job(JOB_ID)) == 4 and queue.dead_letter_queue.messages == []


def test_a_crash_that_recorded_nothing_spends_no_retry(queue, make_memory_worker, handler, raw_store, train, clock):
    """An attempt that died holding the job (its lease lapsed, nothing recorded) leaves the budget as it was."""
    crashed = raw_store.claim(JOB_ID, owner="w-dead", token="t-dead", lease_s=2, message_id="m-old")
    assert crashed.attempt is not None
    clock.offset += timedelta(seconds=3)  # its record lease lapses
    train.during = failing
    worker = make_memory_worker(handler, queue=queue, **NO_BACKOFF)
    queue.send(message_body())
    actions = [worker.run_once() for _ in range(5)]
    # Five failures of its own after the crash: the crashed attempt did not bring the limit closer.
    assert actions == ["retry"] * 4 + ["dead_letter"]
    job = raw_store.get_job(JOB_ID)
    assert job["attempts"] == 6 and failed_attempts(job) == 5
    assert job["history"][0]["outcome"] == "abandoned"


def test_a_redelivery_of_the_dead_lettered_message_goes_back_without_work(
        queue, make_memory_worker, handler, raw_store, train, recorder, fake_clock):
    """The message the budget dead-lettered, redelivered because its delete failed, is not trained again."""
    train.during = failing
    worker = make_memory_worker(handler, queue=queue, SQS_VISIBILITY_TIMEOUT_SECONDS=1,
                                SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=300, **NO_BACKOFF)
    queue.send(message_body())
    assert [worker.run_once() for _ in range(4)] == ["retry"] * 4
    failures = iter([QueueError("DeleteMessage failed: InternalError")])
    queue.faults["delete"] = lambda message: next(failures, None)
    assert worker.run_once() == "dead_letter"
    assert queue.counts() == (0, 1) and train.runs == 5
    recorder.calls.clear()
    fake_clock.advance(1.2)  # its visibility runs out: the redelivery
    assert worker.run_once() == "dead_letter"
    assert train.runs == 5 and recorder.calls == []
    assert queue.counts() == (0, 0) and len(queue.dead_letter_queue.messages) == 2
    assert failed_attempts(raw_store.get_job(JOB_ID)) == 5
