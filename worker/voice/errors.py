"""The voice job's errors, each on a branch of the core's tree (``worker.core.errors``), which names the
loop's action; the loop decides on the branch alone and never imports this module.

    WorkerError (core)
    ├── RetryableError (core)    retry: the message comes back after the backoff
    │   ├── StorageError         an S3 upload or check of the artifacts failed
    │   ├── LogsUnavailable      shipped stage logs could not be written or read (S3): a shipment is
    │   │                        retried at the next interval, never the job's failure
    │   ├── UnknownJob           no job record for the message (yet): the redrive policy bounds the retries
    │   └── JobBusy              this very message is being worked on under a lapsed SQS lease: come back
    │                            when that record lease ends (``retry_after_s``)
    ├── PermanentError (core)    dead_letter: retrying cannot help
    │   ├── MalformedRecord      the job's or profile's record holds a field the worker decides on in a
    │   │                        shape it never writes (another writer's): fixed by hand, not by retrying
    │   ├── AlreadyFailed        a redelivery of a message whose permanent failure is recorded: back to
    │   │                        the DLQ unworked, under the recorded error type
    │   ├── BadQualityReport     the evaluation report the pipeline config names is missing, too large or
    │   │                        not the report's schema (a stage-contract error: fix the stage)
    │   ├── BadPrepReport        the trainers' data-preparation report (prep/report.json) is too large or
    │   │                        not the report's schema (a stage-contract error: fix the stage)
    │   ├── TooLittleSpeech      data preparation kept less usable speech than the profile's minimum:
    │   │                        the record's dataset says what was left out and why; record more
    │   └── StandInRefused       a staging or production job and the reference stand-in trainer, not
    │                            allowed by ALLOW_STAND_IN_TRAINER: refused before any download
    ├── QualityBelowBar          ack: a trained model is below a bar of [quality.gate]; the job ends
    │                            refused (a final status, the scores and the failed bars on the record),
    │                            nothing committed: a business outcome, never retried nor dead-lettered
    └── IdempotencyMismatch      a submit's idempotency key was used for other fields: nothing created
                                 or sent (``worker.voice.submit``'s, a command's error, never a handler's)

The layers below add their own: the records' ``StoreError`` and ``StaleWrite``
(``worker.voice.records.errors``), the pipeline's ``DownloadError``, ``StageFailed``, ``BadRecording``
and ``StageFailedPermanently`` (``pipeline.errors``). The job also raises the core's ``InvalidMessage``,
``UnexpectedError``, ``RetriesExhausted``, ``LeaseLost``, ``Stopped`` and ``TimeLimitExceeded``.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.core.errors import Action, PermanentError, RetryableError, WorkerError


class StorageError(RetryableError):
    pass


class LogsUnavailable(RetryableError):
    """Shipped stage logs could not be written or read (``worker.voice.stage_logs``)."""


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


class BadQualityReport(PermanentError):
    """The evaluation stage's report (``[quality] report``) is missing, too large, not JSON or not the
    report's schema: the stage broke its contract, and a retry of the same stage writes the same."""


class BadPrepReport(PermanentError):
    """The data-preparation report (``prep/report.json``, worker.voice.prep_report) is too large, not JSON
    or not the report's schema: the stage broke its contract, and a retry of it writes the same."""


class TooLittleSpeech(PermanentError):
    """The trainers' data preparation kept less usable speech than the profile's minimum (its report's
    ``refused``): the user must record more; the record's ``dataset`` says what was left out and why."""


class StandInRefused(PermanentError):
    """A job for ``staging`` or ``production`` and a pipeline that is the reference stand-in
    (``[pipeline] stand_in = true``), which ALLOW_STAND_IN_TRAINER does not allow: an operational
    misconfiguration, dead-lettered (it should page) before any download."""


# How a QualityBelowBar's message begins; ``status`` shows the failed bars without it.
QUALITY_BAR_PREFIX = "below the quality bar: "


class QualityBelowBar(WorkerError):
    """A trained model is below at least one bar of the quality gate: the job ends ``refused``.

    A business outcome, not a fault: the handler records it (final) and acknowledges the message, so
    no retry is spent and nothing reaches the DLQ. ``failed`` holds one line per failed bar
    (``full.speaker_similarity 0.41 < 0.70``)."""

    action = Action.ACK

    def __init__(self, failed: Sequence[str]):
        self.failed = list(failed)
        super().__init__(QUALITY_BAR_PREFIX + "; ".join(self.failed))
