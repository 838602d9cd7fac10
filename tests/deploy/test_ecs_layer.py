"""The template's ECS layer: a GPU fleet on spot that scales on backlog per task down to zero and back,
tasks whose stop fits the worker's grace, roles that grant only what the code calls, and a CPU-only
reconcile task on a schedule; and, without CreateEcsLayer, nothing of it."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex

import pytest
from cfnlint.decode import cfn_yaml

from pipeline.remote_work import FINAL_PUSH_BUDGET_S
from pipeline.stage_env import BUILTIN_NAMES
from tests.deploy.cfn import ACCOUNT, REGION, Resolver, load_template
from tests.deploy.files import REPO, read_dockerfile
from worker.settings import ENV_NAMES, load_settings

MONGO_SECRET = f"arn:aws:secretsmanager:{REGION}:{ACCOUNT}:secret:voice-mongo-AbCdEf"
ECS_PARAMS = {"CreateEcsLayer": "true", "SubnetIds": "subnet-0a1b2c3d,subnet-4e5f6a7b",
              "SecurityGroupIds": "sg-0a1b2c3d", "ImageTag": "1.4.0", "MongoUriSecretArn": MONGO_SECRET}
# What the stack held before the ECS layer existed: an existing stack must update to exactly this.
BASE_RESOURCES = {"JobQueue", "DeadLetterQueue", "QueuesTlsOnly", "DeadLetterQueueNotEmptyAlarm",
                  "DeadLettersArrivingAlarm", "OldestJobAgeAlarm", "ModelBucket", "ModelBucketTlsOnly", "WorkerPolicy", "OperatorPolicy"}
# Past the grace, the stage's SIGTERM -> SIGKILL and the last checkpoint push the worker still
# releases the message (one ChangeMessageVisibility), all before ECS's SIGKILL at stopTimeout; the
# spot notice's budget is tests/deploy/test_stop_budget.py, with the same allowance.
RELEASE_MARGIN_S = 5
ALARMS = REPO / "config" / "cloudwatch-alarms.yaml"
# Modules that run only as operator commands, with OperatorPolicy: not the daemon's calls.
OPERATOR_ONLY = {"worker/voice/submit.py", "worker/ops/reconcile.py", "worker/ops/dlq.py",
                 "worker/ops/demo.py", "worker/ops/devstack.py"}
# The IAM action each S3 operation the code makes needs (multipart parts are s3:PutObject).
S3_ACTION = {"put_object": "s3:PutObject", "create_multipart_upload": "s3:PutObject",
             "upload_part": "s3:PutObject", "complete_multipart_upload": "s3:PutObject",
             "abort_multipart_upload": "s3:AbortMultipartUpload", "head_object": "s3:GetObject",
             "get_object": "s3:GetObject", "delete_object": "s3:DeleteObject",
             "list_objects_v2": "s3:ListBucket",
             # boto3's managed transfers (s3transfer): multipart parts are s3:PutObject too.
             "upload_fileobj": "s3:PutObject", "download_fileobj": "s3:GetObject",
             "delete_objects": "s3:DeleteObject"}


@pytest.fixture(scope="module")
def stack():
    return Resolver(load_template(), **ECS_PARAMS)


def _container(stack, task_definition):
    (only,) = stack.resource(task_definition)["ContainerDefinitions"]
    return only


def _env(container) -> dict[str, str]:
    return {pair["Name"]: pair["Value"] for pair in container["Environment"]}


def _statements(stack, role):
    """Every statement the role grants: its inline policies and its managed policies from the stack."""
    spec = stack.resource(role)
    found = [s for p in spec.get("Policies", []) for s in p["PolicyDocument"]["Statement"]]
    names = {stack.resolve({"Ref": n}): n for n, r in stack.template["Resources"].items()
             if r["Type"] == "AWS::IAM::ManagedPolicy"}
    for arn in spec.get("ManagedPolicyArns", []):
        found += stack.resource(names[arn])["PolicyDocument"]["Statement"]
    return found


def _actions(statement) -> set[str]:
    action = statement["Action"]
    return {action} if isinstance(action, str) else set(action)


def _grants(statements, action, resource) -> bool:
    return any(s["Effect"] == "Allow" and action in _actions(s)
               and any(fnmatch.fnmatchcase(resource, r) for r in
                       ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"]))
               for s in statements)


def _daemon_actions() -> set[str]:
    """IAM actions of every SQS and S3 call in worker/ and pipeline/ outside the operator-only modules."""
    actions = set()
    for path in sorted([*REPO.glob("worker/**/*.py"), *REPO.glob("pipeline/**/*.py")]):
        if str(path.relative_to(REPO)) in OPERATOR_ONLY:
            continue
        source = path.read_text()
        for op in re.findall(r"\b_?(?:lease_)?sqs\.([a-z_]+)\(", source):
            actions.add("sqs:" + "".join(w.title() for w in op.split("_")).removesuffix("Batch"))
        for op in re.findall(r"\b_?s3(?:_client)?\.([a-z_0-9]+)\(", source):
            if op != "get_paginator":
                actions.add(S3_ACTION[op])
        actions |= {S3_ACTION[op] for op in re.findall(r"get_paginator\(\"([a-z_0-9]+)\"\)", source)}
    return actions


# ---------------------------------------------------------------- off by default


def test_without_the_ecs_layer_the_stack_is_what_it_was():
    """With CreateEcsLayer left at its default the stack creates only the queues, alarms, bucket and
    policies, and every new output is conditional; with it, every resource exists."""
    off = Resolver(load_template())
    assert {n for n in off.template["Resources"] if off.exists(n)} == BASE_RESOURCES
    for name, output in off.template["Outputs"].items():
        if name in ("ClusterName", "WorkerServiceName", "LogGroupName"):
            assert not off.condition(output["Condition"])
    on = Resolver(load_template(), **ECS_PARAMS)
    assert all(on.exists(n) for n in on.template["Resources"])


def test_the_ecs_layer_refuses_to_deploy_without_its_inputs():
    """The template's rule asserts subnets, security groups, an image tag and the Mongo secret when the
    layer is on, and only then."""
    rule = load_template()["Rules"]["EcsLayerInputs"]
    assert rule["RuleCondition"] == {"Fn::Equals": [{"Ref": "CreateEcsLayer"}, "true"]}
    asserted = json.dumps(rule["Assertions"])
    for name in ("SubnetIds", "SecurityGroupIds", "ImageTag", "MongoUriSecretArn"):
        assert f'{{"Ref": "{name}"}}' in asserted, name


# ---------------------------------------------------------------- the fleet


def test_instances_boot_the_ecs_gpu_ami_and_drain_on_a_spot_notice(stack):
    """The launch template takes the GPU-optimized AMI from its SSM parameter, requires IMDSv2, and its
    user data joins the cluster with spot instance draining on."""
    param = load_template()["Parameters"]["GpuAmiId"]
    assert param["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
    assert param["Default"] == "/aws/service/ecs/optimized-ami/amazon-linux-2023/gpu/recommended/image_id"
    data = stack.resource("GpuLaunchTemplate")["LaunchTemplateData"]
    assert load_template()["Resources"]["GpuLaunchTemplate"]["Properties"]["LaunchTemplateData"][
        "ImageId"] == {"Ref": "GpuAmiId"}
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    # No container reads the instance role: the token's answer dies at the bridge's hop.
    assert data["MetadataOptions"]["HttpPutResponseHopLimit"] == 1
    config = dict(line.split("=", 1) for line in data["UserData"].splitlines() if line.startswith("ECS_"))
    assert config["ECS_CLUSTER"] == stack.resolve({"Ref": "Cluster"})
    assert config["ECS_ENABLE_SPOT_INSTANCE_DRAINING"] == "true"


def test_fleet_is_on_demand_base_then_capacity_optimized_spot_over_the_allowed_gpu_types():
    """The group puts the on-demand base first, spot above it (capacity-optimized), over exactly the
    GpuInstanceTypes parameter's NVIDIA GPU types, from zero instances up."""
    stack = Resolver(load_template(), **ECS_PARAMS, GpuInstanceTypes="g5.xlarge,g6.*",
                     OnDemandBaseCapacity="1")
    group = stack.resource("GpuAutoScalingGroup")
    distribution = group["MixedInstancesPolicy"]["InstancesDistribution"]
    assert distribution["SpotAllocationStrategy"] == "capacity-optimized"
    assert distribution["OnDemandBaseCapacity"] == "1"
    assert distribution["OnDemandPercentageAboveBaseCapacity"] == "0"  # the default: all spot above
    (override,) = group["MixedInstancesPolicy"]["LaunchTemplate"]["Overrides"]
    requirements = override["InstanceRequirements"]
    assert requirements["AllowedInstanceTypes"] == ["g5.xlarge", "g6.*"]
    assert requirements["AcceleratorTypes"] == ["gpu"] and requirements["AcceleratorCount"]["Min"] >= 1
    assert group["MinSize"] == "0" and "DesiredCapacity" not in group  # ECS's managed scaling owns it
    assert group["NewInstancesProtectedFromScaleIn"] is True


def test_capacity_provider_manages_scaling_and_termination_protection(stack):
    """Managed scaling, managed termination protection and managed draining on the group, and the
    service runs on that capacity provider."""
    provider = stack.resource("GpuCapacityProvider")["AutoScalingGroupProvider"]
    assert provider["ManagedScaling"]["Status"] == "ENABLED"
    assert provider["ManagedTerminationProtection"] == "ENABLED"
    assert provider["ManagedDraining"] == "ENABLED"
    (strategy,) = stack.resource("WorkerService")["CapacityProviderStrategy"]
    assert strategy["CapacityProvider"] == stack.resolve({"Ref": "GpuCapacityProvider"})


# ---------------------------------------------------------------- the worker service


def test_each_worker_task_takes_one_gpu_and_runs_the_daemon(stack):
    """One GPU per task, the image's run command, EC2 (GPUs), non-root with an init."""
    task = stack.resource("WorkerTaskDefinition")
    container = _container(stack, "WorkerTaskDefinition")
    assert task["RequiresCompatibilities"] == ["EC2"]
    assert container["ResourceRequirements"] == [{"Type": "GPU", "Value": "1"}]
    assert container["Command"] == ["run"] and container["User"] == "10001"
    assert container["LinuxParameters"]["InitProcessEnabled"] is True


@pytest.mark.parametrize("grace", ["0", "60", "82"])
def test_stop_timeout_outlasts_the_grace_the_stage_stop_and_the_release(grace):
    """For any allowed ShutdownGraceSeconds, stopTimeout covers the grace, the trainer's SIGTERM ->
    SIGKILL, the last checkpoint push and the release, within ECS's 120 s (the spot notice's own
    budget is tests/deploy/test_stop_budget.py)."""
    stack = Resolver(load_template(), **ECS_PARAMS, ShutdownGraceSeconds=grace)
    container = _container(stack, "WorkerTaskDefinition")
    settings = load_settings({"SHUTDOWN_GRACE_SECONDS": _env(container)["SHUTDOWN_GRACE_SECONDS"]})
    assert settings.shutdown_grace_s == float(grace)
    needed_s = settings.shutdown_grace_s + settings.stage_stop_grace_s + FINAL_PUSH_BUDGET_S + RELEASE_MARGIN_S
    assert needed_s <= container["StopTimeout"] <= 120


def test_worker_settings_are_the_stacks_and_load(stack):
    """The worker's environment names only settings, points at this stack's queue and bucket, takes
    MONGO_URI from the secret, and loads as valid daemon settings."""
    container = _container(stack, "WorkerTaskDefinition")
    env = _env(container)
    assert set(env) <= set(ENV_NAMES) | set(BUILTIN_NAMES)
    assert env["SQS_QUEUE_URL"] == stack.resolve({"Ref": "JobQueue"})
    assert env["S3_BUCKET"] == stack.resolve({"Ref": "ModelBucket"})
    assert container["Secrets"] == [{"Name": "MONGO_URI", "ValueFrom": MONGO_SECRET}]
    load_settings({**{k: v for k, v in env.items() if k in ENV_NAMES}, "MONGO_URI": "mongodb://db/voice"})


def test_deployments_and_stack_updates_do_not_stop_running_jobs_needlessly(stack):
    """New tasks start before old ones stop, a failing release rolls back, no AZ rebalancing stops tasks,
    and the service has no DesiredCount for a stack update to reset."""
    service = stack.resource("WorkerService")
    deployment = service["DeploymentConfiguration"]
    assert deployment["MinimumHealthyPercent"] == 100 and deployment["MaximumPercent"] > 100
    assert deployment["DeploymentCircuitBreaker"] == {"Enable": True, "Rollback": True}
    assert service["AvailabilityZoneRebalancing"] == "DISABLED"
    assert "DesiredCount" not in service


def test_logs_go_to_one_group_kept_for_the_retention_parameter():
    """The log group keeps lines LogRetentionDays, and both tasks' awslogs drivers write to it."""
    stack = Resolver(load_template(), **ECS_PARAMS, LogRetentionDays="90")
    group = stack.resource("LogGroup")
    assert group["RetentionInDays"] == "90"
    for task in ("WorkerTaskDefinition", "ReconcileTaskDefinition"):
        logs = _container(stack, task)["LogConfiguration"]
        assert logs["LogDriver"] == "awslogs"
        assert logs["Options"]["awslogs-group"] == group["LogGroupName"]


# ---------------------------------------------------------------- metrics dimensions


@pytest.mark.parametrize("params", [{}, {"Environment": "staging", "NamePrefix": "vw"}])
def test_tasks_publish_the_dimension_set_the_alarms_match(params):
    """Both tasks' METRICS_DIMENSIONS parse to exactly the alarms' dimensions (Environment, Queue), with
    the values config/cloudwatch-alarms.yaml is deployed with for this stack."""
    stack = Resolver(load_template(), **ECS_PARAMS, **params)
    queue_name = stack.resolve({"Fn::GetAtt": ["JobQueue", "QueueName"]})
    alarms_template = cfn_yaml.loads(ALARMS.read_text(), str(ALARMS))
    alarms = Resolver(alarms_template, Environment=params.get("Environment", "production"),
                      QueueName=queue_name)
    expected = {}
    # The alarms on the worker's own metrics; the metric-math ones read AWS/SQS and ECS metrics.
    for spec in (a for a in alarms_template["Resources"].values() if "MetricName" in a["Properties"]):
        expected = {d["Name"]: d["Value"] for d in alarms.resolve(spec["Properties"]["Dimensions"])}
        assert list(expected) == ["Environment", "Queue"]
    for task in ("WorkerTaskDefinition", "ReconcileTaskDefinition"):
        value = _env(_container(stack, task))["METRICS_DIMENSIONS"]
        assert load_settings({"METRICS_DIMENSIONS": value}).metrics_dimensions == expected


# ---------------------------------------------------------------- roles


# The one call made on the worker's behalf: the ECS agent sets task protection with the task role's
# credentials when worker/core/ecs_agent.py asks it to.
AGENT_ACTIONS = {"ecs:UpdateTaskProtection"}


def test_worker_task_role_grants_only_calls_the_daemon_makes(stack):
    """The task role is WorkerPolicy plus the agent's task protection, and each action it grants is one
    the daemon's code calls (or has the agent call): nothing on the DLQ beyond dead-lettering."""
    assert stack.resource("WorkerTaskRole")["ManagedPolicyArns"] == [stack.resolve({"Ref": "WorkerPolicy"})]
    statements = _statements(stack, "WorkerTaskRole")
    granted = set().union(*(_actions(s) for s in statements))
    assert granted <= _daemon_actions() | AGENT_ACTIONS, granted - _daemon_actions() - AGENT_ACTIONS
    assert "ecs:UpdateTaskProtection" in granted
    assert _grants(statements, "ecs:UpdateTaskProtection", f"arn:aws:ecs:{REGION}:{ACCOUNT}:task/voice-worker/abc")
    assert not _grants(statements, "ecs:UpdateTaskProtection", f"arn:aws:ecs:{REGION}:{ACCOUNT}:task/other/abc")
    dlq = stack.resolve({"Fn::GetAtt": ["DeadLetterQueue", "Arn"]})
    for action in ("sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility"):
        assert not _grants(statements, action, dlq), action
    assert _grants(statements, "sqs:SendMessage", dlq)


@pytest.mark.parametrize("target,action,other", [
    ("arn:aws:sns:eu-west-1:123456789012:voice-jobs", "sns:Publish", "events:PutEvents"),
    ("arn:aws:events:eu-west-1:123456789012:event-bus/voice", "events:PutEvents", "sns:Publish")])
def test_job_events_grant_the_one_call_on_the_one_target_and_reach_the_task(target, action, other):
    """With JobEventsTarget the task gets EVENTS_TARGET and its role that target's one call, on it alone;
    without it, neither."""
    with_events = Resolver(load_template(), **ECS_PARAMS, JobEventsTarget=target)
    statements = _statements(with_events, "WorkerTaskRole")
    assert _grants(statements, action, target) and not _grants(statements, action, target + "-other")
    assert not any(other in _actions(s) for s in statements)
    assert _env(_container(with_events, "WorkerTaskDefinition"))["EVENTS_TARGET"] == target
    plain = Resolver(load_template(), **ECS_PARAMS)
    assert not any(a in _actions(s) for s in _statements(plain, "WorkerTaskRole") for a in (action, other))
    assert "EVENTS_TARGET" not in _env(_container(plain, "WorkerTaskDefinition"))


def test_execution_role_pulls_the_image_writes_the_logs_and_reads_the_secret_only(stack):
    """The execution role's actions are the image pull, the log stream writes and the one secret."""
    statements = _statements(stack, "ExecutionRole")
    granted = set().union(*(_actions(s) for s in statements))
    assert granted == {"ecr:GetAuthorizationToken", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer",
                       "logs:CreateLogStream", "logs:PutLogEvents", "secretsmanager:GetSecretValue"}
    assert _grants(statements, "secretsmanager:GetSecretValue", MONGO_SECRET)
    assert not _grants(statements, "secretsmanager:GetSecretValue", MONGO_SECRET.replace("mongo", "other"))
    repo = f"arn:aws:ecr:{REGION}:{ACCOUNT}:repository/voice-worker"
    assert _grants(statements, "ecr:BatchGetImage", repo)
    assert not _grants(statements, "ecr:BatchGetImage", repo + "-other")


# ---------------------------------------------------------------- reconcile


def test_reconcile_task_runs_the_reconcile_command_on_fargate_without_a_gpu(stack):
    """The image's entrypoint plus the task's command is `python -m worker reconcile`, on Fargate, with
    no GPU."""
    entrypoint = next(json.loads(i.args) for i in read_dockerfile(REPO / "Dockerfile")
                      if i.keyword == "ENTRYPOINT")
    container = _container(stack, "ReconcileTaskDefinition")
    assert container["Command"] == ["reconcile"]
    assert shlex.join(entrypoint + container["Command"]) == "python -m worker reconcile"
    assert "ResourceRequirements" not in container
    task = stack.resource("ReconcileTaskDefinition")
    assert task["RequiresCompatibilities"] == ["FARGATE"] and task["NetworkMode"] == "awsvpc"


def test_reconcile_role_is_the_operator_policy_so_it_may_re_enqueue(stack):
    """The reconcile task's role holds OperatorPolicy: SendMessage on the job queue for the re-enqueue,
    and the DLQ reads of the dead-letter rule."""
    role = stack.resource("ReconcileTaskRole")
    assert "ManagedPolicyArns" not in role  # not OperatorPolicy: no redrive, no delete on the DLQ
    statements = _statements(stack, "ReconcileTaskRole")
    assert _grants(statements, "sqs:SendMessage", stack.resolve({"Fn::GetAtt": ["JobQueue", "Arn"]}))
    dlq = stack.resolve({"Fn::GetAtt": ["DeadLetterQueue", "Arn"]})
    assert _grants(statements, "sqs:ReceiveMessage", dlq)


def test_schedule_runs_the_reconcile_task_every_15_minutes_with_a_role_for_only_that(stack):
    """EventBridge Scheduler runs the reconcile task definition on Fargate in the cluster every 15
    minutes; its role may run that task and pass its two roles, nothing else."""
    schedule = stack.resource("ReconcileSchedule")
    assert schedule["ScheduleExpression"] == "rate(15 minutes)" and schedule["State"] == "ENABLED"
    target = schedule["Target"]
    assert target["Arn"] == stack.resolve({"Fn::GetAtt": ["Cluster", "Arn"]})
    ecs = target["EcsParameters"]
    reconcile_arn = stack.resolve({"Ref": "ReconcileTaskDefinition"})
    assert ecs["TaskDefinitionArn"] == reconcile_arn and ecs["LaunchType"] == "FARGATE"
    assert ecs["NetworkConfiguration"]["AwsvpcConfiguration"]["Subnets"] == ["subnet-0a1b2c3d", "subnet-4e5f6a7b"]
    assert target["RoleArn"] == stack.resolve({"Fn::GetAtt": ["SchedulerRole", "Arn"]})
    statements = _statements(stack, "SchedulerRole")
    assert set().union(*(_actions(s) for s in statements)) == {"ecs:RunTask", "iam:PassRole"}
    assert _grants(statements, "ecs:RunTask", reconcile_arn)
    assert not _grants(statements, "ecs:RunTask", stack.resolve({"Ref": "WorkerTaskDefinition"}))
    arn = {name: stack.resolve({"Fn::GetAtt": [name, "Arn"]})
           for name in ("ExecutionRole", "ReconcileTaskRole", "WorkerTaskRole")}
    assert _grants(statements, "iam:PassRole", arn["ExecutionRole"])
    assert _grants(statements, "iam:PassRole", arn["ReconcileTaskRole"])
    assert not _grants(statements, "iam:PassRole", arn["WorkerTaskRole"])
