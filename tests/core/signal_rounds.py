"""A process that runs ``run_worker`` round after round, each round ended by signals from the test.

A round starts on a ``go`` line on stdin, so a late signal of one round cannot reach the next; it prints
``ready`` once the signal handlers are in place and the loop is polling, then ``done <exit code>`` when
``run_worker`` returned. A round that never prints ``done`` is a worker the signals hung. The process
exits 0 when stdin closes.

Polls find nothing; while "waiting" they call ``Event.wait(0)`` in a loop, so the main thread holds the
event's internal lock most of the time: a signal handler that takes that lock would deadlock it.
"""

from __future__ import annotations

import signal
import sys
import time

from worker.core.daemon import run_worker
from worker.core.logs import configure_logging
from worker.core.loop import Worker
from worker.settings import load_settings

POLL_S = 0.002


class EmptyQueue:
    def __init__(self) -> None:
        self.worker: Worker | None = None
        self._announced = False

    def receive(self, wait_s, visibility_timeout_s):
        if not self._announced:
            self._announced = True
            print("ready", flush=True)
        until = time.monotonic() + POLL_S
        while time.monotonic() < until and not self.worker.shutdown.requested.wait(0):
            pass
        return None


def main() -> None:
    configure_logging("WARNING", "json")
    # A late signal of a round, after run_worker put the previous handler back, must not end the process.
    signal.signal(signal.SIGTERM, lambda *_: None)
    settings = load_settings({"SQS_QUEUE_URL": "http://127.0.0.1:9/000000000000/q", "SQS_WAIT_TIME_SECONDS": "0"})
    while sys.stdin.readline().strip() == "go":
        queue = EmptyQueue()
        queue.worker = Worker(settings.loop_config(), queue, lambda message, lease: None)
        print(f"done {run_worker(queue.worker)}", flush=True)


if __name__ == "__main__":
    main()
