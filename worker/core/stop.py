"""A stop request that work can wait on, carrying why it was made.

The heartbeat sets it on lease loss, time limit or cancellation, the loop on shutdown past the grace;
the handler and the pipeline's stage runner wait on it. The first reason wins: a job stopped for
shutdown that then loses its lease is still reported as a shutdown.

A stop can also be announced before it is made (``forewarn``): when a shutdown starts, the grace
runs before the stop, and a stage that can checkpoint on request is told at once, so its work up to
that moment survives the stop.
"""

from __future__ import annotations

import threading

from worker.core.errors import Stopped, StopReason


class StopSignal:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._reason: StopReason | None = None
        self._detail = ""
        self._forewarned = threading.Event()

    def set(self, reason: StopReason | str, detail: str = "") -> bool:
        """Request a stop; returns True only for the call that actually set it."""
        reason = StopReason(reason)  # an unknown reason is a ValueError here, not at the raise
        with self._lock:
            if self._reason is not None:
                return False
            self._reason, self._detail = reason, detail
        self._event.set()
        return True

    def forewarn(self) -> None:
        """Announce that a stop is coming (a shutdown's grace has begun); idempotent."""
        self._forewarned.set()

    def forewarned(self) -> bool:
        """Whether a stop was announced (a stop made without notice, a cancel say, is not announced)."""
        return self._forewarned.is_set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._event.wait(timeout_s)

    @property
    def reason(self) -> StopReason | None:
        return self._reason

    def raise_if_set(self) -> None:
        """Raise ``Stopped`` with the recorded reason when a stop was requested."""
        if self._reason is not None:
            raise Stopped(self._reason, self._detail)
