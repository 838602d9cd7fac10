"""Crash points for the reliability tests: inert unless VOICE_WORKER_CRASH_AT names one.

``CrashPoints(name).reached("after_upload")`` kills this process with SIGKILL — no cleanup, no
finally blocks — exactly where a power cut or an OOM kill could strike. With no name configured (the
production default) every call is a no-op.
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "after_receive",            # the loop holds the message, nothing else happened
    "during_download",          # the first recording is being fetched
    "after_upload",             # all five objects are in S3, no record written
    "after_paths",              # the profile holds the paths, nothing marked completed
    "after_profile_completed",  # the profile is completed, the job is not
    "after_job_completed",      # the commit marker is written, the message not yet deleted
)


class CrashPoints:
    def __init__(self, crash_at: str | None = None):
        if crash_at is not None and crash_at not in POINTS:
            raise ValueError(f"unknown crash point {crash_at!r}; known: {', '.join(POINTS)}")
        self._crash_at = crash_at

    def reached(self, point: str) -> None:
        if point == self._crash_at:
            os.kill(os.getpid(), signal.SIGKILL)


NEVER = CrashPoints(None)
