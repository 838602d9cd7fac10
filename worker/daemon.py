"""Running a Worker as a process: signals in, an exit code out.

Signal handlers only set events (``Worker.stop``); the loop notices, and the lease enforces the grace.
Exit codes: 0 after a requested shutdown, 1 when the loop ended for any other reason.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import structlog

from worker.loop import Worker

log = structlog.get_logger(__name__)

EXIT_OK, EXIT_CRASHED, EXIT_CONFIG = 0, 1, 2


def install_signal_handlers(worker: Worker) -> None:
    def on_signal(signum, _frame):
        worker.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def run_worker(worker: Worker, close: Callable[[], None] | None = None) -> int:
    """Run until shutdown. Order on the way out: the loop has settled its last message (run returned),
    then the store and other clients are closed, then the exit code is returned."""
    install_signal_handlers(worker)
    log.info("worker.started")
    code = EXIT_OK
    try:
        worker.run()
    except Exception as exc:
        log.exception("worker.crashed", error=f"{type(exc).__name__}: {exc}")
        code = EXIT_CRASHED
    if close is not None:
        try:
            close()
        except Exception as exc:  # closing must not turn a clean stop into a crash
            log.error("worker.close_failed", error=f"{type(exc).__name__}: {exc}")
    return code
