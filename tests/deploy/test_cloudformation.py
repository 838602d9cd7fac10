"""The CloudFormation template: lint-clean, and the queue, DLQ, alarms and bucket the worker relies on."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.deploy.cfn import TEMPLATE_PATH, Resolver, load_template
from tests.deploy.files import VENV_BIN
from worker.settings import FIELD_OF_ENV, load_settings


@pytest.fixture(scope="module")
def stack():
    return Resolver(load_template(), AlarmTopicArn="arn:aws:sns:eu-west-1:123456789012:ops")


def _resources_of_type(stack, kind):
    """The resources of that type the stack creates (a false Condition creates none)."""
    return {
        name: stack.resource(name)
        for name, spec in stack.template["Resources"].items()
        if spec["Type"] == kind and stack.exists(name)
    }


def test_cfn_lint_reports_nothing():
    """cfn-lint exits 0 and prints nothing: no error, warning or informational finding."""
    result = subprocess.run(
        [str(VENV_BIN / "cfn-lint"), "--include-checks", "I", "--", str(TEMPLATE_PATH)],
        capture_output=True, text=True, timeout=120,
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_job_queue_matches_the_worker_defaults(stack):
    """Visibility 300 s and a 20 s long poll, the worker's own defaults; 4-day retention; SSE on."""
    defaults = load_settings({})
    queue = stack.resource("JobQueue")
    assert queue["VisibilityTimeout"] == defaults.sqs_visibility_timeout_s == 300
    assert queue["ReceiveMessageWaitTimeSeconds"] == defaults.sqs_wait_time_s == 20
    assert queue["MessageRetentionPeriod"] == 4 * 24 * 3600
    assert queue["SqsManagedSseEnabled"] is True


def test_redrive_sends_to_the_dlq_after_twenty_receives(stack):
    """The job queue's RedrivePolicy targets the DLQ with maxReceiveCount 20, a backstop well above
    the worker's own MAX_FAILED_ATTEMPTS default."""
    redrive = stack.resource("JobQueue")["RedrivePolicy"]
    assert redrive["maxReceiveCount"] == 20
    assert redrive["maxReceiveCount"] > FIELD_OF_ENV["MAX_FAILED_ATTEMPTS"].default
    assert redrive["deadLetterTargetArn"] == stack.resolve({"Fn::GetAtt": ["DeadLetterQueue", "Arn"]})


def test_dlq_keeps_messages_longer_than_the_queue_and_allows_only_it(stack):
    """DLQ retention is 14 days (above the source's), SSE on, and only the job queue may redrive to it."""
    dlq, queue = stack.resource("DeadLetterQueue"), stack.resource("JobQueue")
    assert dlq["MessageRetentionPeriod"] == 1_209_600 > queue["MessageRetentionPeriod"]
    assert dlq["SqsManagedSseEnabled"] is True
    allow = dlq["RedriveAllowPolicy"]
    assert allow["redrivePermission"] == "byQueue"
    assert allow["sourceQueueArns"] == [stack.resolve({"Fn::GetAtt": ["JobQueue", "Arn"]})]


def test_alarms_watch_the_dlq_and_the_oldest_job(stack):
    """One alarm fires on any visible DLQ message, one on the job queue's oldest-message age."""
    alarms = {
        (a["MetricName"], a["Dimensions"][0]["Value"]): a
        for a in _resources_of_type(stack, "AWS::CloudWatch::Alarm").values() if "MetricName" in a
    }
    dlq_name = stack.resolve({"Fn::GetAtt": ["DeadLetterQueue", "QueueName"]})
    queue_name = stack.resolve({"Fn::GetAtt": ["JobQueue", "QueueName"]})
    dlq = alarms[("ApproximateNumberOfMessagesVisible", dlq_name)]
    assert (dlq["Threshold"], dlq["ComparisonOperator"]) == (0, "GreaterThanThreshold")
    age = alarms[("ApproximateAgeOfOldestMessage", queue_name)]
    assert age["ComparisonOperator"] == "GreaterThanThreshold"
    assert int(age["Threshold"]) > load_settings({}).job_time_limit_s  # a long job is not an alarm
    for alarm in (dlq, age):
        assert alarm["Namespace"] == "AWS/SQS"
        assert alarm["AlarmActions"] == ["arn:aws:sns:eu-west-1:123456789012:ops"]


def test_alarms_have_no_actions_without_a_topic():
    """With AlarmTopicArn left empty the alarms carry no actions instead of an empty ARN."""
    stack = Resolver(load_template())
    for alarm in _resources_of_type(stack, "AWS::CloudWatch::Alarm").values():
        assert "AlarmActions" not in alarm and "OKActions" not in alarm


def test_model_bucket_is_encrypted_versioned_private_and_tls_only(stack):
    """SSE, versioning, every public-access block, and a bucket policy denying plain HTTP."""
    bucket = stack.resource("ModelBucket")
    rule = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] in ("AES256", "aws:kms")
    assert bucket["VersioningConfiguration"]["Status"] == "Enabled"
    assert all(bucket["PublicAccessBlockConfiguration"].values())
    assert len(bucket["PublicAccessBlockConfiguration"]) == 4
    (policy,) = _resources_of_type(stack, "AWS::S3::BucketPolicy").values()
    (deny,) = policy["PolicyDocument"]["Statement"]
    assert deny["Effect"] == "Deny"
    assert deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    arn = stack.resolve({"Fn::GetAtt": ["ModelBucket", "Arn"]})
    assert sorted(deny["Resource"]) == [arn, arn + "/*"]


def test_outputs_name_what_the_worker_is_configured_with(stack):
    """Outputs give the queue URL, DLQ URL, bucket and the worker's and operators' policy ARNs."""
    outputs = {name: stack.resolve(o["Value"]) for name, o in stack.template["Outputs"].items()}
    assert outputs["QueueUrl"].endswith("/voice-worker-jobs")
    assert outputs["DeadLetterQueueUrl"].endswith("/voice-worker-jobs-dlq")
    assert outputs["ModelBucketName"] == stack.resolve({"Ref": "ModelBucket"})
    assert outputs["WorkerPolicyArn"].startswith("arn:aws:iam::")
    assert outputs["OperatorPolicyArn"] == stack.resolve({"Ref": "OperatorPolicy"})
    assert outputs["OperatorPolicyArn"].startswith("arn:aws:iam::")
    json.dumps(outputs)  # every output resolved to plain values
