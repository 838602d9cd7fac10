"""The pipeline's errors, each on a branch of the core's tree (``worker.core.errors``), which names
the loop's action; the loop decides on the branch alone and never imports this module.

    RetryableError (core)        retry: the message comes back after the backoff
    ├── DownloadError            a recording could not be fetched this time (timeout, 5xx, network,
    │                            the disk its file was written to)
    └── StageFailed              a stage exited with a code not declared permanent, was killed, left an
                                 output missing, empty or linked, or the job's work files could not be
                                 written (disk full, read-only, WORK_ROOT gone)
    PermanentError (core)        dead_letter: retrying cannot help
    ├── BadRecording             a recording is gone, refused, too large, too long, or not usable audio
    └── StageFailedPermanently   a stage exited with a code listed in permanent_exit_codes

The pipeline also raises the core's own ``ConfigError``, ``Stopped`` and ``TimeLimitExceeded`` (a
stage past its timeout).
"""

from __future__ import annotations

from worker.core.errors import PermanentError, RetryableError


class DownloadError(RetryableError):
    pass


class StageFailed(RetryableError):
    pass


class BadRecording(PermanentError):
    pass


class StageFailedPermanently(PermanentError):
    pass
