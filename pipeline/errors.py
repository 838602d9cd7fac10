"""The pipeline's errors, each on a branch of the core's tree (``worker.core.errors``), which names
the loop's action; the loop decides on the branch alone and never imports this module.

    ConfigError (core)           refuse to start
    └── HostUnfit                this host cannot run jobs (the base model cannot be fetched or does
                                 not verify, the trainer sees no GPU a stage needs, the work file
                                 system is gone, read-only or full): raised only at start-up, before
                                 the first receive; the daemon exits EXIT_HOST_UNFIT (7)
    RetryableError (core)        retry: the message comes back after the backoff
    ├── DownloadError            a recording could not be fetched this time (timeout, 5xx, network,
    │                            the disk its file was written to)
    └── StageFailed              a stage exited with a code not declared permanent, was killed, left an
        │                        output missing, empty or linked, or the job's work files could not be
        │                        written (disk full, read-only, WORK_ROOT gone)
        └── HostCondition        ... because of the host: a stage exited EXIT_DEVICE_LOST (70: its GPU is
                                 not there), the dataset child found the disk full, WORK_ROOT is gone or
                                 replaced. The job handler turns it (and any failure caused by a full,
                                 read-only or failing work file system) into the core's ``HostFault``
                                 (``pipeline.host_faults``)
    PermanentError (core)        dead_letter: retrying cannot help
    ├── BadRecording             a recording is gone, refused, too large, too long, or not usable audio
    └── StageFailedPermanently   a stage exited with a code listed in permanent_exit_codes

The pipeline also raises the core's own ``ConfigError``, ``Stopped`` and ``TimeLimitExceeded`` (a
stage past its timeout).
"""

from __future__ import annotations

from worker.core.errors import ConfigError, PermanentError, RetryableError


class HostUnfit(ConfigError):
    """A host check failed: ``check`` names it, ``problem`` says why, in one line each.

    A ``ConfigError`` so that anything that stops on one stops on this too; the daemon tells them
    apart for its exit code (a host problem is no job's: no message is received, no retry spent)."""

    def __init__(self, check: str, problem: str):
        self.check, self.problem = check, problem
        super().__init__(f"{check}: {problem}")


class DownloadError(RetryableError):
    pass


class StageFailed(RetryableError):
    pass


class HostCondition(StageFailed):
    """A stage failed because of the host, not the job (see the tree above): a ``StageFailed`` for any
    caller that knows no better, a host fault for the job handler."""


class BadRecording(PermanentError):
    pass


class StageFailedPermanently(PermanentError):
    pass
