"""The IAM policies: the worker's and the operator commands', each exactly the actions its code uses,
scoped to the queues (and the worker's to its prefix), the same in the CloudFormation template and
the standalone JSON documents."""

from __future__ import annotations

import fnmatch
import inspect
import json
import re

import pytest

from tests.deploy.cfn import ACCOUNT, MODEL_BUCKET, REGION, Resolver, load_template
from tests.deploy.files import REPO
from worker.core.queue import Queue

POLICY_JSON = REPO / "config" / "iam-policy.json"
OPERATOR_POLICY_JSON = REPO / "config" / "iam-operator-policy.json"
# RecordingsPrefix is left at its default: the prefix the worker's default RECORDINGS_S3_KEY_PREFIX uses.
PARAMS = {"ModelPrefix": "models/v1", "RecordingsBucketName": "voice-recordings"}
ALLOWED = {
    # No GetQueueUrl: the daemon is given SQS_QUEUE_URL; it resolves only the DLQ's URL.
    "JobQueue": {"sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility",
                 "sqs:GetQueueAttributes"},
    # Dead-lettering only: the daemon never receives from, deletes in or hides messages of the DLQ.
    "DeadLetterQueue": {"sqs:SendMessage", "sqs:GetQueueUrl", "sqs:GetQueueAttributes"},
    "ModelObjects": {"s3:PutObject", "s3:GetObject", "s3:DeleteObject", "s3:AbortMultipartUpload"},
    "ModelListing": {"s3:ListBucket"},
    "Recordings": {"s3:GetObject"},
}
RESOURCES = {
    "JobQueue": f"arn:aws:sqs:{REGION}:{ACCOUNT}:voice-worker-jobs",
    "DeadLetterQueue": f"arn:aws:sqs:{REGION}:{ACCOUNT}:voice-worker-jobs-dlq",
    "ModelObjects": f"arn:aws:s3:::{MODEL_BUCKET}/models/v1/*",
    "ModelListing": f"arn:aws:s3:::{MODEL_BUCKET}",
    "Recordings": "arn:aws:s3:::voice-recordings/recordings/*",
}


def _cfn_statements(logical_id="WorkerPolicy", **params):
    stack = Resolver(load_template(), **params)
    return stack.resource(logical_id)["PolicyDocument"]["Statement"]


def _json_statements(path=POLICY_JSON):
    values = {"AWS_REGION": REGION, "ACCOUNT_ID": ACCOUNT, "QUEUE_NAME": "voice-worker-jobs",
              "DLQ_NAME": "voice-worker-jobs-dlq", "MODEL_BUCKET": MODEL_BUCKET,
              "MODEL_PREFIX": "models/v1", "RECORDINGS_BUCKET": "voice-recordings"}
    text = re.sub(r"\$\{([A-Z_]+)\}", lambda m: values[m.group(1)], path.read_text())
    return json.loads(text)["Statement"]


def _actions(statement) -> set[str]:
    action = statement["Action"]
    return {action} if isinstance(action, str) else set(action)


def _resources(statement) -> list[str]:
    resource = statement["Resource"]
    return [resource] if isinstance(resource, str) else list(resource)


def _canonical(statements) -> list[str]:
    return sorted(json.dumps({**s, "Action": sorted(_actions(s))}, sort_keys=True) for s in statements)


def _grants(statements, action: str, resource: str) -> bool:
    """Whether an unconditional Allow statement grants ``action`` on ``resource`` (IAM's * match)."""
    return any(s["Effect"] == "Allow" and "Condition" not in s and action in _actions(s)
               and any(fnmatch.fnmatchcase(resource, pattern) for pattern in _resources(s))
               for s in statements)


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


def test_the_worker_may_delete_an_unreferenced_artifact_under_its_prefix_only(statements):
    """The cleanup after a commit deletes objects under the model prefix; nothing outside it."""
    key = f"models/v1/production/p1/j1/{'ab' * 32}/full/model.pth"
    assert _grants(statements, "s3:DeleteObject", f"arn:aws:s3:::{MODEL_BUCKET}/{key}")
    assert not _grants(statements, "s3:DeleteObject", f"arn:aws:s3:::{MODEL_BUCKET}/other/{key}")
    assert not _grants(statements, "s3:DeleteObject", "arn:aws:s3:::voice-recordings/recordings/p1/x.wav")


def test_cloudformation_and_json_policies_are_the_same():
    """The standalone JSON document grants what the template's managed policy grants, statement by
    statement."""
    assert _canonical(_cfn_statements(**PARAMS)) == _canonical(_json_statements())


def test_recordings_read_is_only_the_recordings_prefix_not_the_bucket(statements):
    """s3:GetObject on the recordings bucket covers recordings/* only: not its other keys, not the models."""
    assert _grants(statements, "s3:GetObject", "arn:aws:s3:::voice-recordings/recordings/p1/take.wav")
    for outside in ("arn:aws:s3:::voice-recordings/private/p1/take.wav", "arn:aws:s3:::voice-recordings/x.wav",
                    "arn:aws:s3:::other-bucket/recordings/p1/take.wav"):
        assert not _grants(statements, "s3:GetObject", outside), outside


def test_recordings_prefix_parameter_never_grants_the_whole_bucket():
    """RecordingsPrefix must be one or more plain segments ending with "/": never empty, "/", "." or ".."."""
    spec = load_template()["Parameters"]["RecordingsPrefix"]
    pattern = re.compile(spec["AllowedPattern"])
    for good in ("recordings/", "tenants/acme/", spec["Default"]):
        assert pattern.fullmatch(good), good
    for bad in ("", "/", "recordings", "/recordings/", "recordings//", "../", "./", "a/../", "*/", "a b/"):
        assert not pattern.fullmatch(bad), bad


def test_recordings_prefix_matches_the_workers_default_key_prefix():
    """The JSON policy, the template's default and its RecordingsKeyPrefix output agree with the worker's
    default RECORDINGS_S3_KEY_PREFIX, so the keys the worker accepts are the keys it may read."""
    from worker.settings import load_settings

    key_prefix = load_settings({}).recordings_s3_key_prefix
    static_part = key_prefix.split("{profileId}")[0]
    assert static_part == "recordings/"
    assert load_template()["Parameters"]["RecordingsPrefix"]["Default"] == static_part
    (recordings,) = [s for s in _json_statements() if s["Sid"] == "Recordings"]
    assert recordings["Resource"] == f"arn:aws:s3:::voice-recordings/{static_part}*"
    stack = Resolver(load_template(), **PARAMS)
    assert stack.resolve(load_template()["Outputs"]["RecordingsKeyPrefix"]["Value"]) == key_prefix
    assert stack.resolve(load_template()["Outputs"]["RecordingsBucket"]["Value"]) == "voice-recordings"


def test_recordings_statement_is_dropped_without_a_recordings_bucket():
    """With no RecordingsBucketName the policy grants no read on any other bucket."""
    sids = {s["Sid"] for s in _cfn_statements(ModelPrefix="models/v1")}
    assert sids == set(ALLOWED) - {"Recordings"}


# ---------------------------------------------------------------- the operator commands' policy

JOB_QUEUE, DLQ = RESOURCES["JobQueue"], RESOURCES["DeadLetterQueue"]
OPERATOR_ALLOWED = {
    "JobQueue": {"sqs:SendMessage", "sqs:GetQueueAttributes", "sqs:GetQueueUrl"},
    "DeadLetterQueue": {"sqs:GetQueueUrl", "sqs:GetQueueAttributes", "sqs:ReceiveMessage",
                        "sqs:ChangeMessageVisibility", "sqs:DeleteMessage", "sqs:StartMessageMoveTask"},
    "QueueAge": {"cloudwatch:GetMetricStatistics"},
}
# GetMetricStatistics has no resource-level permissions: "*" is the only resource it takes.
OPERATOR_RESOURCES = {"JobQueue": JOB_QUEUE, "DeadLetterQueue": DLQ, "QueueAge": "*"}
# (IAM action, resource) of every call each command makes, read from its code. The DLQ is found by
# Queue.dead_letter_url (GetQueueAttributes on the job queue, GetQueueUrl of the DLQ); a peek receives
# and resets visibility with ChangeMessageVisibilityBatch (IAM: sqs:ChangeMessageVisibility).
_FIND_DLQ = {("sqs:GetQueueAttributes", JOB_QUEUE), ("sqs:GetQueueUrl", DLQ)}
_PEEK = {("sqs:ReceiveMessage", DLQ), ("sqs:ChangeMessageVisibility", DLQ)}
COMMAND_CALLS = {
    "submit": {("sqs:SendMessage", JOB_QUEUE)},
    "reconcile": {("sqs:SendMessage", JOB_QUEUE)} | _FIND_DLQ | _PEEK,
    "dlq list": _FIND_DLQ | _PEEK,
    # Counts of both queues (their attributes), the job queue's oldest-message age from CloudWatch.
    "queue": _FIND_DLQ | {("sqs:GetQueueAttributes", DLQ), ("cloudwatch:GetMetricStatistics", "*")},
    # Move task: both queues' QueueArn, then StartMessageMoveTask, which also needs Receive, Delete and
    # GetQueueAttributes on the DLQ and SendMessage on the destination. Fallback: receive, send, delete.
    "dlq redrive": _FIND_DLQ | _PEEK | {
        ("sqs:GetQueueAttributes", DLQ), ("sqs:StartMessageMoveTask", DLQ),
        ("sqs:DeleteMessage", DLQ), ("sqs:SendMessage", JOB_QUEUE)},
}
# Granted though no command calls it (they take SQS_QUEUE_URL): resolving the job queue's URL by name.
OPERATOR_UNCALLED = {("sqs:GetQueueUrl", JOB_QUEUE)}
# `doctor` runs with the worker's credentials (worker/ops/doctor.py): both queues' attributes, the DLQ's
# URL, and a probe object under <prefix>/.doctor/ written and deleted.
_PROBE = f"arn:aws:s3:::{MODEL_BUCKET}/models/v1/.doctor/0123456789abcdef"
DOCTOR_CALLS = _FIND_DLQ | {("sqs:GetQueueAttributes", DLQ), ("s3:PutObject", _PROBE),
                            ("s3:DeleteObject", _PROBE)}
# The modules whose SQS calls the operator commands make (worker/ops/cli.py wires them), each call
# through a worker.core.queue.Queue, named ``queue`` or ``..._queue`` there, or used where it is made.
OPERATOR_CODE = ("worker/voice/submit.py", "worker/ops/reconcile.py", "worker/ops/dlq.py",
                 "worker/ops/queue_view.py")


@pytest.fixture(params=["cloudformation", "json"])
def operator_statements(request):
    if request.param == "cloudformation":
        return _cfn_statements("OperatorPolicy", **PARAMS)
    return _json_statements(OPERATOR_POLICY_JSON)


def _sqs_actions_called(source: str) -> set[str]:
    """IAM actions of the ``sqs.x(...)``/``self._sqs.x(...)`` calls in source; a batch call needs the
    single call's action."""
    def camel(op: str) -> str:
        return "".join(word.title() for word in op.split("_"))

    sqs = {"sqs:" + camel(op).removesuffix("Batch") for op in re.findall(r"\b_?sqs\.([a-z_]+)\(", source)}
    return sqs | {"cloudwatch:" + camel(op) for op in re.findall(r"\bcloudwatch\.([a-z_]+)\(", source)}


def _queue_methods_source(source: str) -> str:
    """The source of every Queue method ``source`` calls on a queue, and of the Queue methods those call."""
    methods = {name for name, attr in vars(Queue).items() if inspect.isfunction(attr)}
    todo = set(re.findall(r"(?:\w*queue|\bQueue\([^()]*\))\.([a-z_]+)\(", source)) & methods
    done: set[str] = set()
    while todo:
        name = todo.pop()
        done.add(name)
        todo |= set(re.findall(r"\.([a-z_]+)\(", inspect.getsource(getattr(Queue, name)))) & methods - done
    return "\n".join(inspect.getsource(getattr(Queue, name)) for name in sorted(done))


def test_operator_statements_allow_exactly_the_listed_actions(operator_statements):
    """Every operator statement is an unconditional Allow of exactly the allowed set for its Sid."""
    assert {s["Sid"]: _actions(s) for s in operator_statements} == OPERATOR_ALLOWED
    assert all(s["Effect"] == "Allow" for s in operator_statements)
    assert not any({"NotAction", "NotResource", "Condition"} & set(s) for s in operator_statements)


def test_operator_policy_has_no_wildcard_and_only_the_two_queues(operator_statements):
    """No action has a *; the resources are the job queue and the DLQ, nothing else (no bucket), and
    "*" for the one CloudWatch read, which takes no other."""
    assert not any("*" in action for s in operator_statements for action in _actions(s))
    assert {s["Sid"]: s["Resource"] for s in operator_statements} == OPERATOR_RESOURCES


def test_operator_policy_grants_what_each_command_calls_and_no_more(operator_statements):
    """submit, reconcile, dlq list and dlq redrive are each granted every call they make; beyond those
    calls the policy grants only the one documented extra."""
    for command, calls in COMMAND_CALLS.items():
        missing = {call for call in calls if not _grants(operator_statements, *call)}
        assert not missing, f"{command} is denied {sorted(missing)}"
    granted = {(action, resource) for s in operator_statements
               for action in _actions(s) for resource in _resources(s)}
    assert granted == set().union(*COMMAND_CALLS.values()) | OPERATOR_UNCALLED


def test_operator_call_table_matches_the_code():
    """The SQS operations the operator modules call are the actions COMMAND_CALLS lists: a new call in
    the code (say ListMessageMoveTasks) fails here until the policy and the table have it."""
    source = "\n".join((REPO / path).read_text() for path in OPERATOR_CODE)
    called = _sqs_actions_called(source + _queue_methods_source(source))
    assert called == {action for calls in COMMAND_CALLS.values() for action, _ in calls}


def test_cloudformation_and_json_operator_policies_are_the_same():
    """config/iam-operator-policy.json grants what the template's OperatorPolicy grants."""
    assert _canonical(_cfn_statements("OperatorPolicy", **PARAMS)) == _canonical(
        _json_statements(OPERATOR_POLICY_JSON))


def test_doctor_runs_on_the_worker_policy_not_the_operators(statements, operator_statements):
    """Every call `doctor` makes is granted by the worker policy; the operator policy grants no S3."""
    missing = {call for call in DOCTOR_CALLS if not _grants(statements, *call)}
    assert not missing, f"doctor is denied {sorted(missing)}"
    assert not any(a.startswith("s3:") for s in operator_statements for a in _actions(s))
