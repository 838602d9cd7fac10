"""The core's error tree: the branches every layer's errors hang on. Each class names the ``Action``
the loop takes with a message whose handler ended with it (``action``; the most specific class wins),
so ``decide`` is a look-up on the branch and knows no class of a layer above.

    WorkerError                retry: an error of no branch below (a ConfigError met inside a job)
    ├── ConfigError            settings unusable: stop at start-up, exit non-zero
    ├── RetryableError         retry: leave the message; the queue redelivers it after the backoff for
    │   │                      its receive count. Recorded on the job as ``retryable: true``
    │   ├── QueueError         the queue's throttling, 5xx, network (after the client's own retries)
    │   └── UnexpectedError    a bug or an unforeseen library error inside the handler: retried, reported
    ├── PermanentError         dead_letter: retrying cannot help: record it, move the body to the DLQ,
    │   │                      then delete
    │   ├── InvalidMessage     body not JSON or not the schema; one line per violation
    │   ├── TimeLimitExceeded  one attempt ran past its time limit (JOB_TIME_LIMIT_SECONDS)
    │   └── RetriesExhausted   a retryable failure that spent the job's last failed attempt
    │                          (MAX_FAILED_ATTEMPTS): dead-lettered under the type of the error it wraps
    ├── LeaseLost              abandon: our claim on the message or the record is gone: commit nothing,
    │                          delete nothing
    ├── HostFault              release: the host failed the job mid-way (its GPU gone, its work file system
    │                          full, read-only or gone): another host takes the message now, no failure is
    │                          recorded, and this worker takes no other message (the daemon exits 7)
    └── Stopped                the handler was told to stop; its ``reason`` (a ``StopReason``) names the
                               action: shutdown -> release, cancelled -> retry (the redelivery records
                               it), lease_lost -> abandon, time_limit -> dead_letter as TimeLimitExceeded

The layers above add classes of their own on these branches, each layer drawing its tree in the
docstring of its own errors module; nothing here imports them. Adapters translate third-party
exceptions (botocore, pymongo, urllib3, sqlite3) into the project's errors at their boundary, so the
loop and the handler only ever catch the project's own types.
"""

from __future__ import annotations

from enum import StrEnum


class Action(StrEnum):
    """What the loop does with a message once its handler returned: ``worker.core.loop.decide`` picks one."""

    ACK = "ack"  # delete it: the job is durably done (or there was nothing to do)
    RETRY = "retry"  # leave it, visible again after the backoff
    DEAD_LETTER = "dead_letter"  # copy it to the DLQ with why, then delete it
    RELEASE = "release"  # make it visible again at once (shutdown)
    ABANDON = "abandon"  # touch nothing: the lease is lost, the message is not ours


class StopReason(StrEnum):
    """Why work was told to stop (``Stopped.reason``, ``StopSignal.reason``)."""

    SHUTDOWN = "shutdown"
    CANCELLED = "cancelled"
    LEASE_LOST = "lease_lost"
    TIME_LIMIT = "time_limit"


class WorkerError(Exception):
    """Root of every error this project raises on purpose."""

    # What the loop does with the message when this error ends the handler; each branch names its own.
    action: Action = Action.RETRY

    @property
    def error_type(self) -> str:
        return type(self).__name__

    @property
    def retryable(self) -> bool:
        """Whether a later attempt may succeed: the job record's ``error.retryable``."""
        return isinstance(self, RetryableError)

    def settled_as(self) -> WorkerError:
        """The error the message is settled with (reported, dead-lettered with): this one."""
        return self


class ConfigError(WorkerError):
    """Settings that cannot work; ``problems`` holds one readable line per problem."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class RetryableError(WorkerError):
    action = Action.RETRY
    # When set, the message comes back after this long instead of the exponential backoff.
    retry_after_s: float | None = None


class QueueError(RetryableError):
    pass


class UnexpectedError(RetryableError):
    pass


class PermanentError(WorkerError):
    action = Action.DEAD_LETTER


class InvalidMessage(PermanentError):
    """The body is not a valid job; ``problems`` holds one line per violation."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class TimeLimitExceeded(PermanentError):
    pass


class RetriesExhausted(PermanentError):
    """A retryable failure that brought the job's failed attempts to the limit: retrying is given up.

    ``error_type`` is the wrapped error's, so the DLQ copy says what actually went wrong.
    """

    def __init__(self, error: WorkerError, failed_attempts: int, limit: int):
        super().__init__(f"{failed_attempts} failed attempts (MAX_FAILED_ATTEMPTS={limit}); the last: {error}")
        self.error = error
        self.failed_attempts = failed_attempts

    @property
    def error_type(self) -> str:
        return self.error.error_type


class LeaseLost(WorkerError):
    action = Action.ABANDON


class HostFault(WorkerError):
    """The host, not the job, ended the attempt: the message is released and the worker stops receiving
    (``Worker.unfit``), so the daemon exits ``EXIT_HOST_UNFIT`` and its supervisor replaces the host."""

    action = Action.RELEASE


class Stopped(WorkerError):
    """The work was stopped on request; nothing after the stop point was committed."""

    # The reasons, also under the names the call sites use: ``Stopped(Stopped.SHUTDOWN)``.
    SHUTDOWN = StopReason.SHUTDOWN
    CANCELLED = StopReason.CANCELLED
    LEASE_LOST = StopReason.LEASE_LOST
    TIME_LIMIT = StopReason.TIME_LIMIT
    ACTIONS = {
        StopReason.SHUTDOWN: Action.RELEASE,  # another worker takes the message now
        # A cancellation the handler did not record as such: the redelivery records it.
        StopReason.CANCELLED: Action.RETRY,
        StopReason.LEASE_LOST: Action.ABANDON,  # not ours to touch
        StopReason.TIME_LIMIT: Action.DEAD_LETTER,  # as TimeLimitExceeded: see ``settled_as``
    }

    def __init__(self, reason: StopReason | str, detail: str = ""):
        self.reason = StopReason(reason)
        self.action = self.ACTIONS[self.reason]
        super().__init__(f"stopped: {self.reason}" + (f" ({detail})" if detail else ""))

    def settled_as(self) -> WorkerError:
        """A time-limit stop is dead-lettered as the permanent ``TimeLimitExceeded`` it is."""
        if self.reason is StopReason.TIME_LIMIT:
            return TimeLimitExceeded(str(self))
        return self
