"""Job state-change events: published to SNS or EventBridge after the record, never failing the job."""

from __future__ import annotations

import json

import boto3
import pytest
from structlog.testing import capture_logs

from worker.core.errors import ConfigError
from worker.core.events import Publisher, target_problem, target_service
from worker.settings import load_settings

JOB_ID = "665f1c2e9b1e8a0012ab34cd"
TOPIC = "arn:aws:sns:us-east-1:123456789012:voice-jobs"
BUS = "arn:aws:events:us-east-1:123456789012:event-bus/voice"


@pytest.mark.parametrize("target,ok", [(TOPIC, True), (TOPIC + ".fifo", True), (BUS, True), ("", True),
                                       ("voice-jobs", False), ("arn:aws:sqs:us-east-1:123456789012:q", False),
                                       ("https://sns.amazonaws.com/voice", False),
                                       (TOPIC + "\n", False), (BUS + "\n", False), (" " + TOPIC, False),
                                       (TOPIC.replace("123456789012", "\u0661" * 12), False),
                                       (BUS.replace("123456789012", "\uff11" * 12), False)])
def test_the_target_is_an_sns_topic_or_an_eventbridge_bus(target, ok):
    """EVENTS_TARGET takes an SNS topic ARN or an EventBridge bus ARN, whole and in ASCII; anything else stops the start."""
    assert (target_problem(target) is None) is ok
    if not ok:
        with pytest.raises(ConfigError, match="EVENTS_TARGET"):
            load_settings({"EVENTS_TARGET": target})


def test_an_sns_event_carries_its_type_as_an_attribute_for_filters(aws):
    """On SNS the detail is the message and the type the eventType attribute."""
    sns, sqs = boto3.client("sns", region_name="us-east-1"), boto3.client("sqs", region_name="us-east-1")
    topic = sns.create_topic(Name="voice-jobs")["TopicArn"]
    queue = sqs.create_queue(QueueName="listener")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn)
    assert target_service(topic) == "sns"
    Publisher(topic, lambda: sns).publish("JobCompleted", {"jobId": JOB_ID, "status": "completed"})
    [message] = sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=1)["Messages"]
    envelope = json.loads(message["Body"])
    assert json.loads(envelope["Message"]) == {"jobId": JOB_ID, "status": "completed"}
    assert envelope["MessageAttributes"]["eventType"]["Value"] == "JobCompleted"


class RecordingEvents:
    def __init__(self):
        self.entries = []

    def put_events(self, Entries):  # noqa: N803 - boto3's parameter name
        self.entries.extend(Entries)
        return {"FailedEntryCount": 0, "Entries": [{"EventId": "1"}]}


def test_an_eventbridge_event_has_the_worker_as_source_and_the_type_as_detail_type():
    """On EventBridge the entry names the bus, Source voice-worker, DetailType the event type."""
    client = RecordingEvents()
    assert target_service(BUS) == "events"
    Publisher(BUS, lambda: client).publish("JobFailed", {"jobId": JOB_ID})
    [entry] = client.entries
    assert (entry["EventBusName"], entry["Source"], entry["DetailType"]) == (BUS, "voice-worker", "JobFailed")
    assert json.loads(entry["Detail"]) == {"jobId": JOB_ID}


def test_a_publish_that_fails_is_a_warning_not_an_error(aws):
    """A topic that does not exist, or a refused EventBridge entry, is one warning line."""
    with capture_logs() as logs:
        Publisher(TOPIC, lambda: boto3.client("sns", region_name="us-east-1")).publish("JobCompleted", {"jobId": "j"})

        class Refusing(RecordingEvents):
            def put_events(self, Entries):  # noqa: N803
                return {"FailedEntryCount": 1, "Entries": [{"ErrorCode": "AccessDenied", "ErrorMessage": "no"}]}

        Publisher(BUS, Refusing).publish("JobCompleted", {"jobId": "j"})
    assert [e["event"] for e in logs] == ["events.publish_failed", "events.publish_failed"]
    assert "AccessDenied" in logs[1]["error"]


def test_a_fifo_topic_gets_the_job_as_group_and_the_event_as_deduplication_id():
    """On a FIFO topic, events of one job share a group and each has its own deduplication id."""
    calls = []

    class Sns:
        def publish(self, **kwargs):
            calls.append(kwargs)

    Publisher(TOPIC + ".fifo", Sns).publish("JobCompleted", {"jobId": JOB_ID, "at": "2026-12-01T00:00:00"})
    Publisher(TOPIC + ".fifo", Sns).publish("JobFailed", {"jobId": JOB_ID, "at": "2026-12-01T00:00:00"})
    assert [c["MessageGroupId"] for c in calls] == [JOB_ID, JOB_ID]
    assert calls[0]["MessageDeduplicationId"] != calls[1]["MessageDeduplicationId"]
