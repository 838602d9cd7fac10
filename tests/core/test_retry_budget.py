"""The retry budget: a recorded retryable failure that reaches MAX_FAILED_ATTEMPTS dead-letters the message."""

from __future__ import annotations

import pytest

from pipeline.errors import BadRecording, DownloadError, StageFailed
from worker.core.errors import Action, RetriesExhausted, Stopped, WorkerError
from worker.core.loop import retry_budget, spend_retry


@pytest.mark.parametrize("failed_attempts,limit,error,action", [
    (1, 5, StageFailed("exit 1"), Action.RETRY),
    (4, 5, StageFailed("exit 1"), Action.RETRY),
    (5, 5, StageFailed("exit 1"), Action.DEAD_LETTER),
    (6, 5, DownloadError("timeout"), Action.DEAD_LETTER),
    (1, 1, DownloadError("timeout"), Action.DEAD_LETTER),
    # Not retryable: never counted, each keeps its own action whatever the count says.
    (9, 5, BadRecording("not audio"), Action.DEAD_LETTER),
    (9, 5, Stopped(Stopped.SHUTDOWN), Action.RELEASE),
    (9, 5, Stopped(Stopped.LEASE_LOST), Action.ABANDON),
    (9, 5, WorkerError("a config error inside a job"), Action.RETRY),
])
def test_the_budget_decides_from_the_failed_count_the_limit_and_the_error(failed_attempts, limit, error, action):
    """Only a retryable failure that brings the count to the limit turns into a dead letter."""
    assert retry_budget(failed_attempts, limit, error) is action


def test_the_last_allowed_failure_is_dead_lettered_under_its_own_type():
    """Past the budget the error becomes RetriesExhausted, permanent, with the original type and message."""
    last = StageFailed("stage train_full exited 1")
    settled = spend_retry(last, 5, 5)
    assert isinstance(settled, RetriesExhausted) and settled.action is Action.DEAD_LETTER
    assert settled.error_type == "StageFailed" and settled.retryable is False
    assert str(settled) == "5 failed attempts (MAX_FAILED_ATTEMPTS=5); the last: stage train_full exited 1"


@pytest.mark.parametrize("error,failed_attempts", [
    (StageFailed("exit 1"), 4),
    (BadRecording("not audio"), 5),
    (Stopped(Stopped.SHUTDOWN), 5),
])
def test_an_error_within_the_budget_or_not_retryable_is_left_as_it_is(error, failed_attempts):
    """Below the limit, and for any error that is not retryable, the handler ends with its own error."""
    assert spend_retry(error, failed_attempts, 5) is error


def test_the_loop_dead_letters_a_spent_budget_with_the_error_attributes(memory_queue, make_memory_worker):
    """The worker copies the message to the DLQ with the original ErrorType, then deletes it."""
    def handler(message, lease):
        raise spend_retry(DownloadError("timeout fetching input[0]"), 5, 5)

    worker = make_memory_worker(handler)
    memory_queue.send('{"jobId": "j-1"}')
    assert worker.run_once() == "dead_letter"
    assert memory_queue.counts() == (0, 0)
    (copy,) = memory_queue.dead_letter_queue.messages
    assert copy.message_attributes["ErrorType"]["StringValue"] == "DownloadError"
    assert copy.message_attributes["ErrorMessage"]["StringValue"] == (
        "5 failed attempts (MAX_FAILED_ATTEMPTS=5); the last: timeout fetching input[0]")
