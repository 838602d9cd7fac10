"""Observability: EMF metric lines (structure, wiring in loop, lease and handler), progress rate limit, config files."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import boto3
import jsonschema
import pytest

from pipeline.errors import BadRecording, DownloadError
from tests.deploy.cfn import Resolver
from tests.deploy.files import REPO
from tests.voice.conftest import message_body
from tests.voice.records.conftest import WallClock, make_store
from worker.core import metrics as m
from worker.core.core_config import LeaseTimings
from worker.core.errors import ConfigError, QueueError, Stopped
from worker.core.lease import Lease, Shutdown
from worker.core.metrics import Metrics, parse_dimensions
from worker.core.queue import Message, Queue
from worker.core.stop import StopSignal
from worker.core.testing import FakeClock
from worker.settings import load_settings
from worker.voice import metrics as vm
from worker.voice.records.attempt import Attempt, ProgressReporter
from worker.voice.records.errors import StoreError

# The EMF document structure, restated from CloudWatch's specification.
_UNITS = ["Seconds", "Microseconds", "Milliseconds", "Bytes", "Kilobytes", "Megabytes", "Gigabytes",
          "Terabytes", "Bits", "Kilobits", "Megabits", "Gigabits", "Terabits", "Percent", "Count",
          "Bytes/Second", "Kilobytes/Second", "Megabytes/Second", "Gigabytes/Second", "Terabytes/Second",
          "Bits/Second", "Kilobits/Second", "Megabits/Second", "Gigabits/Second", "Terabits/Second",
          "Count/Second", "None"]
EMF_SCHEMA = {
    "type": "object",
    "required": ["_aws"],
    "properties": {"_aws": {
        "type": "object",
        "required": ["Timestamp", "CloudWatchMetrics"],
        "properties": {
            "Timestamp": {"type": "integer", "minimum": 0},
            "CloudWatchMetrics": {"type": "array", "minItems": 1, "items": {
                "type": "object",
                "required": ["Namespace", "Dimensions", "Metrics"],
                "properties": {
                    "Namespace": {"type": "string", "minLength": 1, "maxLength": 1024},
                    "Dimensions": {"type": "array", "minItems": 1, "items": {
                        "type": "array", "maxItems": 30,
                        "items": {"type": "string", "minLength": 1, "maxLength": 250}}},
                    "Metrics": {"type": "array", "minItems": 1, "maxItems": 100, "items": {
                        "type": "object", "required": ["Name"],
                        "properties": {"Name": {"type": "string", "minLength": 1, "maxLength": 1024},
                                       "Unit": {"enum": _UNITS},
                                       "StorageResolution": {"enum": [1, 60]}}}},
                }}},
        }}},
}


def emf(line: str) -> dict:
    """One EMF document from one line, checked against the spec: schema plus top-level target members."""
    doc = json.loads(line)  # the whole line is one JSON object, nothing before or after
    jsonschema.validate(doc, EMF_SCHEMA)
    for directive in doc["_aws"]["CloudWatchMetrics"]:
        for dimension_set in directive["Dimensions"]:
            for name in dimension_set:
                assert isinstance(doc.get(name), str) and 0 < len(doc[name]) <= 1024, name
        for metric in directive["Metrics"]:
            value = doc.get(metric["Name"])
            values = value if isinstance(value, list) else [value]
            assert values and len(values) <= 100, metric["Name"]
            assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values), metric["Name"]
    return doc


def emf_lines(stream: io.StringIO) -> list[dict]:
    return [emf(line) for line in stream.getvalue().splitlines()]


def metric_names(doc: dict) -> set[str]:
    return {metric["Name"] for d in doc["_aws"]["CloudWatchMetrics"] for metric in d["Metrics"]}


def with_metric(docs: list[dict], name: str) -> list[dict]:
    return [doc for doc in docs if name in metric_names(doc)]


# ---------------------------------------------------------------- the document

def test_emit_writes_one_valid_emf_line_with_dimensions_and_namespace():
    """One emit is one line: the _aws block names namespace, dimensions and metrics, all present at top level."""
    out = io.StringIO()
    metrics = Metrics("VW-Test", parse_dimensions("Environment=production, Queue=jobs"), stream=out,
                      clock=lambda: 1714564800.1234)
    metrics.emit({m.JOB_DURATION: (12.5, m.SECONDS), "JobsCompleted": (1, m.COUNT)}, outcome="completed")
    [doc] = emf_lines(out)
    [directive] = doc["_aws"]["CloudWatchMetrics"]
    assert doc["_aws"]["Timestamp"] == 1714564800123
    assert directive["Namespace"] == "VW-Test"
    assert directive["Dimensions"] == [["Environment", "Queue"]]
    assert directive["Metrics"] == [{"Name": "JobDuration", "Unit": "Seconds"}, {"Name": "JobsCompleted", "Unit": "Count"}]
    assert (doc["Environment"], doc["Queue"], doc["JobDuration"], doc["JobsCompleted"]) == ("production", "jobs", 12.5, 1)
    assert doc["outcome"] == "completed"


def test_without_configured_dimensions_the_dimension_set_is_empty():
    """No METRICS_DIMENSIONS gives one empty dimension set, which the format allows."""
    out = io.StringIO()
    Metrics(stream=out).count("JobsRetried")
    [doc] = emf_lines(out)
    assert doc["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [[]]
    assert doc["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "VoiceWorker"


def test_properties_never_shadow_a_dimension_or_a_metric():
    """A property named like a dimension, a metric or _aws cannot replace it."""
    out = io.StringIO()
    Metrics(dimensions={"Queue": "jobs"}, stream=out).emit(
        {"JobsRetried": (1, m.COUNT)}, Queue="evil", JobsRetried="x", _aws="x", note="kept")
    [doc] = emf_lines(out)
    assert doc["Queue"] == "jobs" and doc["JobsRetried"] == 1 and doc["note"] == "kept"


def test_values_that_are_not_finite_numbers_are_dropped():
    """NaN and infinity never reach a line; a document left with no metric is not written."""
    out = io.StringIO()
    metrics = Metrics(stream=out)
    metrics.emit({"JobDuration": (float("nan"), m.SECONDS), "JobsCompleted": (1, m.COUNT)})
    metrics.emit({"JobDuration": (float("inf"), m.SECONDS)})
    [doc] = emf_lines(out)
    assert metric_names(doc) == {"JobsCompleted"} and "JobDuration" not in doc


def test_disabled_metrics_write_nothing():
    """METRICS_ENABLED=false turns every emit into nothing."""
    out = io.StringIO()
    settings = load_settings({"METRICS_ENABLED": "false"})
    metrics = Metrics.from_config(settings.metrics_config(), stream=out)
    metrics.count("JobsRetried")
    metrics.seconds("JobDuration", 3.0)
    assert out.getvalue() == ""


def test_a_broken_stream_never_fails_the_caller():
    """A closed stdout is logged once and swallowed: metrics are advisory."""
    out = io.StringIO()
    out.close()
    metrics = Metrics(stream=out)
    metrics.count("JobsRetried")
    metrics.count("JobsRetried")


def test_default_stream_is_stdout(capsys):
    """With no stream given the lines go to stdout, not to stderr where the logs are."""
    Metrics().count("JobsRetried")
    captured = capsys.readouterr()
    assert emf(captured.out.strip())["JobsRetried"] == 1 and captured.err == ""


# ---------------------------------------------------------------- settings

@pytest.mark.parametrize("text,problem", [
    ("Environment", "not Name=Value"),
    ("Environment=", "not Name=Value"),
    ("Env ironment=x", "letters, digits"),
    ("Stage=x", "reserved"),
    ("JobsCompleted=x", "reserved"),
    ("JobGpuSeconds=x", "reserved"),
    ("ReconcileFailures=x", "reserved"),
    ("A=1,A=2", "given twice"),
    (",".join(f"D{n}=v" for n in range(30)), "at most 29"),
])
def test_bad_dimensions_are_refused_at_start(text, problem):
    """A malformed METRICS_DIMENSIONS stops the worker with one line naming the problem."""
    with pytest.raises(ConfigError) as caught:
        load_settings({"METRICS_DIMENSIONS": text})
    assert any(line.startswith("METRICS_DIMENSIONS") and problem in line for line in caught.value.problems)


def test_the_core_reserves_its_own_names_and_those_it_is_given():
    """The core's parse refuses its own metric names and ``reserved``, and knows no layer's; the voice
    worker's parse (the one the settings use) reserves its metrics and its Stage dimension too."""
    with pytest.raises(ValueError, match="reserved"):
        parse_dimensions("JobDuration=x")
    assert parse_dimensions("Stage=x,JobGpuSeconds=y") == {"Stage": "x", "JobGpuSeconds": "y"}
    with pytest.raises(ValueError, match="'Stage' is reserved"):
        parse_dimensions("Stage=x", reserved={"Stage"})
    for name in ("Stage", "StageDuration", "JobGpuSeconds", "WastedGpuSeconds", "ReconciledWorkerLost",
                 "JobsCompleted"):
        with pytest.raises(ValueError, match="reserved"):
            vm.parse_dimensions(f"{name}=x")
    assert vm.parse_dimensions("Environment=production") == {"Environment": "production"}
    assert not (vm.VOICE_METRIC_NAMES | vm.DIMENSIONS) & (m.METRIC_NAMES | {"Stage"} - vm.DIMENSIONS)


def test_metrics_and_reconcile_defaults():
    """Metrics are on in namespace VoiceWorker; the stale age defaults well past time limit plus visibility."""
    s = load_settings({})
    assert (s.metrics_enabled, s.metrics_namespace, s.metrics_dimensions) == (True, "VoiceWorker", {})
    assert s.reconcile_stale_s == 21_600 + 300 + 900 + 3600
    assert s.reconcile_stale_s > s.job_time_limit_s + s.sqs_visibility_timeout_s
    assert load_settings({"RECONCILE_STALE_AFTER_SECONDS": "30000"}).reconcile_stale_s == 30_000


def test_a_stale_age_shorter_than_an_attempt_is_refused():
    """RECONCILE_STALE_AFTER_SECONDS below time limit + visibility timeout could mark a live job lost."""
    with pytest.raises(ConfigError) as caught:
        load_settings({"RECONCILE_STALE_AFTER_SECONDS": "3600"})
    assert "RECONCILE_STALE_AFTER_SECONDS=3600 must be at least" in caught.value.problems[0]


# ---------------------------------------------------------------- the loop and the lease

@pytest.fixture
def build_worker(make_memory_worker):
    """A worker on the in-memory queue whose metrics go to a string; returns (worker, its EMF output)."""
    def build(handler, **env):
        out = io.StringIO()
        return make_memory_worker(handler, metrics=Metrics(dimensions={"Queue": "jobs"}, stream=out), **env), out
    return build


def _raise(exc):
    def handler(message, lease):
        raise exc
    return handler


@pytest.mark.parametrize("handler,outcome", [
    (lambda message, lease: "completed", "JobsCompleted"),
    (lambda message, lease: "cancelled", "JobsCancelled"),
    (lambda message, lease: "duplicate", "JobsSkipped"),
    (_raise(DownloadError("timeout")), "JobsRetried"),
    (_raise(BadRecording("not audio")), "JobsDeadLettered"),
    (_raise(Stopped(Stopped.SHUTDOWN)), "JobsReleased"),
    (_raise(Stopped(Stopped.LEASE_LOST)), "JobsLeaseLost"),
])
def test_each_message_adds_one_to_its_outcome(build_worker, memory_queue, handler, outcome):
    """After settling, the loop writes one EMF line counting the message's outcome once."""
    worker, out = build_worker(handler)
    memory_queue.send()
    worker.run_once()
    [doc] = emf_lines(out)
    outcome_metrics = metric_names(doc) & set(m.OUTCOME_METRICS.values())
    assert outcome_metrics == {outcome} and doc[outcome] == 1 and doc["Queue"] == "jobs"


def test_a_completed_job_reports_its_duration_and_receive_count(build_worker, memory_queue, fake_clock):
    """Completion adds JobDuration (seconds) and the receive count it took."""
    def slow(message, lease):
        fake_clock.advance(0.25)
        return "completed"

    worker, out = build_worker(slow)
    memory_queue.send()
    memory_queue.receive(wait_s=0, visibility_timeout_s=0)  # a first, abandoned delivery
    worker.run_once()
    [doc] = emf_lines(out)
    assert doc["JobDuration"] == 0.25 and doc["ReceiveCountAtCompletion"] == 2
    units = {metric["Name"]: metric["Unit"] for metric in doc["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    assert units == {"JobsCompleted": "Count", "JobDuration": "Seconds", "ReceiveCountAtCompletion": "Count"}


def test_failed_queue_renewals_count_as_heartbeat_failures(build_worker, memory_queue, fake_clock):
    """A visibility renewal that fails (throttled) adds one HeartbeatFailures with part=queue."""
    failures = iter([QueueError("ChangeMessageVisibility (renewal) failed: ThrottlingException")])
    memory_queue.faults["extend"] = lambda message: next(failures, None)
    worker, out = build_worker(lambda message, lease: fake_clock.advance(0.5) and "completed")
    memory_queue.send()
    worker.run_once()
    [heartbeat] = with_metric(emf_lines(out), m.HEARTBEAT_FAILURES)
    assert heartbeat["HeartbeatFailures"] == 1 and heartbeat["part"] == "queue"


def test_failed_store_renewals_count_as_heartbeat_failures(build_worker, memory_queue, fake_clock):
    """A store renewal callback that fails adds HeartbeatFailures with part=store."""
    calls = []

    def handler(message, lease):
        def renew():
            calls.append(1)
            if len(calls) == 1:
                raise StoreError("store down")
        lease.on_renew(renew)
        fake_clock.advance(0.5)
        return "completed"

    worker, out = build_worker(handler)
    memory_queue.send()
    worker.run_once()
    [heartbeat] = with_metric(emf_lines(out), m.HEARTBEAT_FAILURES)
    assert heartbeat["part"] == "store"


# ---------------------------------------------------------------- progress: stage timing and rate limit

@pytest.fixture(params=["sqlite", "mongo"])
def claimed(request, tmp_path):
    """A store of either kind holding one job claimed with token "t"."""
    clock = WallClock()
    store = make_store(request.param, tmp_path, clock, request)
    store.submit({"_id": "a" * 24, "profileId": "b" * 24, "environment": "production"}, {"_id": "b" * 24})
    store.claim("a" * 24, owner="w", token="t", lease_s=3600)
    yield store, clock
    store.close()


def progress_of(store) -> tuple:
    p = store.get_job("a" * 24)["progress"]
    return p["stage"], p["percent"]


def test_stage_durations_are_timed_from_first_report_to_100_percent(claimed):
    """Each stage emits one StageDuration with a Stage dimension, from its first report to its first 100 %."""
    store, _ = claimed
    out, ticks = io.StringIO(), FakeClock(start_s=100.0)
    reporter = ProgressReporter(Attempt(store, "a" * 24, None, "t", 60.0), StopSignal(), clock=ticks,
                                metrics=Metrics(dimensions={"Queue": "jobs"}, stream=out))
    for at, stage, percent in [(0, "download", 0), (3, "download", 100), (3, "train_full", 0),
                               (4, "train_full", 50), (10, "train_full", 100), (11, "train_full", 100)]:
        ticks.now = 100.0 + at
        reporter(stage, percent)
    docs = emf_lines(out)
    assert [(d["Stage"], d["StageDuration"]) for d in docs] == [("download", 3.0), ("train_full", 7.0)]
    assert all(d["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["Queue", "Stage"]] for d in docs)
    assert all(d["jobId"] == "a" * 24 for d in docs)


def test_progress_is_rate_limited_per_stage_but_stage_changes_and_100_go_through(claimed):
    """Within 2 s of a write, same-stage reports are dropped; a new stage, 100 % or the interval's end write."""
    store, clock = claimed
    ticks = FakeClock(start_s=100.0)
    reporter = ProgressReporter(Attempt(store, "a" * 24, None, "t", 60.0), StopSignal(), clock=ticks)
    steps = [  # (seconds since start, stage, percent, written?)
        (0.0, "train_full", 0, True), (0.5, "train_full", 10, False), (1.99, "train_full", 20, False),
        (2.0, "train_full", 30, True), (2.1, "train_full", 100, True), (2.2, "export", 0, True),
        (2.3, "export", 5, False),
    ]
    expected = None
    for at, stage, percent, written in steps:
        ticks.now = 100.0 + at
        clock.advance(0.1)
        reporter(stage, percent)
        if written:
            expected = (stage, float(percent))
            assert store.get_job("a" * 24)["progress"]["updatedAt"] == clock.now
        assert progress_of(store) == expected, (at, stage, percent)
    assert reporter.writes == 4


def test_a_chatty_trainer_cannot_flood_the_store(claimed):
    """A thousand PROGRESS lines within one interval cause one write."""
    store, _ = claimed
    ticks, writes = FakeClock(start_s=100.0), []
    real = store.set_progress
    store.set_progress = lambda *a, **k: writes.append(a) or real(*a, **k)
    reporter = ProgressReporter(Attempt(store, "a" * 24, None, "t", 60.0), StopSignal(), clock=ticks)
    for n in range(1000):
        ticks.now = 100.0 + n * 0.0019
        reporter("train_full", n / 10)
    assert len(writes) == 1 and progress_of(store) == ("train_full", 0.0)


def test_the_handler_times_stages_through_its_metrics(aws, tmp_path):
    """VoiceJobHandler hands its Metrics to the progress reporter, so a real attempt emits StageDuration."""
    from tests.voice.conftest import FakeTrain
    from worker.voice.artifacts import ArtifactUploader
    from worker.voice.job import HandlerConfig, VoiceJobHandler
    from worker.voice.records.sqlite import SqliteStore

    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="models")
    store = SqliteStore(str(tmp_path / "records.db"))
    store.submit({"_id": "a" * 24, "profileId": "b" * 24, "environment": "production"}, {"_id": "b" * 24})
    train = FakeTrain()
    train.during = lambda job, work_dir, stop, progress: progress("train_full", 0)
    out = io.StringIO()
    handler = VoiceJobHandler(HandlerConfig(work_root=tmp_path / "work", s3_prefix="", worker_id="w", lease_s=60),
                              store=store, uploader=ArtifactUploader(s3, "models"), train=train,
                              metrics=Metrics(stream=out))
    message = Message("m-1", "-", message_body("a" * 24, "b" * 24), 1, time.monotonic())
    timings = LeaseTimings(visibility_timeout_s=60, interval_s=10, time_limit_s=600, shutdown_grace_s=1)
    lease = Lease(Queue(None, "q"), message, timings, shutdown=Shutdown())
    assert handler(message, lease) == "completed"
    [doc] = [d for d in emf_lines(out) if "StageDuration" in d]
    assert doc["Stage"] == "train_full" and doc["StageDuration"] >= 0
    store.close()


# ---------------------------------------------------------------- the shipped dashboard and alarms

# The services' own metrics the dashboard shows beside the worker's: the queue, the ECS service's
# tasks, and the CloudWatch agent's GPU figures (config/amazon-cloudwatch-agent.json).
FOREIGN_METRICS = {
    "AWS/SQS": {"ApproximateNumberOfMessagesVisible", "ApproximateNumberOfMessagesNotVisible",
                "ApproximateAgeOfOldestMessage"},
    "ECS/ContainerInsights": {"DesiredTaskCount", "PendingTaskCount", "RunningTaskCount"},
    "CWAgent": {"nvidia_smi_utilization_gpu", "nvidia_smi_utilization_memory"},
}
_SEARCH = re.compile(r"""SEARCH\('(?:Namespace="(?P<ns>[^"]+)"|\{(?P<schema>[^}]+)\}) MetricName="(?P<name>[^"]+)"', """
                     r"""'[A-Za-z0-9]+', \d+\)""")


def _log_metric_filters() -> set[str]:
    """The metric names the stack's log metric filters publish in the worker's namespace."""
    text = (REPO / "config" / "cloudformation.yaml").read_text()
    return set(re.findall(rf"MetricNamespace: {m.DEFAULT_NAMESPACE}\n\s+MetricName: (\w+)", text))


def test_dashboard_graphs_every_metric_the_code_emits_and_nothing_else():
    """Every metric the worker and reconciler emit has a graph, and each graph names a real metric: the
    worker's, a log filter's of the stack, or a service's own that the dashboard knows."""
    body = json.loads((REPO / "config" / "cloudwatch-dashboard.json").read_text())
    named, foreign = set(), []
    for widget in body["widgets"]:
        assert widget["x"] + widget["width"] <= 24
        if widget["type"] != "metric":
            continue
        ids = [entry[0]["id"] for entry in widget["properties"]["metrics"]]
        assert len(ids) == len(set(ids)) and all(re.fullmatch(r"[a-z][A-Za-z0-9_]*", i) for i in ids)
        assert widget["properties"]["region"]
        for entry in widget["properties"]["metrics"]:
            found = _SEARCH.fullmatch(entry[0]["expression"])
            assert found, entry[0]["expression"]
            namespace = found["ns"] or found["schema"].split(",")[0]
            if namespace == m.DEFAULT_NAMESPACE:
                named.add(found["name"])
            else:
                foreign.append((namespace, found["name"]))
    filters = _log_metric_filters()
    assert named - filters == set(vm.METRIC_NAMES)
    assert [(ns, name) for ns, name in foreign if name not in FOREIGN_METRICS.get(ns, ())] == []


def test_alarms_template_is_lint_clean_and_watches_emitted_metrics():
    """cfn-lint passes the alarms template, and each alarm watches a metric the code emits with the documented dimensions."""
    import subprocess

    from cfnlint.decode import cfn_yaml

    from tests.deploy.files import VENV_BIN

    path = REPO / "config" / "cloudwatch-alarms.yaml"
    result = subprocess.run([str(VENV_BIN / "cfn-lint"), "--include-checks", "I", "--", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")
    stack = Resolver(cfn_yaml.loads(path.read_text(), str(path)))
    # The alarms on the worker's own metrics; the metric-math ones (tests/deploy/test_alarms.py) read
    # AWS/SQS and ECS metrics.
    alarms = [stack.resource(name) for name, spec in stack.template["Resources"].items()
              if spec["Type"] == "AWS::CloudWatch::Alarm" and "MetricName" in spec["Properties"]]
    assert alarms
    for props in alarms:
        assert props["MetricName"] in vm.METRIC_NAMES
        assert props["Namespace"] == m.DEFAULT_NAMESPACE
        assert [d["Name"] for d in props["Dimensions"]] == ["Environment", "Queue"]
    # The documented METRICS_DIMENSIONS produces exactly the dimension names the alarms match.
    assert list(vm.parse_dimensions("Environment=production,Queue=voice-worker-jobs")) == ["Environment", "Queue"]
    assert "METRICS_DIMENSIONS=Environment=<Environment>,Queue=<QueueName>" in path.read_text()


def test_every_emitted_metric_name_is_a_known_constant():
    """The names the code uses are all listed in METRIC_NAMES (which the config files are checked against):
    the core's in worker/core/metrics.py, the voice worker's in worker/voice/metrics.py and the stage
    metric where the records emit it."""
    from worker.voice.records import attempt

    literal = re.compile(r'"((?:Jobs?|Reconcile|Stage|Wasted)[A-Za-z]+)"')
    core_names = set(literal.findall(Path(m.__file__).read_text()))
    assert core_names and core_names <= set(m.METRIC_NAMES)
    voice_names = {name for module in (vm, attempt) for name in literal.findall(Path(module.__file__).read_text())}
    assert voice_names and voice_names <= set(vm.VOICE_METRIC_NAMES)
    assert vm.METRIC_NAMES == m.METRIC_NAMES | vm.VOICE_METRIC_NAMES
