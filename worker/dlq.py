"""The dead-letter queue: look without taking, and move messages back to the source queue.

The DLQ is the one named by the source queue's RedrivePolicy. Two kinds of messages end up there:
the worker's own (a permanent failure: it sends the body with ErrorType, ErrorMessage, ReceiveCount
and SourceQueue attributes, see ``worker.queue.dead_letter_attributes``) and SQS's (a message
received ``maxReceiveCount`` times without a delete: no attributes of ours).

Looking (``peek``) has to receive, and SQS has no other way: each message is received with a short
``hold_s`` visibility, so the scan does not see it twice, and made visible again at the end
(``release``). The trade-offs: while a scan runs those messages are hidden from everyone for at most
``hold_s``, and every look adds one to the DLQ copy's ApproximateReceiveCount — so the DLQ itself
must have no RedrivePolicy of its own.

Redriving uses SQS's ``StartMessageMoveTask`` (everything, in the background) where the service
supports it. With ``--max``, with ``--fallback``, or when the endpoint does not implement it (local
emulators), it receives, sends to the source queue, and deletes from the DLQ only after that send
succeeded: a failure can leave a message in both queues (the worker acknowledges the duplicate
without work), never in neither.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from worker.errors import QueueError
from worker.logs import scrub
from worker.message import job_id_hint
from worker.queue import Queue, sendable_attribute

log = structlog.get_logger(__name__)

# The attributes worker.queue.dead_letter_attributes adds; a redriven message goes back without them.
OUR_ATTRIBUTES = ("ErrorType", "ErrorMessage", "ReceiveCount", "SourceQueue")
# Answers meaning "this endpoint has no StartMessageMoveTask", as opposed to a failure worth retrying.
_UNSUPPORTED_CODES = frozenset({
    "UnsupportedOperation", "AWS.SimpleQueueService.UnsupportedOperation", "InvalidAction",
    "NotImplemented", "UnknownOperation", "UnknownOperationException",
})
BATCH = 10  # SQS's most per receive and per batch call
MOVE_TASK, RECEIVE_SEND_DELETE = "move_task", "receive_send_delete"


def _queue_error(exc: Exception, action: str) -> QueueError:
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        return QueueError(f"{action} failed: {err.get('Code', '')}: {err.get('Message', '')}"[:500])
    return QueueError(f"{action} failed: {type(exc).__name__}: {exc}"[:500])


def move_task_unsupported(exc: BaseException) -> bool:
    """True when the endpoint does not implement StartMessageMoveTask (moto raises NotImplementedError)."""
    if isinstance(exc, NotImplementedError):
        return True
    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in _UNSUPPORTED_CODES


def _attr_text(attrs: dict, name: str) -> str | None:
    value = (attrs.get(name) or {}).get("StringValue")
    return value if value else None


def dead_letter_receives(message_attributes: dict, max_receive_count: int | None, approximate: int) -> int:
    """How often the source queue delivered the message before it was dead-lettered.

    The worker's copy says so itself (ReceiveCount); SQS moves a message on the receive after
    ``maxReceiveCount``; failing both, the DLQ copy's own approximate count (looks included).
    """
    stated = _attr_text(message_attributes, "ReceiveCount")
    if stated and stated.isdigit():
        return int(stated)
    return max_receive_count if max_receive_count else approximate


def redrive_attributes(message_attributes: dict) -> dict:
    """The message's own attributes, without the ones the dead-lettering added, in sendable form."""
    return {name: sendable_attribute(attr)
            for name, attr in message_attributes.items() if name not in OUR_ATTRIBUTES}


@dataclass(frozen=True)
class DeadLetter:
    message_id: str
    receipt_handle: str = field(repr=False)
    body: str = field(repr=False)
    receive_count: int
    sent_at_ms: int | None
    job_id: str | None
    error_type: str | None
    error_message: str | None
    source_queue: str | None
    message_attributes: dict = field(default_factory=dict, repr=False)
    attributes: dict = field(default_factory=dict, repr=False)

    def age_s(self, now_s: float) -> float | None:
        return None if self.sent_at_ms is None else max(0.0, now_s - self.sent_at_ms / 1000)

    def for_record(self) -> dict:
        """What ``Store.record_dead_letter`` keeps on the job."""
        return {"messageId": self.message_id, "receiveCount": self.receive_count,
                "errorType": self.error_type, "errorMessage": self.error_message,
                "sourceQueue": self.source_queue}

    def summary(self, now_s: float) -> dict:
        age_s = self.age_s(now_s)
        return {"messageId": self.message_id, "jobId": self.job_id, "receiveCount": self.receive_count,
                "errorType": self.error_type,
                "errorMessage": scrub(self.error_message) if self.error_message else None,
                "sourceQueue": self.source_queue, "ageSeconds": None if age_s is None else round(age_s)}


@dataclass
class RedriveResult:
    method: str
    task_handle: str | None = None
    moved: int = 0
    # Sent to the source queue but still in the DLQ (its delete failed): a later redrive duplicates it.
    not_deleted: list[str] = field(default_factory=list)
    fallback_reason: str | None = None
    error: str | None = None  # why it stopped early; ``moved`` says how far it got


class DeadLetterQueue:
    def __init__(self, sqs, source_url: str, url: str, *, max_receive_count: int | None = None,
                 clock: Callable[[], float] = time.time, wait_s: int = 1):
        self._sqs = sqs
        self.source_url = source_url
        self.url = url
        self.max_receive_count = max_receive_count
        self._clock = clock
        # An empty short-poll answer may come from a server sampling only part of the queue; a
        # (short) long poll asks them all, so "nothing came back" really means the queue is done.
        self._wait_s = wait_s

    @classmethod
    def of(cls, sqs, source_url: str, *, clock: Callable[[], float] = time.time,
           wait_s: int = 1) -> DeadLetterQueue | None:
        """The DLQ of ``source_url`` from its RedrivePolicy, or None when it has none."""
        url = Queue(sqs, source_url).dead_letter_url()
        if url is None:
            return None
        try:
            policy = json.loads(sqs.get_queue_attributes(
                QueueUrl=source_url, AttributeNames=["RedrivePolicy"])["Attributes"]["RedrivePolicy"])
        except (ClientError, BotoCoreError) as exc:
            raise _queue_error(exc, "GetQueueAttributes") from exc
        max_receives = str(policy.get("maxReceiveCount", ""))
        return cls(sqs, source_url, url, clock=clock, wait_s=wait_s,
                   max_receive_count=int(max_receives) if max_receives.isdigit() else None)

    def now_s(self) -> float:
        return self._clock()

    # ------------------------------------------------------------ looking

    def _receive(self, count: int, hold_s: int) -> list[DeadLetter]:
        try:
            resp = self._sqs.receive_message(
                QueueUrl=self.url, MaxNumberOfMessages=max(1, min(BATCH, count)), WaitTimeSeconds=self._wait_s,
                VisibilityTimeout=hold_s, MessageSystemAttributeNames=["All"], MessageAttributeNames=["All"])
        except (ClientError, BotoCoreError) as exc:
            raise _queue_error(exc, "ReceiveMessage from the dead-letter queue") from exc
        return [self._letter(raw) for raw in resp.get("Messages") or []]

    def _letter(self, raw: dict) -> DeadLetter:
        attrs, msg_attrs = raw.get("Attributes") or {}, raw.get("MessageAttributes") or {}
        sent = attrs.get("SentTimestamp", "")
        approximate = int(attrs.get("ApproximateReceiveCount", "1"))
        return DeadLetter(
            message_id=raw["MessageId"], receipt_handle=raw["ReceiptHandle"], body=raw.get("Body", ""),
            receive_count=dead_letter_receives(msg_attrs, self.max_receive_count, approximate),
            sent_at_ms=int(sent) if sent.isdigit() else None, job_id=job_id_hint(raw.get("Body", "")),
            error_type=_attr_text(msg_attrs, "ErrorType"),
            error_message=_attr_text(msg_attrs, "ErrorMessage"),
            source_queue=_attr_text(msg_attrs, "SourceQueue"), message_attributes=dict(msg_attrs),
            attributes=dict(attrs))

    def peek(self, max_messages: int = 1000, *, hold_s: int = 30) -> list[DeadLetter]:
        """Up to ``max_messages`` DLQ messages, each once, hidden for ``hold_s``: call ``release`` after."""
        seen: dict[str, DeadLetter] = {}
        try:
            while len(seen) < max_messages:
                batch = self._receive(max_messages - len(seen), hold_s)
                fresh = [letter for letter in batch if letter.message_id not in seen]
                seen.update((letter.message_id, letter) for letter in batch)
                if not fresh:  # empty, or only repeats: the whole queue has been seen
                    break
        except QueueError:
            self.release(seen.values())
            raise
        return list(seen.values())

    def release(self, letters: Iterable[DeadLetter]) -> None:
        """Make looked-at messages visible again now; a failure only delays them by ``hold_s``."""
        letters = list(letters)
        for start in range(0, len(letters), BATCH):
            chunk = letters[start:start + BATCH]
            entries = [{"Id": str(i), "ReceiptHandle": letter.receipt_handle, "VisibilityTimeout": 0}
                       for i, letter in enumerate(chunk)]
            try:
                resp = self._sqs.change_message_visibility_batch(QueueUrl=self.url, Entries=entries)
            except (ClientError, BotoCoreError) as exc:
                log.warning("dlq.release_failed",
                            error=str(_queue_error(exc, "ChangeMessageVisibilityBatch")))
                continue
            failed = resp.get("Failed")
            if failed:
                log.warning("dlq.release_failed", messages=len(failed), code=failed[0].get("Code"))

    # ------------------------------------------------------------ moving back

    def redrive(self, *, max_messages: int | None = None, fallback: bool = False,
                hold_s: int = 60) -> RedriveResult:
        """Move messages back to the source queue (see the module docstring); failures are in ``error``."""
        reason = "--fallback" if fallback else ("--max" if max_messages is not None else None)
        if reason is None:
            try:
                return RedriveResult(MOVE_TASK, task_handle=self._start_move_task())
            except QueueError as exc:
                return RedriveResult(MOVE_TASK, error=str(exc))
            except (ClientError, BotoCoreError, NotImplementedError) as exc:
                if not move_task_unsupported(exc):
                    error = _queue_error(exc, "StartMessageMoveTask (try again, or use --fallback)")
                    return RedriveResult(MOVE_TASK, error=str(error))
                reason = "StartMessageMoveTask is not supported by this endpoint"
                log.info("dlq.move_task_unsupported", fallback=RECEIVE_SEND_DELETE)
        result = RedriveResult(RECEIVE_SEND_DELETE, fallback_reason=reason)
        try:
            self._receive_send_delete(result, max_messages, hold_s)
        except QueueError as exc:
            result.error = str(exc)
        return result

    def _arn(self, url: str) -> str:
        try:
            attrs = self._sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]
        except (ClientError, BotoCoreError) as exc:
            raise _queue_error(exc, "GetQueueAttributes") from exc
        return attrs["QueueArn"]

    def _start_move_task(self) -> str:
        # The destination is explicit: the worker's own dead-letter sends have no "original source".
        resp = self._sqs.start_message_move_task(SourceArn=self._arn(self.url),
                                                 DestinationArn=self._arn(self.source_url))
        return resp["TaskHandle"]

    def _receive_send_delete(self, result: RedriveResult, max_messages: int | None, hold_s: int) -> None:
        handled: set[str] = set()
        while max_messages is None or result.moved < max_messages:
            want = BATCH if max_messages is None else max_messages - result.moved
            received = self._receive(want, hold_s)
            batch = [letter for letter in received if letter.message_id not in handled]
            if not batch:
                # Only messages already sent (their delete failed): put them back as they were.
                self.release(received)
                return
            for index, letter in enumerate(batch):
                handled.add(letter.message_id)
                try:
                    self._send_to_source(letter)
                except QueueError:
                    # Nothing was deleted: this one and the rest of the batch go back to the DLQ now.
                    self.release(batch[index:])
                    raise
                try:
                    self._sqs.delete_message(QueueUrl=self.url, ReceiptHandle=letter.receipt_handle)
                except (ClientError, BotoCoreError) as exc:
                    log.warning("dlq.delete_failed", message_id=letter.message_id,
                                error=str(_queue_error(exc, "DeleteMessage")))
                    result.not_deleted.append(letter.message_id)
                result.moved += 1

    def _send_to_source(self, letter: DeadLetter) -> None:
        params: dict[str, Any] = {"QueueUrl": self.source_url, "MessageBody": letter.body}
        attributes = redrive_attributes(letter.message_attributes)
        if attributes:
            params["MessageAttributes"] = attributes
        if self.source_url.endswith(".fifo"):
            group = letter.attributes.get("MessageGroupId") or letter.job_id or letter.message_id
            params["MessageGroupId"] = group
            params["MessageDeduplicationId"] = letter.message_id
        try:
            self._sqs.send_message(**params)
        except (ClientError, BotoCoreError) as exc:
            raise _queue_error(exc, f"SendMessage of {letter.message_id} to the source queue") from exc


# ------------------------------------------------------------ the operator's commands

def format_age(age_s: float | None) -> str:
    if age_s is None:
        return "?"
    minutes, _ = divmod(int(age_s), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h" if days else (f"{hours}h{minutes:02d}m" if hours else f"{minutes}m")


def render_letter(summary: dict) -> str:
    error = (f"{summary['errorType']}: {summary['errorMessage'] or '-'}" if summary["errorType"]
             else "(moved by SQS's redrive policy: no error attributes)")
    return (f"{summary['messageId']}  job {summary['jobId'] or '-'}  receives {summary['receiveCount']}  "
            f"age {format_age(summary['ageSeconds'])}  {error}")


def cmd_dlq_list(dlq: DeadLetterQueue, *, as_json: bool, max_messages: int = 1000,
                 out: TextIO | None = None) -> int:
    out = out or sys.stdout
    letters = dlq.peek(max_messages)
    dlq.release(letters)
    now_s = dlq.now_s()
    summaries = sorted((letter.summary(now_s) for letter in letters),
                       key=lambda s: -(s["ageSeconds"] or 0))
    if as_json:
        print(json.dumps(summaries), file=out)
    elif not summaries:
        print(f"the dead-letter queue is empty ({dlq.url})", file=out)
    else:
        print(f"{len(summaries)} message(s) in {dlq.url}, oldest first:", file=out)
        for summary in summaries:
            print(render_letter(summary), file=out)
    return 0


def cmd_dlq_redrive(dlq: DeadLetterQueue, *, max_messages: int | None, fallback: bool,
                    out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    result = dlq.redrive(max_messages=max_messages, fallback=fallback)
    if result.method == MOVE_TASK and result.error is None:
        print(f"started a message move task ({result.task_handle}): the dead-letter queue's messages "
              f"go back to {dlq.source_url} in the background; `dlq list` shows what is left", file=out)
        return 0
    if result.method == RECEIVE_SEND_DELETE:
        print(f"moved {result.moved} message(s) back to {dlq.source_url} by receive, send, delete "
              f"({result.fallback_reason})", file=out)
    for message_id in result.not_deleted:
        print(f"  {message_id}: sent, but its delete from the dead-letter queue failed: it is in both "
              "queues (the worker acknowledges the duplicate without work)", file=out)
    if result.error:
        print(f"redrive stopped: {scrub(result.error)}", file=err)
        return 1
    return 0
