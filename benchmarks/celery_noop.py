"""The Celery contender of benchmarks/throughput.py: a no-op task on Celery's SQS transport.

Started by the benchmark as ``python -m celery -A benchmarks.celery_noop worker --pool=solo …`` with
BENCH_SQS_HOSTPORT (the moto server), BENCH_QUEUE_URL and BENCH_NOTIFY_PORT in the environment. The
task tells the benchmark it ran with one UDP datagram to 127.0.0.1:BENCH_NOTIFY_PORT.

Settings chosen to match the other contenders: one message at a time (prefetch multiplier 1, solo
pool), acknowledged after the task ran (acks_late, like a worker that deletes after the work), long
polls of 1 s with no extra client-side pause.
"""

from __future__ import annotations

import os
import socket

from celery import Celery

QUEUE = "bench"

app = Celery("bench_noop")
app.conf.update(
    broker_url=f"sqs://bench:bench@{os.environ.get('BENCH_SQS_HOSTPORT', '127.0.0.1:1')}",
    broker_transport_options={
        "region": "us-east-1",
        "is_secure": False,
        "wait_time_seconds": 1,
        "polling_interval": 0,
        "predefined_queues": {QUEUE: {"url": os.environ.get("BENCH_QUEUE_URL", ""),
                                      "access_key_id": "bench", "secret_access_key": "bench"}},
    },
    broker_connection_retry_on_startup=True,
    task_default_queue=QUEUE,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    result_backend=None,
    task_ignore_result=True,
)

_notify = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


@app.task(name="bench.noop")
def noop() -> None:
    _notify.sendto(b"1", ("127.0.0.1", int(os.environ["BENCH_NOTIFY_PORT"])))
