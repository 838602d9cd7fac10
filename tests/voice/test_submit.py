"""Submitting a job on moto: records first, then the message, on standard and FIFO queues alike."""

from __future__ import annotations

import json

import pytest

from tests.ops.test_commands import PAYLOAD, store  # noqa: F401 (store is a fixture)
from tests.support import FaultyClient, client_error, create_queues
from worker.core.errors import QueueError
from worker.voice.submit import submit


@pytest.fixture
def fifo_url(sqs):
    # No content-based deduplication: every send must carry its own MessageDeduplicationId.
    return sqs.create_queue(QueueName="jobs.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]


def test_submit_to_a_fifo_queue_sends_the_job_as_its_own_group(store, sqs, fifo_url):
    """On a .fifo queue the message's group and deduplication id are the job id, and the job is stamped enqueued."""
    job_id, created = submit(store, sqs, fifo_url, PAYLOAD)

    assert created
    [msg] = sqs.receive_message(QueueUrl=fifo_url, MaxNumberOfMessages=10,
                                MessageSystemAttributeNames=["All"])["Messages"]
    assert json.loads(msg["Body"])["jobId"] == job_id
    assert msg["Attributes"]["MessageGroupId"] == job_id
    assert msg["Attributes"]["MessageDeduplicationId"] == job_id
    assert store.get_job(job_id).get("enqueuedAt") is not None


def test_a_second_submit_of_the_same_job_to_a_fifo_queue_is_deduplicated(store, sqs, fifo_url):
    """Submitting the same jobId twice (no idempotency key) leaves one message on a FIFO queue."""
    job_id, _ = submit(store, sqs, fifo_url, {**PAYLOAD, "jobId": "a" * 24})
    submit(store, sqs, fifo_url, {**PAYLOAD, "jobId": "a" * 24})
    messages = sqs.receive_message(QueueUrl=fifo_url, MaxNumberOfMessages=10)["Messages"]
    assert [json.loads(m["Body"])["jobId"] for m in messages] == [job_id]


def test_a_failed_send_leaves_the_job_recorded_but_not_enqueued(store, sqs):
    """A send SQS refuses raises QueueError naming the job; the record stays pending without enqueuedAt."""
    queues = create_queues(sqs, with_dlq=False)
    client = FaultyClient(sqs)
    client.faults["send_message"] = lambda kw: client_error("ServiceUnavailable")

    with pytest.raises(QueueError, match=r"recorded but not enqueued: SendMessage failed: ServiceUnavailable") as caught:
        submit(store, client, queues.url, {**PAYLOAD, "jobId": "b" * 24})

    assert "b" * 24 in str(caught.value)
    job = store.get_job("b" * 24)
    assert job["status"] == "pending" and job.get("enqueuedAt") is None


def test_the_submission_hash_ignores_generated_ids_and_field_order():
    """Two submissions that differ only in jobId, _doc._id or key order hash alike; any other field changes it."""
    from worker.voice.submit import submission_hash

    base = submission_hash({**PAYLOAD, "jobId": "a" * 24, "_doc": {"_id": "a" * 24}})
    assert submission_hash({key: PAYLOAD[key] for key in reversed(list(PAYLOAD))}) == base
    assert submission_hash({**PAYLOAD, "_doc": {"_id": "b" * 24, "note": "x"}}) != base
    assert submission_hash({**PAYLOAD, "metadata": {**PAYLOAD["metadata"], "language": "de"}}) != base
    assert base.startswith("sha256:") and len(base) == len("sha256:") + 64


def test_a_known_key_with_another_body_raises_and_sends_nothing(store, sqs):
    """submit() with a used idempotencyKey and other fields raises IdempotencyMismatch naming the job; nothing is sent."""
    from worker.voice.submit import IdempotencyMismatch

    queues = create_queues(sqs, with_dlq=False)
    job_id, created = submit(store, sqs, queues.url, {**PAYLOAD, "idempotencyKey": "order-9"})
    assert created and store.get_job(job_id)["submissionHash"].startswith("sha256:")

    with pytest.raises(IdempotencyMismatch, match=job_id):
        submit(store, sqs, queues.url, {**PAYLOAD, "environment": "production", "idempotencyKey": "order-9"})

    assert len(queues.receive_now()) == 1
