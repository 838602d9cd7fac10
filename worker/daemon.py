"""Running a Worker as a process: signals in, an exit code out.

Signal handlers only set events (``Worker.stop``); the loop notices, and the lease enforces the grace.
Exit codes: 0 after a requested shutdown, 1 when the loop ended for any other reason.
"""

from __future__ import annotations

import faulthandler
import signal
from collections.abc import Callable

import structlog

from worker.health import Pulse
from worker.loop import Worker

log = structlog.get_logger(__name__)

EXIT_OK, EXIT_CRASHED, EXIT_CONFIG = 0, 1, 2


def install_signal_handlers(worker: Worker) -> None:
    def on_signal(signum, _frame):
        worker.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # `kill -USR1 <pid>` prints every thread's stack to stderr: the way to see where a worker that
    # does not stop is stuck, without stopping it.
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def run_worker(worker: Worker, close: Callable[[], None] | None = None, pulse: Pulse | None = None) -> int:
    """Run until shutdown, then leave in this order:
    1. the loop has settled its last message (``run`` returned: deleted, released or left to SQS);
    2. tell systemd we are stopping;
    3. close the store and other clients;
    4. return the exit code: 0 for a requested stop, 1 for anything else."""
    pulse = pulse or Pulse()
    install_signal_handlers(worker)
    pulse.ready()
    log.info("worker.started")
    code = EXIT_OK
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
    return code
