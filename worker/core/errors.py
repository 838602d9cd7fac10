"""The project's one error tree. The loop decides a message's fate from the branch alone.

    WorkerError
    ├── ConfigError            settings or pipeline config unusable: stop at start-up, exit non-zero
    ├── RetryableError         leave the message; SQS redelivers it after the backoff for its receive count
    │   ├── QueueError         SQS throttling, 5xx, network (after botocore's own retries)
    │   ├── StorageError       S3 upload/read failed
    │   ├── StoreError         the records store is unavailable
    │   ├── StaleWrite         an update matched no record (not ours any more, or gone): never acknowledge
    │   ├── UnknownJob         no job record for the message (yet): the redrive policy bounds the retries
    │   ├── JobBusy            this very message is being worked on under a lapsed SQS lease: come back
    │   │                      when that record lease ends (``retry_after_s``)
    │   ├── UnexpectedError    a bug or an unforeseen library error inside the job: retried, reported
    │   ├── LeaseLost          our claim on the message or the record is gone: commit nothing, delete nothing
    │   ├── DownloadError      a recording could not be fetched this time (timeout, 5xx, network)
    │   └── StageFailed        a pipeline stage exited with a code not declared permanent, or the job's
    │                          work files could not be written (disk full, read-only, WORK_ROOT gone)
    ├── PermanentError         retrying cannot help: record it, move the body to the DLQ, then delete
    │   ├── InvalidMessage     body not JSON or not the schema; one line per violation
    │   ├── BadRecording       a recording is gone, too large, or not decodable audio
    │   ├── StageFailedPermanently   a stage exited with a code listed in permanent_exit_codes
    │   └── TimeLimitExceeded  one attempt ran past JOB_TIME_LIMIT_SECONDS
    └── Stopped                the handler was told to stop (shutdown, cancelled, lease lost, time limit);
                               ``reason`` says which, and the loop maps it to release / cancel / nothing

Adapters translate third-party exceptions (botocore, pymongo, urllib3, sqlite3) into these at their
boundary, so the loop and the handler only ever catch the project's own types.
"""

from __future__ import annotations


class WorkerError(Exception):
    """Root of every error this project raises on purpose."""

    retryable: bool = False

    @property
    def error_type(self) -> str:
        return type(self).__name__


class ConfigError(WorkerError):
    """Settings that cannot work; ``problems`` holds one readable line per problem."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class RetryableError(WorkerError):
    retryable = True
    # When set, the message comes back after this long instead of the exponential backoff.
    retry_after_s: float | None = None


class QueueError(RetryableError):
    pass


class StorageError(RetryableError):
    pass


class StoreError(RetryableError):
    pass


class StaleWrite(RetryableError):
    pass


class UnknownJob(RetryableError):
    pass


class JobBusy(RetryableError):
    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnexpectedError(RetryableError):
    pass


class LeaseLost(RetryableError):
    pass


class DownloadError(RetryableError):
    pass


class StageFailed(RetryableError):
    pass


class PermanentError(WorkerError):
    retryable = False


class InvalidMessage(PermanentError):
    """The body is not a valid job; ``problems`` holds one line per violation."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class BadRecording(PermanentError):
    pass


class StageFailedPermanently(PermanentError):
    pass


class TimeLimitExceeded(PermanentError):
    pass


class Stopped(WorkerError):
    """The work was stopped on request; nothing after the stop point was committed."""

    SHUTDOWN = "shutdown"
    CANCELLED = "cancelled"
    LEASE_LOST = "lease_lost"
    TIME_LIMIT = "time_limit"
    REASONS = (SHUTDOWN, CANCELLED, LEASE_LOST, TIME_LIMIT)

    def __init__(self, reason: str, detail: str = ""):
        if reason not in self.REASONS:
            raise ValueError(f"unknown stop reason {reason!r}")
        self.reason = reason
        super().__init__(f"stopped: {reason}" + (f" ({detail})" if detail else ""))
