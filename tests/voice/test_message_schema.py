"""The job message's JSON Schema: generated from the one model the worker validates with, shipped as
docs/job-message.schema.json, and never stricter than the worker on a body."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings

from tests.voice.test_message import CASES, DELETE, _bodies, changed, valid_body
from worker.core.errors import InvalidMessage
from worker.core.names import SAFE_NAME
from worker.voice.message import ENVIRONMENTS, JobMessage, message_schema, message_schema_text, parse_job

REPO = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO / "docs" / "job-message.schema.json"
VALIDATOR = jsonschema.Draft202012Validator(message_schema())


def test_the_schema_file_is_what_the_schema_command_prints():
    """`python -m worker schema` exits 0 with no settings at all, and docs/job-message.schema.json is its
    output byte for byte: a change to the model without regenerating the file is red here."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}  # no worker setting, no UTF-8 locale
    done = subprocess.run([sys.executable, "-m", "worker", "schema"], cwd=REPO, env=env, capture_output=True,
                          timeout=120)
    assert (done.returncode, done.stderr) == (0, b"")
    assert done.stdout == message_schema_text().encode()
    assert SCHEMA_FILE.read_bytes() == done.stdout, (
        "docs/job-message.schema.json is stale: run `python -m worker schema > docs/job-message.schema.json`")


def test_the_schema_is_draft_2020_12_and_describes_every_field():
    """A valid 2020-12 schema that says how it is made, titled, with a title and a description on every field."""
    schema = message_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert "python -m worker schema" in schema["$comment"]
    models = [schema, *schema["$defs"].values()]
    for model in models:
        assert model["title"] and model["description"] and model["additionalProperties"] is True
        for name, prop in model["properties"].items():
            assert prop.get("title") or "$ref" in prop, name
            assert prop["description"], name
    assert list(schema["properties"]) == ["_doc", "jobId", "profileId", "environment", "metadata", "input"]
    assert schema["required"] == ["_doc", "jobId", "profileId", "metadata", "input"]
    assert list(JobMessage.model_fields) == ["doc", "job_id", "profile_id", "environment", "metadata", "input"]


def test_the_static_limits_are_schema_keywords():
    """What does not depend on a deployment is a keyword a producer's validator checks: the safe-name
    pattern and its 1-128 characters, the environments, at least one recording, a non-empty text."""
    schema = message_schema()
    props, metadata = schema["properties"], schema["$defs"]["JobMetadata"]["properties"]
    recording = schema["$defs"]["RecordingInput"]["properties"]
    for name in (props["jobId"], props["profileId"], metadata["directoryName"]):
        assert (name["type"], name["minLength"], name["maxLength"]) == ("string", 1, 128)
        assert name["pattern"] == f"^{SAFE_NAME}$"
    assert props["environment"]["anyOf"][0]["enum"] == list(ENVIRONMENTS)
    assert props["input"]["minItems"] == 1 and "maxItems" not in props["input"]  # MAX_RECORDINGS_PER_JOB: a setting
    assert recording["originalText"]["minLength"] == 1 and "maxLength" not in recording["originalText"]
    assert metadata["language"]["anyOf"][0]["pattern"].startswith("^[A-Za-z]{2,3}")
    assert "MAX_RECORDINGS_PER_JOB" in props["input"]["description"]
    assert "MAX_TEXT_CHARS" in recording["originalText"]["description"]
    assert "RECORDINGS_S3_BUCKET" in recording["recordingUrl"]["description"]


# The malformed cases a JSON Schema can say (type, required, pattern, length, enum, minItems): a
# producer validating with the schema refuses each of them before sending.
SCHEMA_CASES = ["no-doc", "no-jobId", "no-profileId", "no-metadata", "no-input", "no-directoryName", "doc-string",
                "jobId-number", "metadata-array", "input-object", "input-empty", "input-item-string", "text-missing",
                "text-empty", "env-unknown", "env-bool", "language-option"]


@pytest.mark.parametrize("case", SCHEMA_CASES)
def test_the_schema_refuses_what_it_can_say(case):
    """Each malformed case the schema can express is refused by a 2020-12 validator too, at the same field."""
    body, line = CASES[case]
    where = line.split(":")[0]  # the worker's field, e.g. input[1].originalText
    errors = list(VALIDATOR.iter_errors(body))
    # The validator names the field, or (a required property) the object that lacks it.
    assert any(where.startswith(_location(error.absolute_path)) for error in errors), (
        case, [(list(e.absolute_path), e.message) for e in errors])


def _location(path) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")


@pytest.mark.parametrize(("path", "value"), [
    (("jobId",), "../etc"), (("profileId",), "a/b"), (("metadata", "directoryName"), "."),
    (("jobId",), "x" * 129), (("metadata", "directoryName"), ""), (("metadata", "language"), "-o"),
    (("environment",), "prod"), (("input",), DELETE),
])
def test_the_schema_refuses_unsafe_names_and_choices(path, value):
    """A producer's validator refuses a path-traversing or over-long name, an unknown environment or language."""
    assert not VALIDATOR.is_valid(changed(path, value))
    with pytest.raises(InvalidMessage):
        parse_job(json.dumps(changed(path, value)))


def test_the_valid_body_passes_the_schema():
    """The documented body, with its extra fields, is valid under the schema (extras allowed)."""
    VALIDATOR.validate(valid_body())
    VALIDATOR.validate(changed(("environment",), None) | {"anything": [1, {"x": None}]})


@settings(max_examples=300, deadline=None)
@given(_bodies)
def test_property_what_the_worker_accepts_the_schema_accepts(body):
    """The schema is never stricter than the worker: every body parse_job takes is valid under it."""
    try:
        parse_job(json.dumps(body))
    except InvalidMessage:
        return
    VALIDATOR.validate(body)
