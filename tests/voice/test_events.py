"""The job's recorded outcomes are announced as state-change events (worker.core.events), once each."""

from __future__ import annotations

import pytest

from pipeline.errors import BadRecording, StageFailed
from tests.voice.conftest import BUCKET, JOB_ID, PROFILE_ID, deliver
from worker.voice.artifacts import ArtifactUploader
from worker.voice.job import HandlerConfig, VoiceJobHandler


class Collected:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def publish(self, event_type, detail):
        self.events.append((event_type, dict(detail)))


@pytest.fixture
def announced(store, s3, train, tmp_path):
    events = Collected()
    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="models", worker_id="w",
                                            lease_s=60, max_failed_attempts=2),
                              store=store, uploader=ArtifactUploader(s3, BUCKET), train=train, events=events)
    return handler, events


def test_failures_are_announced_as_failed_until_the_retry_budget_is_spent(announced, train):
    """A recorded retryable failure is JobFailed; the one that spends the budget is JobDeadLettered."""
    handler, events = announced

    def fails(*_args):
        raise StageFailed("stage train_full exited with code 1")

    train.during = fails
    for receive in (1, 2):
        with pytest.raises(Exception):  # noqa: B017 - the settled error is the retry budget's subject
            deliver(handler, receive, message_id=f"m-{receive}")
    assert [t for t, _ in events.events] == ["JobFailed", "JobDeadLettered"]
    failed = events.events[0][1]
    assert (failed["jobId"], failed["profileId"], failed["environment"]) == (JOB_ID, PROFILE_ID, "production")
    assert failed["error"]["type"] == "StageFailed" and failed["error"]["retryable"] is True
    assert events.events[1][1]["error"]["type"] == "StageFailed" and events.events[1][1]["failedAttempts"] == 2


def test_a_commit_is_announced_with_its_paths_and_a_redelivery_announces_nothing(announced, train):
    """JobCompleted carries the committed s3Paths; a redelivery after the commit publishes nothing."""
    handler, events = announced
    assert deliver(handler, 1) == "completed"
    [(kind, detail)] = events.events
    assert kind == "JobCompleted" and detail["attempts"] == 1
    assert set(detail["s3Paths"]) == {"fullModel", "fullConfig", "speakerEmbeddings", "lightModel", "lightConfig"}
    assert all(uri.startswith(f"s3://{BUCKET}/") for uri in detail["s3Paths"].values())
    assert deliver(handler, 2, message_id="m-2") == "already_complete"
    assert len(events.events) == 1


def test_a_permanent_failure_is_announced_as_dead_lettered(announced, train):
    """An error no retry can fix is JobDeadLettered, not JobFailed."""
    handler, events = announced

    def bad(*_args):
        raise BadRecording("input[0]: not audio")

    train.during = bad
    with pytest.raises(BadRecording):
        deliver(handler, 1)
    assert [(t, d["error"]["retryable"]) for t, d in events.events] == [("JobDeadLettered", False)]


def test_a_cancel_is_announced(announced, raw_store):
    """A job cancelled before its claim is JobCancelled."""
    handler, events = announced
    assert raw_store.request_cancel(JOB_ID)
    assert deliver(handler, 1) == "cancelled"
    assert [t for t, _ in events.events] == ["JobCancelled"]
