"""Job messages: the SQS body parsed into a validated, frozen ``Job``, or ``InvalidMessage``.

``jobId``, ``profileId`` and ``metadata.directoryName`` become file path components and S3 key
parts, so they must each be one safe name. Recording URLs may be presigned (credentials in the query
string), so nothing here ever echoes a URL's query, fragment or userinfo back into an error line.
Each is parsed once, here, into a ``RecordingUrl`` (``pipeline.recording_url``): the value the
input policy scopes is the value the downloader fetches. Where s3:// recordings may live and how
much input a job may list is an ``InputPolicy`` (worker/voice/input_policy.py), passed in by the
caller.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, cast

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic_core import ErrorDetails

from pipeline.recording_url import RecordingUrl, parse_recording_url
from worker.core.errors import BadRecording, InvalidMessage
from worker.core.names import SAFE_NAME
from worker.core.redact import MAX_SHOWN_CHARS, show
from worker.voice.input_policy import SHAPE_ONLY, InputPolicy, body_size_problem

ENVIRONMENTS = ("development", "staging", "production")
DEFAULT_ENVIRONMENT = "production"
DEFAULT_LANGUAGE = "en"

# The language reaches the trainer's argv: a code like "en", "pt-BR" or "zh_Hans", never an option.
_LANGUAGE = re.compile(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8}){0,3}")
_SAFE_NAME = re.compile(SAFE_NAME)

MAX_PROBLEM_LINES = 20


# ---------------------------------------------------------------- the parsed job


@dataclass(frozen=True, slots=True)
class Recording:
    url: RecordingUrl  # parsed once, in parse_job: the policy scoped this value and fetch gets it
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.url, RecordingUrl):
            raise TypeError(f"Recording.url must be a parsed RecordingUrl, got {type(self.url).__name__}")


@dataclass(frozen=True, slots=True)
class Job:
    """A validated job. Construction re-checks the rules: no Job can carry an unsafe path part."""

    job_id: str
    profile_id: str
    directory_name: str
    recordings: tuple[Recording, ...]
    environment: str = DEFAULT_ENVIRONMENT
    language: str = DEFAULT_LANGUAGE
    doc: dict = field(default_factory=dict)
    body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = (
            ("jobId", name_problem(self.job_id)),
            ("profileId", name_problem(self.profile_id)),
            ("metadata.directoryName", name_problem(self.directory_name)),
            ("environment", environment_problem(self.environment)),
            ("metadata.language", language_problem(self.language)),
            ("input", None if self.recordings else "must not be empty"),
        )
        problems = [f"{label}: {problem}" for label, problem in checks if problem]
        if problems:
            raise ValueError("; ".join(problems))


# ---------------------------------------------------------------- the rules, as pure functions


def is_safe_name(value: object) -> bool:
    return name_problem(value) is None


def name_problem(value: object) -> str | None:
    """Why ``value`` cannot be one path component / S3 key part, or None when it can."""
    if not isinstance(value, str):
        return f"must be a string, got {_json_type(value)}"
    # fullmatch, not match: "$" alone would also accept a trailing newline. The pattern already
    # refuses "." and ".." (first character alphanumeric); the check below keeps that explicit.
    if value in (".", "..") or not _SAFE_NAME.fullmatch(value):
        return (
            "must be 1-128 letters, digits, '.', '_' or '-', starting alphanumeric, "
            f"got {show(value)}"
        )
    return None


def environment_problem(value: str) -> str | None:
    if value in ENVIRONMENTS:
        return None
    return f"must be one of {', '.join(ENVIRONMENTS)}, got {show(value)}"


def language_problem(value: str) -> str | None:
    if isinstance(value, str) and _LANGUAGE.fullmatch(value):
        return None
    return f"must be a language code like 'en' or 'pt-BR', got {show(value)}"


def text_problem(value: str) -> str | None:
    return None if value.strip() else "must not be empty or only whitespace"


def recording_url(text: str) -> RecordingUrl:
    """``text`` parsed (``pipeline.recording_url``), its refusal re-raised as a schema problem."""
    try:
        return parse_recording_url(text)
    except BadRecording as exc:
        raise ValueError(str(exc)) from None


# ---------------------------------------------------------------- the wire schema


def _rule(problem_of) -> AfterValidator:
    """A pydantic check from one of the pure rules above (None, for an optional field, passes)."""

    def check(value):
        if value is not None and (problem := problem_of(value)):
            raise ValueError(problem)
        return value

    return AfterValidator(check)


_SafeName = Annotated[str, _rule(name_problem)]


class _Wire(BaseModel):
    # Strict: a number is not a string, a list is not an object. Extras are kept in the raw body.
    model_config = ConfigDict(strict=True, extra="ignore")


def _policy_rule(problem_of, validator=AfterValidator):
    """A check of the caller's ``InputPolicy`` (validation context): ``problem_of(policy, value, context)``."""

    def check(value, info: ValidationInfo):
        context = info.context or {}
        if problem := problem_of(context.get("policy", SHAPE_ONLY), value, context):
            raise ValueError(problem)
        return value

    return validator(check)


# After the parse, so only a URL that parsed is checked for where it points.
_in_scope = _policy_rule(lambda policy, url, ctx: policy.recording_url_problem(url, ctx.get("profile_id")))
_not_too_long = _policy_rule(lambda policy, text, _ctx: policy.text_length_problem(text))
# Before: an over-long list is refused without validating each of its entries first.
_not_too_many = _policy_rule(lambda policy, items, _ctx: isinstance(items, list)
                             and policy.recordings_count_problem(len(items)), BeforeValidator)


class _RecordingIn(_Wire):
    # Parsed first (a str in, a RecordingUrl out), so the scope checks the value that is fetched.
    recordingUrl: Annotated[str, AfterValidator(recording_url), _in_scope]
    originalText: Annotated[str, _rule(text_problem), _not_too_long]


class _MetadataIn(_Wire):
    directoryName: _SafeName
    language: Annotated[str | None, _rule(language_problem)] = None


class _BodyIn(_Wire):
    doc: dict[str, Any] = Field(alias="_doc")
    jobId: _SafeName
    profileId: _SafeName
    environment: Annotated[str | None, _rule(environment_problem)] = None
    metadata: _MetadataIn
    input: Annotated[list[_RecordingIn], _not_too_many] = Field(min_length=1)


# ---------------------------------------------------------------- parsing


def parse_job(body: str | bytes, policy: InputPolicy = SHAPE_ONLY) -> Job:
    """The job in an SQS body, or ``InvalidMessage`` listing every violation, one line each.

    The worker passes ``Settings.input_policy()``; the default checks the shape and the body size
    only, for tools whose output the worker validates again.
    """
    raw = _load_json(body)
    if not isinstance(raw, dict):
        raise InvalidMessage(f"body: must be a JSON object, got {_json_type(raw)}")
    profile_id = raw.get("profileId")
    context = {"policy": policy, "profile_id": profile_id if is_safe_name(profile_id) else None}
    try:
        wire = _BodyIn.model_validate(raw, context=context)
    except ValidationError as exc:
        raise InvalidMessage(_problem_lines(exc)) from None
    return Job(
        job_id=wire.jobId,
        profile_id=wire.profileId,
        environment=wire.environment or DEFAULT_ENVIRONMENT,
        directory_name=wire.metadata.directoryName,
        language=wire.metadata.language or DEFAULT_LANGUAGE,
        # The field is declared str (the strict type check and its wording); its validator parsed it.
        recordings=tuple(Recording(url=cast(RecordingUrl, r.recordingUrl), text=r.originalText)
                         for r in wire.input),
        doc=raw["_doc"],
        body=raw,
    )


def job_id_hint(body: str | bytes) -> str | None:
    """The ``jobId`` of a body that failed validation, when it is a safe name. Never raises."""
    if body_size_problem(body):
        return None  # not worth parsing megabytes for a hint
    try:
        raw = json.loads(body)
        job_id = raw.get("jobId") if isinstance(raw, dict) else None
        return job_id if is_safe_name(job_id) else None
    except Exception:  # noqa: BLE001 - a hint is optional; a broken body simply has none
        return None


def _load_json(body: str | bytes) -> Any:
    if problem := body_size_problem(body):
        raise InvalidMessage(problem)
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise InvalidMessage("body is not valid JSON: nested too deeply") from None
    except (ValueError, TypeError) as exc:
        # JSONDecodeError/UnicodeDecodeError are ValueErrors; keep only the first line, shortened.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InvalidMessage(f"body is not valid JSON: {reason[:MAX_SHOWN_CHARS * 2]}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def _problem_lines(exc: ValidationError) -> list[str]:
    lines = [_problem_line(err) for err in exc.errors(include_url=False)]
    if len(lines) > MAX_PROBLEM_LINES:
        extra = len(lines) - MAX_PROBLEM_LINES
        lines = lines[:MAX_PROBLEM_LINES] + [f"… and {extra} more problems"]
    return lines


def _problem_line(err: ErrorDetails) -> str:
    where, kind = _location(err["loc"]), err["type"]
    if kind in _TYPE_WORDING:
        return f"{where}: {_TYPE_WORDING[kind]}, got {_json_type(err.get('input'))}"
    if kind == "missing":
        return f"{where}: is required"
    if kind == "too_short":
        return f"{where}: must not be empty"
    # Our validators' own words; pydantic's remaining messages never echo the input.
    return f"{where}: {err['msg'].removeprefix('Value error, ')}"


_TYPE_WORDING = {
    "string_type": "must be a string",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "list_type": "must be an array",
}


def _location(loc: tuple) -> str:
    where = ""
    for part in loc:
        where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
    return where or "body"


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    names = ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array"))
    for kind, name in names:
        if isinstance(value, kind):
            return name
    return "object" if isinstance(value, dict) else type(value).__name__
