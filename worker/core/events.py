"""Job state-change events to an SNS topic or an EventBridge bus (``EVENTS_TARGET``): the one place
either service is called.

A product backend that wants to know when a job is done should not have to poll the records; with
``EVENTS_TARGET`` set, the worker publishes one event each time it records a job's outcome:
``JobCompleted``, ``JobFailed`` (a retry will follow; or, with ``outcome: "refused"``, the job ended
final below its quality bar and its message is acknowledged: the detail says why), ``JobDeadLettered``
(no retry: the message goes to the DLQ) and ``JobCancelled``. The event is JSON (``detail``); on SNS
it is the message, with the type as the ``eventType`` message attribute (for subscription filters);
on EventBridge it is the entry's ``Detail``, with ``Source`` ``voice-worker`` and the type as
``DetailType``.

Events are best effort and come after the record they describe: the job record stays the source of
truth. A publish that fails is one warning, never a failure of the job; a redelivered message that
needs no work publishes nothing again. Each call waits at most a few seconds (the client is made
with ``worker.core.aws.notice_client_config``: 3 s to connect, 5 s to read, two attempts), on the
job's thread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import structlog
from botocore.exceptions import BotoCoreError, ClientError

log = structlog.get_logger(__name__)

SOURCE = "voice-worker"
COMPLETED, FAILED, DEAD_LETTERED, CANCELLED = "JobCompleted", "JobFailed", "JobDeadLettered", "JobCancelled"
# Matched whole (fullmatch: "$" would also take a trailing newline) and in ASCII ([0-9]: "\d" also
# takes other scripts' digits), as AWS spells ARNs.
_SNS_TOPIC = re.compile(r"arn:aws[a-z-]*:sns:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_-]{1,256}(\.fifo)?")
_EVENT_BUS = re.compile(r"arn:aws[a-z-]*:events:[a-z0-9-]+:[0-9]{12}:event-bus/[A-Za-z0-9._/-]{1,256}")


def target_problem(target: str) -> str | None:
    """Why ``target`` is neither an SNS topic ARN nor an EventBridge bus ARN; None when it is one (or empty)."""
    if not target or _SNS_TOPIC.fullmatch(target) or _EVENT_BUS.fullmatch(target):
        return None
    return "must be an SNS topic ARN (arn:aws:sns:...) or an EventBridge bus ARN (arn:aws:events:...:event-bus/NAME)"


def target_service(target: str) -> str:
    """``sns`` or ``events``: which client ``target`` needs."""
    return "sns" if _SNS_TOPIC.fullmatch(target) else "events"


class Events(Protocol):
    def publish(self, event_type: str, detail: Mapping[str, Any]) -> None: ...


class NoEvents:
    """No target configured: nothing is published."""

    def publish(self, event_type: str, detail: Mapping[str, Any]) -> None:
        pass


class Publisher:
    """Publishes to ``target`` with a client made by ``client`` (at the first event)."""

    def __init__(self, target: str, client: Callable[[], Any]):
        self._target, self._client, self._sns = target, client, bool(_SNS_TOPIC.fullmatch(target))

    def publish(self, event_type: str, detail: Mapping[str, Any]) -> None:
        body = json.dumps(detail, sort_keys=True, default=str)
        try:
            if self._sns:
                self._client().publish(
                    TopicArn=self._target, Message=body,
                    MessageAttributes={"eventType": {"DataType": "String", "StringValue": event_type}},
                    **(self._fifo(event_type, detail) if self._target.endswith(".fifo") else {}))
            else:
                answer = self._client().put_events(Entries=[{
                    "Source": SOURCE, "DetailType": event_type, "Detail": body, "EventBusName": self._target}])
                if answer.get("FailedEntryCount"):
                    entry = (answer.get("Entries") or [{}])[0]
                    raise _Refused(f"{entry.get('ErrorCode', '')} {entry.get('ErrorMessage', '')}".strip())
        except (BotoCoreError, ClientError, _Refused) as exc:
            log.warning("events.publish_failed", event_type=event_type, job_id=detail.get("jobId"),
                        error=f"{type(exc).__name__}: {exc}"[:300])
            return
        log.info("events.published", event_type=event_type)


    @staticmethod
    def _fifo(event_type: str, detail: Mapping[str, Any]) -> dict[str, str]:
        """A FIFO topic's group (the job: its events stay in order) and deduplication id (the event
        itself), so a topic without content-based deduplication takes it too."""
        job = str(detail.get("jobId", "job"))
        return {"MessageGroupId": job, "MessageDeduplicationId": f"{job}-{event_type}-{detail.get('at', '')}"[:128]}


class _Refused(Exception):
    """EventBridge accepted the call but not the entry."""
