"""The loop's Queue protocol (worker/core/broker.py) and the two queues that implement it: the SQS adapter
(on moto) and MemoryQueue. Each contract test runs against both; mypy holds both to the protocol too
(the ``_IS_A_QUEUE`` assignments in worker/core/queue.py and worker/core/testing.py)."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from typing import Any

import pytest

from worker.core import broker, lease, loop
from worker.core.errors import LeaseLost, PermanentError, RetryableError
from worker.core.lease import Lease
from worker.core.queue import Queue as SqsQueue
from worker.core.testing import FakeClock, MemoryQueue

PROTOCOL_METHODS = ("receive", "extend", "set_visibility", "release", "delete", "dead_letter")


class NotAudio(PermanentError):
    pass


@dataclass
class Subject:
    """A queue under test with what the test needs beside the protocol: a way in and a look at the DLQ."""

    queue: Any
    send: Any
    dead_letters: Any


@pytest.fixture(params=["sqs", "memory"])
def subject(request) -> Subject:
    if request.param == "memory":
        clock = FakeClock()
        dlq = MemoryQueue(clock, url="memory://jobs-dlq")
        queue = MemoryQueue(clock, dead_letter_queue=dlq)
        return Subject(queue, lambda body: queue.send(body),
                       lambda: [(held.body, held.message_attributes) for held in dlq.messages])
    queues = request.getfixturevalue("queues")

    def dead_letters():
        got = queues.sqs.receive_message(QueueUrl=queues.dlq_url, MaxNumberOfMessages=10,
                                         MessageAttributeNames=["All"]).get("Messages", [])
        return [(raw["Body"], raw.get("MessageAttributes", {})) for raw in got]

    return Subject(SqsQueue(queues.sqs, queues.url),
                   lambda body: queues.sqs.send_message(QueueUrl=queues.url, MessageBody=body)["MessageId"],
                   dead_letters)


def queue_calls(module) -> set[str]:
    """The methods a module calls on its ``self._queue``."""
    return {node.func.attr for node in ast.walk(ast.parse(inspect.getsource(module)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and ast.unparse(node.func.value) == "self._queue"}


def test_the_protocol_is_exactly_what_the_loop_and_the_heartbeat_call():
    """Queue names the six calls Worker and Lease make, and both take a Queue, not the SQS adapter."""
    members = {name for name, value in vars(broker.Queue).items()
               if callable(value) and not name.startswith("_")}
    assert members == set(PROTOCOL_METHODS) == queue_calls(loop) | queue_calls(lease)
    assert inspect.signature(loop.Worker).parameters["queue"].annotation == "Queue"
    assert inspect.signature(Lease).parameters["queue"].annotation == "Queue"
    assert loop.Queue is broker.Queue and lease.Queue is broker.Queue


@pytest.mark.parametrize("implementation", [SqsQueue, MemoryQueue])
def test_both_queues_implement_every_method_with_the_protocols_parameters(implementation):
    """Each method is there with the protocol's parameter names and kinds (what a keyword call relies on)."""
    for name in PROTOCOL_METHODS:
        expected = inspect.signature(getattr(broker.Queue, name)).parameters
        got = inspect.signature(getattr(implementation, name)).parameters
        assert [(p.name, p.kind) for p in got.values()] == [(p.name, p.kind) for p in expected.values()], name


def test_both_queues_are_queues_at_run_time(queues):
    """isinstance with the runtime-checkable protocol: the SQS adapter and MemoryQueue, not a stand-in."""
    assert isinstance(SqsQueue(queues.sqs, queues.url), broker.Queue)
    assert isinstance(MemoryQueue(), broker.Queue)
    assert not isinstance(object(), broker.Queue)


def test_the_message_class_is_the_brokers():
    """worker.core.queue re-exports the one Message (the loop's), which both queues hand out."""
    from worker.core import queue

    assert queue.Message is broker.Message


# ---------------------------------------------------------------- the contract, on both

def test_a_received_message_is_invisible_until_released(subject):
    """receive takes one message with its receive count; it is not handed out again until released."""
    queue = subject.queue
    message_id = subject.send("job-1")
    first = queue.receive(wait_s=0, visibility_timeout_s=30)
    assert isinstance(first, broker.Message)
    assert (first.message_id, first.body, first.receive_count) == (message_id, "job-1", 1)
    assert queue.receive(wait_s=0, visibility_timeout_s=30) is None
    queue.extend(first, 60)
    assert queue.receive(wait_s=0, visibility_timeout_s=30) is None
    queue.release(first)
    again = queue.receive(wait_s=0, visibility_timeout_s=30)
    assert again is not None and (again.message_id, again.receive_count) == (message_id, 2)
    assert again.receipt_handle != first.receipt_handle


def test_a_visibility_of_zero_hands_the_message_back(subject):
    """set_visibility resets the visibility from now: 0 makes the message receivable at once."""
    queue = subject.queue
    subject.send("job-1")
    message = queue.receive(wait_s=0, visibility_timeout_s=30)
    queue.set_visibility(message, 0)
    assert queue.receive(wait_s=0, visibility_timeout_s=30).receive_count == 2


def test_a_deleted_message_is_gone_and_its_receipt_refused(subject):
    """After delete the message is never handed out again, and renewing it is LeaseLost."""
    queue = subject.queue
    subject.send("job-1")
    message = queue.receive(wait_s=0, visibility_timeout_s=30)
    queue.delete(message)
    with pytest.raises(LeaseLost):
        queue.extend(message, 30)
    assert queue.receive(wait_s=0, visibility_timeout_s=30) is None


def test_dead_letter_copies_the_body_with_why(subject):
    """dead_letter sends the body to the DLQ with the error's type and answers True; the original stays
    until the loop deletes it."""
    queue = subject.queue
    subject.send("job-1")
    message = queue.receive(wait_s=0, visibility_timeout_s=30)
    assert queue.dead_letter(message, NotAudio("recording 0 is not audio")) is True
    [(body, attributes)] = subject.dead_letters()
    assert body == "job-1" and attributes["ErrorType"]["StringValue"] == "NotAudio"
    queue.delete(message)


def test_dead_letter_without_a_dead_letter_queue_answers_false(sqs):
    """No DLQ: False, and the loop parks the message instead of deleting it."""
    from tests.support import create_queues

    bare = create_queues(sqs, name="bare", with_dlq=False)
    sqs_queue = SqsQueue(sqs, bare.url)
    sqs.send_message(QueueUrl=bare.url, MessageBody="job-1")
    memory = MemoryQueue()
    memory.send("job-1")
    for queue in (sqs_queue, memory):
        message = queue.receive(wait_s=0, visibility_timeout_s=30)
        assert queue.dead_letter(message, RetryableError("x")) is False
