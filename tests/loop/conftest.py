from __future__ import annotations

import json
from dataclasses import dataclass

import boto3
import pytest

from tests.loop.fakes import FaultyClient
from worker.loop import Worker
from worker.queue import Queue
from worker.settings import load_settings

FAST = {
    "SQS_VISIBILITY_TIMEOUT_SECONDS": "2",
    "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "200",
    "SQS_WAIT_TIME_SECONDS": "0",
    "SHUTDOWN_GRACE_SECONDS": "5",
}


@dataclass
class Queues:
    sqs: object
    url: str
    dlq_url: str | None

    def send(self, body: str = '{"hello": "world"}', **kw) -> str:
        return self.sqs.send_message(QueueUrl=self.url, MessageBody=body, **kw)["MessageId"]

    def counts(self, url: str | None = None) -> tuple[int, int]:
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=url or self.url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]), int(attrs["ApproximateNumberOfMessagesNotVisible"])

    def receive_now(self, url: str | None = None, wait_s: int = 0) -> list[dict]:
        return self.sqs.receive_message(
            QueueUrl=url or self.url, MaxNumberOfMessages=10, WaitTimeSeconds=wait_s,
            MessageAttributeNames=["All"], MessageSystemAttributeNames=["ApproximateReceiveCount"],
        ).get("Messages", [])


def create_queues(sqs, name: str = "jobs", with_dlq: bool = True) -> Queues:
    dlq_url = None
    attrs = {"VisibilityTimeout": "30"}
    if with_dlq:
        dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
        dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        attrs["RedrivePolicy"] = json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "5"})
    url = sqs.create_queue(QueueName=name, Attributes=attrs)["QueueUrl"]
    return Queues(sqs, url, dlq_url)


@pytest.fixture
def sqs(aws):
    return boto3.client("sqs", region_name="us-east-1")


@pytest.fixture
def queues(sqs) -> Queues:
    return create_queues(sqs)


@pytest.fixture
def make_worker(queues):
    """Build a Worker on the moto queue; returns (worker, recording client)."""

    def build(handler, *, client=None, reporter=None, **env):
        values = {**FAST, "SQS_QUEUE_URL": queues.url, **{k: str(v) for k, v in env.items()}}
        settings = load_settings(values)
        faulty = client or FaultyClient(queues.sqs)
        worker = Worker(settings, Queue(faulty, queues.url), handler, reporter=reporter)
        return worker, faulty

    return build
