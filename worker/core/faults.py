"""Crash points for the reliability tests: inert unless VOICE_WORKER_CRASH_AT names one.

``CrashPoints(point).reached("after_upload")`` kills this process with SIGKILL — no cleanup, no
finally blocks — exactly where a power cut or an OOM kill could strike. With no point configured (the
production default) every call is a no-op.
"""

from __future__ import annotations

import os
import signal
from enum import StrEnum


class CrashPoint(StrEnum):
    AFTER_RECEIVE = "after_receive"  # the loop holds the message, nothing else happened
    DURING_DOWNLOAD = "during_download"  # the first recording is being fetched
    AFTER_UPLOAD = "after_upload"  # all five objects are in S3, no record written
    AFTER_PATHS = "after_paths"  # the profile holds the paths, nothing marked completed
    AFTER_PROFILE_COMPLETED = "after_profile_completed"  # the profile is completed, the job is not
    AFTER_JOB_COMPLETED = "after_job_completed"  # the commit marker is written, the message not yet deleted


POINTS = tuple(CrashPoint)


class CrashPoints:
    def __init__(self, crash_at: CrashPoint | None = None):
        # A CrashPoint already: the settings parsed VOICE_WORKER_CRASH_AT, the only way to set one.
        self._crash_at = crash_at

    def reached(self, point: str) -> None:
        if point == self._crash_at:
            os.kill(os.getpid(), signal.SIGKILL)


NEVER = CrashPoints(None)
