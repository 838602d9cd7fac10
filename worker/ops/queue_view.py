"""``queue``: how deep and how old the job queue is, and how deep its dead-letter queue, at a glance.

The counts are SQS's own approximate attributes (visible, in flight, delayed), read with one
GetQueueAttributes per queue: nothing is received, so looking never touches a message's receive count
or visibility. SQS does not tell the age of the oldest message through the queue's attributes; it
publishes it to CloudWatch (``ApproximateAgeOfOldestMessage``, one datapoint a minute), so the age is
the newest datapoint of the last 15 minutes, shown with how old that datapoint is — or the reason
there is none (no datapoint yet, no permission), never a guess.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from botocore.exceptions import BotoCoreError, ClientError

from worker.core.errors import LeaseLost, QueueError
from worker.core.queue import Queue

# What each count means to an operator; the order is the order printed.
COUNTS = (
    ("visible", "ApproximateNumberOfMessages", "waiting for a worker"),
    ("inFlight", "ApproximateNumberOfMessagesNotVisible",
     "received: a worker holds it, or it waits out a retry's backoff"),
    ("delayed", "ApproximateNumberOfMessagesDelayed", "sent with a delay, not yet visible"),
)
AGE_METRIC = "ApproximateAgeOfOldestMessage"
AGE_LOOKBACK = timedelta(minutes=15)
EXIT_OK, EXIT_FAILED = 0, 1


@dataclass(frozen=True)
class OldestAge:
    """The age of the oldest message SQS reported to CloudWatch, or why there is none."""

    age_s: float | None
    reported_at: str | None  # ISO 8601, UTC: when SQS measured it
    unavailable: str | None


@dataclass(frozen=True)
class QueueView:
    url: str
    visible: int | None
    inFlight: int | None  # noqa: N815 - the JSON field's own name
    delayed: int | None
    oldest: OldestAge | None  # the job queue's only: a DLQ's age is dlq list's business


def _count(attributes: dict[str, str], name: str) -> int | None:
    value = attributes.get(name)
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def queue_counts(queue: Queue) -> dict[str, int | None]:
    attributes = queue.attributes(*(name for _, name, _ in COUNTS))
    return {key: _count(attributes, name) for key, name, _ in COUNTS}


def oldest_age(cloudwatch, queue_name: str, now: datetime) -> OldestAge:
    """The newest ApproximateAgeOfOldestMessage datapoint of the last 15 minutes (the CloudWatch API's
    errors are translated here into a reason: this view is the metric's only reader)."""
    try:
        answer = cloudwatch.get_metric_statistics(
            Namespace="AWS/SQS", MetricName=AGE_METRIC, Dimensions=[{"Name": "QueueName", "Value": queue_name}],
            StartTime=now - AGE_LOOKBACK, EndTime=now, Period=60, Statistics=["Maximum"])
    except ClientError as exc:
        error = exc.response.get("Error", {})
        return OldestAge(None, None, f"CloudWatch refused: {error.get('Code', '?')}")
    except BotoCoreError as exc:
        return OldestAge(None, None, f"CloudWatch unreachable: {type(exc).__name__}")
    points = [p for p in answer.get("Datapoints") or [] if isinstance(p.get("Timestamp"), datetime)
              and isinstance(p.get("Maximum"), int | float)]
    if not points:
        return OldestAge(None, None, "no datapoint in the last 15 minutes (SQS reports it once a minute "
                                     "while the queue is active)")
    newest = max(points, key=lambda p: p["Timestamp"])
    stamp = newest["Timestamp"].astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return OldestAge(float(newest["Maximum"]), stamp, None)


def look(sqs, queue_url: str, cloudwatch, now: datetime) -> tuple[QueueView, QueueView | None]:
    """The job queue and its dead-letter queue (None when its RedrivePolicy names none); every SQS
    call through the adapter."""
    queue = Queue(sqs, queue_url)
    name = queue_url.rstrip("/").rsplit("/", 1)[-1]
    main = QueueView(queue_url, **queue_counts(queue), oldest=oldest_age(cloudwatch, name, now))
    dlq_url = queue.dead_letter_url()
    if dlq_url is None:
        return main, None
    return main, QueueView(dlq_url, **queue_counts(Queue(sqs, dlq_url)), oldest=None)


def _age_text(age_s: float) -> str:
    seconds = int(age_s)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s")


def render(main: QueueView, dlq: QueueView | None) -> str:
    def number(value: int | None) -> str:
        return "?" if value is None else str(value)

    lines = [f"queue  {main.url}"]
    for key, _, meaning in COUNTS:
        lines.append(f"  {key if key != 'inFlight' else 'in flight':<10} {number(getattr(main, key)):>6}  {meaning}")
    oldest = main.oldest
    if oldest is not None and oldest.age_s is not None:
        lines.append(f"  {'oldest':<10} {_age_text(oldest.age_s):>6}  (CloudWatch, measured {oldest.reported_at})")
    elif oldest is not None:
        lines.append(f"  {'oldest':<10} {'?':>6}  {oldest.unavailable}")
    if dlq is None:
        lines.append("dead letters  none: the queue has no RedrivePolicy")
    else:
        lines.append(f"dead letters  {dlq.url}")
        lines.append(f"  {'visible':<10} {number(dlq.visible):>6}  `python -m worker dlq list` shows them")
        lines.append(f"  {'in flight':<10} {number(dlq.inFlight):>6}  being listed or redriven")
    return "\n".join(lines)


def as_json(main: QueueView, dlq: QueueView | None) -> dict[str, Any]:
    return {"queue": asdict(main), "deadLetters": None if dlq is None else asdict(dlq)}


def cmd_queue(sqs, queue_url: str, cloudwatch, *, as_json_output: bool, out: TextIO | None = None,
              now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> int:
    out = out or sys.stdout
    try:
        main, dlq = look(sqs, queue_url, cloudwatch, now())
    except (QueueError, LeaseLost) as exc:
        from worker.ops.commands import error_line

        print(f"queue failed: {error_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(as_json(main, dlq)) if as_json_output else render(main, dlq), file=out)
    return EXIT_OK
