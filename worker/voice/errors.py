"""The voice job's errors, each on a branch of the core's tree (``worker.core.errors``), which names the
loop's action; the loop decides on the branch alone and never imports this module.

    WorkerError (core)
    ├── RetryableError (core)    retry: the message comes back after the backoff
    │   ├── StorageError         an S3 upload or check of the artifacts failed
    │   ├── UnknownJob           no job record for the message (yet): the redrive policy bounds the retries
    │   └── JobBusy              this very message is being worked on under a lapsed SQS lease: come back
    │                            when that record lease ends (``retry_after_s``)
    ├── PermanentError (core)    dead_letter: retrying cannot help
    │   ├── MalformedRecord      the job's or profile's record holds a field the worker decides on in a
    │   │                        shape it never writes (another writer's): fixed by hand, not by retrying
    │   └── AlreadyFailed        a redelivery of a message whose permanent failure is recorded: back to
    │                            the DLQ unworked, under the recorded error type
    └── IdempotencyMismatch      a submit's idempotency key was used for other fields: nothing created
                                 or sent (``worker.voice.submit``'s, a command's error, never a handler's)

The layers below add their own: the records' ``StoreError`` and ``StaleWrite``
(``worker.voice.records.errors``), the pipeline's ``DownloadError``, ``StageFailed``, ``BadRecording``
and ``StageFailedPermanently`` (``pipeline.errors``). The job also raises the core's ``InvalidMessage``,
``UnexpectedError``, ``RetriesExhausted``, ``LeaseLost``, ``Stopped`` and ``TimeLimitExceeded``.
"""

from __future__ import annotations

from worker.core.errors import PermanentError, RetryableError, WorkerError


class StorageError(RetryableError):
    pass


class UnknownJob(RetryableError):
    pass


class JobBusy(RetryableError):
    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class MalformedRecord(PermanentError):
    """A record holds fields the worker decides on in a shape the worker never writes: some other
    writer (the product's backend, a hand edit) wrote them, and no retry can mend them. ``problems``
    holds one line per field ("job attempts: text ('three'), not a count ...")."""

    def __init__(self, job_id: str, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"the records of job {job_id} hold fields the worker cannot read, written by "
                         "something other than the worker; fix or remove them, then redrive the "
                         "message: " + "; ".join(self.problems))


class AlreadyFailed(PermanentError):
    """A redelivery of a message whose permanent failure is recorded: dead-lettered again, unworked.

    ``error_type`` is the recorded one, so the DLQ copy says what actually went wrong.
    """

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.recorded_type = error_type

    @property
    def error_type(self) -> str:
        return self.recorded_type


class IdempotencyMismatch(WorkerError):
    """An idempotency key already used for a submission with other fields (raised by ``submit``)."""

    def __init__(self, job_id: str, key: str):
        super().__init__(f"idempotencyKey {key!r} was used for job {job_id} with a different submission: "
                         "nothing created or sent (use a new key for a new job)")
        self.job_id, self.key = job_id, key
