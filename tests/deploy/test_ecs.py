"""The ECS task definition: a valid request, one GPU, secrets kept out of plain env, a stop that fits."""

from __future__ import annotations

import json
import re

import boto3
import pytest
from botocore.validate import validate_parameters

from pipeline.stage_env import BUILTIN_NAMES
from tests.deploy.files import REPO, read_dockerfile, store_connect_worst_s
from worker.settings import ENV_NAMES, load_settings

TASK_DEFINITION = REPO / "config" / "ecs-task-definition.json"
RECONCILE_TASK_DEFINITION = REPO / "config" / "ecs-reconcile-task-definition.json"
ALARMS = REPO / "config" / "cloudwatch-alarms.yaml"
PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")
# Past the grace the worker still stops the trainer, clears the lease and releases the message,
# all before ECS's SIGKILL at stopTimeout.
RELEASE_MARGIN_S = 15
SECRET_SETTINGS = {"MONGO_URI", "SENTRY_DSN"}


def _filled(path):
    """The document with each ${NAME} placeholder replaced by a stand-in value: name-in-lower-case."""
    return json.loads(PLACEHOLDER.sub(lambda m: m.group(1).lower().replace("_", "-"), path.read_text()))


@pytest.fixture(scope="module")
def task():
    return _filled(TASK_DEFINITION)


@pytest.fixture(scope="module")
def container(task):
    (only,) = task["containerDefinitions"]
    return only


def _environment(container) -> dict[str, str]:
    return {pair["name"]: pair["value"] for pair in container["environment"]}


def test_is_a_valid_register_task_definition_request(task):
    """Every field has the name and type ECS's RegisterTaskDefinition API accepts (botocore's model)."""
    ecs = boto3.client("ecs", region_name="us-east-1")
    shape = ecs.meta.service_model.operation_model("RegisterTaskDefinition").input_shape
    validate_parameters(task, shape)


def test_runs_on_ec2_with_one_gpu(task, container):
    """EC2 compatibility (GPUs) and exactly one GPU for the one worker process."""
    assert task["family"] and task["requiresCompatibilities"] == ["EC2"]
    assert container["resourceRequirements"] == [{"type": "GPU", "value": "1"}]
    assert container["essential"] is True


def test_stop_timeout_outlasts_the_shutdown_grace(container):
    """stopTimeout leaves the trainer's SIGTERM -> SIGKILL and the release margin after
    SHUTDOWN_GRACE_SECONDS, and the grace loads."""
    settings = load_settings({"SHUTDOWN_GRACE_SECONDS": _environment(container)["SHUTDOWN_GRACE_SECONDS"]})
    needed_s = settings.shutdown_grace_s + settings.stage_stop_grace_s + RELEASE_MARGIN_S
    assert container["stopTimeout"] >= needed_s
    assert container["stopTimeout"] <= 120  # the most ECS allows


def test_runs_as_the_images_user_with_an_init(container):
    """user is the image's fixed non-root UID, and an init reaps the trainer's orphans."""
    dockerfile_user = next(
        i.args for i in reversed(read_dockerfile(REPO / "Dockerfile")) if i.keyword == "USER"
    )
    assert container["user"] == dockerfile_user.partition(":")[0] == "10001"
    assert container["linuxParameters"]["initProcessEnabled"] is True


def test_health_check_runs_the_health_command(container):
    """The container health check runs python -m worker.core.healthcheck, like the image's HEALTHCHECK,
    with a start period past the store's connect retries."""
    check = container["healthCheck"]
    assert check["command"] == ["CMD", "python", "-m", "worker.core.healthcheck"]
    assert check["timeout"] < check["interval"]
    assert check["startPeriod"] > store_connect_worst_s(load_settings({}))


def test_settings_come_from_env_and_secrets_without_inline_secrets(container):
    """Queue and bucket are plain env, MONGO_URI and SENTRY_DSN come from Secrets Manager or SSM,
    every name is a worker setting, and the plain values together load as valid settings."""
    env = _environment(container)
    secrets = {s["name"]: s["valueFrom"] for s in container["secrets"]}
    assert {"SQS_QUEUE_URL", "S3_BUCKET"} <= set(env)
    assert SECRET_SETTINGS <= set(secrets) and not SECRET_SETTINGS & set(env)
    assert all(re.match(r"arn:aws:(secretsmanager|ssm):", arn) for arn in secrets.values())
    # Beyond the worker's settings: the thread counts the stages inherit (pipeline/stage_env.py).
    assert set(env) | set(secrets) <= set(ENV_NAMES) | set(BUILTIN_NAMES)
    assert not any("://" in v and "@" in v for v in env.values())  # no credentials in a URL
    load_settings({k: v for k, v in env.items() if k in ENV_NAMES})


def test_recordings_bucket_is_set_so_s3_recordings_can_be_read(container):
    """RECORDINGS_S3_BUCKET is set (from the placeholder the IAM policy's Recordings statement uses):
    without it the worker refuses every s3:// recording."""
    raw = json.loads(TASK_DEFINITION.read_text())
    env = {pair["name"]: pair["value"] for pair in raw["containerDefinitions"][0]["environment"]}
    assert env["RECORDINGS_S3_BUCKET"] == "${RECORDINGS_BUCKET}"
    assert "${RECORDINGS_BUCKET}" in (REPO / "config" / "iam-policy.json").read_text()
    assert load_settings(_environment(container)).recordings_s3_bucket == "recordings-bucket"


def test_logs_go_to_cloudwatch(container):
    """The awslogs driver with a group, region and stream prefix."""
    logs = container["logConfiguration"]
    assert logs["logDriver"] == "awslogs"
    assert {"awslogs-group", "awslogs-region", "awslogs-stream-prefix"} <= set(logs["options"])


def test_roles_and_image_are_placeholders_not_real_accounts():
    """Roles and the image are filled from ${...} placeholders, never a real account baked in."""
    raw = json.loads(TASK_DEFINITION.read_text())
    for value in (raw["executionRoleArn"], raw["taskRoleArn"], raw["containerDefinitions"][0]["image"]):
        assert PLACEHOLDER.search(value)
        assert not re.search(r"\d{12}", value)


@pytest.mark.parametrize("path", [TASK_DEFINITION, RECONCILE_TASK_DEFINITION], ids=["worker", "reconcile"])
def test_metrics_dimensions_are_the_alarms_dimension_set(path):
    """METRICS_DIMENSIONS is Environment=${ENVIRONMENT},Queue=${QUEUE_NAME}: the names the alarms match,
    the Queue value the queue SQS_QUEUE_URL names."""
    from cfnlint.decode import cfn_yaml

    (container,) = _filled(path)["containerDefinitions"]
    env = _environment(container)
    dimensions = load_settings({"METRICS_DIMENSIONS": env["METRICS_DIMENSIONS"]}).metrics_dimensions
    assert dimensions == {"Environment": "environment", "Queue": "queue-name"}
    assert env["SQS_QUEUE_URL"].rsplit("/", 1)[1] == dimensions["Queue"]
    alarms = cfn_yaml.loads(ALARMS.read_text(), str(ALARMS))["Resources"].values()
    # The alarms on the worker's own metrics; the metric-math ones read AWS/SQS and ECS metrics.
    worker_alarms = [a for a in alarms if "MetricName" in a["Properties"]]
    assert worker_alarms
    assert all([d["Name"] for d in a["Properties"]["Dimensions"]] == list(dimensions) for a in worker_alarms)


def test_reconcile_task_definition_is_a_cpu_task_running_reconcile():
    """The standalone reconcile task is a valid Fargate request with no GPU, whose command after the
    image's ENTRYPOINT is `python -m worker reconcile`, and whose settings load."""
    task = _filled(RECONCILE_TASK_DEFINITION)
    ecs = boto3.client("ecs", region_name="us-east-1")
    validate_parameters(task, ecs.meta.service_model.operation_model("RegisterTaskDefinition").input_shape)
    (container,) = task["containerDefinitions"]
    entrypoint = next(json.loads(i.args) for i in read_dockerfile(REPO / "Dockerfile") if i.keyword == "ENTRYPOINT")
    assert entrypoint + container["command"] == ["python", "-m", "worker", "reconcile"]
    assert task["requiresCompatibilities"] == ["FARGATE"] and "resourceRequirements" not in container
    assert {s["name"] for s in container["secrets"]} == {"MONGO_URI"}
    load_settings(_environment(container))
