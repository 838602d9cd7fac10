"""The typed job and profile records (pydantic v2): what the stores' reads hand the worker and the
operator commands, and what the rules decide on.

The records live in MongoDB beside the product's backend, which writes them too, so a stored field may
hold anything. Each field's type here is an annotated type whose validator accepts exactly what the
worker would write there (a count is a whole number from 0, a time has a UTC form, ...) and says in
one line what else it found. A record is read field by field with those types (``read_job``,
``read_profile``): a field that validates is kept, typed; any other becomes ``None`` (or its empty
value) with a ``Problem`` naming the field. Reading never raises; what the worker does with the
problems is its own decision (``view.unworkable``: strict on the fields it decides on, a
``MalformedRecord`` before the claim), the operator commands show each as ``?`` and a warning.

Fields the models do not name (``quality``, ``baseModel``, ``idempotencyKey``, ...) pass through as
extra fields, and every record keeps the document it was read from (``document``): writes are made on
stored documents inside the stores' swaps (``transitions``), never from a model, so a read narrows
nothing another writer or a newer worker stored. A record is also a read-only mapping over that
document, the shape the stores returned before the models, so callers that inspect the stored values
(tests, the JSON output of ``status``) keep reading them as stored.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, cast, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError

from pipeline.config import ARTIFACT_KEY
from worker.core.names import is_sha256_hex

PENDING, PROCESSING, COMPLETED, ERROR, CANCELLED = (
    "pending", "processing", "completed", "error", "cancelled")
# A job whose trained models fell below the quality gate: final, nothing committed (mark_refused).
REFUSED = "refused"
JOB_STATUSES = (PENDING, PROCESSING, COMPLETED, ERROR, CANCELLED, REFUSED)
PROFILE_STATUSES = (PENDING, PROCESSING, COMPLETED)
RECORD = "(the record)"  # a Problem's field when the document itself is not one
# Beyond any record the worker writes; deeper nesting is not searched for unwritable times.
_MAX_DEPTH = 32
_MAX_COUNT = 2**31
_MAX_SECONDS = 1e12  # some 30,000 years: a larger GPU time is no measurement
_SHOWN_CHARS = 40


@dataclass(frozen=True)
class Problem:
    """One field of a record that does not hold what the worker would have written there."""

    field: str  # "attempts", "progress.percent", "history[2].start", or RECORD
    what: str
    # A time no store can write back (outside the years 1-9999 once in UTC): every write of the
    # record would fail, so the worker cannot even record an error on it.
    unwritable: bool = False

    def __str__(self) -> str:
        return f"{self.field}: {self.what}"


class Unwritable(ValueError):
    """A time with no UTC form: a validation error that also marks the Problem ``unwritable``."""


# ---------------------------------------------------------------- the field types
# Each validator gets the stored value (None for a missing field) and returns the typed value or
# raises ValueError with what it found; pydantic then only confirms the type it returned.

def _text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{shown(value)}, not text")


def _required_text(value: object) -> str:
    if value is None:
        raise ValueError("missing")
    return _text(value)  # type: ignore[return-value]  # not None: checked above


def _ident(value: object) -> str | None:
    # A whole number is a usable id too (another writer's choice), never a flag or a fraction.
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**64:
        return str(value)
    return _text(value)


def _required_ident(value: object) -> str:
    if value is None:
        raise ValueError("missing")
    return _ident(value)  # type: ignore[return-value]  # not None: checked above


def _count(value: object) -> int:
    # Absent or null on records made before the field: none yet, as the rules read it.
    if value is None:
        return 0
    # A whole float is what a JavaScript writer's number can come back as.
    if (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < _MAX_COUNT
            and float(value).is_integer()):
        return int(value)
    raise ValueError(f"{shown(value)}, not a count (a whole number from 0)")


def _seconds_or_none(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < _MAX_SECONDS:
        return float(value)
    raise ValueError(f"{shown(value)}, not a number of seconds")


def _seconds(value: object) -> float:
    # The job's totals: a record written before them holds none, read as no time.
    read = _seconds_or_none(value)
    return 0.0 if read is None else read


def _percent(value: object) -> float:
    if value is None:
        raise ValueError("missing")
    # NaN fails the comparison, so it is refused with the rest.
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 100:
        return float(value)
    raise ValueError(f"{shown(value)}, not a percentage (0-100)")


def _percent_or_none(value: object) -> float | None:
    return None if value is None else _percent(value)


def _count_or_none(value: object) -> int | None:
    return None if value is None else _count(value)


def _latest(value: object) -> dict[str, float]:
    # Never a problem: only (name, finite number) pairs are shown; the series are the record of a run.
    if not isinstance(value, dict):
        return {}
    return {name: float(v) for name, v in value.items()
            if isinstance(name, str) and isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v)}


def _flag(value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    # "false" as text would read as true: not guessed at.
    raise ValueError(f"{shown(value)}, not true or false")


def _false_unless_set(value: object) -> bool:
    return bool(_flag(value))


def _time(value: object) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise ValueError(f"{shown(value)}, not a time")
    moment = in_utc(value)
    if moment is None:
        raise Unwritable(f"{shown(value)}, outside the years 1-9999 in UTC")
    return moment


def _required_time(value: object) -> datetime:
    if value is None:
        raise ValueError("missing")
    return _time(value)  # type: ignore[return-value]  # not None: checked above


def _status(allowed: tuple[str, ...]):
    def status(value: object) -> str:
        if isinstance(value, str) and value in allowed:
            return value
        raise ValueError(f"{shown(value)}, not one of {', '.join(allowed)}")
    return status


def _artifact_keys(value: object) -> tuple[str, ...] | None:
    # Never a problem: a value another writer left that is no list of names reads as none recorded,
    # and the job is judged against the required set (``rules.committed_artifacts``).
    if (isinstance(value, list) and value
            and all(isinstance(key, str) and ARTIFACT_KEY.fullmatch(key) for key in value)):
        return tuple(value)
    return None


def _attempt_number(value: object) -> int | None:
    # Never a problem: an entry without a usable number (written before numbers) vouches for nothing.
    return value if type(value) is int and value >= 1 else None


def _mirror(value: object) -> dict[str, str]:
    # Never a problem: only well-formed (item, SHA-256) pairs vouch for anything (``rules.vouched_mirrors``).
    if not isinstance(value, dict):
        return {}
    return {item: digest for item, digest in value.items() if isinstance(item, str) and is_sha256_hex(digest)}


Text = Annotated[str | None, BeforeValidator(_text)]
RequiredText = Annotated[str | None, BeforeValidator(_required_text)]
Ident = Annotated[str | None, BeforeValidator(_ident)]
RequiredIdent = Annotated[str | None, BeforeValidator(_required_ident)]
Count = Annotated[int | None, BeforeValidator(_count)]
Seconds = Annotated[float | None, BeforeValidator(_seconds)]
SomeSeconds = Annotated[float | None, BeforeValidator(_seconds_or_none)]
Percent = Annotated[float | None, BeforeValidator(_percent)]
SomePercent = Annotated[float | None, BeforeValidator(_percent_or_none)]
SomeCount = Annotated[int | None, BeforeValidator(_count_or_none)]
Latest = Annotated[dict[str, float], BeforeValidator(_latest)]
Flag = Annotated[bool | None, BeforeValidator(_flag)]
FalseUnlessSet = Annotated[bool | None, BeforeValidator(_false_unless_set)]
Time = Annotated[datetime | None, BeforeValidator(_time)]
RequiredTime = Annotated[datetime | None, BeforeValidator(_required_time)]
JobStatus = Annotated[str | None, BeforeValidator(_status(JOB_STATUSES))]
ProfileStatus = Annotated[str | None, BeforeValidator(_status(PROFILE_STATUSES))]
ArtifactKeys = Annotated[tuple[str, ...] | None, BeforeValidator(_artifact_keys)]
AttemptNumber = Annotated[int | None, BeforeValidator(_attempt_number)]
Mirror = Annotated[dict[str, str], BeforeValidator(_mirror)]


class _EntryByEntry:
    """Marks a mapping read entry by entry (``_read_paths``): the valid ones kept, each other a problem."""


# A mapping of artifact key to path.
Paths = Annotated[dict[str, str], _EntryByEntry()]


# ---------------------------------------------------------------- the models

class Part(BaseModel):
    """A document inside a record (or a record): camelCase aliases as stored, unknown fields kept."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)


class Lease(Part):
    owner: Text = None
    token: Text = None
    expires_at: RequiredTime = Field(None, alias="expiresAt")
    message_id: Text = Field(None, alias="messageId")


class Progress(Part):
    stage: RequiredText = None
    percent: Percent = None
    updated_at: RequiredTime = Field(None, alias="updatedAt")
    # What ``ProgressReporter.detail`` adds (absent on an older worker's writes and the commit's own):
    step: SomeCount = None
    stage_index: SomeCount = Field(None, alias="stageIndex")  # 1-based, among stageCount steps
    stage_count: SomeCount = Field(None, alias="stageCount")
    stage_started_at: Time = Field(None, alias="stageStartedAt")
    overall_percent: SomePercent = Field(None, alias="overallPercent")
    eta_s: SomeSeconds = Field(None, alias="etaS")  # from updatedAt
    latest: Latest = Field(default_factory=dict)  # the latest value of each METRIC name


class DeadLetter(Part):
    """What the reconciler kept of a DLQ message it applied to the job (``ops.dlq``'s ``for_record``)."""

    message_id: Text = Field(None, alias="messageId")
    error_type: Text = Field(None, alias="errorType")
    error_message: Text = Field(None, alias="errorMessage")
    source_queue: Text = Field(None, alias="sourceQueue")


class RecordedError(Part):
    type: RequiredText = None
    message: Text = None
    # Absent: unknown (shown as ?), and not permanent to the handler, as it has always read it.
    retryable: Flag = None
    at: Time = None
    message_id: Text = Field(None, alias="messageId")
    dead_letter: DeadLetter | None = Field(None, alias="deadLetter")
    # The worker dead-lettered the message for spending the job's retries (rules.errored).
    retries_spent: Flag = Field(None, alias="retriesSpent")

    @property
    def dead_lettered(self) -> bool:
        """The reconciler recorded a DLQ message for the job (the field is there, whatever it holds)."""
        return "dead_letter" in self.model_fields_set


class Note(Part):
    stage: Text = None
    text: Text = None


class HistoryEntry(Part):
    """One attempt (or one thing the reconciler did) in the job's history."""

    worker: Text = None
    token: Text = None
    attempt: AttemptNumber = None
    start: Time = None
    end: Time = None
    outcome: Text = None
    gpu_seconds: SomeSeconds = Field(None, alias="gpuSeconds")
    mirror: Mirror = Field(default_factory=dict)
    notes: tuple[Note, ...] = ()  # what its stages noted (rules.with_note)
    device: Text = None  # what its trainer stages ran on (rules.with_device): cuda, cpu, or None (unknown)


class Record(Part):
    """A whole record: its problems, the document it was read from, and that document as a mapping."""

    _document: dict = PrivateAttr(default_factory=dict)
    _problems: tuple[Problem, ...] = PrivateAttr(default=())

    @property
    def problems(self) -> tuple[Problem, ...]:
        return self._problems

    @property
    def document(self) -> dict:
        """The stored document as read: every field, valid or not, known or not."""
        return self._document

    def invalid(self, name: str) -> bool:
        """Whether ``name`` (or anything inside it) was not valid: render it as ``?``."""
        return any(p.field == name or p.field.startswith((f"{name}.", f"{name}[")) for p in self._problems)

    # The mapping over the stored document: what a caller that inspects stored values reads.
    def __getitem__(self, key: str) -> Any:
        return self._document[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._document.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._document

    def keys(self):
        return self._document.keys()

    def items(self):
        return self._document.items()

    def values(self):
        return self._document.values()

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]  # a mapping's keys, not pydantic's pairs
        return iter(self._document)

    def __len__(self) -> int:
        return len(self._document)

    def __bool__(self) -> bool:
        return True  # a record read is there, whatever its document holds

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Record):
            return self._document == other._document
        if isinstance(other, Mapping):
            return self._document == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to its document, which is not hashable


class JobRecord(Record):
    # The status first: its problem is the first named, as the commands have always listed them.
    status: JobStatus = None
    id: RequiredIdent = Field(None, alias="_id")
    profile_id: Ident = Field(None, alias="profileId")
    attempts: Count = 0
    failed_attempts: Count = Field(0, alias="failedAttempts")
    lease: Lease | None = None
    progress: Progress | None = None
    error: RecordedError | None = None
    # None stands for an entry that is not a document: it still takes its number.
    history: tuple[HistoryEntry | None, ...] = ()
    cancel_requested: FalseUnlessSet = Field(False, alias="cancelRequested")
    created_at: Time = Field(None, alias="createdAt")
    started_at: Time = Field(None, alias="startedAt")
    completed_at: Time = Field(None, alias="completedAt")
    heartbeat_at: Time = Field(None, alias="heartbeatAt")
    earlier_gpu_seconds: Seconds = Field(0.0, alias="earlierGpuSeconds")
    earlier_wasted_gpu_seconds: Seconds = Field(0.0, alias="earlierWastedGpuSeconds")
    artifacts: ArtifactKeys = None  # the keys its commit wrote (rules.ARTIFACTS)

    def usage(self) -> dict[str, float]:
        """GPU-seconds of the job's attempts: in all, and of those that ended without committing (wasted;
        an attempt still running is neither yet), with the attempt count (``rules.usage``). A field that
        did not read counts as none (a record written before these fields, or edited by hand)."""
        total = self.earlier_gpu_seconds or 0.0
        wasted = self.earlier_wasted_gpu_seconds or 0.0
        for entry in self.history:
            seconds = (entry.gpu_seconds if entry is not None else None) or 0.0
            total += seconds
            if entry is not None and entry.outcome not in ("completed", "running"):
                wasted += seconds
        return {"attempts": self.attempts or 0, "gpuSeconds": round(total, 3), "wastedGpuSeconds": round(wasted, 3)}

    def trainer_device(self) -> str:
        """What the job's trainer time was spent on: "cuda" once any attempt's stages ran on one (its
        seconds are GPU-seconds), else "cpu" (a CPU host, or a record that does not say)."""
        return "cuda" if any(entry is not None and entry.device == "cuda" for entry in self.history) else "cpu"

    def cost(self) -> dict[str, Any]:
        """``usage`` with the failed attempts, as the commands show it: unreadable counts are None."""
        return {**self.usage(), "attempts": self.attempts, "failedAttempts": self.failed_attempts}


class ProfileRecord(Record):
    status: ProfileStatus = None
    id: RequiredIdent = Field(None, alias="_id")
    job_id: Ident = Field(None, alias="jobId")
    model_paths: Paths = Field(default_factory=dict, alias="modelPaths")  # the entries that are paths
    s3_paths: Paths = Field(default_factory=dict, alias="s3Paths")
    updated_at: Time = Field(None, alias="updatedAt")


# ---------------------------------------------------------------- reading

R = TypeVar("R", bound=Record)
P = TypeVar("P", bound=Part)


def read_job(doc: object) -> JobRecord:
    """Any value as a job record, each invalid field None with its Problem. Never raises."""
    return _read_record(JobRecord, doc, blank={"status": None, "attempts": None, "failed_attempts": None})


def read_profile(doc: object) -> ProfileRecord:
    """Any value as a profile record, each invalid field None (or empty) with its Problem. Never raises."""
    return _read_record(ProfileRecord, doc, blank={})


def _read_record(model: type[R], doc: object, *, blank: dict[str, Any]) -> R:
    if isinstance(doc, Record):
        doc = doc.document
    problems: list[Problem] = []
    try:
        if not isinstance(doc, dict):
            problems.append(Problem(RECORD, f"{shown(doc)}, not a document"))
            record = model.model_construct(**blank)
        else:
            record = _read_part(model, doc, "", problems)
            reported = {p.field for p in problems}
            problems += [Problem(name, f"{shown(moment)}, outside the years 1-9999 in UTC", unwritable=True)
                         for name, moment in _times(doc, "", 0) if name not in reported and in_utc(moment) is None]
    except Exception as exc:  # noqa: BLE001 - a reader's bug must not make a record unshowable
        problems.append(Problem(RECORD, f"could not be read ({type(exc).__name__})"))
        record = model.model_construct(**blank)
    record._document = doc if isinstance(doc, dict) else {}
    record._problems = tuple(problems)
    return cast(R, record)


def _read_part(model: type[P], doc: dict, path: str, problems: list[Problem]) -> P:
    """``doc`` as ``model``: each field validated on its own, so one bad field costs only itself."""
    values: dict[str, Any] = {}
    present: set[str] = set()
    for name, info in model.model_fields.items():
        key = info.alias or name
        where = f"{path}.{key}" if path else key
        if key in doc:
            present.add(name)
        values[name] = _read_field(model, name, doc.get(key), where, problems)
    known = {info.alias or name for name, info in model.model_fields.items()} | set(model.model_fields)
    extra = {key: value for key, value in doc.items() if isinstance(key, str) and key not in known}
    return cast(P, model.model_construct(_fields_set=present, **values, **extra))


def _read_field(model: type[Part], name: str, value: object, where: str, problems: list[Problem]) -> Any:
    annotation = model.model_fields[name].annotation
    part = _part_of(annotation)
    if part is not None:
        return _read_document(part, value, where, problems)
    if get_origin(annotation) is tuple:
        (item, _dots) = get_args(annotation)
        return _read_list(item, value, where, problems)
    if any(isinstance(mark, _EntryByEntry) for mark in model.model_fields[name].metadata):
        return _read_paths(value, where, problems)
    try:
        return _adapter(model, name).validate_python(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        cause = (error.get("ctx") or {}).get("error")
        what = str(cause) if isinstance(cause, Exception) else error["msg"]
        problems.append(Problem(where, what, unwritable=isinstance(cause, Unwritable)))
        return None


@functools.cache
def _adapter(model: type[Part], name: str) -> TypeAdapter:
    """The field's own type (with its validator) as pydantic validates it, built once."""
    return TypeAdapter(model.model_fields[name].rebuild_annotation())


def _part_of(annotation: Any) -> type[Part] | None:
    """The Part a ``Part | None`` annotation names, else None."""
    if isinstance(annotation, type) and issubclass(annotation, Part):
        return annotation
    if get_origin(annotation) in (Union, UnionType):
        parts = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, Part)]
        return parts[0] if len(parts) == 1 else None
    return None


def _read_document(part: type[Part], value: object, where: str, problems: list[Problem]) -> Part | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.append(Problem(where, f"{shown(value)}, not a document"))
        return None
    return _read_part(part, value, where, problems)


def _read_list(item: Any, value: object, where: str, problems: list[Problem]) -> tuple:
    """A list of documents. Where the item type admits None (the history), an entry that is no document
    keeps its place as None; elsewhere (notes) it is left out."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        problems.append(Problem(where, f"{shown(value)}, not a list"))
        return ()
    part = _part_of(item)
    assert part is not None, f"a list field of {item} is no list of documents"
    keeps_place = item is not part
    entries = []
    for number, entry in enumerate(value):
        name = f"{where}[{number}]"
        if entry is None and keeps_place:
            problems.append(Problem(name, "null, not a document"))
        read = _read_document(part, entry, name, problems)
        if read is not None or keeps_place:
            entries.append(read)
    return tuple(entries)


def _read_paths(value: object, where: str, problems: list[Problem]) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(Problem(where, f"{shown(value)}, not a document"))
        return {}
    kept = {}
    for key, path in value.items():
        if isinstance(key, str) and isinstance(path, str):
            kept[key] = path
        elif path is not None:
            problems.append(Problem(f"{where}.{key}", f"{shown(path)}, not a path"))
    return kept


def _times(value: object, path: str, depth: int) -> Iterator[tuple[str, datetime]]:
    """(path, datetime) of each time inside ``value``, down to _MAX_DEPTH."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(value, datetime):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _times(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(value, list | tuple):
        for number, item in enumerate(value):
            yield from _times(item, f"{path}[{number}]", depth + 1)


def in_utc(moment: datetime) -> datetime | None:
    """``moment`` as aware UTC (a naive one is UTC already, as BSON means it), or None when it has
    no UTC form: year 1 at +05:00 is year 0 in UTC."""
    try:
        if moment.utcoffset() is None:
            return moment.replace(tzinfo=UTC)
        return moment.astimezone(UTC)
    except Exception:  # noqa: BLE001 - OverflowError for year 0, and whatever an odd tzinfo raises
        return None


def shown(value: object) -> str:
    """A short, safe account of a stored value for a problem's text: its kind, and the value when short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a flag ({str(value).lower()})"
    if isinstance(value, str):
        cut = value[:_SHOWN_CHARS]
        return f"text ({cut!r}{'…' if len(value) > _SHOWN_CHARS else ''})"
    if isinstance(value, int):
        # Python refuses to print an integer of more than 4,300 digits: only its size then.
        return f"a number ({value})" if value.bit_length() <= 64 else f"a number of {value.bit_length()} bits"
    if isinstance(value, float):
        return f"a number ({value!r})"
    if isinstance(value, datetime):
        return f"a time ({value.isoformat()})"
    if isinstance(value, dict):
        return f"a document of {len(value)} field(s)"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}"
    return f"a {type(value).__name__}"

