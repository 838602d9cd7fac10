"""The SQS adapter: receive, extend, release, delete, dead-letter. botocore errors stop here.

Every method makes exactly the SQS calls its name says; botocore's own retry mode (see ``worker.core.aws``)
handles throttling and 5xx, so there are no retry loops here. What is left after those retries becomes
``QueueError`` (try again later) or ``LeaseLost`` (the receipt handle is no longer ours).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

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
MAX_ATTRIBUTE_TEXT = 1024  # SQS allows 256 KiB, but an error attribute is for humans and alarms.


@dataclass(frozen=True)
class Message:
    """One received SQS message. ``received_at_s`` is on the monotonic clock of the receiving process."""

    message_id: str
    receipt_handle: str = field(repr=False)
    body: str = field(repr=False)
    receive_count: int
    received_at_s: float
    attributes: dict[str, str] = field(default_factory=dict, repr=False)
    message_attributes: dict[str, Any] = field(default_factory=dict, repr=False)


def is_lease_lost_error(code: str, message: str) -> bool:
    """True when SQS answered that the receipt handle no longer holds the message."""
    if code in _LOST_CODES:
        return True
    if code in ("InvalidParameterValue", "AWS.SimpleQueueService.InvalidParameterValue"):
        text = message.lower()
        return any(hint in text for hint in _LOST_PARAMETER_HINTS)
    return False


def _translate(exc: Exception, action: str) -> WorkerError:
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code, text = str(err.get("Code", "")), str(err.get("Message", ""))
        if is_lease_lost_error(code, text):
            return LeaseLost(f"{action}: receipt handle no longer valid ({code}: {text})")
        return QueueError(f"{action} failed: {code}: {text}")
    return QueueError(f"{action} failed: {type(exc).__name__}: {exc}")


class Queue:
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
        if not messages:
            return None
        raw = messages[0]
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

    def delete(self, message: Message) -> None:
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

    def dead_letter_url(self) -> str | None:
        """The DLQ named by this queue's RedrivePolicy, or None when the queue has none."""
        try:
            attrs = self._sqs.get_queue_attributes(
                QueueUrl=self.url, AttributeNames=["RedrivePolicy", "QueueArn"]
            )["Attributes"]
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, "GetQueueAttributes") from exc
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
        params: dict[str, Any] = {
            "QueueUrl": dlq_url,
            "MessageBody": message.body,
            "MessageAttributes": dead_letter_attributes(message, error, self.url),
        }
        if dlq_url.endswith(".fifo"):
            params["MessageGroupId"] = message.attributes.get("MessageGroupId", message.message_id)
            params["MessageDeduplicationId"] = message.message_id
        try:
            self._sqs.send_message(**params)
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, "SendMessage to the dead-letter queue") from exc
        return True


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

    Read exactly as ``Queue.dead_letter_url`` reads it; tools that already hold the queue's
    attributes resolve the DLQ with this instead of asking SQS for them again.
    """
    arn = json.loads(redrive_policy)["deadLetterTargetArn"]
    # arn:aws:sqs:<region>:<account>:<name>
    _, _, _, _, account, name = arn.split(":", 5)
    return account, name
