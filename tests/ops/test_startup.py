"""Settings problems found at start: one line on stderr and exit 2, with nothing created on the way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import FaultyClient, client_error
from worker.core.errors import ConfigError, QueueError
from worker.core.queue import Queue
from worker.ops import cli

REPO = Path(__file__).resolve().parents[2]
NO_REGION = "AWS_REGION is not set and cannot be derived from SQS_QUEUE_URL: set AWS_REGION"
# A URL that names no region (not an AWS host) and no server that answers.
LOCAL_QUEUE = "http://localhost:1/queue/x"


@pytest.fixture
def env(monkeypatch, tmp_path):
    """The CLI's environment: no region from anywhere (variables, ~/.aws), a store file that does not exist yet."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ENDPOINT_URL", "MONGO_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("SQS_QUEUE_URL", LOCAL_QUEUE)
    monkeypatch.setenv("STORE_URL", f"sqlite:///{tmp_path}/records.db")
    monkeypatch.setenv("S3_BUCKET", "voice-models")
    monkeypatch.setenv("PIPELINE_CONFIG", str(REPO / "config" / "pipeline.toml"))
    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)
    return monkeypatch


@pytest.mark.parametrize("argv", [
    ["run"], ["submit", "-"], ["doctor"], ["reconcile"], ["dlq", "list"], ["dlq", "redrive", "--fallback"],
], ids=lambda argv: " ".join(argv))
def test_a_missing_region_is_one_settings_line_and_exit_2(env, tmp_path, capsys, argv):
    """Every command that talks to AWS, given no region, prints the one settings line and exits 2, creating no store file."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines() == [NO_REGION]
    assert not (tmp_path / "records.db").exists()


@pytest.mark.parametrize("argv", [["submit", "-"], ["doctor"], ["reconcile"], ["dlq", "list"]],
                         ids=lambda argv: " ".join(argv))
def test_a_command_that_needs_the_queue_names_a_missing_one_and_exits_2(env, tmp_path, capsys, argv):
    """Every command that talks to the queue, given no SQS_QUEUE_URL, prints the one settings line and exits 2, creating no store file."""
    env.delenv("SQS_QUEUE_URL")
    env.setenv("AWS_REGION", "us-east-1")
    code = cli.main(argv)
    assert (code, capsys.readouterr().err.splitlines()) == (2, ["SQS_QUEUE_URL is required: the queue to take jobs from"])
    assert not (tmp_path / "records.db").exists()


@pytest.mark.parametrize("service", ["s3", "sts", "sqs"])
def test_no_client_quietly_falls_back_to_a_default_region(env, service):
    """S3 and STS would pick us-east-1 on their own: without a region every client is refused with the settings line."""
    from worker.core.aws import make_client
    from worker.settings import load_settings

    with pytest.raises(ConfigError) as caught:
        make_client(service, load_settings().aws_config())
    assert caught.value.problems == [NO_REGION]


def test_a_missing_region_through_the_real_entry_point(tmp_path):
    """`python -m worker dlq list` in a process with no region anywhere prints the settings line, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SQS_", "STORE_", "MONGO_"))}
    env.update({"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true", "SQS_QUEUE_URL": LOCAL_QUEUE})
    proc = subprocess.run([sys.executable, "-m", "worker", "dlq", "list"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr.strip()) == (2, NO_REGION)


@pytest.mark.parametrize("argv", [["status", "0" * 24], ["cancel", "0" * 24], ["reconcile"]],
                         ids=lambda argv: argv[0])
def test_commands_that_need_records_never_create_a_missing_store_file(env, tmp_path, capsys, argv):
    """status, cancel and reconcile on a STORE_URL file that does not exist say so and exit 2, and it still does not exist."""
    env.setenv("AWS_REGION", "us-east-1")
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines() == [f"STORE_URL names {tmp_path}/records.db, which does not exist"]
    assert not (tmp_path / "records.db").exists()


def test_doctor_reports_a_missing_store_file_without_creating_it(env, aws, tmp_path, capsys):
    """doctor fails its store check on a STORE_URL file that does not exist, and does not create it."""
    env.setenv("AWS_REGION", "us-east-1")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  store reachable: STORE_URL names {tmp_path}/records.db, which does not exist" in out
    assert not (tmp_path / "records.db").exists()


def test_run_fails_clearly_on_a_queue_that_does_not_exist(env, aws, tmp_path, capsys):
    """`run` against a queue URL that names no queue prints one settings line and exits 2 before opening the store."""
    url = "https://sqs.us-east-1.amazonaws.com/123456789012/no-such-queue"
    env.setenv("SQS_QUEUE_URL", url)
    code = cli.main(["run"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.splitlines() == [f"SQS_QUEUE_URL names a queue that does not exist: {url}"]
    assert not (tmp_path / "records.db").exists()


def test_queue_check_passes_for_a_queue_that_exists(queues):
    """An existing queue passes the start-up check."""
    Queue(queues.sqs, queues.url).check_exists()


@pytest.mark.parametrize("code", ["QueueDoesNotExist", "AWS.SimpleQueueService.NonExistentQueue"])
def test_both_spellings_of_a_missing_queue_are_a_config_error(queues, code):
    """The JSON and the query protocol's codes for a missing queue both become a ConfigError."""
    client = FaultyClient(queues.sqs)
    client.faults["get_queue_attributes"] = lambda kw: client_error(code)
    with pytest.raises(ConfigError):
        Queue(client, queues.url).check_exists()


def test_a_transient_failure_at_start_is_not_a_config_error(queues):
    """An error left after botocore's retries (ServiceUnavailable) is a QueueError: `run` exits 1 for it, not 2."""
    client = FaultyClient(queues.sqs)
    client.faults["get_queue_attributes"] = lambda kw: client_error("ServiceUnavailable")
    with pytest.raises(QueueError):
        Queue(client, queues.url).check_exists()
