"""Dead-letter tooling on moto: list without consuming, redrive by move task or receive -> send -> delete."""

from __future__ import annotations

import io
import json
import time

import pytest

from pipeline.errors import BadRecording
from tests.support import FaultyClient, client_error, create_queues
from tests.voice.conftest import message_body
from worker.core.errors import QueueError
from worker.core.queue import Message, Queue
from worker.ops.commands import cmd_dlq_list, cmd_dlq_redrive, format_age
from worker.ops.dlq import RECEIVE_SEND_DELETE, DeadLetterQueue, dead_letter_receives


def dead_letter(queues, n: int, receive_count: int = 3, **attrs) -> str:
    """Dead-letters job n's message the way the worker does; returns the job id."""
    job_id = f"{n:024x}"
    message_attributes = {k: {"DataType": "String", "StringValue": v} for k, v in attrs.items()}
    message = Message(message_id=f"src-{n}", receipt_handle="-", body=message_body(job_id),
                      receive_count=receive_count, received_at_s=time.monotonic(),
                      message_attributes=message_attributes)
    assert Queue(queues.sqs, queues.url).dead_letter(
        message, BadRecording("recording 0 is not audio, see https://media.example.com/a.wav?X-Amz-Signature=s"))
    return job_id


def ops(client, name: str) -> list[dict]:
    return [kwargs for op, kwargs, *_ in client.calls if op == name]


def source_messages(queues) -> list[dict]:
    return queues.receive_now()


# ---------------------------------------------------------------- pure rules

def test_receive_count_prefers_the_worker_attribute_then_the_policy():
    """The worker's ReceiveCount wins, else the policy's maxReceiveCount, else the DLQ's own count."""
    ours = {"ReceiveCount": {"DataType": "Number", "StringValue": "3"}}
    assert dead_letter_receives(ours, 5, 9) == 3
    assert dead_letter_receives({}, 5, 9) == 5
    assert dead_letter_receives({}, None, 9) == 9


def test_age_reads_in_days_hours_minutes():
    """Ages print as minutes, hours+minutes or days+hours."""
    assert [format_age(s) for s in (None, 59, 61 * 60, 26 * 3600)] == ["?", "0m", "1h01m", "1d02h"]


def test_no_redrive_policy_means_no_dlq(sqs):
    """A queue without a RedrivePolicy has no dead-letter queue to resolve."""
    bare = create_queues(sqs, name="bare", with_dlq=False)
    assert DeadLetterQueue.of(sqs, bare.url) is None


# ---------------------------------------------------------------- list

def test_list_shows_each_message_and_leaves_it_in_the_queue(queues, dlq):
    """list prints id, job id, receive count, error attributes and age, and every message stays visible."""
    first, second = dead_letter(queues, 1, receive_count=3), dead_letter(queues, 2, receive_count=5)
    out = io.StringIO()

    assert cmd_dlq_list(dlq, as_json=False, out=out) == 0

    text = out.getvalue()
    assert "2 message(s)" in text
    assert f"job {first}  receives 3  age 0m\n  message  " in text
    assert "  error    BadRecording: recording 0 is not audio" in text
    assert f"job {second}  receives 5" in text
    assert "X-Amz-Signature" not in text  # URL query strings never reach the terminal
    assert queues.counts(queues.dlq_url) == (2, 0)


def test_list_json_has_one_object_per_message(queues, dlq):
    """--json prints an array of objects with the message's id, job, receives, error and age."""
    job_id = dead_letter(queues, 1, receive_count=4)
    out = io.StringIO()
    cmd_dlq_list(dlq, as_json=True, out=out)
    [entry] = json.loads(out.getvalue())
    assert entry["jobId"] == job_id and entry["receiveCount"] == 4
    assert entry["errorType"] == "BadRecording" and entry["sourceQueue"] == queues.url
    assert entry["errorMessage"].startswith("recording 0 is not audio")
    assert isinstance(entry["messageId"], str) and 0 <= entry["ageSeconds"] < 60


def test_list_sees_every_message_of_a_queue_longer_than_one_batch(queues, dlq):
    """A DLQ of 23 messages is listed whole, each message once."""
    for n in range(23):
        queues.sqs.send_message(QueueUrl=queues.dlq_url, MessageBody=message_body(f"{n:024x}"))
    letters = dlq.peek()
    dlq.release(letters)
    assert len(letters) == len({letter.message_id for letter in letters}) == 23
    assert queues.counts(queues.dlq_url) == (23, 0)


def test_list_of_an_empty_dlq_says_so(dlq):
    """An empty DLQ prints one line saying it is empty."""
    out = io.StringIO()
    assert cmd_dlq_list(dlq, as_json=False, out=out) == 0
    assert "is empty" in out.getvalue()


def test_a_failing_scan_puts_back_what_it_held(queues, client, dlq):
    """When a later receive fails, the messages already received are made visible again."""
    for n in range(12):
        queues.sqs.send_message(QueueUrl=queues.dlq_url, MessageBody=message_body(f"{n:024x}"))
    receives = []

    def fail_second(kwargs):
        receives.append(1)
        return client_error("ServiceUnavailable") if len(receives) == 2 else None

    client.faults["receive_message"] = fail_second
    with pytest.raises(QueueError):
        dlq.peek(hold_s=300)
    assert queues.counts(queues.dlq_url) == (12, 0)


# ---------------------------------------------------------------- redrive

def test_redrive_falls_back_where_the_move_task_is_not_implemented(queues, client, dlq):
    """On moto (no StartMessageMoveTask) redrive receives, sends and deletes: bodies back, our attributes gone."""
    job_ids = [dead_letter(queues, n, Tenant="acme") for n in range(3)]

    result = dlq.redrive()

    assert result.method == RECEIVE_SEND_DELETE and result.moved == 3 and result.error is None
    assert "has no StartMessageMoveTask" in result.fallback_reason
    back = source_messages(queues)
    assert sorted(json.loads(m["Body"])["jobId"] for m in back) == sorted(job_ids)
    for m in back:
        assert set(m["MessageAttributes"]) == {"Tenant"}
        assert m["MessageAttributes"]["Tenant"]["StringValue"] == "acme"
    assert queues.counts(queues.dlq_url) == (0, 0)


class MoveTaskClient(FaultyClient):
    """A client whose endpoint implements StartMessageMoveTask (moto does not)."""

    def start_message_move_task(self, **kwargs):
        self.calls.append(("start_message_move_task", kwargs, "", time.monotonic()))
        return {"TaskHandle": "task-1"}


def test_redrive_uses_the_move_task_where_the_service_has_it(queues):
    """Where StartMessageMoveTask exists it moves everything from the DLQ to the source queue, nothing else."""
    dead_letter(queues, 1)
    client = MoveTaskClient(queues.sqs)
    dlq = DeadLetterQueue.of(client, queues.url, wait_s=0)
    out = io.StringIO()

    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=False, out=out) == 0

    def arn(url):
        return queues.sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]

    assert ops(client, "start_message_move_task") == [{"SourceArn": arn(queues.dlq_url),
                                                       "DestinationArn": arn(queues.url)}]
    assert ops(client, "receive_message") == [] and ops(client, "delete_message") == []
    assert "task-1" in out.getvalue()


def test_redrive_with_fallback_flag_never_asks_for_a_move_task(queues):
    """--fallback goes straight to receive -> send -> delete."""
    dead_letter(queues, 1)
    client = MoveTaskClient(queues.sqs)
    result = DeadLetterQueue.of(client, queues.url, wait_s=0).redrive(fallback=True)
    assert result.method == RECEIVE_SEND_DELETE and result.moved == 1
    assert ops(client, "start_message_move_task") == []


def test_unsupported_operation_code_falls_back(queues, client, dlq):
    """An UnsupportedOperation answer to the move task means fall back, not fail."""
    dead_letter(queues, 1)
    client.faults["start_message_move_task"] = lambda kw: client_error("UnsupportedOperation")
    result = dlq.redrive()
    assert result.method == RECEIVE_SEND_DELETE and result.moved == 1


def test_a_failing_move_task_is_reported_and_moves_nothing(queues, client, dlq):
    """A 5xx from StartMessageMoveTask is an error to retry: nothing is received, sent or deleted."""
    dead_letter(queues, 1)
    client.faults["start_message_move_task"] = lambda kw: client_error("InternalError")
    err = io.StringIO()
    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=False, out=io.StringIO(), err=err) == 1
    assert "InternalError" in err.getvalue() and "--fallback" in err.getvalue()
    assert ops(client, "receive_message") == [] and ops(client, "send_message") == []
    assert queues.counts(queues.dlq_url) == (1, 0)


def test_redrive_max_moves_at_most_n(queues, client, dlq):
    """--max 2 moves two messages and leaves the rest visible in the DLQ."""
    for n in range(5):
        dead_letter(queues, n)
    out = io.StringIO()
    assert cmd_dlq_redrive(dlq, max_messages=2, fallback=False, out=out) == 0
    assert "moved 2 message(s)" in out.getvalue()
    assert len(source_messages(queues)) == 2
    assert queues.counts(queues.dlq_url) == (3, 0)
    assert ops(client, "start_message_move_task") == []


def test_redrive_never_deletes_a_message_whose_send_failed(queues, client, dlq):
    """With the second send failing: the first message moves, the second stays in the DLQ, undeleted and visible."""
    for n in range(3):
        dead_letter(queues, n)
    sent = []

    def fail_second_send(kwargs):
        sent.append(kwargs["MessageBody"])
        return client_error("ServiceUnavailable") if len(sent) == 2 else None

    client.faults["send_message"] = fail_second_send
    err = io.StringIO()

    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=True, out=io.StringIO(), err=err) == 1

    assert "redrive stopped" in err.getvalue()
    calls = [(op, kw) for op, kw, *_ in client.calls if op in ("send_message", "delete_message")]
    assert [op for op, _ in calls] == ["send_message", "delete_message", "send_message"]
    assert len(source_messages(queues)) == 1
    assert queues.counts(queues.dlq_url) == (2, 0)


def test_every_delete_follows_a_successful_send_of_the_same_message(queues, client, dlq):
    """In a full fallback redrive each DLQ delete comes after its own message was sent."""
    for n in range(12):
        dead_letter(queues, n)
    handles: dict[str, str] = {}
    order: list[tuple[str, str]] = []
    real_receive = queues.sqs.receive_message

    def remember(**kwargs):
        resp = real_receive(**kwargs)
        handles.update({m["ReceiptHandle"]: m["Body"] for m in resp.get("Messages", [])})
        return resp

    client._client = type("Spy", (), {"__getattr__": lambda _s, n: getattr(queues.sqs, n),
                                      "receive_message": staticmethod(remember)})()
    client.faults["send_message"] = lambda kw: order.append(("send", kw["MessageBody"]))
    client.faults["delete_message"] = lambda kw: order.append(("delete", handles[kw["ReceiptHandle"]]))

    assert dlq.redrive(fallback=True).moved == 12

    for index, (op, body) in enumerate(order):
        if op == "delete":
            assert ("send", body) in order[:index]
    assert queues.counts() == (12, 0)
    assert queues.counts(queues.dlq_url) == (0, 0)


def test_a_failed_delete_after_the_send_is_reported_as_a_duplicate(queues, client, dlq):
    """A delete that fails after its send leaves the message in both queues and says so."""
    dead_letter(queues, 1)
    client.faults["delete_message"] = lambda kw: client_error("ServiceUnavailable")
    out = io.StringIO()
    assert cmd_dlq_redrive(dlq, max_messages=None, fallback=True, out=out) == 0
    assert "in both queues" in out.getvalue()
    assert len(ops(client, "send_message")) == 1
    assert len(source_messages(queues)) == 1


def test_a_delete_with_an_expired_hold_is_reported_as_a_duplicate(queues, client, dlq):
    """A delete SQS refuses for a stale receipt handle is one more failed delete: reported, the run goes on."""
    for n in range(2):
        dead_letter(queues, n)
    client.faults["delete_message"] = lambda kw: client_error("ReceiptHandleIsInvalid")
    result = dlq.redrive(fallback=True)
    assert result.moved == 2 and result.error is None and len(result.not_deleted) == 2


def test_fifo_redrive_keeps_the_message_group(sqs):
    """Redriving into a FIFO queue sends with the message's group and a deduplication id."""
    dlq_url = sqs.create_queue(QueueName="jobs-dlq.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    url = sqs.create_queue(QueueName="jobs.fifo", Attributes={
        "FifoQueue": "true", "RedrivePolicy": json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": "5"})})["QueueUrl"]
    sqs.send_message(QueueUrl=dlq_url, MessageBody=message_body("a" * 24), MessageGroupId="g-1",
                     MessageDeduplicationId="d-1")
    result = DeadLetterQueue.of(sqs, url, wait_s=0).redrive(fallback=True)
    assert result.moved == 1
    [msg] = sqs.receive_message(QueueUrl=url, MessageSystemAttributeNames=["MessageGroupId"])["Messages"]
    assert msg["Attributes"]["MessageGroupId"] == "g-1"


# ---------------------------------------------------------------- the command line

@pytest.fixture
def cli_env(queues, monkeypatch):
    from worker.ops import cli

    monkeypatch.setenv("SQS_QUEUE_URL", queues.url)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)
    return cli


def test_cli_dlq_list_json(cli_env, queues, capsys):
    """`python -m worker dlq list --json` prints the DLQ's messages as JSON."""
    job_id = dead_letter(queues, 1)
    assert cli_env.main(["dlq", "list", "--json"]) == 0
    assert [entry["jobId"] for entry in json.loads(capsys.readouterr().out)] == [job_id]


def test_cli_dlq_redrive_rejects_a_max_below_one(cli_env, capsys):
    """--max 0 is a usage error (exit 2), and nothing is moved."""
    assert cli_env.main(["dlq", "redrive", "--max", "0"]) == 2
    assert "--max must be at least 1" in capsys.readouterr().err


def test_cli_dlq_without_a_redrive_policy_fails_clearly(cli_env, sqs, monkeypatch, capsys):
    """A queue with no RedrivePolicy gets one line saying there is no dead-letter queue."""
    bare = create_queues(sqs, name="bare", with_dlq=False)
    monkeypatch.setenv("SQS_QUEUE_URL", bare.url)
    assert cli_env.main(["dlq", "list"]) == 2
    assert "no RedrivePolicy" in capsys.readouterr().err
