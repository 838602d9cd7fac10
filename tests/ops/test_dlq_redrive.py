"""Fallback redrive (receive -> send -> delete) bounded to what was there: re-dead-lettering, progress, Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import signal
import time

import pytest

from pipeline.errors import BadRecording
from tests.ops.test_dlq import dead_letter, ops, source_messages
from tests.support import FaultyClient, create_queues
from worker.core.queue import Message, Queue
from worker.ops.commands import cmd_dlq_redrive
from worker.ops.dlq import DeadLetterQueue


class RedeadLetteringClient(FaultyClient):
    """A client behind which a "worker" takes each message redriven to the source queue and dead-letters it again at once."""

    def __init__(self, queues, *, by_policy: bool = False):
        super().__init__(queues.sqs)
        self._queues, self._by_policy = queues, by_policy
        self.redriven = 0

    def send_message(self, **kwargs):
        resp = self._client.send_message(**kwargs)
        if kwargs["QueueUrl"] != self._queues.url:
            return resp
        self.redriven += 1
        assert self.redriven <= 50, "redrive keeps moving the messages a worker dead-letters again"
        if self._by_policy:
            # maxReceiveCount 1: moto moves the message to the DLQ, same id, on its second receive.
            for _ in range(2):
                self._queues.sqs.receive_message(QueueUrl=self._queues.url, VisibilityTimeout=0)
            return resp
        [raw] = self._queues.sqs.receive_message(QueueUrl=self._queues.url, MessageAttributeNames=["All"])["Messages"]
        message = Message(message_id=raw["MessageId"], receipt_handle=raw["ReceiptHandle"], body=raw["Body"],
                          receive_count=1, received_at_s=time.monotonic(),
                          message_attributes=raw.get("MessageAttributes", {}))
        assert Queue(self._queues.sqs, self._queues.url).dead_letter(message, BadRecording("still not audio"))
        self._queues.sqs.delete_message(QueueUrl=self._queues.url, ReceiptHandle=raw["ReceiptHandle"])
        return resp


@pytest.mark.parametrize("by_policy", [False, True], ids=["worker-dead-letters", "redrive-policy-moves"])
def test_redrive_ends_while_a_worker_dead_letters_each_moved_message_again(sqs, by_policy):
    """A fallback redrive moves exactly the messages present at its start, each once, though every one comes straight back."""
    queues = create_queues(sqs)
    if by_policy:
        policy = json.loads(sqs.get_queue_attributes(QueueUrl=queues.url, AttributeNames=["RedrivePolicy"])
                            ["Attributes"]["RedrivePolicy"])
        sqs.set_queue_attributes(QueueUrl=queues.url, Attributes={
            "RedrivePolicy": json.dumps({**policy, "maxReceiveCount": "1"})})
    for n in range(12):
        dead_letter(queues, n)
    client = RedeadLetteringClient(queues, by_policy=by_policy)
    out = io.StringIO()

    code = cmd_dlq_redrive(DeadLetterQueue.of(client, queues.url, wait_s=0), max_messages=None, fallback=True,
                           out=out, err=io.StringIO())

    assert code == 0, out.getvalue()
    assert client.redriven == 12
    assert "moved 12 message(s)" in out.getvalue() and "~12 were in the dead-letter queue" in out.getvalue()
    assert queues.counts(queues.dlq_url) == (12, 0)  # the ones that came back are visible again


def test_redrive_max_stops_at_n_though_messages_come_back(queues):
    """--max 3 moves three messages even while a worker dead-letters them again."""
    for n in range(5):
        dead_letter(queues, n)
    client = RedeadLetteringClient(queues)
    result = DeadLetterQueue.of(client, queues.url, wait_s=0).redrive(max_messages=3)
    assert result.moved == 3 and client.redriven == 3 and result.expected == 5


def test_redrive_prints_progress_on_stderr(queues, dlq):
    """A long fallback redrive says "moved N of ~M" on stderr as it goes."""
    for n in range(12):
        dead_letter(queues, n)
    err = io.StringIO()
    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=True, out=io.StringIO(), err=err) == 0
    assert "moved 10 of ~12" in err.getvalue().splitlines()


@pytest.fixture(params=[signal.default_int_handler, signal.SIG_IGN], ids=["sigint-default", "sigint-ignored"])
def sigint_before(request):
    """SIGINT's disposition before the command, set here rather than inherited from however the test run was
    started: under nohup or as a background job it starts ignored."""
    previous = signal.signal(signal.SIGINT, request.param)
    yield request.param
    signal.signal(signal.SIGINT, previous)


def test_first_ctrl_c_stops_redrive_after_the_current_message(queues, client, dlq, sigint_before):
    """SIGINT during a fallback redrive finishes the message in hand, exits 130, leaves the rest visible in the
    DLQ and puts SIGINT back as it was, also when it was ignored before."""
    for n in range(5):
        dead_letter(queues, n)
    sends = []

    def interrupt_on_second_send(kwargs):
        sends.append(1)
        if len(sends) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    client.faults["send_message"] = interrupt_on_second_send
    out, err = io.StringIO(), io.StringIO()

    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=True, out=out, err=err) == 130

    assert "moved 2 message(s)" in out.getvalue() and "redrive interrupted" in err.getvalue()
    assert len(ops(client, "delete_message")) == 2  # the one in hand was settled
    assert len(source_messages(queues)) == 2
    assert queues.counts(queues.dlq_url) == (3, 0)
    assert signal.getsignal(signal.SIGINT) is sigint_before


def test_ctrl_c_between_send_and_delete_names_the_message(queues, client, dlq):
    """A KeyboardInterrupt after a send and before its delete exits 130 and names that message as maybe in both queues."""
    for n in range(3):
        dead_letter(queues, n)
    deletes = []

    def interrupt_second_delete(kwargs):
        deletes.append(1)
        return KeyboardInterrupt() if len(deletes) == 2 else None

    client.faults["delete_message"] = interrupt_second_delete
    out, err = io.StringIO(), io.StringIO()

    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=True, out=out, err=err) == 130

    [unsettled] = [line for line in out.getvalue().splitlines() if "may be in both queues" in line]
    sent_second = ops(client, "send_message")[1]["MessageBody"]
    in_dlq = {m["Body"]: m["MessageId"] for m in queues.receive_now(queues.dlq_url)}
    assert unsettled.strip().startswith(in_dlq[sent_second])  # sent, not deleted, and named
    assert "moved 1 message(s)" in out.getvalue()


def test_redrive_leaves_messages_that_arrive_during_the_run(queues, client, dlq):
    """Messages dead-lettered while a fallback redrive runs (other jobs) wait for the next run: it moves only the starting count."""
    for n in range(3):
        dead_letter(queues, n)
    arrivals = iter(range(100, 150))

    def another_job_fails(kwargs):
        dead_letter(queues, next(arrivals))  # raises StopIteration, failing the test, if it never ends

    client.faults["send_message"] = another_job_fails
    result = dlq.redrive(fallback=True)
    assert (result.moved, result.expected) == (3, 3)
    assert queues.counts(queues.dlq_url) == (3, 0)


class OverCountingClient(FaultyClient):
    """ApproximateNumberOfMessages two more than the truth, as SQS's approximation may be."""

    def get_queue_attributes(self, **kwargs):
        resp = self._client.get_queue_attributes(**kwargs)
        attrs = resp["Attributes"]
        if "ApproximateNumberOfMessages" in attrs:
            attrs["ApproximateNumberOfMessages"] = str(int(attrs["ApproximateNumberOfMessages"]) + 2)
        return resp


def test_an_overestimated_count_still_moves_no_message_twice(queues):
    """When the count overstates the DLQ, messages dead-lettered again in the run are not moved a second time."""
    for n in range(3):
        dead_letter(queues, n)
    client, worker = OverCountingClient(queues.sqs), RedeadLetteringClient(queues)
    client.send_message = worker.send_message
    result = DeadLetterQueue.of(client, queues.url, wait_s=0).redrive(fallback=True)
    assert (result.moved, result.expected, worker.redriven) == (3, 5, 3)
    assert result.came_back >= 1  # it stopped on seeing them, not on running out of messages
    assert queues.counts(queues.dlq_url) == (3, 0)
