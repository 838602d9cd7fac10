"""A real worker process whose handler is a job of TEST_JOB_SECONDS that honours its stop signal.

Used by the shutdown tests against a moto server: the same start-up path as ``python -m worker run``
(settings from the environment, logging, clients, signal handlers), with a stand-in handler.
"""

from __future__ import annotations

import os
import sys

from worker.core.aws import make_client
from worker.core.daemon import run_worker
from worker.core.logs import configure_logging
from worker.core.loop import Worker
from worker.core.queue import Queue
from worker.settings import load_settings


def handler(message, lease):
    if lease.stop.wait(float(os.environ.get("TEST_JOB_SECONDS", "60"))):
        lease.stop.raise_if_set()
    return "slept"


if __name__ == "__main__":
    settings = load_settings()
    configure_logging(settings.log_level, settings.log_format)
    queue = Queue(make_client("sqs", settings.aws_config()), settings.sqs_queue_url)
    sys.exit(run_worker(Worker(settings.loop_config(), queue, handler)))
