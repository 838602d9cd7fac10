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
from worker.voice.stage_logs import AttemptLogShipper, LogShipping, S3Logs, ShippingTrainer, chunk_key, job_logs_prefix

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


def _grants(statements, action: str, resource: str, prefix: str | None = None) -> bool:
    """Whether an Allow statement grants ``action`` on ``resource`` (IAM's * match): an unconditional one,
    or, for a listing asking for ``prefix``, one whose only condition is an s3:prefix StringLike it matches."""
    def applies(statement) -> bool:
        condition = statement.get("Condition")
        if condition is None:
            return True
        if prefix is None or list(condition) != ["StringLike"] or list(condition["StringLike"]) != ["s3:prefix"]:
            return False
        return any(fnmatch.fnmatchcase(prefix, pattern) for pattern in condition["StringLike"]["s3:prefix"])

    return any(s["Effect"] == "Allow" and applies(s) and action in _actions(s)
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
MODEL_BUCKET_ARN = RESOURCES["ModelListing"]
OPERATOR_ALLOWED = {
    "JobQueue": {"sqs:SendMessage", "sqs:GetQueueAttributes", "sqs:GetQueueUrl"},
    "DeadLetterQueue": {"sqs:GetQueueUrl", "sqs:GetQueueAttributes", "sqs:ReceiveMessage",
                        "sqs:ChangeMessageVisibility", "sqs:DeleteMessage", "sqs:StartMessageMoveTask"},
    "QueueAge": {"cloudwatch:GetMetricStatistics"},
    "StageLogs": {"s3:GetObject"},
    "StageLogListing": {"s3:ListBucket"},
}
# GetMetricStatistics has no resource-level permissions: "*" is the only resource it takes.
OPERATOR_RESOURCES = {"JobQueue": JOB_QUEUE, "DeadLetterQueue": DLQ, "QueueAge": "*",
                      "StageLogs": f"{MODEL_BUCKET_ARN}/models/v1/.logs/*", "StageLogListing": MODEL_BUCKET_ARN}
# A job's shipped stage logs, named by the code that writes and reads them (worker/voice/stage_logs.py), so a
# change of their layout shows here: S3Logs.chunks lists the job's prefix (ListObjectsV2: s3:ListBucket with
# that s3:prefix), S3Logs.read_chunk gets each chunk.
_JOB_ID, _ATTEMPT, _LOG = "665f1c2e9b1e8a0012ab34cd", "0002-1a2b3c4d", "20261202T052042.118313Z-train_full.log"
_JOB_LOGS = job_logs_prefix("models/v1", _JOB_ID)
_CHUNK = f"{MODEL_BUCKET_ARN}/{chunk_key('models/v1', _JOB_ID, _ATTEMPT, _LOG, 0)}"
_READ_LOGS = {("s3:ListBucket", MODEL_BUCKET_ARN, _JOB_LOGS), ("s3:GetObject", _CHUNK)}
# (IAM action, resource[, listed prefix]) of every call each command makes, read from its code. The DLQ is
# found by Queue.dead_letter_url (GetQueueAttributes on the job queue, GetQueueUrl of the DLQ); a peek receives
# and resets visibility with ChangeMessageVisibilityBatch (IAM: sqs:ChangeMessageVisibility).
_FIND_DLQ = {("sqs:GetQueueAttributes", JOB_QUEUE), ("sqs:GetQueueUrl", DLQ)}
_PEEK = {("sqs:ReceiveMessage", DLQ), ("sqs:ChangeMessageVisibility", DLQ)}
# Counts of both queues (their attributes), the job queue's oldest-message age from CloudWatch.
_QUEUE_VIEW = _FIND_DLQ | {("sqs:GetQueueAttributes", DLQ), ("cloudwatch:GetMetricStatistics", "*")}
COMMAND_CALLS = {
    "submit": {("sqs:SendMessage", JOB_QUEUE)},
    "reconcile": {("sqs:SendMessage", JOB_QUEUE)} | _FIND_DLQ | _PEEK,
    "dlq list": _FIND_DLQ | _PEEK,
    "queue": _QUEUE_VIEW,
    # Move task: both queues' QueueArn, then StartMessageMoveTask, which also needs Receive, Delete and
    # GetQueueAttributes on the DLQ and SendMessage on the destination. Fallback: receive, send, delete.
    "dlq redrive": _FIND_DLQ | _PEEK | {
        ("sqs:GetQueueAttributes", DLQ), ("sqs:StartMessageMoveTask", DLQ),
        ("sqs:DeleteMessage", DLQ), ("sqs:SendMessage", JOB_QUEUE)},
    # The job's shipped stage logs (worker/ops/logs.py); the records come from the store, not AWS.
    "logs": _READ_LOGS,
    # The web page: the queue's view (queue_view.look) and the newest log's tail (logs.tail_lines).
    "ui": _QUEUE_VIEW | _READ_LOGS,
}
# Granted though no command calls it (they take SQS_QUEUE_URL): resolving the job queue's URL by name.
OPERATOR_UNCALLED = {("sqs:GetQueueUrl", JOB_QUEUE)}
# `doctor` runs with the worker's credentials (worker/ops/doctor.py): both queues' attributes, the DLQ's
# URL, and a probe object under <prefix>/.doctor/ written and deleted.
_PROBE = f"arn:aws:s3:::{MODEL_BUCKET}/models/v1/.doctor/0123456789abcdef"
DOCTOR_CALLS = _FIND_DLQ | {("sqs:GetQueueAttributes", DLQ), ("s3:PutObject", _PROBE),
                            ("s3:DeleteObject", _PROBE)}
# The modules whose AWS calls the operator commands make (worker/ops/cli.py wires them): SQS through a
# worker.core.queue.Queue, named ``queue`` or ``..._queue`` there, or used where it is made; S3 through a
# worker.voice.stage_logs.S3Logs, named ``logs`` or ``..._logs``.
OPERATOR_CODE = ("worker/voice/submit.py", "worker/ops/reconcile.py", "worker/ops/dlq.py",
                 "worker/ops/queue_view.py", "worker/ops/logs.py",
                 *sorted(str(path.relative_to(REPO)) for path in (REPO / "worker" / "ops" / "ui").glob("*.py")))
# What authorises each S3 operation the code may call (a paginator's operation included). One the table
# does not know fails the code-grep tests until it is added here and, where needed, to a policy.
S3_OPERATION_ACTIONS = {
    "list_objects_v2": "s3:ListBucket", "list_objects": "s3:ListBucket",
    "get_object": "s3:GetObject", "head_object": "s3:GetObject",
    "put_object": "s3:PutObject", "create_multipart_upload": "s3:PutObject", "upload_part": "s3:PutObject",
    "complete_multipart_upload": "s3:PutObject", "abort_multipart_upload": "s3:AbortMultipartUpload",
    "delete_object": "s3:DeleteObject", "delete_objects": "s3:DeleteObject",
}


@pytest.fixture(params=["cloudformation", "json"])
def operator_statements(request):
    if request.param == "cloudformation":
        return _cfn_statements("OperatorPolicy", **PARAMS)
    return _json_statements(OPERATOR_POLICY_JSON)


def _camel(op: str) -> str:
    return "".join(word.title() for word in op.split("_"))


def _sqs_actions_called(source: str) -> set[str]:
    """IAM actions of the ``sqs.x(...)``/``self._sqs.x(...)`` calls in source; a batch call needs the
    single call's action."""
    sqs = {"sqs:" + _camel(op).removesuffix("Batch") for op in re.findall(r"\b_?sqs\.([a-z_]+)\(", source)}
    return sqs | {"cloudwatch:" + _camel(op) for op in re.findall(r"\bcloudwatch\.([a-z_]+)\(", source)}


def _s3_actions_called(source: str) -> set[str]:
    """IAM actions of the ``s3.x(...)``/``self._s3.x(...)`` calls and the paginators' operations in source."""
    operations = set(re.findall(r"\b_?s3\.([a-z0-9_]+)\(", source)) - {"get_paginator"}
    operations |= set(re.findall(r"\b_?s3\.get_paginator\(\s*[\"']([a-z0-9_]+)[\"']", source))
    unknown = operations - set(S3_OPERATION_ACTIONS)
    assert not unknown, f"S3 operations S3_OPERATION_ACTIONS does not map to an IAM action: {sorted(unknown)}"
    return {S3_OPERATION_ACTIONS[op] for op in operations}


def _methods_source(cls: type, receiver: str, source: str) -> str:
    """The source of every method of ``cls`` that ``source`` calls on a ``receiver`` (a regex), and of the
    methods of ``cls`` those call."""
    methods = {name for name, attr in vars(cls).items() if inspect.isfunction(attr)}
    todo = set(re.findall(rf"(?:{receiver})\.([a-z_]+)\(", source)) & methods
    done: set[str] = set()
    while todo:
        name = todo.pop()
        done.add(name)
        todo |= set(re.findall(r"\.([a-z_]+)\(", inspect.getsource(getattr(cls, name)))) & methods - done
    return "\n".join(inspect.getsource(getattr(cls, name)) for name in sorted(done))


def _queue_methods_source(source: str) -> str:
    """The source of every Queue method ``source`` calls on a queue, and of the Queue methods those call."""
    return _methods_source(Queue, r"\w*queue|\bQueue\([^()]*\)", source)


def _shipped_logs_methods_source(source: str) -> str:
    """The source of every S3Logs method ``source`` calls on its logs, and of the S3Logs methods those call."""
    return _methods_source(S3Logs, r"\w*logs|\bS3Logs\([^()]*\)", source)


def test_operator_statements_allow_exactly_the_listed_actions(operator_statements):
    """Every operator statement is an Allow of exactly the allowed set for its Sid; the one condition keeps
    the listing to the shipped logs."""
    assert {s["Sid"]: _actions(s) for s in operator_statements} == OPERATOR_ALLOWED
    assert all(s["Effect"] == "Allow" for s in operator_statements)
    assert not any({"NotAction", "NotResource"} & set(s) for s in operator_statements)
    conditions = {s["Sid"]: s["Condition"] for s in operator_statements if "Condition" in s}
    assert conditions == {"StageLogListing": {"StringLike": {"s3:prefix": ["models/v1/.logs/*"]}}}


def test_operator_policy_has_no_wildcard_and_only_the_queues_and_the_logs(operator_statements):
    """No action has a *; the resources are the job queue, the DLQ, the model bucket (listing) and its
    shipped-logs prefix, nothing else, and "*" for the one CloudWatch read, which takes no other."""
    assert not any("*" in action for s in operator_statements for action in _actions(s))
    assert {s["Sid"]: s["Resource"] for s in operator_statements} == OPERATOR_RESOURCES


def test_operator_policy_grants_what_each_command_calls_and_no_more(operator_statements):
    """submit, reconcile, queue, dlq list and redrive, logs and ui are each granted every call they make;
    beyond those calls the policy grants only the one documented extra."""
    for command, calls in COMMAND_CALLS.items():
        missing = {call for call in calls if not _grants(operator_statements, *call)}
        assert not missing, f"{command} is denied {sorted(missing)}"
    calls = set().union(*COMMAND_CALLS.values()) | OPERATOR_UNCALLED
    granted = {(action, resource) for s in operator_statements
               for action in _actions(s) for resource in _resources(s)}
    unused = {(action, pattern) for action, pattern in granted
              if not any(call[0] == action and fnmatch.fnmatchcase(call[1], pattern) for call in calls)}
    assert not unused, f"granted but never called: {sorted(unused)}"


def test_operator_call_table_matches_the_code():
    """The SQS, CloudWatch and S3 operations the operator modules call are the actions COMMAND_CALLS lists:
    a new call in the code (say ListMessageMoveTasks, or a HeadObject in the log reader) fails here until
    the policy and the table have it."""
    source = "\n".join((REPO / path).read_text() for path in OPERATOR_CODE)
    called = _sqs_actions_called(source + _queue_methods_source(source))
    called |= _s3_actions_called(source + _shipped_logs_methods_source(source))
    assert called == {call[0] for calls in COMMAND_CALLS.values() for call in calls}


def test_the_log_readers_s3_calls_are_seen_by_the_code_grep():
    """The log reader's calls (S3Logs.chunks and read_chunk, which logs.py makes) are in the grepped source,
    and the shipper's write (put_chunk) is not: the operator policy owes the reader, not the worker."""
    source = "\n".join((REPO / path).read_text() for path in OPERATOR_CODE)
    reader = _shipped_logs_methods_source(source)
    assert "def chunks(" in reader and "def read_chunk(" in reader and "def put_chunk(" not in reader
    assert _s3_actions_called(reader) == {"s3:ListBucket", "s3:GetObject"}


def test_operators_read_the_shipped_logs_and_nothing_else_in_the_bucket(operator_statements):
    """The operator policy lists and reads under <prefix>/.logs/ only: no model read, no listing of the
    models' keys, no write or delete anywhere, the logs included."""
    model = f"{MODEL_BUCKET_ARN}/models/v1/production/p1/j1/{'ab' * 32}/full/model.pth"
    assert _grants(operator_statements, "s3:GetObject", _CHUNK)
    assert not _grants(operator_statements, "s3:GetObject", model)
    assert not _grants(operator_statements, "s3:GetObject", f"{MODEL_BUCKET_ARN}/other/.logs/{_JOB_ID}/x.log")
    assert _grants(operator_statements, "s3:ListBucket", MODEL_BUCKET_ARN, _JOB_LOGS)
    for prefix in (None, "", "models/v1/", "models/v1/production/", "models/v1/.work/", ".logs/"):
        assert not _grants(operator_statements, "s3:ListBucket", MODEL_BUCKET_ARN, prefix), prefix
    for write in ("s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert not _grants(operator_statements, write, _CHUNK), write
        assert not _grants(operator_statements, write, model), write


def test_cloudformation_and_json_operator_policies_are_the_same():
    """config/iam-operator-policy.json grants what the template's OperatorPolicy grants."""
    assert _canonical(_cfn_statements("OperatorPolicy", **PARAMS)) == _canonical(
        _json_statements(OPERATOR_POLICY_JSON))


def test_doctor_runs_on_the_worker_policy_not_the_operators(statements, operator_statements):
    """Every call `doctor` makes is granted by the worker policy; the operator policy grants none of its S3
    calls (no write under the prefix), so a doctor run with operator credentials fails."""
    missing = {call for call in DOCTOR_CALLS if not _grants(statements, *call)}
    assert not missing, f"doctor is denied {sorted(missing)}"
    assert not any(_grants(operator_statements, *call) for call in DOCTOR_CALLS if call[0].startswith("s3:"))


# The worker's side of the stage logs: the shipper's classes and the S3Logs methods they call.
SHIPPER_CODE = (AttemptLogShipper, LogShipping, ShippingTrainer)
# What each S3 action the shipper may need is called on: a chunk, or the listing of its job's logs.
_SHIPPER_CALLS = {"s3:PutObject": (_CHUNK,), "s3:GetObject": (_CHUNK,), "s3:DeleteObject": (_CHUNK,),
                  "s3:AbortMultipartUpload": (_CHUNK,), "s3:ListBucket": (MODEL_BUCKET_ARN, _JOB_LOGS)}


def test_worker_policy_grants_every_call_of_the_log_shipper(statements):
    """Each S3 call the worker's log shipper makes (today PutObject of a chunk) is granted by the worker
    policy on the chunk's key: a listing or a read added to the shipper fails here until it is granted."""
    source = "\n".join(inspect.getsource(cls) for cls in SHIPPER_CODE)
    called = _s3_actions_called(source + _shipped_logs_methods_source(source))
    assert "s3:PutObject" in called
    missing = {action for action in called if not _grants(statements, action, *_SHIPPER_CALLS[action])}
    assert not missing, f"the log shipper is denied {sorted(missing)}"
