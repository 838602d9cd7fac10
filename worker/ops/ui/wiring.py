"""The page's sources built from the settings: the store the CLI opened, the queue's counts when
SQS_QUEUE_URL is set, and the shipped stage logs when S3_BUCKET is (``worker.ops.logs``). Nothing of
the settings goes further than this module: the page never sees them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from worker.ops.ui.server import serve
from worker.ops.ui.sources import LogTail, QueueLook, Sources
from worker.settings import Settings
from worker.voice.records import Store


def queue_look(settings: Settings, clients: Callable[[str], Any]) -> QueueLook | None:
    if not settings.sqs_queue_url:
        return None
    from worker.ops.queue_view import look

    url, sqs, cloudwatch = settings.sqs_queue_url, clients("sqs"), clients("cloudwatch")
    return lambda: look(sqs, url, cloudwatch, datetime.now(UTC))


def log_tail(settings: Settings, clients: Callable[[str], Any]) -> LogTail | None:
    from worker.ops.logs import shipped_logs, tail_lines

    logs = shipped_logs(settings, clients("s3")) if settings.s3_bucket else None
    if logs is None:
        return None
    return lambda job_id, count: "\n".join(tail_lines(logs, job_id, count))


def serve_ui(settings: Settings, store: Store, *, host: str, port: int, clients: Callable[[str], Any]) -> int:
    sources = Sources(store, queue_look=queue_look(settings, clients), log_tail=log_tail(settings, clients),
                      presence_interval_s=settings.presence_interval_s)
    return serve(sources, host, port)
