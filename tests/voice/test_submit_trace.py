"""With tracing on, submit starts the job's trace and sends its context with the message."""

from __future__ import annotations

from tests.ops.test_commands import PAYLOAD, store  # noqa: F401 (store is a fixture)
from tests.support import recorded_spans
from worker.voice.submit import submit


def test_the_message_carries_the_submit_spans_trace(store, sqs):
    """The sent message's traceparent names the trace of the submit span."""
    url = sqs.create_queue(QueueName="jobs")["QueueUrl"]
    with recorded_spans() as exporter:
        submit(store, sqs, url, PAYLOAD)
    [message] = sqs.receive_message(QueueUrl=url, MessageAttributeNames=["All"])["Messages"]
    [span] = exporter.get_finished_spans()
    assert span.name == "submit"
    assert f"{span.context.trace_id:032x}" in message["MessageAttributes"]["traceparent"]["StringValue"]


def test_without_tracing_the_message_has_no_trace_attributes(store, sqs):
    """Off, the message is sent as before: no attributes."""
    url = sqs.create_queue(QueueName="plain")["QueueUrl"]
    submit(store, sqs, url, PAYLOAD)
    [message] = sqs.receive_message(QueueUrl=url, MessageAttributeNames=["All"])["Messages"]
    assert "MessageAttributes" not in message
