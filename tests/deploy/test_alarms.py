"""config/cloudwatch-alarms.yaml beyond the worker's own metrics: no worker alive from the queue's
metrics, backlog per ECS task from the scaling metric, OK notifications wherever an alarm notifies,
and the template's oldest-message threshold against the job's time limit and retry backoff."""

from __future__ import annotations

import pytest
from cfnlint.decode import cfn_yaml

from tests.deploy.cfn import Resolver, load_template
from tests.deploy.files import REPO
from worker.settings import load_settings

ALARMS = REPO / "config" / "cloudwatch-alarms.yaml"
TOPIC = "arn:aws:sns:eu-west-1:123456789012:ops"


def _alarms_template() -> dict:
    return cfn_yaml.loads(ALARMS.read_text(), str(ALARMS))


def _alarms(**params) -> dict[str, dict]:
    """The alarms the stack creates for these parameters, resolved."""
    stack = Resolver(_alarms_template(), **params)
    return {name: stack.resource(name) for name, spec in stack.template["Resources"].items()
            if spec["Type"] == "AWS::CloudWatch::Alarm" and stack.exists(name)}


def _metric_math(expression: str, **values):
    """Evaluate a CloudWatch metric-math expression on one datapoint per id (None: no datapoint)."""
    python = expression.replace(" AND ", " and ").replace("IF(", "_if(").replace("FILL(", "_fill(")
    helpers = {"_if": lambda c, a, b: a if c else b, "_fill": lambda v, d: d if v is None else v}
    return eval(python, {"__builtins__": {}}, {**helpers, **values})  # noqa: S307 - our own template


def _queries(alarm: dict) -> dict[str, dict]:
    return {query["Id"]: query for query in alarm["Metrics"]}


def _expression(alarm: dict) -> str:
    (returned,) = [q for q in alarm["Metrics"] if q["ReturnData"]]
    return returned["Expression"]


def test_every_alarm_that_notifies_also_notifies_when_it_clears():
    """With a topic, each alarm's OKActions are its AlarmActions; without one, neither is set."""
    with_topic = _alarms(AlarmTopicArn=TOPIC, EcsServiceName="voice-worker-worker")
    assert len(with_topic) == len(_alarms_template()["Resources"])
    for name, alarm in with_topic.items():
        assert alarm["AlarmActions"] == [TOPIC], name
        assert alarm["OKActions"] == alarm["AlarmActions"], name
    for name, alarm in _alarms(EcsServiceName="voice-worker-worker").items():
        assert "AlarmActions" not in alarm and "OKActions" not in alarm, name


@pytest.mark.parametrize("visible, received, inflight, fires", [
    (3, 0, 0, True),       # jobs wait, nobody polls, nobody works: no worker alive
    (3, None, None, True),  # no receive and no in-flight datapoint count as zero
    (3, 0, 2, False),      # every worker busy on a long job: their messages are in flight
    (3, 4, 0, False),      # workers are receiving
    (0, 0, 0, False),      # nothing to do (also a service scaled to zero)
])
def test_no_worker_alive_fires_only_when_jobs_wait_with_nobody_receiving_or_working(
        visible, received, inflight, fires):
    """The alarm's expression is 1 exactly when jobs waited the whole period with no receive and none in flight."""
    alarm = _alarms()["NoWorkerAliveAlarm"]
    value = _metric_math(_expression(alarm), visible=visible, received=received, inflight=inflight)
    assert (value >= alarm["Threshold"]) is fires
    assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"


def test_no_worker_alive_reads_the_job_queue_over_a_window_a_dead_workers_message_returns_in():
    """visible is the period's Minimum (waiting all along), on the job queue; the window outlasts the
    visibility timeout, so a message whose worker died is visible again inside it."""
    params = {"QueueName": "vw-jobs"}
    queries = _queries(_alarms(**params)["NoWorkerAliveAlarm"])
    stats = {qid: queries[qid]["MetricStat"] for qid in ("visible", "received", "inflight")}
    assert {qid: s["Stat"] for qid, s in stats.items()} == {"visible": "Minimum", "received": "Sum",
                                                           "inflight": "Maximum"}
    for stat in stats.values():
        assert stat["Metric"]["Namespace"] == "AWS/SQS"
        assert stat["Metric"]["Dimensions"] == [{"Name": "QueueName", "Value": "vw-jobs"}]
    window_s = int(stats["visible"]["Period"])
    assert window_s % 60 == 0
    assert window_s > 3 * load_settings({}).sqs_visibility_timeout_s


def test_backlog_per_task_alarm_exists_only_with_an_ecs_service():
    """Without EcsServiceName (systemd hosts) there is no backlog-per-task alarm."""
    assert "BacklogPerTaskAlarm" not in _alarms()
    assert "BacklogPerTaskAlarm" in _alarms(EcsServiceName="voice-worker-worker")


def test_backlog_per_task_alarm_is_the_scaling_metric_above_its_target():
    """The alarm computes the ECS layer's scaling metric (same expression and metrics, for the stack's
    cluster and service) and fires well above the scaling target, for 30 minutes."""
    stack = Resolver(load_template(), CreateEcsLayer="true")
    scaling = stack.template["Resources"]["WorkersWantedAlarm"]["Properties"]
    scaling_queries = {q["Id"]: q for q in stack.resolve(scaling["Metrics"])}
    outputs = {name: stack.resolve(o["Value"]) for name, o in stack.template["Outputs"].items()}
    alarm = _alarms(EcsClusterName=outputs["ClusterName"], EcsServiceName=outputs["WorkerServiceName"],
                    QueueName=outputs["QueueUrl"].rsplit("/", 1)[1])["BacklogPerTaskAlarm"]
    queries = _queries(alarm)
    # The scaling alarms' jobs (waiting + in flight) per running task: desired tasks that do not run
    # (no capacity, MaxInstances) show here, not in the scaling metric, which counts them as asked for.
    assert _expression(alarm) == "(visible + inflight) / running"
    for qid in ("visible", "inflight"):
        expected = scaling_queries[qid]["MetricStat"]
        assert queries[qid]["MetricStat"]["Metric"] == expected["Metric"], qid
        assert queries[qid]["MetricStat"]["Stat"] == expected["Stat"], qid
    running = queries["running"]["MetricStat"]["Metric"]
    assert running["MetricName"] == "RunningTaskCount"
    assert running["Dimensions"] == scaling_queries["desired"]["MetricStat"]["Metric"]["Dimensions"]
    target = float(stack.params["BacklogPerTaskTarget"])
    assert float(alarm["Threshold"]) > target
    assert alarm["ComparisonOperator"] == "GreaterThanThreshold"
    assert alarm["EvaluationPeriods"] * queries["running"]["MetricStat"]["Period"] == 1800
    assert alarm["TreatMissingData"] == "notBreaching"  # no running task: the no-worker alarm's case


def test_oldest_message_threshold_outlasts_one_attempt_at_its_time_limit_and_its_retry():
    """The template's OldestMessageAgeThresholdSeconds default is at least one attempt that ran to
    JOB_TIME_LIMIT_SECONDS, its lease lapsing and the longest retry backoff: a message's age keeps
    growing across attempts (a retry changes its visibility, it is not sent again)."""
    settings = load_settings({})
    one_attempt_s = settings.job_time_limit_s + settings.sqs_visibility_timeout_s + settings.sqs_retry_visibility_max_s
    default_s = int(load_template()["Parameters"]["OldestMessageAgeThresholdSeconds"]["Default"])
    assert default_s >= one_attempt_s


def test_one_protection_clear_that_never_held_fires_its_alarm():
    """TaskProtectionClearFailuresAlarm watches the metric the ECS agent client counts, with the worker's
    dimensions, and fires on a single failed clear in 5 minutes; no data (a systemd host) is not an alarm."""
    from worker.core.metrics import PROTECTION_CLEAR_FAILURES

    alarm = _alarms()["TaskProtectionClearFailuresAlarm"]
    assert alarm["MetricName"] == PROTECTION_CLEAR_FAILURES
    assert [d["Name"] for d in alarm["Dimensions"]] == ["Environment", "Queue"]
    assert (alarm["Statistic"], int(alarm["Period"]), int(alarm["EvaluationPeriods"])) == ("Sum", 300, 1)
    assert (float(alarm["Threshold"]), alarm["ComparisonOperator"]) == (0.0, "GreaterThanThreshold")
    assert alarm["TreatMissingData"] == "notBreaching"
