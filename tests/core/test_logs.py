"""Logs: structured, tied to the message, free of bodies and credentials; reporting never changes outcomes."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from pipeline.errors import DownloadError
from worker.core.logs import configure_logging, scrub
from worker.core.reporting import Reporter

SECRET_BODY = (
    '{"jobId": "j1", "input": [{"recordingUrl": "https://media.example.com/a.wav?X-Amz-Signature=SECRET123",'
    ' "originalText": "PRIVATE-TRANSCRIPT"}]}'
)


@pytest.fixture
def json_logs():
    stream = io.StringIO()
    configure_logging("DEBUG", "json", stream=stream)
    yield stream
    structlog.reset_defaults()


def test_every_message_line_carries_its_id_and_receive_count_and_no_body(memory_queue, make_memory_worker, fake_clock,
                                                                        json_logs):
    """Each log line about a message names it and its receive count; the body and signed query never appear."""
    def handler(message, lease):
        structlog.get_logger("handler").info("job.step", source="https://media.example.com/a.wav?X-Amz-Signature=SECRET123")
        fake_clock.advance(0.3)  # one heartbeat tick, in the message's log context
        raise DownloadError("fetch of https://media.example.com/a.wav?X-Amz-Signature=SECRET123 timed out")

    worker = make_memory_worker(handler)
    msg_id = memory_queue.send(SECRET_BODY)
    worker.run_once()
    text = json_logs.getvalue()
    assert "SECRET123" not in text and "PRIVATE-TRANSCRIPT" not in text
    lines = [json.loads(entry) for entry in text.splitlines()]
    about_message = [entry for entry in lines if entry["event"].split(".")[0] in ("message", "heartbeat", "job")]
    assert {entry["event"] for entry in about_message} >= {"message.received", "job.step", "message.handled"}
    assert all(entry["message_id"] == msg_id and entry["receive_count"] == 1 for entry in about_message)
    assert all("timestamp" in entry and "level" in entry for entry in lines)


def test_console_format_is_readable(json_logs):
    """LOG_FORMAT=console renders key=value lines rather than JSON."""
    stream = io.StringIO()
    configure_logging("INFO", "console", stream=stream)
    structlog.get_logger("t").info("worker.started", queue="q")
    line = stream.getvalue()
    assert "worker.started" in line and "queue=q" in line and not line.startswith("{")


def test_scrub_cuts_queries_userinfo_and_fragments():
    """URLs lose query strings, fragments and userinfo, keeping scheme, host and path."""
    assert scrub("get https://u:p@h.example/a/b.wav?sig=1&x=2#frag done") == "get https://h.example/a/b.wav done"
    assert scrub("s3://bucket/key?versionId=3") == "s3://bucket/key"


class BrokenSdk:
    def __init__(self, fail_init=False):
        self.fail_init = fail_init

    def init(self, **kw):
        if self.fail_init:
            raise RuntimeError("bad dsn")

    def capture_exception(self, exc):
        raise ConnectionError("sentry unreachable")


def test_reporting_failure_is_contained_and_outcome_unchanged(queues, make_worker, json_logs):
    """A reporter that throws is logged; the message still gets its retry backoff."""
    reporter = Reporter("https://key@sentry.example/1", sdk=BrokenSdk())
    assert reporter.enabled

    def handler(message, lease):
        raise DownloadError("503")

    worker, client = make_worker(handler, reporter=reporter)
    queues.send()
    assert worker.run_once() == "retry"
    assert client.calls[-1][0] == "change_message_visibility"
    assert 1 <= client.calls[-1][1]["VisibilityTimeout"] <= 30  # the jittered first backoff
    assert "reporting.capture_failed" in json_logs.getvalue()


def test_reporter_init_failure_is_contained(json_logs):
    """A reporter whose SDK fails to initialise is disabled, not fatal."""
    reporter = Reporter("https://key@sentry.example/1", sdk=BrokenSdk(fail_init=True))
    assert not reporter.enabled
    reporter.capture(ValueError("x"))
    assert "reporting.init_failed" in json_logs.getvalue()


def test_no_dsn_means_no_reporting():
    """Without SENTRY_DSN nothing is initialised."""
    assert not Reporter(None).enabled


class RecordingSdk:
    def __init__(self):
        self.init_kwargs = {}

    def init(self, **kw):
        self.init_kwargs = kw

    def capture_exception(self, exc):
        pass


def test_sentry_gets_no_locals_and_scrubbed_events():
    """Sentry is set up without frame locals or PII, and events lose URL query strings before sending."""
    sdk = RecordingSdk()
    Reporter("https://key@sentry.example/1", sdk=sdk)
    kw = sdk.init_kwargs
    assert kw["include_local_variables"] is False and kw["send_default_pii"] is False
    event = {"exception": {"values": [{"value": "GET https://h.example/a.wav?X-Amz-Signature=SECRET1 failed"}]},
             "extra": {"urls": ["s3://b/k?versionId=SECRET2"]}}
    text = str(kw["before_send"](event, {}))
    assert "SECRET1" not in text and "SECRET2" not in text and "https://h.example/a.wav" in text


def test_urls_nested_in_lists_and_dicts_are_scrubbed_too(json_logs):
    """A list or dict logged as one field loses its signed queries and userinfo like a plain string does."""
    structlog.get_logger("t").warning("job.work_files_not_removed", failures=[
        "a.wav: https://h.example/a.wav?X-Amz-Signature=SECRET123"], paths={"m": "mongodb://u:SECRET456@db/x"})
    text = json_logs.getvalue()
    assert "SECRET123" not in text and "SECRET456" not in text and "h.example/a.wav" in text


def test_console_logs_carry_no_terminal_control_sequences(json_logs):
    """A stage's escape sequences in a logged traceback, which the console renderer writes as it is, are dropped."""
    stream = io.StringIO()
    configure_logging("INFO", "console", stream=stream)
    try:
        raise RuntimeError("stage x failed:\n\x1b[2J\x1b]0;owned\x07boom\rforged\x9b1m")
    except RuntimeError as exc:
        structlog.get_logger("t").error("worker.unexpected", exc_info=exc)
    line = stream.getvalue()
    assert not any(ch in line for ch in "\x1b\x07\r\x9b"), repr(line)
    assert "boom" in line and "forged" in line
