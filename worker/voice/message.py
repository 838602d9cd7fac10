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
import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

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
# C0 and C1 controls and DEL, but tab, newline and carriage return.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_MAX_SHOWN_CODE_POINTS = 5

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
    if not value.strip():
        return "must not be empty or only whitespace"
    # A NUL or an escape sequence would reach the trainer's transcript files, and the terminal of
    # whoever reads them; tab, newline and carriage return are ordinary text.
    if control := _CONTROL.search(value):
        return (f"must not contain control characters other than tab, newline and carriage return, "
                f"got U+{ord(control.group()):04X} at index {control.start()}")
    if not value.isascii():
        # JSON can carry a lone surrogate ("\\ud800"); the transcript is written out as UTF-8 for the trainer.
        try:
            value.encode()
        except UnicodeEncodeError:
            return "must be valid Unicode text (it holds a lone surrogate)"
        # Zero-width spaces, joiners, a BOM: text that shows as nothing gives the trainer nothing to learn.
        if not any(not ch.isspace() and unicodedata.category(ch) != "Cf" for ch in value):
            invisible = list(dict.fromkeys(f"U+{ord(ch):04X}" for ch in value if not ch.isspace()))
            more = ", …" if len(invisible) > _MAX_SHOWN_CODE_POINTS else ""
            return ("must not be empty or only whitespace and invisible characters, got only "
                    + ", ".join(invisible[:_MAX_SHOWN_CODE_POINTS]) + more)
    return None


def recording_url(text: str) -> RecordingUrl:
    """``text`` parsed (``pipeline.recording_url``), its refusal re-raised as a schema problem."""
    try:
        return parse_recording_url(text)
    except BadRecording as exc:
        raise ValueError(str(exc)) from None


# ---------------------------------------------------------------- the wire shape

# Hand-written, not pydantic: pydantic's import and schema building were ~6-9 MiB of the idle daemon's
# memory, and the rules were already the pure functions above; pydantic only walked the shape.
# Strict: a number is not a string, a list is not an object. Extras are ignored (kept in the raw
# body). Problems are (location, words) pairs in field order, every field's, not only the first.

_MISSING = object()
_Problems = list[tuple[tuple, str]]


def _typed(value: object, kind: type, loc: tuple, problems: _Problems) -> bool:
    if isinstance(value, kind):
        return True
    problems.append((loc, f"{_TYPE_WORDING[kind]}, got {_json_type(value)}"))
    return False


def _field(obj: dict, loc: tuple, problems: _Problems, kind: type, *rules, optional: bool = False) -> Any:
    """``obj[loc[-1]]`` when present, a ``kind`` and passing each rule in turn; else None, its problem noted.

    An optional field absent or null is None with no problem. The first failure ends the checks: a
    value of the wrong type never reaches a rule, a rule's problem is the field's only line.
    """
    value = obj.get(loc[-1], _MISSING)
    if value is _MISSING or (optional and value is None):
        if not optional:
            problems.append((loc, "is required"))
        return None
    if not _typed(value, kind, loc, problems):
        return None
    for rule in rules:
        if problem := rule(value):
            problems.append((loc, problem))
            return None
    return value


def _recordings(raw: dict, policy: InputPolicy, profile_id: str | None, problems: _Problems) -> list[Recording]:
    # The count first: an over-long list is refused without validating each of its entries.
    items = _field(raw, ("input",), problems, list, lambda items: policy.recordings_count_problem(len(items)),
                   lambda items: None if items else "must not be empty")
    recordings = []
    for index, item in enumerate(items or ()):
        loc = ("input", index)
        if not _typed(item, dict, loc, problems):
            continue
        url = _recording_url(item, (*loc, "recordingUrl"), policy, profile_id, problems)
        text = _field(item, (*loc, "originalText"), problems, str, text_problem, policy.text_length_problem)
        if url is not None and text is not None:
            recordings.append(Recording(url=url, text=text))
    return recordings


def _recording_url(item: dict, loc: tuple, policy: InputPolicy, profile_id: str | None,
                   problems: _Problems) -> RecordingUrl | None:
    if (text := _field(item, loc, problems, str)) is None:
        return None
    try:
        url = recording_url(text)
    except ValueError as exc:
        problems.append((loc, str(exc)))
        return None
    # Parsed first, so the scope checks the value that is fetched, and only a URL that parsed.
    if problem := policy.recording_url_problem(url, profile_id):
        problems.append((loc, problem))
        return None
    return url


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
    problems: _Problems = []
    doc = _field(raw, ("_doc",), problems, dict)
    job_id = _field(raw, ("jobId",), problems, str, name_problem)
    profile = _field(raw, ("profileId",), problems, str, name_problem)
    environment = _field(raw, ("environment",), problems, str, environment_problem, optional=True)
    directory_name: str | None = None
    language: str | None = None
    if (metadata := _field(raw, ("metadata",), problems, dict)) is not None:
        directory_name = _field(metadata, ("metadata", "directoryName"), problems, str, name_problem)
        language = _field(metadata, ("metadata", "language"), problems, str, language_problem, optional=True)
    recordings = _recordings(raw, policy, profile_id if is_safe_name(profile_id) else None, problems)
    if problems:
        raise InvalidMessage(_problem_lines(problems))
    assert directory_name is not None  # no problems: metadata was an object with a safe directoryName
    return Job(
        job_id=job_id,
        profile_id=profile,
        environment=environment or DEFAULT_ENVIRONMENT,
        directory_name=directory_name,
        language=language or DEFAULT_LANGUAGE,
        recordings=tuple(recordings),
        doc=doc,
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
        return json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise InvalidMessage("body is not valid JSON: nested too deeply") from None
    except (ValueError, TypeError) as exc:
        # JSONDecodeError/UnicodeDecodeError are ValueErrors; keep only the first line, shortened.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InvalidMessage(f"body is not valid JSON: {reason[:MAX_SHOWN_CHARS * 2]}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in JSON")


def _finite_float(text: str) -> float:
    # Python reads 1e999 as inf, which json.dumps then writes as the Infinity refused above: the body
    # kept with the job must be JSON that any reader (and this parser) takes back.
    value = float(text)
    if math.isinf(value):
        infinity = "-Infinity" if value < 0 else "Infinity"
        raise ValueError(f"number {show(text)} is out of range: it would be {infinity}, which is not allowed")
    return value


def _problem_lines(problems: _Problems) -> list[str]:
    lines = [f"{_location(loc)}: {words}" for loc, words in problems]
    if len(lines) > MAX_PROBLEM_LINES:
        extra = len(lines) - MAX_PROBLEM_LINES
        lines = lines[:MAX_PROBLEM_LINES] + [f"… and {extra} more problems"]
    return lines


_TYPE_WORDING: dict[type, str] = {str: "must be a string", dict: "must be an object", list: "must be an array"}


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
