"""`queue`: the job queue's depth and age and its DLQ's depth, read without receiving a message."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta

import boto3
import pytest

from tests.support import client_error
from worker.ops.queue_view import cmd_queue, oldest_age


class FakeCloudWatch:
    """CloudWatch's GetMetricStatistics answering the datapoints (or the error) a test gives."""

    def __init__(self, datapoints=(), error=None):
        self.datapoints, self.error, self.asked = list(datapoints), error, []

    def get_metric_statistics(self, **kwargs):
        self.asked.append(kwargs)
        if self.error is not None:
            raise self.error
        return {"Datapoints": self.datapoints}


NOW = datetime(2026, 12, 2, 3, 0, tzinfo=UTC)


def run(queues, cloudwatch, *, as_json=False) -> tuple[int, str]:
    out = io.StringIO()
    code = cmd_queue(queues.sqs, queues.url, cloudwatch, as_json_output=as_json, out=out, now=lambda: NOW)
    return code, out.getvalue()


def test_the_counts_are_sqss_own_and_looking_receives_nothing(queues):
    """Three visible, one in flight, two delayed and a dead letter are counted, and no message's receive count moves."""
    for i in range(4):
        queues.sqs.send_message(QueueUrl=queues.url, MessageBody=f"job {i}")
    for i in range(2):
        queues.sqs.send_message(QueueUrl=queues.url, MessageBody=f"later {i}", DelaySeconds=900)
    queues.sqs.receive_message(QueueUrl=queues.url, MaxNumberOfMessages=1, VisibilityTimeout=600)
    queues.sqs.send_message(QueueUrl=queues.dlq_url, MessageBody="dead")
    code, text = run(queues, FakeCloudWatch(), as_json=True)
    view = json.loads(text)
    assert code == 0
    assert (view["queue"]["visible"], view["queue"]["inFlight"], view["queue"]["delayed"]) == (3, 1, 2)
    assert view["deadLetters"]["visible"] == 1 and view["deadLetters"]["url"] == queues.dlq_url
    received = queues.sqs.receive_message(QueueUrl=queues.url, MaxNumberOfMessages=10,
                                          AttributeNames=["ApproximateReceiveCount"])["Messages"]
    assert sorted(m["Attributes"]["ApproximateReceiveCount"] for m in received) == ["1", "1", "1"]


def test_the_oldest_age_is_the_newest_datapoint_with_when_it_was_measured(queues):
    """Of several datapoints the newest one's maximum is shown, with its time; the text names both."""
    cloudwatch = FakeCloudWatch([{"Timestamp": NOW - timedelta(minutes=5), "Maximum": 30.0},
                                 {"Timestamp": NOW - timedelta(minutes=1), "Maximum": 754.0}])
    code, text = run(queues, cloudwatch)
    assert code == 0
    assert "oldest" in text and "12m34s" in text and "2026-12-02T02:59:00Z" in text
    [asked] = cloudwatch.asked
    assert asked["Dimensions"] == [{"Name": "QueueName", "Value": queues.url.rsplit("/", 1)[-1]}]
    assert asked["MetricName"] == "ApproximateAgeOfOldestMessage"


@pytest.mark.parametrize("cloudwatch, reason", [
    (FakeCloudWatch(), "no datapoint in the last 15 minutes"),
    (FakeCloudWatch(error=client_error("AccessDenied", "GetMetricStatistics")), "CloudWatch refused: AccessDenied"),
    (FakeCloudWatch([{"Timestamp": "yesterday", "Maximum": "a lot"}]), "no datapoint"),
])
def test_an_age_cloudwatch_cannot_give_is_a_question_mark_and_the_reason(queues, cloudwatch, reason):
    """No datapoint, a refused call or a garbled answer shows ? and why, and the counts still print."""
    code, text = run(queues, cloudwatch)
    assert code == 0
    assert reason in text and "visible" in text
    assert oldest_age(cloudwatch, "jobs", NOW).age_s is None


def test_a_queue_without_a_redrive_policy_says_it_has_no_dead_letter_queue(aws):
    """The DLQ line says there is none instead of a depth of zero."""
    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="plain")["QueueUrl"]
    out = io.StringIO()
    assert cmd_queue(sqs, url, FakeCloudWatch(), as_json_output=False, out=out, now=lambda: NOW) == 0
    assert "none: the queue has no RedrivePolicy" in out.getvalue()


def test_a_failed_sqs_call_is_one_line_and_exit_1(queues, capsys):
    """A queue that does not answer is `queue failed: ...` on stderr and exit 1, never a traceback."""
    sqs = boto3.client("sqs", region_name="us-east-1")
    code = cmd_queue(sqs, queues.url + "-gone", FakeCloudWatch(), as_json_output=False, out=io.StringIO(),
                     now=lambda: NOW)
    assert code == 1
    assert capsys.readouterr().err.startswith("queue failed: ")
