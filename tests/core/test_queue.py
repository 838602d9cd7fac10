"""The SQS adapter on moto: sends with FIFO ids, batch receive/release/delete, attributes, move tasks, errors."""

from __future__ import annotations

import dataclasses
import time

import pytest
from botocore.exceptions import EndpointConnectionError

from tests.support import FaultyClient, client_error, create_queues
from worker.core.errors import LeaseLost, QueueError
from worker.core.queue import MAX_BATCH, Queue, move_task_unsupported


@pytest.fixture
def client(queues):
    return FaultyClient(queues.sqs)


@pytest.fixture
def fifo_url(sqs):
    return sqs.create_queue(QueueName="jobs.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]


def sent(client) -> list[dict]:
    return [kwargs for op, kwargs, *_ in client.calls if op == "send_message"]


def tenant(value: str) -> dict:
    return {"Tenant": {"DataType": "String", "StringValue": value}}


# ---------------------------------------------------------------- send

def test_send_to_a_standard_queue_leaves_the_fifo_ids_out(queues, client):
    """On a standard queue the group and deduplication ids are not sent; body and attributes are."""
    message_id = Queue(client, queues.url).send("body", group_id="g", dedup_id="d", attributes=tenant("acme"))

    [call] = sent(client)
    assert "MessageGroupId" not in call and "MessageDeduplicationId" not in call
    [msg] = queues.receive_now()
    assert (msg["MessageId"], msg["Body"]) == (message_id, "body")
    assert msg["MessageAttributes"]["Tenant"]["StringValue"] == "acme"


def test_send_without_attributes_sends_none(queues, client):
    """No attributes (or an empty dict) sends no MessageAttributes field, which SQS would refuse empty."""
    Queue(client, queues.url).send("body", group_id="g", dedup_id="d", attributes={})
    assert "MessageAttributes" not in sent(client)[0]


def test_send_to_a_fifo_queue_carries_the_group_and_deduplicates(sqs, fifo_url):
    """On a FIFO queue the message gets the caller's group; a second send with the same dedup id is dropped."""
    queue = Queue(sqs, fifo_url)
    queue.send("one", group_id="job-1", dedup_id="job-1")
    queue.send("one", group_id="job-1", dedup_id="job-1")

    [msg] = sqs.receive_message(QueueUrl=fifo_url, MaxNumberOfMessages=10,
                                MessageSystemAttributeNames=["MessageGroupId"])["Messages"]
    assert msg["Attributes"]["MessageGroupId"] == "job-1"


def test_a_failed_send_is_a_queue_error_naming_the_action(queues, client):
    """A ClientError from SendMessage becomes a QueueError with the caller's action and SQS's code."""
    client.faults["send_message"] = lambda kw: client_error("ServiceUnavailable", "try later")
    with pytest.raises(QueueError, match=r"^re-enqueue of job j failed: ServiceUnavailable: try later$"):
        Queue(client, queues.url).send("body", group_id="j", dedup_id="j", action="re-enqueue of job j")


def test_an_unreachable_endpoint_is_a_queue_error(queues, client):
    """botocore's connection errors (no ClientError) become QueueError too."""
    client.faults["send_message"] = lambda kw: EndpointConnectionError(endpoint_url="https://sqs.example")
    with pytest.raises(QueueError, match="SendMessage failed: EndpointConnectionError"):
        Queue(client, queues.url).send("body", group_id="g", dedup_id="d")


def test_an_error_text_is_cut_to_a_readable_length(queues, client):
    """A botocore message as long as an HTML error page is cut to 500 characters."""
    client.faults["send_message"] = lambda kw: client_error("InternalError", "x" * 5000)
    with pytest.raises(QueueError) as caught:
        Queue(client, queues.url).send("body", group_id="g", dedup_id="d")
    assert len(str(caught.value)) == 500


# ---------------------------------------------------------------- batches

def test_receive_batch_takes_up_to_ten_with_all_attributes(queues):
    """One receive returns at most ten messages, hidden for the hold, with SentTimestamp and message attributes."""
    for n in range(12):
        queues.send(f"m-{n}", MessageAttributes=tenant("acme"))

    batch = Queue(queues.sqs, queues.url).receive_batch(50, wait_s=0, visibility_timeout_s=300)

    assert len(batch) == MAX_BATCH
    assert all(m.attributes["SentTimestamp"].isdigit() and m.receive_count == 1 for m in batch)
    assert batch[0].message_attributes["Tenant"]["StringValue"] == "acme"
    assert queues.counts() == (2, 10)


def test_release_batch_makes_received_messages_visible_at_once(queues, client):
    """Releasing a batch is one ChangeMessageVisibilityBatch call; the messages are visible again."""
    for n in range(3):
        queues.send(f"m-{n}")
    queue = Queue(client, queues.url)
    batch = queue.receive_batch(10, wait_s=0, visibility_timeout_s=300)

    assert queue.release_batch(batch) == []

    assert [op for op in client.ops() if op.startswith("change")] == ["change_message_visibility_batch"]
    assert queues.counts() == (3, 0)


def test_release_batch_lists_the_entries_sqs_refused(queues):
    """A stale handle in a batch does not fail the call: SQS's refusal of that entry comes back, the rest are released."""
    queues.send("m")
    queue = Queue(queues.sqs, queues.url)
    [message] = queue.receive_batch(1, wait_s=0, visibility_timeout_s=300)
    stale = dataclasses.replace(message, receipt_handle="stale")

    [failed] = queue.release_batch([message, stale])

    assert (failed["Id"], failed["Code"]) == ("1", "ReceiptHandleIsInvalid")
    assert queues.counts() == (1, 0)


def test_release_batch_refuses_more_than_sqs_takes(queues, client):
    """More than ten messages per batch is a caller's mistake, refused before any call; none is no call."""
    queue = Queue(client, queues.url)
    with pytest.raises(ValueError):
        queue.release_batch([object()] * (MAX_BATCH + 1))
    assert queue.release_batch([]) == [] and client.calls == []


def test_a_failed_release_batch_is_a_queue_error(queues, client):
    """A failed ChangeMessageVisibilityBatch call raises QueueError."""
    queues.send("m")
    queue = Queue(client, queues.url)
    batch = queue.receive_batch(10, wait_s=0, visibility_timeout_s=300)
    client.faults["change_message_visibility_batch"] = lambda kw: client_error("ServiceUnavailable")
    with pytest.raises(QueueError, match="ChangeMessageVisibilityBatch failed"):
        queue.release_batch(batch)


def test_delete_removes_a_received_message(queues):
    """A message received in a batch and deleted is gone."""
    queues.send("m")
    queue = Queue(queues.sqs, queues.url)
    [message] = queue.receive_batch(1, wait_s=0, visibility_timeout_s=0)
    queue.delete(message)
    assert queues.counts() == (0, 0)


def test_a_lost_receipt_handle_is_lease_lost(queues, client):
    """SQS saying the receipt handle is invalid becomes LeaseLost, not a QueueError."""
    queues.send("m")
    queue = Queue(client, queues.url)
    [message] = queue.receive_batch(1, wait_s=0, visibility_timeout_s=300)
    client.faults["delete_message"] = lambda kw: client_error("ReceiptHandleIsInvalid")
    with pytest.raises(LeaseLost):
        queue.delete(message)


# ---------------------------------------------------------------- attributes and move tasks

def test_attributes_and_arn(queues):
    """attributes returns what was asked for; arn is the queue's QueueArn."""
    queues.send("m")
    queue = Queue(queues.sqs, queues.url)
    assert queue.attributes("ApproximateNumberOfMessages") == {"ApproximateNumberOfMessages": "1"}
    assert queue.arn().startswith("arn:aws:sqs:") and queue.arn().endswith(":jobs")


def test_dead_letter_url_reads_attributes_the_caller_holds(queues, client):
    """Given the queue's attributes, dead_letter_url asks SQS only for the DLQ's URL."""
    attrs = queues.sqs.get_queue_attributes(QueueUrl=queues.url, AttributeNames=["All"])["Attributes"]
    assert Queue(client, queues.url).dead_letter_url(attrs) == queues.dlq_url
    assert client.ops() == ["get_queue_url"]


def test_dead_letter_url_of_a_queue_without_a_redrive_policy_is_none(sqs):
    """A queue with no RedrivePolicy has no dead-letter queue."""
    bare = create_queues(sqs, name="bare", with_dlq=False)
    assert Queue(sqs, bare.url).dead_letter_url() is None


def test_move_task_unsupported_only_for_answers_that_say_so():
    """NotImplementedError and unsupported-operation codes mean unsupported; throttling and 5xx do not."""
    assert move_task_unsupported(NotImplementedError())
    assert move_task_unsupported(client_error("UnsupportedOperation"))
    assert move_task_unsupported(client_error("InvalidAction"))
    assert not move_task_unsupported(client_error("ThrottlingException"))
    assert not move_task_unsupported(client_error("500"))


class MoveTaskClient(FaultyClient):
    """A client whose endpoint implements StartMessageMoveTask (moto does not)."""

    def start_message_move_task(self, **kwargs):
        self.calls.append(("start_message_move_task", kwargs, "", time.monotonic()))
        return {"TaskHandle": "task-1"}


def test_start_move_task_names_both_queues_and_returns_the_handle(queues):
    """The move task goes from this queue's ARN to the destination's; its handle comes back."""
    client = MoveTaskClient(queues.sqs)
    dlq, source = Queue(client, queues.dlq_url), Queue(client, queues.url)

    assert dlq.start_move_task(source) == "task-1"

    [call] = [kw for op, kw, *_ in client.calls if op == "start_message_move_task"]
    assert call == {"SourceArn": dlq.arn(), "DestinationArn": source.arn()}


def test_start_move_task_where_the_endpoint_lacks_it_is_none(queues, client):
    """moto's NotImplementedError and an UnsupportedOperation answer both mean: no move task here."""
    dlq, source = Queue(client, queues.dlq_url), Queue(client, queues.url)
    assert dlq.start_move_task(source) is None
    client.faults["start_message_move_task"] = lambda kw: client_error("UnsupportedOperation")
    assert dlq.start_move_task(source) is None


def test_a_failed_move_task_is_a_queue_error_naming_the_action(queues, client):
    """A 5xx from StartMessageMoveTask raises QueueError with the caller's action."""
    client.faults["start_message_move_task"] = lambda kw: client_error("InternalError")
    with pytest.raises(QueueError, match=r"^StartMessageMoveTask \(use --fallback\) failed: InternalError"):
        Queue(client, queues.dlq_url).start_move_task(Queue(client, queues.url),
                                                      action="StartMessageMoveTask (use --fallback)")
