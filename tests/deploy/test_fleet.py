"""The rest of issue #29's deployment: which image each task runs, price protection that lets g5 and g6
in, an alarm on each new dead letter, least privilege checked against the calls in the code, each
task's share of a multi-GPU host, and the fleet's dashboard (queue, tasks, spot, GPU)."""

from __future__ import annotations

import inspect
import json
import math
import re

import pytest

from tests.deploy.cfn import ACCOUNT, REGION, Resolver, load_template
from tests.deploy.files import REPO
from tests.deploy.test_ecs_layer import ECS_PARAMS, OPERATOR_ONLY, S3_ACTION, _container, _env, _grants, _statements
from tests.deploy.test_iam import COMMAND_CALLS, _queue_methods_source, _sqs_actions_called
from worker.core.queue import Queue


@pytest.fixture(scope="module")
def stack():
    return Resolver(load_template(), **ECS_PARAMS)


def _image_repository(container) -> str:
    return container["Image"].split("/", 1)[1].rsplit(":", 1)[0]


# ---------------------------------------------------------------- images


def test_worker_tasks_run_the_production_image_and_reconcile_the_slim_one(stack):
    """The worker task runs Dockerfile.trainer's image (the real pipeline); the reconcile task, pulled
    afresh by Fargate every 15 minutes, the slim one from Dockerfile. Both are pullable."""
    worker = _container(stack, "WorkerTaskDefinition")
    reconcile = _container(stack, "ReconcileTaskDefinition")
    assert _image_repository(worker) == stack.params["TrainerImageRepositoryName"] == "voice-worker-trainer"
    assert _image_repository(reconcile) == stack.params["ImageRepositoryName"] == "voice-worker"
    statements = _statements(stack, "ExecutionRole")
    for repo in ("voice-worker-trainer", "voice-worker"):
        assert _grants(statements, "ecr:BatchGetImage", f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/{repo}")
    standalone = json.loads((REPO / "config" / "ecs-task-definition.json").read_text())
    assert "/voice-worker-trainer:" in standalone["containerDefinitions"][0]["image"]
    reconcile_json = json.loads((REPO / "config" / "ecs-reconcile-task-definition.json").read_text())
    assert "/voice-worker:" in reconcile_json["containerDefinitions"][0]["image"]


# ---------------------------------------------------------------- price protection

# On-demand Linux prices, us-east-1, USD an hour (aws.amazon.com/ec2/pricing/on-demand): the default
# GpuInstanceTypes. Price protection compares each with the cheapest of them.
ON_DEMAND_USD = {"g4dn.xlarge": 0.526, "g6.xlarge": 0.8048, "g5.xlarge": 1.006, "g5.2xlarge": 1.212}


def test_price_protection_lets_every_default_type_in_on_demand_and_on_spot(stack):
    """Every default type is within OnDemandMaxPricePercentageOverLowestPrice of the cheapest (EC2's
    default of 20 would leave only g4dn), and the spot threshold is set too."""
    group = stack.resource("GpuAutoScalingGroup")
    (override,) = group["MixedInstancesPolicy"]["LaunchTemplate"]["Overrides"]
    requirements = override["InstanceRequirements"]
    assert set(requirements["AllowedInstanceTypes"]) == set(ON_DEMAND_USD)
    cheapest = min(ON_DEMAND_USD.values())
    above = {t: (p / cheapest - 1) * 100 for t, p in ON_DEMAND_USD.items()}
    assert max(above.values()) > 20  # the point: EC2's default would exclude them
    assert max(above.values()) <= int(requirements["OnDemandMaxPricePercentageOverLowestPrice"])
    assert max(above.values()) <= int(requirements["SpotMaxPricePercentageOverLowestPrice"])


# ---------------------------------------------------------------- new dead letters


def _arrived(expression: str, sent: float | None, depth_before: float | None, depth_now: float | None) -> float:
    """The alarm's expression on one minute: DIFF over the two depth datapoints."""
    fill = lambda v: 0 if v is None else v  # noqa: E731
    python = (expression.replace("DIFF(FILL(depth, 0))", "(_d)").replace("FILL(sent, 0)", "(_s)")
              .replace("IF(", "_if("))
    assert not re.search(r"[A-Z]{2,}\(", python), python
    return eval(python, {"__builtins__": {}},  # noqa: S307 - our own template
                {"_if": lambda c, a, b: a if c else b, "_s": fill(sent), "_d": fill(depth_now) - fill(depth_before)})


@pytest.mark.parametrize("sent,before,now,fires", [
    (1, 0, 1, True),      # the worker dead-lettered a job (SendMessage to the DLQ)
    (0, 0, 1, True),      # the redrive policy moved one (no send, the depth rose)
    (1, 1, 2, True),      # a second while the first is still there: the level alarm stays silent
    (0, 1, 1, False),     # nothing new, one still waiting: not again
    (0, 2, 1, False),     # one redriven or deleted
    (None, None, None, False)])
def test_each_new_dead_letter_fires_whichever_way_it_came(sent, before, now, fires):
    """DeadLettersArrivingAlarm: the DLQ's NumberOfMessagesSent (the worker's own dead-lettering is a
    SendMessage) plus any rise of its depth (redrive-policy moves are not sends), per minute."""
    stack = Resolver(load_template())
    alarm = stack.resource("DeadLettersArrivingAlarm")
    (result,) = [m for m in alarm["Metrics"] if m["ReturnData"]]
    stats = {m["Id"]: m["MetricStat"] for m in alarm["Metrics"] if "MetricStat" in m}
    dlq = stack.resolve({"Fn::GetAtt": ["DeadLetterQueue", "QueueName"]})
    assert {i: (s["Metric"]["MetricName"], s["Metric"]["Dimensions"][0]["Value"], s["Period"])
            for i, s in stats.items()} == {"sent": ("NumberOfMessagesSent", dlq, 60),
                                           "depth": ("ApproximateNumberOfMessagesVisible", dlq, 60)}
    assert (_arrived(result["Expression"], sent, before, now) > alarm["Threshold"]) is fires
    assert alarm["ComparisonOperator"] == "GreaterThanThreshold" and alarm["EvaluationPeriods"] == 1
    assert alarm["TreatMissingData"] == "notBreaching"
    # The level alarm stays beside it.
    assert stack.resource("DeadLetterQueueNotEmptyAlarm")["MetricName"] == "ApproximateNumberOfMessagesVisible"


def test_the_worker_dead_letters_with_a_send_message_to_the_dlq():
    """What the alarm's `sent` counts: Queue.dead_letter sends the body to the DLQ (SendMessage)."""
    assert "Queue(self._sqs, dlq_url).send(" in inspect.getsource(Queue.dead_letter)
    assert "send_message(" in inspect.getsource(Queue.send)


# ---------------------------------------------------------------- least privilege, per queue


def _sqs_calls(paths) -> set[str]:
    actions = set()
    for path in paths:
        for op in re.findall(r"\b_?(?:lease_)?sqs\.([a-z_]+)\(", (REPO / path).read_text()):
            actions.add("sqs:" + "".join(w.title() for w in op.split("_")).removesuffix("Batch"))
    return actions


def _daemon_calls() -> set[str]:
    """IAM actions of every SQS, S3 and CloudWatch call the daemon (and `doctor`, which runs with its
    credentials) makes: the sqs/s3/cloudwatch client calls in worker/ and pipeline/ outside the
    operator commands, and those of the Queue methods they call."""
    files = [p for p in [*REPO.glob("worker/**/*.py"), *REPO.glob("pipeline/**/*.py")]
             if str(p.relative_to(REPO)) != "worker/core/queue.py"
             and (not str(p.relative_to(REPO)).startswith("worker/ops/")
                  or str(p.relative_to(REPO)) == "worker/ops/doctor.py")
             and str(p.relative_to(REPO)) not in OPERATOR_ONLY]
    source = "\n".join(p.read_text() for p in files)
    actions = _sqs_actions_called(source + _queue_methods_source(source))
    for op in re.findall(r"\b_?s3(?:_client)?\.([a-z_0-9]+)\(", source):
        if op != "get_paginator":
            actions.add(S3_ACTION[op])
    actions |= {S3_ACTION[op] for op in re.findall(r"get_paginator\(\"([a-z_0-9]+)\"\)", source)}
    return actions


def test_the_worker_policy_grants_exactly_the_calls_the_daemon_makes():
    """WorkerPolicy's SQS, S3 and CloudWatch actions are the daemon's calls, no more and no fewer: a
    call added to the code, or an action added to the policy, fails here (EVENTS_TARGET's one call is
    conditional, tested with the ECS layer)."""
    stack = Resolver(load_template(), RecordingsBucketName="voice-recordings")
    granted = {a for s in stack.resource("WorkerPolicy")["PolicyDocument"]["Statement"]
               for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert granted == _daemon_calls()


def test_the_worker_never_resolves_the_job_queue_by_name_so_the_policy_does_not_grant_it(stack):
    """GetQueueUrl is called in one place only, Queue.dead_letter_url (the DLQ named by the
    RedrivePolicy): the worker's job-queue statement does not grant it, the DLQ statement does."""
    daemon = [p.relative_to(REPO) for p in [*REPO.glob("worker/**/*.py"), *REPO.glob("pipeline/**/*.py")]
              if "get_queue_url(" in p.read_text()]
    assert [str(p) for p in daemon] == ["worker/core/queue.py"]
    assert "get_queue_url(" in inspect.getsource(Queue.dead_letter_url)
    assert inspect.getsource(Queue).count("get_queue_url(") == 1
    statements = _statements(stack, "WorkerTaskRole")
    queue = stack.resolve({"Fn::GetAtt": ["JobQueue", "Arn"]})
    dlq = stack.resolve({"Fn::GetAtt": ["DeadLetterQueue", "Arn"]})
    assert not _grants(statements, "sqs:GetQueueUrl", queue)
    assert _grants(statements, "sqs:GetQueueUrl", dlq)


def test_the_reconcile_role_grants_exactly_the_calls_reconcile_makes(stack):
    """The reconcile task's role is the (action, queue) pairs of worker/ops/reconcile.py's calls, no
    more: no DeleteMessage or StartMessageMoveTask on the DLQ (those are `dlq redrive`'s)."""
    statements = _statements(stack, "ReconcileTaskRole")
    names = {"arn:aws:sqs:eu-west-1:123456789012:voice-worker-jobs": stack.resolve({"Fn::GetAtt": ["JobQueue", "Arn"]}),
             "arn:aws:sqs:eu-west-1:123456789012:voice-worker-jobs-dlq":
                 stack.resolve({"Fn::GetAtt": ["DeadLetterQueue", "Arn"]})}
    wanted = {(action, names[resource]) for action, resource in COMMAND_CALLS["reconcile"]}
    granted = {(a, r) for s in statements for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
               for r in ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"])}
    assert granted == wanted
    called = _sqs_calls(["worker/ops/reconcile.py"])
    # Reconcile's own module calls through Queue methods; its direct calls, if any, are in the table.
    assert called <= {a for a, _ in wanted}
    dlq = names["arn:aws:sqs:eu-west-1:123456789012:voice-worker-jobs-dlq"]
    for action in ("sqs:DeleteMessage", "sqs:StartMessageMoveTask"):
        assert not _grants(statements, action, dlq)


# ---------------------------------------------------------------- a task's share of the host

# vCPUs, memory (GiB) and NVIDIA GPUs of the default GpuInstanceTypes (aws.amazon.com/ec2/instance-types/g5,
# /g6, /g4), and of the multi-GPU types a wildcard (g5.*) would add.
INSTANCE_TYPES = {"g5.xlarge": (4, 16, 1), "g5.2xlarge": (8, 32, 1), "g6.xlarge": (4, 16, 1),
                  "g4dn.xlarge": (4, 16, 1), "g5.12xlarge": (48, 192, 4), "g6.12xlarge": (48, 192, 4),
                  "g4dn.12xlarge": (48, 192, 4)}
# What ECS registers of an instance's memory is less than its size (the OS, the agent): at most 90 %.
REGISTERED_MEMORY_FRACTION = 0.9


def test_a_task_reserves_its_share_of_cpu_and_memory_per_gpu_and_threads_follow(stack):
    """CPU units: the smallest vCPUs-per-GPU of the allowed types; DATASET_WORKERS, OMP_NUM_THREADS and
    MKL_NUM_THREADS: that share in whole vCPUs (not every CPU of a 4-GPU host); memory: within what ECS
    registers per GPU on the smallest type. The standalone task definition has the same numbers."""
    container = _container(stack, "WorkerTaskDefinition")
    allowed = stack.resource("GpuAutoScalingGroup")["MixedInstancesPolicy"]["LaunchTemplate"][
        "Overrides"][0]["InstanceRequirements"]["AllowedInstanceTypes"]
    share_vcpus = min(INSTANCE_TYPES[t][0] / INSTANCE_TYPES[t][2] for t in allowed)
    share_gib = min(INSTANCE_TYPES[t][1] / INSTANCE_TYPES[t][2] for t in allowed)
    cpu = int(container["Cpu"])
    assert cpu == int(share_vcpus * 1024)
    env = _env(container)
    threads = cpu // 1024
    assert env["DATASET_WORKERS"] == env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(threads)
    assert int(container["MemoryReservation"]) <= share_gib * 1024 * REGISTERED_MEMORY_FRACTION
    # Each multi-GPU type fits one task per GPU with these reservations.
    for t, (vcpus, gib, gpus) in INSTANCE_TYPES.items():
        assert gpus * cpu <= vcpus * 1024 and gpus * int(container["MemoryReservation"]) <= gib * 1024 * 0.9, t
    standalone = json.loads((REPO / "config" / "ecs-task-definition.json").read_text())["containerDefinitions"][0]
    standalone_env = {p["name"]: p["value"] for p in standalone["environment"]}
    assert (standalone["cpu"], standalone["memoryReservation"]) == (cpu, int(container["MemoryReservation"]))
    assert {k: standalone_env[k] for k in ("DATASET_WORKERS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")} == {
        k: env[k] for k in ("DATASET_WORKERS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    assert math.floor(int(stack.params["WorkerCpuUnits"]) / 1024) == int(stack.params["WorkerThreads"])


# ---------------------------------------------------------------- the dashboard and the GPU metrics


def _dashboard_metrics() -> str:
    return json.dumps(json.loads((REPO / "config" / "cloudwatch-dashboard.json").read_text()))


@pytest.mark.parametrize("metric", [
    "ApproximateNumberOfMessagesVisible", "ApproximateNumberOfMessagesNotVisible",
    "ApproximateAgeOfOldestMessage", "DesiredTaskCount", "PendingTaskCount", "RunningTaskCount",
    "SpotInterruptionNotices", "nvidia_smi_utilization_gpu"])
def test_the_dashboard_graphs_queue_tasks_spot_and_gpu(metric):
    """A widget for each: queue depth and age, pending tasks, spot notices, GPU utilisation."""
    assert f'MetricName=\\"{metric}\\"' in _dashboard_metrics()


def test_spot_notices_are_counted_from_the_worker_s_log_line(stack):
    """The metric filter matches the event worker/core/imds.py logs at a notice and feeds the
    dashboard's SpotInterruptionNotices."""
    source = (REPO / "worker" / "core" / "imds.py").read_text()
    (event,) = re.findall(r'log\.warning\("(worker\.spot_interruption)"', source)
    flt = stack.resource("SpotInterruptionNotices")
    assert flt["FilterPattern"] == f'{{ $.event = "{event}" }}'
    (transformation,) = flt["MetricTransformations"]
    assert (transformation["MetricNamespace"], transformation["MetricName"]) == ("VoiceWorker", "SpotInterruptionNotices")
    assert flt["LogGroupName"] == stack.resolve({"Ref": "LogGroup"})


def test_the_cloudwatch_agent_collects_nvidia_smi_on_systemd_and_ecs_hosts(stack):
    """config/amazon-cloudwatch-agent.json collects nvidia_gpu utilisation; the ECS instances' user data
    loads exactly its metrics section, and their role may put CWAgent metrics only."""
    agent = json.loads((REPO / "config" / "amazon-cloudwatch-agent.json").read_text())
    gpu = agent["metrics"]["metrics_collected"]["nvidia_gpu"]
    assert {"utilization_gpu", "utilization_memory", "memory_used"} <= set(gpu["measurement"])
    data = stack.resource("GpuLaunchTemplate")["LaunchTemplateData"]["UserData"]
    start = data.index("cat > /etc/voice-worker-cloudwatch-agent.json <<'EOF'\n") + len(
        "cat > /etc/voice-worker-cloudwatch-agent.json <<'EOF'\n")
    embedded = json.loads(data[start:data.index("\nEOF\n", start)])
    assert embedded == {"metrics": agent["metrics"]}
    statements = [s for p in stack.resource("InstanceRole")["Policies"] for s in p["PolicyDocument"]["Statement"]]
    assert [(s["Action"], s["Condition"]) for s in statements] == [
        ("cloudwatch:PutMetricData", {"StringEquals": {"cloudwatch:namespace": "CWAgent"}})]
