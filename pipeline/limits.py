"""How much one job may make the worker download and decode; past a limit the job fails permanently.

The defaults are the settings' defaults, so a pipeline run without ``Settings.job_limits`` (tests,
benchmarks) is still protected against decode bombs. The one difference: without settings there is no
job-wide download budget, because a caller's fetch may not take the ``remaining_job_bytes`` keyword;
each file still has its own DOWNLOAD_MAX_BYTES.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, not the host's count): the default DATASET_WORKERS."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class JobLimits:
    """Per-job caps: bytes downloaded in total, seconds of audio per recording and in total, and how
    many recordings the dataset step converts at once."""

    max_job_download_bytes: int | None = None  # MAX_JOB_DOWNLOAD_BYTES; None: no job-wide budget
    max_recording_seconds: float = 1800.0  # MAX_RECORDING_SECONDS
    max_job_audio_seconds: float = 36_000.0  # MAX_JOB_AUDIO_SECONDS
    dataset_workers: int = field(default_factory=usable_cpus)  # DATASET_WORKERS
