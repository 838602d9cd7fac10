"""SIGTERM ends the stage now; SIGUSR1 (the worker's checkpoint signal) asks for a checkpoint and goes on."""

from __future__ import annotations

import signal
from types import FrameType

# 128 + SIGTERM, what a shell reports for a process ended by it; never 65, so the job is retried.
EXIT_TERMINATED = 143


class Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler: the stop grace is shorter than one training step.

    A BaseException, like KeyboardInterrupt, so no ``except Exception`` (ours or a library's) swallows it.
    """


class StageSignals:
    def __init__(self) -> None:
        self.checkpoint_requested = False

    def install(self) -> StageSignals:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGUSR1, self._on_checkpoint)
        return self

    def take_checkpoint_request(self) -> bool:
        """True once per SIGUSR1 received since the last call (several signals coalesce into one)."""
        requested, self.checkpoint_requested = self.checkpoint_requested, False
        return requested

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        raise Terminated()

    def _on_checkpoint(self, signum: int, frame: FrameType | None) -> None:
        self.checkpoint_requested = True
