"""A handler's log fields (the voice job's jobId) are on every line of its message, from the receipt to the
delete, and a failing hint costs the message nothing (issue #27, defect 2)."""

from __future__ import annotations

import json

import structlog
from structlog.testing import capture_logs

from worker.voice.message import log_fields

JOB_ID = "665f1c2e9b1e8a0012ab34cd"


def lines(logs: list[dict], *events: str) -> list[dict]:
    return [entry for entry in logs if entry["event"] in events]


def test_the_receipt_the_outcome_and_the_delete_carry_the_job_id(memory_queue, make_memory_worker):
    """message.received, message.handled and message.deleted name the job of the body they belong to."""
    worker = make_memory_worker(lambda message, lease: "completed", log_fields=log_fields)
    memory_queue.send(json.dumps({"jobId": JOB_ID, "profileId": "p"}))
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        assert worker.run_once() == "ack"
    found = lines(logs, "message.received", "message.handled", "message.deleted")
    assert [entry["event"] for entry in found] == ["message.received", "message.handled", "message.deleted"]
    assert all(entry.get("job_id") == JOB_ID for entry in found)
    assert "job_id" not in structlog.contextvars.get_contextvars()  # nothing left for the next message


def test_a_body_without_a_usable_job_id_logs_none_and_a_broken_hint_costs_nothing(memory_queue,
                                                                                  make_memory_worker):
    """A body whose jobId is not a safe name logs no job_id; a hint that raises is ignored and the message handled."""
    def broken(_message):
        raise RuntimeError("the hint broke")

    worker = make_memory_worker(lambda message, lease: "completed", log_fields=broken)
    memory_queue.send(json.dumps({"jobId": "../etc"}))
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        assert worker.run_once() == "ack"
    assert all("job_id" not in entry for entry in lines(logs, "message.received", "message.handled"))
    assert log_fields(type("M", (), {"body": json.dumps({"jobId": "../etc"})})()) == {}
