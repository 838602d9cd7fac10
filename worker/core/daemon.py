"""Running a Worker as a process: signals in, an exit code out.

A Python signal handler runs on the main thread between any two bytecodes, also while that thread
holds a lock: the one inside a ``threading.Event`` it is waiting on or setting, say. A handler that
takes such a lock can deadlock the process for good (two SIGTERMs close together did, and one during
the main thread's ``Event.wait`` can), leaving the job leased until SIGKILL. So the handler takes no
lock: it writes one byte to a pipe, and a relay thread turns each byte into ``Worker.stop()``.

Exit codes: 0 after a requested shutdown, 1 when the loop ended for any other reason.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import structlog

from worker.core.health import Pulse
from worker.core.loop import Worker

log = structlog.get_logger(__name__)

EXIT_OK, EXIT_CRASHED, EXIT_CONFIG = 0, 1, 2

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What signal.signal returns and takes back: a callable, SIG_DFL/SIG_IGN, or None (set outside Python).
Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class SignalRelay:
    """SIGTERM and SIGINT in, one ``stop()`` call per signal out, from a thread of its own."""

    def __init__(self, stop: Callable[[], None]):
        self._stop = stop
        self._read_fd, self._write_fd = os.pipe()
        # A full pipe must not block the handler: 64 KiB of unread signals already mean "hurry".
        os.set_blocking(self._write_fd, False)
        self._previous: dict[int, Handler] = {}
        self._thread = threading.Thread(target=self._relay, name="signal-relay", daemon=True)

    def on_signal(self, _signum, _frame) -> None:
        """The signal handler: one write to the pipe, nothing that can wait on another thread."""
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:
            pass

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self.on_signal)
        self._thread.start()  # a signal before this waits in the pipe

    def uninstall(self) -> None:
        """Put the previous handlers back, then end the relay thread and close the pipe."""
        for sig, previous in self._previous.items():
            # None: a handler set outside Python, which cannot be put back; the default is the nearest.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        # Only now: a handler writing to a closed (or reused) descriptor number would be worse than none.
        os.close(self._write_fd)
        self._thread.join()
        os.close(self._read_fd)

    def _relay(self) -> None:
        while chunk := os.read(self._read_fd, 64):  # b"" once uninstall closed the write end
            for _ in chunk:
                try:
                    self._stop()
                except Exception as exc:  # the relay must outlive a failing stop, or later signals go unheard
                    log.error("worker.stop_failed", error=f"{type(exc).__name__}: {exc}")


def install_signal_handlers(worker: Worker) -> SignalRelay:
    """Route SIGTERM/SIGINT to ``worker.stop`` through a relay; ``uninstall()`` it when the worker is done."""
    relay = SignalRelay(worker.stop)
    relay.install()
    # `kill -USR1 <pid>` prints every thread's stack to stderr: the way to see where a worker that
    # does not stop is stuck, without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    return relay


def run_worker(worker: Worker, close: Callable[[], None] | None = None, pulse: Pulse | None = None) -> int:
    """Run until shutdown, then leave in this order:
    1. the loop has settled its last message (``run`` returned: deleted, released or left to SQS);
    2. tell systemd we are stopping;
    3. close the store and other clients;
    4. put the previous signal handlers back;
    5. return the exit code: 0 for a requested stop, 1 for anything else."""
    pulse = pulse or Pulse()
    code = EXIT_OK
    relay = install_signal_handlers(worker)
    try:
        pulse.ready()
        log.info("worker.started")
        try:
            worker.run()
        except Exception as exc:
            log.exception("worker.crashed", error=f"{type(exc).__name__}: {exc}")
            code = EXIT_CRASHED
        pulse.stopping()
        if close is not None:
            try:
                close()
            except Exception as exc:  # closing must not turn a clean stop into a crash
                log.error("worker.close_failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        relay.uninstall()
    return code
