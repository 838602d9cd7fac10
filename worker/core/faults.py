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
    """Where a handler's work may be cut short. The loop reaches AFTER_RECEIVE itself; the handler
    reaches the others, in its commit order, by these names."""

    AFTER_RECEIVE = "after_receive"  # the loop holds the message, nothing else happened
    DURING_DOWNLOAD = "during_download"  # the handler is fetching its first input
    AFTER_UPLOAD = "after_upload"  # every output is stored, nothing recorded yet
    AFTER_PATHS = "after_paths"  # where the outputs are is recorded, nothing marked completed
    AFTER_PROFILE_COMPLETED = "after_profile_completed"  # the result's record is completed, the job's is not
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
