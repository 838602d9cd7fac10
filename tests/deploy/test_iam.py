"""The worker's IAM policy: exactly the actions it uses, scoped to its queues and prefix, the same in
the CloudFormation template and the standalone JSON document."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.cfn import ACCOUNT, MODEL_BUCKET, REGION, Resolver, load_template
from tests.deploy.files import REPO

POLICY_JSON = REPO / "config" / "iam-policy.json"
PARAMS = {"ModelPrefix": "models/v1", "RecordingsBucketName": "voice-recordings",
          "RecordingsPrefix": "rec/"}
ALLOWED = {
    "JobQueue": {"sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility",
                 "sqs:GetQueueAttributes", "sqs:GetQueueUrl"},
    "DeadLetterQueue": {"sqs:SendMessage", "sqs:GetQueueUrl", "sqs:GetQueueAttributes",
                        "sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility"},
    "ModelObjects": {"s3:PutObject", "s3:GetObject", "s3:AbortMultipartUpload",
                     "s3:ListMultipartUploadParts"},
    "DoctorProbe": {"s3:DeleteObject"},
    "ModelListing": {"s3:ListBucket"},
    "Recordings": {"s3:GetObject"},
}
RESOURCES = {
    "JobQueue": f"arn:aws:sqs:{REGION}:{ACCOUNT}:voice-worker-jobs",
    "DeadLetterQueue": f"arn:aws:sqs:{REGION}:{ACCOUNT}:voice-worker-jobs-dlq",
    "ModelObjects": f"arn:aws:s3:::{MODEL_BUCKET}/models/v1/*",
    "DoctorProbe": f"arn:aws:s3:::{MODEL_BUCKET}/models/v1/.doctor/*",
    "ModelListing": f"arn:aws:s3:::{MODEL_BUCKET}",
    "Recordings": "arn:aws:s3:::voice-recordings/rec/*",
}


def _cfn_statements(**params):
    stack = Resolver(load_template(), **params)
    return stack.resource("WorkerPolicy")["PolicyDocument"]["Statement"]


def _json_statements():
    values = {"AWS_REGION": REGION, "ACCOUNT_ID": ACCOUNT, "QUEUE_NAME": "voice-worker-jobs",
              "DLQ_NAME": "voice-worker-jobs-dlq", "MODEL_BUCKET": MODEL_BUCKET,
              "MODEL_PREFIX": "models/v1", "RECORDINGS_BUCKET": "voice-recordings",
              "RECORDINGS_PREFIX": "rec/"}
    text = re.sub(r"\$\{([A-Z_]+)\}", lambda m: values[m.group(1)], POLICY_JSON.read_text())
    return json.loads(text)["Statement"]


def _actions(statement) -> set[str]:
    action = statement["Action"]
    return {action} if isinstance(action, str) else set(action)


@pytest.fixture(params=["cloudformation", "json"])
def statements(request):
    return _cfn_statements(**PARAMS) if request.param == "cloudformation" else _json_statements()


def test_each_statement_allows_exactly_the_listed_actions(statements):
    """Every statement is an Allow whose actions are exactly the allowed set for its Sid."""
    assert {s["Sid"]: _actions(s) for s in statements} == ALLOWED
    assert all(s["Effect"] == "Allow" for s in statements)
    assert not any({"NotAction", "NotResource"} & set(s) for s in statements)


def test_no_wildcard_actions_or_resources_beyond_the_prefixes(statements):
    """No action has a *, and each resource is its queue, bucket or prefix, a trailing * at most."""
    assert not any("*" in action for s in statements for action in _actions(s))
    assert {s["Sid"]: s["Resource"] for s in statements} == RESOURCES


def test_list_bucket_is_limited_to_the_model_prefix(statements):
    """ListBucket (so HeadObject of a missing key answers 404, not 403) only lists the model prefix."""
    (listing,) = [s for s in statements if s["Sid"] == "ModelListing"]
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["models/v1/*"]}}


def test_cloudformation_and_json_policies_are_the_same():
    """The standalone JSON document grants what the template's managed policy grants, statement by
    statement."""
    def canonical(statements):
        return sorted(json.dumps({**s, "Action": sorted(_actions(s))}, sort_keys=True) for s in statements)

    assert canonical(_cfn_statements(**PARAMS)) == canonical(_json_statements())


def test_recordings_statement_is_dropped_without_a_recordings_bucket():
    """With no RecordingsBucketName the policy grants no read on any other bucket."""
    sids = {s["Sid"] for s in _cfn_statements(ModelPrefix="models/v1")}
    assert sids == set(ALLOWED) - {"Recordings"}
