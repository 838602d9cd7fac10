"""Shared pieces of the SQS benchmarks: the local server, a paced feeder, counters of work and requests.

Not a test and not imported by one: the benchmarks print what they measure and assert nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import boto3

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from worker.ops.demo import LocalAws  # noqa: E402  (re-exported: the one way this project starts moto)

__all__ = ["LocalAws", "Handled", "Feeder", "RequestCounter", "session", "new_queue", "ROOT"]


def session() -> boto3.session.Session:
    # moto accepts any credentials; fixed ones keep the benchmark away from a real AWS profile.
    return boto3.session.Session(aws_access_key_id="bench", aws_secret_access_key="bench",
                                 region_name="us-east-1")


def new_queue(sqs, name: str) -> str:
    return sqs.create_queue(QueueName=name, Attributes={"VisibilityTimeout": "30"})["QueueUrl"]


class Handled:
    """How many messages a consumer has handled; wakes the feeder and the clock."""

    def __init__(self, target: int):
        self.target = target
        self.count = 0
        self.done_at: float | None = None
        self.changed = threading.Condition()

    def add(self, n: int = 1) -> None:
        with self.changed:
            self.count += n
            if self.count >= self.target and self.done_at is None:
                self.done_at = time.perf_counter()
            self.changed.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.count >= count, timeout_s)


class Feeder(threading.Thread):
    """Sends ``total`` messages, never more than ``depth`` ahead of what the consumer has handled.

    This keeps the queue shallow, as a worker fleet sized to its load sees it: each receive finds a
    message or two, so batching and prefetch cannot hide a consumer's per-message cost.
    """

    def __init__(self, send: Callable[[int], None], handled: Handled, total: int, depth: int, base: int = 0):
        super().__init__(daemon=True, name="feeder")
        self._send, self._handled, self._total, self._depth, self._base = send, handled, total, depth, base
        self.started_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.started_at = time.perf_counter()
            for n in range(self._total):
                with self._handled.changed:
                    self._handled.changed.wait_for(lambda n=n: self._base + n - self._handled.count < self._depth)
                self._send(n)
        except BaseException as exc:  # reported by the caller; a dead feeder must not look like a slow consumer
            self.error = exc


class RequestCounter:
    """Counts the HTTP requests a boto3 client sends, per SQS operation."""

    def __init__(self, client):
        self.by_operation: Counter = Counter()
        self._lock = threading.Lock()
        client.meta.events.register("before-send.sqs", self._count)

    def _count(self, event_name: str, **_kwargs) -> None:
        with self._lock:
            self.by_operation[event_name.rsplit(".", 1)[-1]] += 1

    def total(self) -> int:
        return sum(self.by_operation.values())
