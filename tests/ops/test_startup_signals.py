"""Signals during `python -m worker run`'s start-up: heard from the first slow step, never the default action."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from structlog.testing import capture_logs

from tests.support import create_queues, events_after, events_until
from worker.core.daemon import StartUpStopped
from worker.ops import cli
from worker.settings import load_settings
from worker.voice.records.errors import StoreError

REPO = Path(__file__).resolve().parents[2]
# Nothing listens on the discard port: each ping waits out pymongo's 5 s server selection, then the
# worker retries, so the start-up stays in the store's connect retries for half a minute.
ABSENT_MONGO = "mongodb://127.0.0.1:9/voice"


@pytest.fixture
def queue(moto_server):
    """A queue on the moto server holding one job message, which no test here may see received."""
    sqs = boto3.client("sqs", region_name="us-east-1", endpoint_url=moto_server,
                       aws_access_key_id="test", aws_secret_access_key="test")
    q = create_queues(sqs, name=f"start-up-{os.getpid()}-{time.monotonic_ns()}")
    q.send('{"jobId": "never-received"}')
    return q


def start_worker(moto_server: str, queue_url: str, tmp_path: Path, log_format: str = "json") -> subprocess.Popen:
    """`python -m worker run` on ``queue_url`` with a MongoDB that never answers; its logs on a stderr pipe."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQS_", "MONGO_", "STORE_", "S3_", "LOG_"))}
    env.update({"SQS_QUEUE_URL": queue_url, "AWS_ENDPOINT_URL": moto_server, "AWS_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "S3_BUCKET": "voice-models",
                "WORK_ROOT": str(tmp_path / "work"), "SQS_WAIT_TIME_SECONDS": "1", "LOG_FORMAT": log_format,
                "MONGO_URI": ABSENT_MONGO, "MONGO_CONNECT_MAX_ATTEMPTS": "6"})
    return subprocess.Popen([sys.executable, "-m", "worker", "run"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def lines_until(proc: subprocess.Popen, text: str) -> list[str]:
    """The stderr lines of ``proc`` up to and including the first that contains ``text`` (all of them if it exits first)."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            break
    return seen


@pytest.mark.server
def test_a_drain_during_the_stores_connect_retries_exits_zero_without_receiving(moto_server, queue, tmp_path):
    """SIGUSR2 while the start-up retries an absent MongoDB ends it with exit 0: no message received, the queued one untouched."""
    proc = start_worker(moto_server, queue.url, tmp_path)
    try:
        events = events_until(proc, "store.mongo_ping_failed")
        proc.send_signal(signal.SIGUSR2)
        assert proc.wait(60) == 0
        events += events_after(proc)
    finally:
        proc.kill()
    names = [e["event"] for e in events]
    assert "message.received" not in names and "worker.started" not in names
    # Ended at the retry's wait, not by the store giving up after its last attempt.
    assert "worker.startup_failed" not in names and names.count("store.mongo_ping_failed") < 6
    [drain] = [e for e in events if e["event"] == "worker.drain_requested"]
    [stopped] = [e for e in events if e["event"] == "worker.stopped"]
    assert (drain["during"], stopped["reason"], stopped["during"]) == ("start-up", "drain", "start-up")
    assert queue.counts() == (1, 0)


@pytest.mark.server
def test_sigusr1_during_the_start_up_dumps_stacks_and_sigterm_then_stops_it(moto_server, queue, tmp_path):
    """SIGUSR1 during the start-up prints every thread's stack (the store's retry in it) and the start-up goes on;
    SIGTERM then ends it with exit 0, no traceback, nothing received."""
    proc = start_worker(moto_server, queue.url, tmp_path, log_format="console")
    try:
        lines_until(proc, "store.mongo_ping_failed")
        proc.send_signal(signal.SIGUSR1)
        # The dump, then the next attempt's failure: the worker lived through the dump and is still starting.
        # Read as one stretch (faulthandler writes from the signal handler, between log lines), and shown
        # whole when it is not as expected.
        seen = lines_until(proc, "store.mongo_ping_failed")
        text = "".join(seen)
        assert "most recent call first" in text and "in connect_mongo" in text, text
        assert seen and "store.mongo_ping_failed" in seen[-1], text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        rest = proc.stderr.read()
    finally:
        proc.kill()
    assert "Traceback" not in rest and "message.received" not in rest
    assert "worker.stopped" in rest and "reason=shutdown" in rest
    assert queue.counts() == (1, 0)


@pytest.mark.server
def test_sigint_during_the_start_up_after_a_json_stack_dump_stops_it_cleanly(moto_server, queue, tmp_path):
    """With JSON logs SIGUSR1 during the start-up is one worker.stacks line; SIGINT then ends the start-up with exit 0, no traceback."""
    proc = start_worker(moto_server, queue.url, tmp_path)
    try:
        events = events_until(proc, "store.mongo_ping_failed")
        proc.send_signal(signal.SIGUSR1)
        events += events_until(proc, "worker.stacks")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        rest = proc.stderr.read()
    finally:
        proc.kill()
    assert "Traceback" not in rest
    events += [json.loads(line) for line in rest.splitlines()]
    [stacks] = [e for e in events if e["event"] == "worker.stacks"]
    assert any("connect_mongo" in frame for thread in stacks["threads"] for frame in thread["stack"])
    [stopped] = [e for e in events if e["event"] == "worker.stopped"]
    assert (stopped["reason"], stopped["during"]) == ("shutdown", "start-up")
    assert "message.received" not in [e["event"] for e in events]
    assert queue.counts() == (1, 0)


def test_a_drain_while_a_start_up_step_fails_still_exits_zero(monkeypatch, tmp_path, capsys):
    """A step that gives up (the store unreachable) after a drain was requested exits 0, not 1: a restart would undo the drain."""
    import worker.app

    def build_app(settings, *, wait):
        os.kill(os.getpid(), signal.SIGUSR2)
        try:
            wait(10)  # a slow step that the signal does not cut short, and that then fails
        except StartUpStopped:
            raise StoreError("MongoDB did not answer after 7 attempts: ServerSelectionTimeoutError") from None

    settings = load_settings({
        "SQS_QUEUE_URL": "https://sqs.us-east-1.amazonaws.com/123456789012/jobs", "AWS_REGION": "us-east-1",
        "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}", "S3_BUCKET": "voice-models",
        "WORK_ROOT": str(tmp_path / "work")})
    monkeypatch.setattr(worker.app, "build_app", build_app)
    monkeypatch.setattr(os, "umask", lambda _mask: 0o022)  # cmd_run's umask must not outlive the test
    # Should cmd_run not take SIGUSR2, the signal lands here instead of ending the test process.
    def placeholder(*_):
        pass

    before = signal.signal(signal.SIGUSR2, placeholder)
    try:
        with capture_logs() as logs:
            assert cli.cmd_run(settings, None) == 0
        assert signal.getsignal(signal.SIGUSR2) is placeholder  # the relay put it back
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert [e["event"] for e in logs if e["event"].startswith("worker.")] == [
        "worker.signal", "worker.drain_requested", "worker.startup_failed", "worker.stopped"]
