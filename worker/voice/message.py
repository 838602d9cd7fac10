"""Job messages: the SQS body parsed into a validated, frozen ``Job``, or ``InvalidMessage``.

``jobId``, ``profileId`` and ``metadata.directoryName`` become file path components and S3 key
parts, so they must each be one safe name. Recording URLs may be presigned (credentials in the query
string), so nothing here ever echoes a URL's query, fragment or userinfo back into an error line.
Each is parsed once, here, into a ``RecordingUrl`` (``pipeline.recording_url``): the value the
input policy scopes is the value the downloader fetches. Where s3:// recordings may live and how
much input a job may list is an ``InputPolicy`` (worker/voice/input_policy.py), passed in by the
caller.

The message is one pydantic model tree, ``JobMessage``: the one validation of a body, and the source
of the JSON Schema producers get (``python -m worker schema``, ``docs/job-message.schema.json``).
Its constraints (types, patterns, lengths, choices) are pydantic's, so the schema shows what is
checked; the rules a schema cannot say (a transcript that shows nothing, a URL's grammar, the
deployment's input policy) are validators of its fields. ``Job`` is built from a validated model,
and only there: nothing checks a ``Job`` a second time.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic.config import JsonDict
from pydantic_core import ErrorDetails, PydanticCustomError, PydanticKnownError

from pipeline.errors import BadRecording
from pipeline.recording_url import RecordingUrl, parse_recording_url
from worker.core.broker import Message
from worker.core.errors import InvalidMessage
from worker.core.names import SAFE_NAME
from worker.core.redact import MAX_SHOWN_CHARS, show
from worker.voice.input_policy import SHAPE_ONLY, SQS_MAX_BODY_BYTES, InputPolicy, body_size_problem

Environment = Literal["development", "staging", "production"]
ENVIRONMENTS: tuple[str, ...] = get_args(Environment)
DEFAULT_ENVIRONMENT = "production"
DEFAULT_LANGUAGE = "en"

# The language reaches the trainer's argv: a code like "en", "pt-BR" or "zh_Hans", never an option.
LANGUAGE = r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8}){0,3}"
_LANGUAGE = re.compile(LANGUAGE)
_SAFE_NAME = re.compile(SAFE_NAME)
SAFE_NAME_MAX_CHARS = 128  # what SAFE_NAME allows: one character and up to 127 more
# C0 and C1 controls and DEL, but tab, newline and carriage return.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_MAX_SHOWN_CODE_POINTS = 5

MAX_PROBLEM_LINES = 20
SCHEMA_COMMAND = "python -m worker schema"


# ---------------------------------------------------------------- the parsed job

_VALIDATED = object()  # the key Job.from_message holds: no other caller can make a Job


@dataclass(frozen=True, slots=True)
class Recording:
    url: RecordingUrl  # parsed once, in parse_job: the policy scoped this value and fetch gets it
    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.url, RecordingUrl):
            raise TypeError(f"Recording.url must be a parsed RecordingUrl, got {type(self.url).__name__}")


@dataclass(frozen=True, slots=True)
class Job:
    """A validated job: made only by ``Job.from_message`` from a ``JobMessage`` that pydantic validated
    (``parse_job``), so no Job can carry an unsafe path part. Built by hand, it is refused."""

    job_id: str
    profile_id: str
    directory_name: str
    recordings: tuple[Recording, ...]
    environment: str = DEFAULT_ENVIRONMENT
    language: str = DEFAULT_LANGUAGE
    doc: dict = field(default_factory=dict)
    body: dict = field(default_factory=dict)
    validated: InitVar[object] = None

    def __post_init__(self, validated: object) -> None:
        if validated is not _VALIDATED:
            raise ValueError("a Job is made only from a validated message (parse_job): its jobId, profileId "
                             "and metadata.directoryName must have passed the message's rules")

    @classmethod
    def from_message(cls, message: JobMessage, body: dict) -> Job:
        """The job of ``message``, which pydantic validated from ``body`` (kept whole, extras and all)."""
        return cls(
            job_id=message.job_id,
            profile_id=message.profile_id,
            environment=message.environment or DEFAULT_ENVIRONMENT,
            directory_name=message.metadata.directory_name,
            language=message.metadata.language or DEFAULT_LANGUAGE,
            recordings=tuple(Recording(url=r.recording_url, text=r.original_text) for r in message.input),
            doc=body["_doc"],  # the very object in the body kept with the job
            body=body,
            validated=_VALIDATED,
        )


# ---------------------------------------------------------------- the rules' words
# A refusal names the rule and echoes the value shortened and redacted (``show``). The name, choice
# and language rules are the model's constraints, and these functions only word their refusals
# (``is_safe_name`` also serves callers that check one name); ``text_problem`` is a rule of the model's.


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


# ---------------------------------------------------------------- the model's validators

# The error type of every refusal worded here; _problem_line prints its words as they are.
_RULE = "message_rule"


def _refusal(words: str) -> PydanticCustomError:
    return PydanticCustomError(_RULE, "{words}", {"words": words})


def _worded(words_for: Callable[[str], str | None]) -> WrapValidator:
    """pydantic's check of a string field (strict type and constraints), its refusal in our words.

    A value that is not a string is refused as such; a string that breaks a constraint (pattern,
    length, choice, or text pydantic cannot read: a lone surrogate) gets ``words_for(value)``.
    """

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            if not isinstance(value, str):
                # pydantic's own refusal for a str field; a Literal's (literal_error) is worded the same
                raise PydanticKnownError("string_type") from None
            if words := words_for(value):
                raise _refusal(words) from None
            raise

    return WrapValidator(check)


def _rule(problem_of: Callable[[str], str | None]) -> AfterValidator:
    """A rule no JSON Schema keyword says, checked once the value has passed the field's constraints."""

    def check(value: str) -> str:
        if problem := problem_of(value):
            raise _refusal(problem)
        return value

    return AfterValidator(check)


def _policy(info: ValidationInfo) -> InputPolicy:
    """The caller's input policy (``parse_job``'s validation context); without one, the shape only."""
    return (info.context or {}).get("policy", SHAPE_ONLY)


def _parsed_url(value: Any) -> RecordingUrl:
    if not isinstance(value, str):
        raise PydanticKnownError("string_type")  # strict, as every field: JSON gives only str for a URL
    try:
        return parse_recording_url(value)
    except BadRecording as exc:
        raise _refusal(str(exc)) from None


def _in_scope(url: RecordingUrl, info: ValidationInfo) -> RecordingUrl:
    # After the parse, so the scope checks the value that is fetched, and only a URL that parsed.
    context = info.context or {}
    if problem := _policy(info).recording_url_problem(url, context.get("profile_id")):
        raise _refusal(problem)
    return url


def _language_supported(language: str, info: ValidationInfo) -> str:
    if problem := _policy(info).language_problem(language):
        raise _refusal(problem)
    return language


def _text_not_too_long(text: str, info: ValidationInfo) -> str:
    if problem := _policy(info).text_length_problem(text):
        raise _refusal(problem)
    return text


def _not_too_many(items: Any, info: ValidationInfo) -> Any:
    # Before the list's own validation: an over-long list is refused without validating each entry.
    if isinstance(items, list) and (problem := _policy(info).recordings_count_problem(len(items))):
        raise _refusal(problem)
    return items


# ---------------------------------------------------------------- the wire model

SafeName = Annotated[
    str,
    Field(min_length=1, max_length=SAFE_NAME_MAX_CHARS, pattern=f"^{SAFE_NAME}$"),
    _worded(name_problem),
]
Language = Annotated[str, Field(pattern=f"^{LANGUAGE}$"), _worded(language_problem)]
# The URL's JSON type is a string; its value is the parse: a str in, a RecordingUrl out.
ParsedRecordingUrl = Annotated[RecordingUrl, PlainValidator(_parsed_url, json_schema_input_type=str)]

_NAME_RULE = ("1-128 ASCII letters, digits, '.', '_' or '-', starting with a letter or digit (so never "
              "'.', '..' or a path).")


def _unwrapped(schema: JsonDict) -> None:
    """A model's description (its docstring) as a producer reads it: each paragraph one line."""
    if isinstance(description := schema.get("description"), str):
        schema["description"] = "\n\n".join(" ".join(part.split()) for part in description.split("\n\n"))


class _Wire(BaseModel):
    # Strict: a number is not a string, a list is not an object. Fields the model does not name are
    # allowed, and kept in the body stored with the job.
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra=_unwrapped)


class RecordingInput(_Wire):
    """One recording of the speaker and the words said in it."""

    model_config = ConfigDict(title="Recording")

    recording_url: Annotated[ParsedRecordingUrl, AfterValidator(_in_scope)] = Field(
        alias="recordingUrl", title="Recording URL",
        description=(
            "https://host[:port]/path[?query] (a presigned URL is fine; its query is never shown in an error) or "
            "s3://bucket/key. No whitespace, control characters, backslashes or user:password@; an https host "
            "is a DNS name or an IP address (IPv6 in brackets), the path is more than '/'; an s3 bucket is a "
            "valid bucket name, the key is not empty and has no '?' or '#'. An s3:// recording must be in the "
            "deployment's RECORDINGS_S3_BUCKET, under RECORDINGS_S3_KEY_PREFIX for this job's profileId "
            "(default recordings/{profileId}/), with no empty, '.' or '..' key segments."),
        examples=["s3://voice-recordings/recordings/665f1c2e9b1e8a0012ab34ce/1.wav"],
    )
    original_text: Annotated[
        str, Field(min_length=1), _worded(text_problem), _rule(text_problem), AfterValidator(_text_not_too_long)
    ] = Field(
        alias="originalText", title="Original text",
        description=(
            "What is said in the recording (the transcript the voice is trained on). Not empty, and not only "
            "whitespace and invisible format characters (Unicode Cf: zero-width spaces, joiners, BOM); no "
            "control characters other than tab, newline and carriage return; valid Unicode (no lone "
            "surrogate). At most MAX_TEXT_CHARS characters, a deployment setting (default 2000)."),
        examples=["Hello there."],
    )


class JobMetadata(_Wire):
    """The voice's directory and language."""

    model_config = ConfigDict(title="Metadata")

    directory_name: SafeName = Field(
        alias="directoryName", title="Directory name",
        description="The directory the voice's files are published under: " + _NAME_RULE,
        examples=["user-123-voice-1"],
    )
    language: Annotated[Language, AfterValidator(_language_supported)] | None = Field(
        default=None, title="Language",
        description=("The language of the recordings, a code like 'en', 'pt-BR' or 'zh_Hans': 2-3 letters, then "
                     "up to three '-' or '_' parts of 1-8 letters or digits. Absent or null: 'en'."),
        examples=["en"],
    )


class JobMessage(_Wire):
    """The body of one SQS message that asks the voice worker to train a voice from recordings.

    One JSON object, UTF-8, of at most 1 MiB (the most one SQS message carries). Types are strict: a
    number is never read as a string, nor an array as an object. Fields not named here are allowed
    and kept with the job. Numbers anywhere in the body must be finite: NaN, Infinity and numbers
    that overflow a double (1e999) are refused. A refused body gets one problem line per violation
    (at most 20), naming the field and the rule.
    """

    model_config = ConfigDict(title="Voice job message")

    doc: dict[str, Any] = Field(
        alias="_doc", title="Document",
        description="The job's document as its producer keeps it: any JSON object, kept with the job as it is.",
        examples=[{"_id": "665f1c2e9b1e8a0012ab34cd"}],
    )
    job_id: SafeName = Field(
        alias="jobId", title="Job id",
        description="The job's id, the key of its record and part of its files' paths: " + _NAME_RULE,
        examples=["665f1c2e9b1e8a0012ab34cd"],
    )
    profile_id: SafeName = Field(
        alias="profileId", title="Profile id",
        description=("The voice profile the job trains, part of its files' paths and of the s3:// scope of its "
                     "recordings: " + _NAME_RULE + " Must equal the job record's profileId when it has one."),
        examples=["665f1c2e9b1e8a0012ab34ce"],
    )
    environment: Annotated[Environment, _worded(environment_problem)] | None = Field(
        default=None, title="Environment",
        description="Which deployment stage the voice is for. Absent or null: 'production'.",
    )
    metadata: JobMetadata = Field(
        title="Metadata", description="Where the trained voice is published, and the language it speaks.")
    input: Annotated[list[RecordingInput], BeforeValidator(_not_too_many)] = Field(
        min_length=1, title="Recordings",
        description=("The recordings to train on, at least one and at most MAX_RECORDINGS_PER_JOB, a deployment "
                     "setting (default 500)."),
    )

    @field_validator("input", mode="wrap")
    @classmethod
    def _scoped_to_the_profile(cls, value: Any, handler: ValidatorFunctionWrapHandler,
                               info: ValidationInfo) -> Any:
        # The fields are validated in order: the profileId the recordings are scoped to is the one that
        # passed its rule, or none (the bucket and the key's segments are still checked without it).
        if info.context is not None:
            info.context["profile_id"] = info.data.get("profile_id")
        return handler(value)


def message_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``JobMessage``, as producers get it."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": (f"Generated from worker/voice/message.py by `{SCHEMA_COMMAND} > docs/job-message.schema.json`; "
                     "do not edit by hand. The worker also applies its deployment's input policy (the "
                     "s3:// scope, MAX_RECORDINGS_PER_JOB, MAX_TEXT_CHARS) and refuses bodies over "
                     f"{SQS_MAX_BODY_BYTES} bytes and numbers that are not finite."),
        **JobMessage.model_json_schema(),
    }


def message_schema_text() -> str:
    """What ``python -m worker schema`` prints, and docs/job-message.schema.json holds: the schema, indented
    (ASCII: the same bytes whatever the terminal's encoding)."""
    return json.dumps(message_schema(), indent=2) + "\n"


# ---------------------------------------------------------------- parsing


def parse_job(body: str | bytes, policy: InputPolicy = SHAPE_ONLY) -> Job:
    """The job in an SQS body, or ``InvalidMessage`` listing every violation, one line each.

    The worker passes ``Settings.input_policy()``; the default checks the shape and the body size
    only, for tools whose output the worker validates again.
    """
    raw = _load_json(body)
    if not isinstance(raw, dict):
        raise InvalidMessage(f"body: must be a JSON object, got {_json_type(raw)}")
    try:
        message = JobMessage.model_validate(raw, context={"policy": policy})
    except ValidationError as exc:
        raise InvalidMessage(_problem_lines(exc)) from None
    return Job.from_message(message, raw)


def log_fields(message: Message) -> dict[str, str]:
    """``job_id`` for every log line of a message, from its receipt on (``Worker(log_fields=)``): the
    body's jobId when it is a safe name, else nothing. Never raises."""
    hint = job_id_hint(message.body)
    return {"job_id": hint} if hint else {}


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


def _problem_lines(exc: ValidationError) -> list[str]:
    lines = [_problem_line(err) for err in exc.errors(include_url=False)]
    if len(lines) > MAX_PROBLEM_LINES:
        extra = len(lines) - MAX_PROBLEM_LINES
        lines = lines[:MAX_PROBLEM_LINES] + [f"… and {extra} more problems"]
    return lines


def _problem_line(err: ErrorDetails) -> str:
    where, kind = _location(err["loc"]), err["type"]
    if kind == _RULE:
        return f"{where}: {err['ctx']['words']}"
    if kind in _TYPE_WORDING:
        return f"{where}: {_TYPE_WORDING[kind]}, got {_json_type(err.get('input'))}"
    if kind == "missing":
        return f"{where}: is required"
    if kind == "too_short":  # input: [] (min_length=1)
        return f"{where}: must not be empty"
    # No body the model knows reaches here; should one, it is still one line, in no pydantic words.
    return f"{where}: is not valid ({kind})"


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
