"""Running a Worker as a process: signals in, an exit code out.

Signal handlers only set events (``Worker.stop``); the loop notices, and the lease enforces the grace.
Exit codes: 0 after a requested shutdown, 1 when the loop ended for any other reason.
"""

from __future__ import annotations

import signal

import structlog

from worker.loop import Worker

log = structlog.get_logger(__name__)

EXIT_OK, EXIT_CRASHED, EXIT_CONFIG = 0, 1, 2


def install_signal_handlers(worker: Worker) -> None:
    def on_signal(signum, _frame):
        worker.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def run_worker(worker: Worker) -> int:
    install_signal_handlers(worker)
    log.info("worker.started")
    try:
        worker.run()
    except Exception as exc:
        log.exception("worker.crashed", error=f"{type(exc).__name__}: {exc}")
        return EXIT_CRASHED
    return EXIT_OK
