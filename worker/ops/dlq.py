"""The dead-letter queue: look without taking, and move messages back to the source queue.

The DLQ is the one named by the source queue's RedrivePolicy. Two kinds of messages end up there:
the worker's own (a permanent failure: it sends the body with ErrorType, ErrorMessage, ReceiveCount
and SourceQueue attributes, see ``worker.core.queue.dead_letter_attributes``) and SQS's (a message
received ``maxReceiveCount`` times without a delete: no attributes of ours).

Looking (``peek``) has to receive, and SQS has no other way: each message is received with a short
``hold_s`` visibility, so the scan does not see it twice, and made visible again at the end
(``release``). The trade-offs: while a scan runs those messages are hidden from everyone for at most
``hold_s``, and every look adds one to the DLQ copy's ApproximateReceiveCount — so the DLQ itself
must have no RedrivePolicy of its own.

Redriving uses SQS's ``StartMessageMoveTask`` (everything, in the background) where the service
supports it. With ``--max``, with ``--fallback``, or when the endpoint does not implement it (local
emulators: in-process moto raises NotImplementedError, the moto server answers HTTP 500 with an HTML
page; ``move_task_missing`` judges the answer, never the endpoint's address), it receives, sends to
the source queue, and deletes from the DLQ only after that send succeeded: a failure can leave a
message in both queues (the worker acknowledges the duplicate without work), never in neither.
Such a run moves at most the ApproximateNumberOfMessages of its start and never the same message
twice: one a worker dead-letters again during the run stays.
The operator's commands over this (``dlq list``, ``dlq redrive``) are in ``worker.ops.commands``;
every SQS call goes through the adapter, ``worker.core.queue.Queue``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import structlog
from botocore.exceptions import ClientError

from worker.core.errors import LeaseLost, QueueError
from worker.core.logs import scrub
from worker.core.queue import MAX_BATCH, Message, Queue, sendable_attribute
from worker.voice.message import job_id_hint

log = structlog.get_logger(__name__)

# The attributes worker.core.queue.dead_letter_attributes adds; a redriven message goes back without them.
OUR_ATTRIBUTES = ("ErrorType", "ErrorMessage", "ReceiveCount", "SourceQueue")
MOVE_TASK, RECEIVE_SEND_DELETE = "move_task", "receive_send_delete"
# What the adapter raises for a failed SQS call: a stale receipt handle is LeaseLost there, and here
# only one more failed call.
SQS_FAILED = (QueueError, LeaseLost)


def move_task_missing(exc: BaseException) -> bool:
    """True when a failed StartMessageMoveTask says the endpoint has no such operation, in whatever
    words: an HTTP 501, or a 5xx whose body is an HTML page (the moto server's "500 Internal Server
    Error" for an operation it lacks). An SQS implementation answers in JSON or XML, so a real 5xx of
    the service (a JSON error with a code) stays a failure to report."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ClientError):
        cause = cause.__cause__
    if cause is None:
        return False
    meta = cause.response.get("ResponseMetadata") or {}
    status = int(meta.get("HTTPStatusCode") or 0)
    content_type = str((meta.get("HTTPHeaders") or {}).get("content-type", "")).lower()
    text = str((cause.response.get("Error") or {}).get("Message", "")).lstrip().lower()
    html = content_type.startswith("text/html") or text.startswith(("<!doctype html", "<html"))
    return status == 501 or (status >= 500 and html)


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()


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
    # ApproximateNumberOfMessages when a receive -> send -> delete run began: the most it moves.
    expected: int | None = None
    # Received again in this run (re-dead-lettered by a worker, or a same-body duplicate): left there.
    came_back: int = 0
    # Sent to the source queue but still in the DLQ (its delete failed): a later redrive duplicates it.
    not_deleted: list[str] = field(default_factory=list)
    # Ctrl-C landed between its send and its delete: it may be in both queues.
    unsettled: str | None = None
    interrupted: bool = False
    fallback_reason: str | None = None
    error: str | None = None  # why it stopped early; ``moved`` says how far it got


class DeadLetterQueue:
    def __init__(self, sqs, source_url: str, url: str, *, max_receive_count: int | None = None,
                 clock: Callable[[], float] = time.time, wait_s: int = 1):
        self._queue, self._source_queue = Queue(sqs, url), Queue(sqs, source_url)
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
        source_queue = Queue(sqs, source_url)
        attributes = source_queue.attributes("RedrivePolicy", "QueueArn")
        url = source_queue.dead_letter_url(attributes)
        if url is None:
            return None
        policy = json.loads(attributes["RedrivePolicy"])
        max_receives = str(policy.get("maxReceiveCount", ""))
        return cls(sqs, source_url, url, clock=clock, wait_s=wait_s,
                   max_receive_count=int(max_receives) if max_receives.isdigit() else None)

    def now_s(self) -> float:
        return self._clock()

    # ------------------------------------------------------------ looking

    def _receive(self, count: int, hold_s: int) -> list[DeadLetter]:
        messages = self._queue.receive_batch(count, wait_s=self._wait_s, visibility_timeout_s=hold_s,
                                             action="ReceiveMessage from the dead-letter queue")
        return [self._letter(message) for message in messages]

    def _letter(self, message: Message) -> DeadLetter:
        attrs, msg_attrs = message.attributes, message.message_attributes
        sent = attrs.get("SentTimestamp", "")
        return DeadLetter(
            message_id=message.message_id, receipt_handle=message.receipt_handle, body=message.body,
            receive_count=dead_letter_receives(msg_attrs, self.max_receive_count, message.receive_count),
            sent_at_ms=int(sent) if sent.isdigit() else None, job_id=job_id_hint(message.body),
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
        except SQS_FAILED:
            self.release(seen.values())
            raise
        return list(seen.values())

    def release(self, letters: Iterable[DeadLetter]) -> None:
        """Make looked-at messages visible again now; a failure only delays them by ``hold_s``."""
        letters = list(letters)
        for start in range(0, len(letters), MAX_BATCH):
            try:
                failed = self._queue.release_batch(letters[start:start + MAX_BATCH])
            except SQS_FAILED as exc:
                log.warning("dlq.release_failed", error=str(exc))
                continue
            if failed:
                log.warning("dlq.release_failed", messages=len(failed), code=failed[0].get("Code"))

    # ------------------------------------------------------------ moving back

    def redrive(self, *, max_messages: int | None = None, fallback: bool = False, hold_s: int = 60,
                progress: Callable[[int, int], None] | None = None,
                stop: Callable[[], bool] | None = None) -> RedriveResult:
        """Move messages back to the source queue (see the module docstring); failures are in ``error``.

        receive -> send -> delete moves only what was there at the start, each message at most once:
        a worker re-dead-lettering the moved messages at once must not keep the run going. ``stop``
        is asked between messages; Ctrl-C (KeyboardInterrupt) mid-message ends the run with
        ``interrupted`` set and, if it fell between a send and its delete, ``unsettled`` naming it.
        """
        reason = "--fallback" if fallback else ("--max" if max_messages is not None else None)
        if reason is None:
            try:
                task_handle = self._queue.start_move_task(
                    self._source_queue, action="StartMessageMoveTask (try again, or use --fallback)")
                reason = "the endpoint has no StartMessageMoveTask"
            except SQS_FAILED as exc:
                if not move_task_missing(exc):
                    return RedriveResult(MOVE_TASK, error=str(exc))
                task_handle = None
                reason = "the endpoint has no StartMessageMoveTask (an HTML page came back)"
            if task_handle is not None:
                return RedriveResult(MOVE_TASK, task_handle=task_handle)
            log.info("dlq.move_task_unsupported", fallback=RECEIVE_SEND_DELETE)
        result = RedriveResult(RECEIVE_SEND_DELETE, fallback_reason=reason)
        try:
            self._receive_send_delete(result, max_messages, hold_s, progress or (lambda *_: None),
                                      stop or (lambda: False))
        except SQS_FAILED as exc:
            result.error = str(exc)
        return result

    def _visible_count(self) -> int:
        attrs = self._queue.attributes("ApproximateNumberOfMessages",
                                       action="GetQueueAttributes of the dead-letter queue")
        return int(attrs.get("ApproximateNumberOfMessages", "0"))

    def _receive_send_delete(self, result: RedriveResult, max_messages: int | None, hold_s: int,
                             progress: Callable[[int, int], None], stop: Callable[[], bool]) -> None:
        result.expected = self._visible_count()
        limit = result.expected if max_messages is None else min(max_messages, result.expected)
        # What this run has touched. SQS's redrive policy dead-letters a moved message under the id
        # our send got; the worker's own dead-lettering sends the same body under a new id.
        seen_ids: set[str] = set()
        moved_bodies: set[str] = set()
        # Not to be moved in this run: hidden for hold_s so receives get past them, visible again at the end.
        held: dict[str, DeadLetter] = {}
        waiting: list[DeadLetter] = []  # received, not yet tried: visible again at once when the run ends
        try:
            while result.moved < limit and not stop():
                for letter in self._receive(limit - result.moved, hold_s):
                    if letter.message_id in seen_ids or _digest(letter.body) in moved_bodies:
                        result.came_back += letter.message_id not in held
                        held[letter.message_id] = letter
                    else:
                        waiting.append(letter)
                if not waiting:  # empty, or only messages this run already moved
                    return
                while waiting and result.moved < limit and not stop():
                    letter = waiting[0]
                    seen_ids.add(letter.message_id)
                    self._move(letter, result, seen_ids)  # a failed send leaves it in ``waiting``
                    waiting.pop(0)
                    moved_bodies.add(_digest(letter.body))
                    progress(result.moved, result.expected)
                if waiting:
                    return
        except KeyboardInterrupt:
            result.interrupted = True
        finally:
            result.interrupted = result.interrupted or stop()
            self.release([*held.values(), *waiting])

    def _move(self, letter: DeadLetter, result: RedriveResult, seen_ids: set[str]) -> None:
        # Never delete before the send succeeded: a failure leaves a message in both queues, never in neither.
        result.unsettled = letter.message_id  # until the delete is settled either way
        try:
            seen_ids.add(self._send_to_source(letter))
        except SQS_FAILED:
            result.unsettled = None  # SQS said no: it is only in the DLQ
            raise
        try:
            self._queue.delete(letter)
        except SQS_FAILED as exc:
            log.warning("dlq.delete_failed", message_id=letter.message_id, error=str(exc))
            result.not_deleted.append(letter.message_id)
        result.unsettled = None
        result.moved += 1

    def _send_to_source(self, letter: DeadLetter) -> str:
        return self._source_queue.send(
            letter.body, attributes=redrive_attributes(letter.message_attributes),
            group_id=letter.attributes.get("MessageGroupId") or letter.job_id or letter.message_id,
            dedup_id=letter.message_id, action=f"SendMessage of {letter.message_id} to the source queue")
