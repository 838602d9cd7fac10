"""The SQS adapter: every SQS call of the project is made here, and botocore errors stop here.

The loop receives, extends, releases, deletes and dead-letters; ``submit`` and the reconciler send;
the dead-letter tools (``worker.ops.dlq``) receive and release in batches, delete, read attributes
and start message move tasks. Every method makes exactly the SQS calls its name says; botocore's own
retry mode (see ``worker.core.aws``) handles throttling and 5xx, so there are no retry loops here.
What is left after those retries becomes ``QueueError`` (try again later) or ``LeaseLost`` (the
receipt handle is no longer ours).

A FIFO queue (``.fifo``) needs a MessageGroupId and a MessageDeduplicationId on each send, so
``send`` takes both from every caller and passes them where the queue is FIFO: the group is the
job's (the message's own group when it had one), the deduplication id one the caller keeps stable
for that send (a job id, a message id), so a retried send within SQS's 5-minute deduplication interval is dropped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from botocore.exceptions import BotoCoreError, ClientError

from worker.core import broker
from worker.core.broker import Message
from worker.core.errors import ConfigError, LeaseLost, QueueError, WorkerError
from worker.core.redact import redact_text

# Error codes that mean "this receipt handle no longer holds the message": renewing, releasing or
# deleting with it cannot work, and another consumer may already have the message.
_LOST_CODES = frozenset(
    {
        "ReceiptHandleIsInvalid",
        "MessageNotInflight",
        "AWS.SimpleQueueService.MessageNotInflight",
        "InvalidReceiptHandle",
    }
)
# InvalidParameterValue is also used for bad input in general; only these texts mean the lease is gone.
_LOST_PARAMETER_HINTS = ("receipt handle", "receipthandle", "12 hours", "43200", "beyond the limit",
                         "maximum visibility timeout")
# The JSON protocol says QueueDoesNotExist, the query protocol the long form.
_MISSING_QUEUE_CODES = frozenset({"QueueDoesNotExist", "AWS.SimpleQueueService.NonExistentQueue"})
# Answers meaning "this endpoint has no StartMessageMoveTask", as opposed to a failure worth retrying.
_UNSUPPORTED_CODES = frozenset({
    "UnsupportedOperation", "AWS.SimpleQueueService.UnsupportedOperation", "InvalidAction",
    "NotImplemented", "UnknownOperation", "UnknownOperationException",
})
MAX_ATTRIBUTE_TEXT = 1024  # SQS allows 256 KiB, but an error attribute is for humans and alarms.
MAX_BATCH = 10  # SQS's most per receive and per batch call
MAX_VISIBILITY_S = 43_200  # SQS's ceiling on a message's visibility: 12 hours from the receive
# A parse error can quote a whole HTML error page; the error is for a log line or a terminal.
_MAX_ERROR_TEXT = 500


class Receipt(Protocol):
    """Anything received from a queue: a ``Message``, or a tool's view of one (``worker.ops.dlq.DeadLetter``)."""

    @property
    def receipt_handle(self) -> str: ...


def _message(raw: dict, received_at_s: float) -> Message:
    attrs = raw.get("Attributes") or {}
    return Message(
        message_id=raw["MessageId"],
        receipt_handle=raw["ReceiptHandle"],
        body=raw.get("Body", ""),
        receive_count=int(attrs.get("ApproximateReceiveCount", "1")),
        received_at_s=received_at_s,
        attributes=dict(attrs),
        message_attributes=dict(raw.get("MessageAttributes") or {}),
    )


def is_lease_lost_error(code: str, message: str) -> bool:
    """True when SQS answered that the receipt handle no longer holds the message."""
    if code in _LOST_CODES:
        return True
    if code in ("InvalidParameterValue", "AWS.SimpleQueueService.InvalidParameterValue"):
        text = message.lower()
        return any(hint in text for hint in _LOST_PARAMETER_HINTS)
    return False


def move_task_unsupported(exc: BaseException) -> bool:
    """True when the endpoint does not implement StartMessageMoveTask (moto raises NotImplementedError)."""
    if isinstance(exc, NotImplementedError):
        return True
    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in _UNSUPPORTED_CODES


def _translate(exc: Exception, action: str) -> WorkerError:
    """The one translation of botocore's exceptions into the project's errors."""
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code, text = str(err.get("Code", "")), str(err.get("Message", ""))
        if is_lease_lost_error(code, text):
            return LeaseLost(f"{action}: receipt handle no longer valid ({code}: {text})"[:_MAX_ERROR_TEXT])
        return QueueError(f"{action} failed: {code}: {text}"[:_MAX_ERROR_TEXT])
    return QueueError(f"{action} failed: {type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT])


class Queue:
    """One SQS queue. It implements ``worker.core.broker.Queue`` (receive, extend, set_visibility,
    release, delete, dead_letter: the loop's and the heartbeat's calls); the rest serves ``submit``,
    the reconciler and the DLQ tools. ``Message`` is re-exported from ``worker.core.broker``."""

    def __init__(self, client, queue_url: str, *, lease_client=None, clock=time.monotonic):
        self._sqs = client
        # Renewals get their own client with short timeouts and few retries: a renewal that hangs
        # for minutes would hide a lapsing lease (see worker.core.aws.lease_client_config).
        self._lease_sqs = lease_client or client
        self.url = queue_url
        self._clock = clock

    def receive(self, *, wait_s: int, visibility_timeout_s: int) -> Message | None:
        """Long-poll for one message, invisible for ``visibility_timeout_s`` from its receipt on."""
        try:
            resp = self._sqs.receive_message(
                QueueUrl=self.url,
                MaxNumberOfMessages=1,
                WaitTimeSeconds=wait_s,
                VisibilityTimeout=visibility_timeout_s,
                MessageSystemAttributeNames=["ApproximateReceiveCount", "MessageGroupId"],
                MessageAttributeNames=["All"],
            )
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, "ReceiveMessage") from exc
        received_at_s = self._clock()
        messages = resp.get("Messages") or []
        return _message(messages[0], received_at_s) if messages else None

    def receive_batch(self, max_messages: int, *, wait_s: int, visibility_timeout_s: int,
                      action: str = "ReceiveMessage") -> list[Message]:
        """Up to ``max_messages`` (at most ``MAX_BATCH``) messages with all their attributes, each
        invisible for ``visibility_timeout_s``; ``action`` names the call in the error."""
        try:
            resp = self._sqs.receive_message(
                QueueUrl=self.url,
                MaxNumberOfMessages=max(1, min(MAX_BATCH, max_messages)),
                WaitTimeSeconds=wait_s,
                VisibilityTimeout=visibility_timeout_s,
                MessageSystemAttributeNames=["All"],
                MessageAttributeNames=["All"],
            )
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, action) from exc
        received_at_s = self._clock()
        return [_message(raw, received_at_s) for raw in resp.get("Messages") or []]

    def set_visibility(self, message: Message, timeout_s: int) -> None:
        """Reset (not add to) the message's visibility: it becomes visible ``timeout_s`` from now."""
        try:
            self._sqs.change_message_visibility(
                QueueUrl=self.url, ReceiptHandle=message.receipt_handle, VisibilityTimeout=timeout_s
            )
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, "ChangeMessageVisibility") from exc

    def extend(self, message: Message, timeout_s: int) -> None:
        """The heartbeat's renewal: like ``set_visibility``, through the lease client."""
        try:
            self._lease_sqs.change_message_visibility(
                QueueUrl=self.url, ReceiptHandle=message.receipt_handle, VisibilityTimeout=timeout_s
            )
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, "ChangeMessageVisibility (renewal)") from exc

    def release(self, message: Message) -> None:
        """Make the message visible now, so another worker can take it at once."""
        self.set_visibility(message, 0)

    def release_batch(self, messages: Sequence[Receipt]) -> list[dict]:
        """Make up to ``MAX_BATCH`` received messages visible now in one call; the entries SQS refused.

        A failure of the call itself raises; one entry's failure (its handle expired, say) is only
        listed, as SQS answers it.
        """
        if len(messages) > MAX_BATCH:
            raise ValueError(f"at most {MAX_BATCH} messages per batch, got {len(messages)}")
        if not messages:
            return []
        entries = [{"Id": str(i), "ReceiptHandle": m.receipt_handle, "VisibilityTimeout": 0}
                   for i, m in enumerate(messages)]
        try:
            resp = self._sqs.change_message_visibility_batch(QueueUrl=self.url, Entries=entries)
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, "ChangeMessageVisibilityBatch") from exc
        return list(resp.get("Failed") or [])

    def delete(self, message: Receipt) -> None:
        try:
            self._sqs.delete_message(QueueUrl=self.url, ReceiptHandle=message.receipt_handle)
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, "DeleteMessage") from exc

    def check_exists(self) -> None:
        """ConfigError when the queue does not exist; any other failure (after botocore's retries) is a QueueError."""
        try:
            self._sqs.get_queue_attributes(QueueUrl=self.url, AttributeNames=["QueueArn"])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _MISSING_QUEUE_CODES:
                raise ConfigError(f"SQS_QUEUE_URL names a queue that does not exist: {self.url}") from None
            raise _translate(exc, "GetQueueAttributes") from exc
        except BotoCoreError as exc:
            raise _translate(exc, "GetQueueAttributes") from exc

    def attributes(self, *names: str, action: str = "GetQueueAttributes") -> dict[str, str]:
        """The queue's attributes of those ``names`` (``"All"`` for every one) that it has."""
        try:
            return dict(self._sqs.get_queue_attributes(QueueUrl=self.url, AttributeNames=list(names))
                        .get("Attributes") or {})
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, action) from exc

    def arn(self) -> str:
        return self.attributes("QueueArn")["QueueArn"]

    def dead_letter_url(self, attributes: dict[str, str] | None = None) -> str | None:
        """The DLQ named by this queue's RedrivePolicy, or None when the queue has none.

        Read from ``attributes`` when the caller holds the queue's already (``doctor``), else asked for.
        """
        attrs = self.attributes("RedrivePolicy", "QueueArn") if attributes is None else attributes
        policy = attrs.get("RedrivePolicy")
        if not policy:
            return None
        account, name = dead_letter_target(policy)
        try:
            return self._sqs.get_queue_url(QueueName=name, QueueOwnerAWSAccountId=account)["QueueUrl"]
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, "GetQueueUrl") from exc

    def dead_letter(self, message: Message, error: WorkerError) -> bool:
        """Copy the body to the DLQ with why it failed; True if sent, False if there is no DLQ.

        The caller deletes the original only after this returned True.
        """
        dlq_url = self.dead_letter_url()
        if dlq_url is None:
            return False
        Queue(self._sqs, dlq_url).send(
            message.body, attributes=dead_letter_attributes(message, error, self.url),
            group_id=message.attributes.get("MessageGroupId", message.message_id),
            dedup_id=message.message_id, action="SendMessage to the dead-letter queue")
        return True

    @property
    def is_fifo(self) -> bool:
        return self.url.endswith(".fifo")

    def send(self, body: str, *, group_id: str, dedup_id: str, attributes: dict | None = None,
             action: str = "SendMessage") -> str:
        """Send ``body`` (with ``attributes``, when any); the new message's id.

        ``group_id`` and ``dedup_id`` become the MessageGroupId and MessageDeduplicationId where the
        queue is FIFO, and are left out elsewhere. ``action`` names the call in the error.
        """
        params: dict[str, Any] = {"QueueUrl": self.url, "MessageBody": body}
        if attributes:
            params["MessageAttributes"] = attributes
        if self.is_fifo:
            params["MessageGroupId"] = group_id
            params["MessageDeduplicationId"] = dedup_id
        try:
            return self._sqs.send_message(**params)["MessageId"]
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, action) from exc

    def start_move_task(self, destination: Queue, *, action: str = "StartMessageMoveTask") -> str | None:
        """Have SQS move every message of this queue to ``destination`` in the background; the task's
        handle, or None where the endpoint does not implement StartMessageMoveTask (local emulators).

        The destination is always named: the worker's own dead-letter sends have no "original source".
        """
        source_arn, destination_arn = self.arn(), destination.arn()
        try:
            resp = self._sqs.start_message_move_task(SourceArn=source_arn, DestinationArn=destination_arn)
        except (ClientError, BotoCoreError, NotImplementedError) as exc:
            if move_task_unsupported(exc):
                return None
            raise _translate(exc, action) from exc
        return resp["TaskHandle"]


if TYPE_CHECKING:
    # mypy holds the adapter to the protocol the loop takes: a method that drifts fails the type check.
    _IS_A_QUEUE: type[broker.Queue] = Queue


def dead_letter_attributes(message: Message, error: WorkerError, source_queue_url: str) -> dict:
    """The original message attributes (as many as fit in SQS's ten) plus why it was dead-lettered."""
    ours = {
        "ErrorType": {"DataType": "String", "StringValue": error.error_type},
        # Redacted again here: an error built from a library's text may quote a URL or a credential.
        "ErrorMessage": {"DataType": "String", "StringValue": (redact_text(str(error)) or "-")[:MAX_ATTRIBUTE_TEXT]},
        "ReceiveCount": {"DataType": "Number", "StringValue": str(message.receive_count)},
        "SourceQueue": {"DataType": "String", "StringValue": source_queue_url},
    }
    kept = {k: v for k, v in message.message_attributes.items() if k not in ours}
    room = 10 - len(ours)
    kept = {k: sendable_attribute(v) for k, v in sorted(kept.items())[:room]}
    return {**kept, **ours}


def sendable_attribute(attr: dict) -> dict:
    # A received attribute carries list fields SendMessage rejects when empty.
    return {k: v for k, v in attr.items() if k in ("DataType", "StringValue", "BinaryValue")}


def dead_letter_target(redrive_policy: str) -> tuple[str, str]:
    """(account, queue name) of the DLQ named by a RedrivePolicy's ``deadLetterTargetArn``.

    How ``Queue.dead_letter_url`` reads it.
    """
    arn = json.loads(redrive_policy)["deadLetterTargetArn"]
    # arn:aws:sqs:<region>:<account>:<name>
    _, _, _, _, account, name = arn.split(":", 5)
    return account, name
