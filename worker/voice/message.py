"""Job messages: the SQS body parsed into a validated, frozen ``Job``, or ``InvalidMessage``.

``jobId``, ``profileId`` and ``metadata.directoryName`` become file path components and S3 key
parts, so they must each be one safe name. Recording URLs may be presigned (credentials in the query
string), so nothing here ever echoes a URL's query, fragment or userinfo back into an error line.
Where s3:// recordings may live and how much input a job may list is an ``InputPolicy``
(worker/voice/input_policy.py), passed in by the caller.
"""

from __future__ import annotations

import ipaddress
import json
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      ValidationInfo)

from worker.core.errors import InvalidMessage
from worker.voice.input_policy import MAX_SHOWN_CHARS, SHAPE_ONLY, InputPolicy, body_size_problem, show
from worker.core.names import SAFE_NAME
from worker.core.redact import redact_url

ENVIRONMENTS = ("development", "staging", "production")
DEFAULT_ENVIRONMENT = "production"
DEFAULT_LANGUAGE = "en"

# The language reaches the trainer's argv: a code like "en", "pt-BR" or "zh_Hans", never an option.
_LANGUAGE = re.compile(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8}){0,3}")
_SAFE_NAME = re.compile(SAFE_NAME)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_ASCII_SPACE_OR_CONTROL = re.compile(r"[\x00-\x20\x7f]")

MAX_PROBLEM_LINES = 20


# ---------------------------------------------------------------- the parsed job


@dataclass(frozen=True, slots=True)
class Recording:
    url: str
    text: str


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


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a fetchable ``https://host/path`` or ``s3://bucket/key``, or None."""
    if _has_space_or_control(url):
        return "must not contain whitespace or control characters"
    if "\\" in url:
        # Parsers disagree on backslashes ("https://a\\@b/"): refuse rather than guess the host.
        return "must not contain backslashes"
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("https", "s3"):
        return f"must be https://host/path or s3://bucket/key, got {show(redact_url(url))}"
    # RFC 3986: the authority ends at the first '/', '?' or '#'.
    authority, after = re.match(r"([^/?#]*)(.*)", rest, re.DOTALL).groups()
    if "@" in authority:
        return "must not contain user credentials (user:password@)"
    if scheme.lower() == "s3":
        return _s3_problem(authority, after)
    return _https_problem(authority, after)


def _has_space_or_control(text: str) -> bool:
    if text.isascii():  # the common case, without a per-character Unicode lookup
        return _ASCII_SPACE_OR_CONTROL.search(text) is not None
    return any(ch.isspace() or unicodedata.category(ch).startswith("C") for ch in text)


def _https_problem(authority: str, after: str) -> str | None:
    if not authority:
        return "has no host"
    host, port = _split_port(authority)
    if port is not None and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return f"has an invalid port in {show(redact_url('https://' + authority))}"
    if not _valid_host(host):
        return f"has an invalid host {show(host)}"
    if re.split(r"[?#]", after, maxsplit=1)[0] in ("", "/"):
        return f"has no path to a recording: {show(redact_url('https://' + authority + '/'))}"
    return None


def _s3_problem(bucket: str, after: str) -> str | None:
    if not _valid_bucket(bucket):
        return f"has an invalid S3 bucket name {show(bucket)}"
    if "?" in after or "#" in after:
        # Keys may hold '?'/'#' but URL parsers would cut them off: refuse the ambiguity.
        return "must not contain '?' or '#': an s3:// URL has no query or fragment"
    if after in ("", "/"):
        return "has an empty S3 key"
    return None


def _split_port(authority: str) -> tuple[str, str | None]:
    if authority.startswith("["):  # an IPv6 literal: its colons are not the port separator
        host, bracket, after = authority.partition("]")
        return host + bracket, (after[1:] if after.startswith(":") else after or None)
    host, sep, port = authority.partition(":")
    return host, (port if sep else None)


def _valid_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            return bool(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            return False
    labels = host.removesuffix(".").split(".")
    return len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels)


def _valid_bucket(bucket: str) -> bool:
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        return False
    return not re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket)  # no IP-address-shaped names


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key), for a URL that ``url_problem`` accepted."""
    bucket, _, key = url.partition("://")[2].partition("/")
    return bucket, key




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


# After the well-formedness rule, so only a URL that parsed is checked for where it points.
_in_scope = _policy_rule(lambda policy, url, ctx: policy.recording_url_problem(url, ctx.get("profile_id")))
_not_too_long = _policy_rule(lambda policy, text, _ctx: policy.text_length_problem(text))
# Before: an over-long list is refused without validating each of its entries first.
_not_too_many = _policy_rule(lambda policy, items, _ctx: isinstance(items, list)
                             and policy.recordings_count_problem(len(items)), BeforeValidator)


class _RecordingIn(_Wire):
    recordingUrl: Annotated[str, _rule(url_problem), _in_scope]
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
        recordings=tuple(Recording(url=r.recordingUrl, text=r.originalText) for r in wire.input),
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


def _problem_line(err: dict) -> str:
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
