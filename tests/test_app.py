"""How the process ends: exit codes and logged reasons for crashes and failed start-ups."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import UTC

import pytest
import structlog

from worker.core.aws import client_config, lease_client_config, make_client
from worker.core.daemon import EXIT_CRASHED, run_worker
from worker.core.logs import configure_logging
from worker.settings import load_settings


class ExplodingWorker:
    def __init__(self):
        self.stopped = False

    def run(self):
        raise RuntimeError("the loop broke")

    def stop(self):
        self.stopped = True

    def drain(self):
        self.stopped = True


class RecordingPulse:
    def __init__(self):
        self.states = []

    def ready(self):
        self.states.append("READY")

    def stopping(self):
        self.states.append("STOPPING")


def test_unexpected_loop_end_exits_non_zero_with_the_reason_logged():
    """A loop that raises ends the process with exit 1, the reason logged, and the store still closed."""
    stream = io.StringIO()
    configure_logging("INFO", "json", stream=stream)
    closed, pulse = [], RecordingPulse()
    try:
        code = run_worker(ExplodingWorker(), close=lambda: closed.append(True), pulse=pulse)
    finally:
        structlog.reset_defaults()
    assert code == EXIT_CRASHED
    crash = [json.loads(line) for line in stream.getvalue().splitlines() if '"worker.crashed"' in line]
    assert crash and "the loop broke" in crash[0]["error"]
    assert closed == [True] and pulse.states == ["READY", "STOPPING"]


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SQS_", "MONGO_", "STORE_", "S3_"))}
    env.update({"SQS_QUEUE_URL": "http://127.0.0.1:9/000000000000/q", "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
                "S3_BUCKET": "b", **env_extra})
    return subprocess.run([sys.executable, "-m", "worker", "run"], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.server
def test_unreachable_store_at_start_exits_one_with_the_reason(moto_server):
    """A store that cannot be reached within the connect budget stops the start-up with exit 1 and a logged reason."""
    import boto3

    # The queue is checked first: it has to exist for the start-up to reach the store.
    sqs = boto3.client("sqs", region_name="us-east-1", endpoint_url=moto_server,
                       aws_access_key_id="test", aws_secret_access_key="test")
    queue_url = sqs.create_queue(QueueName=f"exits-{os.getpid()}")["QueueUrl"]
    proc = _run({"MONGO_URI": "mongodb://127.0.0.1:9/voice", "MONGO_CONNECT_MAX_ATTEMPTS": "1",
                 "SQS_QUEUE_URL": queue_url, "AWS_ENDPOINT_URL": moto_server, "AWS_REGION": "us-east-1",
                 "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"})
    assert proc.returncode == 1
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    failed = [line for line in lines if line["event"] == "worker.startup_failed"]
    assert failed and failed[0]["error_type"] == "StoreError"


def test_bad_pipeline_config_stops_the_start_up_with_its_line(tmp_path):
    """An unusable pipeline config is a configuration error: one line, exit 2, no AWS call."""
    bad = tmp_path / "pipeline.toml"
    bad.write_text('[artifacts]\nfullModel = "../escape.pth"\n')
    proc = _run({"STORE_URL": f"sqlite:///{tmp_path}/r.db", "PIPELINE_CONFIG": str(bad)})
    assert proc.returncode == 2
    assert "pipeline" in proc.stderr.lower() and "Traceback" not in proc.stderr


def test_aws_clients_retry_in_standard_mode_and_outlast_the_long_poll():
    """Clients use botocore's standard retries, a read timeout longer than the wait, and AWS_ENDPOINT_URL."""
    settings = load_settings({"SQS_WAIT_TIME_SECONDS": "20", "AWS_ENDPOINT_URL": "http://127.0.0.1:4566",
                              "SQS_QUEUE_URL": "https://sqs.eu-west-2.amazonaws.com/1/q",
                              "SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "5000"})
    config = client_config(settings.aws_config())
    assert config.retries["mode"] == "standard"
    assert config.read_timeout > 20
    client = make_client("sqs", settings.aws_config())
    assert client.meta.endpoint_url == "http://127.0.0.1:4566"
    assert client.meta.region_name == "eu-west-2"


def test_renewal_clients_give_up_within_one_heartbeat_tick():
    """The heartbeat's SQS client times out within one renewal interval and tries twice, not five times."""
    settings = load_settings({"SQS_VISIBILITY_HEARTBEAT_INTERVAL_MS": "3000", "AWS_REGION": "eu-west-2"})
    config = lease_client_config(settings.aws_config())
    assert (config.connect_timeout, config.read_timeout, config.retries["max_attempts"]) == (3.0, 3.0, 2)
    assert config.region_name == "eu-west-2"


def test_the_app_makes_every_client_from_one_session_and_s3_only_when_used(queues, tmp_path, monkeypatch):
    """build_app creates one boto3 session for all its clients, and no S3 client until something uses S3."""
    import boto3

    from worker import app as app_module

    sessions, made = [], []

    def counting_session():
        session = boto3.session.Session()
        real_client = session.client
        session.client = lambda service, **kw: (made.append(service), real_client(service, **kw))[1]
        sessions.append(session)
        return session

    monkeypatch.setattr(app_module, "new_session", counting_session)
    settings = load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1"})
    app = app_module.build_app(settings)
    try:
        assert len(sessions) == 1 and made == ["sqs", "sqs"]
        uploader = app.worker._handler._commit._uploader
        _ = uploader._s3.meta  # the first use
        assert made == ["sqs", "sqs", "s3"]
    finally:
        app.close()


def test_the_apps_job_handler_spends_the_configured_retry_budget(queues, tmp_path):
    """MAX_FAILED_ATTEMPTS reaches the job handler that counts failures against it."""
    from worker.app import build_app

    settings = load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        "MAX_FAILED_ATTEMPTS": "3"})
    app = build_app(settings)
    try:
        assert app.worker._handler.config.max_failed_attempts == 3
    finally:
        app.close()


def test_a_lazy_client_is_made_once_when_threads_race_to_use_it():
    """Many threads using a LazyClient first at the same moment make exactly one client."""
    import threading
    import time

    from worker.core.aws import LazyClient

    made = []

    def make():
        time.sleep(0.05)  # wide enough for every thread to arrive while the first one builds
        made.append(object())
        return type("Client", (), {"name": "c"})()

    lazy = LazyClient(make)
    threads = [threading.Thread(target=lambda: lazy.name) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and lazy.name == "c"


@pytest.mark.parametrize("skew_s", [30, -300])
def test_run_refuses_to_start_on_a_clock_off_from_the_stores(queues, tmp_path, monkeypatch, capsys, skew_s):
    """A host clock further from the store's than MAX_CLOCK_SKEW_SECONDS: one line on stderr, exit 2, store closed."""
    from datetime import datetime, timedelta

    from worker.app import build_app
    from worker.core.errors import ConfigError
    from worker.ops import cli
    from worker.voice.records import rules

    settings = load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        "MAX_CLOCK_SKEW_SECONDS": "10"})
    monkeypatch.setattr(rules, "utc_now", lambda: datetime.now(UTC) + timedelta(seconds=skew_s))
    monkeypatch.setattr(os, "umask", lambda _mask: 0o022)  # cmd_run's umask must not outlive the test
    assert cli.cmd_run(settings, None) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "MAX_CLOCK_SKEW_SECONDS=10" in lines[0]
    assert ("behind" if skew_s < 0 else "ahead of") in lines[0]
    closed = []
    monkeypatch.setattr("worker.voice.records.sqlite.SqliteStore.close", lambda self: closed.append(self))
    with pytest.raises(ConfigError):
        build_app(settings)
    assert len(closed) == 1


def test_run_starts_on_a_clock_within_the_margin(queues, tmp_path, monkeypatch):
    """A host clock 5 s off from the store's, under the 10 s margin, starts."""
    from datetime import datetime, timedelta

    from worker.app import build_app
    from worker.voice.records import rules

    settings = load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1"})
    monkeypatch.setattr(rules, "utc_now", lambda: datetime.now(UTC) + timedelta(seconds=5))
    build_app(settings).close()


@pytest.mark.parametrize("agent_uri", [None, "http://169.254.170.2/api/task-1"])
def test_the_app_protects_jobs_from_scale_in_only_on_ecs(queues, tmp_path, agent_uri):
    """With ECS_AGENT_URI the worker is wired to ECS task protection; without it (systemd hosts), to nothing."""
    from worker.app import build_app
    from worker.core.ecs_agent import TaskProtection
    from worker.core.loop import NoActivity

    settings = load_settings({
        "SQS_QUEUE_URL": queues.url, "STORE_URL": f"sqlite:///{tmp_path / 'records.db'}",
        "S3_BUCKET": "voice-models", "WORK_ROOT": str(tmp_path / "work"), "AWS_REGION": "us-east-1",
        **({"ECS_AGENT_URI": agent_uri} if agent_uri else {})})
    app = build_app(settings)
    try:
        # Outermost the presence record's tracking, then systemd's STATUS, then the protection.
        assert isinstance(app.worker._activity.inner.inner, TaskProtection if agent_uri else NoActivity)
    finally:
        app.close()


def test_the_start_up_clock_check_reads_mongodbs_server_time():
    """On MongoDB the host's clock is compared with the server's (here an injected server clock 30 s ahead)."""
    from datetime import datetime, timedelta

    import mongomock

    from worker.app import refuse_clock_skew
    from worker.core.errors import ConfigError
    from worker.voice.records.mongo import MongoStore, ServerClock

    client = mongomock.MongoClient()
    server = ServerClock(lambda: datetime.now(UTC) + timedelta(seconds=30))
    with MongoStore(client["voice"], clock=server, client=client) as store:
        with pytest.raises(ConfigError) as caught:
            refuse_clock_skew(store, 10)
        refuse_clock_skew(store, 60)
    assert caught.value.problems[0].startswith("this host's clock is 30.0 s behind the store's")


# What an idle daemon leaves unloaded until its first message: the job, its pipeline and message model.
# What `run` loads (the job path, checked at start) and what it never needs (the operator commands).
JOB_MACHINERY = ("worker.voice.job", "worker.voice.message", "worker.voice.artifacts", "pipeline.run",
                 "pipeline.downloads", "pipeline.stages")
COMMANDS = ("worker.ops.commands",)
IDLE_THEN_ONE_MESSAGE = """
import os, sys
from moto import mock_aws
MACHINERY = {machinery!r}
COMMANDS = {commands!r}
with mock_aws():
    import boto3
    url = boto3.client("sqs", region_name="us-east-1").create_queue(QueueName="q")["QueueUrl"]
    os.environ.update(SQS_QUEUE_URL=url, AWS_REGION="us-east-1", S3_BUCKET="voice-models",
                      STORE_URL="sqlite:///" + sys.argv[1] + "/records.db", WORK_ROOT=sys.argv[1] + "/work",
                      LOG_LEVEL="ERROR", METRICS_ENABLED="false")
    from worker.ops import cli

    def first_message(worker, close, pulse, **_options):
        print(sorted(m for m in MACHINERY if m in sys.modules))
        print(sorted(m for m in COMMANDS if m in sys.modules))
        boto3.client("sqs", region_name="us-east-1").send_message(QueueUrl=url, MessageBody="not a job")
        print(worker.run_once(), "worker.voice.job" in sys.modules)
        close()
        return 0

    cli.run_worker = first_message
    sys.exit(cli.main(["run"]))
"""


def test_run_loads_the_job_path_at_start_and_never_the_operator_commands(tmp_path):
    """`run` has the job path loaded before its first message (a broken install fails at start) and never
    loads the operator commands."""
    probe = IDLE_THEN_ONE_MESSAGE.format(machinery=JOB_MACHINERY, commands=COMMANDS)
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [str(sorted(JOB_MACHINERY)), "[]", "dead_letter True"]


