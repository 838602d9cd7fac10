"""The loop's decision table: the handler's result and the lease's state -> one Action, counted as one Outcome."""

from __future__ import annotations

import pytest

from worker.core.errors import BadRecording, DownloadError, LeaseLost, Stopped, TimeLimitExceeded
from worker.core.loop import Action, decide
from worker.core.metrics import OUTCOME_METRICS, Outcome, outcome_of


@pytest.mark.parametrize("outcome,lease_lost,action", [
    (None, False, Action.ACK),
    (None, True, Action.ABANDON),
    (DownloadError("timeout"), False, Action.RETRY),
    (BadRecording("not audio"), False, Action.DEAD_LETTER),
    (LeaseLost("handle rejected"), False, Action.ABANDON),
    (Stopped(Stopped.SHUTDOWN), False, Action.RELEASE),
    (Stopped(Stopped.LEASE_LOST), False, Action.ABANDON),
    (Stopped(Stopped.CANCELLED), False, Action.RETRY),
])
def test_each_result_maps_to_one_action(outcome, lease_lost, action):
    """Every handler result and lease state gives exactly the action of the design's table."""
    decision = decide(outcome, lease_lost)
    assert decision.action is action


def test_a_time_limit_stop_is_dead_lettered_as_time_limit_exceeded():
    """A stop for the job's time limit is permanent: dead-lettered with TimeLimitExceeded."""
    decision = decide(Stopped(Stopped.TIME_LIMIT), False)
    assert decision.action is Action.DEAD_LETTER and isinstance(decision.error, TimeLimitExceeded)


@pytest.mark.parametrize("action,label,outcome", [
    (Action.ACK, "completed", Outcome.COMPLETED),
    (Action.ACK, "cancelled", Outcome.CANCELLED),
    (Action.ACK, "already_complete", Outcome.SKIPPED),
    (Action.ACK, None, Outcome.SKIPPED),
    (Action.RETRY, None, Outcome.RETRIED),
    (Action.DEAD_LETTER, None, Outcome.DEAD_LETTERED),
    (Action.RELEASE, None, Outcome.RELEASED),
    (Action.ABANDON, "completed", Outcome.LEASE_LOST),
])
def test_every_action_is_counted_as_one_outcome_with_a_metric(action, label, outcome):
    """Each action (and the handler's label for an ack) is counted as one Outcome that has a metric."""
    assert outcome_of(action, label) is outcome and outcome in OUTCOME_METRICS
