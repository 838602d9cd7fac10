"""Issue #27's papercuts: distinct dev worker ids, a heartbeat in the wrong unit, URLs never cut in two."""

from __future__ import annotations

import os

import pytest

from worker.core.errors import ConfigError
from worker.ops.commands import render_letter, wrapped
from worker.ops.devstack import dev_environment
from worker.settings import load_settings, settings_warnings

LONG_URL = "https://sqs.eu-west-1.amazonaws.com/123456789012/voice-jobs-dlq?" + "x" * 90


def test_dev_workers_each_get_their_own_id(tmp_path):
    """env.sh names no WORKER_ID, so each dev worker takes <hostname>:<pid>, its own."""
    env = dev_environment("http://127.0.0.1:1", "http://127.0.0.1:1/000000000000/q", tmp_path)
    assert "WORKER_ID" not in env
    assert load_settings(env).worker_id.endswith(f":{os.getpid()}")


@pytest.mark.parametrize("value", ["1", "60", "99"])
def test_a_heartbeat_surely_in_seconds_is_refused_with_the_millisecond_value(value):
    """SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS below 100 is refused, the line saying what to write for seconds."""
    with pytest.raises(ConfigError) as refused:
        load_settings({"SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": value})
    assert any(f"for {value} s write {int(value) * 1000}" in line for line in refused.value.problems)


def test_a_sub_second_heartbeat_starts_with_a_warning_and_a_normal_one_without():
    """100 to 999 ms loads (test suites use it) with a warning naming the seconds reading; 1000 and up is quiet."""
    assert settings_warnings(load_settings({"SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "300"})) == [
        "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS=300 renews every 300 ms, under a second: if 300 s was meant, "
        "write 300000"]
    assert settings_warnings(load_settings({"SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "1000"})) == []
    assert settings_warnings(load_settings({})) == []


def test_status_text_wraps_at_spaces_and_keeps_a_long_url_whole():
    """A record's free text longer than the width breaks at spaces only: the URL is one whole line."""
    lines = wrapped(f"could not reach {LONG_URL} after 3 tries", "    ")
    assert f"    {LONG_URL}" in lines
    assert " ".join(line.strip() for line in lines) == f"could not reach {LONG_URL} after 3 tries"


def test_dlq_list_keeps_a_long_url_in_the_error_whole():
    """dlq list's error lines break at spaces only, so a URL in the error is never split."""
    block = render_letter({"jobId": "j", "receiveCount": 5, "ageSeconds": 60, "messageId": "m",
                           "errorType": "QueueError", "errorMessage": f"send to {LONG_URL} failed"})
    assert any(line.strip() == LONG_URL for line in block.splitlines())
