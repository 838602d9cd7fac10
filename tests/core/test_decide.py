"""The loop's decision table: the handler's result and the lease's state -> one Action, counted as one Outcome.

The loop decides on the core's branches alone: the errors here are the core's, or a layer's stand-ins
(``Flaky``, ``Hopeless``) hung on its branches as pipeline/errors.py and worker/voice/errors.py hang theirs.
"""

from __future__ import annotations

import re

import pytest

from worker.core import errors
from worker.core.errors import (
    Action,
    ConfigError,
    LeaseLost,
    PermanentError,
    RetriesExhausted,
    RetryableError,
    Stopped,
    StopReason,
    TimeLimitExceeded,
    WorkerError,
)
from worker.core.loop import decide
from worker.core.metrics import OUTCOME_METRICS, Outcome, outcome_of
from worker.core.stop import StopSignal

# Every exception class errors.py defines, by name.
TREE = {name: cls for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, WorkerError) and cls.__module__ == errors.__name__}


class Flaky(RetryableError):
    """A layer's retryable error (a download that timed out, say): the loop knows only its branch."""


class Hopeless(PermanentError):
    """A layer's permanent error (a recording that is not audio, say)."""


@pytest.mark.parametrize("outcome,lease_lost,action", [
    (None, False, Action.ACK),
    (None, True, Action.ABANDON),
    (Flaky("timeout"), False, Action.RETRY),
    (Flaky("timeout"), True, Action.ABANDON),
    (Hopeless("not audio"), False, Action.DEAD_LETTER),
    (TimeLimitExceeded("6 h"), False, Action.DEAD_LETTER),
    (RetriesExhausted(Flaky("timeout"), 5, 5), False, Action.DEAD_LETTER),
    (RetriesExhausted(Flaky("timeout"), 5, 5), True, Action.ABANDON),
    (ConfigError("no S3 client"), False, Action.RETRY),
    (LeaseLost("handle rejected"), False, Action.ABANDON),
    (Stopped(Stopped.SHUTDOWN), False, Action.RELEASE),
    (Stopped(Stopped.LEASE_LOST), False, Action.ABANDON),
    (Stopped(Stopped.CANCELLED), False, Action.RETRY),
    (Stopped(Stopped.SHUTDOWN), True, Action.ABANDON),
])
def test_each_result_maps_to_one_action(outcome, lease_lost, action):
    """Every handler result and lease state gives exactly the action of the design's table."""
    decision = decide(outcome, lease_lost)
    assert decision.action is action


def test_a_time_limit_stop_is_dead_lettered_as_time_limit_exceeded():
    """A stop for the job's time limit is permanent: dead-lettered with TimeLimitExceeded."""
    decision = decide(Stopped(Stopped.TIME_LIMIT), False)
    assert decision.action is Action.DEAD_LETTER and isinstance(decision.error, TimeLimitExceeded)


def test_the_most_specific_class_names_the_action():
    """A class takes its branch's action unless it names its own, which then wins for it and below."""
    class Exhausted(Flaky):
        pass

    class Refused(PermanentError):
        action = Action.RELEASE

    class RefusedAgain(Refused):
        pass

    assert decide(Exhausted("x"), False).action is Action.RETRY
    assert decide(Refused("x"), False).action is Action.RELEASE
    assert decide(RefusedAgain("x"), False).action is Action.RELEASE


@pytest.mark.parametrize("reason,action", [
    ("shutdown", Action.RELEASE), ("cancelled", Action.RETRY), ("lease_lost", Action.ABANDON),
    ("time_limit", Action.DEAD_LETTER),
])
def test_a_stop_takes_the_action_its_reason_names(reason, action):
    """Stopped converts its reason to a StopReason, which names its action; the message keeps the reason's text."""
    stopped = Stopped(reason, "why")
    assert stopped.reason is StopReason(reason) and stopped.action is action
    assert str(stopped) == f"stopped: {reason} (why)"


def test_an_unknown_stop_reason_is_refused_where_it_is_given():
    """A reason no StopReason names is a ValueError, from Stopped and from the stop signal alike."""
    with pytest.raises(ValueError):
        Stopped("bored")
    signal = StopSignal()
    with pytest.raises(ValueError):
        signal.set("bored")
    assert not signal.is_set()


def test_retryable_is_exactly_the_retryable_branch():
    """An error is recorded retryable when its class lies under RetryableError, and only then."""
    for cls in TREE.values():
        error = cls.__new__(cls)
        assert error.retryable is issubclass(cls, RetryableError), cls.__name__
    assert LeaseLost("x").retryable is False and Hopeless("x").retryable is False and Flaky("x").retryable
    assert RetriesExhausted(Flaky("x"), 5, 5).retryable is False


def test_the_docstring_draws_every_error_under_its_parent():
    """errors.py's drawing names every class it defines, each under the class it derives from."""
    drawn = {}
    parents: list[str] = []
    for line in errors.__doc__.splitlines():
        root = re.match(r"^ {4}([A-Z]\w+)", line)
        branch = re.match(r"^ {4}((?:[│ ] {3})*)[├└]── ([A-Z]\w+)", line)
        if root or branch:
            depth, name = (0, root.group(1)) if root else (len(branch.group(1)) // 4 + 1, branch.group(2))
            del parents[depth:]
            drawn[name] = parents[-1] if parents else None
            parents.append(name)
    assert drawn == {name: (cls.__base__.__name__ if cls is not WorkerError else None)
                     for name, cls in TREE.items()}


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
